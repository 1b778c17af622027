"""The DFlash drafter module: layout, backends (compiled flex forward vs sdpa), reference math, leak sanity."""

import math

import pytest
import torch
import torch.nn.functional as F

from dflash_dist.config import ConfigError
from dflash_dist.model.drafter import (
    DFlashDrafter,
    DrafterModelConfig,
    RMSNorm,
    apply_rotary,
    default_flex_kernel_options,
    rotary_cos_sin,
)
from dflash_dist.model.masks import dense_mask, flex_block_mask

H, HEADS, KV, D, INTER, LAYERS, NF, BS = 32, 4, 2, 8, 48, 2, 3, 4
CTX, NB = 16, 5
Q = NB * BS


def cfg():
    return DrafterModelConfig(hidden_size=H, num_attention_heads=HEADS, num_key_value_heads=KV, head_dim=D,
                              intermediate_size=INTER, num_layers=LAYERS, num_feature_layers=NF, rms_norm_eps=1e-6,
                              rope_theta=10000.0, block_size=BS, vocab_size=50, max_position_embeddings=256)


def make_model(backend, seed=0):
    torch.manual_seed(seed)
    m = DFlashDrafter(cfg(), backend)
    with torch.no_grad():  # non-trivial norm weights so a skipped/misplaced norm is visible
        for mod in m.modules():
            if isinstance(mod, RMSNorm):
                mod.weight.uniform_(0.5, 1.5)
    return m


def inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    anchors = torch.tensor([[0, 1, 2, 7, 11],        # anchor 0 (sees no context), overlapping, adjacent-ish
                            [3, 9, 13, 0, 0],        # two padding blocks
                            [0, 0, 0, 0, 0]])        # all padding
    valid = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [0, 0, 0, 0, 0]], dtype=torch.bool)
    b = anchors.shape[0]
    pos = (anchors[:, :, None] + torch.arange(BS)).reshape(b, Q)
    return dict(
        block_embeds=torch.randn(b, Q, H, generator=g),
        features=torch.randn(b, CTX, NF * H, generator=g),
        ctx_positions=torch.arange(CTX).expand(b, CTX),
        block_positions=pos,
    ), anchors, valid


def expected_names():
    names = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(LAYERS):
        p = f"layers.{i}."
        names |= {p + f"self_attn.{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")}
        names |= {p + f"mlp.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")}
        names |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
    return names


def test_parameter_names_and_shapes_match_zlab_layout():
    m = DFlashDrafter(cfg(), "sdpa")
    sd = m.state_dict()
    assert set(sd) == expected_names() == {n for n, _ in m.named_parameters()}
    assert sd["fc.weight"].shape == (H, NF * H)
    assert sd["layers.0.self_attn.q_proj.weight"].shape == (HEADS * D, H)
    assert sd["layers.0.self_attn.k_proj.weight"].shape == (KV * D, H)
    assert sd["layers.0.self_attn.v_proj.weight"].shape == (KV * D, H)
    assert sd["layers.0.self_attn.o_proj.weight"].shape == (H, HEADS * D)
    assert sd["layers.0.self_attn.q_norm.weight"].shape == sd["layers.0.self_attn.k_norm.weight"].shape == (D,)
    assert sd["layers.1.mlp.gate_proj.weight"].shape == (INTER, H)
    assert sd["layers.1.mlp.down_proj.weight"].shape == (H, INTER)
    assert not any(isinstance(mod, (torch.nn.Embedding,)) for mod in m.modules())
    assert all(mod.bias is None for mod in m.modules() if isinstance(mod, torch.nn.Linear))
    # HF init: N(0, 0.02) linears, norms at 1
    assert abs(float(sd["fc.weight"].std()) - 0.02) < 0.003
    assert all(bool((v == 1).all()) for k, v in sd.items() if "norm" in k)


def test_rope_and_rmsnorm_match_transformers_qwen3():
    from transformers import Qwen3Config
    from transformers.models.qwen3 import modeling_qwen3 as q3

    hf = Qwen3Config(hidden_size=H, num_attention_heads=HEADS, num_key_value_heads=KV, head_dim=D,
                     rope_theta=10000.0, max_position_embeddings=256)
    rot = q3.Qwen3RotaryEmbedding(hf)
    x = torch.randn(2, HEADS, 7, D)
    pos = torch.tensor([[0, 3, 4, 5, 100, 101, 7], [1, 2, 3, 4, 5, 6, 200]])
    cos_hf, sin_hf = rot(x, pos)
    m = DFlashDrafter(cfg(), "sdpa")
    cos, sin = rotary_cos_sin(pos, m.inv_freq(x.device), x.dtype)
    torch.testing.assert_close(cos, cos_hf)
    torch.testing.assert_close(sin, sin_hf)
    ref, _ = q3.apply_rotary_pos_emb(x, x, cos_hf, sin_hf)
    torch.testing.assert_close(apply_rotary(x, cos, sin), ref)
    n_hf, n = q3.Qwen3RMSNorm(H, eps=1e-6), RMSNorm(H, 1e-6)
    with torch.no_grad():
        n_hf.weight.uniform_(0.5, 1.5)
        n.weight.copy_(n_hf.weight)
    y = torch.randn(3, H).to(torch.bfloat16)
    torch.testing.assert_close(n.to(torch.bfloat16)(y), n_hf.to(torch.bfloat16)(y))


def reference_forward(m, block_embeds, features, ctx_positions, block_positions, mask):
    """Per-sample, per-head restatement of the architecture from the module's weights (no module code)."""
    p = dict(m.named_parameters())
    eps, theta = 1e-6, 10000.0

    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def rope(x, pos):  # x [L, D]: pair i with i + D/2
        half = D // 2
        ang = pos[:, None].float() * theta ** (-torch.arange(half).float() * 2 / D)
        x1, x2 = x[:, :half], x[:, half:]
        return torch.cat([x1 * ang.cos() - x2 * ang.sin(), x2 * ang.cos() + x1 * ang.sin()], -1)

    ctx = rms(features @ p["fc.weight"].t(), p["hidden_norm.weight"])
    h = block_embeds.clone()
    for li in range(LAYERS):
        w = {k[len(f"layers.{li}."):]: v for k, v in p.items() if k.startswith(f"layers.{li}.")}
        x = rms(h, w["input_layernorm.weight"])
        att = torch.zeros_like(h)
        for s in range(h.shape[0]):
            kv_in = torch.cat([ctx[s], x[s]])                    # context NOT input-normed
            kpos = torch.cat([ctx_positions[s], block_positions[s]])
            heads = []
            for hd in range(HEADS):
                g = hd // (HEADS // KV)
                qh = rope(rms(x[s] @ w["self_attn.q_proj.weight"][hd * D:(hd + 1) * D].t(),
                              w["self_attn.q_norm.weight"]), block_positions[s])
                kh = rope(rms(kv_in @ w["self_attn.k_proj.weight"][g * D:(g + 1) * D].t(),
                              w["self_attn.k_norm.weight"]), kpos)
                vh = kv_in @ w["self_attn.v_proj.weight"][g * D:(g + 1) * D].t()
                sc = (qh @ kh.t()) / math.sqrt(D)
                pr = sc.masked_fill(~mask[s], float("-inf")).softmax(-1).nan_to_num(0.0)
                heads.append(pr @ vh)
            att[s] = torch.cat(heads, -1) @ w["self_attn.o_proj.weight"].t()
        h = h + att
        y = rms(h, w["post_attention_layernorm.weight"])
        h = h + (F.silu(y @ w["mlp.gate_proj.weight"].t()) * (y @ w["mlp.up_proj.weight"].t())) \
            @ w["mlp.down_proj.weight"].t()
    return rms(h, p["norm.weight"])


def test_sdpa_matches_reference_and_shape():
    m = make_model("sdpa")
    x, anchors, valid = inputs()
    mask = dense_mask(anchors, valid, CTX, BS)
    with torch.no_grad():
        out = m(**x, mask=mask)
        ref = reference_forward(m, **x, mask=mask)
    assert out.shape == (3, Q, H)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    assert m.attention_calls == {"flex_compiled": 0, "sdpa": LAYERS, "flex_dynamic": 0, "compiled_layers": 0}


def test_flex_compiled_forward_matches_sdpa():
    sdpa, flex = make_model("sdpa"), DFlashDrafter(cfg(), "flex")
    flex.load_state_dict(sdpa.state_dict())
    x, anchors, valid = inputs(1)
    with torch.no_grad():
        out_s = sdpa(**x, mask=dense_mask(anchors, valid, CTX, BS))
        out_f = flex(**x, mask=flex_block_mask(anchors, valid, CTX, BS))
    torch.testing.assert_close(out_f, out_s, atol=1e-5, rtol=1e-5)
    assert flex.attention_calls == {"flex_compiled": LAYERS, "sdpa": 0, "flex_dynamic": 0, "compiled_layers": 0}
    assert sdpa.attention_calls == {"flex_compiled": 0, "sdpa": LAYERS, "flex_dynamic": 0, "compiled_layers": 0}


def test_compiled_layers_forward_matches_sdpa_and_is_reported():
    """drafter.tuning.compile_layers: each layer through torch.compile(fullgraph) with the flex call traced inside."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    sdpa = make_model("sdpa")
    flex = DFlashDrafter(cfg(), "flex").configure_compile(compile_layers=True)
    flex.load_state_dict(sdpa.state_dict())
    x, anchors, valid = inputs(1)
    graphs0 = counters["stats"]["unique_graphs"]
    with torch.no_grad():
        out_s = sdpa(**x, mask=dense_mask(anchors, valid, CTX, BS))
        out_f = flex(**x, mask=flex_block_mask(anchors, valid, CTX, BS))
    torch.testing.assert_close(out_f, out_s, atol=1e-5, rtol=1e-5)
    assert flex.attention_calls["compiled_layers"] == LAYERS and flex.attention_calls["flex_compiled"] == LAYERS
    # the layers share one compiled graph: every layer after the first reuses it
    assert 1 <= counters["stats"]["unique_graphs"] - graphs0 <= 2
    with pytest.raises(AssertionError, match="need the flex backend"):  # refused before, by config.drafter_backend
        make_model("sdpa").configure_compile(compile_layers=True)


def test_bf16_features_reach_fc_uncopied_under_autocast():
    """Under autocast to the features' dtype, fc takes the features as they are (no cast up to the fp32 weights
    and back: the same bits, one [S, 5H] copy fewer each way); the output equals the old path's bit for bit."""
    m = make_model("sdpa")
    x, anchors, valid = inputs()
    feats = x["features"].bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert m._fc_input(feats) is feats
        got = m(**dict(x, features=feats), mask=dense_mask(anchors, valid, CTX, BS))
        m._fc_input = lambda f: f.to(m.fc.weight.dtype)  # the old path: up to fp32, autocast casts back
        want = m(**dict(x, features=feats), mask=dense_mask(anchors, valid, CTX, BS))
    assert torch.equal(got, want)
    del m._fc_input
    assert m._fc_input(feats).dtype == torch.float32  # no autocast: the weights' dtype


def test_sdpa_backward_finite_and_padding_rows_zero():
    m = make_model("sdpa")
    x, anchors, valid = inputs(2)
    x["block_embeds"].requires_grad_(True)
    x["features"].requires_grad_(True)
    seen = []
    hook = m.layers[0].self_attn.o_proj.register_forward_hook(lambda mod, inp, out: seen.append(inp[0]))
    out = m(**x, mask=dense_mask(anchors, valid, CTX, BS))
    hook.remove()
    (out.square().mean()).backward()
    pad_rows = (~valid).repeat_interleave(BS, dim=1)                  # [b, Q]
    assert (seen[0][pad_rows] == 0).all() and (seen[0][~pad_rows] != 0).any()
    for name, prm in m.named_parameters():
        assert prm.grad is not None and torch.isfinite(prm.grad).all(), name
    assert torch.isfinite(x["block_embeds"].grad).all() and torch.isfinite(x["features"].grad).all()
    # anchor-0 block and padding: no context -> no gradient into any feature from those rows; features past the
    # largest visible position (>= max anchor) get exactly zero gradient
    assert (x["features"].grad[0, 11:] == 0).all() and (x["features"].grad[2] == 0).all()


def test_wrong_mask_type_raises():
    x, anchors, valid = inputs()
    with pytest.raises(TypeError):
        DFlashDrafter(cfg(), "sdpa")(**x, mask=flex_block_mask(anchors, valid, CTX, BS, compile=False))
    with pytest.raises(TypeError):
        DFlashDrafter(cfg(), "flex")(**x, mask=dense_mask(anchors, valid, CTX, BS))
    with pytest.raises(ValueError):
        DFlashDrafter(cfg(), "eager")


def test_context_leak_sanity():
    """Block i's output must not depend on features at positions >= its anchor; with the leaky rule it does."""
    m = make_model("sdpa")
    x, anchors, valid = inputs(3)
    blk, a = 3, int(anchors[0, 3])                       # sample 0, block 3, anchor 7
    rows = slice(blk * BS, (blk + 1) * BS)
    x2 = dict(x, features=x["features"].clone())
    x2["features"][0, a:] += 3.0 * torch.randn(CTX - a, NF * H)
    x3 = dict(x, features=x["features"].clone())
    x3["features"][0, a - 1] += 3.0                     # strictly before the anchor: visible
    with torch.no_grad():
        ok = dense_mask(anchors, valid, CTX, BS)
        leak = dense_mask(anchors, valid, CTX, BS, context_inclusive=True)
        base, moved, before = m(**x, mask=ok), m(**x2, mask=ok), m(**x3, mask=ok)
        base_l, moved_l = m(**x, mask=leak), m(**x2, mask=leak)
    torch.testing.assert_close(moved[0, rows], base[0, rows], atol=1e-6, rtol=0)
    assert (moved[0, 4 * BS:] - base[0, 4 * BS:]).abs().max() > 1e-3     # block 4 (anchor 11) does see them
    assert (before[0, rows] - base[0, rows]).abs().max() > 1e-3
    assert (moved_l[0, rows] - base_l[0, rows]).abs().max() > 1e-3      # context_inclusive leaks position a


def test_from_target_qwen3_config():
    from transformers import Qwen3Config

    hf = Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                     intermediate_size=128, rope_theta=500000.0, vocab_size=1000, max_position_embeddings=4096,
                     rms_norm_eps=1e-5)
    c = DrafterModelConfig.from_target(hf, num_layers=3, num_feature_layers=5, block_size=16)
    assert (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (64, 4, 2, 32)
    assert (c.intermediate_size, c.num_layers, c.num_feature_layers, c.block_size) == (128, 3, 5, 16)
    assert (c.rope_theta, c.vocab_size, c.max_position_embeddings, c.rms_norm_eps) == (500000.0, 1000, 4096, 1e-5)
    c2 = DrafterModelConfig.from_target(
        {"hidden_size": 64, "num_attention_heads": 8, "intermediate_size": 96, "vocab_size": 10,
         "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "max_position_embeddings": 64},
        num_layers=1, num_feature_layers=2, block_size=8, intermediate_size=200)
    assert (c2.head_dim, c2.num_key_value_heads, c2.rope_theta, c2.intermediate_size) == (8, 8, 1e6, 200)
    # scaled RoPE is mirrored (model/rope.py), per-layer-type RoPE refused
    c3 = DrafterModelConfig.from_target(
        {"hidden_size": 64, "num_attention_heads": 8, "intermediate_size": 96, "vocab_size": 10,
         "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}, "max_position_embeddings": 64},
        num_layers=1, num_feature_layers=2, block_size=8)
    assert c3.rope_parameters == {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                  "original_max_position_embeddings": 64}
    with pytest.raises(ConfigError, match="layer type"):
        DrafterModelConfig.from_target(
            {"hidden_size": 64, "num_attention_heads": 8, "intermediate_size": 96, "vocab_size": 10,
             "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                 "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
            num_layers=1, num_feature_layers=2, block_size=8)


def test_compiled_layers_run_under_ddp(tmp_path):
    """The trainer wraps the drafter in DDP: compiled layers inside it must compile (dynamo's DDP graph
    splitter is switched off by configure_compile; with it on, compiling these layers fails)."""
    import socket

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        sdpa = make_model("sdpa")
        flex = DFlashDrafter(cfg(), "flex").configure_compile(compile_layers=True)
        flex.load_state_dict(sdpa.state_dict())
        ddp = DDP(flex, bucket_cap_mb=0.001)  # several buckets: what the splitter would cut at
        x, anchors, valid = inputs(1)
        with torch.no_grad():
            out = ddp(**x, mask=flex_block_mask(anchors, valid, CTX, BS))
            ref = sdpa(**x, mask=dense_mask(anchors, valid, CTX, BS))
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        assert flex.attention_calls["compiled_layers"] == LAYERS
    finally:
        dist.destroy_process_group()


def test_mix_order_reduction_off_only_where_inductor_miscompiles_it(monkeypatch):
    """torch < 2.13 generates a wrong workspace slice for the RMSNorm weight gradient (seen on torch 2.11 GPUs)."""
    import torch._inductor.config as ic
    from helpers.compile_settings import compile_settings_restored

    import dflash_dist.model.drafter as drafter_mod
    # configure_compile sets dynamo/inductor config process-wide: config.patch puts it back on exit (never
    # monkeypatch: its undo deletes config keys, tests/helpers/compile_settings.py says why)
    with compile_settings_restored(), ic.patch("triton.mix_order_reduction", True):
        monkeypatch.setattr(drafter_mod, "_torch_version", lambda: (2, 13))
        make_model("flex").configure_compile(compile_layers=True)
        assert ic.triton.mix_order_reduction is True
        monkeypatch.setattr(drafter_mod, "_torch_version", lambda: (2, 11))
        make_model("flex").configure_compile(compile_layers=True)
        assert ic.triton.mix_order_reduction is False


def test_compile_settings_intact_after_the_mix_order_test():
    """The test above changes process-wide inductor and dynamo settings: run it here, then compile. Every setting
    is back as it was and inductor compiles (pytest 9.2's monkeypatch undo deleted triton.mix_order_reduction, and
    every later compile failed: 'triton.mix_order_reduction does not exist')."""
    import torch._dynamo.config as dc
    import torch._inductor.config as ic
    before = (ic.get_config_copy(), dc.get_config_copy())
    with pytest.MonkeyPatch.context() as mp:
        test_mix_order_reduction_off_only_where_inductor_miscompiles_it(mp)
    assert hasattr(ic.triton, "mix_order_reduction")
    after = (ic.get_config_copy(), dc.get_config_copy())
    for b, a in zip(before, after):
        assert {k: a.get(k, "<missing>") for k in b if a.get(k, "<missing>") != b[k]} == {}
    # two reductions of one tensor in different loop orders: inductor's scheduler reads mix_order_reduction
    ns = {}  # a code object of its own: dynamo caches per code object
    exec(compile("def f(x):\n    return x.sum(0), x.sum(1)\n", "<config-intact>", "exec"), ns)
    x = torch.randn(64, 32)
    torch.testing.assert_close(torch.compile(ns["f"])(x), (x.sum(0), x.sum(1)))


def sliding_cfg(window=6, types=("sliding_attention", "full_attention")):
    c = cfg()
    return DrafterModelConfig(**{**c.__dict__, "layer_types": list(types), "sliding_window": window})


def test_sliding_window_layers_use_the_window_mask():
    """A drafter with a sliding layer: sdpa with {kind: mask} == sdpa with one full mask (window derived from the
    positions) == compiled flex with {kind: BlockMask}; it differs from the all-full drafter with the same weights;
    each layer gets its own kind's mask."""
    from dflash_dist.model.masks import layer_masks
    assert LAYERS == 2
    torch.manual_seed(0)
    full = make_model("sdpa")
    swa = DFlashDrafter(sliding_cfg(), "sdpa")
    swa.load_state_dict(full.state_dict())
    flex = DFlashDrafter(sliding_cfg(), "flex")
    flex.load_state_dict(full.state_dict())
    x, anchors, valid = inputs(3)
    per_kind = layer_masks(swa.config.layer_types, lambda w: dense_mask(anchors, valid, CTX, BS, sliding_window=w), 6)
    with torch.no_grad():
        out_dict = swa(**x, mask=per_kind)
        out_one = swa(**x, mask=dense_mask(anchors, valid, CTX, BS))
        out_full = full(**x, mask=dense_mask(anchors, valid, CTX, BS))
        out_flex = flex(**x, mask=layer_masks(flex.config.layer_types,
                                              lambda w: flex_block_mask(anchors, valid, CTX, BS, sliding_window=w), 6))
        # layer kinds swapped: a different function of the same weights
        out_swapped = DFlashDrafter(sliding_cfg(types=("full_attention", "sliding_attention")), "sdpa")
        out_swapped.load_state_dict(full.state_dict())
        out_swapped = out_swapped(**x, mask=dense_mask(anchors, valid, CTX, BS))
    assert torch.equal(out_dict, out_one)
    torch.testing.assert_close(out_flex, out_dict, atol=1e-5, rtol=1e-5)
    assert (out_dict - out_full).abs().max() > 1e-3 and (out_swapped - out_dict).abs().max() > 1e-3
    with pytest.raises(TypeError, match="sliding_attention"):
        flex(**x, mask=flex_block_mask(anchors, valid, CTX, BS))
    with pytest.raises(ValueError, match="sliding_attention"):
        swa(**x, mask={"full_attention": dense_mask(anchors, valid, CTX, BS)})


def test_sliding_window_config_is_validated():
    with pytest.raises(ConfigError, match="sliding_window"):
        sliding_cfg(window=None)
    with pytest.raises(ConfigError, match="layer_types"):
        sliding_cfg(types=("sliding_attention",))
    with pytest.raises(ConfigError, match="no layer is sliding"):
        sliding_cfg(types=("full_attention", "full_attention"))
    from dflash_dist.config import DrafterConfig
    assert DrafterConfig(num_layers=2, sliding_window=32).layer_types == ["sliding_attention"] * 2
    with pytest.raises(ConfigError, match="block_size"):
        DrafterConfig(num_layers=2, block_size=16, sliding_window=8)
    with pytest.raises(ConfigError, match="sliding_window"):
        DrafterConfig(num_layers=2, layer_types=["full_attention", "sliding_attention"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA: flex's backward and the dynamic kernel (passed on an "
                    "H200, torch 2.11, 2026-12-04, masks from the compiled builder; the interval-built masks "
                    "equal them tensor for tensor, test_masks)")
def test_sliding_window_flex_on_cuda_matches_sdpa_forward_and_backward():
    """The training path on a GPU: compiled layers, dynamic-shape flex, {kind: BlockMask} (flex_block_mask's) for a
    drafter with sliding and full layers == the sdpa drafter (dense masks) in outputs and weight gradients."""
    from dflash_dist.model.masks import layer_masks
    dev = torch.device("cuda")
    torch.manual_seed(0)
    # head_dim 16: the CUDA flex kernel needs at least 16 (the CPU tests' drafter has 8)
    mc = DrafterModelConfig(**{**sliding_cfg(window=6).__dict__, "head_dim": 16})
    ref = DFlashDrafter(mc, "sdpa").to(dev)
    with torch.no_grad():
        for mod in ref.modules():
            if isinstance(mod, RMSNorm):
                mod.weight.uniform_(0.5, 1.5)
    flex = DFlashDrafter(mc, "flex").to(dev).configure_compile(flex_dynamic=True,
                                                                                 compile_layers=True)
    flex.load_state_dict(ref.state_dict())
    for seed in (1, 2):  # two calls: the dynamic kernel and the compiled layers reused
        x, anchors, valid = inputs(seed)
        x = {k: v.to(dev) for k, v in x.items()}
        anchors, valid = anchors.to(dev), valid.to(dev)
        outs, grads = [], []
        for m, build in ((ref, lambda w: dense_mask(anchors, valid, CTX, BS, sliding_window=w)),
                         (flex, lambda w: flex_block_mask(anchors, valid, CTX, BS, dynamic=True, sliding_window=w))):
            m.zero_grad()
            out = m(**x, mask=layer_masks(m.config.layer_types, build, 6))
            (out.float() ** 2).sum().backward()
            outs.append(out.detach())
            grads.append({k: p.grad.detach().clone() for k, p in m.named_parameters()})
        torch.testing.assert_close(outs[1], outs[0], atol=2e-4, rtol=2e-4)
        for k in grads[0]:
            torch.testing.assert_close(grads[1][k], grads[0][k], atol=2e-3, rtol=2e-3, msg=k)
    assert flex.attention_calls["compiled_layers"] == 2 * LAYERS and flex.attention_calls["flex_dynamic"] == 2 * LAYERS


def test_default_flex_kernel_options_per_device(monkeypatch):
    """null tile options: the forward through TMA on sm90+ only; {} means inductor's defaults, as does CPU."""
    assert default_flex_kernel_options(torch.device("cpu")) == {}
    for cap, want in (((9, 0), {"fwd_USE_TMA": True}), ((10, 0), {"fwd_USE_TMA": True}), ((8, 0), {})):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, cap=cap: cap)
        assert default_flex_kernel_options(torch.device("cuda", 0)) == want, cap
    model = DFlashDrafter(cfg(), "flex")
    assert model.configure_compile().flex_kernel_options is None                  # CPU: nothing to add
    assert model.configure_compile(kernel_options={}).flex_kernel_options is None
    opts = model.configure_compile(kernel_options={"bwd_num_warps": 4}).flex_kernel_options
    assert opts == {"bwd_num_warps": 4}
    assert all(layer.self_attn.flex_kernel_options == opts for layer in model.layers)



def test_configure_compile_refuses_flash_backend_on_cpu():
    """BACKEND=FLASH (FlashAttention-4's kernels) is refused where the model is configured, not at its first compile
    (the rule itself: tests/unit/config/test_drafter_config.py)."""
    with pytest.raises(ConfigError, match="Hopper or newer"):
        DFlashDrafter(cfg(), "flex").configure_compile(kernel_options={"BACKEND": "FLASH"})
