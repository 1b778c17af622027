"""``dflash-doctor``'s kernel checks: flash-linear-attention and causal-conv1d (a hybrid target's fast path) and
flex_attention on a DFlash mask, each run on a small input against its PyTorch reference. ``doc``: the
``cli.doctor.Doctor`` its rows go to."""

from __future__ import annotations

import time
import warnings
from typing import Optional

PASS, WARN, FAIL, NA = "PASS", "WARN", "FAIL", "N/A"  # dflash-doctor's row statuses


def _version(mod: str) -> Optional[str]:
    try:
        from importlib.metadata import version
        return version(mod)
    except Exception:
        return None


def _target_needs_kernels(doc) -> bool:
    """True when the configured target is hybrid and its fast-path policy requires the kernels on CUDA."""
    if doc.cfg is None or doc.hf_config is None:
        return False
    from dflash_dist.targets.fast_path import check_fast_path_for_config, resolve_policy
    if resolve_policy(doc.cfg.target.fast_path, "cuda") != "require":
        return False
    try:
        return check_fast_path_for_config(doc.hf_config, "allow", "cuda")["hybrid"]
    except Exception:
        return False


def _rel_err(a, b) -> float:
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-6))


def _kernel_missing(doc, name: str, how: str, optional_note: str, cpu_note: str) -> None:
    """A hybrid-target kernel package that does not import: FAIL on a GPU when the configured target needs it,
    WARN on a GPU otherwise, not applicable on CPU."""
    import torch
    if not torch.cuda.is_available():
        doc.add(name, NA, cpu_note)
        return
    need = _target_needs_kernels(doc)
    doc.add(name, FAIL if need else WARN,
            how + (" -- the configured hybrid target requires it (target.fast_path)" if need else optional_note))


def check_fla(doc) -> None:
    import torch
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        ver = _version("flash-linear-attention") or _version("fla") or "?"
    except Exception as e:
        _kernel_missing(doc, "flash-linear-attention", f"not importable ({type(e).__name__}): "
                        "`pip install flash-linear-attention`", " (needed only for hybrid GatedDeltaNet targets)",
                        "not installed (GPU only; CPU hybrid targets use the PyTorch path)")
        return
    if not torch.cuda.is_available():
        doc.add("flash-linear-attention", WARN, f"{ver} installed on a CPU machine: transformers binds its Triton "
                                                "kernels even on CPU and hybrid forwards fail there")
        return
    import torch.nn.functional as F
    dev = torch.device("cuda", 0)
    g0 = torch.Generator(device=dev).manual_seed(0)
    B, T, H, D = 1, 256, 2, 64
    q, k, v = (torch.randn(B, T, H, D, device=dev, generator=g0, dtype=torch.bfloat16) for _ in range(3))
    g = F.logsigmoid(torch.randn(B, T, H, device=dev, generator=g0)).float()
    beta = torch.rand(B, T, H, device=dev, generator=g0).to(torch.bfloat16)
    o, _ = chunk_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=None, output_final_state=False,
                                  use_qk_l2norm_in_kernel=True)
    torch.cuda.synchronize()
    if not torch.isfinite(o).all():
        doc.add("flash-linear-attention", FAIL, f"{ver}: chunk_gated_delta_rule returned non-finite values")
        return
    ref_fn = None
    try:
        from transformers.models.qwen3_next import modeling_qwen3_next as mq
        ref_fn = getattr(mq.torch_chunk_gated_delta_rule, "__wrapped__", mq.torch_chunk_gated_delta_rule)
    except Exception:
        pass
    detail = f"{ver}: chunk_gated_delta_rule ran on {tuple(q.shape)} bf16"
    status = PASS
    if ref_fn is not None and getattr(ref_fn, "__module__", "").startswith("transformers"):
        ref, _ = ref_fn(q.float(), k.float(), v.float(), g=g, beta=beta.float(), initial_state=None,
                        output_final_state=False, use_qk_l2norm_in_kernel=True)
        err = _rel_err(o, ref)
        detail += f", max rel. error vs transformers' PyTorch reference {err:.2e}"
        status = PASS if err < 5e-2 else WARN
    doc.add("flash-linear-attention", status, detail)


def check_causal_conv1d(doc) -> None:
    import torch
    try:
        from causal_conv1d import causal_conv1d_fn
        ver = _version("causal-conv1d") or _version("causal_conv1d") or "?"
    except Exception as e:
        _kernel_missing(doc, "causal-conv1d", f"not importable ({type(e).__name__}: {str(e)[:80]}): build it against "
                        "this torch (source-only: docker/ builds it for one GPU architecture; or pip install causal-conv1d "
                        "--no-build-isolation)", "",
                        "not installed (GPU only)")
        return
    if not torch.cuda.is_available():
        doc.add("causal-conv1d", NA, f"{ver} importable; its CUDA kernel cannot run without a GPU")
        return
    import torch.nn.functional as F
    dev = torch.device("cuda", 0)
    g0 = torch.Generator(device=dev).manual_seed(0)
    Bn, Dn, T, W = 2, 64, 128, 4
    x = torch.randn(Bn, Dn, T, device=dev, generator=g0, dtype=torch.bfloat16)
    w = torch.randn(Dn, W, device=dev, generator=g0, dtype=torch.bfloat16)
    out = causal_conv1d_fn(x, w, None, activation="silu")
    ref = F.silu(F.conv1d(x.float(), w.float()[:, None], padding=W - 1, groups=Dn)[..., :T])
    torch.cuda.synchronize()
    err = _rel_err(out, ref)
    doc.add("causal-conv1d", PASS if err < 2e-2 else FAIL,
            f"{ver}: causal_conv1d_fn ran on {tuple(x.shape)} bf16, max rel. error vs F.conv1d {err:.2e}")


def check_flex(doc) -> None:
    import torch

    from dflash_dist.roles.drafter_rank.compile_guard import FLEX_EAGER_WARNING_RE
    from dflash_dist.model.drafter import flex_attention_compiled
    from dflash_dist.model.masks import dense_mask, flex_block_mask
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    gen = torch.Generator().manual_seed(0)
    if cuda:
        b, n, bs, ctx, heads, kv, d = 2, 8, 16, 256, 4, 2, 64
    else:  # tiny: the CPU compile dominates
        b, n, bs, ctx, heads, kv, d = 2, 2, 4, 16, 2, 1, 16
    q_len, k_len = n * bs, ctx + n * bs
    anchors = torch.sort(torch.randint(0, ctx - bs, (b, n), generator=gen), dim=1).values
    valid = torch.ones(b, n, dtype=torch.bool)
    valid[1, n // 2:] = False                                   # padding blocks see nothing -> output 0
    anchors[~valid] = 0
    anchors, valid = anchors.to(dev), valid.to(dev)
    q = torch.randn(b, heads, q_len, d, generator=gen).to(dev)
    k = torch.randn(b, kv, k_len, d, generator=gen).to(dev)
    v = torch.randn(b, kv, k_len, d, generator=gen).to(dev)
    if cuda:
        for t in (q, k, v):
            t.requires_grad_(True)
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=FLEX_EAGER_WARNING_RE, category=UserWarning)
        bm = flex_block_mask(anchors, valid, ctx, bs)
        with torch.set_grad_enabled(cuda):
            out = flex_attention_compiled(q, k, v, block_mask=bm, scale=d ** -0.5, enable_gqa=True)
            if cuda:
                out.sum().backward()
    compile_s = time.perf_counter() - t0
    # dense reference (fp32)
    mask = dense_mask(anchors, valid, ctx, bs)[:, None]        # [b, 1, Q, K]
    qr, kr, vr = (t.detach().clone().requires_grad_(cuda) for t in (q, k, v))
    kr_e, vr_e = kr.repeat_interleave(heads // kv, 1), vr.repeat_interleave(heads // kv, 1)
    with torch.set_grad_enabled(cuda):
        s = (qr @ kr_e.transpose(-1, -2)) * d ** -0.5
        p = torch.softmax(s.masked_fill(~mask, float("-inf")), -1).nan_to_num(0.0)
        ref = p @ vr_e
        if cuda:
            ref.sum().backward()
    errs = {"out": float((out.detach() - ref.detach()).abs().max())}
    if cuda:
        for name, a, r in (("dq", q, qr), ("dk", k, kr), ("dv", v, vr)):
            errs[name] = float((a.grad - r.grad).abs().max())
    tol = 1e-2 if cuda else 1e-4   # GPU: room for TF32 matmuls; a wrong mask or dense fallback is off by O(0.1)
    ok = all(e < tol for e in errs.values())
    what = "forward+backward" if cuda else "forward only (no CPU backward)"
    doc.add("flex_attention", PASS if ok else FAIL,
            f"compiled {what} on a DFlash mask b={b} Q={q_len} K={k_len}: max abs err "
            + ", ".join(f"{k_}={v_:.1e}" for k_, v_ in errs.items())
            + f" (tol {tol:g}); {compile_s:.1f} s incl. compile",
            errors=errs, compile_s=round(compile_s, 2))
