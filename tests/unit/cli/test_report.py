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
