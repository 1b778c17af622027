"""The ranks of a target replica measure its supply together: every forward is a collective, so they must run the
same number of timed rounds even when their clocks disagree on when ``plan_min_seconds`` is reached."""

from __future__ import annotations

import multiprocessing as mp
import os

from helpers.launch_util import free_port


def _replica_rank(rank: int, port: int, per_pass: float, agree: bool, out) -> None:
    import torch
    import torch.distributed as dist

    from dflash_dist.comm.distributed import any_rank
    from dflash_dist.planning.split import timed_rounds
    os.environ.update(OMP_NUM_THREADS="1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    group = dist.new_group([0, 1])
    now = [0.0]

    def one_pass():  # a replica's forward: an all-reduce both ranks must enter
        dist.all_reduce(torch.ones(1), group=group)
        now[0] += per_pass

    secs = timed_rounds(one_pass, 2, 1.0, clock=lambda: now[0],
                        agree=(lambda more: any_rank(more, group, torch.device("cpu"))) if agree else None)
    out.put((rank, len(secs)))
    dist.destroy_process_group()


def _run_replica(agree: bool, timeout_s: float) -> dict:
    ctx, port = mp.get_context("spawn"), free_port()
    out = ctx.Queue()
    # rank 0's clock reaches 1 s after 2 rounds, rank 1's after 8: alone, rank 1 would wait in round 3 forever
    procs = [ctx.Process(target=_replica_rank, args=(r, port, per_pass, agree, out))
             for r, per_pass in ((0, 0.5), (1, 0.125))]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout_s)
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        p.kill()
        p.join()
    counts = {}
    while not out.empty():
        rank, n = out.get()
        counts[rank] = n
    return {"hung": len(hung), "exitcodes": [p.exitcode for p in procs], "rounds": counts}


def test_the_ranks_of_a_replica_agree_on_the_number_of_timed_rounds():
    r = _run_replica(agree=True, timeout_s=120)
    assert r["hung"] == 0 and r["exitcodes"] == [0, 0], r
    assert r["rounds"] == {0: 8, 1: 8}, r  # until the slowest clock has its plan_min_seconds


def test_without_agreeing_the_ranks_of_a_replica_hang_or_fail():
    """What the agreement prevents: rank 0 stops after 2 rounds, rank 1 waits in the third round's collective
    (until rank 0's exit breaks it, or forever)."""
    r = _run_replica(agree=False, timeout_s=20)
    assert r["rounds"].get(0) == 2 and 1 not in r["rounds"], r
    assert r["hung"] or r["exitcodes"][1] != 0, r
