"""Launchers: a two-node c10d rendezvous on this machine, launch/single_node.sh end to end, the SLURM and manual
multi-node scripts' torchrun command lines and SIGTERM forwarding (fake srun/scontrol/python), and the shell syntax
of every script under launch/ and docker/."""

import glob
import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time

import pytest
from helpers.launch_util import REPO, free_port, shared_data_cache, torchrun

JOB_TIMEOUT = 300  # one tiny torchrun job takes ~20-40 s on a 2-core machine; leave room for a busy one

# launch mechanics only: no wandb run, no closing evaluation
SHORT_RUN = ["train.max_steps=4", "logging.log_every=2", "topology.target_ranks=1", "logging.progress_bar=false",
             "logging.wandb.mode=disabled", "train.eval_prompts=0"]


def _wait_all(procs, timeout):
    """Wait for every Popen (stdout piped, own session) at once; on timeout kill their process groups.

    Each process is drained by its own thread so that a full pipe never blocks one agent while another waits
    for it in a collective. Returns [(returncode, or None if it was still running at the timeout, output)]."""
    outs = [None] * len(procs)

    def drain(i, p):
        outs[i] = p.communicate()[0]

    threads = [threading.Thread(target=drain, args=(i, p), daemon=True) for i, p in enumerate(procs)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    late = [p.poll() is None for p in procs]
    if any(late):
        for p in procs:  # one agent stuck means the job is stuck: end all of them
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for t in threads:
            t.join(30)
    return [(None if late[i] else p.returncode, outs[i] or "") for i, p in enumerate(procs)]


def _report(results, names):
    return "\n".join(f"----- {n}: exit {'timeout' if rc is None else rc} -----\n{out[-6000:]}"
                     for n, (rc, out) in zip(names, results))


def _metrics_steps(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line)["step"] for line in f if line.strip()]


@pytest.mark.slow
def test_two_agents_as_two_nodes(tmp_path):
    """Two torchrun agents on one machine, one process each, meet through a c10d rendezvous like two nodes would:
    the drafter (global rank 0) on one, the target (global rank 1) on the other: a split that cannot be node-local,
    so it runs only with topology.cross_node=true."""
    out = tmp_path / "run"
    rdzv = f"127.0.0.1:{free_port()}"
    args = ["-m", "dflash_dist.train", *SHORT_RUN, f"train.output_dir={out}", "topology.cross_node=true"]
    procs = [torchrun(1, args, nnodes=2, node_rank=i, rdzv=rdzv, popen=True) for i in range(2)]
    results = _wait_all(procs, JOB_TIMEOUT)
    names = ["node 0", "node 1"]
    assert all(rc == 0 for rc, _ in results), _report(results, names)
    assert 4 in _metrics_steps(out), _report(results, names)
    assert (out / "checkpoints" / "step_00000004").is_dir(), _report(results, names)
    assert not list((out / "checkpoints").glob(".tmp*")), "no half-written checkpoint left behind"


@pytest.mark.slow
def test_single_node_script_runs_a_job(tmp_path):
    out = tmp_path / "run"
    env = dict(os.environ, PYTHON=sys.executable, WANDB_MODE=os.environ.get("WANDB_MODE", "offline"),
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.Popen(["bash", "launch/single_node.sh", "2", "train.max_steps=2", "logging.log_every=1",
                          "logging.progress_bar=false", "logging.wandb.mode=disabled", "train.eval_prompts=0",
                          f"data.cache_dir={shared_data_cache()}", f"train.output_dir={out}"],
                         cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    results = _wait_all([p], JOB_TIMEOUT)
    assert results[0][0] == 0, _report(results, ["launch/single_node.sh 2"])
    assert 2 in _metrics_steps(out)
    assert (out / "checkpoints" / "step_00000002").is_dir()


def _scripts():
    found = sorted(glob.glob(os.path.join(REPO, "launch", "*.sh")) + glob.glob(os.path.join(REPO, "launch", "*.sbatch"))
                   + glob.glob(os.path.join(REPO, "docker", "*.sh")))
    return [os.path.relpath(f, REPO) for f in found]


def test_scripts_exist():
    assert {"launch/single_node.sh", "launch/multinode.sh", "launch/slurm.sbatch",
            "docker/build_causal_conv1d.sh"} <= set(_scripts())
    for name in ("launch/single_node.sh", "launch/multinode.sh", "docker/build_causal_conv1d.sh"):
        assert os.stat(os.path.join(REPO, name)).st_mode & stat.S_IXUSR, f"{name} is not executable"


@pytest.mark.parametrize("script", _scripts())
def test_shell_syntax(script):
    r = subprocess.run(["bash", "-n", script], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def _fake_bin(tmp_path, name, body):
    d = tmp_path / "bin"
    d.mkdir(exist_ok=True)
    f = d / name
    f.write_text("#!/usr/bin/env bash\n" + body)
    f.chmod(0o755)
    return d


# records its argv one per line (a blank line ends a call), then exits with $FAKE_RC, or with SLEEP=1 waits to be
# signalled and records the signal
_RECORDER = """\
log=$FAKE_LOG
for a in "$0" "$@"; do printf '%s\\n' "$a" >> "$log"; done; echo >> "$log"
if [[ ${SLEEP:-0} == 1 ]]; then
  trap 'echo "got TERM" >> "$log"; exit 143' TERM
  echo started > "$log.started"
  while :; do sleep 0.1; done
fi
exit "${FAKE_RC:-0}"
"""


def _calls(log):
    text = log.read_text()
    return [c.splitlines() for c in text.split("\n\n") if c.strip()]


def _slurm_env(tmp_path, **extra):
    bindir = _fake_bin(tmp_path, "srun", _RECORDER)
    _fake_bin(tmp_path, "scontrol", 'if [[ $1 == show && $2 == hostnames ]]; then printf "gpu-a7\\ngpu-b3\\n"; '
                                    'else exit 1; fi\n')
    env = dict(os.environ, PATH=f"{bindir}{os.pathsep}{os.environ['PATH']}", FAKE_LOG=str(tmp_path / "srun.log"),
               SLURM_JOB_ID="4242", SLURM_NNODES="2", SLURM_JOB_NODELIST="gpu-[a7,b3]", SLURM_JOB_NAME="dflash",
               SLURM_SUBMIT_DIR=str(tmp_path), SLURM_CPUS_ON_NODE="64", SLURM_GPUS_ON_NODE="8")
    for k in ("OMP_NUM_THREADS", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "OUTPUT_DIR", "GPUS_PER_NODE"):
        env.pop(k, None)
    env.update(extra)
    return env


def test_slurm_script_command_line(tmp_path):
    env = _slurm_env(tmp_path, FAKE_RC="3")
    r = subprocess.run(["bash", "launch/slurm.sbatch", "train.max_steps=7", "train.output_dir=/elsewhere"], cwd=REPO,
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 3, "the script exits with srun's status\n" + r.stdout + r.stderr
    (call,) = _calls(tmp_path / "srun.log")
    line = " ".join(call)
    assert "--kill-on-bad-exit=1" in call and "--cpus-per-task=64" in call
    for want in ("--nnodes 2", "--nproc-per-node 8", "--rdzv-backend c10d", "--rdzv-endpoint gpu-a7:29500",
                 "--rdzv-id 4242", "-m dflash_dist.train"):
        assert want in line, (want, line)
    own = call.index(f"train.output_dir={tmp_path}/outputs/dflash")
    assert "train.resume=auto" in call
    # the user's overrides come last, so they win over the script's
    assert call[-2:] == ["train.max_steps=7", "train.output_dir=/elsewhere"]
    assert call.index("train.output_dir=/elsewhere") > own
    assert (tmp_path / "outputs" / "dflash").is_dir()


def test_slurm_script_forwards_sigterm(tmp_path):
    env = _slurm_env(tmp_path, SLEEP="1")
    p = subprocess.Popen(["bash", "launch/slurm.sbatch"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        started = tmp_path / "srun.log.started"
        deadline = time.monotonic() + 30
        while not started.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert started.exists(), "fake srun never started"
        p.send_signal(signal.SIGTERM)  # what `#SBATCH --signal=B:TERM@120` sends: the batch shell only
        out = p.communicate(timeout=30)[0]
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert "got TERM" in (tmp_path / "srun.log").read_text(), out
    assert p.returncode == 143, out  # srun's exit status, after it finished
    assert "forwarding" in out


@pytest.mark.parametrize("node_rank", [0, 1])
def test_multinode_script_command_line(tmp_path, node_rank):
    bindir = _fake_bin(tmp_path, "python", _RECORDER)
    env = dict(os.environ, PYTHON=str(bindir / "python"), FAKE_LOG=str(tmp_path / "py.log"))
    env.pop("RDZV_PORT", None)
    env.pop("RDZV_ID", None)
    r = subprocess.run(["bash", "launch/multinode.sh", "2", str(node_rank), "10.1.2.3", "8", "train.max_steps=5"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    (call,) = _calls(tmp_path / "py.log")
    line = " ".join(call[1:])
    assert line == ("-m torch.distributed.run --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d "
                    f"--rdzv-endpoint 10.1.2.3:29500 --rdzv-id dflash --rdzv-conf is_host={1 - node_rank} "
                    "-m dflash_dist.train train.max_steps=5"), line
    bad = subprocess.run(["bash", "launch/multinode.sh", "2", "2", "10.1.2.3", "8"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "NODE_RANK" in bad.stderr


def test_docker_files():
    """No daemon here to build the image: check what can be checked without one."""
    text = open(os.path.join(REPO, "docker", "Dockerfile")).read()
    for line in text.splitlines():
        parts = line.split()
        if parts[:1] == ["COPY"] and not any(p.startswith("--from") for p in parts):
            for src in parts[1:-1]:
                assert os.path.exists(os.path.join(REPO, src)), f"Dockerfile copies missing {src}"
    assert 'ARG TORCH_CUDA_ARCH_LIST="9.0"' in text and "build_causal_conv1d.sh" in text
    ignored = open(os.path.join(REPO, ".dockerignore")).read().split()
    assert {"outputs/", "wandb/", ".git", "*.egg-info"} <= set(ignored)
