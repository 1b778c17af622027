"""Target capture: layer id i is HF hidden_states[i+1], later layers do not run, no lm_head."""

import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config, Qwen3NextConfig

from dflash_dist.config import TargetConfig
from dflash_dist.model.drafter import _torch_version
from dflash_dist.targets.hf import build_target_model, load_hf_config
from dflash_dist.roles.target_rank.capture import FeatureCapture


def tiny(kind):
    common = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)
    if kind == "qwen3":
        return Qwen3Config(num_hidden_layers=8, head_dim=8, **common)
    if kind == "llama":
        return LlamaConfig(num_hidden_layers=8, **common)
    return Qwen3NextConfig(num_hidden_layers=8, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
                           linear_key_head_dim=8, linear_value_head_dim=8, mlp_only_layers=list(range(8)),
                           num_experts=2, num_experts_per_tok=1, moe_intermediate_size=16,
                           shared_expert_intermediate_size=16, **common)


@pytest.mark.parametrize("kind", ["qwen3", "llama", "qwen3_next"])
def test_capture_equals_hf_hidden_states(kind):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny(kind)).eval()
    ids = torch.randint(0, 128, (2, 11))
    lengths = torch.tensor([11, 7])
    layer_ids = [1, 2, 4, 5]
    with torch.no_grad():
        ref = model(ids, output_hidden_states=True).hidden_states
    ran = []
    hooks = [layer.register_forward_hook(lambda m, a, o, i=i: ran.append(i))
             for i, layer in enumerate(model.get_decoder().layers)]
    cap = FeatureCapture(model, layer_ids)
    feats = cap(ids, lengths)
    assert feats.shape == (18, len(layer_ids) * 32)
    expect = torch.cat([ref[i + 1] for i in layer_ids], dim=-1)                       # hidden_states[i+1]
    keep = torch.arange(11)[None] < lengths[:, None]
    torch.testing.assert_close(feats, expect[keep], rtol=1e-5, atol=1e-5)
    assert max(ran) == 5, "decoder layers after the last needed one must not run"
    # right padding does not change the real tokens' features (causal): sample 1 alone
    alone = FeatureCapture.__call__(cap, ids[1:2, :7], torch.tensor([7]))
    torch.testing.assert_close(alone, feats[11:], rtol=1e-5, atol=1e-5)
    # rows rounded up to a multiple (target.tuning.pad_multiple): 11 -> 16 tokens, the same features
    rounded = FeatureCapture(model, layer_ids, pad_multiple=8)
    shapes = []
    hook = model.get_decoder().layers[0].register_forward_hook(lambda m, a, o: shapes.append(a[0].shape[1]))
    torch.testing.assert_close(rounded(ids, lengths), feats, rtol=1e-5, atol=1e-5)
    assert shapes == [16] and "padded to a multiple of 8" in rounded.describe()
    hook.remove()
    rounded.close()
    for h in hooks:
        h.remove()


def test_last_layer_id_gets_final_norm_like_hf():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny("qwen3")).eval()
    ids = torch.randint(0, 128, (1, 6))
    with torch.no_grad():
        ref = model(ids, output_hidden_states=True).hidden_states
    feats = FeatureCapture(model, [7])(ids, torch.tensor([6]))
    torch.testing.assert_close(feats, ref[8][0], rtol=1e-5, atol=1e-5)


def test_random_init_is_seeded_and_frozen():
    cfg = TargetConfig(hf_config={"builtin": "tiny"}, name_or_path=None)
    hf = load_hf_config(cfg)
    assert hf.num_hidden_layers == 8
    a = build_target_model(TargetConfig(hf_config=dict(tiny("qwen3").to_dict(), model_type="qwen3"), init_seed=3), "cpu")
    b = build_target_model(TargetConfig(hf_config=dict(tiny("qwen3").to_dict(), model_type="qwen3"), init_seed=3), "cpu")
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert not any(p.requires_grad for p in a.parameters()) and not a.training


# ---------------------------------------------------------------------------------------- packed capture

def _batch(lengths, vocab=128, seed=1):
    """Right-padded ids [b, S] and the same samples concatenated [1, T]."""
    g = torch.Generator().manual_seed(seed)
    samples = [torch.randint(0, vocab, (n,), generator=g) for n in lengths]
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    for i, s in enumerate(samples):
        ids[i, :len(s)] = s
    return ids, torch.tensor(lengths), torch.cat(samples)[None]


def _capture(model, layer_ids, ids, lengths, **kw):
    cap = FeatureCapture(model, layer_ids, **kw)
    try:
        return cap(ids, lengths)
    finally:
        cap.close()


@pytest.fixture(scope="module")
def qwen3():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny("qwen3"), attn_implementation="sdpa").eval()


def test_packed_capture_equals_padded(qwen3, monkeypatch):
    """One packed row [1, T] with per-sample positions and document-causal flex attention gives the padded path's
    features; every attention layer that ran went through the flex function with a BlockMask, HF built no mask,
    flex never ran eagerly, and the model is left as it was built."""
    from torch.nn.attention.flex_attention import BlockMask
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    from dflash_dist.roles.drafter_rank.compile_guard import FLEX_EAGER_WARNING_RE
    from dflash_dist.roles.target_rank.packing import PACKED_ATTN, packed_stats
    ids, lengths, packed = _batch([11, 5, 8])
    layer_ids = [3, 7]  # a middle layer and the last one (final norm)
    ref = _capture(qwen3, layer_ids, ids, lengths)

    cap = FeatureCapture(qwen3, layer_ids, packing=True)  # registers PACKED_ATTN
    masks = []
    flex_fn = AttentionInterface._global_mapping[PACKED_ATTN]

    def spy(module, q, k, v, mask, **kw):
        masks.append((mask, q.shape[2]))
        return flex_fn(module, q, k, v, mask, **kw)
    monkeypatch.setitem(AttentionInterface._global_mapping, PACKED_ATTN, spy)
    for name in list(ALL_MASK_ATTENTION_FUNCTIONS._global_mapping):  # HF's mask builders (sdpa, eager, flex, ...)
        monkeypatch.setitem(ALL_MASK_ATTENTION_FUNCTIONS._global_mapping, name,
                            lambda *a, name=name, **k: pytest.fail(f"HF built a {name} mask"))
    before = dict(packed_stats)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=FLEX_EAGER_WARNING_RE)
        feats = cap(packed, lengths)
    cap.close()
    torch.testing.assert_close(feats, ref, rtol=1e-5, atol=1e-5)
    assert feats.shape == (24, 2 * 32)
    assert packed_stats["flex_calls"] - before["flex_calls"] == 8 == len(masks)  # every layer up to id 7
    assert packed_stats["block_masks"] - before["block_masks"] == 1               # one mask per forward
    assert all(isinstance(m, BlockMask) and m is masks[0][0] for m, _ in masks)
    assert masks[0][0].kv_num_blocks.numel() * 128 <= masks[0][1]  # block-sparse: one entry per 128-row block
    assert qwen3.config._attn_implementation == "sdpa"                 # switched for the capture only
    padded = FeatureCapture(qwen3, [1])
    padded.close()
    assert padded.describe() == "padded (sdpa), compiled layers: no"
    assert cap.describe() == "packed (flex document-causal), compiled layers: no"


@pytest.mark.skipif(_torch_version() < (2, 13),
                    reason="torch < 2.13: inductor's C++ flex template for CPU emits code that does not compile "
                           "(torch 2.11: 'cur_kvSplitSize6' was not declared); CUDA's compiled capture runs in "
                           "bench/target_capture.py (packed_compiled)")
def test_compiled_layers_equal_uncompiled(qwen3):
    """target.compile: the decoder layers that run are compiled (packed: flex traced into the layer graph; padded:
    sdpa) and give the same features, for a second batch too; the layers get their own forward back after."""
    layer_ids = [2, 7]
    batches = [_batch([30, 9, 17], seed=2), _batch([3, 40], seed=3)]
    refs = [_capture(qwen3, layer_ids, ids, lengths) for ids, lengths, _ in batches]
    for packing in (True, False):
        cap = FeatureCapture(qwen3, layer_ids, packing=packing, compile=True)
        try:
            for (ids, lengths, packed), ref in zip(batches, refs):
                torch.testing.assert_close(cap(packed if packing else ids, lengths), ref, rtol=1e-5, atol=1e-5)
        finally:
            cap.close()
        assert cap.describe().endswith("compiled layers: yes")
        assert not any("forward" in layer.__dict__ for layer in qwen3.get_decoder().layers)


def test_packing_resolution_and_hybrid_refused():
    from dflash_dist.config import ConfigError
    from dflash_dist.roles.target_rank.capture import check_packing_config, resolve_packing
    dense = AutoModelForCausalLM.from_config(tiny("qwen3")).eval()
    hybrid = AutoModelForCausalLM.from_config(tiny("qwen3_next")).eval()
    cfg = lambda packing, hf=tiny("qwen3"): TargetConfig(hf_config=dict(hf.to_dict(), model_type=hf.model_type),
                                                          packing=packing)
    assert resolve_packing(cfg("auto"), dense, "cuda") is True
    assert resolve_packing(cfg("auto"), dense, "cpu") is False
    assert resolve_packing(cfg("off"), dense, "cuda") is False
    assert resolve_packing(cfg("on"), dense, "cpu") is True
    assert resolve_packing(cfg("auto"), hybrid, "cuda") is False
    with pytest.raises(ConfigError, match=r"target.packing=on: decoder layer 0 .*GatedDeltaNet"):
        resolve_packing(cfg("on"), hybrid, "cuda")
    with pytest.raises(ConfigError, match="linear attention"):
        FeatureCapture(hybrid, [1], packing=True)
    with pytest.raises(ConfigError, match=r"target.packing=on: decoder layer 0 is linear_attention"):
        check_packing_config(cfg("on"), tiny("qwen3_next"))         # from the config, before weights load
    check_packing_config(cfg("auto"), tiny("qwen3_next"))
    with pytest.raises(ConfigError, match="target.packing"):
        TargetConfig(hf_config={"builtin": "tiny"}, packing="yes")


def test_compile_resolution():
    from dflash_dist.roles.target_rank.capture import resolve_compile
    dense = AutoModelForCausalLM.from_config(tiny("qwen3")).eval()
    hybrid = AutoModelForCausalLM.from_config(tiny("qwen3_next")).eval()
    cfg = lambda compile: TargetConfig(hf_config={"builtin": "tiny"}, compile=compile)  # noqa: E731
    assert resolve_compile(cfg(None), dense, "cuda") is True        # the measured default on GPUs
    assert resolve_compile(cfg(None), dense, "cpu") is False
    assert resolve_compile(cfg(None), hybrid, "cuda") is False      # fla/causal-conv1d not bound: padded, eager
    assert resolve_compile(cfg(True), hybrid, "cpu") is True
    assert resolve_compile(cfg(False), dense, "cuda") is False


def test_pad_multiple_resolution_and_the_built_capture():
    from dflash_dist.config import ConfigError
    from dflash_dist.roles.target_rank.capture import build_capture, resolve_pad_multiple
    dense = AutoModelForCausalLM.from_config(tiny("qwen3")).eval()
    hybrid = AutoModelForCausalLM.from_config(tiny("qwen3_next")).eval()
    cfg = lambda pad, **kw: TargetConfig(hf_config={"builtin": "tiny"}, tuning={"pad_multiple": pad}, **kw)  # noqa: E731
    assert resolve_pad_multiple(cfg(None), hybrid, "cuda", packed=False) == 64   # cuDNN plans per shape
    assert resolve_pad_multiple(cfg(None), dense, "cuda", packed=False) == 64
    assert resolve_pad_multiple(cfg(None), hybrid, "cpu", packed=False) == 1
    assert resolve_pad_multiple(cfg(32), dense, "cpu", packed=False) == 32
    assert resolve_pad_multiple(cfg(32), dense, "cuda", packed=True) == 1       # packed rows round on their own
    cap = build_capture(cfg(16, packing="off", compile=False), hybrid, [1, 2], "cpu")
    assert (cap.packing, cap.compile, cap.pad_multiple) == (False, False, 16)
    cap.close()
    for bad in (0, -64, 2.5, "64", True):
        with pytest.raises(ConfigError, match="target.tuning.pad_multiple"):
            cfg(bad)
