#!/usr/bin/env python3
"""A torch.profiler window over a gloo sender crashes it when its isends are in flight as the window starts or stops.

A target rank's loop keeps up to ``topology.max_in_flight`` payload sends pending (gloo runs them on its own
worker threads). This script is that pattern alone: rank 0 multiplies and isends [4096, 640] fp32 tensors to rank
1, at most 3 pending, and opens a profiler window (CPU activity) from iteration 5 to 15; rank 1 receives. Each mode
runs --runs times in a fresh ``torchrun`` (2 processes, gloo); reported: how many runs finished.

    python bench/experiments/profiler_gloo_window.py --out profiler_gloo.json [--runs 5]

modes: isend (sends in flight when the window starts and stops), send (blocking sends), drain (isends, all waited
for right before the window starts and before it stops), irecv (the window on the receiver instead: rank 1 keeps up
to 3 irecvs posted across its start and stop, rank 0 sends blocking).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

MODES = ("isend", "send", "drain", "irecv")


def rank_main(mode: str, trace_dir: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    x = torch.randn(4096, 640, generator=torch.Generator().manual_seed(0))
    w = torch.randn(640, 640, generator=torch.Generator().manual_seed(1))
    pending = []
    prof = profile(activities=[ProfilerActivity.CPU])

    def drain() -> None:
        while pending:
            pending.pop(0).wait()

    for i in range(40):
        if mode == "irecv":
            receiver_iteration(rank, i, x, w, pending, prof, trace_dir)
        elif rank == 0:
            if i == 5:
                if mode == "drain":
                    drain()
                prof.start()
            y = (x @ w).contiguous()
            if mode == "send":
                dist.send(y, 1)
            else:
                pending.append(dist.isend(y, 1))
                if len(pending) > 2:
                    pending.pop(0).wait()
            if i == 15:
                if mode == "drain":
                    drain()
                prof.stop()
                prof.export_chrome_trace(os.path.join(trace_dir, f"{mode}_rank0.json"))
        else:
            buf = torch.empty(4096, 640)
            dist.recv(buf, 0)
    drain()
    dist.barrier()
    dist.destroy_process_group()


def receiver_iteration(rank, i, x, w, pending, prof, trace_dir) -> None:
    """Mode irecv: rank 0 sends blocking, rank 1 keeps irecvs posted across its window (iterations 5..15)."""
    import torch
    import torch.distributed as dist
    if rank == 0:
        dist.send((x @ w).contiguous(), 1)
        return
    if i == 5:
        prof.start()
    buf = torch.empty(4096, 640)
    pending.append(dist.irecv(buf, 0))
    if len(pending) > 2:
        pending.pop(0).wait()
    if i == 15:
        prof.stop()
        prof.export_chrome_trace(os.path.join(trace_dir, "irecv_rank1.json"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--out", default=None)
    p.add_argument("--workdir", default="/tmp/profiler_gloo_window")
    p.add_argument("--rank-mode", default=None, help=argparse.SUPPRESS)  # set for the torchrun'd processes
    args = p.parse_args(argv)
    os.makedirs(args.workdir, exist_ok=True)
    if args.rank_mode:
        rank_main(args.rank_mode, args.workdir)
        return 0
    rows = []
    for mode in args.modes.split(","):
        codes = []
        for _ in range(args.runs):
            r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                                os.path.abspath(__file__), "--rank-mode", mode, "--workdir", args.workdir],
                               capture_output=True, text=True, timeout=300,
                               env=dict(os.environ, OMP_NUM_THREADS="1"))
            codes.append(r.returncode)
        rows.append({"mode": mode, "runs": len(codes), "finished": codes.count(0), "exit_codes": codes})
        print(f"| {mode} | {len(codes)} | {codes.count(0)} | {codes} |", flush=True)
    if args.out:
        import torch
        with open(args.out, "w") as f:
            json.dump({"bench": "profiler_gloo_window", "torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
