"""The frozen lm_head and the loss of a drafter step, run on a target rank (``drafter.tuning.loss_on_target``).

Why: in a drafter-bound job the target GPUs idle part of the time (at SpecForge's config the best 8-GPU split
leaves 43% of two target GPUs unused), while the frozen vocab projection is ~28% of a drafter step's FLOPs (550
tokens, 256 anchors, Qwen3-8B shapes). The head takes no weight gradient, so all a drafter needs back from it is
the loss sum, the argmax (accuracy) and the gradient with respect to its final hidden rows: [rows, H] each way,
~34 MB per sample at 256 anchors, a fraction of a millisecond over NVLink. The target already holds the head.

A step on the drafter (``drafter.tuning.micro_batches`` = M groups of anchors): for each group, the forward, then its
rows and labels are posted to the target that sent the message; the next group's forward runs while the target
computes. Then each group's backward in order, each once its own reply is in: the drafter posts the reply's
receives right before that backward (a receive pending on the GPU holds 16 SMs spinning and slows the next group's
forward beside it; measured: docs/benchmarks.md#head-on-target) and its stream waits for them there (the host does
not), the rows taking their received gradient (``_ReceivedGrad``); the last reply arrives while the
earlier groups' backward runs.
``drafter.tuning.local_loss_groups``: the last groups' loss stays on the drafter. This module only moves tensors:
both sides call the objective object they are handed (model/objectives/: ``rows`` and ``parts`` on the drafter,
``serve`` on the target), so the numbers are those of the local fused loss (bit for bit on CPU,
``tests/integration/test_head_offload.py``). Faster than the local loss in a
drafter-bound job with 2 or 4 groups, less so with one backward for all groups waiting for every reply (measured:
docs/benchmarks.md#head-on-target).

On a target replica of k ranks, with an objective that has the slice math (``objective.vocab_parallel``; the
decayed CE, D-PACE and KL): every rank of the replica holds its slice of the lm_head's rows and serves every request
of the replica's messages, and the drafter combines the k replies (``combine_slices``, model/head_shards.py). No
rank of the replica waits for another's reply, so each serves at its own boundaries (``head_servers``). Other
objectives are served by the replica's feeder with the whole head.

On a target (``HeadLossServer``): it serves the requests of the messages it sent, in the order it sent them,
between captures and whenever it waits on its drafters, and captures its message j only once the requests of
its messages up to j - 2D are served (D drafters: message j's drafter sends them in round j // D, so a capture
two rounds ahead never holds a reply up, and nothing waits in a cycle: see ``target.loop.run_target``).

Wire: a request's index, rows, width and dtype go through the rendezvous store under a per-link key (its
appearance also says the rows were posted, so the target never leaves a receive pending on its GPU; before it
queues the receive it posts the feature payloads whose receives are posted, which the rows may depend on). The
rows and labels travel over the group ``heads``, the loss sum, argmax and gradient back over ``head_replies``
(NCCL on GPU, gloo on CPU), each connected at startup (NCCL connects a direction on first use and can block there
until the peer makes its own: the first GPU runs hung in their first step without this). Groups of their own: NCCL
orders point-to-point operations per pair and group, so replies on the data group would queue against the
feature sends, and on one group with the rows a drafter's later rows would queue behind a reply receive it posts
only at that group's backward (a cycle).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from dflash_dist.comm.transport import CODE_DTYPES, DTYPE_CODES, Channel, TransportError, poll_until

log = logging.getLogger("dflash_dist")

__all__ = ["request_key", "head_channels", "head_servers", "HeadLossClient", "HeadLossServer", "head_flops"]


FIRST_LOGGED = 2  # the first requests are logged on both sides (where a hung first step stopped)
# replies whose sends a target keeps in flight before it waits for the oldest: a drafter takes a reply right
# before that group's backward, so up to a step's served groups per drafter wait (2 x [rows, H] each: ~126 MB at
# 7,680 rows of Qwen3-8B width)
MAX_REPLIES_KEPT = 16


def request_key(drafter: int, target: int, n: int) -> str:
    """Store key of drafter ``drafter``'s n-th head request to target ``target``: 'index,rows,width,dtype code'."""
    return f"dflash/head_request/{drafter}-{target}/{n}"


def head_flops(rows: int, hidden: int, vocab: int) -> float:
    """Model FLOPs of serving one request: the logits and the gradient wrt the rows (2 matmuls of R x H x V)."""
    return 4.0 * rows * hidden * vocab


def head_servers(topo, objective) -> dict[int, list[int]]:
    """Feeder rank -> the ranks that serve its messages' head requests, in vocabulary order: every rank of its
    replica, each with its slice (a replica, and ``objective.vocab_parallel``), else the feeder alone."""
    sliced = topo.tp > 1 and bool(getattr(objective, "vocab_parallel", False))
    return {rep[0]: (list(rep) if sliced else [rep[0]]) for rep in topo.replicas}


def head_channels(d, timeout_s: float, check, peers, drafter: bool) -> tuple[Channel, Channel]:
    """The channels of ``drafter.tuning.loss_on_target`` on one rank (``d``: its distributed setup): rows over ``heads``,
    replies over ``head_replies``, each connected at startup with every peer, drafters sending rows and receiving
    replies, targets the other way (NCCL connects a direction of a pair on its first operation, which can block
    until the peer makes its own: a first reply receive blocked before its request reached the store).
    Both roles connect ``heads`` first. Returns (rows, replies)."""
    rows, replies = (Channel(d.ctrl, g, d.device, timeout_s=timeout_s, check=check, store=d.store)
                     for g in (d.heads, d.head_replies))
    rows.connect(peers, sending=drafter)
    replies.connect(peers, sending=not drafter)
    return rows, replies


class _ReceivedGrad(torch.autograd.Function):
    """Ties rows to a loss computed elsewhere: forward returns 0 (the received loss sum is added to it), backward
    hands the rows the received gradient d(loss sum)/d rows, scaled like the local fused loss's."""

    @staticmethod
    def forward(ctx, rows: Tensor, grad_buf: Tensor) -> Tensor:
        ctx.grad_buf = grad_buf  # filled by the reply's receive; complete() waits for it before this group's backward
        ctx.rows_dtype = rows.dtype
        return rows.new_zeros((), dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        g = ctx.grad_buf
        return (g * grad_loss.to(g.dtype)).to(ctx.rows_dtype), None


@dataclass
class _Pending:
    """One posted request: the reply's buffers and the works that fill them."""
    rows_y: Tensor
    rows_w: Tensor
    surrogate: Tensor      # 0 with the received gradient behind it
    loss: Tensor           # [1] fp32, received
    pred: Tensor           # [R] int64, received
    grad: Tensor           # [R, H] received: what ``surrogate``'s backward hands the rows
    extra: Optional[Tensor]  # [R, objective.reply_columns] fp32 received, or None
    works: list            # the receives of the reply, once posted (complete)
    sends: tuple           # (works, rows, labels, inputs...) of the request: kept alive until the reply is in
    target: int = -1
    client: Optional["HeadLossClient"] = None
    parts: Optional[object] = None  # the LossParts, once the reply is in (complete)
    slices: Optional[list] = None  # [(rank, (stats, ids, G))] received from each rank of a replica, vocab order

    @property
    def weight_sum(self) -> Tensor:
        """The group's loss weight sum (the step's normalisation needs it before any backward): local, known
        before the reply, unless the objective's weights come with it (``weights_served``: the reply is taken)."""
        if self.client is not None and self.client.objective.weights_served:
            return self.client.complete(self, self.target).weight_sum
        return self.rows_w.sum()


class HeadLossClient:
    """Drafter side: post a group's rows to a target, then collect the replies as the objective's LossParts.
    ``objective``: the drafter's objective object (its ``rows`` and ``parts``)."""

    def __init__(self, channel: Channel, replies: Channel, rank: int, head: Tensor, objective,
                 servers: Optional[dict] = None):
        if channel.store is None:
            raise ValueError("drafter.tuning.loss_on_target needs the rendezvous store")
        self.ch, self.replies, self.rank, self.dtype = channel, replies, rank, head.dtype
        self.head = head.detach()  # the frozen head: the labels' rows when replies come in vocabulary slices
        self.objective = objective
        self.servers = servers or {}  # feeder -> the ranks serving its requests (head_servers); absent: itself
        self.sent: dict[int, int] = {}   # requests posted per target
        self.requests = 0

    def request(self, target: int, index: int, hidden: Tensor, labels: Tensor, soft=None) -> _Pending:
        """Post the loss rows of one group (hidden [b, N*B, H] with its graph, labels [b, N*B], the batch's
        ``soft`` for kind=kl) to ``target`` for plan message ``index``; returns without waiting. The reply's
        receives are posted by ``complete``."""
        rows_h, rows_y, rows_w = self.objective.rows(hidden, labels)
        inputs = [t.contiguous() for t in self.objective.request_inputs(labels, soft)]
        send_h = rows_h.detach().to(self.dtype).contiguous()
        send_y = rows_y.contiguous()
        r, h = send_h.shape
        dev = send_h.device
        loss = torch.zeros(1, dtype=torch.float32, device=dev)
        pred = torch.empty(r, dtype=torch.int64, device=dev)
        grad = torch.empty(r, h, dtype=self.dtype, device=dev)
        cols = self.objective.reply_columns
        extra = torch.empty(r, cols, dtype=torch.float32, device=dev) if cols else None
        ranks = self.servers.get(target, [target])
        slices = None
        if len(ranks) > 1:  # each rank of the replica replies for its slice of the vocabulary
            cols = self.objective.slice_stats_columns
            slices = [(q, (torch.empty(r, cols, dtype=torch.float32, device=dev),
                           torch.empty(r, dtype=torch.int64, device=dev), torch.empty(r, h, dtype=self.dtype,
                                                                                   device=dev))) for q in ranks]
        g = self.ch.data_group
        sends = dist.batch_isend_irecv([dist.P2POp(dist.isend, t, q, g) for q in ranks
                                        for t in (send_h, send_y, *inputs)])
        for q in ranks:
            n = self.sent.get(q, 0)
            self.ch.store.set(request_key(self.rank, q, n), f"{index},{r},{h},{DTYPE_CODES[self.dtype]}")
            self.sent[q] = n + 1
        self.requests += 1
        if self.requests <= FIRST_LOGGED:
            log.info("head request %d posted to target rank%s %s: message %d, %d rows", self.requests,
                     "s" if len(ranks) > 1 else "", ", ".join(map(str, ranks)), index, r)
        surrogate = _ReceivedGrad.apply(rows_h, grad)
        return _Pending(rows_y, rows_w, surrogate, loss, pred, grad, extra, [], (sends, send_h, send_y, *inputs),
                        target, self, slices=slices)

    def complete(self, p: _Pending, target: int):
        """Post the reply's receives (on the reply group) and make the compute stream wait for them (CUDA; CPU:
        the host waits); returns the group's LossParts. Posted this late, right before the group's backward, a
        receive never sits on the GPU while the target computes: a pending NCCL receive holds 16 SMs spinning
        and slows the forward beside it (measured: docs/benchmarks.md#head-on-target). Once per request (the
        step's weight sum may have taken it already)."""
        if p.parts is not None:
            return p.parts
        g = self.replies.data_group
        if p.slices is None:
            bufs = [(target, t) for t in (p.loss, p.pred, p.grad) + (() if p.extra is None else (p.extra,))]
        else:
            bufs = [(q, t) for q, reply in p.slices for t in reply]
        p.works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, t, q, g) for q, t in bufs])
        for w, (q, _) in zip(p.works, bufs):
            self.replies.wait(w, f"the head reply of target rank {q}", host=False, group=g)
        for w in p.sends[0]:
            self.ch.wait(w, f"target rank {target}'s replica to take head rows", host=False,
                         group=self.ch.data_group)
        if p.slices is not None:  # the whole head's reply from the slices' (on the stream, after their receives)
            loss_sum, pred, grad, extra = self.objective.combine_slices([reply for _, reply in p.slices], self.head,
                                                                        p.rows_y, *p.sends[3:])
            p.loss.copy_(loss_sum.reshape(1))
            p.pred.copy_(pred)
            p.grad.copy_(grad)  # what the surrogate's backward hands the rows
            if extra is not None:
                p.extra.copy_(extra)
            p.slices = None
        p.parts = self.objective.parts(p.surrogate + p.loss[0], p.pred, p.rows_y, p.rows_w, p.extra)
        return p.parts


class HeadLossServer:
    """Target side: the requests this rank expects (M per message it sent, in sending order) and their service.
    ``objective``: the drafter's objective object (its ``serve`` computes a request's reply)."""

    def __init__(self, channel: Channel, replies: Channel, rank: int, weight: Tensor, objective,
                 requests_per_message: int, before_serve: Optional[Callable[[], None]] = None,
                 slice_lo: Optional[int] = None):
        if channel.store is None:
            raise ValueError("drafter.tuning.loss_on_target needs the rendezvous store")
        self.ch, self.replies, self.rank, self.weight = channel, replies, rank, weight.detach()
        self.slice_lo = slice_lo  # ``weight`` is head rows [slice_lo, slice_lo + len): replies for that slice
        self.objective = objective
        self.requests_per_message = requests_per_message
        # posts the feature payloads whose receives are posted (Sender.pump), before a request's receive is queued:
        # a payload posted later from the compute stream would wait behind the request's receive, which waits for
        # the drafter's forward of that payload (that cycle hung the first step). The drafter counts its
        # payload receive in the store before it writes the request's key, so reading the key first sees the count.
        self.before_serve = before_serve
        self._timing: deque = deque()           # CUDA (start, end) events of served requests, not yet read
        self.expected: deque = deque()          # (run index j, plan index k, drafter rank), oldest first
        self.served_per: dict[int, int] = {}    # requests served per drafter
        self._replies: deque = deque()          # (works, buffers) of replies still being sent
        self.served = 0
        self.rows = 0
        self.busy_s = 0.0                       # GPU time of the served requests (CPU: host time)
        self.flops = 0.0

    def expect(self, j: int, k: int, drafter: int) -> None:
        """Message j (plan index k) was sent to ``drafter``: its requests will come, in order."""
        for _ in range(self.requests_per_message):
            self.expected.append((j, k, drafter))

    def drop_from(self, j_limit: int) -> int:
        """Forget the requests of messages j >= j_limit (a graceful stop: they will not be trained)."""
        keep = deque(e for e in self.expected if e[0] < j_limit)
        dropped = len(self.expected) - len(keep)
        self.expected = keep
        return dropped

    def poll(self) -> bool:
        """Serve the oldest expected request if its drafter has posted it. Never waits for a drafter."""
        self._reap()
        if not self.expected:
            return False
        j, k, d = self.expected[0]
        n = self.served_per.get(d, 0)
        key = request_key(d, self.rank, n)
        store = self.ch.store
        if not store.check([key]):
            return False
        spec = store.get(key).decode()
        store.delete_key(key)
        self.expected.popleft()
        self.served_per[d] = n + 1
        self._serve(d, k, spec)
        return True

    def _serve(self, drafter: int, k: int, spec: str) -> None:
        t0 = time.monotonic()
        cuda = self.weight.device.type == "cuda"
        index, r, h, code = (int(x) for x in spec.split(","))
        bsz = self.objective.block_size
        if index != k:
            raise TransportError(f"drafter rank {drafter} sent head rows of message {index}, target rank {self.rank} "
                                 f"expected message {k}: the schedules disagree")
        if h != self.weight.shape[1] or code not in CODE_DTYPES or r % (bsz - 1):
            raise TransportError(f"drafter rank {drafter}: head rows [{r}, {h}] dtype code {code} do not fit a head "
                                 f"of width {self.weight.shape[1]} and blocks of {bsz}")
        if self.before_serve is not None:
            self.before_serve()
        dev = self.weight.device
        rows = torch.empty(r, h, dtype=CODE_DTYPES[code], device=dev)
        labels = torch.empty(r, dtype=torch.int64, device=dev)
        inputs = [torch.empty(r, c, dtype=dt, device=dev) for c, dt in self.objective.request_specs()]
        g = self.ch.data_group
        works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, t, drafter, g) for t in (rows, labels, *inputs)])
        for w in works:  # CUDA: the stream waits for the rows (the drafter's GPU may still be computing them)
            self.ch.wait(w, f"head rows of message {k} from drafter rank {drafter}", host=False, group=g)
        start = torch.cuda.current_stream(dev).record_event(torch.cuda.Event(enable_timing=True)) if cuda else None
        with torch.no_grad():
            if self.slice_lo is not None:
                stats, ids, part = self.objective.serve_slice(rows, self.weight, self.slice_lo, labels, *inputs)
                out = (stats.float().contiguous(), ids, part.to(rows.dtype).contiguous())
            else:
                loss_sum, pred, grad, extra = self.objective.serve(rows, self.weight, labels, *inputs)
                out = ((loss_sum.float().reshape(1), pred, grad.to(rows.dtype))
                       + (() if extra is None else (extra.float().contiguous(),)))
        gr = self.replies.data_group  # the drafter posts their receives right before that group's backward
        replies = dist.batch_isend_irecv([dist.P2POp(dist.isend, t, drafter, gr) for t in out])
        self._replies.append((replies, (*out, rows, labels, *inputs)))
        if cuda:  # busy = the GPU's time on it, read once done (never a host wait here)
            self._timing.append((start, torch.cuda.current_stream(dev).record_event(
                torch.cuda.Event(enable_timing=True))))
        else:
            self.busy_s += time.monotonic() - t0
        self.served += 1
        if self.served <= FIRST_LOGGED:
            log.info("head request of message %d from drafter rank %d served (%d rows)", k, drafter, r)
        self.rows += r
        self.flops += head_flops(r, h, self.weight.shape[0])

    def _reap(self) -> None:
        g = self.replies.data_group
        while self._replies and all(self.replies.done(w, g) for w in self._replies[0][0]):
            self._replies.popleft()
        while len(self._replies) > MAX_REPLIES_KEPT:  # gloo cannot say done; beyond this many, wait for the oldest
            for w in self._replies.popleft()[0]:
                self.replies.wait(w, "a drafter to take a head reply", group=g)
        while self._timing and self._timing[0][1].query():
            start, end = self._timing.popleft()
            self.busy_s += start.elapsed_time(end) / 1e3

    def serve_through(self, j_max: int, idle: Optional[Callable[[], bool]] = None,
                      stop_limit: Optional[Callable[[], Optional[int]]] = None) -> None:
        """Serve until no expected request belongs to a message j <= j_max; ``idle``: other work while no request
        is posted (say whether it did any); ``stop_limit``: the first message the drafters will not train, once a
        graceful stop is announced (its requests are dropped)."""
        last_stop_check = 0.0

        def done() -> bool:
            nonlocal last_stop_check
            while self.poll():
                pass
            if stop_limit is not None and time.monotonic() - last_stop_check > 0.2:  # a store read: not every poll
                last_stop_check = time.monotonic()
                limit = stop_limit()
                if limit is not None:
                    self.drop_from(limit)
            return not self.expected or self.expected[0][0] > j_max

        if not poll_until(done, self.ch.timeout_s, self.ch.check, max_sleep=5e-4, idle=idle):
            j, k, d = self.expected[0]
            raise TransportError(f"timed out after {self.ch.timeout_s:.0f} s waiting for drafter rank {d} to send "
                                 f"the head rows of message {k} to target rank {self.rank}")

    def wait_replies(self) -> None:
        """Wait until every reply posted so far is sent (nothing of this server left in flight)."""
        for works, _ in self._replies:
            for w in works:
                self.replies.wait(w, "a drafter to take a head reply", group=self.replies.data_group)
        self._replies.clear()

    def finish(self, idle=None, stop_limit=None) -> None:
        """Serve every expected request, then wait until the replies are sent."""
        self.serve_through(float("inf"), idle=idle, stop_limit=stop_limit)
        self.wait_replies()
        for _, end in self._timing:
            end.synchronize()
        self._reap()

    def describe(self) -> str:
        return (f"{self.served} head requests served ({self.rows} rows, {self.flops / 1e12:.1f} TFLOP, "
                f"{self.busy_s:.1f} s)")
