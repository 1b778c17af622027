"""The in-process link of a colocated rank (``topology.target_ranks=0``): its target half hands each message to
its drafter half on the same device, beside the point-to-point link of ``transport.py``.

The drafter pulls: completing a posted receive runs the target half's next message (``LocalLink.producer``, set by
``dflash_dist.roles.colocated``), so one thread alternates a capture and a training step and holds one message at a time.
A message crosses as the network would deliver it (the meta tensor packed and unpacked, cu_seqlens on the host), and
its features stay where the capture put them: no copy, no process group. The same link carries what a split job
sends once or rarely: the target's embedding and lm_head, and the drafter weights of an in-training evaluation.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Optional

import torch

from dflash_dist.comm.message import EndOfStream, Message, TransportError, pack_meta, unpack_labels, unpack_meta


class LocalLink:
    """One colocated rank's link between its two halves (the ``channel`` both role loops hold)."""

    store = None  # no rendezvous: nothing is posted ahead of its receive

    def __init__(self, rank: int, device: torch.device):
        self.rank, self.device = rank, torch.device(device)
        self.producer: Optional[Callable[[], None]] = None  # runs the target half's next message, or its end
        self.queue: deque = deque()
        self.heads: Optional[tuple] = None  # (embedding, lm_head) of the target on this rank
        self.weights: deque = deque()  # drafter weights the leader posted for an in-training evaluation
        self.timeout_s = float("inf")  # nothing to wait for: a message is produced when it is taken
        self.sender = LocalSender(self)
        self.receiver = LocalReceiver(self)

    def describe(self) -> str:
        return "in-process on this rank (colocated: the features stay on the device, no copy)"

    def can_idle(self) -> bool:
        return False  # the target half never waits for the drafter half: nothing to do in its waits

    def take(self, expect_index: int):
        """The next item the target half put on the link, produced now if there is none."""
        while not self.queue:
            if self.producer is None:
                raise TransportError(f"rank {self.rank}: the target half has ended its stream, but the drafter half "
                                     f"waits for message {expect_index}")
            self.producer()
        got = self.queue.popleft()
        if isinstance(got, Message):
            if expect_index >= 0 and got.index != expect_index:
                raise TransportError(f"rank {self.rank}: its target half produced message {got.index}, its drafter "
                                     f"half expected {expect_index}: the routing schedules disagree")
            self.sender.taken[self.rank] = self.sender.taken.get(self.rank, 0) + 1
        return got

    def post_weights(self, flat: torch.Tensor) -> "LocalWork":
        """The leader's packed drafter weights for an evaluation (taken by ``take_weights``)."""
        self.weights.append(flat)
        return LocalWork(lambda: True)

    def take_weights(self, into: torch.Tensor) -> "LocalWork":
        """A receive of the weights the leader posted, into ``into``: complete once they are there."""
        def done() -> bool:
            if not self.weights:
                return False
            into.copy_(self.weights.popleft())
            return True
        return LocalWork(done)


class LocalWork:
    """A completed-or-not operation of the link, with the two calls the loops make on a process group's Work. It
    never blocks: the one thread that would complete it is the caller's."""

    def __init__(self, done: Callable[[], bool]):
        self._done, self._complete = done, False

    def is_completed(self) -> bool:
        self._complete = self._complete or self._done()
        return self._complete

    def wait(self, *_):
        if not self.is_completed():
            raise TransportError("nothing was posted on this rank's in-process link for this receive")
        return True


class LocalSender:
    """The target half's end: ``Sender``'s calls, each message queued for the drafter half."""

    def __init__(self, link: LocalLink):
        self.link = link
        self.taken: dict[int, int] = {}
        self.wait_s = self.idle_work_s = self.serve_s = 0.0
        self.idle_work = self.serve = None
        self.bytes_sent = 0

    def send(self, dst: int, msg: Message, stats=()) -> None:
        msg.validate()
        n, t, dev = msg.num_samples, msg.num_tokens, self.link.device
        # the meta tensor the network would deliver: the same dtypes and devices on both kinds of link
        meta = pack_meta(msg.sample_ids, msg.cu_seqlens, msg.input_ids, msg.loss_mask, msg.target_ids).to(dev)
        sample_ids, _, ids, mask = unpack_meta(meta, n, t)
        probs = None if msg.target_probs is None else msg.target_probs.to(dev, torch.float32)
        self.link.queue.append(Message.build(msg.index, sample_ids, msg.cu_seqlens.to("cpu", torch.int64), ids, mask,
                                             msg.features, self.link.rank, stats,
                                             target_ids=unpack_labels(meta, n, t, msg.label_k), target_probs=probs))

    def send_end(self, dst: int, stats=()) -> None:
        self.link.queue.append(EndOfStream(self.link.rank, list(stats)))

    def wait_event(self, event) -> None:
        event.synchronize()

    def all_took(self, n: int) -> bool:
        return self.taken.get(self.link.rank, 0) >= n

    def idle_between(self) -> bool:
        return False

    def pump(self) -> None:
        pass

    def flush(self) -> None:
        pass  # a message is queued only when the drafter half asks for it: nothing is ever left in flight


class LocalReceiver:
    """The drafter half's end: ``Receiver.post``; completing a receive may run the target half's next message."""

    def __init__(self, link: LocalLink):
        self.link = link
        self.bytes_received = 0  # nothing crosses a link

    def post(self, src: int, expect_index: int = -1) -> "LocalPending":
        return LocalPending(self.link, expect_index)


class LocalPending:
    def __init__(self, link: LocalLink, expect_index: int):
        self.link, self.expect_index, self.result = link, expect_index, None

    def advance(self) -> bool:
        return True

    def complete(self):
        if self.result is None:
            self.result = self.link.take(self.expect_index)
        return self.result
