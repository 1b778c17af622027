"""FLOP counts for MFU: one drafter training step and the target's capture forward; nominal GPU peaks.

One formula for everything that reports MFU (the trainer's metrics, ``bench/drafter_step.py``,
``bench/target_capture.py``); docs/benchmarks.md ("Drafter step FLOPs") explains each term. Model FLOPs count
2 per multiply-add, trainable matmuls x3 (forward, input grad, weight grad), attention over *visible* (query,
key) pairs only, and the frozen lm_head x2 (forward + input grad).
"""

from __future__ import annotations

from typing import Iterable, Optional

__all__ = ["NOMINAL_BF16_TFLOPS", "NOMINAL_FP8_TFLOPS", "nominal_peak_tflops", "drafter_step_flops", "attention_flops_per_pair",
           "target_forward_flops", "target_layers_profile", "target_capture_flops", "causal_pairs"]

# Dense bf16 tensor-core peaks from the vendors' data sheets (TFLOP/s), matched as substrings of the device name
NOMINAL_BF16_TFLOPS = (("H200", 989.4), ("H100 SXM", 989.4), ("H100 80GB HBM3", 989.4), ("H100 PCIe", 756.0),
                       ("H100", 989.4), ("H20", 148.0), ("A100", 312.0), ("L40S", 362.0), ("B200", 2250.0))


# Dense FP8 (e4m3) tensor-core peaks, the same data sheets: 2x bf16 where the GPU has FP8 tensor cores (no A100)
NOMINAL_FP8_TFLOPS = (("H200", 1978.9), ("H100 SXM", 1978.9), ("H100 80GB HBM3", 1978.9), ("H100 PCIe", 1513.0),
                      ("H100", 1978.9), ("H20", 296.0), ("L40S", 733.0), ("B200", 4500.0))


def nominal_peak_tflops(device, fp8: bool = False) -> Optional[float]:
    """The vendor's dense bf16 (``fp8``: FP8) peak of a CUDA device, or None (CPU, unknown GPU, no FP8 cores)."""
    import torch
    device = torch.device(device)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, val in (NOMINAL_FP8_TFLOPS if fp8 else NOMINAL_BF16_TFLOPS):
        if key in name:
            return val
    return None


def attention_flops_per_pair(mc, train: bool = True) -> float:
    """FLOPs per visible (query, key) pair over all heads and layers: QK^T (2d) + PV (2d) per query head, x3.5
    with the backward (counted as 2.5 forwards: docs/benchmarks.md#flop-accounting)."""
    return 4.0 * mc.head_dim * mc.num_attention_heads * mc.num_layers * (3.5 if train else 1.0)


def drafter_step_flops(mc, b: int, s_pad: int, n_blocks: int, vocab: int, visible_pairs: float,
                       train: bool = True, recompute_head: bool = False) -> dict:
    """Model FLOPs of one drafter step (``mc``: drafter.DrafterModelConfig).

    b samples, context padded to s_pad, n_blocks blocks of B slots per sample (Q = n_blocks*B query rows per
    sample, padding blocks included: their rows run through every matmul), ``visible_pairs`` = sum over valid
    blocks of B * (anchor + B) (a query sees the anchor's context keys j < a and its own block's B keys).
    ``recompute_head``: the checkpointed loss runs the lm_head forward again in backward (hardware FLOPs only)."""
    H, nh, nkv, d = mc.hidden_size, mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim
    I, L, nf, B = mc.intermediate_size, mc.num_layers, mc.num_feature_layers, mc.block_size
    rows_q = b * n_blocks * B
    rows_c = b * s_pad
    fc = 2 * rows_c * (nf * H) * H
    q = 2 * rows_q * H * (nh * d)
    kv = 2 * 2 * (rows_c + rows_q) * H * (nkv * d)     # k_proj and v_proj over [ctx | block] rows
    o = 2 * rows_q * (nh * d) * H
    mlp = 3 * 2 * rows_q * H * I
    layer = q + kv + o + mlp
    attn_fwd = 4 * d * nh * visible_pairs * L           # QK^T (2d) + PV (2d) per visible pair, head and layer
    lm_rows = b * n_blocks * (B - 1)                    # slot 0 never carries a loss: dropped before the head
    lm_fwd = 2 * lm_rows * H * vocab
    dense_attn_fwd = 4 * d * nh * rows_q * (s_pad + n_blocks * B) * L  # if every (query, key) pair were computed
    if train:
        mm = 2 * fc + 3 * L * layer                     # fc x2: its input, the target features, needs no grad
        attn = 3.5 * attn_fwd
        lm = 2 * lm_fwd
        lm_hw = (3 if recompute_head else 2) * lm_fwd
        dense_attn = 3.5 * dense_attn_fwd
    else:
        mm, attn, lm, lm_hw, dense_attn = fc + L * layer, attn_fwd, lm_fwd, lm_fwd, dense_attn_fwd
    model = mm + attn + lm
    return {"matmul": float(mm), "attention": float(attn), "lm_head": float(lm), "model": float(model),
            "hardware": float(mm + attn + lm_hw), "attention_if_dense": float(dense_attn),
            "rows_q": rows_q, "rows_ctx": rows_c, "lm_rows": lm_rows, "visible_pairs": float(visible_pairs)}


def target_forward_flops(tc, run_params: int, attention_layers_run: int, batches: Iterable[tuple[int, int]],
                         lm_head: bool = False) -> float:
    """Forward FLOPs of the target over padded batches [(b, S), ...]: 2 * (parameters of the decoder layers that
    run) per token, plus causal attention (4*d per pair and head, S*(S+1)/2 pairs per sequence) in the
    attention layers that run, plus the lm_head (full forward only). ``tc``: the HF text config."""
    d = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
    total = 0.0
    for b, s in batches:
        total += 2.0 * run_params * b * s
        total += attention_layers_run * 4.0 * d * tc.num_attention_heads * b * s * (s + 1) / 2
        if lm_head:
            total += 2.0 * b * s * tc.hidden_size * tc.vocab_size
    return total


def _is_experts(name: str, mod) -> bool:
    return type(mod).__name__.endswith("Experts") or (name.split(".")[-1] == "experts"
                                                      and type(mod).__name__ == "ModuleList")


def target_layers_profile(layers, tc) -> dict:
    """What the decoder layers that run compute per token, read off the built modules (``tc``: HF text config):

    * ``matmul_per_token``: 2 FLOPs per weight of every matmul a token goes through: all 2-D weights (attention
      or linear-attention projections, dense MLP, router, shared experts) and, of the routed experts' weights,
      the fraction ``top_k / num_experts`` a token uses (MoE: active experts only);
    * ``attention_windows``: one entry per softmax-attention layer, its sliding window or None (full causal);
    * ``linear_per_token``: the GatedDeltaNet recurrence per token (delta rule on a [d_k, d_v] state per value
      head: k^T S, the rank-1 update and q S, 2 FLOPs per multiply-add each: 6*d_k*d_v) and its causal conv1d
      (2 * kernel * channels), summed over the linear-attention layers.
    """
    top_k = int(getattr(tc, "num_experts_per_tok", None) or getattr(tc, "experts_per_token", None) or 0)
    dense = routed = 0.0
    windows, linear = [], 0.0
    for layer in layers:
        expert_params = set()
        for name, mod in layer.named_modules():
            if not _is_experts(name, mod):
                continue
            listed = type(mod).__name__ == "ModuleList"
            # fused experts: the 3-D [E, in, out] weights (their [E, out] biases are adds, not matmuls)
            params = [p for p in mod.parameters() if p.dim() >= (2 if listed else 3)]
            n_exp = len(mod) if listed else (params[0].shape[0] if params else 0)
            k = top_k or n_exp
            routed += sum(p.numel() for p in params) * (k / max(n_exp, 1))
            expert_params.update(id(p) for p in mod.parameters())
        dense += sum(p.numel() for p in layer.parameters() if p.dim() >= 2 and id(p) not in expert_params)
        # FP8 linears (targets/quant) hold their weights as 2-D buffers: the same matmuls
        dense += sum(b.numel() for n, b in layer.named_buffers() if b.dim() == 2 and n.endswith("weight"))
        attn = getattr(layer, "self_attn", None)
        if attn is not None:
            w = getattr(attn, "sliding_window", None)
            if w is None and getattr(tc, "sliding_window", None) and not getattr(tc, "layer_types", None) \
                    and getattr(tc, "use_sliding_window", True) is not False:
                w = tc.sliding_window  # Mistral: every layer slides
            windows.append(int(w) if w else None)
        la = getattr(layer, "linear_attn", None)
        if la is not None:
            hv = int(getattr(la, "num_v_heads", None) or tc.linear_num_value_heads)
            dk = int(getattr(la, "head_k_dim", None) or tc.linear_key_head_dim)
            dv = int(getattr(la, "head_v_dim", None) or tc.linear_value_head_dim)
            conv_dim = int(getattr(la, "conv_dim", 0) or 0)
            kernel = int(getattr(la, "conv_kernel_size", None) or getattr(tc, "linear_conv_kernel_dim", 4))
            linear += 6.0 * hv * dk * dv + 2.0 * kernel * conv_dim
    return {"matmul_per_token": 2.0 * (dense + routed), "attention_windows": windows, "linear_per_token": linear}


def causal_pairs(s: int, window: Optional[int] = None) -> float:
    """Visible (query, key) pairs of a causal sequence of s tokens; with a sliding window w (a query sees its
    last w keys, itself included: transformers' ``q - kv < w``): sum over i of min(i + 1, w)."""
    if window is None or window >= s:
        return s * (s + 1) / 2
    return window * (window + 1) / 2 + (s - window) * window


def target_capture_flops(profile: dict, tc, batches: Iterable[tuple[int, int]], lm_head: bool = False) -> float:
    """Forward FLOPs of the target's decoder layers of ``profile`` (``target_layers_profile``) over batches
    [(b, S), ...] as they run (padded: b rows of S; packed: (1, n) per sample): matmuls of the active weights,
    linear-attention recurrences, and softmax attention over the visible pairs of each layer (4*d per pair and
    head: QK^T and PV), plus the lm_head when asked (full forward)."""
    d = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
    per_pair = 4.0 * d * tc.num_attention_heads
    total = 0.0
    for b, s in batches:
        tokens = b * s
        total += (profile["matmul_per_token"] + profile["linear_per_token"]) * tokens
        total += per_pair * b * sum(causal_pairs(s, w) for w in profile["attention_windows"])
        if lm_head:
            total += 2.0 * tokens * tc.hidden_size * tc.vocab_size
    return total


def target_peak_tflops(cfg, hf_config, device) -> Optional[float]:
    """The peak the target's capture MFU is counted against: the bf16 peak (``logging.peak_tflops`` or the vendor
    figure), or for an FP8 target (``target.quantization=fp8`` or a pre-quantized checkpoint) the FP8 one (twice
    ``logging.peak_tflops`` when that is set: dense FP8 runs at 2x bf16 on every GPU with FP8 tensor cores)."""
    from dflash_dist.targets.quant import target_is_fp8
    fp8 = target_is_fp8(cfg.target, hf_config)
    if cfg.logging.peak_tflops:
        return cfg.logging.peak_tflops * (2 if fp8 else 1)
    return nominal_peak_tflops(device, fp8=fp8)
