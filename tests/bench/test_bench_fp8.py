"""bench/target_fp8.py at toy size on CPU: bf16 and FP8 rows of the same model, the per-layer cosines, the
fast-path line naming the kernel, FLOPs of the FP8 rows counted like the bf16 ones."""

import json
import os
import subprocess
import sys

from helpers.launch_util import REPO

ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", WANDB_MODE="disabled",
           TOKENIZERS_PARALLELISM="false", PYTHONPATH=REPO)


def test_target_fp8_bench_tiny(tmp_path):
    out = tmp_path / "fp8.json"
    r = subprocess.run([sys.executable, os.path.join(REPO, "bench", "target_fp8.py"), "--tiny", "--mixes", "64",
                        "--budgets", "256", "--variants", "padded", "--tokens-per-pass", "256", "--repeats", "1",
                        "--warmup", "0", "--cos-samples", "2", "--out", str(out)],
                       cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    d = json.load(open(out))
    rows = {x["precision"]: x for x in d["rows"]}
    assert set(rows) == {"bf16", "fp8"} and all("error" not in x for x in rows.values())
    assert "GEMM: reference: dequantize-then-matmul" in d["fp8_fast_path"] and "quantization" not in d["bf16_fast_path"]
    flops = {k: x["capture_tflops"] * x["capture_s"] for k, x in rows.items()}  # same batches: the same FLOPs
    assert abs(flops["fp8"] - flops["bf16"]) <= 1e-9 * flops["bf16"]
    assert len(d["cosine"]) == len(d["layer_ids"]) and all(0.99 < c["mean"] < 1.0 for c in d["cosine"])
    assert all(c["mean"] > 0.9999 for c in d["cosine_bf16_vs_fp32"])  # the CPU's target is fp32 already


def test_fp8_error_sources_tiny(tmp_path):
    """bench/experiments/fp8_error_sources.py at toy size: one cosine per layer for every variant; rounding the
    weights and activations costs more than either part alone or bf16 (the rounding really reaches the linears)."""
    out = tmp_path / "sources.json"
    script = os.path.join(REPO, "bench", "experiments", "fp8_error_sources.py")
    r = subprocess.run([sys.executable, script, "--tiny", "--layers", "3",
                        "--tokens", "64", "--out", str(out)], cwd=REPO, env=ENV, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    rows = json.load(open(out))["cosine_vs_fp32"]
    assert set(rows) == {"fp8", "fp8_attention", "fp8_mlp", "fp8_weights", "fp8_blocks", "bf16"}
    assert all(len(c) == 3 and all(0.9 < x <= 1.0 + 1e-6 for x in c) for c in rows.values())
    for i in range(3):
        assert rows["fp8"][i] < min(rows["fp8_weights"][i], rows["bf16"][i]), rows
        assert rows["fp8"][i] < 0.9999 and rows["bf16"][i] > 0.9999, rows
