"""dflash-eval writes its JSON beside the checkpoint or export it read, or to --out; never into the current
directory."""

import json
import os

import torch

from dflash_dist.cli.eval import lossless_note, main as eval_main
from dflash_dist.export.write import export_checkpoint
from tests.unit.export.test_export import make_checkpoint


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


def test_generation_length_is_the_runs_and_progress_shows_an_eta(tmp_path, capsys):
    """Without --max-new-tokens dflash-eval generates as many tokens as the run's in-training evaluation
    (train.eval_max_new_tokens, from the checkpoint); it reports prompts done / total, elapsed and ETA as it goes."""
    import torch

    from dflash_dist.checkpoint.store import save_checkpoint
    from dflash_dist.cli.eval import Progress
    from dflash_dist.config import JobConfig, TargetConfig, TrainConfig
    from tests.unit.export import test_export as E
    model = E.make_drafter()
    job = JobConfig(target=TargetConfig(hf_config=dict(E.TARGET_HF), tokenizer=E.TINY_DIR, layer_ids=E.LAYER_IDS),
                    train=TrainConfig(eval_max_new_tokens=3))
    meta = {"cursor": 5, "total_messages": 10, "layer_ids": E.LAYER_IDS, "mask_token_id": E.MASK,
            "block_size": E.BLOCK, "drafter_config": model.config.__dict__, "target_config": E.target_config_dict(),
            "tokenizer": E.TINY_DIR, "job_config": job.to_dict(), "final": False}
    ckpt = save_checkpoint(str(tmp_path / "run"), 7, model.state_dict(), None, meta)
    rows = tmp_path / "p.jsonl"
    rows.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("Hello", "How are you?")))
    out = tmp_path / "o.json"
    torch.manual_seed(0)
    assert eval_main(["--checkpoint", ckpt, "--prompts", str(rows), "--no-lossless-check", "--out", str(out)]) == 0
    res = json.load(open(out))
    assert res["max_new_tokens"] == 3 and all(r["new_tokens"] <= 3 for r in res["per_prompt"])
    err = capsys.readouterr().err
    assert "dflash-eval: prompts 2/2, elapsed" in err and "ETA 0:00:00" in err
    assert eval_main(["--checkpoint", ckpt, "--prompts", str(rows), "--no-lossless-check", "--out", str(out),
                      "--max-new-tokens", "2", "--include-one-step"]) == 0
    res = json.load(open(out))
    assert res["max_new_tokens"] == 2 and res["one_step_excluded"] is False and res["tau"] == res["tau_all_prompts"]

    # the ETA is the mean time per prompt so far times the prompts left; lines at most every every_s seconds
    now, lines = [0.0], []
    p = Progress(every_s=5.0, clock=lambda: now[0], write=lines.append)
    for done, t in ((1, 10.0), (2, 12.0), (3, 20.0), (4, 40.0)):
        now[0] = t
        p(done, 4)
    assert lines == ["dflash-eval: prompts 1/4, elapsed 0:00:10, ETA 0:00:30",
                     "dflash-eval: prompts 3/4, elapsed 0:00:20, ETA 0:00:07",
                     "dflash-eval: prompts 4/4, elapsed 0:00:40, ETA 0:00:00"]


def test_target_quantization_overrides_the_runs(tmp_path):
    """--target-quantization fp8 evaluates a drafter trained on a bf16 target against the FP8 target it will be
    served with (quantized on load); none, the other way round. The result says which target ran."""
    ckpt, _ = make_checkpoint(tmp_path)
    rows = tmp_path / "p.jsonl"
    rows.write_text(json.dumps({"prompt": "Hello"}) + "\n")
    out = tmp_path / "o.json"
    common = ["--checkpoint", ckpt, "--prompts", str(rows), "--max-new-tokens", "4", "--no-lossless-check",
              "--out", str(out)]
    assert eval_main(common + ["--target-quantization", "fp8"]) == 0
    assert json.load(open(out))["quantization"].startswith("quantization: fp8, quantized on load")
    assert eval_main(common + ["--target-quantization", "none"]) == 0
    assert json.load(open(out))["quantization"] is None


def test_a_lossless_check_below_one_below_float32_says_rounding_can_explain_it(tmp_path, capsys):
    assert lossless_note(0.25, torch.bfloat16).startswith("note: with a bfloat16 target a lossless check below 1")
    assert "--target-dtype float32" in lossless_note(0.9, torch.float16)
    assert lossless_note(0.25, torch.float32) is None and lossless_note(1.0, torch.bfloat16) is None
    assert lossless_note(None, torch.bfloat16) is None
    ckpt, _ = make_checkpoint(tmp_path)
    rows = tmp_path / "p.jsonl"
    rows.write_text(json.dumps({"prompt": "Hello"}) + "\n")
    out = tmp_path / "e.json"
    assert eval_main(["--checkpoint", ckpt, "--prompts", str(rows), "--max-new-tokens", "4", "--target-dtype",
                      "bfloat16", "--out", str(out)]) == 0
    e = json.load(open(out))
    assert e["target_dtype"] == "bfloat16"
    assert ("note: with a bfloat16 target" in capsys.readouterr().out) == (e["lossless_fraction"] < 1)
