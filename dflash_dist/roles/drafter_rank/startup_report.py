"""Startup report: one profiled training step that shows which attention path really ran.

Called once on a drafter rank after the warm-up (first) step::

    report = startup_report(lambda: trainer.train_step(batch), trainer.model,
                            {"b": b, "S_pad": s_pad, "Q": q, "first_step_s": t_first}, trainer.device)

It reports the attention backend, the kernels (CUDA) or aten ops (CPU) the step launched, the step's peak
memory next to what the dense attention fallback would need, the compile time of the first step and whether
it came from the inductor caches. On CUDA with the flex backend it *asserts* (``StartupCheckError``) that the
flex_attention forward and backward kernels of the configured family ran (inductor's Triton templates, or
FlashAttention-4's CuTe kernels with ``drafter.tuning.flex_kernel_options.BACKEND=FLASH``) and that no op formed
or consumed a dense [Q, K] score matrix (matmul/softmax on score-shaped operands); on CPU it reports what ran
without asserting.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import resource
import time
import traceback
import warnings
from collections import Counter
from typing import Any, Callable, Optional

import torch

from dflash_dist.roles.drafter_rank.compile_guard import dynamo_counters, graph_break_reasons

__all__ = ["startup_report", "format_startup_report", "StartupCheckError", "dense_attention_bytes",
           "flex_kernels", "flex_problems", "flex_kernel_family",
           "inductor_cache_dir", "FLEX_FWD_KERNEL", "FLEX_BWD_KERNEL", "FLASH_FWD_KERNEL", "FLASH_BWD_KERNEL"]

log = logging.getLogger("dflash_dist")

# Inductor names template kernels triton_tem_fused_<origin ops>_<n>; the flex HOPs' origins are
# flex_attention / flex_attention_backward (e.g. triton_tem_fused_flex_attention_0,
# triton_tem_fused_flex_attention_backward_2). flex_decoding is flex's small-Q forward variant.
FLEX_FWD_KERNEL = ("flex_attention", "flex_decoding")
FLEX_BWD_KERNEL = ("flex_attention_backward",)
# BACKEND "FLASH": FlashAttention-4's CuTe DSL kernels, which the DSL names after the kernel's class
# (kernel_cutlass_kernel_flash_attncuteflash_fwd_sm90FlashAttentionForwardSm90_object_at_..._0; the backward's
# FlashAttentionBackwardSm90 and its Preprocess / Postprocess kernels). Matched without case.
FLASH_FWD_KERNEL = ("flashattentionforward",)
FLASH_BWD_KERNEL = ("flashattentionbackward",)
_FAMILIES = {"TRITON": (FLEX_FWD_KERNEL, FLEX_BWD_KERNEL, "Triton flex_attention",
                        "triton_tem_fused_flex_attention_<n>", "triton_tem_fused_flex_attention_backward_<n>"),
             "FLASH": (FLASH_FWD_KERNEL, FLASH_BWD_KERNEL, "FlashAttention-4 (flex BACKEND FLASH)",
                       "kernel_cutlass_kernel_..FlashAttentionForwardSm90.._<n>",
                       "kernel_cutlass_kernel_..FlashAttentionBackwardSm90.._<n>")}
_MATMUL_OPS = {"aten::mm", "aten::bmm", "aten::matmul", "aten::baddbmm", "aten::addmm", "aten::einsum"}
_SOFTMAX_OPS = {"aten::softmax", "aten::_softmax", "aten::_safe_softmax", "aten::log_softmax",
                "aten::_log_softmax", "aten::exp", "aten::exp2", "aten::logsumexp", "aten::_softmax_backward_data"}
_ATTN_OP_WORDS = ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention", "flex")


class StartupCheckError(AssertionError):
    """The profiled step did not run the attention path the configuration promises."""


def inductor_cache_dir() -> dict:
    """Where inductor's on-disk caches live and whether the FX-graph / AOT-autograd caches are on."""
    import getpass
    import tempfile
    out: dict = {}
    try:
        user = getpass.getuser()
    except Exception:  # pragma: no cover
        user = "unknown"
    default = os.path.join(tempfile.gettempdir(), f"torchinductor_{user}")
    try:
        # note: torch exports TORCHINDUCTOR_CACHE_DIR itself the first time it resolves the directory
        from torch._inductor.runtime.cache_dir_utils import cache_dir
        out["dir"] = cache_dir()
    except Exception:  # pragma: no cover - older torch
        out["dir"] = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default
    out["default_location"] = os.path.abspath(out["dir"]) == os.path.abspath(default)
    try:
        import torch._inductor.config as ic
        out["fx_graph_cache"] = bool(ic.fx_graph_cache)
        out["fx_graph_remote_cache"] = getattr(ic, "fx_graph_remote_cache", None)
    except Exception:  # pragma: no cover
        pass
    try:
        import torch._functorch.config as fc
        out["autograd_cache"] = bool(getattr(fc, "enable_autograd_cache", False))
    except Exception:  # pragma: no cover
        pass
    return out


def dense_attention_bytes(b: int, heads: int, q_len: int, k_len: int, num_layers: int, dtype_bytes: int) -> dict:
    """What the dense fallback materialises: scores and probabilities [b, heads, Q, K] per layer; the
    probabilities of every layer stay alive for the backward."""
    one = int(b) * int(heads) * int(q_len) * int(k_len) * int(dtype_bytes)
    return {"scores_plus_probs_per_layer": 2 * one, "probs_all_layers_saved": one * int(num_layers),
            "total_estimate": one * int(num_layers) + one}


def _is_score_shape(shape, q_len: int, k_len: int, min_dims: int = 3, lead: Optional[set] = None) -> bool:
    """``min_dims``: a multi-head score matrix carries a (batch x) head dimension, so 3 by default. A 2-D
    [tokens, features] operand can have a [Q, K] shape by coincidence: 64 anchors x 16 = 1,024 queries over
    512 + 1,024 keys against a [1,536, 1,024] k_proj of a model whose kv width is 1,024. ``lead``: the
    products of the leading dimensions a score matrix can have (heads, b x heads): a [b, S+Q, H] activation
    whose hidden size equals the queries of a micro-batch (drafter.tuning.micro_batches) has [K, Q]'s last two."""
    if not (isinstance(shape, (list, tuple)) and len(shape) >= min_dims
            and tuple(shape[-2:]) in ((q_len, k_len), (k_len, q_len))):
        return False
    return lead is None or math.prod(shape[:-2]) in lead


def _forms_scores(shapes, q_len: int, k_len: int, min_dims: int = 3, lead: Optional[set] = None) -> bool:
    """A matmul [.., Q, x] @ [.., x, K] (or transposed) produces a score matrix without any input having it."""
    mats = [s for s in shapes if isinstance(s, (list, tuple)) and len(s) >= min_dims
            and (lead is None or math.prod(s[:-2]) in lead)]
    for a in mats:
        for c in mats:
            if a is c:
                continue
            if a[-2] == q_len and c[-1] == k_len and a[-1] == c[-2]:
                return True
    return False


def _scan_events(events, q_len: int, k_len: int, cuda: bool, min_dims: int = 3, lead: Optional[set] = None) -> dict:
    kernels: Counter = Counter()
    cpu_ops: Counter = Counter()
    attn_ops: Counter = Counter()
    dense: list = []
    dev_cuda = getattr(torch.autograd, "DeviceType", None)
    for e in events:
        name = e.name
        is_kernel = cuda and dev_cuda is not None and getattr(e, "device_type", None) == dev_cuda.CUDA
        if is_kernel:
            kernels[name] += 1
            continue
        if not name.startswith("aten::"):
            continue
        cpu_ops[name] += 1
        if any(w in name for w in _ATTN_OP_WORDS):
            attn_ops[name] += 1
        shapes = getattr(e, "input_shapes", None) or []
        if name in _MATMUL_OPS and (any(_is_score_shape(s, q_len, k_len, min_dims, lead) for s in shapes)
                                    or _forms_scores(shapes, q_len, k_len, min_dims, lead)):
            dense.append({"op": name, "kind": "matmul", "shapes": [list(s) for s in shapes if s]})
        elif name in _SOFTMAX_OPS and any(_is_score_shape(s, q_len, k_len, min_dims, lead) for s in shapes):
            dense.append({"op": name, "kind": "softmax", "shapes": [list(s) for s in shapes if s]})
    return {"kernels": kernels, "cpu_ops": cpu_ops, "attn_ops": attn_ops, "dense": dense}


def flex_kernel_family(model: torch.nn.Module) -> str:
    """"FLASH" when the drafter's flex_attention calls ask for FlashAttention-4's kernels
    (``drafter.tuning.flex_kernel_options.BACKEND``), else "TRITON" (inductor's templates: AUTO, TRITON, unset)."""
    m = getattr(model, "module", model)
    opts = getattr(m, "flex_kernel_options", None) or {}
    return "FLASH" if str(opts.get("BACKEND", "")).upper() == "FLASH" else "TRITON"


def flex_kernels(kernels: dict, family: str = "TRITON") -> tuple[dict, dict]:
    """(forward, backward) flex_attention kernels of ``family`` ("TRITON" or "FLASH") among {kernel name:
    launches}."""
    fwd_pats, bwd_pats = _FAMILIES[family][:2]

    def hit(name: str, pats) -> bool:
        low = name.lower()
        return any(p in low for p in pats)

    fwd = {k: n for k, n in kernels.items() if hit(k, fwd_pats) and not hit(k, bwd_pats)}
    bwd = {k: n for k, n in kernels.items() if hit(k, bwd_pats)}
    return fwd, bwd


def flex_problems(backend: str, fwd: dict, bwd: dict, dense: list, calls: dict, layers: int, q_len: int,
                  k_len: int, family: str = "TRITON", kernels: Optional[dict] = None) -> list[str]:
    """What is wrong with a CUDA training step of the flex backend (empty: the compiled flex path of ``family``
    ran). ``kernels``: every kernel of the step, to name the other family's if those ran instead."""
    problems: list[str] = []
    if backend != "flex":
        return problems
    what, fwd_like, bwd_like = _FAMILIES[family][2:]
    other = "FLASH" if family == "TRITON" else "TRITON"
    ran_other = flex_kernels(kernels or {}, other)
    instead = (f"; the {_FAMILIES[other][2]} kernels ran instead: {sorted(ran_other[0]) + sorted(ran_other[1])}"
               if any(ran_other) else "")
    if not fwd:
        problems.append(f"no {what} forward kernel ran (expected a kernel named like {fwd_like}){instead}")
    if not bwd:
        problems.append(f"no {what} backward kernel ran (expected a kernel named like {bwd_like}){instead}")
    if dense:
        ops = sorted({d["op"] for d in dense})
        problems.append(f"{len(dense)} op(s) formed or consumed a dense [Q={q_len}, K={k_len}] score matrix "
                        f"({', '.join(ops)}): the eager/dense attention fallback ran")
    if calls.get("flex_compiled", 0) < layers:
        problems.append(f"compiled flex_attention was called {calls.get('flex_compiled', 0)} times in the step for "
                        f"{layers} layers")
    return problems


def _kernel_checks(scan: dict, family: str, backend: str, calls: dict, layers: int, q_len: int, k_len: int
                   ) -> dict:
    """The CUDA part of the report: the flex kernels of the configured family, the top kernels, and the problems
    (empty: the compiled flex path ran)."""
    fwd, bwd = flex_kernels(scan["kernels"], family)
    problems = flex_problems(backend, fwd, bwd, scan["dense"], calls, layers, q_len, k_len, family, scan["kernels"])
    return {"flex_kernel_family": family, "flex_forward_kernels": fwd, "flex_backward_kernels": bwd,
            "top_kernels": dict(scan["kernels"].most_common(25)), "attention_ops": dict(scan["attn_ops"]),
            "problems": problems, "ok": not problems}


def startup_report(step_fn: Callable[[], Any], model: torch.nn.Module, batch_meta: dict, device,
                   strict: bool = True, print_fn: Optional[Callable[[str], None]] = None) -> dict:
    """Run ``step_fn()`` (one real training step) under torch.profiler and report what ran.

    ``model``: the DFlashDrafter (or its DDP wrapper). ``batch_meta``: b, S_pad, Q of the step's batch;
    optional first_step_s (wall time of the warm-up step, measured by the caller), precompile_s (the dry steps
    run before it, ``DrafterTrainer.precompile``), dtype_bytes (default: 2 on
    CUDA (bf16 autocast), 4 on CPU), guard (a CompileGuard, for its summary). ``strict``: on CUDA with the flex
    backend, raise ``StartupCheckError`` if the flex kernels are missing or a dense score matrix appeared.
    ``print_fn``: where the formatted report goes (default: log.info)."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    m = getattr(model, "module", model)
    backend = getattr(m, "backend", "unknown")
    mcfg = getattr(m, "config", None)
    heads = int(getattr(mcfg, "num_attention_heads", 0) or 0)
    layers = int(getattr(mcfg, "num_layers", 0) or 0)
    b, s_pad, q_len = int(batch_meta["b"]), int(batch_meta["S_pad"]), int(batch_meta["Q"])
    k_len = s_pad + q_len
    dtype_bytes = int(batch_meta.get("dtype_bytes") or (2 if cuda else 4))
    calls0 = dict(getattr(m, "attention_calls", {}))
    counters0 = dynamo_counters()
    breaks0 = graph_break_reasons()

    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        mem0 = torch.cuda.memory_allocated(device)
    t0 = time.perf_counter()
    with profile(activities=activities, record_shapes=True) as prof:
        step_fn()
        if cuda:
            torch.cuda.synchronize(device)
    step_s = time.perf_counter() - t0
    # one head: its scores may be plain 2-D matrices; more heads: they carry a head dimension
    scan = _scan_events(prof.events(), q_len, k_len, cuda, min_dims=3 if heads > 1 else 2,
                        lead={heads, b * heads} if heads > 1 else None)
    counters1 = dynamo_counters()
    calls1 = dict(getattr(m, "attention_calls", {}))
    calls = {k: calls1.get(k, 0) - calls0.get(k, 0) for k in calls1}

    report: dict = {
        "backend": backend,
        "device": str(device),
        "torch": torch.__version__,
        "shape": {"b": b, "S_pad": s_pad, "Q": q_len, "K": k_len},
        "attention_calls": calls,
        "profiled_step_s": round(step_s, 3),
        "compiled_during_profile": counters1["frames"] > counters0["frames"],
        "dense_score_ops": scan["dense"][:20],
        "num_dense_score_ops": len(scan["dense"]),
        "dense_fallback_bytes": dense_attention_bytes(b, heads, q_len, k_len, layers, dtype_bytes),
        "graph_breaks": graph_break_reasons(),
        "new_graph_breaks": {k: v - breaks0.get(k, 0) for k, v in graph_break_reasons().items()
                             if v - breaks0.get(k, 0) > 0},
        "dynamo": counters1,
        "cache": inductor_cache_dir(),
    }
    hit = counters1["fx_graph_cache_hit"] + counters1["aot_autograd_cache_hit"]
    miss = counters1["fx_graph_cache_miss"] + counters1["aot_autograd_cache_miss"]
    report["compile"] = {
        "first_step_s": batch_meta.get("first_step_s"),
        "precompile_s": batch_meta.get("precompile_s"),
        "compile_s": counters1["compile_s"],
        "backward_compile_s": counters1["backward_compile_s"],
        "from_cache": ("n/a (nothing compiled)" if hit + miss == 0 else
                       "yes" if miss == 0 else "no" if hit == 0 else "partial"),
    }
    guard = batch_meta.get("guard")
    if guard is not None and hasattr(guard, "summary"):
        report["guard"] = guard.summary()

    plan = batch_meta.get("memory_plan")
    if plan is not None:  # planning/memory.py's plan of this step; on CPU the peak is the process's resident one
        report["memory_plan"] = plan.as_dict()
        report["memory_plan"]["compared_bytes"] = plan.total - (0 if not cuda else plan.parts.get("process", 0))
        report["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if cuda:
        report["peak_memory_bytes"] = int(torch.cuda.max_memory_allocated(device))
        report["peak_reserved_bytes"] = int(torch.cuda.max_memory_reserved(device))
        report["memory_before_step_bytes"] = int(mem0)
        report.update(_kernel_checks(scan, flex_kernel_family(m), backend, calls, layers, q_len, k_len))
    else:
        report["peak_memory_bytes"] = None
        report["attention_ops"] = dict(scan["attn_ops"])
        report["top_aten_ops"] = dict(scan["cpu_ops"].most_common(25))
        report["problems"] = []
        report["ok"] = True

    text = format_startup_report(report)
    (print_fn or log.info)(text)
    if cuda and strict and report["problems"]:
        raise StartupCheckError("startup report: the drafter did not run the compiled flex path:\n  - "
                                + "\n  - ".join(report["problems"]) + "\n" + text)
    return report


def _gib(n: Optional[int]) -> str:
    if n is None:
        return "n/a"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def format_startup_report(r: dict) -> str:
    s = r["shape"]
    lines = [
        "startup report (one profiled training step)",
        f"  attention backend : {r['backend']}  (calls in step: {r['attention_calls']})",
        f"  device / torch    : {r['device']} / {r['torch']}",
        f"  batch shape       : b={s['b']} S_pad={s['S_pad']} Q={s['Q']} K={s['K']}",
        f"  profiled step     : {r['profiled_step_s']:.3f} s"
        + ("  (it compiled: not a steady-state timing)" if r["compiled_during_profile"] else ""),
    ]
    if "flex_forward_kernels" in r:
        fam = r.get("flex_kernel_family", "TRITON")
        lines.append(f"  flex fwd kernels  : ({fam}) {r['flex_forward_kernels'] or 'NONE'}")
        lines.append(f"  flex bwd kernels  : ({fam}) {r['flex_backward_kernels'] or 'NONE'}")
        top = list(r.get("top_kernels", {}).items())[:8]
        lines.append("  top kernels       : " + "; ".join(f"{k[:70]} x{n}" for k, n in top))
    if r.get("attention_ops"):
        lines.append(f"  attention ops     : {r['attention_ops']}")
    if "top_aten_ops" in r:
        lines.append("  top aten ops      : " + ", ".join(f"{k} x{n}" for k, n in list(r["top_aten_ops"].items())[:10]))
    lines.append(f"  dense score ops   : {r['num_dense_score_ops']}"
                 + (f" e.g. {r['dense_score_ops'][0]}" if r["dense_score_ops"] else ""))
    d = r["dense_fallback_bytes"]
    lines.append(f"  peak memory       : {_gib(r['peak_memory_bytes'])}  vs dense fallback: "
                 f"{_gib(d['scores_plus_probs_per_layer'])} scores+probs per layer, "
                 f"{_gib(d['total_estimate'])} with every layer's probs saved")
    mp = r.get("memory_plan")
    if mp:
        peak, how = ((r["peak_memory_bytes"], "torch.cuda.max_memory_allocated") if r.get("peak_memory_bytes")
                     else (r.get("peak_rss_bytes"), "peak RSS of the process"))
        top = sorted(mp["parts"].items(), key=lambda kv: -kv[1])[:3]
        lines.append(f"  memory plan       : {_gib(mp['compared_bytes'])} planned vs {_gib(peak)} measured ({how}); "
                     "largest parts " + ", ".join(f"{k} {_gib(v)}" for k, v in top))
    c = r["compile"]
    fs, ps = c["first_step_s"], c.get("precompile_s")
    dry = "" if ps is None else f"dry steps before training {ps:.1f} s, "
    lines.append(f"  compile           : {dry}first step {'n/a' if fs is None else f'{fs:.1f} s'}, dynamo+inductor "
                 f"{c['compile_s']:.1f} s fwd + {c['backward_compile_s']:.1f} s bwd, from cache: {c['from_cache']}")
    dy = r["dynamo"]
    lines.append(f"  dynamo            : frames {dy['frames']}, graphs {dy['unique_graphs']}, graph breaks "
                 f"{dy['graph_breaks']}, recompiles {dy['recompiles']}, fx cache hit/miss "
                 f"{dy['fx_graph_cache_hit']}/{dy['fx_graph_cache_miss']}, aot cache hit/miss "
                 f"{dy['aot_autograd_cache_hit']}/{dy['aot_autograd_cache_miss']}")
    ca = r["cache"]
    lines.append(f"  inductor cache    : {ca.get('dir')} (fx_graph_cache={ca.get('fx_graph_cache')}, "
                 f"autograd_cache={ca.get('autograd_cache')})")
    for p in r.get("problems", []):
        lines.append(f"  PROBLEM           : {p}")
    return "\n".join(lines)


@contextlib.contextmanager
def sync_warnings_recorded():
    """Collect the "synchronizing CUDA operation" warnings of CUDA's sync debug mode raised inside the block:
    yields a list that gets one entry per sync, where it happened and the innermost project frame that led
    there, e.g. ``clip_grad.py:101 <- trainer.py:189``."""
    where: list[str] = []
    show = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return show(message, category, filename, lineno, file, line)
        ours = [f for f in traceback.extract_stack()[:-1] if f"{os.sep}dflash_dist{os.sep}" in f.filename]
        via = f"{os.path.basename(ours[-1].filename)}:{ours[-1].lineno}" if ours else ""
        at = f"{os.path.basename(filename)}:{lineno}"
        where.append(at + (f" <- {via}" if via and via != at else ""))

    with warnings.catch_warnings():  # only the sync warnings change filter: the compile guard's stay in force
        warnings.filterwarnings("always", message=r".*synchroniz")
        warnings.showwarning = record
        yield where


def host_syncs(fn: Callable[[], Any], device) -> tuple[Any, Optional[list[str]]]:
    """Run ``fn`` under CUDA's sync debug mode: returns (its result, one entry per host sync it made, see
    ``sync_warnings_recorded``); None on CPU. A training step should make none: each one makes the host wait
    for the queued GPU work (and for the receive that work waits on) before it can queue the next step."""
    if torch.device(device).type != "cuda":
        return fn(), None
    with sync_warnings_recorded() as where:
        torch.cuda.set_sync_debug_mode("warn")
        # the switch itself is reported as a sync (torch 2.11: "1 at __init__.py:1270 <- this line"),
        # not one of the step's
        del where[:]
        try:
            out = fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return out, where
