"""The in-training evaluation's graceful stop (no processes): a target running one whole abandons it at the next
prompt once a stop is requested, and the leader records no result for it."""

import json
import logging
from types import SimpleNamespace

from dflash_dist.eval import in_training as IT


class Store:
    def __init__(self, values=None):
        self.values = {k: v.encode() for k, v in (values or {}).items()}

    def set(self, key, value):
        self.values[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        return self.values[key]

    def check(self, keys):
        return all(k in self.values for k in keys)


def evaluator(stop_when, prompts=5, steps_per_prompt=3):
    """A TargetEval whose running evaluation (request 0, step 4) is a stand-in for evaluate_steps: ``prompts`` prompts
    of ``steps_per_prompt`` verify steps each; the stop is requested once ``stop_when(steps run)`` holds. Returns
    (evaluator, trace): the steps run, whether the generator was closed, what _post got."""
    trace = {"steps": 0, "closed": False, "posted": None}
    ev = IT.TargetEval.__new__(IT.TargetEval)
    ev.store, ev.link, ev.fault, ev.receiving, ev.prompts = Store(), None, None, None, list(range(prompts))
    ev.job = SimpleNamespace(life=SimpleNamespace(stop_reason=lambda: "SIGTERM" if stop_when(trace["steps"]) else None))

    def steps():
        try:
            for p in range(prompts):
                for _ in range(steps_per_prompt):
                    trace["steps"] += 1
                    yield
                ev._prompt_done(p + 1, prompts)
        except GeneratorExit:
            trace["closed"] = True
            raise
        return {"wall_s": 1.0}

    ev.running = IT._Running(0, 4, steps(), 0.0, 0.0)
    ev._post = lambda r: trace.update(posted=r)
    return ev, trace


def test_a_stop_during_an_evaluation_abandons_it_at_the_next_prompt(caplog):
    ev, trace = evaluator(stop_when=lambda steps: steps >= 5)  # requested during the second prompt (steps 4-6)
    with caplog.at_level(logging.WARNING, logger="dflash_dist"):
        ev.finish()
    assert trace["closed"] and trace["posted"] is None and ev.running is None
    assert trace["steps"] == 7  # the second prompt finished, the third's first step (its prefill) ran, no more
    assert json.loads(ev.store.get(f"{IT.RES}0")) == {"step": 4, "stopped": "SIGTERM"}
    assert "evaluation at step 4 stopped after 2/5 prompts: SIGTERM" in caplog.text


def test_a_stop_before_the_evaluation_starts_runs_none_of_it():
    ev, trace = evaluator(stop_when=lambda steps: True)
    ev.finish()
    assert trace["steps"] == 0 and ev.running is None and f"{IT.RES}0" in ev.store.values


def test_without_a_stop_the_evaluation_runs_to_its_end():
    ev, trace = evaluator(stop_when=lambda steps: False)
    ev.finish()
    assert trace["steps"] == 15 and trace["posted"] == {"wall_s": 1.0} and not trace["closed"]


def test_the_leader_records_no_result_for_an_abandoned_evaluation():
    leader = IT.LeaderEval.__new__(IT.LeaderEval)
    leader.store = Store({f"{IT.RES}0": json.dumps({"step": 2, "stopped": "SIGTERM"}),
                          f"{IT.RES}1": json.dumps({"step": 4, "n_prompts": 3})})
    leader.sent, leader.steps, leader._inflight, leader._deferred = [0, 1], {0: 2, 1: 4}, None, None
    leader.pump = lambda: None
    assert leader.ready() == [(4, {"step": 4, "n_prompts": 3})] and leader.sent == []


def test_the_train_side_of_the_gap_is_what_the_variant_serves():
    """eval_record: training accuracy and the acceptance length it predicts from the variant's served proposals
    (DFlash2's selector, Domino's correction) where the window has them, else from the head's argmax."""
    result = {"acceptance_length": 1.5}
    head = {"acc": 0.2, "tau_from_acc": 1.25}
    rec = IT.eval_record(result, head)
    assert (rec["train_acc"], rec["tau_from_train_acc"], rec["train_serve_gap"]) == (0.2, 1.25, -0.25)
    rec = IT.eval_record(result, {**head, "served_acc": 0.4, "tau_from_served_acc": 1.75})
    assert (rec["train_acc"], rec["tau_from_train_acc"], rec["train_serve_gap"]) == (0.4, 1.75, 0.25)
