"""dflash-report: bad lines of metrics.jsonl are skipped and counted, never the end of the report."""

import json
import os

from dflash_dist.cli import report


def test_bad_lines_are_skipped_and_counted(tmp_path, capsys):
    import matplotlib  # noqa: F401  (in the dev extra: never skipped)
    run = tmp_path / "run"
    run.mkdir()
    good = [{"step": s, "kind": "train", "loss": 5.0 / s, "samples_per_s": 10.0 * s} for s in (1, 2, 3)]
    lines = [json.dumps(r).encode() for r in good]
    lines += [b"\xff\xfe not utf-8 \x80", b"{not json", b"[1, 2]", json.dumps({"step": "7"}).encode(),
              json.dumps({"step": 4, "kind": 3}).encode(),
              json.dumps({"step": 5, "kind": "train", "loss": [1], "samples_per_s": "fast", "lr": True,
                          "slot_acc_1": {"x": 1}}).encode(),
              json.dumps({"step": 6, "kind": "eval", "tau": "high", "accept_pos_1": "x", "accept_pos_2": 0.5}).encode()]
    (run / "metrics.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    assert report.main([str(run)]) == 0
    captured = capsys.readouterr()
    assert "skipped 5 unreadable lines of metrics.jsonl" in captured.err
    assert "and 6 values that are not numbers" in captured.err
    assert "samples/s: peak 30.00, mean 20.00" in captured.out
    assert {"loss.png", "samples_per_s.png", "acceptance_per_position.png"} <= set(os.listdir(run / "report"))


def _ev(cat, name, ts, dur):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_the_runs_traces_are_summarised(tmp_path, capsys):
    """A run's debug output: each target rank's trace (logging.debug.trace_target) summarised after the first
    --trace-skip messages, each traced step of profile/ (logging.debug.profile_step, .json or .json.gz) as its phase
    table and one bar of phases.png; a trace cut short is named, not the end of the report."""
    import gzip

    import matplotlib  # noqa: F401
    run = tmp_path / "run"
    (run / "target_trace").mkdir(parents=True)
    (run / "profile").mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "kind": "train", "samples_per_s": 2.0}) + "\n")
    rows = [{"stall_ms": 500.0, "capture_ms": 900.0, "backpressure_ms": 0.0}] * 2   # load and compile: skipped
    rows += [{"stall_ms": s, "capture_ms": c, "backpressure_ms": b} for s, c, b in
             ((1.0, 30.0, 9.0), (3.0, 40.0, 7.0), (2.0, 50.0, 4.0))]
    (run / "target_trace" / "rank1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"stall')
    trace = {"traceEvents": [_ev("gpu_user_annotation", "dflash/group0 forward", 1000, 50),
                             _ev("gpu_user_annotation", "dflash/clip and optimizer", 1500, 10),
                             _ev("kernel", "gemm", 1000, 300), _ev("kernel", "adam", 1500, 500)]}
    (run / "profile" / "drafter_rank0_step5.json").write_text(json.dumps(trace))
    with gzip.open(run / "profile" / "drafter_rank1_step5.json.gz", "wt") as f:
        json.dump(trace, f)
    (run / "profile" / "target_rank2_step5.json").write_text('{"traceEvents": [')
    assert report.main([str(run), "--trace-skip", "2"]) == 0
    out, err = capsys.readouterr()
    assert ("target trace rank1.jsonl, 3 messages after the first 2: stall_ms median 2.0 max 3.0 (4%), "
            "capture_ms median 40.0 max 50.0 (82%), backpressure_ms median 7.0 max 9.0 (14%)") in out
    for name in ("drafter_rank0_step5.json", "drafter_rank1_step5.json.gz"):
        assert f"{name}: 1.0 ms (gpu clock), kernels busy 0.8 ms" in out
    assert out.count("| group0 forward | 0.0 | 0.5 | 0.3 | 0.2 |") == 2
    assert out.count("| clip and optimizer | 0.5 | 0.5 | 0.5 | 0.0 |") == 2
    assert "unreadable traces in profile/ (not JSON): target_rank2_step5.json" in err
    assert (run / "report" / "phases.png").stat().st_size > 1000
    res = report.write_report(str(run), str(tmp_path / "r2"), trace_skip=0)
    assert res["target_traces"]["rank1.jsonl"]["messages"] == 5
    assert list(res["timelines"]) == ["drafter_rank0_step5.json", "drafter_rank1_step5.json.gz"]
