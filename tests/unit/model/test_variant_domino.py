"""model/variants/domino: the Domino variant on the seam (settings, loss mix, decode, FLOPs, export names)."""

import pytest
import torch
import torch.nn.functional as F
from test_spec import TARGET

from dflash_dist.config import ConfigError, DrafterConfig, DrafterDomino, JobConfig
from dflash_dist.eval.spec_decode import make_dflash_draft_fn
from dflash_dist.model.variants.domino import head as D
from dflash_dist.model.blocks import make_batch
from dflash_dist.model.masks import dense_mask
from dflash_dist.model.spec import resolve_drafter
from dflash_dist.model.variants import variant_class
from dflash_dist.model.variants.domino.variant import Domino, DominoDrafter, settings_of

B, V, H = 4, 64, 32


def _spec(**domino):
    dc = DrafterConfig(num_layers=2, block_size=B, variant="domino", domino=DrafterDomino(emb_dim=8,
                       gru_hidden_dim=6, **domino))
    return resolve_drafter(dc, TARGET, 3, "cpu")


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = [13, 9]
    ids = torch.randint(0, V, (sum(lens),), generator=g)
    sup = torch.rand(sum(lens), generator=g) > 0.3
    cu = torch.tensor([0, lens[0], sum(lens)])
    feats = torch.randn(sum(lens), 3 * H, generator=g)
    return make_batch(ids, sup, cu, feats, num_anchors=3, block_size=B, mask_token_id=V - 1, ctx_bucket=16,
                      generator=g), ids, cu


def _hidden(model, batch, embed):
    mask = dense_mask(batch.anchors, batch.valid, batch.ctx_len, B)
    return model(F.embedding(batch.block_ids, embed), batch.features, batch.ctx_positions, batch.block_positions,
                 mask)


def test_the_variant_builds_the_head_from_drafter_domino():
    spec = _spec()
    assert variant_class("domino") is Domino
    assert spec.model.variant_settings["gru_hidden_dim"] == 6
    model = spec.build_model()
    assert isinstance(model, DominoDrafter) and model.loss_term_names == ("domino",)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items() if k.startswith("domino.")}
    want = D.expected_shapes(H, V, settings_of(spec.model))
    assert {k.removeprefix("domino."): v for k, v in shapes.items()} == want
    # a DFlash drafter carries no settings, and the preset's keys reach the config
    assert resolve_drafter(DrafterConfig(num_layers=2, block_size=B), TARGET, 3, "cpu").model.variant_settings is None
    cfg = JobConfig.from_dict({"target": {"hf_config": {"builtin": "tiny"}},
                              "drafter": {"variant": "domino", "domino": {"gru_hidden_dim": 12}}})
    assert cfg.drafter.domino.gru_hidden_dim == 12


def test_block_tokens_are_the_teacher_tokens():
    batch, ids, cu = _batch()
    rows = torch.zeros(2, batch.ctx_len, dtype=torch.long)
    rows[0, :13], rows[1, :9] = ids[:13], ids[13:]
    assert torch.equal(batch.block_tokens, D.teacher_tokens(rows, batch.anchors, B))


@pytest.mark.parametrize("step", [0, 3, 10])
def test_objective_plus_term_is_specforges_mixed_loss(step):
    """objective (sum w CE base) + the term = domino_loss's (1 - lambda) CE(corrected) + lambda CE(base), in
    value and in every parameter's gradient, lambda from the step and train.max_steps."""
    torch.manual_seed(0)
    spec = _spec(lambda_base_decay_ratio=0.5)
    model, objective = spec.build_model(), spec.make_objective()
    embed, head = torch.randn(V, H), torch.randn(V, H) * 0.3
    batch, _, _ = _batch()
    hidden = _hidden(model, batch, embed)
    model.set_context(group=batch, embed=embed, objective=objective, step=step, total_steps=10)
    got = objective.loss(hidden, head, batch.labels).loss_sum + model.loss_terms(hidden, batch.labels, head)["domino"]
    lam = D.lambda_base(step, 10, model.settings)
    assert lam == {0: 1.0, 3: 0.4, 10: 0.0}[step]
    feats = model.domino.features(hidden, F.embedding(batch.block_tokens, embed), B)
    rh, re, corr, y, _ = D.domino_rows(hidden, feats, batch.labels, batch.labels, B, 2)
    _, _, w = objective.rows(hidden, batch.labels)
    want = D.domino_loss(rh, re, corr, head, model.domino.embed_proj[2].weight, y, w, lam, 7).loss_sum
    names, params = zip(*model.named_parameters())
    g_got = torch.autograd.grad(got, params, retain_graph=True, allow_unused=True)
    g_want = torch.autograd.grad(want, params, allow_unused=True)
    torch.testing.assert_close(got, want)
    for a, b in zip(g_got, g_want):
        if a is None or b is None:
            assert a is None and b is None
        else:
            torch.testing.assert_close(a, b)
    g_gru = g_got[names.index("domino.prefix_gru.weight_hh_l0")]
    assert bool(g_gru.abs().sum() > 0) == (lam < 1.0)              # the correction trains once lambda < 1


def test_the_term_takes_the_objectives_d_pace_weights():
    """With drafter.loss.weighting=dpace the mix is SpecForge's with D-PACE's row weights (those of the group's own
    loss, handed over as row_weights), not the slot weights; D-PACE served on a target is refused."""
    torch.manual_seed(0)
    dc = DrafterConfig(num_layers=2, block_size=B, variant="domino", domino=DrafterDomino(emb_dim=8, gru_hidden_dim=6))
    dc.loss.weighting = "dpace"
    spec = resolve_drafter(dc, TARGET, 3, "cpu")
    model, objective = spec.build_model(), spec.make_objective()
    embed, head = torch.randn(V, H), torch.randn(V, H) * 0.3
    batch, _, _ = _batch()
    hidden = _hidden(model, batch, embed)
    model.set_context(group=batch, embed=embed, objective=objective, step=3, total_steps=10)
    parts = objective.loss(hidden, head, batch.labels)
    term = model.loss_terms(hidden, batch.labels, head, row_weights=parts.row_weights)["domino"]
    feats = model.domino.features(hidden, F.embedding(batch.block_tokens, embed), B)
    rh, re, corr, y, _ = D.domino_rows(hidden, feats, batch.labels, batch.labels, B, 2)
    want = D.domino_loss(rh, re, corr, head, model.domino.embed_proj[2].weight, y, parts.row_weights, 0.4, 7)
    torch.testing.assert_close(parts.loss_sum + term, want.loss_sum)
    decay = objective.rows(hidden, batch.labels)[2]
    assert not torch.allclose(parts.row_weights, decay)        # the two weightings differ on this batch
    dc.tuning.loss_on_target = True
    with pytest.raises(ConfigError, match="loss_on_target.*weighting=decay"):
        resolve_drafter(dc, TARGET, 3, "cpu")


def test_served_accuracy_is_the_corrected_argmax_per_slot():
    """loss_terms counts, per slot 1..B-1, the rows whose corrected logits' argmax (teacher forced) is the label;
    window_metrics turns the sums into served_acc[_slot_k] and the acceptance length they predict."""
    torch.manual_seed(0)
    spec = _spec()
    model, objective = spec.build_model(), spec.make_objective()
    with torch.no_grad():
        for i in (0, 2):                                        # a correction large enough to change argmaxes
            model.domino.embed_proj[i].weight.normal_(0.0, 2.0)
    embed, head = torch.randn(V, H), torch.randn(V, H) * 0.3
    batch, _, _ = _batch()
    hidden = _hidden(model, batch, embed)
    base = hidden @ head.t()
    final = model.domino.corrected_logits(base, hidden, F.embedding(batch.block_tokens, embed), B)
    slot = torch.arange(hidden.shape[1]) % B
    labelled = (batch.labels >= 0) & (slot > 0)[None]
    # labels: the corrected argmax on every other labelled row, the head's on the rest
    pick = torch.where(torch.arange(hidden.shape[1])[None] % 2 == 0, final.argmax(-1), base.argmax(-1))
    labels = torch.where(labelled, pick, batch.labels)
    model.set_context(group=batch, embed=embed, objective=objective, step=5, total_steps=10)
    terms = model.loss_terms(hidden, labels, head)
    hit = (final.argmax(-1) == labels) & labelled
    per_slot = lambda x: torch.stack([x[:, slot == k].sum() for k in range(1, B)]).double()  # noqa: E731
    assert torch.equal(terms["domino_rows"], per_slot(labelled))
    assert torch.equal(terms["domino_correct"], per_slot(hit))
    assert not torch.equal(per_slot(hit), per_slot((base.argmax(-1) == labels) & labelled))   # not the head's
    assert set(model.stat_slots()) == {"domino_rows", "domino_correct"}
    m = model.window_metrics({"domino_rows": [4, 2, 0], "domino_correct": [2, 1, 0]})
    assert m["served_acc"] == 0.5 and [m[f"served_acc_slot_{k}"] for k in (1, 2, 3)] == [0.5, 0.5, 0.0]
    assert m["tau_from_served_acc"] == 1 + 0.5 + 0.25


def test_propose_is_the_heads_sequential_decode_and_evaluation_uses_it():
    torch.manual_seed(1)
    model = _spec().build_model()
    with torch.no_grad():
        model.domino.embed_proj[0].weight.normal_(0, 1.0)         # a correction that changes argmaxes
        model.domino.embed_proj[2].weight.normal_(0, 3.0)
    embed, head = torch.randn(V, H), torch.randn(V, H)
    ctx = torch.randn(1, 5, 3 * H)
    block_ids = torch.tensor([[7] + [V - 1] * (B - 1)])
    draft = make_dflash_draft_fn(model, embed, head)
    got = draft(ctx, block_ids, 5)
    mask = dense_mask(torch.tensor([[5]]), torch.tensor([[True]]), 5, B)
    with torch.no_grad():
        hidden = model(F.embedding(block_ids, embed), ctx, torch.arange(5)[None], torch.arange(5, 5 + B)[None], mask)
    want, _ = D.propose(model.domino, hidden, block_ids[:, 0], head, embed)
    assert torch.equal(got, want[0])
    plain = (hidden[0, 1:] @ head.t()).argmax(-1)
    assert not torch.equal(want[0], plain)                         # DFlash's argmax would differ here


def test_flops_and_export_fields_delegate_to_the_math():
    spec = _spec()
    s = settings_of(spec.model)
    per = D.flops_per_block_token(H, V, B, s)
    assert Domino().extra_flops(spec.model, 2, 16, 3, V) == pytest.approx(3 * sum(per.values()) * 2 * 3 * B)
    fields = Domino().export_fields(spec.model)
    assert fields == D.export_fields(s) and fields["architectures"] == ["DominoDraftModel"]
    cfg = {"hidden_size": H, "vocab_size": V, **fields}
    assert Domino().extra_tensor_shapes(cfg) == D.expected_shapes(H, V, s)
    names = Domino().export_names(spec.build_model().state_dict())
    assert set(D.expected_shapes(H, V, s)) <= set(names) and not any(k.startswith("domino.") for k in names)


def test_checkpoint_and_export_checks_bound_the_domino_sizes(tmp_path):
    """meta.json's drafter_config.variant_settings and an export's dflash_config sizes are bounded before any
    module is built (a crafted 2^30-wide GRU is refused, naming the field)."""
    import dataclasses
    import json

    from dflash_dist.checkpoint.store import CheckpointError
    from dflash_dist.checkpoint.validate import check_drafter_config
    from dflash_dist.export.validate import check_export_dir
    dc = dataclasses.asdict(_spec().model)
    assert check_drafter_config("meta.json", "drafter_config", dc)["variant_settings"]["emb_dim"] == 8
    dc["variant_settings"]["gru_hidden_dim"] = 1 << 30
    with pytest.raises(CheckpointError, match="drafter_config.variant_settings.gru_hidden_dim"):
        check_drafter_config("meta.json", "drafter_config", dc)
    cfg = {"hidden_size": H, "num_attention_heads": 4, "intermediate_size": 96, "num_hidden_layers": 2,
           "vocab_size": V, "dflash_config": {"projector_type": "domino", "emb_dim": 1 << 30}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="dflash_config.emb_dim"):
        check_export_dir(str(tmp_path))
