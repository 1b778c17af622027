"""dflash-train, the one-node launcher (CPU, gloo): --help and --cfg job print once from any directory, wrong
settings and unusable data exit 2 with one line and no traceback, Ctrl-C / SIGTERM checkpoint, print the command
that continues the run, and exit 130 / 143."""

import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time

import pytest
from helpers.launch_util import REPO, shared_data_cache

QUICK = ["train.eval_every=0", "train.eval_prompts=0", "logging.wandb.mode=disabled", "logging.progress_bar=false"]


def dflash_train_cmd() -> list:
    """The installed console script (pyproject [project.scripts]); python -m on a checkout without it."""
    exe = shutil.which("dflash-train", path=os.path.dirname(sys.executable)) or shutil.which("dflash-train")
    return [exe] if exe else [sys.executable, "-m", "dflash_dist.cli.train"]


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
                PYTHONUNBUFFERED="1", WANDB_MODE="disabled")


def dflash_train(args: list, cwd, timeout: float = 240, popen: bool = False):
    cmd = dflash_train_cmd() + [str(a) for a in args]
    if popen:
        return subprocess.Popen(cmd, cwd=str(cwd), env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
    return subprocess.run(cmd, cwd=str(cwd), env=_env(), capture_output=True, text=True, timeout=timeout)


def test_help_prints_once_from_any_directory(tmp_path):
    r = dflash_train(["--help"], cwd=tmp_path, timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert out.count("usage: dflash-train") == 1 and out.count("config groups (") == 1, out[-3000:]
    groups = out.split("config groups (")[1].split("keys (")[0]
    assert "tiny_llama3" in groups and "paper" in groups and "jsonl" in groups
    assert "base" not in groups.replace(",", " ").split()  # config/'s defaults, not an option to pick
    lines = out.splitlines()
    at = lines.index("  train.lr = 0.002")  # the default job's value (train=tiny), then config/'s docstring
    assert lines[at + 1].strip() == "Peak AdamW learning rate."
    assert "  target.tuning.pad_multiple = null" in lines and "  logging.wandb.mode = null" in lines
    assert "Traceback" not in out


def test_cfg_job_prints_the_checked_config_once(tmp_path):
    r = dflash_train(["--cfg", "job", "train.max_steps=7", "drafter=dflash"], cwd=tmp_path, timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert out.count("\ntrain:\n") == 1 and out.startswith("target:\n"), out[-3000:]
    assert out.count("max_steps: 7") == 1 and "num_layers: 5" in out  # the override and the preset, resolved
    assert not os.listdir(tmp_path)  # nothing started, nothing written
    # the same checks as training: a split that needs the world size, a target layer the target lacks
    r = dflash_train(["--cfg", "job", "--nproc-per-node", "2", "topology.target_ranks=2"], cwd=tmp_path)
    assert r.returncode == 2 and "topology.target_ranks=2 leaves no drafter rank in a world of 2" in r.stderr
    r = dflash_train(["--cfg", "job", "target.layer_ids=[1,99]"], cwd=tmp_path)
    assert r.returncode == 2 and "target.layer_ids [99] out of range" in r.stderr, r.stderr[-3000:]
    assert "max_steps" not in r.stdout


@pytest.mark.parametrize("args, needle", [
    (["--nproc-per-node", "3", "train.lr_typo=1"], "unknown key 'train.lr_typo'"),
    (["--nproc-per-node", "3", "topology.target_ranks=5"], "topology.target_ranks=5 leaves no drafter rank"),
    (["--nproc-per-nodes", "3"], "unknown option '--nproc-per-nodes'"),
    (["--nproc-per-node", "3", "data.max_length=8192"], "data.max_length=8192 is beyond the target's positions"),
])
def test_wrong_settings_print_one_line_and_exit_2(tmp_path, args, needle):
    r = dflash_train(args + [f"train.output_dir={tmp_path / 'run'}"], cwd=tmp_path, timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode == 2, out[-3000:]
    assert [line for line in out.splitlines() if line.strip()] == [line for line in out.splitlines()
                                                                  if needle in line], out[-3000:]
    assert out.count(needle) == 1 and "Traceback" not in out
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_an_error_of_the_ranks_exits_2_without_the_launcher_report(tmp_path):
    """Unusable data is found by the ranks (rank 0 reads it): they print it once and exit 2; so does dflash-train,
    without torch's ChildFailedError report."""
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    r = dflash_train(["--nproc-per-node", "2", *QUICK, "data=jsonl", f"data.source={empty}",
                      f"train.output_dir={tmp_path / 'e'}"], cwd=tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode == 2, out[-4000:]
    assert out.count("no usable conversation") == 1, out[-4000:]
    assert "Traceback" not in out and "ChildFailedError" not in out and "exitcode" not in out


@pytest.mark.parametrize("limit, path", [(64, ".dflash-claim"), (2000, "data_cache")])
def test_a_full_disk_at_start_is_one_line_with_the_path_and_errno(tmp_path, limit, path):
    """The first writes of a job (the run directory's claim, then the tokenized data cache) past ``ulimit -f``
    (EFBIG, as a full disk gives ENOSPC; Python ignores SIGXFSZ): one ``disk error`` line naming the file and the
    errno, exit 2, no traceback from any rank."""
    import resource
    run = tmp_path / "run"
    r = subprocess.run(dflash_train_cmd() + ["--nproc-per-node", "2", *QUICK, f"train.output_dir={run}"],
                       cwd=str(tmp_path), env=_env(), capture_output=True, text=True, timeout=240,
                       preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)))
    out = r.stdout + r.stderr
    lines = [x for x in out.splitlines() if "disk error:" in x]
    assert r.returncode == 2 and len(lines) == 1, out[-4000:]
    assert lines[0].startswith(f"dflash_dist: disk error: cannot write {run / path}") and "(errno 27 EFBIG)" in lines[0]
    assert "Traceback" not in out and "ChildFailedError" not in out


def _train_steps(run_dir) -> list:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [x["step"] for x in recs if x.get("kind") == "train"]


def _signal_when_training(p, run_dir, sig, after_step: int = 0, within_s: float = 240) -> str:
    """Once the run has logged a step past ``after_step``, send ``sig`` to the dflash-train process only (as a
    terminal's Ctrl-C or a scheduler would); returns its output after it exits."""
    deadline = time.monotonic() + within_s
    while not any(s > after_step for s in _train_steps(run_dir)):
        if p.poll() is not None or time.monotonic() > deadline:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            pytest.fail(f"no training step after {after_step}:\n" + p.communicate()[0][-4000:])
        time.sleep(0.2)
    p.send_signal(sig)
    try:
        return p.communicate(timeout=180)[0]
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)


def _checkpoints(run_dir) -> list:
    return sorted(os.listdir(run_dir / "checkpoints")) if (run_dir / "checkpoints").is_dir() else []


@pytest.mark.slow
def test_ctrl_c_then_sigterm_checkpoint_print_how_to_continue_and_exit_130_143(tmp_path):
    run = tmp_path / "run"
    args = ["--nproc-per-node", "3", *QUICK, "train.max_steps=400", "logging.log_every=1", f"train.output_dir={run}",
            f"data.cache_dir={shared_data_cache()}"]
    p = dflash_train(args, cwd=tmp_path, popen=True)
    out = _signal_when_training(p, run, signal.SIGINT)
    assert p.returncode == 130, out[-4000:]
    assert "Traceback" not in out and "SignalException" not in out, out[-4000:]
    (ckpt,) = _checkpoints(run)
    meta = json.loads((run / "checkpoints" / ckpt / "meta.json").read_text())
    assert meta["reason"] == "signal"
    assert f"checkpoint: {run / 'checkpoints' / ckpt}" in out
    (line,) = [x for x in out.splitlines() if x.startswith("dflash-train: to continue: ")]
    resume = shlex.split(line.split(": ", 2)[2])
    assert resume[:3] == ["dflash-train", "--nproc-per-node", "3"]
    assert resume[-2:] == [f"train.output_dir={run}", "train.resume=auto"]
    assert resume.count(f"train.output_dir={run}") == 1

    # the printed command continues the run; SIGTERM (a scheduler's) stops it the same way, exit 143
    p = dflash_train(resume[1:], cwd=tmp_path, popen=True)
    out = _signal_when_training(p, run, signal.SIGTERM, after_step=meta["step"])
    assert p.returncode == 143, out[-4000:]
    assert "resuming from" in out and "Traceback" not in out, out[-4000:]
    assert len(_checkpoints(run)) == 2 and "to continue: dflash-train" in out


@pytest.mark.slow
def test_ctrl_c_twice_stops_at_once_without_a_checkpoint_or_traceback(tmp_path):
    run = tmp_path / "run"
    p = dflash_train(["--nproc-per-node", "2", *QUICK, "train.max_steps=3000", "logging.log_every=1",
                      f"train.output_dir={run}", f"data.cache_dir={shared_data_cache()}"], cwd=tmp_path, popen=True)
    out, deadline = [], time.monotonic() + 240
    try:
        for line in p.stdout:  # the first Ctrl-C once a step is logged, the second once both ranks took the first
            out.append(line)
            if "INFO step 1/" in line:
                p.send_signal(signal.SIGINT)
            if sum("received SIGTERM" in x for x in out) == 2:
                p.send_signal(signal.SIGINT)
                break
            assert time.monotonic() < deadline, "".join(out)[-4000:]
        out.append(p.communicate(timeout=120)[0])
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    out = "".join(out)
    assert p.returncode == 130, out[-4000:]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-4000:]
    assert out.count("stopped at once on a second signal: no checkpoint written") == 1
    assert "stopped on SIGINT without a checkpoint" in out and "to continue" not in out
    assert _checkpoints(run) == []


@pytest.mark.slow
def test_a_dead_rank_fails_the_job_with_one_summary_line(tmp_path):
    """kill -9 of a rank: the survivors name it (comm/lifecycle.py), dflash-train exits 1 with one line listing each
    rank's end instead of torch's launcher report."""
    run = tmp_path / "run"
    p = dflash_train(["--nproc-per-node", "2", *QUICK, "train.max_steps=3000", "logging.log_every=1",
                      f"train.output_dir={run}", f"data.cache_dir={shared_data_cache()}"], cwd=tmp_path, popen=True)
    try:
        deadline = time.monotonic() + 240
        while not _train_steps(run):
            assert p.poll() is None and time.monotonic() < deadline, p.communicate()[0][-4000:]
            time.sleep(0.2)
        with open(f"/proc/{p.pid}/task/{p.pid}/children") as f:
            target = int(f.read().split()[-1])  # the last rank started: the target
        os.kill(target, signal.SIGKILL)
        out = p.communicate(timeout=120)[0]
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 1, out[-4000:]
    assert "stopping without a checkpoint because rank 1 (target" in out, out[-4000:]
    (line,) = [x for x in out.splitlines() if x.startswith("dflash-train: the job failed: ")]
    assert "rank 1 killed by SIGKILL" in line and "rank 0 exit code 1" in line
    assert "Root Cause" not in out and "elastic/errors.html" not in out


@pytest.mark.parametrize("checkpoint_every", [0, 1])
def test_a_diverged_run_exits_3_with_one_line_and_no_nonfinite_checkpoint(tmp_path, checkpoint_every):
    """train.lr=1e5: the gradient norm turns non-finite; the job stops after train.max_nonfinite_steps such steps
    (checkpoint_every=0: found at the logging window) or at the first save after one (checkpoint_every=1), exit 3,
    one line naming the step, no traceback, no 'run finished', every checkpoint left finite."""
    from safetensors.torch import load_file
    run = tmp_path / "run"
    p = dflash_train(["--nproc-per-node", "2", *QUICK, "train.lr=1e5", "train.max_steps=40", "logging.log_every=1",
                      f"train.checkpoint_every={checkpoint_every}", f"train.output_dir={run}",
                      f"data.cache_dir={shared_data_cache()}"], cwd=tmp_path)
    out = p.stdout + p.stderr
    assert p.returncode == 3, out[-4000:]
    (line,) = [x for x in out.splitlines() if "training diverged" in x]
    assert line.startswith("dflash_dist: training diverged at step ")
    assert ("for 3 step(s) in a row" in line) if checkpoint_every == 0 else ("a checkpoint now would hold" in line)
    assert "Traceback" not in out and "run finished" not in out and "the job failed" not in out
    ckpts = sorted((run / "checkpoints").glob("step_*")) if (run / "checkpoints").exists() else []
    assert (ckpts == []) if checkpoint_every == 0 else (len(ckpts) >= 1)
    for ck in ckpts:
        assert all(t.isfinite().all() for t in load_file(str(ck / "model.safetensors")).values()), ck
    recs = [json.loads(x) for x in open(run / "metrics.jsonl")]
    first_bad = min(r["step"] for r in recs if r.get("kind") == "train"   # NaN is logged as null
                    and (r["grad_norm"] is None or not math.isfinite(r["grad_norm"])))
    assert f"at step {first_bad}:" in line, (line, recs)
