"""FLOP counts for MFU: one drafter training step and the target's capture forward; nominal GPU peaks.

One formula for everything that reports MFU (the trainer's metrics, ``bench/drafter_step.py``,
``bench/target_capture.py``); docs/benchmarks.md ("Drafter step FLOPs") explains each term. Model FLOPs count
2 per multiply-add, trainable matmuls x3 (forward, input grad, weight grad), attention over *visible* (query,
key) pairs only, and the frozen lm_head x2 (forward + input grad).
"""

from __future__ import annotations

from typing import Iterable, Optional

__all__ = ["NOMINAL_BF16_TFLOPS", "nominal_peak_tflops", "drafter_step_flops", "attention_flops_per_pair",
           "target_forward_flops"]

# Dense bf16 tensor-core peaks from the vendors' data sheets (TFLOP/s), matched as substrings of the device name
NOMINAL_BF16_TFLOPS = (("H200", 989.4), ("H100 SXM", 989.4), ("H100 80GB HBM3", 989.4), ("H100 PCIe", 756.0),
                       ("H100", 989.4), ("H20", 148.0), ("A100", 312.0), ("L40S", 362.0), ("B200", 2250.0))


def nominal_peak_tflops(device) -> Optional[float]:
    """The vendor's dense bf16 peak of a CUDA device, or None (CPU, unknown GPU)."""
    import torch
    device = torch.device(device)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, val in NOMINAL_BF16_TFLOPS:
        if key in name:
            return val
    return None


def attention_flops_per_pair(mc, train: bool = True) -> float:
    """FLOPs per visible (query, key) pair over all heads and layers: QK^T (2d) + PV (2d) per query head, x3.5
    with the backward (which costs 2.5x the forward)."""
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
