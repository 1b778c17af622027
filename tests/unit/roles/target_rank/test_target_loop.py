"""The target rank's end of stream: which evaluations it still serves, and when it gives up (no processes)."""

from types import SimpleNamespace

import dflash_dist.roles.target_rank.loop as TL


class FakeEvaluator:
    """Requests arrive at the given poll calls; records what the target did."""

    def __init__(self, arrive_at_polls):
        self.n, self.calls, self.polls, self.arrive = 0, [], 0, set(arrive_at_polls)

    def poll(self, wait_s=0.0, whole=False):
        self.polls += 1
        self.calls.append("poll")
        if self.polls in self.arrive:
            self.n += 1
            return True
        return False

    def finish(self):
        self.calls.append("finish")

    def close(self):
        self.calls.append("close")

    def done(self):
        self.calls.append("done")


def job(stop_after_polls=None, evaluator=None, patience=30.0):
    def stop_step():
        return 7 if stop_after_polls is not None and evaluator.polls >= stop_after_polls else None
    return SimpleNamespace(cfg=SimpleNamespace(topology=SimpleNamespace(warmup_timeout_s=patience)),
                           life=SimpleNamespace(stop_step=stop_step))


def test_serves_every_expected_evaluation(monkeypatch):
    monkeypatch.setattr(TL, "expected_evals", lambda job: 2)
    ev = FakeEvaluator(arrive_at_polls={1, 3})
    TL.serve_last_evaluations(job(evaluator=ev), ev, stopped=False)
    assert ev.calls == ["finish", "poll", "poll", "poll", "done"] and ev.n == 2  # no close: all served


def test_stop_announced_after_the_stream_ends_the_wait(monkeypatch):
    """The stop was announced after this rank sent its last message: it stops waiting for requests the leader
    will never make, and drops what it holds."""
    monkeypatch.setattr(TL, "expected_evals", lambda job: 3)
    ev = FakeEvaluator(arrive_at_polls={1})
    TL.serve_last_evaluations(job(stop_after_polls=2, evaluator=ev), ev, stopped=False)
    assert ev.calls == ["finish", "poll", "poll", "close", "done"] and ev.n == 1


def test_stopped_rank_only_closes(monkeypatch):
    monkeypatch.setattr(TL, "expected_evals", lambda job: 3)
    ev = FakeEvaluator(arrive_at_polls=set())
    TL.serve_last_evaluations(job(evaluator=ev), ev, stopped=True)
    assert ev.calls == ["close", "done"]  # done: a replica's followers stop waiting


def test_gives_up_after_its_patience(monkeypatch):
    monkeypatch.setattr(TL, "expected_evals", lambda job: 1)
    ev = FakeEvaluator(arrive_at_polls=set())
    TL.serve_last_evaluations(job(evaluator=ev, patience=0.0), ev, stopped=False)
    assert ev.calls == ["finish", "close", "done"]  # no time left to wait: nothing polled, then dropped
