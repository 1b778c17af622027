#!/usr/bin/env python3
"""Every byte of every message arrives, with receives allocated while a step still reads the last one (GPU check).

After each message the drafter rank queues a slow matmul chain and only then an exact digest of the message
(integer sums of the raw bits, weighted by position) on its compute stream, drops the message and posts the next
receive while the chain still runs. The target rank makes each message on its GPU from a seed (fixed shape: every
buffer has the size of the one just freed); the drafter regenerates it from the same seed and compares digests.

    torchrun --standalone --nproc-per-node 2 bench/transport_check.py --out transport_check.json

On CPU (gloo, no streams) it runs the same protocol with small messages.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from dflash_dist.comm.transport import Channel, EndOfStream, Message, Receiver, Sender  # noqa: E402


def make_message(k: int, dev: torch.device, samples: int, length: int, width: int) -> Message:
    g = torch.Generator(device=dev).manual_seed(1000 + k)
    t = samples * length
    cu = torch.arange(samples + 1, dtype=torch.long) * length
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    return Message(index=k, sample_ids=torch.arange(samples) + samples * k, cu_seqlens=cu,
                   input_ids=torch.randint(0, 150_000, (t,), generator=g, device=dev).cpu(),
                   loss_mask=(torch.rand(t, generator=g, device=dev) > 0.3).cpu(),
                   features=torch.randn(t, width, generator=g, device=dev, dtype=dtype))


def digest(msg: Message) -> torch.Tensor:
    """Exact, order-sensitive: int64 sums of the raw bits of features and ids, weighted by position."""
    f = msg.features.contiguous().view(-1)
    bits = f.view(torch.int16 if f.element_size() == 2 else torch.int32).long()
    w = torch.arange(bits.numel(), device=bits.device) % 1009 + 1
    ids = msg.input_ids.to(bits.device)
    wi = torch.arange(ids.numel(), device=bits.device) % 101 + 1
    return torch.stack([(bits * w).sum(), (ids * wi).sum(), msg.loss_mask.to(bits.device).long().sum()])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--messages", type=int, default=200)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--length", type=int, default=550)
    p.add_argument("--width", type=int, default=5 * 4096, help="features per token (Qwen3-8B: 5 x 4096)")
    p.add_argument("--max-in-flight", type=int, default=4)
    p.add_argument("--slow-matmuls", type=int, default=12, help="matmuls queued before each digest")
    p.add_argument("--rendezvous", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--connect", action=argparse.BooleanOptionalAction, default=True,
                   help="connect the pair before the first message, as the trainer does (Channel.connect)")
    p.add_argument("--hang-s", type=float, default=40.0,
                   help="a rank still running after this many seconds prints every thread's stack and exits")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    faulthandler.dump_traceback_later(args.hang_s, exit=True)  # a hang names where it waits

    cuda = torch.cuda.is_available()
    if cuda:  # eager NCCL init, as the trainer does: a lazily created pair communicator would block the first
        # receive until the sender joins, and the sender waits for that receive (rendezvous)
        local = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=local)
    else:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != 2:
        raise SystemExit("run with --nproc-per-node 2 (rank 1 sends, rank 0 receives)")
    dev = C.pick_device()
    if not cuda:  # small messages on CPU
        args.length, args.width, args.messages = min(args.length, 40), min(args.width, 64), min(args.messages, 60)
    ctrl = dist.new_group(backend="gloo")
    store = dist.distributed_c10d._get_default_store() if args.rendezvous else None
    ch = Channel(ctrl, dist.group.WORLD, dev, timeout_s=120, store=store)
    if args.connect:  # as the trainer does (without it the first payload receive hung on 2x H200)
        ch.connect([1 - rank], sending=rank == 1)
    res = {"bench": "transport_check", "env": C.env_info(dev), "args": vars(args), "transport": ch.describe()}
    t0 = time.monotonic()
    if rank == 1:  # target
        tx = Sender(ch, rank, args.max_in_flight)
        for k in range(args.messages):
            msg = make_message(k, dev, args.samples, args.length, args.width)
            if cuda:
                tx.wait_event(torch.cuda.current_stream().record_event())
            tx.send(0, msg)
        tx.send_end(0)
        tx.flush()
        res["sent"] = args.messages
    else:  # drafter
        rx = Receiver(ch, rank)
        n = 4096 if cuda else 256  # a ~1.5 ms matmul on an H200
        x = torch.randn(n, n, device=dev, dtype=torch.bfloat16 if cuda else torch.float32) / n ** 0.5
        digests, want = [], []
        pending = rx.post(1, 0)
        for k in range(args.messages):
            msg = pending.complete()
            y = x
            for _ in range(args.slow_matmuls if cuda else 1):  # the queued step that reads the message late
                y = y @ x
            digests.append(digest(msg) + (y[0, 0] * 0).long())
            del msg
            pending = rx.post(1, k + 1 if k + 1 < args.messages else -1)
            pending.advance()  # the next receive is allocated now, while the chain still runs
            want.append(digest(make_message(k, dev, args.samples, args.length, args.width)))
            if k % 50 == 0:
                print(f"drafter rank: message {k} received at {time.monotonic() - t0:.1f} s", flush=True)
        end = pending.complete()
        got, ref = torch.stack(digests).cpu(), torch.stack(want).cpu()
        bad = [k for k in range(args.messages) if not torch.equal(got[k], ref[k])]
        res.update(received=args.messages, corrupted=len(bad), corrupted_first=bad[:10],
                   end_of_stream=isinstance(end, EndOfStream))
    res["seconds"] = round(time.monotonic() - t0, 2)
    dist.barrier(group=ctrl)
    if rank == 0:
        rows = [{"transport": res["transport"], "rendezvous": args.rendezvous, "messages": res["received"],
                 "corrupted": res["corrupted"], "s": res["seconds"]}]
        print(C.table(rows, [("transport", "payloads"), ("rendezvous", "rendezvous"), ("messages", "messages"),
                             ("corrupted", "corrupted"), ("s", "seconds")],
                      "transport check (drafter rank)"), flush=True)
        if args.out:
            C.write_json(args.out, res)
    dist.destroy_process_group()
    faulthandler.cancel_dump_traceback_later()
    return 0 if rank != 0 or (res["corrupted"] == 0 and res["end_of_stream"]) else 1


if __name__ == "__main__":
    sys.exit(main())
