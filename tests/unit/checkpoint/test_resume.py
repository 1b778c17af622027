"""Run resolution under the run directory's claim, the resume point's checks, and the run's totals over its
launches."""

import json
import os
import subprocess
import sys

import pytest
from helpers.fake_run import fake_run

from dflash_dist.checkpoint import claim as claimmod
from dflash_dist.checkpoint import identity as ident
from dflash_dist.checkpoint.claim import CLAIM_FILE
from dflash_dist.checkpoint.identity import read_run_json, write_run_json
from dflash_dist.checkpoint.resume import (
    check_resume_point,
    checkpoint_totals,
    claim_and_resolve,
    earlier_totals,
    record_dropped,
    run_totals,
)
from dflash_dist.checkpoint.store import CheckpointError
from dflash_dist.config import ConfigError, JobConfig
from dflash_dist.targets.hf import TINY_DIR


def cfg(**train):
    return JobConfig.from_dict({"target": {"hf_config": {"builtin": "tiny"}}, "train": dict(train)})


def identity():
    out = ident.data_identity(cfg(), TINY_DIR, 2048)
    return dict(out, target={"hash": "t" * 16, "label": "tiny"}, drafter={"hash": "d" * 16, "label": "2 layers"})


@pytest.fixture(autouse=True)
def _release():
    yield
    claimmod.release_claims()


def test_the_run_directory_is_claimed_before_it_is_looked_into(tmp_path):
    run = tmp_path / "run"
    got = claim_and_resolve(cfg(output_dir=str(run)), identity())
    assert got == {"run_dir": str(run), "resume_from": None}
    holder = json.load(open(run / CLAIM_FILE))
    assert holder["pid"] == os.getpid()
    # another process on the same directory is refused naming this one, before it reads anything there
    code = ("import sys; sys.path[:0] = [sys.argv[2], sys.argv[3]];"
            "from test_resume import cfg, identity; from dflash_dist.checkpoint.resume import claim_and_resolve\n"
            "try: claim_and_resolve(cfg(output_dir=sys.argv[1]), identity())\n"
            "except Exception as e: print(type(e).__name__, e)")
    tests_dir = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-c", code, str(run), os.path.dirname(__file__), tests_dir],
                       capture_output=True, text=True, timeout=120)
    assert r.stdout.startswith("ConfigError") and "is in use by another job" in r.stdout, r.stdout + r.stderr
    assert f"pid {os.getpid()}" in r.stdout


def test_a_refused_run_releases_its_claim_and_unfinished_saves_are_removed(tmp_path):
    run = tmp_path / "run"
    fake_run(run, identity())
    with pytest.raises(ConfigError, match="already holds a run"):
        claim_and_resolve(cfg(output_dir=str(run)), identity())
    assert not os.path.exists(run / CLAIM_FILE)
    tmp = run / "checkpoints" / ".tmp_step_00000006_4242"
    os.makedirs(tmp)
    got = claim_and_resolve(cfg(output_dir=str(run), resume="auto"), identity())
    assert got["resume_from"].endswith("step_00000004") and not os.path.exists(tmp)


def test_a_new_run_directory_taken_in_the_same_second_gives_the_next_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("dflash_dist.checkpoint.resume.new_run_dir", lambda: _names.pop(0))
    _names[:] = ["outputs/run-a", "outputs/run-b"]
    os.makedirs("outputs/run-a")
    with open(os.path.join("outputs/run-a", CLAIM_FILE), "w") as f:
        json.dump({"host": "elsewhere", "pid": 1, "token": "t"}, f)  # another host's, fresh: live
    assert claim_and_resolve(cfg(), identity())["run_dir"] == "outputs/run-b"


_names: list = []


@pytest.mark.parametrize("field,value,why", [("cursor", -5, "outside the run's plan"),
                                             ("step", -3, "outside the run's plan"),
                                             ("cursor", 11, "0..10 (total_messages)"),
                                             ("step", 7, "each step trains at least one message"),
                                             ("cursor", "4", "not a whole number"),
                                             ("total_messages", 0, "at least 1")])
def test_a_resume_point_outside_the_plan_is_refused_naming_file_and_field(field, value, why):
    meta = {"cursor": 6, "step": 6, "total_messages": 10}
    check_resume_point(meta, "ck")
    with pytest.raises(CheckpointError) as e:
        check_resume_point(dict(meta, **{field: value}), "ck")
    assert str(e.value).startswith(f"{os.path.join('ck', 'meta.json')}: field {field}") and why in str(e.value)


def test_the_runs_totals_add_the_earlier_launches_and_what_they_dropped(tmp_path):
    plan = [[0, 1], [2, 3, 4], [5], [6, 7]]  # 8 samples in 4 messages
    write_run_json(str(tmp_path), {"x": 1}, {"created": "now"})
    ck = str(tmp_path / "checkpoints" / "step_00000002")
    first = {"cursor": 2, "run_totals": {"samples_sent": 5, "samples_trained": 4, "samples_skipped": 1,
                                         "samples_dropped_after_stop": 0, "launches": 1}}
    record_dropped(str(tmp_path), ck, 3)  # the first launch stopped on a signal after that checkpoint
    assert read_run_json(str(tmp_path))["identity"] == {"x": 1}
    before = earlier_totals(first, ck, str(tmp_path), plan)
    assert before == {"samples_sent": 8, "samples_trained": 4, "samples_skipped": 1,
                      "samples_dropped_after_stop": 3, "launches": 1}
    launch = {"samples_sent": 3, "samples_received": 3, "samples_trained": 3, "samples_skipped_nonfinite": 0,
              "samples_skipped_shape": 0, "samples_dropped_after_stop": 0}
    tot = run_totals(before, launch, plan, 4)
    assert tot == {"run_samples_sent": 11, "run_samples_trained": 7, "run_samples_skipped": 1,
                   "run_samples_dropped_after_stop": 3, "run_samples_repeated": 0, "run_launches": 2}
    # what a checkpoint of this launch records: its samples received (2 of them skipped) on top of the earlier ones
    assert checkpoint_totals(before, {"received": 3, "skipped": 2}) == {
        "samples_sent": 11, "samples_trained": 5, "samples_skipped": 3, "samples_dropped_after_stop": 3, "launches": 2}
    # a resume that took a message twice shows up
    assert run_totals(before, dict(launch, samples_received=5), plan, 4)["run_samples_repeated"] == 2
    # a checkpoint of an older dflash_dist (no totals): the plan's samples through its cursor
    assert earlier_totals({"cursor": 3}, ck, str(tmp_path), plan)["samples_trained"] == 6


def test_a_resume_onto_a_disk_without_room_for_another_checkpoint_warns_at_the_start(tmp_path, monkeypatch, caplog):
    import logging
    from collections import namedtuple

    from dflash_dist.checkpoint import store
    run = tmp_path / "run"
    fake_run(run, identity())
    monkeypatch.setattr(store.shutil, "disk_usage", lambda p: namedtuple("u", "total used free")(100, 97, 3))
    with caplog.at_level(logging.WARNING):
        claim_and_resolve(cfg(output_dir=str(run), resume="auto"), identity())
    assert "3 bytes free" in caplog.text and "needs about" in caplog.text
