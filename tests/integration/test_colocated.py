"""Colocated ranks (topology.target_ranks=0; any job of one process): the same training as the split jobs, to the
bit on CPU; the in-training tau is dflash-eval's; runs resume across splits without losing or repeating a sample;
a dead colocated rank is named."""

import glob
import json
import os
import signal

import pytest
from helpers.launch_util import shared_data_cache, signal_once_reached, torchrun
from test_dflash_train import QUICK, _signal_when_training, _train_steps, dflash_train
from test_failures import _wait_for_step, kill9_and_wait
from test_train_e2e import accounting, metrics, sample_log, train_records

from dflash_dist.cli.eval import main as eval_main

JOB = ["-m", "dflash_dist.train", "logging.log_every=1", "logging.progress_bar=false", "logging.wandb.mode=disabled"]


def losses(run_dir) -> list:
    return [(r["step"], r["loss"]) for r in train_records(run_dir)]


def same_losses(a, b) -> None:
    assert [s for s, _ in a] == [s for s, _ in b]
    assert max(abs(x - y) for (_, x), (_, y) in zip(a, b)) <= 1e-6, (a, b)


def run_job(nproc: int, run_dir, *overrides, timeout: float = 400) -> str:
    r = torchrun(nproc, JOB + [f"train.output_dir={run_dir}", *overrides], timeout=timeout)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    return out


def test_one_process_trains_as_one_target_and_one_drafter_and_its_tau_is_dflash_eval(tmp_path):
    """The job of one process, no flags: colocated; its losses are a 1 + 1 job's (same data, same seed), and its
    in-training evaluation equals dflash-eval of its checkpoint on the same prompts."""
    steps = ["train.max_steps=12", "train.eval_every=12", "train.eval_prompts=4", "train.eval_max_new_tokens=32",
             f"data.cache_dir={tmp_path / 'cache'}"]
    out = run_job(1, tmp_path / "colo", *steps)
    assert "topology: 1 colocated rank(s)" in out and "[rank 0 colocated]" in out
    assert "target sends: in-process on this rank" in out
    split_out = run_job(2, tmp_path / "split", *steps)
    assert "[rank 1 target]" in split_out
    same_losses(losses(tmp_path / "colo"), losses(tmp_path / "split"))
    acc = accounting(tmp_path / "colo")
    assert acc["samples_sent"] == acc["samples_trained"] > 0 and acc["run_samples_repeated"] == 0

    (ev,) = [x for x in metrics(tmp_path / "colo") if x["kind"] == "eval"]
    (split_ev,) = [x for x in metrics(tmp_path / "split") if x["kind"] == "eval"]
    assert ev["acceptance_length"] == pytest.approx(split_ev["acceptance_length"], abs=1e-9)
    ck = tmp_path / "colo" / "checkpoints" / "step_00000012"
    (holdout,) = glob.glob(str(tmp_path / "cache" / "holdout-*.jsonl"))
    # no --max-new-tokens: dflash-eval generates the run's train.eval_max_new_tokens, as the in-training evaluation
    assert eval_main(["--checkpoint", str(ck), "--prompts", holdout, "--num-prompts", str(ev["n_prompts"]),
                      "--out", str(tmp_path / "e.json")]) == 0
    e = json.load(open(tmp_path / "e.json"))
    assert e["n_prompts"] == ev["n_prompts"] == 4 and e["lossless_fraction"] == 1.0
    assert e["max_new_tokens"] == ev["max_new_tokens"] == 32
    assert e["acceptance_length"] == pytest.approx(ev["acceptance_length"], abs=1e-9)
    assert e["tau"] == ev["tau"] or e["tau"] == pytest.approx(ev["tau"], abs=1e-9)
    assert e["prompts_one_step"] == ev["prompts_one_step"] and e["one_step_excluded"] == ev["one_step_excluded"]
    assert e["tau_pooled"] == pytest.approx(ev["tau_pooled"], abs=1e-9)
    assert [r["acceptance_lengths"] for r in e["per_prompt"]] == ev["acceptance_lengths"]


def test_an_evaluation_in_batches_equals_dflash_eval_in_the_same_batches(tmp_path):
    """train.eval_batch_size: a colocated rank's evaluation decodes its prompts 3 at a time (a batch of 3 and one
    of 1), and dflash-eval --batch-size 3 of the checkpoint gives every prompt the same acceptance lengths."""
    out = run_job(1, tmp_path / "colo", "train.max_steps=6", "train.eval_prompts=4", "train.eval_max_new_tokens=24",
                  "train.eval_batch_size=3", f"data.cache_dir={tmp_path / 'cache'}")
    assert "in-training evaluation: whole, between two messages (colocated: the drafter half waits for it), 3 " \
           "prompts decoded together" in out
    (ev,) = [x for x in metrics(tmp_path / "colo") if x["kind"] == "eval"]
    (holdout,) = glob.glob(str(tmp_path / "cache" / "holdout-*.jsonl"))
    ck = tmp_path / "colo" / "checkpoints" / "step_00000006"
    assert eval_main(["--checkpoint", str(ck), "--prompts", holdout, "--num-prompts", "4", "--batch-size", "3",
                      "--no-lossless-check", "--out", str(tmp_path / "e.json")]) == 0
    e = json.load(open(tmp_path / "e.json"))
    assert e["n_prompts"] == ev["n_prompts"] == 4 and e["batch_size"] == 3
    assert [r["acceptance_lengths"] for r in e["per_prompt"]] == ev["acceptance_lengths"]
    assert e["acceptance_length"] == pytest.approx(ev["acceptance_length"], abs=1e-9)


def test_two_colocated_ranks_train_as_one_target_and_two_drafters(tmp_path):
    steps = ["train.max_steps=8", "train.eval_prompts=0"]
    out = run_job(2, tmp_path / "colo", "topology.target_ranks=colocated", *steps)
    assert "topology: 2 colocated rank(s)" in out and "[rank 1 colocated]" in out
    run_job(3, tmp_path / "split", *steps)
    same_losses(losses(tmp_path / "colo"), losses(tmp_path / "split"))


def test_a_colocated_run_resumes_as_a_split_and_as_two_colocated_ranks(tmp_path):
    """1 colocated rank trains 4 steps; 1 target + 1 drafter resumes it to 8; 2 colocated ranks to 12: every message
    of the plan up to the cursor trained exactly once, and the losses of steps 5..8 are those of the same two
    launches colocated both times (the split changes nothing)."""
    run = tmp_path / "run"
    common = [f"train.output_dir={run}", "train.eval_prompts=0", "logging.debug.record_sample_ids=true",
              "train.checkpoint_every=4"]
    r = torchrun(1, JOB + common + ["train.max_steps=4"], timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    r = torchrun(2, JOB + common + ["train.max_steps=8", "train.resume=auto", "topology.target_ranks=1"], timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert "resuming from" in out and "step_00000004" in out and "[rank 1 target]" in out
    r = torchrun(2, JOB + common + ["train.max_steps=12", "train.resume=auto", "topology.target_ranks=0"], timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert "topology: 2 colocated rank(s)" in out
    acc = accounting(run)
    assert acc["run_launches"] == 3 and acc["run_samples_repeated"] == 0
    assert acc["run_samples_sent"] == acc["run_samples_trained"] + acc["run_samples_skipped"]
    by_k = {}
    for x in sample_log(run):
        assert x["k"] not in by_k, f"message {x['k']} trained twice"
        by_k[x["k"]] = len(x["ids"])
    cursor = json.load(open(run / "checkpoints" / "step_00000012" / "meta.json"))["cursor"]
    assert sorted(by_k) == list(range(cursor)) and cursor == 4 + 4 + 2 * 4
    assert acc["run_samples_trained"] == sum(by_k.values())

    ref = tmp_path / "ref"  # the same two launches up to step 8, colocated both times
    for steps in (4, 8):
        r = torchrun(1, JOB + [f"train.output_dir={ref}", "train.eval_prompts=0", "train.checkpoint_every=4",
                               f"train.max_steps={steps}", "train.resume=auto"], timeout=300)
        assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    resumed = [x for x in losses(run) if 4 < x[0] <= 8]
    same_losses(resumed, [x for x in losses(ref) if 4 < x[0] <= 8])


def test_kill9_of_a_colocated_rank_is_named(tmp_path):
    p = torchrun(2, JOB + [f"train.output_dir={tmp_path}", "train.max_steps=400", "train.eval_prompts=0",
                           "topology.target_ranks=0"], popen=True)
    _wait_for_step(tmp_path, 3, p)
    out, took = kill9_and_wait(p, 1)
    assert p.returncode != 0 and took < 60
    assert "rank 1 (colocated" in out and "died" in out, out[-3000:]
    assert not os.path.exists(tmp_path / "checkpoints"), "a failure must not write a checkpoint"


def test_sigterm_to_a_one_gpu_style_job_checkpoints_and_resumes_as_a_split(tmp_path):
    """dflash-train with one process (colocated) stopped by SIGTERM: a checkpoint, exit 143, the command that continues;
    1 target + 1 drafter continues it from there."""
    run = tmp_path / "run"
    p = dflash_train(["--nproc-per-node", "1", *QUICK, "train.max_steps=400", "logging.log_every=1",
                      f"train.output_dir={run}", f"data.cache_dir={shared_data_cache()}"], cwd=tmp_path, popen=True)
    out = _signal_when_training(p, run, signal.SIGTERM, after_step=2)
    assert p.returncode == 143, out[-4000:]
    assert "[rank 0 colocated]" in out and "to continue: dflash-train --nproc-per-node 1" in out, out[-4000:]
    (ckpt,) = os.listdir(run / "checkpoints")
    meta = json.load(open(run / "checkpoints" / ckpt / "meta.json"))
    assert meta["reason"] == "signal" and meta["step"] > 2
    r = torchrun(2, JOB + [f"train.output_dir={run}", "train.resume=auto", f"train.max_steps={meta['step'] + 2}",
                           "train.eval_prompts=0", "topology.target_ranks=1"], timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and f"resuming from {run / 'checkpoints' / ckpt}" in out, out[-3000:]
    assert accounting(run)["run_samples_repeated"] == 0


def test_sigterm_during_an_evaluation_abandons_it_and_checkpoints_at_once(tmp_path, monkeypatch):
    """dflash-train with one process (colocated) gets SIGTERM while its in-training evaluation runs (made slow: 3 s
    more per prompt, 16 prompts): the evaluation stops at the next prompt, logged, with no record in metrics.jsonl;
    the run checkpoints and exits 143 within seconds instead of finishing the evaluation first."""
    monkeypatch.setenv("DFLASH_INJECT_FAULT", "0:0:slow_eval")  # rank 0's first evaluation request (step 2)
    monkeypatch.setenv("DFLASH_INJECT_STALL_S", "3")
    run = tmp_path / "run"
    p = dflash_train(["--nproc-per-node", "1", "train.max_steps=400", "train.eval_every=2", "train.eval_prompts=16",
                      "train.eval_max_new_tokens=16", "logging.log_every=1", "logging.wandb.mode=disabled",
                      "logging.progress_bar=false", f"train.output_dir={run}", f"data.cache_dir={shared_data_cache()}"],
                     cwd=tmp_path, popen=True)
    def send():  # step 2's evaluation runs while the message of step 3 is made: step 3 waits for it
        assert max(_train_steps(run)) == 2
        p.send_signal(signal.SIGTERM)
    out, took = signal_once_reached(p, lambda: 2 in _train_steps(run), send)
    assert p.returncode == 143, out[-4000:]
    assert "evaluation at step 2 stopped after " in out and "/16 prompts: SIGTERM" in out, out[-4000:]
    assert took < 20, f"{took:.1f} s from SIGTERM to exit (the whole evaluation: ~48 s)\n{out[-3000:]}"
    (ckpt,) = os.listdir(run / "checkpoints")
    assert json.load(open(run / "checkpoints" / ckpt / "meta.json"))["reason"] == "signal"
    assert not [x for x in metrics(run) if x["kind"] == "eval"]


@pytest.mark.parametrize("overrides", [
    ["drafter=tiny_dflash2"], ["drafter=tiny_domino"], ["drafter.loss.labels=target", "drafter.loss.kind=kl"],
    ["drafter.loss.weighting=dpace"], ["target.quantization=fp8"],
    ["drafter.tuning.loss_on_target=true", "drafter.tuning.micro_batches=2"]])
def test_variants_objectives_and_fp8_targets_train_and_evaluate_colocated(tmp_path, overrides):
    out = run_job(1, tmp_path, *overrides, "train.max_steps=6", "train.eval_every=6", "train.eval_prompts=2",
                  "train.eval_max_new_tokens=16", "logging.log_every=2")
    assert "topology: 1 colocated rank(s)" in out
    (ev,) = [x for x in metrics(tmp_path) if x["kind"] == "eval"]
    assert ev["step"] == 6 and ev["n_prompts"] == 2 and ev["acceptance_length"] >= 1.0
    train = train_records(tmp_path)
    assert train[-1]["step"] == 6 and train[-1]["loss"] < train[0]["loss"]
