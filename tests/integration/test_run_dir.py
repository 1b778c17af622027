"""One run directory, one job; saves that fail keep what was saved; resume skips what it cannot use; the run's
totals over all its launches. Short CPU jobs under torchrun."""

import glob
import json
import os
import re
import resource
import signal
import socket
import time

from helpers.launch_util import torchrun
from test_failures import _rank_pids, _wait_for_step
from test_train_e2e import accounting, metrics, sample_log

SHORT = ["-m", "dflash_dist.train", "logging.log_every=1", "logging.progress_bar=false",
         "logging.wandb.mode=disabled", "train.eval_prompts=0"]


def _exit_codes(out):
    return [int(c) for c in re.findall(r"exitcode\s+:\s*(-?\d+)", out)]


def test_two_jobs_on_one_run_directory_one_trains_the_other_exits_2_naming_it(tmp_path):
    run = tmp_path / "race"
    jobs = [torchrun(2, SHORT + [f"train.output_dir={run}", "train.max_steps=12", f"train.seed={seed}"], popen=True)
            for seed in (1, 2)]
    outs = [p.communicate(timeout=300)[0] for p in jobs]
    codes = [p.returncode for p in jobs]
    assert sorted(codes) == [0, 1], "\n\n".join(o[-3000:] for o in outs)  # torchrun: 1 when a worker failed
    win, lose = (0, 1) if codes[0] == 0 else (1, 0)
    out = outs[lose]
    assert out.count("is in use by another job") == 1, out[-3000:]
    assert f"(host {socket.gethostname()}, pid " in out and "TORCHELASTIC_RUN_ID=" in out  # the holder
    assert _exit_codes(out) == [2, 2] and "target loaded" not in out
    assert json.load(open(run / "config.json"))["train"]["seed"] == win + 1
    recs = metrics(run)
    steps = [r["step"] for r in recs if r["kind"] == "train"]
    assert steps == sorted(set(steps)) and steps[-1] == 12, steps  # one job's records only
    assert len([r for r in recs if r["kind"] == "accounting"]) == 1
    assert not os.path.exists(run / ".dflash-claim")  # released on the winner's clean exit


def test_a_claim_left_by_kill9_of_every_rank_is_stale_and_resume_works(tmp_path):
    run = tmp_path / "run"
    p = torchrun(2, SHORT + [f"train.output_dir={run}", "train.max_steps=400", "train.checkpoint_every=2"], popen=True)
    _wait_for_step(run, 3, p)
    for pid in _rank_pids(p.pid).values():
        os.kill(pid, signal.SIGKILL)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    holder = json.load(open(run / ".dflash-claim"))
    r = torchrun(2, SHORT + [f"train.output_dir={run}", "train.max_steps=5", "train.resume=auto"], timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert f"stale claim left by a job that did not end cleanly (host {holder['host']}, pid {holder['pid']}" in out
    assert f"pid {holder['pid']} is gone" in out and "resuming from" in out
    assert not os.path.exists(run / ".dflash-claim")


def _file_limit(n_bytes):
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (n_bytes, n_bytes))


def test_a_save_that_fails_keeps_the_previous_checkpoint_exits_2_and_resumes(tmp_path):
    """The tiny drafter's optimizer.pt is 3.8 MB, model.safetensors 1.9 MB: a 2.5 MB file size limit fails the
    save inside torch.save (a RuntimeError around EFBIG)."""
    run = tmp_path / "run"
    args = SHORT + [f"train.output_dir={run}", "train.checkpoint_every=2"]
    r = torchrun(2, args + ["train.max_steps=2"], timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    first = run / "checkpoints" / "step_00000002"
    before = {f: open(first / f, "rb").read() for f in os.listdir(first)}

    t0 = time.time()
    r = torchrun(2, args + ["train.max_steps=4", "train.resume=auto"], timeout=300, preexec_fn=_file_limit(2_500_000))
    out = r.stdout + r.stderr
    assert r.returncode != 0
    line = [x for x in out.splitlines() if x.startswith("dflash_dist: checkpoint error:")]
    assert len(line) == 1, out[-3000:]
    msg = line[0]
    assert str(run / "checkpoints" / "step_00000004") in msg and "errno 27 EFBIG" in msg
    assert re.search(r"needs about \d+ bytes", msg) and f"the checkpoint {first} is intact" in msg
    assert f"train.output_dir={run} train.resume=auto" in msg and "ulimit -f" in msg
    assert 2 in _exit_codes(out) and time.time() - t0 < 120
    assert sorted(os.listdir(run / "checkpoints")) == ["step_00000002"]  # no .tmp_step_* left behind
    assert {f: open(first / f, "rb").read() for f in os.listdir(first)} == before
    assert not os.path.exists(run / ".dflash-claim")

    r = torchrun(2, args + ["train.max_steps=4", "train.resume=auto"], timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert f"resuming from {first}" in out and (run / "checkpoints" / "step_00000004" / "meta.json").exists()


def test_resume_auto_skips_an_unusable_newest_checkpoint_and_totals_add_up(tmp_path):
    """A newest checkpoint whose meta.json is ``[1]``: skipped with its reason, the older one resumed; the run's
    totals in the accounting record and the summary cover both launches. Then a cursor outside the plan: refused
    with one checkpoint error naming file and field, exit 2, before any model loads."""
    run = tmp_path / "run"
    args = SHORT + [f"train.output_dir={run}", "train.checkpoint_every=2", "logging.debug.record_sample_ids=true",
                    "topology.target_ranks=1"]
    r = torchrun(3, args + ["train.max_steps=4"], timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    newest = run / "checkpoints" / "step_00000004"
    (newest / "meta.json").write_text("[1]")
    r = torchrun(3, args + ["train.max_steps=6", "train.resume=auto"], timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert out.count(f"skipping checkpoint {newest}: meta.json holds a list, not a JSON object") == 1, out[-3000:]
    assert f"resuming from {run / 'checkpoints' / 'step_00000002'}" in out
    acc = accounting(run)
    # what the run trained: each message of the plan up to the cursor once (the first launch's steps 3-4 were
    # trained again by the second, from the same plan: count every message index once)
    by_k = {x["k"]: len(x["ids"]) for x in sample_log(run)}
    cursor = json.load(open(run / "checkpoints" / "step_00000006" / "meta.json"))["cursor"]
    assert sorted(by_k) == list(range(cursor))
    assert acc["run_samples_trained"] == sum(by_k.values()) > acc["samples_trained"]
    assert acc["run_samples_sent"] == acc["run_samples_trained"] + acc["run_samples_skipped"]
    assert acc["run_launches"] == 2 and acc["run_samples_repeated"] == 0
    first_two = sum(n for k, n in by_k.items() if k < 4)  # the checkpoint of step 2 holds 2 x 2 messages
    assert acc["run_samples_sent"] - acc["samples_sent"] == first_two
    assert (f"over the run's 2 launches: {int(acc['run_samples_sent'])} sent, {int(acc['run_samples_trained'])} "
            f"trained") in out

    meta_path = run / "checkpoints" / "step_00000006" / "meta.json"
    meta = json.load(open(meta_path))
    meta["cursor"] = -5
    meta_path.write_text(json.dumps(meta))
    newest = run / "checkpoints" / "step_00000006"
    r = torchrun(3, args + ["train.max_steps=8", f"train.resume={newest}"], timeout=300)
    out = r.stdout + r.stderr
    assert out.count("checkpoint error:") == 1, out[-3000:]
    assert f"checkpoint error: {meta_path}: cursor" in out and "-5" in out, out[-3000:]
    assert _exit_codes(out) == [2, 2, 2] and "target loaded" not in out
    assert not glob.glob(str(run / "checkpoints" / "step_00000008"))
