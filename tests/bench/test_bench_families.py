"""The MoE / Llama-3.1 bench modes run at toy sizes on CPU (--tiny) and record what the GPU run must report: the
experts implementation bound, the capture path (packed with sliding windows and sinks for gpt-oss), the drafter's
RoPE."""

import json
import os
import subprocess
import sys

import pytest
from helpers.launch_util import REPO

ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", WANDB_MODE="disabled",
           TOKENIZERS_PARALLELISM="false", PYTHONPATH=REPO)


def _run(tmp_path, script, *args):
    out = tmp_path / "out.json"
    r = subprocess.run([sys.executable, os.path.join(REPO, "bench", script), *map(str, args), "--out", out],
                       cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    return json.load(open(out))


@pytest.mark.parametrize("shape,path", [("qwen3_30b_a3b", "packed (flex document-causal)"),
                                        ("gpt_oss_20b", "sliding window 16, attention sinks")])
def test_moe_shape_capture(tmp_path, shape, path):
    r = _run(tmp_path, "target_capture.py", "--tiny", "--shape", shape, "--mixes", 64, "--budgets", 256,
             "--repeats", 1, "--warmup", 0, "--variants", "padded,packed", "--no-full")
    assert r["experts_implementation"] == "grouped_mm" and "MoE experts: grouped_mm" in r["fast_path_summary"]
    rows = {x["variant"]: x for x in r["rows"]}
    assert all("error" not in x and x["capture_tokens_per_s"] > 0 and x["capture_tflops"] > 0 for x in rows.values())
    assert path in rows["packed"]["capture_path"]


def test_llama31_drafter_step(tmp_path):
    r = _run(tmp_path, "drafter_step.py", "--tiny", "--shape", "llama31_8b", "--configs", "40x8", "--repeats", 1,
             "--backends", "sdpa", "--peak-n", 128)
    assert r["shape"] == "llama31_8b" and r["rope"].startswith("llama3 (theta 500000")
    assert r["rows"] and all("error" not in x for x in r["rows"])
