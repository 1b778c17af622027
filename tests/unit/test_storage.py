"""storage: the writes at the start of a job (the run directory's claim, run.json and config.json, the tokenized
data cache, metrics.jsonl, the split plan) that the storage refuses are one line naming the path and the errno,
never a traceback. Without root: Python ignores SIGXFSZ, so a write past ``ulimit -f`` (RLIMIT_FSIZE, set in a
subprocess) fails with EFBIG like a full disk fails with ENOSPC."""

import errno
import os
import resource
import subprocess
import sys

import pytest
from helpers.launch_util import REPO

from dflash_dist.storage import StorageError, storage_error, writing

_WRITERS = r"""
import sys, types
from dflash_dist.storage import StorageError
which, root = sys.argv[1], sys.argv[2]
try:
    if which == "claim":
        from dflash_dist.checkpoint.claim import claim_run_dir
        claim_run_dir(root + "/run")
    elif which == "run_files":
        from dflash_dist.checkpoint.resume import write_run_files
        from dflash_dist.config import JobConfig
        job = types.SimpleNamespace(run_dir=root + "/run", resume_from=None, epoch_messages=3, identity={"x": 1},
                                    cfg=JobConfig.from_dict({"target": {"hf_config": {"builtin": "tiny"}}}))
        write_run_files(job)
    elif which == "data_cache":
        from dflash_dist.config import DataConfig
        from dflash_dist.data.prepare import build_dataset
        from dflash_dist.targets.hf import TINY_DIR
        build_dataset(DataConfig(), root + "/run/data_cache", TINY_DIR, 2048, "k")
    elif which == "metrics":
        from dflash_dist.config import WandbConfig
        from dflash_dist.telemetry.metrics import MetricsWriter
        w = MetricsWriter(root + "/run", {}, WandbConfig(mode="disabled"), 10, True, progress_bar=False)
        w.log(1, {"loss": 1.0, "note": "x" * 4000})
    elif which == "plan":
        from dflash_dist.planning.startup import write_plan_json
        write_plan_json(root + "/run/plan.json", {"splits": ["x" * 4000]})
except StorageError as e:
    print("ERR", e)
"""


@pytest.mark.parametrize("which, limit, path", [
    ("claim", 64, "run/.dflash-claim"), ("run_files", 64, "run/"), ("run_files", 1500, "run/config.json"),
    ("data_cache", 2000, "run/data_cache"), ("metrics", 1000, "run/metrics.jsonl"), ("plan", 1000, "run/plan.json"),
])
def test_a_write_past_the_file_size_limit_is_one_line_with_path_and_errno(tmp_path, which, limit, path):
    r = subprocess.run([sys.executable, "-c", _WRITERS, which, str(tmp_path)], cwd=REPO, capture_output=True,
                       text=True, timeout=120, env=dict(os.environ, PYTHONPATH=REPO),
                       preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)))
    lines = r.stdout.splitlines()
    assert r.returncode == 0 and len(lines) == 1 and lines[0].startswith("ERR cannot write "), r.stdout + r.stderr
    assert str(tmp_path / path) in lines[0] and "(errno 27 EFBIG)" in lines[0] and "ulimit -f" in lines[0]


def test_storage_errnos_become_one_line_and_others_stay_as_they_are(tmp_path):
    target = str(tmp_path / "f")
    with pytest.raises(StorageError, match=rf"cannot write {target} \(a test\): the disk is full \(errno 28 ENOSPC\)"):
        with writing(str(tmp_path), "a test"):
            raise OSError(errno.ENOSPC, "No space left on device", target)
    with pytest.raises(StorageError, match="the disk quota is exceeded"):
        with writing(target, "a test"):
            raise RuntimeError("[enforce fail at inline_container.cc] unexpected pos") from OSError(errno.EDQUOT, "q")
    with pytest.raises(FileNotFoundError):      # not the storage's: left to the caller
        with writing(target, "a test"):
            open(str(tmp_path / "missing" / "x"))
    assert storage_error(target, "x", RuntimeError("Error while serializing: I/O error (os error 30)")) is not None
    assert storage_error(target, "x", ValueError("no errno")) is None


def test_a_rank_says_a_disk_error_once_and_exits_2():
    code = ("from dflash_dist.train import usage_error_exit; from dflash_dist.storage import StorageError; "
            "usage_error_exit(StorageError('cannot write /x (y): the disk is full (errno 28 ENOSPC)'))")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                       env={k: v for k, v in os.environ.items() if k != "RANK"})
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == \
        "dflash_dist: disk error: cannot write /x (y): the disk is full (errno 28 ENOSPC)", r.stderr
    assert "Traceback" not in r.stderr

