"""Rank-to-rank streaming of target hidden states.

A message (``comm/message.py``) is a micro-batch of whole samples, packed: sample ids, cu_seqlens, token ids, loss
mask and the selected features [tokens, n_layers*H]. On the wire it is three point-to-point sends:

1. a fixed-size int64 header over a gloo *control* group (CPU), followed there by the cu_seqlens. The
   receiver learns shape, dtype and kind (and the sample boundaries it needs to build a step) on the host
   without touching a CUDA stream, and gloo aborts on a too-small buffer or silently accepts a wrong one,
   so every payload buffer is allocated from the header, never guessed;
2. an int64 *meta* tensor (ids, cu_seqlens, tokens, mask; with the target's labels also their ids [T, k]),
3. the features and, with a top-k distribution (``drafter.loss.kind=kl``), its probabilities [T, k] fp32, all
   over the *data* group (NCCL on GPU, gloo on CPU).

Backpressure: a sender keeps at most ``max_in_flight`` unfinished messages per destination and waits on
the oldest before sending more. Receivers post the next header ahead of the current step and post the
payload as soon as that header lands, so transfer overlaps compute. No Python threads: gloo and NCCL
progress on their own C++ threads; we only poll ``Work.is_completed``.

Rendezvous (``Channel.store`` set): the sender posts a payload only once the receiver has posted the matching receive.
An NCCL send posted earlier runs as a kernel that spins on the sender's GPU until the receive comes; on an H200 that
made the target's capture slower (measured: docs/benchmarks.md#rendezvous-sends), and a 1 + 1 job's target spent most
of each drafter step in a slowed capture. So the header goes at once (gloo), the payload is staged, the receiver adds
1 to a per-link counter in the rendezvous store after posting its receive, and the sender posts staged payloads up to
that count whenever it polls (``Sender.pump``: between captures, while it waits for its GPU, while it waits on
backpressure). NCCL matches the two sides' point-to-point operations per pair in posting order, and both sides count
the same payloads, so the counter is all they share.

Payloads are posted from the current (compute) stream. A stream of their own measured no gain in a job
(docs/benchmarks.md#rendezvous-sends) and needs ``record_stream`` on every received buffer, so there is none.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Optional

import torch
import torch.distributed as dist

from dflash_dist.comm.message import (  # noqa: F401  (the wire's names, re-exported: callers import them here)
    CODE_DTYPES,
    DTYPE_CODES,
    H_DTYPE,
    H_ERRLEN,
    H_INDEX,
    H_KIND,
    H_LABEL_K,
    H_LABEL_PROBS,
    H_MAGIC,
    H_METALEN,
    H_NSAMPLES,
    H_NTOKENS,
    H_SRC,
    H_STATS,
    H_WIDTH,
    HEADER_LEN,
    KIND_DATA,
    KIND_END,
    KIND_ERROR,
    MAGIC,
    N_STATS,
    EndOfStream,
    Message,
    RemoteError,
    TransportError,
    meta_len,
    pack_meta,
    unpack_labels,
    unpack_meta,
)


def _wait(work, what: str, timeout_s: float, check: Optional[Callable[[], None]], pollable: bool = True,
          idle: Optional[Callable[[], bool]] = None) -> None:
    """Block on a Work so that a dead or silent peer becomes an error that names it, not a hang.

    NCCL works can be polled (``is_completed`` queries a CUDA event), so we poll and run ``check`` (the
    liveness probe) every half second. gloo send/recv works never report completion before ``wait`` and
    a timed-out gloo ``wait`` tears the pair down, so there we block once with the full timeout; a peer
    that dies closes its TCP connection and gloo raises at once.
    """
    if not pollable:
        try:
            work.wait(timedelta(seconds=timeout_s))
        except RuntimeError as e:
            raise TransportError(f"while waiting for {what}: {str(e).splitlines()[0][:300]}") from e
        return
    if not poll_until(work.is_completed, timeout_s, check, idle=idle):
        raise TransportError(f"timed out after {timeout_s:.0f} s waiting for {what}")
    work.wait()


def poll_until(done: Callable[[], bool], timeout_s: float, check: Optional[Callable[[], None]] = None,
          max_sleep: float = 2e-3, idle: Optional[Callable[[], bool]] = None) -> bool:
    """Call ``done`` until it says True, sleeping 10 us growing to ``max_sleep`` in between and running ``check``
    (the liveness probe) every half second. ``idle``: called instead of sleeping; it does one short piece of other
    work and says whether there was any. False once ``timeout_s`` has passed."""
    start = last_check = time.monotonic()
    sleep = 1e-5
    while not done():
        now = time.monotonic()
        if now - start > timeout_s:
            return False
        if check is not None and now - last_check > 0.5:
            check()
            last_check = now
        if idle is not None and idle():
            continue
        time.sleep(sleep)
        sleep = min(sleep * 2, max_sleep)
    return True


def _batched(op, tensors, peer: int, group) -> list:
    """Payload sends/receives as one batched P2P call: NCCL treats unbatched P2P ops on an eagerly
    initialised group as collectives serialised with everything else on it (the compute stream then
    stalls behind a send the peer has not taken yet)."""
    return dist.batch_isend_irecv([dist.P2POp(op, t, peer, group) for t in tensors])


RENDEZVOUS_GRACE_S = 0.005  # how long a sender waits, right after a header, for the drafter to post its receive


def use_rendezvous(setting: Optional[bool], data_group) -> bool:
    """``topology.tuning.rendezvous_sends``: None means on exactly when the payloads travel over NCCL."""
    if setting is not None:
        return bool(setting)
    return dist.get_backend(data_group) == "nccl"


def job_channel(d, topology, check: Optional[Callable[[], None]] = None, serve_heads: bool = False) -> "Channel":
    """The channel of a training job's rank: ``d`` its distributed setup (groups, device, store), ``topology``
    the TopologyConfig (warm-up timeout first, rendezvous sends). ``serve_heads``
    (drafter.tuning.loss_on_target): rendezvous sends whatever the backend, so a target can serve head requests
    while it waits for its drafters (a waiting gloo send cannot be polled)."""
    rendezvous = serve_heads or use_rendezvous(topology.tuning.rendezvous_sends, d.data)
    return Channel(d.ctrl, d.data, d.device, timeout_s=topology.warmup_timeout_s, check=check,
                   store=d.store if rendezvous else None)


def posted_key(src: int, dst: int) -> str:
    """Store counter: payload receives that rank ``dst`` has posted for rank ``src`` (rendezvous sends)."""
    return f"dflash/recv_posted/{src}-{dst}"


class Channel:
    """The two groups one link uses, how long to wait on a peer and, for rendezvous sends, the store."""

    def __init__(self, ctrl_group, data_group, device: torch.device, timeout_s: float = 60.0,
                 check: Optional[Callable[[], None]] = None, store=None):
        self.ctrl_group, self.data_group = ctrl_group, data_group
        self.device = torch.device(device)
        self.timeout_s = timeout_s
        self.check = check
        self.store = store  # None: payloads are sent at once

    def connect(self, peers, sending: bool) -> list[int]:
        """A one-element batched exchange with every peer on the payloads' group, made by both ends at startup
        (targets ``sending`` to all their drafters, drafters receiving from all their targets; one batch each,
        so any order of arrival pairs up). A pair's first NCCL point-to-point call can block until the peer
        makes its own: then a drafter's first payload receive blocks before it can post its rendezvous count,
        while the sender waits for that count (bench/transport_check.py hung so on 2x H200). The trainer's jobs ran without it, their ranks having exchanged weights point to
        point first (not isolated); connecting here makes the first payload depend on nothing else. Returns the
        peers, in order."""
        peers = sorted(int(p) for p in peers)
        if not peers:
            return peers
        op = dist.isend if sending else dist.irecv
        bufs = [torch.full((1,), float(sending), device=self.device) for _ in peers]
        works = dist.batch_isend_irecv([dist.P2POp(op, b, p, self.data_group) for b, p in zip(bufs, peers)])
        for w, p in zip(works, peers):
            self.wait(w, f"rank {p} to connect ({'send' if sending else 'receive'} side)", group=self.data_group)
        return peers

    def describe(self) -> str:
        if self.device.type != "cuda":
            return "posted from the host (no CUDA streams)"
        return "on the compute stream"

    def _pollable(self, group) -> bool:
        return dist.get_backend(group) != "gloo"

    def wait(self, work, what: str, host: bool = True, group=None, idle: Optional[Callable[[], bool]] = None) -> None:
        """host=False on CUDA: only make the current stream wait (no host block) for payload receives. ``idle``:
        other work to do in pieces meanwhile (only where the wait can be polled)."""
        if not host and self.device.type == "cuda":
            work.wait()
        else:
            _wait(work, what, self.timeout_s, self.check, self._pollable(group), idle=idle)

    def can_idle(self) -> bool:
        """Whether a sender's backpressure waits can be polled (and so do other work meanwhile): rendezvous sends
        poll the store; NCCL works answer is_completed; gloo works block."""
        return self.store is not None or self._pollable(self.data_group)

    def done(self, work, group) -> bool:
        """Non-blocking completion test; gloo point-to-point works cannot answer it, so they say False."""
        return self._pollable(group) and work.is_completed()


@dataclass
class _Outgoing:
    """One message on its way to a destination."""
    works: list                      # (Work, group) pairs: header and cu_seqlens, then the payload once posted
    buffers: tuple                   # every tensor the works read, kept alive until they complete
    staged: Optional[tuple] = None   # the payload (meta, feats[, probs]) until it is posted
    data: bool = True                # a data message (END is not): counts as taken once complete


class Sender:
    """Target side: bounded in-flight isends to any number of destinations."""

    def __init__(self, channel: Channel, rank: int, max_in_flight: int = 4):
        self.ch, self.rank, self.max_in_flight = channel, rank, max_in_flight
        self._inflight: dict[int, deque] = {}  # per destination, oldest first: _Outgoing
        self.taken: dict[int, int] = {}  # data messages each destination is known to have received
        self._staged: dict[int, int] = {}  # payloads staged, not yet posted, per destination
        self._posted: dict[int, int] = {}  # payloads posted so far, per destination
        self.wait_s = 0.0  # time spent blocked on backpressure (less the idle work done meanwhile)
        self.bytes_sent = 0
        # other work done in pieces while blocked on backpressure (the in-training evaluation); says whether it did
        # any. Only there: right after a header or during a capture the GPU is not idle.
        self.idle_work: Optional[Callable[[], bool]] = None
        self.idle_work_s = 0.0
        # served first while blocked: the drafters' head requests (drafter.tuning.loss_on_target), timed by their server
        self.serve: Optional[Callable[[], bool]] = None
        self.serve_s = 0.0

    def idle_between(self) -> bool:
        """One piece of idle work while the caller waits on something else (a target waiting for head requests):
        post the staged payloads whose receives are posted, then a piece of ``idle_work``."""
        if self.ch.store is not None:
            self.pump()
        return self._idle(serve=False)

    def _idle(self, serve: bool = True) -> bool:
        t0 = time.monotonic()
        if serve and self.serve is not None and self.serve():
            self.serve_s += time.monotonic() - t0
            return True
        did = self.idle_work is not None and self.idle_work()
        if did:
            self.idle_work_s += time.monotonic() - t0
        return did

    def _header(self, kind: int, index: int = -1, stats=()) -> torch.Tensor:
        h = torch.zeros(HEADER_LEN, dtype=torch.int64)
        h[H_MAGIC], h[H_KIND], h[H_INDEX], h[H_SRC] = MAGIC, kind, index, self.rank
        for i, v in enumerate(list(stats)[:N_STATS]):
            h[H_STATS + i] = int(v)
        return h

    def _post_payload(self, dst: int, out: _Outgoing) -> None:
        works = _batched(dist.isend, out.staged, dst, self.ch.data_group)
        out.works += [(w, self.ch.data_group) for w in works]
        out.staged = None
        self._staged[dst] -= 1
        self._posted[dst] = self._posted.get(dst, 0) + 1

    def pump(self) -> None:
        """Post the staged payloads whose receives are posted (one store read per destination with any staged)."""
        for dst, n in self._staged.items():
            if n == 0:
                continue
            receives = self.ch.store.add(posted_key(self.rank, dst), 0)
            for out in self._inflight[dst]:
                if self._posted.get(dst, 0) >= receives:
                    break
                if out.staged is not None:
                    self._post_payload(dst, out)

    def wait_event(self, event) -> None:
        """Wait for a CUDA event (the end of a capture) and keep posting ready payloads meanwhile, so that a
        drafter's posted receive is never left waiting for this rank's whole forward."""
        if self.ch.store is None or not any(self._staged.values()):
            event.synchronize()
            return

        def finished() -> bool:
            self.pump()
            return event.query()
        # a posted receive waits at most max_sleep (plus a store read) for its payload
        poll_until(finished, float("inf"), max_sleep=5e-4)

    def _throttle(self, dst: int, limit: int) -> None:
        q = self._inflight.setdefault(dst, deque())
        if self.ch.store is not None:
            self.pump()
        while q and q[0].staged is None and all(self.ch.done(w, g) for w, g in q[0].works):
            self._count_taken(dst, q.popleft())
        t0, idle0 = time.monotonic(), self.idle_work_s + self.serve_s
        while len(q) >= limit:
            if q[0].staged is not None:
                self._await_receive(dst, q[0])
            out = q.popleft()
            for w, g in out.works:
                self.ch.wait(w, f"drafter rank {dst} to take a message from target rank {self.rank}", group=g,
                             idle=self._idle)
            self._count_taken(dst, out)
        self.wait_s += time.monotonic() - t0 - (self.idle_work_s + self.serve_s - idle0)

    def _count_taken(self, dst: int, out: _Outgoing) -> None:
        if out.data:
            self.taken[dst] = self.taken.get(dst, 0) + 1

    def all_took(self, n: int) -> bool:
        """Every destination sent to so far is known to have received at least ``n`` data messages."""
        return bool(self._inflight) and all(self.taken.get(d, 0) >= n for d in self._inflight)

    def _await_receive(self, dst: int, out: _Outgoing, grace_s: Optional[float] = None) -> None:
        """Poll the store until the drafter has posted the receive of a staged payload (backpressure: up to the
        channel's timeout, then an error), or for at most ``grace_s`` (right after a header: a drafter that is
        waiting for the message answers within a millisecond; a busy one is not waited for)."""
        def posted() -> bool:
            self.pump()
            return out.staged is None
        if grace_s is not None:
            poll_until(posted, grace_s, max_sleep=2e-4)
        elif not poll_until(posted, self.ch.timeout_s, self.ch.check, idle=self._idle):
            raise TransportError(f"timed out after {self.ch.timeout_s:.0f} s waiting for drafter rank {dst} "
                                 f"to post the receive of a message from target rank {self.rank}")

    def send(self, dst: int, msg: Message, stats=()) -> None:
        msg.validate()
        self._throttle(dst, self.max_in_flight)
        feats = msg.features.contiguous()
        if feats.dtype not in DTYPE_CODES:
            raise TransportError(f"cannot send features of dtype {feats.dtype}")
        h = self._header(KIND_DATA, msg.index, stats)
        n, t = msg.num_samples, msg.num_tokens
        h[H_NSAMPLES], h[H_NTOKENS], h[H_WIDTH] = n, t, feats.shape[1]
        h[H_DTYPE], h[H_METALEN] = DTYPE_CODES[feats.dtype], meta_len(n, t, msg.label_k)
        h[H_LABEL_K], h[H_LABEL_PROBS] = msg.label_k, int(msg.target_probs is not None)
        meta = pack_meta(msg.sample_ids, msg.cu_seqlens, msg.input_ids, msg.loss_mask,
                         msg.target_ids).to(self.ch.device)
        feats = feats.to(self.ch.device)
        probs = () if msg.target_probs is None else (msg.target_probs.to(self.ch.device, torch.float32).contiguous(),)
        payload = (meta, feats) + probs
        # cu_seqlens also travel on the host channel right behind the header: the drafter needs them on the host
        # to build the step, and reading them from a device tensor would sync its compute stream every step
        cu_host = msg.cu_seqlens.to("cpu", torch.int64).contiguous()
        ctrl = self.ch.ctrl_group
        works = [(dist.isend(h, dst, group=ctrl), ctrl), (dist.isend(cu_host, dst, group=ctrl), ctrl)]
        t0 = time.monotonic()
        out = _Outgoing(works, (h, cu_host) + payload, staged=payload)
        self._inflight[dst].append(out)
        self._staged[dst] = self._staged.get(dst, 0) + 1
        if self.ch.store is None:
            self._post_payload(dst, out)
        else:
            # a drafter that waits for this message posts its receive at once: post the payload now rather
            # than after this rank's next forward (whose launch can take tens of ms of host time)
            self._await_receive(dst, out, grace_s=RENDEZVOUS_GRACE_S)
            self.wait_s += time.monotonic() - t0
        self.bytes_sent += sum(p.numel() * p.element_size() for p in payload)

    def send_end(self, dst: int, stats=()) -> None:
        self._throttle(dst, self.max_in_flight)
        h = self._header(KIND_END, -1, stats)
        ctrl = self.ch.ctrl_group
        self._inflight[dst].append(_Outgoing([(dist.isend(h, dst, group=ctrl), ctrl)], (h,), data=False))

    def flush(self) -> None:
        for dst in list(self._inflight):
            self._throttle(dst, 1)  # waits until nothing is in flight to dst


class PendingMessage:
    """A receive in progress: header posted, then payload posted once the header has landed."""

    def __init__(self, receiver: "Receiver", src: int, expect_index: int):
        self.rx, self.src, self.expect_index = receiver, src, expect_index
        self.header = torch.empty(HEADER_LEN, dtype=torch.int64)
        self.header_work = dist.irecv(self.header, src, group=receiver.ch.ctrl_group)
        self.payload = None  # (meta, feats, works) once posted
        self.result = None

    def advance(self) -> bool:
        """Post the payload receive if the header is already here. Never blocks. True once payload is posted."""
        if self.payload is None and self.result is None and self.rx.ch.done(self.header_work, self.rx.ch.ctrl_group):
            self._on_header()
        return self.payload is not None or self.result is not None

    def _on_header(self) -> None:
        # the header work has completed here; never wait() a gloo p2p work twice: the second wait blocks forever
        h = self.header.tolist()
        if h[H_MAGIC] != MAGIC:
            raise TransportError(f"bad header from rank {self.src}: {h}")
        kind, stats = h[H_KIND], h[H_STATS:H_STATS + N_STATS]
        ch = self.rx.ch
        if kind == KIND_END:
            self.result = EndOfStream(self.src, stats)
            return
        if kind == KIND_ERROR:
            data = torch.empty(h[H_ERRLEN], dtype=torch.uint8)
            _wait(dist.irecv(data, self.src, group=ch.ctrl_group), f"error text from rank {self.src}", 10.0, None,
                  ch._pollable(ch.ctrl_group))
            raise RemoteError(self.src, bytes(data.tolist()).decode("utf-8", "replace"))
        if kind != KIND_DATA:
            raise TransportError(f"unknown message kind {kind} from rank {self.src}")
        if self.expect_index >= 0 and h[H_INDEX] != self.expect_index:
            raise TransportError(f"rank {self.src} sent message {h[H_INDEX]}, expected {self.expect_index}: "
                                 f"the routing schedules of target and drafter disagree")
        if h[H_DTYPE] not in CODE_DTYPES:
            raise TransportError(f"rank {self.src}: unknown dtype code {h[H_DTYPE]}")
        n, t, width, label_k = h[H_NSAMPLES], h[H_NTOKENS], h[H_WIDTH], h[H_LABEL_K]
        if label_k < 0 or h[H_METALEN] != meta_len(n, t, label_k) or (h[H_LABEL_PROBS] and not label_k):
            raise TransportError(f"rank {self.src}: header meta length {h[H_METALEN]} != "
                                 f"{meta_len(n, t, max(label_k, 0))} (or label probabilities without label ids)")
        self.cu_host = torch.empty(n + 1, dtype=torch.int64)
        self.cu_work = dist.irecv(self.cu_host, self.src, group=ch.ctrl_group)  # right behind the header
        meta = torch.empty(h[H_METALEN], dtype=torch.int64, device=ch.device)
        feats = torch.empty((t, width), dtype=CODE_DTYPES[h[H_DTYPE]], device=ch.device)
        bufs = (meta, feats)
        if h[H_LABEL_PROBS]:
            bufs += (torch.empty((t, label_k), dtype=torch.float32, device=ch.device),)
        works = _batched(dist.irecv, bufs, self.src, ch.data_group)
        if ch.store is not None:  # rendezvous: the sender posts this payload once it reads the new count
            ch.store.add(posted_key(self.src, self.rx.rank), 1)
        self.payload = (h, bufs, works)

    def complete(self):
        """Block until the whole message is here; returns Message or EndOfStream, raises RemoteError."""
        if self.result is not None:
            return self.result
        if self.payload is None:
            self.rx.ch.wait(self.header_work, f"a header from target rank {self.src} "
                                              f"(message {self.expect_index})", group=self.rx.ch.ctrl_group)
            self._on_header()
            if self.result is not None:
                return self.result
        h, bufs, works = self.payload
        meta, feats = bufs[:2]
        self.rx.ch.wait(self.cu_work, f"cu_seqlens of message {h[H_INDEX]} from rank {self.src}",
                        group=self.rx.ch.ctrl_group)
        for w in works:
            self.rx.ch.wait(w, f"payload of message {h[H_INDEX]} from rank {self.src}", host=False,
                            group=self.rx.ch.data_group)
        n, t = h[H_NSAMPLES], h[H_NTOKENS]
        sample_ids, _, ids, mask = unpack_meta(meta, n, t)
        labels = unpack_labels(meta, n, t, h[H_LABEL_K])
        probs = bufs[2] if len(bufs) > 2 else None
        self.result = Message.build(h[H_INDEX], sample_ids, self.cu_host, ids, mask, feats, self.src,
                                    h[H_STATS:H_STATS + N_STATS], target_ids=labels, target_probs=probs)
        self.rx.bytes_received += sum(b.numel() * b.element_size() for b in bufs)
        return self.result


class Receiver:
    """Drafter side: post receives ahead, complete them in order."""

    def __init__(self, channel: Channel, rank: int):
        self.ch, self.rank = channel, rank
        self.bytes_received = 0

    def post(self, src: int, expect_index: int = -1) -> PendingMessage:
        return PendingMessage(self, src, expect_index)
