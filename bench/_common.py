"""Shared helpers of the bench/ scripts: device, timing, peak matmul rate, configs, tables and JSON.

Every script puts the repository root on sys.path (``import _common`` first), so it runs from a checkout
without ``pip install -e .``. Nothing here re-implements the project: models, batches, masks and losses
come from ``dflash_dist``.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import sys
import time
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional, Sequence

if TYPE_CHECKING:  # annotations only
    import torch

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH_DIR)
if REPO not in sys.path:
    sys.path.insert(0, REPO)

# torch is imported inside the functions that need it: plan_split.py and summarize.py run without it.

# Vendor dense bf16 tensor-core peaks (no sparsity), TFLOP/s, matched on the device name. Only a reference:
# every script also measures an 8192^3 bf16 matmul and reports MFU against that.
from dflash_dist.telemetry.flops import NOMINAL_BF16_TFLOPS, nominal_peak_tflops  # noqa: E402,F401  (re-exported)

# ---------------------------------------------------------------------------------------------- device

def pick_device(name: str = "auto") -> torch.device:
    import torch
    if name == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def sync(device: torch.device) -> None:
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def env_info(device: torch.device) -> dict:
    import torch
    info = {"python": platform.python_version(), "torch": torch.__version__, "device": str(device),
            "hostname": platform.node(), "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        import transformers
        info["transformers"] = transformers.__version__
    except Exception:  # pragma: no cover
        info["transformers"] = None
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info.update({"gpu": p.name, "gpu_mem_gb": round(p.total_memory / 2**30, 1), "cuda": torch.version.cuda,
                     "sm_count": p.multi_processor_count, "visible_gpus": torch.cuda.device_count()})
        try:
            import triton
            info["triton"] = triton.__version__
        except Exception:
            info["triton"] = None
    else:
        info["cpu_threads"] = torch.get_num_threads()
    return info


# ---------------------------------------------------------------------------------------------- timing

def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


class StepTimer:
    """Wall time of one region, exact on GPU: CUDA events on the current stream, synchronised at stop().
    On CPU: perf_counter. ``stop()`` returns seconds."""

    def __init__(self, device: "torch.device"):
        import torch
        self._torch = torch
        self.device = device
        self.cuda = device.type == "cuda"

    def start(self) -> None:
        if self.cuda:
            self._e0 = self._torch.cuda.Event(enable_timing=True)
            self._e1 = self._torch.cuda.Event(enable_timing=True)
            self._e0.record()
        else:
            self._t0 = time.perf_counter()

    def stop(self) -> float:
        if self.cuda:
            self._e1.record()
            self._e1.synchronize()
            return self._e0.elapsed_time(self._e1) / 1e3
        return time.perf_counter() - self._t0


def wall_s(fn: Callable[[], Any], device: torch.device) -> float:
    """Host seconds of one call of fn, the device synchronised before and after (host-side costs included)."""
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def host_sync_sites(fn: Callable[[], Any], device: torch.device, roots: Sequence[str] = ("dflash_dist", "bench")
                    ) -> list[dict]:
    """Where one call of fn makes the host wait for the device (CUDA): torch's sync debug mode flags every
    synchronizing op (``.item()``, a device-to-host or pageable copy, ``nonzero``, ...); each is reported at the
    innermost frame under ``roots`` with its count and message. Nothing on CPU. A step meant to run back to back
    should list none: one such site stops the next step's host work from overlapping this one's GPU tail."""
    import traceback
    import warnings

    import torch
    if device.type != "cuda":
        fn()
        return []
    sites: dict = {}

    def record(message, category, filename, lineno, file=None, line=None):
        if "called a synchronizing" not in str(message):  # not the mode's own "prototype feature" notice
            return
        frames = [f for f in traceback.extract_stack()[:-1] if any(f"/{r}/" in f.filename for r in roots)]
        where = f"{os.path.relpath(frames[-1].filename, REPO)}:{frames[-1].lineno} {frames[-1].line}" if frames else "?"
        entry = sites.setdefault(where, {"site": where, "count": 0, "message": str(message)[:160]})
        entry["count"] += 1

    old = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(old)
    return sorted(sites.values(), key=lambda e: -e["count"])


def time_repeats(fn: Callable[[], Any], device: torch.device, warmup: int, repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` calls of fn, after ``warmup`` untimed calls (synchronised each call)."""
    for _ in range(warmup):
        fn()
    sync(device)
    t = StepTimer(device)
    out = []
    for _ in range(repeats):
        t.start()
        fn()
        out.append(t.stop())
    return out


def peak_matmul_tflops(device: torch.device, n: int = 8192, warmup: int = 3, repeats: int = 10) -> dict:
    """Measured dense matmul rate on random (not zero) inputs: bf16 n x n x n on GPU, fp32 on CPU."""
    import torch
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, dtype=dtype, device=device, generator=g)
    b = torch.randn(n, n, dtype=dtype, device=device, generator=g)
    times = time_repeats(lambda: torch.mm(a, b), device, warmup, repeats)
    med = median(times)
    return {"n": n, "dtype": str(dtype).replace("torch.", ""), "median_ms": med * 1e3,
            "tflops": 2 * n ** 3 / med / 1e12, "repeats": repeats}


# ---------------------------------------------------------------------------------------------- memory

def reset_peak(device: torch.device) -> None:
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def mem_gb(device: torch.device) -> dict:
    import torch
    if device.type != "cuda":
        return {"allocated_gb": None, "peak_gb": None, "reserved_gb": None}
    return {"allocated_gb": round(torch.cuda.memory_allocated(device) / 2**30, 3),
            "peak_gb": round(torch.cuda.max_memory_allocated(device) / 2**30, 3),
            "reserved_gb": round(torch.cuda.max_memory_reserved(device) / 2**30, 3)}


def free_memory(device: torch.device) -> None:
    import gc

    import torch
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def is_oom(e: BaseException) -> bool:
    import torch
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def short_error(e: BaseException, n: int = 400) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:n] if str(e).strip() else ''}"


# ---------------------------------------------------------------------------------------------- configs

def load_conf(group: str, name: str) -> dict:
    """conf/<group>/<name>.yaml of the repository, as a dict of the fields it sets (the same files Hydra composes
    over the dataclass defaults)."""
    import yaml
    with open(os.path.join(REPO, "conf", group, f"{name}.yaml")) as f:
        preset = dict(yaml.safe_load(f) or {})
    preset.pop("defaults", None)  # presets list only what differs from the dataclass defaults
    return preset


def target_config(name: str, **overrides):
    """dflash_dist.config.TargetConfig from conf/target/<name>.yaml (plus overrides)."""
    from dflash_dist.config import TargetConfig
    d = load_conf("target", name)
    d.update(overrides)
    return TargetConfig(**d)


def drafter_config(name: str, **overrides):
    """dflash_dist.config.DrafterConfig from conf/drafter/<name>.yaml plus overrides (a dict for a section, e.g.
    ``dflash2={"conv_dtype": "compute"}``, updates that section's keys)."""
    from dflash_dist.config import DrafterConfig
    d = load_conf("drafter", name)
    for k, v in overrides.items():
        d[k] = {**d[k], **v} if isinstance(v, dict) and isinstance(d.get(k), dict) else v
    return DrafterConfig(**d)


def build_target_on_device(tcfg, device: torch.device):
    """``dflash_dist.targets.hf.build_target_model`` with random init done on the device (a torch.device context:
    transformers creates the parameters there, seconds instead of minutes on CPU for 8B). Falls back to the plain
    call (init on CPU, then .to(device)) if that fails. Returns (model, how, seconds)."""
    import torch

    from dflash_dist.targets.hf import build_target_model
    t0 = time.time()
    if device.type == "cuda" and not tcfg.name_or_path:
        try:
            with torch.device(device):
                model = build_target_model(tcfg, device.type)
            if all(p.device.type == "cuda" for p in model.parameters()):
                return model, "init on device", time.time() - t0
        except Exception as e:  # pragma: no cover - GPU only
            print(f"[bench] init on device failed ({short_error(e)}); building on CPU", flush=True)
            free_memory(device)
    model = build_target_model(tcfg, device.type)
    return model, "init on cpu, moved", time.time() - t0


# ---------------------------------------------------------------------------------------------- output

def write_json(path: Optional[str], obj: Any) -> None:
    """Atomic write (tmp + rename); NaN/inf become null."""
    if not path:
        return

    def clean(x):
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {str(k): clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        if type(x).__module__.startswith("torch"):  # tensors -> lists, dtypes/devices -> str
            return clean(x.tolist()) if hasattr(x, "tolist") else str(x)
        return x

    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(clean(obj), f, indent=1, default=str)
    os.replace(tmp, path)


def fmt(v: Any, nd: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if not math.isfinite(v):
            return "-"
        if abs(v) >= 1000:
            return f"{v:,.0f}"
        return f"{v:.{nd}f}"
    return str(v)


def table(rows: Iterable[dict], columns: Sequence[tuple[str, str]], title: Optional[str] = None) -> str:
    """Markdown table: columns = [(key, header)]."""
    rows = list(rows)
    head = "| " + " | ".join(h for _, h in columns) + " |"
    sep = "| " + " | ".join("---" for _ in columns) + " |"
    body = ["| " + " | ".join(fmt(r.get(k)) for k, _ in columns) + " |" for r in rows]
    out = "\n".join([head, sep] + body)
    return (f"### {title}\n\n{out}" if title else out)


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)
