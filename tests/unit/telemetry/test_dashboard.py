"""The throughput dashboard: wandb sections read back from an offline run's .wandb file, and dflash-report's PNGs."""

from __future__ import annotations

import glob
import json
import os
import struct

import pytest

from dflash_dist.config import WandbConfig
from dflash_dist.telemetry.metrics import MetricsWriter, capacity_metrics, dashboard_key, position_values


def test_dashboard_keys_fall_into_sections():
    assert dashboard_key("train", "samples_per_s") == "throughput/samples_per_s"
    assert dashboard_key("train", "link_gb_per_s") == "throughput/link_gb_per_s"
    assert dashboard_key("train", "target3_tokens_per_s") == "target/rank3_tokens_per_s"
    assert dashboard_key("train", "target3_mfu") == "target/rank3_mfu"
    assert dashboard_key("train", "drafter_stream_wait_frac") == "drafter/stream_wait_frac"
    assert dashboard_key("train", "drafter_step_time_s") == "drafter/step_time_s"
    assert dashboard_key("train", "loss") == "train/loss" and dashboard_key("train", "grad_norm") == "train/grad_norm"
    assert dashboard_key("train", "acc_slot_7") is None
    assert dashboard_key("train", "tau_from_acc") == "acceptance/tau_from_train_acc"
    assert dashboard_key("eval", "tau_pooled") == "acceptance/tau_pooled"
    # the pooled acceptance length is the headline: the first chart of the acceptance section (sorted by name)
    acceptance = sorted(dashboard_key("eval", k) for k in ("tau", "tau_pooled", "acceptance_length", "tau_stderr",
                                                           "tau_all_prompts", "prompts_one_step"))
    assert acceptance[0] == "acceptance/acceptance_length" < "acceptance/per_position"
    assert dashboard_key("eval", "eval_seconds") == "eval/eval_seconds"
    assert dashboard_key("eval", "accept_pos_3") is None
    assert dashboard_key("train", "compile/recompiles") == "compile/recompiles"
    assert dashboard_key("accounting", "samples_trained") == "accounting/samples_trained"
    assert position_values("eval", {"accept_pos_2": 0.5, "accept_pos_1": 0.9, "tau": 3}) == [(1, 0.9), (2, 0.5)]
    # training accuracy per slot: of the proposals a variant serves where it logs them, else the head's argmax
    train = {"acc_slot_1": 0.3, "acc_slot_2": 0.1}
    assert position_values("train", train) == [(1, 0.3), (2, 0.1)]
    served = {**train, "served_acc_slot_1": 0.4, "served_acc_slot_2": 0.2}
    assert position_values("train", served) == [(1, 0.4), (2, 0.2)]
    assert dashboard_key("train", "served_acc_slot_2") is None
    assert dashboard_key("train", "served_acc") == "train/served_acc"
    cap = capacity_metrics({"samples_per_s": 10.0, "drafter_busy_frac": 0.5, "target2_samples_per_s": 10.0,
                            "target2_busy_frac": 0.25, "target3_samples_per_s": 0.0, "target3_busy_frac": 0.0})
    assert cap == {"target_capacity_samples_per_s": 40.0, "drafter_capacity_samples_per_s": 20.0}


# ----------------------------------------------------------------------------------------------- .wandb reader

def read_wandb_records(path: str):
    """The records of a .wandb transaction log, parsed with wandb's own protobuf (``wandb.proto``).

    The file: a 7-byte header (":W&B", magic 0xBEE1, version 0), then 32 KiB blocks of chunks, each with a 7-byte
    header (crc32, length, type: 1 full, 2 first, 3 middle, 4 last); a block tail under 7 bytes is zero padding."""
    from wandb.proto import wandb_internal_pb2 as pb

    with open(path, "rb") as f:
        data = f.read()
    ident, magic, version = struct.unpack("<4sHB", data[:7])
    assert ident == b":W&B" and magic == 0xBEE1 and version == 0
    block, pos, buf, out = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pos += 7
        if kind == 0 and length == 0:
            pos += left - 7
            continue
        chunk, pos = data[pos:pos + length], pos + length
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            out.append(rec)
            buf = b""
    return out


def _history_keys(records) -> set:
    keys = set()
    for r in records:
        if r.WhichOneof("record_type") == "history":
            for item in r.history.item:
                keys.add("/".join(item.nested_key) if item.nested_key else item.key)
    return keys


def _train_window(step: int) -> dict:
    w = {"loss": 3.0 - step / 100, "lr": 1e-3, "grad_norm": 1.5, "acc": 0.4, "tau_from_acc": 2.1,
         "samples_per_s": 10.0 + step, "tokens_per_s": 500.0, "link_gb_per_s": 0.2, "epoch_progress": step / 100,
         "drafter_samples_per_s": 5.0, "drafter_busy_frac": 0.8, "drafter_wait_frac": 0.2,
         "drafter_stream_wait_frac": 0.1, "drafter_mfu": 0.3, "target2_busy_frac": 0.9, "target2_wait_frac": 0.1,
         "target2_tokens_per_s": 900.0, "target2_samples_per_s": 18.0, "target2_mfu": 0.4}
    w.update({f"acc_slot_{k}": 0.8 ** k for k in range(1, 16)})
    return w


def test_offline_wandb_history_holds_the_sectioned_keys(tmp_path, monkeypatch):
    import wandb  # noqa: F401  (a dependency: never skipped)
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = str(tmp_path / "run")
    w = MetricsWriter(run_dir, {"x": 1}, WandbConfig(mode="offline", project="t"), total_steps=30, enabled=True,
                      progress_bar=False)
    for step in (1, 10, 20, 30):
        w.log(step, _train_window(step))
    w.log(30, {"acceptance_length": 2.5, "tau": 3.2, "tau_pooled": 2.5, "tau_stderr": 0.1, "n_prompts": 64, "max_new_tokens": 128,
               "prompts_one_step": 3, "eval_seconds": 4.0, **{f"accept_pos_{k}": 0.7 ** k for k in range(1, 16)}},
          kind="eval")
    w.close()
    files = glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb"))
    assert len(files) == 1
    import time
    deadline = time.monotonic() + 300  # the wandb service may still be writing the log after finish() (slow
    while True:                        # under a loaded machine): wait for its exit record, then read it all
        records = read_wandb_records(files[0])
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            break
        assert time.monotonic() < deadline, f"no exit record in {files[0]} after 300 s ({len(records)} records)"
        time.sleep(0.5)
    keys = _history_keys(records)
    for k in ("throughput/samples_per_s", "throughput/tokens_per_s", "throughput/link_gb_per_s",
              "throughput/target_capacity_samples_per_s", "throughput/drafter_capacity_samples_per_s",
              "target/rank2_tokens_per_s", "target/rank2_busy_frac", "target/rank2_wait_frac", "target/rank2_mfu",
              "drafter/busy_frac", "drafter/stream_wait_frac", "drafter/mfu", "drafter/step_time_s",
              "train/loss", "train/lr", "train/grad_norm", "acceptance/acceptance_length", "acceptance/tau", "acceptance/tau_pooled",
              "acceptance/tau_from_train_acc", "acceptance/per_position", "acceptance/train_acc_per_position"):
        assert any(h == k or h.startswith(k + "_table/") for h in keys), (k, sorted(keys))  # plot.line: <k>_table
    assert not any("acc_slot" in k or "accept_pos" in k for k in keys), sorted(keys)
    assert "train/samples_per_s" not in keys
    metrics = {r.metric.name: r.metric for r in records if r.WhichOneof("record_type") == "metric"}
    s = metrics["throughput/samples_per_s"].summary
    assert s.max and s.mean
    # metrics.jsonl keeps every value as before, plus the derived ones
    recs = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert recs[0]["acc_slot_15"] == pytest.approx(0.8 ** 15) and "drafter_step_time_s" in recs[1]


# ----------------------------------------------------------------------------------------------- dflash-report

def test_report_writes_its_pngs_from_a_run_directory(tmp_path, capsys):
    import matplotlib  # noqa: F401  (in the dev extra: never skipped)

    from dflash_dist.cli import report

    run = tmp_path / "run"
    run.mkdir()
    with open(run / "metrics.jsonl", "w") as f:
        for step in (1, 10, 20, 30):
            f.write(json.dumps({"step": step, "kind": "train", "time": 100.0 + step, **_train_window(step)}) + "\n")
        f.write(json.dumps({"step": 30, "kind": "eval", "tau": 3.2, "tau_pooled": 2.5, "tau_from_train_acc": 2.1,
                            **{f"accept_pos_{k}": 0.7 ** k for k in range(1, 16)}}) + "\n")
        f.write('{"step": 31, "kind": "tra')  # a run killed mid-write
    assert report.main([str(run)]) == 0
    names = sorted(os.listdir(run / "report"))
    assert names == ["acceptance_per_position.png", "loss.png", "samples_per_s.png", "supply_demand.png", "tau.png"]
    for n in names:
        with open(run / "report" / n, "rb") as fh:
            assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert "samples/s: peak 40.00, mean 25.25" in out
    assert report.main([str(tmp_path / "nothing")]) == 2
