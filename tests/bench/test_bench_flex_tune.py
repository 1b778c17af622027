"""bench/flex_tune.py: reading inductor's autotune report into drafter.tuning.flex_kernel_options (the GPU run itself
is a device script, see docs/benchmarks.md)."""

import os
import sys

import pytest
import torch
from helpers.launch_util import REPO as REPO_ROOT

sys.path.insert(0, os.path.join(REPO_ROOT, "bench"))
import flex_tune  # noqa: E402

from dflash_dist.model.drafter import DFlashDrafter  # noqa: E402
from tests.unit.model.test_drafter import cfg as tiny_cfg  # noqa: E402

# the shape of inductor's report (select_algorithm.log_results): fastest row first
REPORT = """AUTOTUNE flex_attention(1x32x8192x128, 1x8x11264x128, ...)
strides: [...]
dtypes: torch.bfloat16, torch.bfloat16
  triton_flex_attention_4 0.2500 ms 100.0% BLOCK_M=128, BLOCK_N=64, PRESCALE_QK=False, num_stages=3, num_warps=8
  triton_flex_attention_1 0.3100 ms 80.6% BLOCK_M=64, BLOCK_N=64, PRESCALE_QK=False, num_stages=2, num_warps=4
SingleProcess AUTOTUNE benchmarking takes 3.1 seconds and 9.0 seconds precompiling for 12 choices
AUTOTUNE flex_attention_backward(1x32x8192x128, ...)
strides: [...]
  triton_flex_attention_backward_7 0.9000 ms 100.0% BLOCK_M1=32, BLOCK_M2=64, BLOCK_N1=64, BLOCK_N2=32, SPARSE_Q_BLOCK_SIZE=128, FLOAT32_PRECISION="'tf32'", num_stages=4, num_warps=4
  triton_flex_attention_backward_2 1.2000 ms 75.0% BLOCK_M1=64, BLOCK_M2=128, BLOCK_N1=128, BLOCK_N2=64, num_stages=3, num_warps=8
"""


def test_autotune_report_gives_prefixed_tiles():
    best = flex_tune.parse_autotune(REPORT)
    assert best["flex_attention"]["choice"] == "triton_flex_attention_4"
    assert best["flex_attention_backward"]["ms"] == 0.9
    opts = flex_tune.kernel_options_from(best)
    assert opts == {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 64, "fwd_num_stages": 3, "fwd_num_warps": 8,
                    "bwd_BLOCK_M1": 32, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N1": 64, "bwd_BLOCK_N2": 32,
                    "bwd_num_stages": 4, "bwd_num_warps": 4}


def test_no_report_no_options():
    assert flex_tune.kernel_options_from(flex_tune.parse_autotune("nothing tuned here\n")) == {}


def test_kernel_options_reach_every_layer():
    model = DFlashDrafter(tiny_cfg(), "flex").configure_compile(kernel_options={"bwd_num_warps": 4})
    assert all(layer.self_attn.flex_kernel_options == {"bwd_num_warps": 4} for layer in model.layers)
    model.configure_compile()
    assert all(layer.self_attn.flex_kernel_options is None for layer in model.layers)


def test_flex_tune_refuses_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)   # the same on a machine with a GPU
    assert flex_tune.main(["--out", os.devnull]) == 2


def test_candidates_from_json_or_a_file(tmp_path):
    """--candidates: kernel_options dicts to time against the defaults, inline or from a file; anything else refused."""
    text = '[{"USE_TMA": true}, {"bwd_num_warps": 4}]'
    assert flex_tune.load_candidates(text) == [{"USE_TMA": True}, {"bwd_num_warps": 4}]
    path = tmp_path / "c.json"
    path.write_text(text)
    assert flex_tune.load_candidates(str(path)) == flex_tune.load_candidates(text)
    assert flex_tune.load_candidates(None) == []
    with pytest.raises(SystemExit, match="kernel_options"):
        flex_tune.load_candidates('{"USE_TMA": true}')
