"""bench/real_model.py's own parts on CPU: processes run side by side with their exit codes and timeouts kept, and
the table reads what the stages recorded (the stages themselves are the project's commands, tested elsewhere;
tests/integration/test_real_model.py trains and evaluates on the real model)."""

import sys
import time

from helpers.bench_scripts import load_bench


def load():
    return load_bench("real_model")


def test_parallel_keeps_order_exit_codes_and_timeouts(tmp_path):
    rm = load()
    jobs = [([sys.executable, "-c", "import sys; sys.exit(3)"], str(tmp_path / "a.log"), 30),
            ([sys.executable, "-c", "import time; time.sleep(30)"], str(tmp_path / "b.log"), 1),
            ([sys.executable, "-c", "print('hi')"], str(tmp_path / "c.log"), 30)]
    t0 = time.monotonic()
    out = rm.parallel(jobs, 3)
    assert [rc for rc, _ in out] == [3, 124, 0] and time.monotonic() - t0 < 20
    assert (tmp_path / "c.log").read_text().splitlines()[-1] == "hi"


def test_table_has_a_row_per_run_with_its_figures():
    rm = load()
    ev = {"acceptance_length": 2.5, "tau": 2.75, "per_position_acceptance": [0.6, 0.4, 0.3, 0.2, 0.1]}
    res = {"regen": {"rows_written": 6000, "small_rows": 1500},
           "runs": {"dflash_small": {"steps": 10, "train_acc": 0.5, "evals": {"mtbench": ev}},
                    "dflash": {"steps": 10, "in_training_eval": {"acceptance_length": 2.4},
                               "evals": {"own_holdout": {"acceptance_length": 2.4}, "mtbench_on_fp8": ev}}}}
    lines = rm.table(res).splitlines()
    assert lines[2].startswith("| dflash_small | 1500 | 10 | - / - | 2.50 / 2.75 |") and "0.60 0.40 0.30 0.20" in lines[2]
    assert lines[3].startswith("| dflash | 6000 | 10 |") and lines[3].endswith("| 2.4000 | 2.4000 |")
    assert lines[-1] == "bf16-target DFlash drafter against the FP8 target: mtbench 2.50"


def test_a_job_out_of_device_memory_runs_again_alone_and_another_failure_does_not(tmp_path):
    rm = load()
    marker = tmp_path / "tried"
    oom_once = ("import os, sys\n"
                f"m = {str(marker)!r}\n"
                "if not os.path.exists(m):\n"
                "    open(m, 'w').close()\n"
                "    print('torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.81 GiB.'); sys.exit(1)\n"
                "print('trained')\n")
    jobs = [([sys.executable, "-c", oom_once], str(tmp_path / "a.log"), 30),
            ([sys.executable, "-c", "import sys; print('ValueError: bad'); sys.exit(1)"], str(tmp_path / "b.log"), 30)]
    out, retried = rm.parallel_then_alone(jobs, 2)
    assert [rc for rc, _ in out] == [0, 1] and retried == [0]
    assert (tmp_path / "a.log").read_text().splitlines()[-1] == "trained"
    assert "OutOfMemoryError" in (tmp_path / "a.log.oom").read_text()
    assert not (tmp_path / "b.log.oom").exists()


def test_sigterm_stops_the_running_jobs_and_starts_no_more(tmp_path):
    import signal
    rm = load()
    # the first job sends the bench (this process) the SIGTERM a scheduler's time limit would
    term_parent = "import os, signal, time; os.kill(os.getppid(), signal.SIGTERM); time.sleep(60)"
    jobs = [([sys.executable, "-c", term_parent], str(tmp_path / "a.log"), 300),
            ([sys.executable, "-c", "print('ran')"], str(tmp_path / "b.log"), 300)]
    old = signal.signal(signal.SIGTERM, rm.Stop.on_signal)
    try:
        t0 = time.monotonic()
        out, retried = rm.parallel_then_alone(jobs, 1)
    finally:
        signal.signal(signal.SIGTERM, old)
    assert rm.Stop.requested and time.monotonic() - t0 < 30
    assert out[0][0] == 124 and out[1] == (None, 0.0) and retried == []
    assert not (tmp_path / "b.log").exists()


def test_table_says_which_runs_never_trained():
    rm = load()
    res = {"regen": {"rows_written": 800, "small_rows": 200},
           "runs": {"dflash": {"train_rc": 124, "steps": None}, "domino": {"steps": 300, "train_acc": 0.1}}}
    lines = rm.table(res).splitlines()
    assert lines[2].startswith("| dflash | 800 | not trained | - / - |")
    assert lines[3].startswith("| domino | 800 | 300 |")


def test_train_summary_takes_the_served_accuracy_where_the_variant_logs_it():
    rm = load()
    recs = [{"step": 10, "acc": 0.1, "samples_per_s": 5.0}, {"step": 20, "acc": 0.2, "samples_per_s": 9.0},
            {"step": 30, "acc": 0.3, "samples_per_s": 7.0}]
    assert rm.train_summary(recs) == {"steps": 30, "train_acc": 0.3, "samples_per_s": 9.0}
    recs[-1]["served_acc"] = 0.4
    assert rm.train_summary(recs)["train_acc"] == 0.4
    assert rm.train_summary([]) == {"steps": None, "train_acc": None, "samples_per_s": None}


def test_a_trained_run_shows_its_steps_and_rows_before_the_report_stage(tmp_path, monkeypatch):
    """The data may be carried from an earlier regeneration (no ``regen`` record) and the report stage may not have
    run yet: the table reads the run's own metrics and data file, not "not trained"."""
    import argparse
    import json

    rm = load()
    (tmp_path / "regen_large.jsonl").write_text('{"messages": []}\n' * 5 + "\n")
    run_dir = tmp_path / "runs" / "dpace"
    run_dir.mkdir(parents=True)
    recs = [{"kind": "train", "step": 50, "acc": 0.2, "samples_per_s": 30.0},
            {"kind": "train", "step": 100, "acc": 0.25, "samples_per_s": 40.0}]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    monkeypatch.setattr(rm, "parallel_then_alone", lambda jobs, n: ([(0, 12.0), (124, 3.0)], []))
    args = argparse.Namespace(runs=["dpace", "domino"], work=str(tmp_path), out=str(tmp_path), real=str(tmp_path),
                              train_timeout=10, parallel=2, extra=[], eval_prompts=16, batch_tokens=4096, steps=100,
                              eval_batch=16, log_every=50)
    res = {}
    rm.stage_train(args, res)
    assert res["runs"]["dpace"]["steps"] == 100 and res["runs"]["dpace"]["data_rows"] == 5
    lines = rm.table(res).splitlines()
    assert lines[2].startswith("| dpace | 5 | 100 | - / - |") and "| 0.250 |" in lines[2]
    assert lines[3].startswith("| domino | 5 | not trained |")


def test_a_stage_rerun_on_another_machine_keeps_the_environment_of_the_measured_stages():
    rm = load()
    gpu = {"torch": "2.11.0+cu130", "gpu": "NVIDIA H100 80GB HBM3"}
    cpu = {"torch": "2.13.0+cpu"}
    res = {}
    rm.record_environment(res, "fetch", cpu)
    assert res["environment"] == cpu
    for stage in ("regen", "train", "eval"):
        rm.record_environment(res, stage, gpu)
    rm.record_environment(res, "report", cpu)
    assert res["environment"] == gpu
    assert res["stage_environment"] == {"fetch": cpu, "regen": gpu, "train": gpu, "eval": gpu, "report": cpu}
