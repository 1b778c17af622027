"""step_trace: the phase timeline of a traced step, from a GPU trace and from a real CPU profile."""

import json

import torch

from dflash_dist.telemetry.step_trace import format_timeline, phase, timeline, traced_step


def _ev(cat, name, ts, dur):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_gpu_timeline_busy_and_idle_per_phase():
    """Phases start at their GPU annotations and run to the next one's start (the last to the step's last kernel:
    annotation spans miss kernels of compiled code and of the autograd thread); busy is the union of the kernels
    inside (overlaps counted once), idle the rest; NCCL kernels summed apart."""
    trace = {"traceEvents": [
        _ev("user_annotation", "dflash/group0 forward", 0, 5),          # host spans: ignored when GPU ones exist
        _ev("gpu_user_annotation", "dflash/group0 forward", 1000, 50),  # its own span is short: not used
        _ev("gpu_user_annotation", "dflash/backward", 1500, 10),
        _ev("kernel", "gemm", 1000, 200), _ev("kernel", "gemm2", 1100, 200),   # union 1000..1300 = 300 us
        _ev("kernel", "ncclDevKernel_SendRecv(x)", 1500, 300),                 # 1500..1800
        _ev("kernel", "gemm3", 1900, 150),                                    # 1900..2050: the step's end
        _ev("cpu_op", "aten::mm", 0, 10)]}
    tl = timeline(trace)
    assert tl["clock"] == "gpu" and [p["name"] for p in tl["phases"]] == ["group0 forward", "backward"]
    fwd, bwd = tl["phases"]
    assert (fwd["start_ms"], fwd["ms"], fwd["busy_ms"]) == (0.0, 0.5, 0.3)
    assert abs(fwd["idle_ms"] - 0.2) < 1e-12
    assert bwd["start_ms"] == 0.5 and abs(bwd["ms"] - 0.55) < 1e-12 and abs(bwd["busy_ms"] - 0.45) < 1e-12
    assert tl["step_ms"] == 1.05 and abs(tl["busy_ms"] - 0.75) < 1e-12
    assert tl["waits"] == {"ncclDevKernel_SendRecv": 0.3}
    assert "| backward | 0.5 | 0.6 | 0.5 | 0.1 |" in format_timeline(tl)


def test_traced_cpu_step_writes_a_trace_with_its_phases(tmp_path):
    """On CPU the phases' host spans, in the order the step ran them; the trace file is a Chrome trace."""
    x = torch.randn(32, 32, requires_grad=True)

    def step():
        with phase("forward"):
            y = (x @ x).tanh().sum()
        with phase("backward"):
            y.backward()

    path = tmp_path / "p" / "t.json"
    tl, _ = traced_step(step, str(path), "cpu")
    assert tl["clock"] == "host" and [p["name"] for p in tl["phases"]] == ["forward", "backward"]
    assert tl["phases"][1]["start_ms"] == tl["phases"][0]["start_ms"] + tl["phases"][0]["ms"] > 0
    assert tl["busy_ms"] is None and tl["step_ms"] > 0
    assert timeline(json.loads(path.read_text()))["phases"] == tl["phases"]
