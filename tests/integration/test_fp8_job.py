"""FP8 targets in a job: a pre-quantized tiny checkpoint trains and evaluates (the fast-path line names the format
and the kernel); on a replica of 2 with the default presets it trains and evaluates like dflash-eval on one rank;
target.fast_path=require on the CPU's dequantize reference is refused before any model loads."""

import json

import pytest
from helpers.fp8_checkpoints import write_fp8_checkpoint
from helpers.launch_util import torchrun

QUICK = ["logging.log_every=2", "logging.progress_bar=false", "logging.wandb.mode=disabled"]


def test_a_prequantized_target_trains_and_evaluates(tmp_path):
    path = write_fp8_checkpoint(str(tmp_path / "fp8"), "compressed")
    run = tmp_path / "run"
    r = torchrun(2, ["-m", "dflash_dist.train", "target=hf", f"target.name_or_path={path}", f"train.output_dir={run}",
                     "train.max_steps=4", "train.eval_prompts=2"] + QUICK, timeout=400)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert ("quantization: fp8, checkpoint (compressed-tensors float8, channel weight scales), 56 FP8 linears, "
            "GEMM: reference: dequantize-then-matmul") in out, out[-4000:]
    rows = [json.loads(x) for x in open(run / "metrics.jsonl")]
    evals = [x for x in rows if "tau" in x]
    assert any("loss" in x for x in rows) and evals and evals[-1]["n_prompts"] == 2 and evals[-1]["acceptance_length"] >= 1.0


def test_an_fp8_replica_trains_and_evaluates_like_dflash_eval_on_one_rank(tmp_path):
    """1 drafter + one replica of 2 of the FP8 tiny target (target.quantization=fp8, default presets: in-training
    evaluation on): exit 0, the quantization line names the rowwise shards, and dflash-eval of the last checkpoint
    with the FP8 target on one process gives the same acceptance lengths prompt by prompt."""
    from dflash_dist.cli.eval import main as eval_main
    run, steps = tmp_path / "rep", 8
    r = torchrun(3, ["-m", "dflash_dist.train", f"train.output_dir={run}", f"train.max_steps={steps}",
                     f"train.eval_every={steps}", f"train.checkpoint_every={steps}", f"data.cache_dir={run / 'cache'}",
                     "topology.target_ranks=2", "target.tensor_parallel=2", "target.quantization=fp8"] + QUICK,
                 timeout=500)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert ("quantization: fp8, quantized on load (per-channel weight scales), 56 FP8 linears (16 rowwise shards "
            "summed over the replica)") in out, out[-4000:]
    (ev,) = [x for x in (json.loads(line) for line in open(run / "metrics.jsonl")) if x.get("kind") == "eval"]
    (holdout,) = [str(p) for p in (run / "cache").glob("holdout-*.jsonl")]
    res = tmp_path / "e.json"
    ck = run / "checkpoints" / f"step_{steps:08d}"
    assert eval_main(["--checkpoint", str(ck), "--prompts", holdout, "--num-prompts", str(ev["n_prompts"]),
                      "--max-new-tokens", str(ev["max_new_tokens"]), "--no-lossless-check", "--out", str(res)]) == 0
    e = json.load(open(res))
    assert e["quantization"].startswith("quantization: fp8, quantized on load"), e["quantization"]
    assert [p["acceptance_lengths"] for p in e["per_prompt"]] == ev["acceptance_lengths"]
    assert e["tau"] == pytest.approx(ev["tau"], abs=1e-12)
    print(f"FP8 replica: in-training tau {ev['tau']:.4f}, dflash-eval on one rank {e['tau']:.4f}")


def test_require_refuses_the_dequantize_reference_before_loading(tmp_path):
    r = torchrun(2, ["-m", "dflash_dist.train", "target.quantization=fp8", "target.fast_path=require",
                     f"train.output_dir={tmp_path / 'run'}", "train.max_steps=2", "train.eval_prompts=0"] + QUICK,
                 timeout=240)
    out = r.stdout + r.stderr
    assert r.returncode != 0
    assert "without an FP8 GEMM (the dequantize-then-matmul reference" in out and "target.fast_path=require" in out
    assert "target loaded" not in out
