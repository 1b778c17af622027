"""The target rank's bookkeeping: the FLOPs of a capture batch as it runs, and its per-message trace line."""

import json
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from dflash_dist.roles.target_rank.trace import MessageTimes, capture_flops_fn, open_trace, write_message_line
from dflash_dist.telemetry.flops import target_forward_flops


def _tiny_qwen3():
    return Qwen3Config(num_hidden_layers=8, head_dim=8, vocab_size=128, hidden_size=32, intermediate_size=64,
                       num_attention_heads=4, num_key_value_heads=2)


def test_capture_flops_count_the_rows_as_they_run():
    """The target's MFU counts a padded message at its rounded length, a packed one per sample."""
    model = AutoModelForCausalLM.from_config(_tiny_qwen3()).eval()
    job = SimpleNamespace(layer_ids=[1, 3], hf_config=model.config)
    # matmul weights (norm scales are not matmuls)
    run_params = sum(p.numel() for layer in model.get_decoder().layers[:4] for p in layer.parameters() if p.dim() >= 2)
    expect = lambda rows: target_forward_flops(model.config, run_params, 4, rows)  # noqa: E731
    lengths = [100, 37]
    assert capture_flops_fn(model, job)(lengths) == pytest.approx(expect([(2, 100)]))
    assert capture_flops_fn(model, job, pad_multiple=64)(lengths) == pytest.approx(expect([(2, 128)]))
    assert capture_flops_fn(model, job, packed=True)(lengths) == pytest.approx(expect([(1, 100), (1, 37)]))


def test_trace_line_per_message(tmp_path):
    """logging.debug.trace_target: one JSON line per message in <run_dir>/target_trace/rank<r>.jsonl, appended; the
    backpressure and evaluation are the Sender's counters since just before the send."""
    job = SimpleNamespace(run_dir=str(tmp_path), dist=SimpleNamespace(rank=1))
    topo = SimpleNamespace(node_of=lambda r: r // 2)
    msg = SimpleNamespace(index=7, num_samples=3, cu_seqlens=torch.tensor([0, 5, 9, 20]))
    tx = SimpleNamespace(wait_s=0.5, idle_work_s=0.25)
    times = MessageTimes(stall_s=0.001, capture_s=0.02, waited_s=0.4, evaluated_s=0.25, wall_s=1.23456)
    for _ in range(2):  # a resumed job continues the file
        trace = open_trace(job)
        write_message_line(trace, topo, 1, 2, msg, times, tx)
        trace.close()
    lines = (tmp_path / "target_trace" / "rank1.jsonl").read_text().splitlines()
    assert len(lines) == 2 and lines[0] == lines[1]
    assert json.loads(lines[0]) == {"message": 7, "from": 1, "from_node": 0, "to": 2, "to_node": 1, "samples": 3,
                                    "tokens": 20, "t_s": 1.2346, "stall_ms": 1.0, "capture_ms": 20.0,
                                    "backpressure_ms": 100.0, "eval_ms": 0.0}
