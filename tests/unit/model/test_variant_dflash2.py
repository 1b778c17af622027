"""model/variants/dflash2: the DFlash2 variant on the seam (build, identity at init, proposals, selector loss,
statistics, FLOPs, export declarations)."""

import os

import pytest
import torch
from test_spec import TARGET

from dflash_dist.config import ConfigError, DrafterConfig, JobConfig, compose_config
from dflash_dist.eval.spec_decode import make_dflash_draft_fn
from dflash_dist.model.variants.dflash2 import layers as D2
from dflash_dist.model.variants.dflash2 import selector as SEL
from dflash_dist.model.drafter import DFlashDrafter
from dflash_dist.model.masks import dense_mask
from dflash_dist.model.spec import resolve_drafter
from dflash_dist.model.variants import DFlash2, variant_class
from dflash_dist.model.variants.dflash2.variant import DFlash2Drafter
from dflash_dist.paths import CONF_DIR

SMALL = {"conv_group_size": 8, "selector_rank": 8, "selector_top_k": 6}


def _spec(variant="dflash2", block_size=4, **dflash2):
    dc = DrafterConfig(num_layers=2, block_size=block_size, variant=variant, dflash2=dict(SMALL, **dflash2))
    return resolve_drafter(dc, TARGET, 3, "cpu")


def _inputs(block_size=4, n_blocks=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    s, q = 6, n_blocks * block_size
    feats, embeds = torch.randn(1, s, 3 * 32, generator=g), torch.randn(1, q, 32, generator=g)
    anchors = torch.tensor([[2, 4][:n_blocks]])
    mask = dense_mask(anchors, torch.ones_like(anchors, dtype=torch.bool), s, block_size)
    blk_pos = (anchors[..., None] + torch.arange(block_size)).reshape(1, -1)
    return embeds, feats, torch.arange(s)[None], blk_pos, mask


def _train_selector(model):
    """Give the selector non-trivial weights (at init its successor codebook is 0: the walk is the unary argmax)."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        sel = model.candidate_selector
        sel.successor_codebook.copy_(torch.randn(sel.successor_codebook.shape, generator=g) * 3)
        sel.predecessor_codebook.copy_(torch.randn(sel.predecessor_codebook.shape, generator=g) * 3)


def test_registered_and_built_from_settings():
    assert variant_class("dflash2") is DFlash2
    spec = _spec()
    model = spec.build_model()
    assert isinstance(model, DFlash2Drafter) and model.loss_term_names == ("selector",)
    assert spec.model.variant_settings["selector_rank"] == 8  # recorded with the shape: a checkpoint rebuilds it
    assert model.candidate_selector.predecessor_codebook.shape == (64, 8)
    assert model.layers[0].attention_conv.kernel_projection.weight.shape == (2 * 2 * (32 // 8), 32)
    assert type(_spec("dflash").build_model()) is DFlashDrafter and _spec("dflash").model.variant_settings is None


def test_presets_build_on_the_tiny_target():
    for overrides in (["drafter=dflash2"], ["drafter=tiny_dflash2"], ["drafter.variant=dflash2"]):
        cfg = JobConfig.from_dict(_container(compose_config(overrides, CONF_DIR)))
        assert cfg.drafter.variant == "dflash2"
        spec = resolve_drafter(cfg.drafter, TARGET, 3, "cpu")
        assert isinstance(spec.build_model(), DFlash2Drafter)
    released = JobConfig.from_dict(_container(compose_config(["drafter=dflash2"], CONF_DIR))).drafter
    assert (released.num_layers, released.block_size, released.sliding_window) == (5, 8, 2048)
    assert (released.dflash2.conv_kernel_size, released.dflash2.conv_group_size, released.dflash2.selector_rank,
            released.dflash2.selector_top_k) == (2, 16, 256, 16)


def _container(c):
    from omegaconf import OmegaConf
    return OmegaConf.to_container(c, resolve=True)


def test_settings_refused_by_name():
    with pytest.raises(ConfigError, match="drafter.dflash2.conv_group_size"):
        _spec(conv_group_size=5)  # does not divide the hidden size 32
    with pytest.raises(ConfigError, match="drafter.dflash2.selector_gold"):
        _spec(selector_gold="insert")
    with pytest.raises(ConfigError, match="drafter.dflash2.selector_top_k"):
        _spec(selector_top_k=100)  # beyond the vocabulary of 64


def test_conv_dtype_compute_runs_the_input_convolution_in_autocast_dtype(monkeypatch):
    """drafter.dflash2.conv_dtype=compute: under bf16 autocast the input-side convolution gets the normed input in
    bf16 (input: fp32, as the norm returns it); the hidden states stay close; without autocast the two are the
    same to the bit. A value outside the choices is refused by name."""
    torch.manual_seed(0)
    models = {mode: _spec(conv_dtype=mode).build_model() for mode in ("input", "compute")}
    with torch.no_grad():  # conv weights away from the identity init, so the convolution does something
        for conv in (m for m in models["input"].modules() if isinstance(m, D2.GroupedDynamicConv)):
            conv.kernel_projection.weight.normal_(0, 0.1)
            conv.base_kernel.normal_(0, 0.5)
    models["compute"].load_state_dict(models["input"].state_dict())
    seen = []
    prepare = D2.GroupedDynamicConv.prepare
    monkeypatch.setattr(D2.GroupedDynamicConv, "prepare",
                        lambda self, x, b: (seen.append(x.dtype), prepare(self, x, b))[1])
    x = _inputs()
    plain = {mode: m(*x) for mode, m in models.items()}
    assert torch.equal(plain["input"], plain["compute"]) and set(seen) == {torch.float32}
    seen.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = {mode: models[mode](*x).float() for mode in ("input", "compute")}
        assert seen == [torch.float32] * 4 + [torch.bfloat16] * 4      # 2 layers x 2 sublayers each
    torch.testing.assert_close(mixed["compute"], mixed["input"], rtol=0.05, atol=0.05)
    assert not torch.equal(mixed["compute"], mixed["input"])
    layers = [m for m in _spec().build_model().modules() if hasattr(m, "conv_in_compute_dtype")]
    assert layers and all(m.conv_in_compute_dtype for m in layers)  # compute is the default (measured faster)
    with pytest.raises(ConfigError, match="drafter.dflash2.conv_dtype"):
        _spec(conv_dtype="fp16")


def test_identity_at_init_unary_logits_equal_dflash():
    """A fresh DFlash2 drafter given a DFlash drafter's weights computes its hidden states, so its unary logits."""
    torch.manual_seed(0)
    plain = _spec("dflash").build_model()
    d2 = _spec().build_model()
    missing, unexpected = d2.load_state_dict(plain.state_dict(), strict=False)
    assert not unexpected and missing and all("_conv." in k or k.startswith("candidate_selector.") for k in missing)
    head = torch.randn(64, 32)
    x = _inputs()
    torch.testing.assert_close(d2(*x) @ head.t(), plain(*x) @ head.t(), rtol=0, atol=1e-6)
    hidden = d2(*x)[:, :4]  # at init the walk is the unary argmax (zero successor codebook)
    torch.testing.assert_close(d2.propose(hidden, head, torch.tensor([5])), plain.propose(hidden, head))


def test_proposals_are_the_selector_walk_and_the_eval_uses_them():
    torch.manual_seed(0)
    model = _spec().build_model()
    _train_selector(model)
    head = torch.randn(64, 32)
    embeds, feats, ctx_pos, blk_pos, mask = _inputs(n_blocks=1)
    hidden = model(embeds, feats, ctx_pos, blk_pos, mask)
    anchor = torch.tensor([9])
    want = SEL.propose(model.candidate_selector, hidden, anchor, head, 6)[0]
    torch.testing.assert_close(model.propose(hidden, head, anchor), want)
    assert not torch.equal(want, (hidden[:, 1:] @ head.t()).argmax(-1))  # the walk, not the unary argmax
    with pytest.raises(ValueError, match="anchor"):
        model.propose(hidden, head)
    # the in-training evaluation's draft step: the walk from the block's anchor
    embed = torch.randn(64, 32)
    block = torch.tensor([[9, 1, 1, 1]])
    draft = make_dflash_draft_fn(model, embed, head)(feats[:, :2], block, 2)
    with torch.no_grad():
        h = model(embed[block], feats[:, :2], torch.arange(2)[None], torch.arange(2, 6)[None],
                  dense_mask(torch.tensor([[2]]), torch.tensor([[True]]), 2, 4))
    torch.testing.assert_close(draft, SEL.propose(model.candidate_selector, h, torch.tensor([9]), head, 6)[0][0])


def test_walk_ties_go_to_the_lowest_index():
    s = torch.zeros(1, 2, 3, 3)
    s[0, 0, :, 1:] = 1.0            # row 0: candidates 1 and 2 tie
    s[0, 1, 1] = torch.tensor([0.0, 2.0, 2.0])
    assert SEL.greedy_walk(s).tolist() == [[1, 1]]


def _group(block_size=4, n_blocks=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    q = n_blocks * block_size
    labels = torch.randint(0, 64, (1, q), generator=g)
    labels[:, ::block_size] = -100
    labels[0, -1] = -100  # a hole: the row after it has no known predecessor
    block_ids = torch.full((1, q), 63)
    block_ids[:, ::block_size] = torch.randint(0, 64, (1, n_blocks), generator=g)
    return labels, block_ids


@pytest.mark.parametrize("gold", ["exclude", "replace_last"])
def test_selector_loss_term_is_the_weighted_kway_ce(gold):
    torch.manual_seed(0)
    model = _spec(selector_gold=gold, selector_loss_weight=0.5).build_model()
    _train_selector(model)
    head = torch.randn(64, 32)
    hidden = torch.randn(1, 12, 32, requires_grad=True)
    labels, block_ids = _group()
    w = torch.rand(9)
    terms = model.loss_terms(hidden, labels, head, block_ids=block_ids, row_weights=w)
    rows_h, pred, rows_gold, _ = SEL.selector_rows(hidden, block_ids, labels, labels, 4)
    cand = SEL.topk_candidates(rows_h.detach(), head, 6)
    parts = SEL.selector_loss(model.candidate_selector, rows_h, head, pred, cand, rows_gold, w, gold)
    torch.testing.assert_close(terms["selector"], 0.5 * parts.loss_sum)
    doubled = model.loss_terms(hidden, labels, head, block_ids=block_ids, row_weights=2 * w)["selector"]
    torch.testing.assert_close(doubled, 2 * terms["selector"])  # weighted by the objective's row weights
    terms["selector"].backward()
    assert model.candidate_selector.successor_codebook.grad.abs().sum() > 0 and hidden.grad.abs().sum() > 0
    assert set(terms) - {"selector"} == set(model.stat_slots())
    assert terms["selector_rows"].tolist() == [3.0, 3.0, 2.0]  # labelled rows per slot 1..3


def test_gold_modes_differ_where_the_gold_is_outside_the_topk():
    torch.manual_seed(0)
    head = torch.randn(64, 32)
    hidden = torch.randn(1, 12, 32)
    labels, block_ids = _group()
    out = {}
    for gold in ("exclude", "replace_last"):
        model = _spec(selector_gold=gold, selector_top_k=2).build_model()
        out[gold] = model.loss_terms(hidden, labels, head, block_ids=block_ids)
    assert out["replace_last"]["selector_weight_sum"] > out["exclude"]["selector_weight_sum"]
    assert out["replace_last"]["selector_gold_in_topk"].sum() == out["exclude"]["selector_gold_in_topk"].sum()


def test_window_metrics_from_summed_statistics():
    torch.manual_seed(0)
    model = _spec().build_model()
    head = torch.randn(64, 32)
    labels, block_ids = _group()
    hidden = torch.randn(1, 12, 32)
    terms = model.loss_terms(hidden, labels, head, block_ids=block_ids)
    sums = {k: [float(x) for x in v.reshape(-1)] for k, v in terms.items() if k != "selector"}
    m = model.window_metrics(sums)
    assert m["selector_ce"] == pytest.approx(sums["selector_ce_sum"][0] / sums["selector_weight_sum"][0])
    assert m["gold_in_topk"] == pytest.approx(sum(sums["selector_gold_in_topk"]) / 8)
    assert {f"acc_unary_slot_{k}" for k in (1, 2, 3)} <= set(m) and {"acc_selected_slot_3", "tau_selector"} <= set(m)
    assert 1.0 <= m["tau_selector"] <= 4.0
    # what it serves is the selector's choice: the training side of the train/serve gap
    assert (m["served_acc"], m["tau_from_served_acc"]) == (m["acc_selected"], m["tau_selector"])
    assert [m[f"served_acc_slot_{k}"] for k in (1, 2, 3)] == [m[f"acc_selected_slot_{k}"] for k in (1, 2, 3)]


def test_extra_flops_count_convs_and_selector():
    v = DFlash2()
    mc = _spec().model
    f = v.extra_flops(mc, 2, 64, 3, 64)
    s = D2.DFlash2Settings(**mc.variant_settings)
    conv, sel = D2.conv_flops_per_row(32, s), D2.selector_flops_per_row(32, s)
    # no top-K pass over the vocabulary: the candidates come from the loss's own logits (head_topk)
    want = 3 * 2 * 24 * (conv["matmul"] + conv["elementwise"]) + 18 * 3 * (sel["matmul"] + sel["gathered"])
    assert f == pytest.approx(want)
    assert v.extra_flops(_spec(selector_rank=16).model, 2, 64, 3, 64) > f
    assert v.extra_flops(_spec(conv_kernel_size=3).model, 2, 64, 3, 64) > f


def test_export_declarations_match_the_module():
    spec = _spec()
    v = DFlash2()
    fields = v.export_fields(spec.model)
    assert fields["architectures"] == ["DFlash2DraftModel"]
    assert {k: fields["dflash_config"][k] for k in SMALL} == SMALL
    model = spec.build_model()
    names = v.export_names({k: t for k, t in model.state_dict().items()})
    config = {"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
              "intermediate_size": 96, "num_hidden_layers": 2, "vocab_size": 64, "block_size": 4,
              "dflash_config": dict(fields["dflash_config"], target_layer_ids=[1, 3, 4])}
    extra = v.extra_tensor_shapes(config)
    assert extra and all(tuple(names[k].shape) == shape for k, shape in extra.items())
    assert "candidate_selector.successor_codebook" in extra and not any(k.endswith("codebook.weight") for k in names)
    assert set(names) - set(extra) == set(_spec("dflash").build_model().state_dict())


def test_conf_presets_exist_in_the_package():
    conf = CONF_DIR
    for name in ("dflash2.yaml", "tiny_dflash2.yaml"):
        assert os.path.isfile(os.path.join(conf, "drafter", name))


def test_dflash2_layers_compile_whole_without_recompiles():
    """drafter.tuning.compile_layers traces each layer fullgraph: the convs add no graph break, and steps of one
    shape compile once (dynamo's guards and recompiles; backend eager: no codegen on CPU, and flex has no CPU
    backward, so the forward only)."""
    from helpers.compile_settings import compile_settings_restored

    from dflash_dist.roles.drafter_rank import compile_guard as cg
    from dflash_dist.model.masks import flex_block_mask
    torch.manual_seed(0)
    model = _spec().build_model("flex")
    with torch.no_grad():  # a non-identity conv, so its taps take part in the traced graph
        for layer in model.layers:
            layer.attention_conv.kernel_projection.weight.normal_(0, 0.1)
    model._layer_fns = [torch.compile(layer, fullgraph=True, backend="eager") for layer in model.layers]
    with compile_settings_restored():
        breaks = cg.graph_break_reasons()
        guard = cg.install_guard(num_shape_buckets=1, warmup_steps=1)
        embeds, feats, ctx_pos, blk_pos, _ = _inputs()
        mask = flex_block_mask(torch.tensor([[2, 4]]), torch.tensor([[True, True]]), 6, 4, compile=False)
        for step in range(3):
            with guard.step((1, 6, 8)), torch.no_grad():
                out = model(embeds + step, feats, ctx_pos, blk_pos, mask)
        assert torch.isfinite(out).all()
        assert cg.report_graph_breaks(breaks) == {}
    torch.compiler.set_stance("default")


def test_checkpoint_weights_are_checked_against_the_recorded_variant(tmp_path):
    from safetensors.torch import save_file

    from dflash_dist.checkpoint.safe_io import CheckpointError, safetensors_header
    from dflash_dist.checkpoint.validate import check_drafter_config, check_weights
    spec = _spec()
    st = str(tmp_path / "model.safetensors")
    save_file(spec.build_model().state_dict(), st)
    header, dc = safetensors_header(st), dict(spec.model.__dict__)
    check_drafter_config(st, "drafter_config", dc)
    check_weights(st, header, dc, "dflash2")
    with pytest.raises(CheckpointError, match="unexpected"):
        check_weights(st, header, dc, "dflash")
    other = dict(dc, variant_settings=dict(dc["variant_settings"], selector_rank=16))
    with pytest.raises(CheckpointError, match="wrong shapes"):
        check_weights(st, header, other, "dflash2")
    huge = dict(dc, variant_settings=dict(dc["variant_settings"], selector_rank=1 << 30))
    with pytest.raises(CheckpointError, match="variant_settings.selector_rank"):
        check_drafter_config(st, "drafter_config", huge)


@pytest.mark.parametrize("loss", [{}, {"weighting": "dpace"}, {"kind": "kl", "kl_top_k": 5, "labels": "target"}],
                         ids=["decay", "dpace", "kl"])
def test_selector_candidates_come_from_the_objectives_pass(loss):
    """Each objective's fused pass (decayed CE, D-PACE, KL) gives each loss row's top-K head ids
    (LossParts.topk_ids, the trainer asks for ``model.head_topk``), the selector's candidates exactly; the loss
    term reads them from the context instead of a second pass over the vocabulary, and without them it makes its
    own."""
    torch.manual_seed(0)
    dc = DrafterConfig(num_layers=2, block_size=4, variant="dflash2", dflash2=dict(SMALL, selector_gold="replace_last"),
                       loss=loss)
    spec = resolve_drafter(dc, TARGET, 3, "cpu")
    model = spec.build_model()
    _train_selector(model)
    objective = spec.make_objective()
    objective.head_topk = model.head_topk
    assert model.head_topk == 6 and DFlashDrafter.head_topk == 0
    head = torch.randn(64, 32)
    hidden = torch.randn(1, 12, 32, requires_grad=True)
    labels, block_ids = _group()
    if loss.get("kind") == "kl":
        soft = (torch.randint(0, 64, (1, 12, 5)), torch.softmax(torch.randn(1, 12, 5), -1))
        parts = objective.loss(hidden, head, labels, soft=soft)
    else:
        parts = objective.loss(hidden, head, labels)
    rows_h = SEL.selector_rows(hidden, block_ids, labels, labels, 4)[0]
    assert torch.equal(parts.topk_ids, SEL.topk_candidates(rows_h.detach(), head, 6))
    calls = []
    real = SEL.topk_candidates
    SEL.topk_candidates = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        model.set_context(head_topk_ids=parts.topk_ids)
        given = model.loss_terms(hidden, labels, head, block_ids=block_ids)["selector"]
        assert calls == []                       # no second pass
        model.set_context()
        own = model.loss_terms(hidden, labels, head, block_ids=block_ids)["selector"]
        assert calls == [1]
    finally:
        SEL.topk_candidates = real
    torch.testing.assert_close(given, own, rtol=0, atol=0)
