"""FP8 targets in a job: a pre-quantized tiny checkpoint trains and evaluates (the fast-path line names the format
and the kernel); target.fast_path=require on the CPU's dequantize reference is refused before any model loads."""

import json

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
    assert any("loss" in x for x in rows) and evals and evals[-1]["n_prompts"] == 2 and evals[-1]["tau"] >= 1.0


def test_require_refuses_the_dequantize_reference_before_loading(tmp_path):
    r = torchrun(2, ["-m", "dflash_dist.train", "target.quantization=fp8", "target.fast_path=require",
                     f"train.output_dir={tmp_path / 'run'}", "train.max_steps=2", "train.eval_prompts=0"] + QUICK,
                 timeout=240)
    out = r.stdout + r.stderr
    assert r.returncode != 0
    assert "without an FP8 GEMM (the dequantize-then-matmul reference" in out and "target.fast_path=require" in out
    assert "target loaded" not in out
