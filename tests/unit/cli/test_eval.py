"""dflash-eval writes its JSON beside the checkpoint or export it read, or to --out; never into the current
directory."""

import json
import os

from dflash_dist.checkpoint.export import export_checkpoint
from dflash_dist.cli.eval import main as eval_main
from tests.unit.checkpoint.test_export import make_checkpoint


def test_result_lands_beside_what_was_evaluated_or_at_out(tmp_path, monkeypatch):
    ckpt, _ = make_checkpoint(tmp_path)
    export = export_checkpoint(ckpt, str(tmp_path / "export"), dtype="float32")
    rows = tmp_path / "p.jsonl"
    rows.write_text(json.dumps({"prompt": "Hello"}) + "\n")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    common = ["--prompts", str(rows), "--max-new-tokens", "4", "--no-lossless-check"]
    assert eval_main(["--checkpoint", ckpt + "/", *common]) == 0
    beside = os.path.normpath(ckpt) + ".eval.json"                   # checkpoints/step_00000007.eval.json
    assert json.load(open(beside))["n_prompts"] == 1
    assert eval_main(["--export", export, *common]) == 0
    assert json.load(open(os.path.normpath(export) + ".eval.json"))["source"]
    out = tmp_path / "results" / "mine.json"
    assert eval_main(["--checkpoint", ckpt, *common, "--out", str(out)]) == 0
    assert json.load(open(out))["n_prompts"] == 1
    assert os.listdir(cwd) == []                                      # nothing written where it ran


def test_a_data_source_named_by_a_checkpoint_is_read_only_when_passed(tmp_path, capsys):
    """Held-out prompts come from the run's data.source; a path recorded in the checkpoint is never opened unless
    --data names it (one checkpoint error line, exit 2)."""
    from dflash_dist.data.conversations import builtin_conversations
    ckpt, _ = make_checkpoint(tmp_path)
    rows = tmp_path / "data.jsonl"
    rows.write_text("".join(json.dumps(c) + "\n" for c in builtin_conversations("builtin")[:200]))
    os.mkfifo(tmp_path / "fifo")
    common = ["--max-new-tokens", "2", "--num-prompts", "2", "--no-lossless-check", "--out", str(tmp_path / "o.json")]
    for source in (str(rows), str(tmp_path / "fifo")):
        meta = json.load(open(os.path.join(ckpt, "meta.json")))
        meta["job_config"].setdefault("data", {})["source"] = source
        json.dump(meta, open(os.path.join(ckpt, "meta.json"), "w"))
        capsys.readouterr()
        assert eval_main(["--checkpoint", ckpt, *common]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "checkpoint error:" in err[0] and "data.source" in err[0] and "--data" in err[0]
    assert eval_main(["--checkpoint", ckpt, *common, "--data", str(rows)]) == 0
    assert json.load(open(tmp_path / "o.json"))["n_prompts"] == 2
