"""Fails loudly, loses nothing: dead ranks, exceptions, bad hidden states, crashes during a save."""

import json
import logging
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from helpers.launch_util import REPO, torchrun

from dflash_dist.checkpoint.store import find_latest, save_checkpoint


def _rank_pids(torchrun_pid):
    """{global rank: pid} of a torchrun agent's workers (read from their environment)."""
    out = {}
    for pid in subprocess.run(["pgrep", "-P", str(torchrun_pid)], capture_output=True, text=True).stdout.split():
        try:
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        for kv in env:
            if kv.startswith(b"RANK="):
                out[int(kv[5:])] = int(pid)
    return out


def _wait_for_step(run_dir, step, p, timeout=240):
    deadline = time.time() + timeout
    path = os.path.join(run_dir, "metrics.jsonl")
    while time.time() < deadline:
        if p.poll() is not None:
            pytest.fail("job ended early:\n" + p.communicate()[0][-3000:])
        if os.path.exists(path):
            with open(path) as f:
                if any(json.loads(line).get("step", 0) >= step for line in f if line.strip()):
                    return
        time.sleep(0.3)
    p.kill()
    pytest.fail("job never reached step %d" % step)


def kill9_and_wait(p, rank: int, within_s: float = 60) -> tuple[str, float]:
    """SIGKILL one rank of a running torchrun job ``p``; the job's output and the seconds until it ended (a job still
    running ``within_s`` after the kill fails the test)."""
    pid = _rank_pids(p.pid)[rank]
    t0 = time.time()
    os.kill(pid, signal.SIGKILL)
    try:
        out, _ = p.communicate(timeout=within_s)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        pytest.fail(f"survivors still running {within_s:.0f} s after the kill")
    return out, time.time() - t0


ARGS = ["-m", "dflash_dist.train", "train.max_steps=400", "logging.log_every=1", "logging.progress_bar=false",
        "logging.wandb.mode=disabled", "train.eval_prompts=0"]


@pytest.mark.parametrize("victim,role,rendezvous", [(2, "target", "null"), (1, "drafter", "null"),
                                                   (1, "drafter", "true")])
def test_kill9_any_rank_ends_the_job_fast_and_names_it(tmp_path, victim, role, rendezvous):
    """rendezvous=true: the target may be polling the store for a dead drafter's receive; it must still say who."""
    p = torchrun(3, ARGS + [f"train.output_dir={tmp_path}", f"topology.tuning.rendezvous_sends={rendezvous}"], popen=True)
    _wait_for_step(tmp_path, 3, p)
    out, took = kill9_and_wait(p, victim)
    assert p.returncode != 0
    assert took < 60
    assert f"rank {victim} ({role}" in out and "died" in out, out[-3000:]
    assert not os.path.exists(tmp_path / "checkpoints"), "a failure must not write a checkpoint"


def test_exception_on_one_rank_surfaces_once(tmp_path):
    p = torchrun(3, ARGS + [f"train.output_dir={tmp_path}"], env={"DFLASH_INJECT_FAULT": "2:4:raise"}, timeout=240)
    out = p.stdout + p.stderr
    assert p.returncode != 0
    assert out.count("RuntimeError: injected fault at message 4") >= 1
    assert "Traceback" in out
    # the drafters report the root cause, not their own broken waits (whether their wait broke first or
    # torchrun's SIGTERM reached them first)
    assert out.count("stopping without a checkpoint because rank 2 (target) failed: RuntimeError: injected fault") == 2, \
        out[-3000:]
    assert not os.path.exists(tmp_path / "checkpoints")


def test_nonfinite_hidden_states_are_skipped_counted_and_reported(tmp_path):
    p = torchrun(3, ["-m", "dflash_dist.train", "train.max_steps=6", "logging.log_every=2", "logging.progress_bar=false",
                     "logging.wandb.mode=disabled", "train.eval_prompts=0", f"train.output_dir={tmp_path}"],
                 env={"DFLASH_INJECT_FAULT": "2:1:nan"}, timeout=240)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    assert "target rank 2 sent 1 samples with non-finite hidden states" in out
    recs = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    acc = [r for r in recs if r["kind"] == "accounting"][-1]
    assert acc["samples_skipped_nonfinite"] == 1
    assert acc["samples_sent"] == acc["samples_received"]
    assert acc["samples_received"] == acc["samples_trained"] + acc["samples_skipped_nonfinite"]
    assert all(r["loss"] == r["loss"] for r in recs if r["kind"] == "train"), "no NaN reached the loss"


def test_wrongly_shaped_hidden_states_are_skipped_and_counted(tmp_path):
    p = torchrun(2, ["-m", "dflash_dist.train", "train.max_steps=4", "logging.log_every=2", "logging.progress_bar=false",
                     "logging.wandb.mode=disabled", "train.eval_prompts=0", f"train.output_dir={tmp_path}"],
                 env={"DFLASH_INJECT_FAULT": "1:1:narrow"}, timeout=240)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    assert "from rank 1 has features of width 639, expected 640: skipped" in out
    recs = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    acc = [r for r in recs if r["kind"] == "accounting"][-1]
    assert acc["samples_skipped_shape"] > 0
    assert acc["samples_received"] == acc["samples_trained"] + acc["samples_skipped_shape"]


_SAVER = r"""
import sys, torch
from dflash_dist.checkpoint.store import save_checkpoint
big = {"w": torch.randn(64 * 1024 * 1024 // 4 * 6)}  # ~400 MB: slow enough to be killed mid-write
print("saving", flush=True)
save_checkpoint(sys.argv[1], 2, big, None, {"cursor": 2, "total_messages": 10})
print("saved", flush=True)
"""


def test_crash_during_save_keeps_previous_checkpoint(tmp_path, caplog):
    good = save_checkpoint(str(tmp_path), 1, {"w": torch.ones(4)}, None, {"cursor": 1, "total_messages": 10})
    p = subprocess.Popen([sys.executable, "-c", _SAVER, str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "saving"
    time.sleep(0.4)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    assert find_latest(str(tmp_path)) == good
    # a step directory that lost its meta or got truncated is skipped with a warning that names it
    bad = tmp_path / "checkpoints" / "step_00000003"
    os.makedirs(bad)
    (bad / "model.safetensors").write_bytes(b"partial")
    trunc = save_checkpoint(str(tmp_path), 4, {"w": torch.ones(1000)}, None, {"cursor": 4, "total_messages": 10},
                            keep=10)
    with open(os.path.join(trunc, "model.safetensors"), "r+b") as f:
        f.truncate(100)
    with caplog.at_level(logging.WARNING):
        assert find_latest(str(tmp_path)) == good
    assert "step_00000004" in caplog.text and "truncated" in caplog.text
    assert "step_00000003" in caplog.text and "meta.json" in caplog.text


_SHORT = ["-m", "dflash_dist.train", "train.max_steps=12", "logging.log_every=2", "logging.progress_bar=false",
          "logging.wandb.mode=disabled", "train.eval_prompts=0", "topology.timeout_s=2"]


def test_slow_first_steps_are_warm_up_not_a_dead_drafter(tmp_path):
    """A drafter whose second step starts 6 s late (as a long first compile or the profiled step can) outlasts the
    2 s steady-state timeout: the target must still be on the warm-up timeout then (it switches once the drafter
    has taken its third message, not once the target has posted two)."""
    p = torchrun(2, _SHORT + [f"train.output_dir={tmp_path}"], timeout=240,
                 env={"DFLASH_INJECT_FAULT": "0:1:stall", "DFLASH_INJECT_STALL_S": "6"})
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    assert "done: 12 steps" in out


def _drafter_silent_at_step_6(tmp_path, *overrides) -> str:
    """Drafter 0 stalls 60 s at step 6 (after warm-up): the job must fail well before the stall ends (steady
    2 s timeout). Returns the job's output."""
    t0 = time.time()
    p = torchrun(2, _SHORT + [f"train.output_dir={tmp_path}", *overrides], timeout=240,
                 env={"DFLASH_INJECT_FAULT": "0:6:stall", "DFLASH_INJECT_STALL_S": "60"})
    out = p.stdout + p.stderr
    assert p.returncode != 0, out[-3000:]
    assert time.time() - t0 < 55, "ended by the timeout, not by the 60 s stall"
    return out


def test_a_drafter_silent_after_warm_up_is_dead_within_the_timeout(tmp_path):
    """The same stall at step 6 (after warm-up) ends the job with the steady 2 s timeout, naming the drafter."""
    out = _drafter_silent_at_step_6(tmp_path)
    assert "drafter rank 0 to take a message from target rank 1" in out, out[-3000:]


def test_a_drafter_silent_with_the_loss_on_the_target_is_dead_within_the_timeout(tmp_path):
    """drafter.tuning.loss_on_target: the target waits for head rows before it captures further; a drafter silent after
    warm-up ends the job within the steady timeout there too, and the target names what it waited for."""
    out = _drafter_silent_at_step_6(tmp_path, "drafter.tuning.loss_on_target=true", "drafter.tuning.micro_batches=2")
    assert "waiting for drafter rank 0 to send the head rows of message" in out, out[-3000:]


def test_sigusr1_prints_every_ranks_stacks(tmp_path):
    """A job that seems stuck: SIGUSR1 to the workers prints each one's Python stacks (faulthandler) and the job
    goes on to finish."""
    from test_train_e2e import _workers_of, train_records
    p = torchrun(2, ["-m", "dflash_dist.train", f"train.output_dir={tmp_path}", "train.max_steps=40",
                     "train.eval_prompts=0", "logging.log_every=2", "logging.progress_bar=false",
                     "logging.wandb.mode=disabled"], popen=True)
    deadline = time.time() + 200
    while not (os.path.exists(tmp_path / "metrics.jsonl") and train_records(tmp_path)):
        assert time.time() < deadline and p.poll() is None, "no training step"
        time.sleep(0.5)
    for w in _workers_of(p.pid):
        os.kill(w, signal.SIGUSR1)
    out = p.communicate(timeout=200)[0]
    assert p.returncode == 0, out[-3000:]
    assert out.count("most recent call first") >= 2 and "dflash_dist/train.py" in out, out[-3000:]
