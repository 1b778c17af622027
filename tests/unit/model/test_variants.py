"""model/variants: the registry, DFlash's declarations, and a toy variant registered from test code alone."""

import torch
from helpers.toy_seams import ScaledDFlash, ScaledDrafter
from test_spec import TARGET

from dflash_dist.export.write import build_export_config
from dflash_dist.checkpoint.identity import differences, drafter_identity
from dflash_dist.config import DrafterConfig, JobConfig
from dflash_dist.model.drafter import DFlashDrafter
from dflash_dist.model.masks import dense_mask
from dflash_dist.model.spec import resolve_drafter
from dflash_dist.model.variants import DFlash, variant_class

TOY = "helpers.toy_seams:ScaledDFlash"


def _spec(variant="dflash"):
    return resolve_drafter(DrafterConfig(num_layers=2, block_size=4, variant=variant), TARGET, 3, "cpu")


def _target_dict():
    from transformers import Qwen3Config
    return Qwen3Config(**{k: v for k, v in TARGET.items() if k != "model_type"}).to_dict()


def test_registry_names_and_import_form():
    assert variant_class("dflash") is DFlash
    assert variant_class(TOY) is ScaledDFlash
    spec = _spec(TOY)
    assert isinstance(spec.build_model(), ScaledDrafter) and type(_spec().build_model()) is DFlashDrafter


def test_toy_variant_weights_proposal_and_loss_terms():
    torch.manual_seed(0)
    model = _spec(TOY).build_model()
    assert "out_scale" in model.state_dict() and model.loss_term_names == ("scale_l2",)
    with torch.no_grad():
        model.out_scale.fill_(2.0)
    b, q, s = 1, 4, 5
    feats, embeds = torch.randn(b, s, 3 * 32), torch.randn(b, q, 32)
    mask = dense_mask(torch.tensor([[2]]), torch.tensor([[True]]), s, 4)
    ctx_pos, blk_pos = torch.arange(s)[None], torch.arange(2, 2 + q)[None]
    hidden = model(embeds, feats, ctx_pos, blk_pos, mask)
    with torch.no_grad():
        model.out_scale.fill_(1.0)
        plain = model(embeds, feats, ctx_pos, blk_pos, mask)
        model.out_scale.fill_(2.0)
    torch.testing.assert_close(hidden, 2 * plain)  # the scale acts after the layers
    head = torch.randn(50, 32)
    assert model.propose(hidden, head).shape == (1, 3)
    assert model.loss_terms(hidden, None, head)["scale_l2"].item() == torch.tensor(1e-3 * 32).item()


def test_export_fields_and_names_come_from_the_variant():
    spec = _spec(TOY)
    cfg = build_export_config(spec.model, _target_dict(), [1, 3, 4], 3, 4, variant=TOY)
    assert cfg["architectures"] == ["ScaledDFlashDraftModel"] and cfg["dflash_config"]["output_scale"] is True
    assert cfg["dflash_config"]["block_size"] == 4  # DFlash's fields stay
    plain = build_export_config(_spec().model, _target_dict(), [1, 3, 4], 3, 4)
    assert plain["architectures"] == ["DFlashDraftModel"] and "output_scale" not in plain["dflash_config"]
    names = ScaledDFlash().export_names(spec.build_model().state_dict())
    assert "output_scale.weight" in names and "out_scale" not in names
    assert ScaledDFlash().extra_tensor_shapes(cfg) == {"output_scale.weight": (32,)}


def test_identity_names_the_variant():
    """A checkpoint of another variant is never resumed: the identity differs and its message names it."""
    def ident(variant):
        cfg = JobConfig.from_dict({"target": {"hf_config": {"builtin": "tiny"}}, "drafter": {"variant": variant}})
        return {"drafter": drafter_identity(cfg, [1, 2], 3, 32)}
    diffs = differences(ident("dflash"), ident(TOY))
    assert len(diffs) == 1 and "dflash drafter" in diffs[0] and TOY in diffs[0] and "drafter.{variant" in diffs[0]
    assert differences(ident("dflash"), ident("dflash")) == []
