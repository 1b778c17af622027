"""Transport under torchrun (gloo): random shapes and dtypes, 1,000 messages, every split, end-of-stream."""

import json

import pytest
import torch
from helpers.launch_util import torchrun

from dflash_dist.comm.transport import Message, TransportError, meta_len, pack_meta, unpack_labels, unpack_meta


# one target to one drafter, several targets to one drafter (ENDs from each), one target round-robin over several
# drafters, and several on both sides either way (3+2, 2+3); the posted-at-once mode on the smallest and a mixed split
@pytest.mark.parametrize("targets,drafters,rendezvous", [(1, 1, True), (3, 1, True), (1, 3, True), (3, 2, True),
                                                        (2, 3, True), (1, 1, False), (2, 3, False)])
def test_stream_every_split(tmp_path, targets, drafters, rendezvous):
    world = targets + drafters
    messages = 1000
    r = torchrun(world, ["tests/helpers/transport_worker.py", "--targets", targets, "--messages", messages,
                         "--max-in-flight", 2, "--out", tmp_path] + (["--rendezvous"] if rendezvous else []),
                 timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    reports = [json.load(open(tmp_path / f"rank{i}.json")) for i in range(world)]
    drafter_reports = [x for x in reports if x["role"] == "drafter"]
    assert len(drafter_reports) == drafters
    for x in reports:  # every target connected to every drafter first, and the other way round
        want = [y["rank"] for y in reports if y["role"] != x["role"]]
        assert x["connected"] == want, (x["rank"], x["connected"])
    got = sorted(j for x in drafter_reports for j in x["received"])
    assert got == list(range(messages)), "every message exactly once"
    for x in drafter_reports:
        assert x["errors"] == [], f"rank {x['rank']}: corrupted messages {x['errors'][:5]}"
        assert x["received"] == sorted(x["received"])
        assert x["ends"] == targets, "END from every target"
        # balanced: every drafter gets every D-th message (never idle while samples remain)
        assert len(x["received"]) in (messages // drafters, -(-messages // drafters))
    target_reports = [x for x in reports if x["role"] == "target"]
    assert all(x["early_posts"] == 0 for x in target_reports), "a payload posted before its receive"
    if rendezvous:  # the drafters' slow steps made the targets hold payloads back
        assert max(x["max_staged"] for x in target_reports) >= 1


def test_meta_roundtrip():
    ids = torch.randint(0, 100, (7,))
    mask = torch.rand(7) > 0.5
    cu = torch.tensor([0, 3, 7])
    sid = torch.tensor([5, 9])
    out = unpack_meta(pack_meta(sid, cu, ids, mask), 2, 7)
    for a, b in zip(out, (sid, cu, ids, mask)):
        assert torch.equal(a, b)


def test_meta_carries_the_target_labels_after_the_rest():
    ids, mask, cu, sid = torch.arange(7), torch.ones(7, dtype=torch.bool), torch.tensor([0, 3, 7]), torch.tensor([1, 2])
    labels = torch.randint(0, 100, (7, 3))
    meta = pack_meta(sid, cu, ids, mask, labels)
    assert meta.numel() == meta_len(2, 7, 3) == meta_len(2, 7) + 21
    assert torch.equal(unpack_labels(meta, 2, 7, 3), labels)
    assert unpack_labels(pack_meta(sid, cu, ids, mask), 2, 7, 0) is None
    for a, b in zip(unpack_meta(meta, 2, 7), (sid, cu, ids, mask)):
        assert torch.equal(a, b)


def test_message_validate_rejects_bad_label_shapes():
    m = Message(0, torch.arange(1), torch.tensor([0, 5]), torch.zeros(5, dtype=torch.long),
                torch.zeros(5, dtype=torch.bool), torch.zeros(5, 8), target_ids=torch.zeros(4, 1, dtype=torch.long))
    with pytest.raises(TransportError):
        m.validate()
    m.target_ids = torch.zeros(5, 2, dtype=torch.long)
    m.validate()
    m.target_probs = torch.zeros(5, 3)
    with pytest.raises(TransportError):
        m.validate()


def test_message_validate_rejects_bad_shapes():
    m = Message(0, torch.arange(2), torch.tensor([0, 3, 5]), torch.zeros(5, dtype=torch.long),
                torch.zeros(5, dtype=torch.bool), torch.zeros(4, 8))
    with pytest.raises(TransportError):
        m.validate()


def test_message_build_is_checked_where_it_is_made():
    """Message.build: sample ids from a plan's list, cu_seqlens from the lengths, and a malformed message refused
    at construction (not at its send)."""
    cu = Message.cu_of(torch.tensor([3, 2]))
    assert cu.tolist() == [0, 3, 5] and cu.dtype == torch.long
    m = Message.build(7, [4, 9], cu, torch.zeros(5, dtype=torch.long), torch.ones(5, dtype=torch.bool),
                      torch.zeros(5, 8), src=2, sender_stats=(1, 2))
    assert (m.index, m.sample_ids.tolist(), m.src, m.sender_stats, m.num_tokens) == (7, [4, 9], 2, [1, 2], 5)
    with pytest.raises(TransportError, match="message 7: inconsistent shapes"):
        Message.build(7, [4, 9], cu, torch.zeros(5, dtype=torch.long), torch.ones(5, dtype=torch.bool),
                      torch.zeros(4, 8))
    with pytest.raises(TransportError, match="target labels"):
        Message.build(7, [4, 9], cu, torch.zeros(5, dtype=torch.long), torch.ones(5, dtype=torch.bool),
                      torch.zeros(5, 8), target_ids=torch.zeros(4, 1, dtype=torch.long))


def test_rendezvous_setting(monkeypatch):
    """topology.tuning.rendezvous_sends: null is on exactly over NCCL; true/false win over the backend."""
    from dflash_dist.comm import transport
    monkeypatch.setattr(transport.dist, "get_backend", lambda group: group)  # the "group" names its backend here
    assert transport.use_rendezvous(None, "nccl") and not transport.use_rendezvous(None, "gloo")
    assert transport.use_rendezvous(True, "gloo") and not transport.use_rendezvous(False, "nccl")


def test_job_channel_from_topology_config(monkeypatch):
    """A job's channel: the warm-up timeout first, rendezvous as configured (null: by backend); payloads posted from
    the current stream (on CPU the log says there are no CUDA streams)."""
    from types import SimpleNamespace

    from dflash_dist.comm import transport
    from dflash_dist.config import TopologyConfig
    monkeypatch.setattr(transport.dist, "get_backend", lambda group: group)
    d = SimpleNamespace(ctrl="gloo", data="nccl", device=torch.device("cpu"), store="the store")
    ch = transport.job_channel(d, TopologyConfig(warmup_timeout_s=123.0))
    assert ch.store == "the store" and ch.timeout_s == 123.0
    assert not hasattr(ch, "stream") and ch.describe() == "posted from the host (no CUDA streams)"
    d.data = "gloo"
    assert transport.job_channel(d, TopologyConfig()).store is None
    assert transport.job_channel(d, TopologyConfig(tuning={"rendezvous_sends": True})).store == "the store"
    assert not hasattr(TopologyConfig(), "comm_streams")  # measured no gain: not a job setting


def test_poll_does_idle_work_instead_of_sleeping():
    """A wait with other work does that work a piece at a time until the awaited thing happens, checking it
    between pieces; without work (idle says False) it sleeps as before; the timeout still holds."""
    from dflash_dist.comm.transport import poll_until
    pieces, checks = [], iter([False, False, False, True])
    assert poll_until(lambda: next(checks), 5.0, idle=lambda: pieces.append(1) or True)
    assert len(pieces) == 3  # one piece per unanswered check, none after the answer
    assert not poll_until(lambda: False, 0.05, idle=lambda: False)  # nothing to do: sleeps, then times out
