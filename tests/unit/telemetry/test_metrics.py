"""Window metrics: the drafter's stream wait (how long its compute stream stood in the receive of a message)."""

import time

from dflash_dist.telemetry.metrics import StreamWaitMeter


def test_stream_wait_on_cpu_is_the_host_time_inside_the_receive():
    m = StreamWaitMeter("cpu")
    for _ in range(3):
        before = m.mark()
        time.sleep(0.02)  # the receive
        m.add(before, m.mark())
        time.sleep(0.01)  # the step: not counted
    assert 0.06 <= m.seconds() < 0.085


class _Mark:
    """A timing event whose completion the test decides (as a CUDA event still queued behind a step)."""

    def __init__(self, t, done=True):
        self.t, self.done = t, done

    def query(self):
        return self.done

    def elapsed_time(self, end):
        return (end.t - self.t) * 1e3


def test_stream_wait_counts_a_pair_once_it_is_complete():
    m = StreamWaitMeter("cpu")
    m.add(_Mark(0.0), _Mark(0.5))
    late = _Mark(2.25, done=False)
    m.add(_Mark(2.0), late)       # still in flight at the first read: not counted, not lost
    m.add(_Mark(3.0), _Mark(3.5))  # behind it: waits its turn (the stream completes events in order)
    assert m.seconds() == 0.5
    late.done = True
    assert m.seconds() == 1.25
