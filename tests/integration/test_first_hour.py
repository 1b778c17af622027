"""A new user's first hour under torchrun (CPU, gloo): run directories, resume, max_steps, data and config errors."""

import glob
import json
import os
import re
import time

from helpers.launch_util import torchrun

from dflash_dist.data.conversations import REGENERATED_JSONL

QUICK = ["-m", "dflash_dist.train", "train.eval_every=0", "train.eval_prompts=0", "logging.wandb.mode=disabled"]


def _rows(path, n):
    with open(REGENERATED_JSONL) as f:
        rows = [next(f) for _ in range(n)]
    path.write_text("".join(rows))
    return str(path)


def _timed_torchrun(nproc, args, cwd, timeout=240):
    """(returncode, output, seconds from the first line a rank logged to the end of the job)."""
    p = torchrun(nproc, args, popen=True, cwd=cwd)
    out, first = [], None
    deadline = time.monotonic() + timeout
    for line in p.stdout:
        if first is None and re.match(r"\d\d:\d\d:\d\d \[rank \d", line):
            first = time.monotonic()
        out.append(line)
        if time.monotonic() > deadline:
            p.kill()
            break
    p.wait(timeout=60)
    return p.returncode, "".join(out), time.monotonic() - (first or time.monotonic())


def _rank_exit_codes(out):
    return [int(c) for c in re.findall(r"exitcode\s+:\s*(-?\d+)", out)]


def test_runs_get_their_own_directory_and_resume_never_hangs_or_mixes(tmp_path):
    cwd = tmp_path / "work"
    cwd.mkdir()
    # 1. no train.output_dir: a new run directory under outputs/, a quiet console and a summary at the end
    r = torchrun(3, QUICK + ["train.max_steps=2"], cwd=str(cwd), timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    (run,) = glob.glob(str(cwd / "outputs" / "run-*"))
    assert {"run.json", "config.json", "metrics.jsonl", "checkpoints"} <= set(os.listdir(run))
    assert "USDT" not in out and "profiler_start" not in out
    rel = os.path.relpath(run, cwd)
    assert "run finished: 2 steps" in out and f"metrics:    {rel}/metrics.jsonl" in out
    assert f"checkpoint: {rel}/checkpoints/step_00000002" in out
    metrics = open(os.path.join(run, "metrics.jsonl")).read()

    # 2. resuming the finished run: nothing left to train, every rank exits 0 at once (was: a 900 s wait, exit 1)
    rc, out, after_start = _timed_torchrun(3, QUICK + ["train.max_steps=2", "train.resume=auto"], str(cwd))
    assert rc == 0, out[-4000:]
    assert out.count("nothing left to train") == 1 and rel in out
    assert "target loaded" not in out
    assert after_start <= 30, f"{after_start:.1f} s after the ranks started"

    # 3. resume into that directory with another dataset: refused before any model loads, naming what differs
    other = _rows(tmp_path / "mine.jsonl", 200)
    r = torchrun(3, QUICK + ["data=jsonl", f"data.source={other}", f"train.output_dir={run}", "train.resume=auto",
                             "train.max_steps=30"], cwd=str(cwd), timeout=240)
    out = r.stdout + r.stderr
    assert r.returncode != 0
    assert out.count("already holds a run") == 1, out[-4000:]
    assert "- data: " in out and "mine.jsonl" in out and "train.resume=none" in out
    assert "target loaded" not in out and out.count("Traceback") <= 1  # torchrun's own, none of a rank
    assert _rank_exit_codes(out) == [2, 2, 2]

    # 4. a new run into it (train.resume=none): refused too; the first run's files are untouched
    r = torchrun(2, QUICK + [f"train.output_dir={run}"], cwd=str(cwd), timeout=240)
    assert r.returncode != 0 and "already holds a run" in r.stdout + r.stderr
    assert open(os.path.join(run, "metrics.jsonl")).read() == metrics
    assert len(glob.glob(str(cwd / "outputs" / "run-*"))) == 1


def test_max_steps_trains_exactly_and_small_files_train(tmp_path):
    data = _rows(tmp_path / "d200.jsonl", 200)
    out_dir = tmp_path / "r200"
    r = torchrun(2, QUICK + ["data=jsonl", f"data.source={data}", "data.num_workers=0", "train.max_steps=30",
                             f"train.output_dir={out_dir}", "logging.log_every=10"], timeout=400)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    recs = [json.loads(x) for x in open(out_dir / "metrics.jsonl")]
    assert [x["step"] for x in recs if x["kind"] == "train"][-1] == 30  # was 14: the 3 epochs stopped it first
    assert "train.max_steps=30: 30 optimizer steps" in out
    assert "200 conversations, 20 held out" in out
    # the run's rate with the startup and compiles in it, and apart from them the steady steps' rate
    pace = re.search(r"pace: +steps 1-4 \(compiles, checked steps\) to [\d.]+ s; steps 5-30 in ([\d.]+) s, "
                     r"([\d.]+) samples/s on this drafter rank;", out)
    assert pace and float(pace.group(1)) > 0 and float(pace.group(2)) > 0, out[-3000:]

    small = _rows(tmp_path / "d50.jsonl", 50)
    r = torchrun(2, QUICK + ["data=jsonl", f"data.source={small}", "data.num_workers=0", "train.max_steps=2",
                             f"train.output_dir={tmp_path / 'r50'}"], timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]  # was: "data.holdout=64 leaves no training data out of 50"
    assert "50 conversations, 5 held out" in out


def test_data_and_config_errors_are_printed_once_and_exit_2(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    r = torchrun(3, QUICK + ["data=jsonl", f"data.source={empty}", f"train.output_dir={tmp_path / 'e'}"],
                 timeout=240)
    out = r.stdout + r.stderr
    assert r.returncode == 1  # what the shell sees: torchrun's own status when a worker fails
    assert out.count("no usable conversation") == 1, out[-4000:]
    assert str(empty) in out and "0 row" in out
    assert _rank_exit_codes(out) == [2, 2, 2]
    assert "Connection closed" not in out and out.count("Traceback") <= 1  # torchrun's own, none of a rank

    r = torchrun(2, QUICK + ["target=hf", "target.name_or_path=/models/does-not-exist",
                             f"train.output_dir={tmp_path / 'm'}"], timeout=240)
    out = r.stdout + r.stderr
    assert out.count("target.name_or_path=/models/does-not-exist: no such directory") == 1, out[-4000:]
    assert "Repo id must be" not in out
    assert _rank_exit_codes(out) == [2, 2]


    # an unknown key (Hydra's own composition error): once, naming the known keys, every rank exits 2
    r = torchrun(3, QUICK + ["train.lr_typo=1e-4", f"train.output_dir={tmp_path / 'k'}"], timeout=240)
    out = r.stdout + r.stderr
    assert out.count("unknown key 'train.lr_typo'") == 1, out[-4000:]
    assert "'lr'" in out and "Set the environment variable HYDRA_FULL_ERROR" not in out
    assert _rank_exit_codes(out) == [2, 2, 2]
