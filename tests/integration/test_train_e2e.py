"""End-to-end training jobs under torchrun on CPU (gloo): the real entry point, the real roles."""

import glob
import json
import os
import signal
import subprocess
import time

import pytest
from helpers.launch_util import signal_once_reached, torchrun


def metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def train_records(run_dir):
    return [r for r in metrics(run_dir) if r["kind"] == "train"]


def accounting(run_dir):
    recs = [r for r in metrics(run_dir) if r["kind"] == "accounting"]
    assert recs, "no accounting record"
    return recs[-1]


def sample_log(run_dir):
    out = []
    for path in glob.glob(os.path.join(run_dir, "sample_log", "rank*.jsonl")):
        with open(path) as f:
            out += [json.loads(line) for line in f]
    return out


def check_accounting(acc):
    assert acc["samples_sent"] == acc["samples_received"] + acc["samples_dropped_after_stop"]
    assert acc["samples_received"] == (acc["samples_trained"] + acc["samples_skipped_nonfinite"]
                                       + acc["samples_skipped_shape"])


def test_default_job_one_target_two_drafters(tmp_path):
    r = torchrun(3, ["-m", "dflash_dist.train", f"train.output_dir={tmp_path}", "train.max_steps=30",
                     "train.eval_every=10", "logging.log_every=5", "logging.progress_bar=false"], timeout=400)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "attention backend=sdpa" in out  # reported, chosen by auto on CPU
    assert "target sends: posted at once" in out  # rendezvous_sends=null: off over gloo
    recs = train_records(tmp_path)
    assert recs[-1]["step"] == 30
    assert recs[-1]["loss"] < 0.8 * recs[0]["loss"], [round(x["loss"], 3) for x in recs]
    assert os.path.exists(tmp_path / "checkpoints" / "step_00000030" / "model.safetensors")
    assert glob.glob(str(tmp_path / "wandb" / "offline-run-*")), "wandb offline run missing"
    cfg = json.load(open(tmp_path / "config.json"))
    assert cfg["topology"]["target_ranks"] == 1
    acc = accounting(tmp_path)
    check_accounting(acc)
    assert acc["samples_trained"] > 0 and acc["samples_dropped_after_stop"] == 0
    # in-training acceptance evaluation on the target rank: requested at 10, 20 (each runs unless the previous
    # one is still running, then it is skipped and said so) and always at the end
    evals = [x for x in metrics(tmp_path) if x["kind"] == "eval"]
    skipped = out.count(" skipped: the one of step")
    assert evals and evals[-1]["step"] == 30 and evals[-1]["n_prompts"] > 0 and evals[-1]["acceptance_length"] >= 1.0, evals
    assert len(evals) + skipped == 3, (evals, skipped)


def test_evaluation_in_slices_on_idle_target_time(tmp_path):
    """train.tuning.eval_in_slices with rendezvous sends (waits the target can poll): the evaluation runs one verify step
    at a time while the target waits for the drafter to take a message, every requested evaluation is either
    logged or skipped (said so), the last one is never skipped and runs after the stream, and no sample is lost.
    The evaluations are long enough (16 prompts x 64 tokens) that a request comes while one is still running."""
    r = torchrun(2, ["-m", "dflash_dist.train", f"train.output_dir={tmp_path}", "train.max_steps=16",
                     "train.eval_every=4", "train.eval_prompts=16", "train.eval_max_new_tokens=64",
                     "topology.tuning.rendezvous_sends=true", "topology.max_in_flight=1", "logging.log_every=4",
                     "logging.progress_bar=false", "logging.wandb.mode=disabled"], timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "in-training evaluation: one verify step at a time while waiting for the drafters" in out
    evals = [x for x in metrics(tmp_path) if x["kind"] == "eval"]
    skipped = out.count(" skipped: the one of step")
    assert len(evals) + skipped == 4, (evals, skipped)  # requested at 4, 8, 12 and after the last step (16)
    assert evals[-1]["step"] == 16 and evals[-1]["n_prompts"] == 16 and evals[-1]["acceptance_length"] >= 1.0
    # the log's headline is the pooled acceptance length, z-lab's tau beside it; the summary says the same
    line = next(x for x in out.splitlines() if "evaluation at step 16:" in x)
    assert f"acceptance length {evals[-1]['acceptance_length']:.3f} (pooled over verify steps), z-lab's tau" in line
    assert f"acceptance length {evals[-1]['acceptance_length']:.3f} (pooled over verify steps; z-lab's tau" in out
    sliced = [x for x in evals if x["eval_slices"]]
    assert sliced, evals  # at least one ran on the target's waits, a verify step per slice
    assert all(x["eval_span_s"] >= x["eval_seconds"] > 0 for x in sliced)
    assert "evaluation while waiting 0%)" not in out  # the target's closing line counts that time
    windows = train_records(tmp_path)
    assert all(0 <= w["target1_eval_frac"] <= 1 for w in windows) and any(w["target1_eval_frac"] > 0 for w in windows)
    check_accounting(accounting(tmp_path))


def test_hybrid_target_job(tmp_path):
    """The embedded tiny hybrid (GatedDeltaNet) target trains a drafter end to end: padded capture, rows rounded to
    the configured multiple, the kernels it bound reported, every sample trained."""
    r = torchrun(2, ["-m", "dflash_dist.train", f"train.output_dir={tmp_path}", "target=tiny_hybrid",
                     "drafter=tiny", "train.max_steps=6", "train.eval_prompts=0", "target.tuning.pad_multiple=16",
                     "logging.log_every=3", "logging.progress_bar=false", "logging.wandb.mode=disabled"],
                 timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "target capture: padded to a multiple of 16 (sdpa), compiled layers: no" in out
    assert "target fast path: Qwen3NextGatedDeltaNet x6: fla=NO, causal-conv1d=NO" in out  # CPU: the fallback
    assert train_records(tmp_path)[-1]["step"] == 6
    check_accounting(accounting(tmp_path))


def test_two_targets_one_drafter(tmp_path):
    r = torchrun(3, ["-m", "dflash_dist.train", f"train.output_dir={tmp_path}", "train.max_steps=6",
                     "topology.target_ranks=2", "logging.log_every=3", "logging.progress_bar=false",
                     "logging.wandb.mode=disabled", "logging.peak_tflops=0.001", "logging.debug.trace_target=true",
                     "train.eval_prompts=0",
                     "topology.tuning.rendezvous_sends=true"],
                timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    recs = train_records(tmp_path)
    assert recs[-1]["step"] == 6
    assert "target1_busy_frac" in recs[-1] and "target2_busy_frac" in recs[-1]  # both targets fed it
    out = r.stdout + r.stderr
    assert out.count("target sends: rendezvous") == 2  # chosen in config, reported by each target
    for t in (1, 2):
        assert 0 <= recs[-1][f"target{t}_busy_frac"] <= 1 and 0 <= recs[-1][f"target{t}_wait_frac"] <= 1
    # the drafter's stream wait: on CPU the host time inside the receives, a part of its wait
    for r in recs:
        assert 0 <= r["drafter_stream_wait_frac"] <= r["drafter_wait_frac"] + 1e-6 <= 1
    assert sum(r["drafter_stream_wait_frac"] for r in recs) > 0
    # the per-message trace of each target: every message it sent, where its time went
    traced = {}
    for t in (1, 2):
        with open(tmp_path / "target_trace" / f"rank{t}.jsonl") as f:
            traced[t] = [json.loads(line) for line in f]
        assert traced[t] and all(x["capture_ms"] > 0 and x["backpressure_ms"] >= 0 and x["to"] == 0
                                 for x in traced[t])
    assert sum(x["samples"] for v in traced.values() for x in v) == accounting(tmp_path)["samples_sent"]
    assert sorted(x["message"] for v in traced.values() for x in v) == list(range(sum(map(len, traced.values()))))
    # the bottleneck metrics: per-role rates, link bandwidth and MFU (against the configured peak)
    last = recs[-1]
    assert last["link_gb_per_s"] > 0 and last["model_flops"] > 0 and last["drafter_mfu"] > 0
    for t in (1, 2):
        assert last[f"target{t}_tokens_per_s"] > 0 and last[f"target{t}_mfu"] > 0
    check_accounting(accounting(tmp_path))


def _workers_of(pid):
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(x) for x in out]


def sigterm_workers_when(p, ready, run_dir, what: str, within_s: float = 240) -> str:
    """Once ``ready()`` holds (metrics exist), SIGTERM the workers of torchrun ``p`` (as SLURM does); returns the
    job's output after it exits. Fails with ``what`` if it does not hold within ``within_s``."""
    deadline = time.time() + within_s
    while not (os.path.exists(run_dir / "metrics.jsonl") and ready()):
        if time.time() > deadline:
            p.kill()
            pytest.fail(what + ":\n" + p.communicate()[0][-3000:])
        time.sleep(0.5)
    for w in _workers_of(p.pid):
        os.kill(w, signal.SIGTERM)
    return p.communicate(timeout=120)[0]


def test_sigterm_then_resume_with_another_split(tmp_path):
    """SIGTERM to every rank (as SLURM does): one checkpoint, exit 0. Resume with 2+1 instead of 1+2: every
    sample of the plan is trained exactly once across the two runs and the loss curve continues."""
    common = ["-m", "dflash_dist.train", f"train.output_dir={tmp_path}", "data.source=synthetic:40:240",
              "train.epochs=1", "logging.log_every=2", "logging.progress_bar=false", "logging.debug.record_sample_ids=true",
              "target.max_batch_samples=8", "logging.wandb.mode=disabled", "train.eval_prompts=0"]
    p = torchrun(3, common + ["topology.target_ranks=1"], popen=True)
    out1 = sigterm_workers_when(p, lambda: any(r["step"] >= 6 for r in train_records(tmp_path)),
                                tmp_path, "first run did not reach step 6")
    assert p.returncode == 0, out1[-4000:]
    assert "stopped on request" in out1
    ckpts = sorted(glob.glob(str(tmp_path / "checkpoints" / "step_*")))
    assert len(ckpts) == 1
    meta = json.load(open(os.path.join(ckpts[0], "meta.json")))
    assert meta["reason"] == "signal" and 0 < meta["cursor"] < meta["total_messages"]
    acc1 = accounting(tmp_path)
    check_accounting(acc1)
    first_losses = [r["loss"] for r in train_records(tmp_path)]

    r = torchrun(3, common + ["topology.target_ranks=2", "train.resume=auto"], timeout=300)
    out2 = r.stdout + r.stderr
    assert r.returncode == 0, out2[-4000:]
    assert "resuming from" in out2
    log = sample_log(tmp_path)
    ks = sorted(x["k"] for x in log)
    assert ks == list(range(meta["total_messages"])), "every message of the plan trained exactly once"
    ids = sorted(i for x in log for i in x["ids"])
    assert ids == list(range(240)), "every sample exactly once (1 epoch)"
    acc2 = accounting(tmp_path)  # the run's totals over both launches: what the first dropped was sent again
    assert acc2["run_samples_trained"] == 240 and acc2["run_samples_repeated"] == 0 and acc2["run_launches"] == 2
    assert acc2["run_samples_sent"] == acc1["samples_sent"] + acc2["samples_sent"]
    assert acc2["run_samples_dropped_after_stop"] == acc1["samples_dropped_after_stop"]
    second = train_records(tmp_path)[len(first_losses):]
    assert second[0]["step"] > meta["step"]
    assert second[-1]["loss"] < first_losses[0]


def test_sigterm_while_an_evaluation_runs(tmp_path):
    """SIGTERM while the target runs an in-training evaluation in slices (one every step, each longer than a
    step): the evaluation is dropped, both ranks stop after the same step with one checkpoint and exit 0."""
    p = torchrun(2, ["-m", "dflash_dist.train", f"train.output_dir={tmp_path}", "train.max_steps=400",
                     "train.eval_every=1", "train.eval_prompts=16", "train.eval_max_new_tokens=64",
                     "topology.tuning.rendezvous_sends=true", "topology.max_in_flight=1", "logging.log_every=2",
                     "logging.progress_bar=false", "logging.wandb.mode=disabled"], popen=True)
    out = sigterm_workers_when(p, lambda: any(r["kind"] == "eval" for r in metrics(tmp_path))
                               and train_records(tmp_path)[-1]["step"] >= 8, tmp_path, "no evaluation by step 8")
    assert p.returncode == 0, out[-4000:]
    assert "stopped on request" in out and " skipped: the one of step" in out  # one was running at each request
    assert len(glob.glob(str(tmp_path / "checkpoints" / "step_*"))) == 1
    check_accounting(accounting(tmp_path))


def test_sigterm_while_a_target_evaluates_whole_abandons_the_evaluation(tmp_path):
    """1 target + 1 drafter over gloo (the target evaluates whole, between two messages, while its drafter waits),
    the evaluation made slow (3 s more per prompt, 16 prompts): SIGTERM to every rank stops it at the next prompt,
    logged, with no record in metrics.jsonl; one checkpoint and exit 0 within seconds."""
    p = torchrun(2, ["-m", "dflash_dist.train", f"train.output_dir={tmp_path}", "train.max_steps=400",
                     "train.eval_every=2", "train.eval_prompts=16", "train.eval_max_new_tokens=16",
                     "logging.log_every=1", "logging.progress_bar=false", "logging.wandb.mode=disabled"], popen=True,
                 env={"DFLASH_INJECT_FAULT": "1:0:slow_eval", "DFLASH_INJECT_STALL_S": "3"})  # rank 1: the target
    def reached():  # step 2 trained: its evaluation is under way on the target
        return os.path.exists(tmp_path / "metrics.jsonl") and any(r["step"] >= 2 for r in train_records(tmp_path))
    out, took = signal_once_reached(p, reached, lambda: [os.kill(w, signal.SIGTERM) for w in _workers_of(p.pid)])
    assert p.returncode == 0, out[-4000:]
    assert "[rank 1 target]" in out and "evaluation at step 2 stopped after " in out, out[-4000:]
    assert "/16 prompts: SIGTERM" in out and "stopped on request" in out, out[-4000:]
    assert took < 20, f"{took:.1f} s from SIGTERM to exit (the whole evaluation: ~48 s)\n{out[-3000:]}"
    assert len(glob.glob(str(tmp_path / "checkpoints" / "step_*"))) == 1
    assert not [x for x in metrics(tmp_path) if x["kind"] == "eval"]
    check_accounting(accounting(tmp_path))
