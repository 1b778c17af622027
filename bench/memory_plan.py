#!/usr/bin/env python3
"""A drafter rank's memory plan against its measured peak, and FSDP2's step time against DDP's, case by case.

Each ``--case LABEL:OVERRIDES`` runs in a fresh process (its own peak; a case that runs out of memory does not stop
the others). It builds the job a drafter rank would run (``bench/_standalone.py``: the real ``DrafterTrainer``,
synthetic samples, random features of the target's width and dtype), takes the largest step of the job's batching
plan (the step the memory plan is made for) and trains on it: warm-up steps (compiles), then timed steps.
Reported: the step (b, S_pad, Q); the drafter's plan at that step for its ``drafter.parallel`` (less the process's
own part), and FSDP2's plan per rank for 8 drafter ranks; the measured peak (CUDA: ``max_memory_allocated`` less
what was allocated before the trainer and the message; CPU: the resident high-water mark less the resident memory
before, with glibc mapping every large tensor apart, ``MALLOC_MMAP_THRESHOLD_``, and after a first trainer made,
stepped and dropped, so that it is the live tensors' peak, not code and caches paged in on first use);
their ratio; ms per step.

    python bench/memory_plan.py --out mp.json --case "ddp:drafter.parallel=ddp" --case "fsdp:drafter.parallel=fsdp"
    python bench/memory_plan.py --out mp_3k.json --mean-len 2048 --case "3k_512:drafter.num_anchors=512"
    python bench/memory_plan.py --out mp_h8192.json --target llama3_70b_random --drafter dflash_h8192 \\
        --case "fsdp:drafter.parallel=fsdp"
    python bench/memory_plan.py --tiny --out /tmp/mp.json --case "ddp:drafter.parallel=ddp"     # CPU, tiny presets

Defaults: the Qwen3-8B-shaped random target and the DFlash preset, ~550-token samples (275..825), 4 samples and
4,096 tokens a message (``--tiny``: the embedded target and drafter, 96-token samples, 16 samples and 2,048 tokens
a message).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import _common as C  # noqa: F401  (puts the repository root on sys.path)

GiB = 1 << 30


def case_config(args, overrides: list, run_dir: str):
    import _standalone as S
    ov = S.job_overrides(args.tiny, args.target, args.drafter, args.mean_len, args.samples, args.max_batch_tokens,
                         args.max_batch_samples, 16, 1, run_dir, overrides)
    return S.compose_job_config(ov)


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


class Peak:
    """The peak of what follows ``start``: CUDA's allocator statistics, or the CPU process's resident high-water
    mark (reset by writing 5 to /proc/self/clear_refs)."""

    def __init__(self, device):
        self.device = device

    def start(self) -> None:
        import gc
        import torch
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            self.before = torch.cuda.memory_allocated(self.device)
        else:
            self.before = _status_bytes("VmRSS")
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")

    def bytes(self) -> int:
        import torch
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device) - self.before
        return _status_bytes("VmHWM") - self.before


def peak_by_source(events: list, top: int = 30) -> dict:
    """What was live at the peak of the allocations recorded since the peak's start (CUDA's allocator history),
    grouped by where each was made: the innermost frame in this project's code (a backward's allocations name the
    line that called it), else the innermost one. {source: GiB}, the largest ``top``, the rest as ``(other)``."""
    done = "free_completed" if any(e["action"] == "free_completed" for e in events) else "free_requested"
    live, total, best, at = {}, 0, -1, -1
    for i, e in enumerate(events):  # first pass: the event at which the live bytes peak
        if e["action"] == "alloc":
            live[e["addr"]] = e["size"]
            total += e["size"]
            if total > best:
                best, at = total, i
        elif e["action"] == done and e["addr"] in live:
            total -= live.pop(e["addr"])
    live = {}
    for e in events[:at + 1]:  # second pass: the blocks live at that event
        if e["action"] == "alloc":
            live[e["addr"]] = e
        elif e["action"] == done:
            live.pop(e["addr"], None)
    groups: dict = {}
    for e in live.values():
        frames = e.get("frames") or []
        mine = [f for f in frames if "/dflash_dist/" in f["filename"]]
        f = (mine or frames or [{"filename": "?", "line": 0, "name": "?"}])[0]
        key = f"{f['filename'].rsplit('/dflash_dist/', 1)[-1]}:{f['line']} {f['name']}"
        groups[key] = groups.get(key, 0) + e["size"]
    ranked = sorted(groups.items(), key=lambda kv: -kv[1])
    out = {k: v / GiB for k, v in ranked[:top]}
    if len(ranked) > top:
        out["(other)"] = sum(v for _, v in ranked[top:]) / GiB
    return out


def plan_bytes(plan) -> int:
    """What the measured peak compares with: the plan less the process's own memory and the CPU heap's slack."""
    return plan.total - plan.parts.get("process", 0) - plan.parts.get("heap slack (CPU)", 0)


def measure(args, label: str, overrides: list) -> dict:
    """One case, in this process: the row."""
    import torch
    import _standalone as S
    from dflash_dist.planning.memory import drafter_plan, plan_steps
    from dflash_dist.targets.hf import resolve_dtype, text_config
    dev = C.pick_device(args.device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    else:
        torch.set_num_threads(args.threads)
    cfg = case_config(args, overrides, tempfile.mkdtemp(prefix="memory_plan_"))
    S.init_single_process_group(dev)
    job, ds = S.make_job(cfg, 2, dev, cfg.train.output_dir)
    mine = S.my_messages(job)
    shapes = {j: plan_steps(job.sample_lengths, [job.plan[j]], cfg.drafter.tuning.ctx_bucket)[0] for j in mine}
    mode = cfg.drafter.parallel if cfg.drafter.parallel in ("ddp", "fsdp") else "ddp"
    plan = drafter_plan(cfg, None, job.drafter, dev.type, sorted(set(shapes.values())), 1, mode)
    j = next(k for k in mine if shapes[k] == plan.shape[:2])
    plan8 = drafter_plan(cfg, None, job.drafter, dev.type, [plan.shape[:2]], 8, "fsdp")
    width = len(job.layer_ids) * text_config(job.hf_config).hidden_size
    dtype = resolve_dtype(cfg.target.dtype, dev.type)  # the features as the target sends them
    row = {"label": label, "overrides": overrides, "env": C.env_info(dev),
           "parallel": mode, "b": plan.shape[0], "S_pad": plan.shape[1], "Q": plan.shape[2],
           "planned_gib": plan_bytes(plan) / GiB, "planned_8_fsdp_gib": plan_bytes(plan8) / GiB,
           "plan_parts_gib": {k: v / GiB for k, v in plan.largest(4)}}

    def message():
        return S.make_message(job, ds, j, dev, torch.randn(S.message_tokens(job, ds, j), width, device=dev).to(dtype))

    k = job.start_cursor + j
    if dev.type == "cpu":  # the first trainer of a process pages in code and fills caches (~80 MiB resident)
        first = S.make_trainer(job)
        first.train_step(first.build(message(), k))
        del first
    peak = Peak(dev)
    peak.start()
    if args.trace and dev.type == "cuda":
        torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    trainer = S.make_trainer(job)
    msg = message()
    if trainer.guard is not None:
        trainer.guard.warmup_steps = None      # the warm-up steps compile; the timed ones must not
    for _ in range(args.warmup):
        trainer.train_step(trainer.build(msg, k))
    if trainer.guard is not None:
        trainer.guard.end_warmup()
    times = []
    for _ in range(args.steps):
        C.sync(dev)
        t0 = time.perf_counter()
        trainer.train_step(trainer.build(msg, k))
        C.sync(dev)
        times.append(time.perf_counter() - t0)
    row["measured_gib"] = peak.bytes() / GiB
    row["planned_over_measured"] = row["planned_gib"] / row["measured_gib"]
    row["ms_per_step"] = 1e3 * C.median(times)
    if args.trace and dev.type == "cuda":
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        row["peak_by_source_gib"] = peak_by_source([e for t in snap["device_traces"] for e in t])
        row["plan_all_parts_gib"] = {k: v / GiB for k, v in plan.parts.items()}
    return row


def run_case(args, label: str, overrides: list) -> dict:
    """The case in a fresh process; its row, or its error."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps([label, overrides])] + args.passthrough
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # CPU: the resident peak is the live tensors' peak
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.case_timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"label": label, "overrides": overrides, "error": f"no result within {args.case_timeout} s"}
    lines = [x for x in r.stdout.splitlines() if x.startswith("{")]
    if r.returncode == 0 and lines:
        return json.loads(lines[-1])
    tail = (r.stderr or r.stdout)[-1500:]
    return {"label": label, "overrides": overrides, "error": tail.strip().splitlines()[-1] if tail.strip() else
            f"exit {r.returncode}", "oom": "out of memory" in tail.lower(), "stderr_tail": tail}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--case", action="append", default=[], help="LABEL:OVERRIDES (space-separated Hydra overrides)")
    p.add_argument("--out", default=None, help="JSON output path (rewritten after every case)")
    p.add_argument("--tiny", action="store_true", help="the embedded target and drafter (CPU-sized)")
    p.add_argument("--target", default=None, help="target preset (default qwen3_8b_random; tiny: tiny)")
    p.add_argument("--drafter", default=None, help="drafter preset (default dflash; tiny: tiny)")
    p.add_argument("--mean-len", type=int, default=None, help="mean synthetic sample length (550; tiny 96)")
    p.add_argument("--samples", type=int, default=None, help="synthetic samples (64; tiny 256)")
    p.add_argument("--max-batch-tokens", type=int, default=None, help="target.max_batch_tokens (4096; tiny 2048)")
    p.add_argument("--max-batch-samples", type=int, default=None, help="target.max_batch_samples (4; tiny 16)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (3; tiny 1)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (5; tiny 2)")
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, default=1, help="CPU threads of a case")
    p.add_argument("--case-timeout", type=float, default=900)
    p.add_argument("--trace", action="store_true", help="CUDA: record the allocations and report what was live at "
                   "the peak, grouped by the line that made it (slower steps: ms/step is then not the step's)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    tiny = args.tiny
    for name, full, small in (("mean_len", 550, 96), ("samples", 64, 256), ("max_batch_tokens", 4096, 2048),
                              ("max_batch_samples", 4, 16), ("warmup", 3, 1), ("steps", 5, 2)):
        if getattr(args, name) is None:
            setattr(args, name, small if tiny else full)
    args.passthrough = _without_cases(argv if argv is not None else sys.argv[1:])
    if args.child:
        label, overrides = json.loads(args.child)
        print(json.dumps(measure(args, label, overrides)), flush=True)
        return 0
    cases = [(c.partition(":")[0], c.partition(":")[2].split()) for c in args.case] or [("default", [])]
    result = {"bench": "memory_plan", "tiny": tiny, "rows": []}
    for label, overrides in cases:
        C.log(f"case {label}: {' '.join(overrides) or '(the defaults)'}")
        row = run_case(args, label, overrides)
        result["rows"].append(row)
        C.log(f"  {row.get('error') or _summary(row)}")
        C.write_json(args.out, result)
    cols = [("label", "case"), ("parallel", "drafter"), ("b", "b"), ("S_pad", "S_pad"), ("Q", "Q"),
            ("planned_gib", "planned GiB"), ("measured_gib", "measured GiB"), ("planned_over_measured", "planned / measured"),
            ("planned_8_fsdp_gib", "FSDP2 x8 planned GiB/rank"), ("ms_per_step", "ms/step"), ("error", "error")]
    print(C.table(result["rows"], cols, title="drafter rank: memory plan vs measured peak"))
    return 0 if all("error" not in r for r in result["rows"]) else 1


def _without_cases(argv: list) -> list:
    """The arguments a case's process gets: everything but the --case / --child pairs and --out."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--case", "--child", "--out"):
            skip = True
        elif not a.startswith(("--case=", "--child=", "--out=")):
            out.append(a)
    return out


def _summary(row: dict) -> str:
    return (f"b={row['b']} S_pad={row['S_pad']}: planned {row['planned_gib']:.2f} GiB, measured "
            f"{row['measured_gib']:.2f} GiB ({row['planned_over_measured']:.2f}x), {row['ms_per_step']:.1f} ms/step")


if __name__ == "__main__":
    sys.exit(main())
