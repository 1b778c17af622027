"""Packed capture for the new families: exact against the padded path for sliding-window attention (Mistral),
alternating sliding/full attention with attention sinks (gpt-oss) and MoE (Qwen3-MoE); hybrids refused."""

import os

import pytest
import torch
import yaml

from dflash_dist.config import TargetConfig
from dflash_dist.targets.families import family_for, text_config
from dflash_dist.targets.hf import build_target_model
from dflash_dist.roles.target_rank.capture import FeatureCapture, packing_problem

CONF = os.path.join(os.path.dirname(__file__), "..", "..", "..", "..", "conf", "target")


def _model(name: str, **hf_over):
    with open(os.path.join(CONF, f"{name}.yaml")) as f:
        d = yaml.safe_load(f)
    d.pop("defaults", None)  # a preset: the fields that differ from TargetConfig's defaults
    d["hf_config"].update(hf_over)
    return build_target_model(TargetConfig(**d), "cpu")


def _batch(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    rows = []
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(5, 2000, (n,), generator=g)
        rows.append(ids[i, :n])
    return ids, torch.tensor(lengths), torch.cat(rows)


@pytest.mark.parametrize("name,windows", [("tiny_mistral", (8,)), ("tiny_gpt_oss", (8,)), ("tiny_qwen3_moe", ())])
def test_packed_equals_padded(name, windows):
    over = {"sliding_window": 8} if windows else {}
    model = _model(name, **over).eval()
    assert packing_problem(model) is None
    layers = list(model.get_decoder().layers)
    assert family_for(model.config).sliding_windows(text_config(model.config), layers) == windows
    ids, lengths, packed = _batch([37, 12, 25])  # longer than the window: the window binds
    layer_ids = [1, 4, 7]
    ref_cap = FeatureCapture(model, layer_ids)
    ref = ref_cap(ids, lengths)
    ref_cap.close()
    cap = FeatureCapture(model, layer_ids, packing=True)
    got = cap(packed, lengths)
    cap.close()
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    if windows:
        assert f"sliding window {windows[0]}" in cap.describe()


def test_packed_without_the_window_would_differ():
    """The check above can fail: the same packed row with the full mask on the sliding layers differs."""
    import dflash_dist.roles.target_rank.capture as capture
    model = _model("tiny_mistral", sliding_window=8).eval()
    ids, lengths, packed = _batch([37, 12, 25])
    ref_cap = FeatureCapture(model, [4])
    ref = ref_cap(ids, lengths)
    ref_cap.close()
    cap = FeatureCapture(model, [4], packing=True)
    cap.windows = (1024,)
    real = capture.document_causal_block_mask

    def wrong(lengths, total, device, windows=(), sink_column=False):
        full, pos, _ = real(lengths, total, device, windows, sink_column)
        return full, pos, {8: full}
    capture.document_causal_block_mask = wrong
    try:
        got = cap(packed, lengths)
    finally:
        capture.document_causal_block_mask = real
        cap.close()
    assert not torch.allclose(got, ref, atol=1e-3)


def test_hybrid_families_refuse_packing():
    for name in ("tiny_qwen3_5", "tiny_qwen3_5_moe"):
        assert "linear attention" in packing_problem(_model(name))
