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


def test_run_summary_names_the_results():
    from dflash_dist.telemetry.metrics import run_summary
    s = run_summary(stopped=False, steps=30, steps_this_run=10, samples=600, wall_s=20.0, loss=1.25, tau=(30, 2.25, 3.5),
                    checkpoint="r/checkpoints/step_00000030", metrics_path="r/metrics.jsonl",
                    wandb_dir="r/wandb/offline-run-x", wandb_mode="offline")
    assert "30 steps (10 in this launch)" in s and "600 samples" in s and "30.0 samples/s" in s
    assert "final loss 1.2500" in s
    # the pooled acceptance length is the headline, z-lab's per-prompt tau beside it
    assert "acceptance length 2.250 (pooled over verify steps; z-lab's tau 3.500) at step 30" in s
    assert "r/checkpoints/step_00000030" in s and "r/metrics.jsonl" in s
    assert "wandb sync r/wandb/offline-run-x" in s
    s = run_summary(stopped=True, steps=3, steps_this_run=3, samples=0, wall_s=1.0, loss=None, tau=None,
                    checkpoint=None, metrics_path="m", wandb_dir=None, wandb_mode="disabled")
    assert "stopped" in s and "acceptance not evaluated" in s and "wandb" not in s
    s = run_summary(stopped=False, steps=30, steps_this_run=30, samples=60, wall_s=60.0, loss=1.0, tau=None,
                    checkpoint="c", metrics_path="m", wandb_dir=None, wandb_mode="disabled", pace="pace:       steps x")
    assert "(1.0 samples/s)" in s and s.splitlines()[1] == "  pace:       steps x"


def test_log_lines_never_land_on_the_progress_bar():
    """A log line written while a bar is drawn starts on a line of its own (tqdm.write clears the bar first)."""
    import io
    import logging

    from tqdm import tqdm

    from dflash_dist.comm.distributed import _BarAwareHandler
    stream = io.StringIO()
    h = _BarAwareHandler(stream, erase_line=False)
    h.setFormatter(logging.Formatter("%(message)s"))
    lg = logging.getLogger("test_bar_aware")
    lg.addHandler(h)
    lg.propagate = False
    bar = tqdm(total=10, file=stream, desc="train", mininterval=0)
    bar.update(3)
    lg.warning("a log line")
    bar.close()
    lg.removeHandler(h)
    lines = stream.getvalue().replace("\r", "\n").split("\n")
    assert "a log line" in lines, lines  # alone on its line, not glued after "train: 30%|..."
