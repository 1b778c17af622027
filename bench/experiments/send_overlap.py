#!/usr/bin/env python3
"""Does an unreceived send slow the sender's compute? Two ranks: rank 0 times a workload while a feature-sized
point-to-point send to rank 1 is pending (rank 1 posts its receive only after --delay-s), against the same
workload alone.

Why: on the H200s a 1 + 1 job's target read ~100% busy while the drafter was the bottleneck (docs/benchmarks.md).
The target posts each message's NCCL send at once; the drafter receives it only when its next step starts, so a
send kernel is pending for most of the target's next capture. If that slows the capture, the capture's time
grows towards --delay-s; if not, it stays at its time alone.

Scenarios (median of --repeats each, the workload's host time to a synchronize):
  alone            the workload, nothing pending
  pending          the send posted just before the workload; the receive comes --delay-s later
  pending_alloc    as pending, and the allocator's cache emptied first: the workload's buffers come from new
                   device allocations (cudaMalloc / expandable-segment growth) while the send is pending
  pending_h2d      as pending, and the workload starts with a host-to-device copy of pageable token ids (as
                   the target loop's batch does)
  received         the receive posted first, then the send and the workload (the send completes at link speed)
  pending_side     as pending, the workload on its own (non-default, non-blocking) CUDA stream
  recv_pending     roles swapped: rank 0 posts a receive that rank 1's send matches only --delay-s later
  recv_pending_side  as recv_pending, the workload on its own stream

    torchrun --standalone --nproc-per-node 2 bench/experiments/send_overlap.py --out send_overlap.json
    torchrun ... bench/experiments/send_overlap.py --workload capture  # the packed, compiled Qwen3-8B-shaped capture
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: _common
import _common as C  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

SCENARIOS = ("alone", "pending", "pending_alloc", "pending_h2d", "received", "pending_side", "recv_pending", "recv_pending_side")


def gemm_workload(dev, tokens: int, hidden: int):
    """A capture-sized chain of matmuls: [tokens, hidden] through 8 layers of (hidden -> 3 hidden -> hidden)."""
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    g = torch.Generator(device="cpu").manual_seed(0)
    ws = [(torch.randn(hidden, 3 * hidden, generator=g).to(dev, dtype) / hidden ** 0.5,
           torch.randn(3 * hidden, hidden, generator=g).to(dev, dtype) / (3 * hidden) ** 0.5) for _ in range(8)]
    x0 = torch.randn(tokens, hidden, generator=g).to(dev, dtype)

    def run():
        x = x0
        for a, b in ws:
            x = torch.nn.functional.silu(x @ a) @ b
        return x
    return run, f"gemm chain [{tokens}, {hidden}] x 8 layers ({dtype})"


def capture_workload(dev, target: str, samples: int, length: int):
    """The trainer's capture: FeatureCapture over a packed batch of `samples` x `length` tokens."""
    from dflash_dist.config import default_layer_ids
    from dflash_dist.targets.hf import text_config
    from dflash_dist.roles.target_rank.capture import build_capture
    tcfg = C.target_config(target)
    model, _, _ = C.build_target_on_device(tcfg, dev)
    tc = text_config(model.config)
    layer_ids = tcfg.layer_ids or default_layer_ids(tc.num_hidden_layers, tcfg.num_feature_layers)
    cap = build_capture(tcfg, model, layer_ids, dev.type)
    packed = cap.packing
    lengths = torch.full((samples,), length, dtype=torch.long)
    ids = torch.randint(0, tc.vocab_size, (samples * length,), generator=torch.Generator().manual_seed(0))
    ids = (ids[None] if packed else ids.view(samples, length)).to(dev)
    return (lambda: cap(ids, lengths)), f"{target} capture, {cap.describe()}, {samples} x {length} tokens"


def timed(fn, dev, stream=None) -> float:
    """Host time from the launch to the end of the workload's own stream: a stream-level wait (as the target
    loop does), never torch.cuda.synchronize, which would also wait for the pending send on NCCL's stream."""
    if dev.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    stream = stream or torch.cuda.current_stream()
    stream.synchronize()
    t0 = time.perf_counter()
    with torch.cuda.stream(stream):
        fn()
        done = torch.cuda.Event()
        done.record(stream)
    done.synchronize()
    return time.perf_counter() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workload", choices=("gemm", "capture"), default="gemm")
    p.add_argument("--tokens", type=int, default=2200, help="gemm: tokens per pass (4 x 550)")
    p.add_argument("--hidden", type=int, default=4096, help="gemm: hidden size")
    p.add_argument("--target", default="qwen3_8b_random", help="capture: conf/target/<name>.yaml")
    p.add_argument("--samples", type=int, default=4, help="capture: samples per message")
    p.add_argument("--length", type=int, default=550, help="capture: tokens per sample")
    p.add_argument("--payload-mb", type=float, default=90.0, help="the pending send (4 x 550 tokens x 40 KB)")
    p.add_argument("--delay-s", type=float, default=0.5, help="how long rank 1 waits before receiving")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    cuda = torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_RANK", 0))
    dev = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if cuda else "gloo")
    ctrl = dist.new_group(backend="gloo")  # the barrier that lines the two ranks up, off the data path
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != 2:
        raise SystemExit("send_overlap: run with exactly 2 ranks (torchrun --nproc-per-node 2)")
    payload = torch.zeros(int(args.payload_mb * 2**20) // 2, dtype=torch.bfloat16, device=dev)

    if rank == 0:
        if args.workload == "gemm":
            work, what = gemm_workload(dev, args.tokens, args.hidden)
        else:
            work, what = capture_workload(dev, args.target, args.samples, args.length)
        for _ in range(3):  # warm: compile, autotune, allocator
            timed(work, dev)
        C.log(f"rank 0 workload: {what}; alone {1e3 * timed(work, dev):.1f} ms")
    side = torch.cuda.Stream() if cuda else None
    times = {s: [] for s in SCENARIOS}
    for rep in range(args.repeats):
        for scen in SCENARIOS:
            dist.barrier(group=ctrl)
            swapped = scen.startswith("recv_")  # rank 0 receives, rank 1 sends late
            if rank == 1:
                if scen == "alone":
                    continue
                if scen != "received":
                    time.sleep(args.delay_s)
                op = dist.isend if swapped else dist.irecv
                w = dist.batch_isend_irecv([dist.P2POp(op, payload, 0)])
                for x in w:
                    x.wait()
                C.sync(dev)
                continue
            if scen == "alone":
                times[scen].append(timed(work, dev))
                continue
            if scen == "received":
                time.sleep(0.05)  # rank 1's receive is posted by now
            if scen == "pending_alloc" and cuda:
                torch.cuda.empty_cache()
            op = dist.irecv if swapped else dist.isend
            pending = dist.batch_isend_irecv([dist.P2POp(op, payload, 1)])
            fn = (lambda: (torch.randint(0, 1000, (args.tokens,)).to(dev), work())) if scen == "pending_h2d" else work
            times[scen].append(timed(fn, dev, side if scen.endswith("_side") else None))
            for x in pending:
                x.wait()
            C.sync(dev)
    if rank == 0:
        alone = C.median(times["alone"])
        rows = [{"scenario": s, "median_ms": 1e3 * C.median(times[s]), "min_ms": 1e3 * min(times[s]),
                 "vs_alone": C.median(times[s]) / alone} for s in SCENARIOS]
        print(C.table(rows, [("scenario", "scenario"), ("median_ms", "median ms"), ("min_ms", "min ms"),
                             ("vs_alone", "x alone")]))
        print(f"receiver delay {1e3 * args.delay_s:.0f} ms: a pending row near it means the send held the workload back")
        if args.out:
            C.write_json(args.out, {"bench": "send_overlap", "env": C.env_info(dev), "workload": what,
                                    "payload_mb": args.payload_mb, "delay_s": args.delay_s,
                                    "repeats": args.repeats, "rows": rows, "times_s": times})
    dist.barrier(group=ctrl)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
