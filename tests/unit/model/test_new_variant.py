"""Adding a drafter variant, as docs/design.md ("Adding a drafter variant") lists it, from test code alone: a
folder (a package written to a temporary directory) with ``variant.py`` (the class, one registration line) and
``serving.py`` (its part of the exported ``modeling_dflash.py``). Nothing in dflash_dist is edited: the checkpoint
validator, the export, ``load_export``, ``AutoModel(trust_remote_code)`` and ``dflash-doctor --export`` take it."""

import importlib
import json
import os
import sys
import textwrap

import pytest
import torch

from dflash_dist.export.write import export_checkpoint
from dflash_dist.export.load import ExportError, export_problems, load_export
from dflash_dist.export.serving import MARKER, modeling_source
from dflash_dist.checkpoint.store import save_checkpoint
from dflash_dist.cli import doctor
from dflash_dist.config import JobConfig, TargetConfig
from dflash_dist.model.drafter import DrafterModelConfig
from dflash_dist.targets.hf import TINY_DIR
from dflash_dist.model.variants import VARIANTS, DFlash, variant_class
from tests.unit.export.test_export import (
    BLOCK,
    LAYER_IDS,
    MASK,
    TARGET_HF,
    H,
    multi_block_inputs,
    target_config_dict,
    unique_dir,
)

VARIANT_PY = '''
"""A toy variant: DFlash with a learnt square gate after the final norm."""
import os

from torch import nn

from dflash_dist.model.drafter import DFlashDrafter
from dflash_dist.model.variants import VARIANTS, DFlash


class GatedDrafter(DFlashDrafter):
    def add_modules(self, cfg):
        self.gate = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)

    def after_layers(self, h):
        return self.gate(self.norm(h))


@VARIANTS.register
class Gated(DFlash):
    name = "toy_gated"
    title = "Gated"
    model_class = GatedDrafter
    architecture = "GatedDFlashDraftModel"
    auto_model = "modeling_dflash.GatedDFlashDraftModel"
    serving_source = os.path.join(os.path.dirname(os.path.abspath(__file__)), "serving.py")
    export_description = "Gated: architectures [\\"GatedDFlashDraftModel\\"], dflash_config.gated; tensor gate.weight"

    def export_fields(self, model_config):
        return {"architectures": [self.architecture], "dflash_config": {"gated": True}}

    def extra_tensor_shapes(self, config):
        return {"gate.weight": (int(config["hidden_size"]), int(config["hidden_size"]))}

    def export_problems(self, config):
        if not self.claims_export(config):
            return []
        return [] if (config.get("dflash_config") or {}).get("gated") is True else ["no dflash_config.gated"]

    def export_detail(self, config):
        return "; gated" if self.claims_export(config) else ""
'''

SERVING_PY = '''# The toy variant's part of modeling_dflash.py.
# ruff: noqa: F821
''' + MARKER + '''

class GatedDFlashDraftModel(DFlashDraftModel):
    def _add_modules(self, config) -> None:
        self.gate = nn.Linear(config.hidden_size, config.hidden_size, bias=False)

    def _after_layers(self, h):
        return self.gate(self.norm(h))
'''


@pytest.fixture
def gated(tmp_path):
    """The toy variant's folder on sys.path, imported (so registered); unregistered afterwards."""
    pkg = tmp_path / "toy_variant_pkg"
    (pkg / "gated").mkdir(parents=True)
    (pkg / "gated" / "__init__.py").write_text("")
    (pkg / "gated" / "variant.py").write_text(textwrap.dedent(VARIANT_PY))
    (pkg / "gated" / "serving.py").write_text(SERVING_PY)
    sys.path.insert(0, str(pkg))
    try:
        mod = importlib.import_module("gated.variant")
        yield mod.Gated
    finally:
        sys.path.remove(str(pkg))
        VARIANTS._classes.pop("toy_gated", None)
        for name in [m for m in sys.modules if m == "gated" or m.startswith("gated.")]:
            del sys.modules[name]


def gated_checkpoint(tmp_path, cls):
    dcfg = DrafterModelConfig.from_target(target_config_dict(), num_layers=2, num_feature_layers=len(LAYER_IDS),
                                          block_size=BLOCK, intermediate_size=48)
    torch.manual_seed(0)
    model = variant_class("toy_gated")().build(dcfg, "sdpa")
    # one training step of its own weights: the gate gets a gradient through the drafter's forward
    feats, embeds, cpos, bpos, mask = multi_block_inputs()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(embeds, feats, cpos, bpos, mask).pow(2).mean().backward()
    assert model.gate.weight.grad is not None and model.gate.weight.grad.abs().sum() > 0
    opt.step()
    job = JobConfig(target=TargetConfig(hf_config=dict(TARGET_HF), tokenizer=TINY_DIR, layer_ids=LAYER_IDS))
    meta = {"cursor": 5, "total_messages": 10, "layer_ids": LAYER_IDS, "mask_token_id": MASK, "block_size": BLOCK,
            "drafter_config": model.config.__dict__, "target_config": target_config_dict(), "tokenizer": TINY_DIR,
            "job_config": job.to_dict(), "final": True, "drafter": {"variant": cls.name}}
    return save_checkpoint(str(tmp_path / "run"), 1, model.state_dict(), None, meta), model.eval()


def test_a_variant_added_from_outside_trains_exports_and_serves(tmp_path, gated):
    assert variant_class("toy_gated") is gated and issubclass(gated, DFlash)
    ckpt, model = gated_checkpoint(tmp_path, gated)      # the export reads it through check_checkpoint
    out = export_checkpoint(ckpt, unique_dir(tmp_path, "gated"), dtype="float32")
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert cfg["architectures"] == ["GatedDFlashDraftModel"] and cfg["dflash_config"]["gated"] is True
    assert cfg["auto_map"] == {"AutoModel": "modeling_dflash.GatedDFlashDraftModel"}
    assert export_problems(cfg, out) == []
    # the exported modeling file: the base part, the built-in variants' parts, then this variant's
    text = open(os.path.join(out, "modeling_dflash.py")).read()
    assert text == modeling_source(gated()) and text.startswith(modeling_source(DFlash()))
    assert text.endswith(SERVING_PY.partition(MARKER)[2])
    # load_export rebuilds the variant from the architecture; AutoModel runs the assembled file: the same outputs
    back, _ = load_export(out)
    assert type(back).__name__ == "GatedDrafter"
    from transformers import AutoModel
    auto = AutoModel.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()
    assert type(auto).__name__ == "GatedDFlashDraftModel"
    feats, embeds, cpos, bpos, mask = multi_block_inputs()
    with torch.no_grad():
        ref = model(embeds, feats, cpos, bpos, mask)
        assert torch.equal(back(embeds, feats, cpos, bpos, mask), ref)
        got = auto(position_ids=torch.cat([cpos, bpos], 1), noise_embedding=embeds, target_hidden=feats,
                   attention_mask=mask)
        assert torch.equal(got, ref)
    # dflash-doctor --export: passes, with the variant's detail line
    doc = doctor.Doctor()
    doctor.check_export(doc, out)
    (row,) = [r for r in doc.rows if r["check"] == "export"]
    assert row["status"] == doctor.PASS and row["detail"].endswith("; gated"), row
    # its own export check refuses a config without its field
    cfg["dflash_config"].pop("gated")
    assert export_problems(cfg) == ["no dflash_config.gated"]
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ExportError, match="not a Gated export"):
        load_export(out)
