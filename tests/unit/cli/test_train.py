"""dflash-train's own pieces: its options, the command that continues a run, which rank failures are a user's."""

import signal

import pytest

from dflash_dist.cli.train import parse_args, resume_command, usage_failure
from dflash_dist.config import ConfigError


def test_options_and_overrides():
    assert parse_args(["--nproc-per-node", "4", "train.max_steps=3", "--cfg", "job"]) == \
        (4, "job", False, ["train.max_steps=3"])
    assert parse_args(["--nproc-per-node=2", "-h", "target=hf"]) == (2, None, True, ["target=hf"])
    assert parse_args(["+train.x=1", "~logging.debug"]) == (None, None, False, ["+train.x=1", "~logging.debug"])
    for bad, needle in ((["--nproc-per-node", "0"], "--nproc-per-node '0'"), (["--nproc-per-node"], "''"),
                        (["--cfg", "hydra"], "only '--cfg job'"), (["-m", "a=1,2"], "unknown option '-m'")):
        with pytest.raises(ConfigError, match=needle):
            parse_args(bad)


def test_resume_command_replaces_the_run_directory_and_resume_keys():
    cmd = resume_command(3, ["train.max_steps=9", "train.output_dir=old", "train.resume=none",
                             "data.source=/data/my file.jsonl"], "outputs/run-1")
    assert cmd == ("dflash-train --nproc-per-node 3 train.max_steps=9 'data.source=/data/my file.jsonl' "
                   "train.output_dir=outputs/run-1 train.resume=auto")


class _Failure:
    def __init__(self, exitcode):
        self.exitcode = exitcode


class _Err:
    def __init__(self, *codes):
        self.failures = {r: _Failure(c) for r, c in enumerate(codes)}


def test_usage_failure_is_exit_2_with_at_most_ranks_the_agent_stopped():
    assert usage_failure(_Err(2, 2, 2)) and usage_failure(_Err(2, -signal.SIGTERM))
    assert not usage_failure(_Err(1, 2)) and not usage_failure(_Err(-signal.SIGKILL)) and not usage_failure(_Err(1))


def test_one_of_several_srun_tasks_is_refused(monkeypatch, capsys):
    from dflash_dist.cli.train import main
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "16")
    before = signal.getsignal(signal.SIGINT)
    assert main(["train.max_steps=1"]) == 2
    assert "not as one of several srun tasks" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGINT) is before  # the launcher's signal relay is gone once it returns


@pytest.mark.parametrize("override", ["drafter.variant=os:getcwd", "drafter.loss.objective=os:getcwd",
                                      "drafter.variant=no.such.module:X"])
def test_code_named_on_the_command_line_is_one_line(override, capsys):
    """``drafter.variant=os:getcwd``: dflash-train's own check refuses it with one line, exit 2, before any rank
    starts (that it is never called: tests/unit/model/test_registry.py); dflash-doctor's config row says the same."""
    from dflash_dist.cli import doctor
    from dflash_dist.cli.train import main
    assert main(["--nproc-per-node", "3", "--cfg", "job", override]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    key = override.split("=")[0]
    assert len(err) == 1 and err[0].startswith(f"dflash_dist: configuration error: {key}="), err
    doc = doctor.Doctor()
    doc.run("config", lambda d: doctor.check_config(d, [override], 3))
    assert doc.rows[0]["status"] == doctor.FAIL and f"{key}=" in doc.rows[0]["detail"]
