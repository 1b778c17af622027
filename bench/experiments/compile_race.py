#!/usr/bin/env python3
"""What one thread's torch.compile does to the eager code of another thread in the same process.

The design dflash_dist replaces runs the target and the drafter as Python threads of one process. torch.compile
keeps some of its state process-wide: ``torch.compiler.is_compiling()`` reads a module global that a compile
session holds True for its whole length (torch 2.13: ``torch.compiler._compile_session_context``). Eager code
in any other thread then takes its compile-only branches; ``torch.optim`` has several (``_get_value`` returns a
tensor instead of a Python number, device grouping is skipped, the foreach fallback check runs). This script
measures it on the drafter's work (AdamW runs, and three steps of the real ``DrafterTrainer``) and on the
target's (a feature capture):

1. ``window`` (deterministic): thread A compiles a function whose backend waits for an event, so its compile
   session stays open; meanwhile the main thread reads ``is_compiling()`` and runs the workloads, each compared
   bit for bit with the same workload run before any thread started.
2. ``threads`` (realistic timing): thread A compiles fresh functions with inductor, one after the other, as a
   drafter compiles its shapes; thread B repeats the workloads meanwhile and counts runs that differ or raise.
3. ``processes``: the same two loops in two processes (the dflash_dist layout).

    python bench/experiments/compile_race.py --out compile_race.json            # CPU or GPU (on CUDA also fused AdamW)
    python bench/experiments/compile_race.py --window-only --out /tmp/cr.json    # part 1 only (a few seconds)
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: _common
import _common as C  # noqa: E402
import torch  # noqa: E402

# ------------------------------------------------------------------------------------------------ workloads

def adamw_run(variant: str, device: str) -> torch.Tensor:
    """20 AdamW steps on four 64x64 parameters with fixed gradients: the parameters after them."""
    # explicit generators only: the global one is shared by the threads (thread A draws from it too)
    g = torch.Generator(device=device).manual_seed(1)
    params = [torch.nn.Parameter(torch.randn(64, 64, generator=g, device=device)) for _ in range(4)]
    kw = {"single": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}[variant]
    opt = torch.optim.AdamW(params, lr=1e-3, **kw)
    for _ in range(20):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g, device=device)
        opt.step()
    return torch.cat([p.detach().flatten() for p in params]).cpu()


def make_capture(device: str):
    """The tiny target's padded eager feature capture (dflash_dist.roles.target_rank.capture.FeatureCapture) on a fixed batch."""
    from dflash_dist.config import default_layer_ids
    from dflash_dist.targets.hf import build_target_model
    from dflash_dist.roles.target_rank.capture import FeatureCapture
    model = build_target_model(C.target_config("tiny"), device)
    cap = FeatureCapture(model, default_layer_ids(model.config.num_hidden_layers, 5))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (3, 40), generator=g).to(device)
    lengths = torch.tensor([40, 25, 33])

    def run() -> torch.Tensor:
        out = cap(ids, lengths)
        return getattr(out, "features", out).float().cpu()
    return run


def make_drafter_steps(device: str, steps: int = 3):
    """The real ``DrafterTrainer`` (tiny drafter of the embedded default, synthetic messages): ``steps`` training
    steps from the same weights and optimizer state each run; the weights after them."""
    import copy
    import tempfile

    import _standalone as S
    dev = torch.device(device)
    S.init_single_process_group(dev)  # the DDP group of a job with one drafter rank
    run_dir = tempfile.mkdtemp(prefix="compile_race_")
    cfg = S.compose_job_config(S.job_overrides(True, None, None, 48, 64, 256, 4, steps, steps, run_dir, []))
    job, ds = S.make_job(cfg, 2, dev, run_dir)
    trainer = S.make_trainer(job)
    mine = S.my_messages(job)[:steps]
    g = torch.Generator(device=device).manual_seed(0)
    msgs = [S.make_message(job, ds, j, dev, torch.randn(S.message_tokens(job, ds, j), trainer.feature_width,
                                                        generator=g, device=device).to(trainer.lm_head.dtype))
            for j in mine]
    weights0 = copy.deepcopy(trainer.model.state_dict())
    opt0 = copy.deepcopy(trainer.opt.state_dict())

    def run() -> torch.Tensor:
        trainer.model.load_state_dict(weights0)
        trainer.opt.load_state_dict(copy.deepcopy(opt0))
        trainer.step = trainer.cursor = 0
        for s, (j, msg) in enumerate(zip(mine, msgs)):
            trainer.train_step(trainer.build(msg, job.start_cursor + j))
            trainer.cursor = s + 1
        return torch.cat([p.detach().float().flatten().cpu() for p in trainer.model.parameters()])
    return run


def workloads(device: str) -> dict:
    runs = {f"adamw_{v}": (lambda v=v: adamw_run(v, device))
            for v in (["single", "foreach"] + (["fused"] if device == "cuda" else []))}
    runs["drafter_steps"] = make_drafter_steps(device)
    runs["target_capture"] = make_capture(device)
    return runs


class Tally:
    """Per workload: runs, runs that differ from the reference (and the largest difference), errors."""

    def __init__(self, refs: dict):
        self.refs = refs
        self.rows = {k: {"runs": 0, "differ": 0, "max_abs_diff": 0.0, "errors": 0, "first_error": None}
                     for k in refs}

    def run(self, name: str, fn) -> None:
        row = self.rows[name]
        try:
            out = fn()
        except Exception as e:  # noqa: BLE001 - counted: what the threaded design would have raised
            row["errors"] += 1
            row["first_error"] = row["first_error"] or f"{type(e).__name__}: {e}"[:240]
            return
        row["runs"] += 1
        if not torch.equal(out, self.refs[name]):
            row["differ"] += 1
            row["max_abs_diff"] = max(row["max_abs_diff"], float((out - self.refs[name]).abs().max()))


def fresh_compiles(n: int, device: str, done: threading.Event | None = None) -> int:
    """Compile n functions that no cache has seen (inductor, forward and backward), one after the other."""
    salt = random.randint(10**3, 10**9)
    g = torch.Generator(device=device).manual_seed(salt)
    for i in range(n):
        ns: dict = {}
        exec(f"def f_{i}(a):\n    return (a * {salt + i} + 1).sin().cos() @ a.T\n", ns)  # a new graph each
        x = torch.randn(8, 8, generator=g, device=device).requires_grad_()
        torch.compile(ns[f"f_{i}"])(x).sum().backward()
    if done is not None:
        done.set()
    return n


# ------------------------------------------------------------------------------------------------ parts

def part_window(device: str) -> dict:
    runs = workloads(device)
    tally = Tally({k: fn() for k, fn in runs.items()})
    started, release = threading.Event(), threading.Event()

    def waiting_backend(gm, example_inputs):
        started.set()
        release.wait(120)
        return gm.forward

    def compile_a():
        torch.compile(lambda x: x.sin() + 1, backend=waiting_backend)(torch.randn(3))
    before = torch.compiler.is_compiling()
    a = threading.Thread(target=compile_a)
    a.start()
    if not started.wait(60):
        raise RuntimeError("thread A never reached its backend")
    during = torch.compiler.is_compiling()  # read in the main thread, which compiles nothing
    for name, fn in runs.items():
        tally.run(name, fn)
    release.set()
    a.join(60)
    return {"is_compiling_before": before, "is_compiling_in_other_thread_during": during,
            "is_compiling_after": torch.compiler.is_compiling(), "workloads": tally.rows}


def _loop(runs: dict, tally: Tally, stop) -> None:
    names = list(runs)
    k = 0
    while not stop.is_set():
        name = names[k % len(names)]
        tally.run(name, runs[name])
        k += 1


def part_threads(device: str, compiles: int) -> dict:
    runs = workloads(device)
    tally = Tally({k: fn() for k, fn in runs.items()})
    stop = threading.Event()
    t0 = time.monotonic()
    a = threading.Thread(target=fresh_compiles, args=(compiles, device, stop))
    b = threading.Thread(target=_loop, args=(runs, tally, stop))
    a.start()
    b.start()
    a.join()
    b.join()
    return {"compiles": compiles, "seconds": round(time.monotonic() - t0, 1), "workloads": tally.rows}


def _process_b(device: str, conn, stop) -> None:
    torch.set_num_threads(1)
    runs = workloads(device)
    tally = Tally({k: fn() for k, fn in runs.items()})
    conn.send("ready")
    _loop(runs, tally, stop)
    conn.send(tally.rows)


def part_processes(device: str, compiles: int) -> dict:
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    here, there = ctx.Pipe()
    b = ctx.Process(target=_process_b, args=(device, there, stop))
    b.start()
    if here.recv() != "ready":
        raise RuntimeError("process B did not start")
    t0 = time.monotonic()
    fresh_compiles(compiles, device)
    stop.set()
    rows = here.recv()
    b.join(60)
    return {"compiles": compiles, "seconds": round(time.monotonic() - t0, 1), "workloads": rows}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--compiles", type=int, default=12, help="fresh inductor compiles in parts 2 and 3")
    p.add_argument("--window-only", action="store_true", help="part 1 only")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    res = {"bench": "compile_race", "env": C.env_info(torch.device(device)), "device": device}
    C.log("part 1: a compile session held open in thread A, the workloads in the main thread")
    res["window"] = part_window(device)
    if not args.window_only:
        C.log(f"part 2: {args.compiles} fresh compiles in thread A, the workloads looping in thread B")
        res["threads"] = part_threads(device, args.compiles)
        C.log("part 3: the same in two processes")
        res["processes"] = part_processes(device, args.compiles)
    rows = []
    for part in ("window", "threads", "processes"):
        for name, r in res.get(part, {}).get("workloads", {}).items():
            rows.append({"part": part, "workload": name, "runs": r["runs"], "differ": r["differ"],
                         "max": f"{r['max_abs_diff']:.3g}", "errors": r["errors"],
                         "first": (r["first_error"] or "")[:90]})
    w = res["window"]
    title = (f"compile state across threads ({device}, torch {torch.__version__}): is_compiling() in a thread "
             f"that compiles nothing, while another compiles: {w['is_compiling_in_other_thread_during']}")
    print(C.table(rows, [("part", "part"), ("workload", "workload"), ("runs", "runs"),
                         ("differ", "runs that differ"), ("max", "max |diff|"), ("errors", "errors"),
                         ("first", "first error")], title), flush=True)
    if args.out:
        C.write_json(args.out, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
