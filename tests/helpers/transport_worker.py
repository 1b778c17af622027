"""Worker for tests/unit/comm/test_transport.py, run under torchrun (gloo).

Targets send `--messages` random messages (random sample counts, lengths, widths and dtypes, derived from
the message index so the receiver can recompute and check every byte) along the topology's schedule, then
END to every drafter. Drafters receive their messages in order with receives posted ahead and check them.
Each rank writes a JSON report with what it saw.
"""

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: the helpers package
from helpers.worker_exit import finish  # noqa: E402

from dflash_dist.comm.topology import Topology
from dflash_dist.comm.transport import Channel, EndOfStream, Message, Receiver, Sender, posted_key

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def make_message(k: int) -> Message:
    g = torch.Generator().manual_seed(k)
    n = int(torch.randint(1, 5, (1,), generator=g))
    lens = torch.randint(1, 40, (n,), generator=g)
    t = int(lens.sum())
    width = int(torch.randint(1, 48, (1,), generator=g))
    dtype = DTYPES[int(torch.randint(0, 3, (1,), generator=g))]
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
    msg = Message(index=k, sample_ids=torch.arange(n) + 10 * k, cu_seqlens=cu,
                  input_ids=torch.randint(0, 50000, (t,), generator=g),
                  loss_mask=torch.rand(t, generator=g) > 0.5,
                  features=torch.randn(t, width, generator=g).to(dtype))
    # the target's labels on two of three messages: greedy ids only, or a top-k distribution
    label_k = (0, 1, int(torch.randint(1, 6, (1,), generator=g)))[k % 3]
    if label_k:
        msg.target_ids = torch.randint(0, 50000, (t, label_k), generator=g)
    if k % 3 == 2:
        msg.target_probs = torch.rand(t, label_k, generator=g)
    return msg


def same_labels(a, b) -> bool:
    return all((x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
               for x, y in ((a.target_ids, b.target_ids), (a.target_probs, b.target_probs)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--targets", type=int, required=True)
    ap.add_argument("--messages", type=int, default=1000)
    ap.add_argument("--max-in-flight", type=int, default=3)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rendezvous", action="store_true", help="payload sends wait for the posted receive (store)")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    topo = Topology(dist.get_world_size(), dist.get_rank(), args.targets)
    ctrl = dist.new_group(backend="gloo")
    store = dist.distributed_c10d._get_default_store() if args.rendezvous else None
    ch = Channel(ctrl, None, torch.device("cpu"), timeout_s=60, store=store)
    report = {"rank": topo.rank, "role": topo.role, "received": [], "ends": 0, "errors": [], "early_posts": 0,
              "max_staged": 0}
    target = topo.role == "target"
    report["connected"] = ch.connect(topo.drafter_ranks if target else topo.target_ranks, sending=target)
    t0 = time.time()
    if topo.role == "target":
        tx = Sender(ch, topo.rank, args.max_in_flight)
        for j in topo.target_messages(args.messages):
            dst = topo.drafter_for(j)
            tx.send(dst, make_message(j), stats=(j,))
            if store is not None:
                # the rendezvous invariant: never a payload posted before its receive
                report["early_posts"] += tx._posted.get(dst, 0) > store.add(posted_key(topo.rank, dst), 0)
                report["max_staged"] = max(report["max_staged"], tx._staged.get(dst, 0))
        for d in topo.drafter_ranks:
            tx.send_end(d)
        tx.flush()
    else:
        rx = Receiver(ch, topo.rank)
        mine = list(topo.drafter_messages(args.messages))
        pending = rx.post(topo.target_for(mine[0]), mine[0]) if mine else None
        for i, j in enumerate(mine):
            if args.rendezvous and j % 97 == 0:
                time.sleep(0.05)  # a slow step now and then: the targets stage payloads and wait on backpressure
            msg = pending.complete()
            if i + 1 < len(mine):
                pending = rx.post(topo.target_for(mine[i + 1]), mine[i + 1])
                pending.advance()
            ref = make_message(j)
            ok = (msg.index == j and msg.features.dtype == ref.features.dtype
                  and torch.equal(msg.features, ref.features) and torch.equal(msg.input_ids, ref.input_ids)
                  and torch.equal(msg.loss_mask, ref.loss_mask) and torch.equal(msg.cu_seqlens, ref.cu_seqlens)
                  and torch.equal(msg.sample_ids, ref.sample_ids) and msg.src == topo.target_for(j)
                  and same_labels(msg, ref))
            if not ok:
                report["errors"].append(j)
            report["received"].append(j)
        for t in topo.target_ranks:
            if isinstance(rx.post(t).complete(), EndOfStream):
                report["ends"] += 1
    report["seconds"] = time.time() - t0
    with open(os.path.join(args.out, f"rank{topo.rank}.json"), "w") as f:
        json.dump(report, f)
    finish()  # helpers/worker_exit.py: no interpreter finalization racing gloo's threads


if __name__ == "__main__":
    main()
