"""Compile guard for the drafter ranks: proof that the compiled flex path is the path that runs.

Three failure modes of ``torch.compile`` are silent by default and each one costs the run its speed or its memory:

1. **flex_attention runs uncompiled.** ``flex_attention`` outside a compiled region warns once
   ("flex_attention called without torch.compile() ...", a ``UserWarning``) and then materialises the full
   [b, h, Q, K] score matrix. ``install_guard`` turns that warning into an error, and every guarded step also
   checks torch's warn-once registry in case some library swallowed it.
2. **Recompiles.** Each recompile of the flex kernel costs tens of seconds (autotuning), and an unbounded
   series of them is a hang in disguise. ``install_guard`` bounds them (``recompile_limit`` = shape buckets +
   margin, and a hard error when it is hit); ``CompileGuard.step`` refuses every recompile after warm-up
   (``torch.compiler.set_stance("fail_on_recompile")``) and turns dynamo's error into a ``CompileGuardError``
   that names the batch shape (b, S_pad, Q) against the shapes seen so far.
3. **Graph breaks.** The flex call is compiled with ``fullgraph=True`` (a break is a compile error); other
   compiled regions are checked with ``report_graph_breaks``.

Usage on a drafter rank (DrafterTrainer wires it in; the shapes and ``batch_shape`` come from ``shape_plan.py``)::

    guard = install_guard(num_shape_buckets=len(shapes), expected_shapes=shapes, warmup_steps=2)
    for batch in ...:
        with guard.step(batch_shape(batch)):
            trainer.train_step(batch)

``dynamo_counters()`` is a flat dict of torch._dynamo's counters for the startup banner and periodic logs.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import re
import sys
import warnings
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import torch

from dflash_dist.model.lazy_compile import LazyCompiled

__all__ = ["CompileGuardError", "CompileGuard", "install_guard", "steady_state", "dynamo_counters",
           "graph_break_reasons", "report_graph_breaks", "FLEX_EAGER_WARNING_RE", "format_shape"]

log = logging.getLogger("dflash_dist")

# The text torch (2.5 .. 2.13) warns with when flex_attention runs outside torch.compile
# (torch/nn/attention/flex_attention.py, _warn_once(warning_id="flex_attention_performance", UserWarning)).
FLEX_EAGER_WARNING_RE = r"flex_attention called without torch\.compile"
_FLEX_WARNING_ID = "flex_attention_performance"
_RECOMPILE_STANCE_MSG = "Detected recompile when torch.compile stance is 'fail_on_recompile'"
_SHAPE_NAMES = ("b", "S_pad", "Q")


class CompileGuardError(RuntimeError):
    """The compiled fast path was left (eager flex, a refused recompile, a recompile limit, a graph break)."""


# ---------------------------------------------------------------------------------------------- shapes

def format_shape(shape: Sequence[int]) -> str:
    if len(shape) == len(_SHAPE_NAMES):
        return "(" + ", ".join(f"{n}={v}" for n, v in zip(_SHAPE_NAMES, shape)) + ")"
    return str(tuple(shape))


# ---------------------------------------------------------------------------------------------- counters

def _counters():
    if "torch._dynamo" not in sys.modules:  # never imported, so nothing in this process was compiled
        return collections.defaultdict(collections.Counter)
    from torch._dynamo.utils import counters
    return counters


def _compilation_metrics() -> list:
    if "torch._dynamo" not in sys.modules:
        return []
    try:
        from torch._dynamo.utils import get_compilation_metrics
        return list(get_compilation_metrics())
    except Exception:  # pragma: no cover - internal API
        return []


def graph_break_reasons() -> dict[str, int]:
    """{reason: count} of every graph break dynamo took in this process (``counters['graph_break']``)."""
    return {str(k): int(v) for k, v in _counters()["graph_break"].items() if v}


def dynamo_counters() -> dict:
    """Flat snapshot of torch._dynamo.utils.counters (process-wide, cumulative) for logs and the banner.

    frames/frames_ok: frames dynamo converted; unique_graphs: FX graphs compiled; graph_breaks; recompiles
    (compilations with a recompile reason, from dynamo's compilation metrics); fx_graph_cache_* (inductor's FX
    graph cache) and aot_autograd_cache_* (AOT autograd cache): hit/miss/bypass; compile_s: dynamo+backend
    compile time of the frames in the metrics buffer (forward; the lazily compiled backward is in
    backward_compile_s)."""
    c = _counters()
    metrics = _compilation_metrics()
    compile_s = sum(float(getattr(m, "entire_frame_compile_time_s", None) or 0.0) for m in metrics)
    bwd_us = sum(float(getattr(m, "backward_cumulative_compile_time_us", None) or 0.0) for m in metrics)
    return {
        "frames": int(c["frames"]["total"]),
        "frames_ok": int(c["frames"]["ok"]),
        "unique_graphs": int(c["stats"]["unique_graphs"]),
        "graph_breaks": int(sum(v for v in c["graph_break"].values() if v > 0)),
        "recompiles": sum(1 for m in metrics if getattr(m, "recompile_reason", None)),
        "fx_graph_cache_hit": int(c["inductor"]["fxgraph_cache_hit"]),
        "fx_graph_cache_miss": int(c["inductor"]["fxgraph_cache_miss"]),
        "fx_graph_cache_bypass": int(c["inductor"]["fxgraph_cache_bypass"]),
        "aot_autograd_cache_hit": int(c["aot_autograd"]["autograd_cache_hit"]),
        "aot_autograd_cache_miss": int(c["aot_autograd"]["autograd_cache_miss"]),
        "aot_autograd_cache_bypass": int(c["aot_autograd"]["autograd_cache_bypass"]),
        "compile_s": round(compile_s, 3),
        "backward_compile_s": round(bwd_us / 1e6, 3),
    }


def report_graph_breaks(baseline: Optional[dict] = None, raise_on_break: bool = True) -> dict[str, int]:
    """Graph breaks taken since ``baseline`` (a previous ``graph_break_reasons()``; None: since process start).

    Returns {reason: count}; with ``raise_on_break`` a non-empty result raises ``CompileGuardError`` listing
    the reasons (a break inside a compiled region splits it and can leave part of it eager)."""
    now = graph_break_reasons()
    base = baseline or {}
    new = {k: v - base.get(k, 0) for k, v in now.items() if v - base.get(k, 0) > 0}
    if new and raise_on_break:
        lines = "\n".join(f"  [{n}x] {_first_lines(r, 3)}" for r, n in new.items())
        raise CompileGuardError(f"compile guard: {sum(new.values())} graph break(s) in compiled regions:\n{lines}")
    return new


def _first_lines(text: str, n: int) -> str:
    lines = [ln for ln in str(text).splitlines() if ln.strip()]
    return " | ".join(lines[:n])


# ---------------------------------------------------------------------------------------------- install

def _flex_module():
    import torch.nn.attention.flex_attention as fa
    return fa


def _arm_flex_warning() -> None:
    """Make the next eager flex_attention call warn again (torch warns once per process), as an error."""
    fa = _flex_module()
    shown = getattr(fa, "_WARNINGS_SHOWN", None)
    if isinstance(shown, set):
        shown.discard(_FLEX_WARNING_ID)
    warnings.filterwarnings("error", message=FLEX_EAGER_WARNING_RE, category=UserWarning)


def _flex_warning_was_swallowed() -> bool:
    """True if torch recorded the eager-flex warning as shown although our error filter should have raised."""
    shown = getattr(_flex_module(), "_WARNINGS_SHOWN", None)
    return isinstance(shown, set) and _FLEX_WARNING_ID in shown


def _set_first(obj: Any, names: Sequence[str], value: Any, applied: dict) -> Optional[str]:
    for name in names:
        if hasattr(obj, name):
            setattr(obj, name, value)
            applied[name] = value
            return name
    return None


def install_guard(num_shape_buckets: int, margin: int = 2, *, warmup_steps: Optional[int] = 1,
                  expected_shapes: Optional[Iterable[Sequence[int]]] = None,
                  check_flex_compiled: bool = True) -> "CompileGuard":
    """Process-wide settings, then a ``CompileGuard`` holding the per-step state.

    * eager flex_attention -> error: a ``warnings`` filter turns torch's "flex_attention called without
      torch.compile" ``UserWarning`` into an exception (re-armed: torch only warns once per process), and
      ``torch.nn.attention.flex_attention._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG`` (which silences it) must be off;
    * ``torch._dynamo.config.recompile_limit`` (``cache_size_limit`` on old torch) = num_shape_buckets + margin,
      and ``fail_on_recompile_limit_hit`` (``fail_on_cache_limit_hit``) = True where it exists: the limit raises
      instead of silently running the frame eagerly; ``suppress_errors`` off (it would hide compile failures);
    * dynamo's compilation-metrics buffer enlarged so ``dynamo_counters()['recompiles']`` keeps counting.

    ``guard.applied`` records what was set (the attribute names differ between torch versions).
    """
    if num_shape_buckets < 1:
        raise ValueError(f"num_shape_buckets={num_shape_buckets}: need >= 1")
    import torch._dynamo
    cfg = torch._dynamo.config
    applied: dict = {"torch": torch.__version__}
    fa = _flex_module()
    if getattr(fa, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", False):
        raise CompileGuardError("torch.nn.attention.flex_attention._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG is True: "
                                "eager flex_attention would run silently. Unset it for training.")
    _arm_flex_warning()
    applied["flex_eager_warning"] = "error"
    limit = int(num_shape_buckets) + int(margin)
    applied["recompile_limit_attr"] = _set_first(cfg, ("recompile_limit", "cache_size_limit"), limit, applied)
    applied["fail_attr"] = _set_first(cfg, ("fail_on_recompile_limit_hit", "fail_on_cache_limit_hit"), True,
                                      applied)
    if getattr(cfg, "suppress_errors", False):
        cfg.suppress_errors = False
        applied["suppress_errors"] = False
    try:
        from torch._dynamo.utils import set_compilation_metrics_limit
        set_compilation_metrics_limit(4096)
        applied["compilation_metrics_limit"] = 4096
    except Exception:  # pragma: no cover - internal API
        pass
    applied["set_stance"] = hasattr(torch.compiler, "set_stance")
    if check_flex_compiled:
        from dflash_dist.model import drafter
        fn = drafter.flex_attention_compiled
        if isinstance(fn, LazyCompiled):
            fn = fn.compiled()
        if not hasattr(fn, "_torchdynamo_orig_callable") and not hasattr(fn, "_torchdynamo_inline"):
            raise CompileGuardError("drafter.flex_attention_compiled is not a torch.compile'd function")
    guard = CompileGuard(limit, applied, warmup_steps=warmup_steps, expected_shapes=expected_shapes)
    log.info("compile guard: %s", guard.describe_settings())
    return guard


# ---------------------------------------------------------------------------------------------- per step

def _is_recompile_refusal(e: BaseException) -> bool:
    return isinstance(e, RuntimeError) and _RECOMPILE_STANCE_MSG in str(e)


def _is_limit_hit(e: BaseException) -> bool:
    try:
        from torch._dynamo.exc import FailOnRecompileLimitHit
        if isinstance(e, FailOnRecompileLimitHit):
            return True
    except ImportError:  # pragma: no cover
        pass
    text = str(e)
    return any(f"Hard failure due to {flag}" in text
               for flag in ("fail_on_recompile_limit_hit", "fail_on_cache_limit_hit"))


def _is_flex_eager(e: BaseException) -> bool:
    return isinstance(e, UserWarning) and re.search(FLEX_EAGER_WARNING_RE, str(e)) is not None


def _dynamo_reason(e: BaseException) -> str:
    text = str(e)
    cause = e.__cause__
    if cause is not None and str(cause) and str(cause) not in text:
        text += "\n" + str(cause)
    return "\n".join("    " + ln for ln in text.splitlines()[:12])


def _stance(name: str):
    return torch.compiler.set_stance(name)


@contextlib.contextmanager
def steady_state(shape: Optional[Sequence[int]] = None, seen: Optional[Iterable[Sequence[int]]] = None
                 ) -> Iterator[None]:
    """Run the body with recompiles refused (``set_stance("fail_on_recompile")``); a refused recompile, a hit
    recompile limit or an eager flex_attention becomes a ``CompileGuardError`` naming ``shape`` vs ``seen``.

    The stance also refuses the *first* compile of a function never compiled before: in steady state nothing
    may compile at all."""
    try:
        with _stance("fail_on_recompile"):
            yield
    except BaseException as e:
        err = _translate(e, shape, seen, step=None, steady=True)
        if err is None:
            raise
        raise err from e


def _translate(e: BaseException, shape, seen, step: Optional[int], steady: bool,
               warmup: Optional[Sequence[Sequence[int]]] = None) -> Optional[CompileGuardError]:
    where = f" at step {step}" if step is not None else ""
    shape_s = format_shape(shape) if shape is not None else "(unknown shape)"
    seen = [tuple(s) for s in (seen or [])]
    seen_s = ", ".join(format_shape(s) for s in seen) or "none"
    warm = [tuple(s) for s in (warmup if warmup is not None else seen)]
    warm_s = ", ".join(format_shape(s) for s in warm) or "none"
    later = [s for s in seen if s not in warm]
    if later:
        warm_s += f"; first seen after warm-up: {', '.join(format_shape(s) for s in later)}"
    if _is_flex_eager(e):
        return CompileGuardError(
            f"compile guard{where}: flex_attention ran WITHOUT torch.compile for batch {shape_s}: the eager path "
            f"materialises the full [b, heads, Q, K] score matrix. Call drafter.flex_attention_compiled, not "
            f"flex_attention, and check that torch.compile is not disabled (TORCHDYNAMO_DISABLE, set_stance "
            f"'force_eager', suppress_errors fallbacks).")
    if _is_recompile_refusal(e):
        if shape is not None and tuple(shape) in seen:
            what = (f"batch {shape_s} was already compiled; this recompile comes from a guard other than the "
                    f"batch shape (see dynamo's reason): a per-step Python value, dtype or requires_grad change")
        else:
            what = f"batch {shape_s} is a new shape; shapes seen in warm-up: {warm_s}"
        return CompileGuardError(
            f"compile guard{where}: recompilation refused in steady state: {what}.\n  dynamo:\n{_dynamo_reason(e)}\n"
            f"  Fix: add the shape to the warm-up (or to expected_shapes), or make the shape static "
            f"(drafter.tuning.ctx_bucket / fixed samples per message).")
    if _is_limit_hit(e):
        return CompileGuardError(
            f"compile guard{where}: dynamo's recompile limit was hit for batch {shape_s} (more compiled variants "
            f"of one function than shape buckets + margin); shapes seen: {seen_s}.\n  dynamo:\n{_dynamo_reason(e)}")
    return None


class CompileGuard:
    """Per-step state: shapes seen (with the step that first ran each) and warm-up vs steady state.

    Warm-up: the first ``warmup_steps`` guarded steps (None: until ``end_warmup()``) may compile freely
    (bounded by the recompile limit). Steady state: every step runs under ``fail_on_recompile``, except a
    step whose shape is in ``expected_shapes`` and has not been seen yet (a planned bucket reached late: it
    may compile once, still bounded by the limit). A recompile for a shape already seen is always an error.
    """

    def __init__(self, recompile_limit: int, applied: dict, warmup_steps: Optional[int] = 1,
                 expected_shapes: Optional[Iterable[Sequence[int]]] = None):
        self.recompile_limit = recompile_limit
        self.applied = applied
        self.warmup_steps = warmup_steps
        self.expected = None if expected_shapes is None else {tuple(int(v) for v in s) for s in expected_shapes}
        self.seen: dict[tuple, int] = {}          # shape -> first step index
        self.warmup_shapes: list[tuple] = []
        self.steps = 0
        self._steady = False
        self.compiled_in_steady_state: list[tuple] = []   # (step, shape) of allowed late compiles

    # -------------------------------------------------------------- state
    @property
    def steady(self) -> bool:
        return self._steady or (self.warmup_steps is not None and self.steps >= self.warmup_steps)

    def end_warmup(self) -> None:
        """Enter steady state now (from here on every recompile raises)."""
        self._steady = True

    steady_state = end_warmup

    def describe_settings(self) -> str:
        a = self.applied
        return (f"torch {a.get('torch')}, eager flex_attention -> error, {a.get('recompile_limit_attr')}="
                f"{self.recompile_limit}, {a.get('fail_attr')}=True, warm-up steps={self.warmup_steps}, "
                f"expected shapes={'any' if self.expected is None else len(self.expected)}")

    # -------------------------------------------------------------- running
    @contextlib.contextmanager
    def step(self, shape: Sequence[int]) -> Iterator[None]:
        """Guard one training step of batch shape ``shape`` = (b, S_pad, Q) (``batch_shape(batch)``)."""
        shape = tuple(int(v) for v in shape)
        idx = self.steps
        steady = self.steady
        new = shape not in self.seen
        planned_late = steady and new and self.expected is not None and shape in self.expected
        refuse = steady and not planned_late
        seen = list(self.seen)
        if _flex_warning_was_swallowed():
            raise CompileGuardError("compile guard: flex_attention ran WITHOUT torch.compile earlier in this process "
                                    "(its once-only warning was recorded, but did not raise)")
        c0 = dynamo_counters()["frames"] if planned_late else None
        try:
            with (_stance("fail_on_recompile") if refuse else contextlib.nullcontext()):
                yield
        except BaseException as e:
            err = _translate(e, shape, seen, idx, steady, warmup=list(self.warmup_shapes))
            if err is None:
                raise
            raise err from e
        finally:
            self.steps += 1
        if _flex_warning_was_swallowed():
            raise CompileGuardError(f"compile guard at step {idx}: flex_attention ran WITHOUT torch.compile for "
                                    f"batch {format_shape(shape)} (its warning was swallowed by a warnings filter, "
                                    f"not raised)")
        if new:
            self.seen[shape] = idx
            if not steady:
                self.warmup_shapes.append(shape)
            if steady and self.expected is not None and shape not in self.expected:
                log.warning("compile guard: step %d shape %s is not in the expected shapes (no recompile needed)",
                            idx, format_shape(shape))
        if planned_late and dynamo_counters()["frames"] > c0:
            self.compiled_in_steady_state.append((idx, shape))
            log.warning("compile guard: step %d compiled the planned shape %s late (after warm-up)", idx,
                        format_shape(shape))

    def run(self, fn: Callable, shape: Sequence[int], *args, **kwargs):
        """``fn(*args, **kwargs)`` as one guarded step."""
        with self.step(shape):
            return fn(*args, **kwargs)

    def summary(self) -> dict:
        return {"steps": self.steps, "steady": self.steady, "shapes_seen": len(self.seen),
                "warmup_shapes": [list(s) for s in self.warmup_shapes],
                "late_compiles": [[i, list(s)] for i, s in self.compiled_in_steady_state],
                "recompile_limit": self.recompile_limit, **dynamo_counters()}
