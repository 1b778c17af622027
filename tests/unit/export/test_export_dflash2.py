"""A DFlash2 export as vLLM (``DFlash2DraftModel``) and SGLang (``DFLASH``) load it: config.json fields, tensor
names and shapes, ``dflash-doctor --export`` on good and broken exports, and the standalone
``modeling_dflash.DFlash2DraftModel`` (trust_remote_code) against the project's DFlash2 math."""

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from dflash_dist.export.write import apply_variant_fields, build_export_config
from dflash_dist.export.load import ExportError, export_problems, validate_export_tensors
from dflash_dist.export.serving import modeling_source, write_modeling
from dflash_dist.cli import doctor
from dflash_dist.config import ConfigError
from dflash_dist.model.variants.dflash2 import layers as dflash2
from dflash_dist.model.variants import DFlash2
from dflash_dist.model.variants.dflash2.export_checks import dflash2_settings
from dflash_dist.model.variants.dflash2.selector import propose, transform_logits
from dflash_dist.model.drafter import DrafterModelConfig
from tests.unit.export.test_export import BLOCK, LAYER_IDS, MASK, H, target_config_dict

SETTINGS = dflash2.DFlash2Settings(conv_kernel_size=2, conv_group_size=8, selector_rank=6, selector_top_k=5,
                                   output_multiplier=0.7, final_logit_softcapping=3.0)
V = 2048


def drafter_config() -> DrafterModelConfig:
    return DrafterModelConfig.from_target(target_config_dict(), num_layers=2, num_feature_layers=len(LAYER_IDS),
                                          block_size=BLOCK, intermediate_size=48)


def dflash2_config(settings=SETTINGS) -> dict:
    """The config.json a DFlash2 export carries: DFlash's, with the fields the DFlash2 variant's export_fields
    gives (its layers.export_fields) merged as build_export_config merges them."""
    cfg = build_export_config(drafter_config(), target_config_dict(), LAYER_IDS, MASK, BLOCK, "float32")
    return apply_variant_fields(cfg, {"architectures": [dflash2.ARCHITECTURE],
                                      "dflash_config": dflash2.export_fields(settings)})


def random_tensors(seed=0, scale=0.3) -> dict:
    """Every tensor of the contract (the variant's layers.expected_shapes) random, norms around 1."""
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g) * scale + (1.0 if k.endswith("norm.weight") else 0.0)
            for k, s in dflash2.expected_shapes(drafter_config(), SETTINGS).items()}


def write_export(path, cfg=None, tensors=None) -> str:
    """An export directory: config.json, model.safetensors, modeling_dflash.py (as dflash-export writes them)."""
    os.makedirs(path, exist_ok=True)
    save_file(tensors if tensors is not None else random_tensors(), os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg if cfg is not None else dflash2_config(), f, indent=2)
    write_modeling(DFlash2(), path)
    return str(path)


def modeling_module():
    """The exported modeling_dflash.py as a module, without an export directory."""
    import types
    mod = types.ModuleType("modeling_dflash")
    exec(compile(modeling_source(DFlash2()), "modeling_dflash.py", "exec"), mod.__dict__)
    return mod


def unique_dir(tmp_path, name):
    # transformers caches remote code per directory basename
    return str(tmp_path / f"{name}_{os.getpid()}_{tmp_path.name}")


def test_config_fields_are_the_engines_contract():
    cfg = dflash2_config()
    dfc = cfg["dflash_config"]
    assert cfg["architectures"] == ["DFlash2DraftModel"] and cfg["model_type"] == "qwen3"
    assert {k: dfc[k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")} == \
        {"conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 6, "selector_top_k": 5}
    assert dfc["output_multiplier"] == 0.7 and dfc["final_logit_softcapping"] == 3.0
    assert dfc["mask_token_id"] == MASK and dfc["target_layer_ids"] == LAYER_IDS and dfc["block_size"] == BLOCK
    assert cfg["is_causal"] is False and "input_embedding_scale" not in cfg and "input_embedding_scale" not in dfc
    assert cfg["auto_map"] == {"AutoModel": "modeling_dflash.DFlash2DraftModel"}
    assert export_problems(cfg) == []
    assert dflash2_settings(cfg).selector_top_k == 5
    # the names and shapes implied by the config's fields are the contract's (no embedding, no lm_head)
    tensors = random_tensors()
    validate_export_tensors(tensors, cfg)
    assert "candidate_selector.successor_codebook" in tensors
    assert not any("embed" in k or "lm_head" in k for k in tensors)


def test_a_dflash2_field_the_engines_refuse_is_refused_at_export():
    cfg = build_export_config(drafter_config(), target_config_dict(), LAYER_IDS, MASK, BLOCK, "float32")
    fields = dict(dflash2.export_fields(SETTINGS))
    del fields["selector_rank"]
    with pytest.raises(ExportError, match="selector_rank"):
        apply_variant_fields(cfg, {"architectures": [dflash2.ARCHITECTURE], "dflash_config": fields})
    for key, value in (("output_multiplier", float("inf")), ("output_multiplier", float("nan")),
                       ("final_logit_softcapping", float("inf")), ("final_logit_softcapping", float("nan"))):
        fields = dict(dflash2.export_fields(SETTINGS), **{key: value})
        with pytest.raises(ExportError, match=key):
            apply_variant_fields(dict(cfg, dflash_config=dict(cfg["dflash_config"])),
                                 {"architectures": [dflash2.ARCHITECTURE], "dflash_config": fields})
        with pytest.raises(ConfigError, match=key):   # nor can a job be configured so
            dflash2.DFlash2Settings(**dict(vars(SETTINGS), **{key: value}))


def renamed_codebook():
    t = random_tensors()
    t["candidate_selector.successor_codebook.weight"] = t.pop("candidate_selector.successor_codebook")
    return dflash2_config(), t


def swap_field(drop=None, **top):
    cfg = dflash2_config()
    if drop:
        del cfg["dflash_config"][drop]
    cfg.update(top)
    return cfg, None


def dflash_field(**fields):
    cfg = dflash2_config()
    cfg["dflash_config"].update(fields)
    return cfg, None


def nan_codebook():
    t = random_tensors()
    t["candidate_selector.predecessor_codebook"][3, 1] = float("nan")
    return dflash2_config(), t


BROKEN = {
    "multiplier_inf": (lambda: dflash_field(output_multiplier=float("inf")), "output_multiplier"),
    "softcap_nan": (lambda: dflash_field(final_logit_softcapping=float("nan")), "final_logit_softcapping"),
    "rope_nan": (lambda: swap_field(rope_parameters={"rope_type": "default", "rope_theta": float("nan")}),
                 "rope_parameters.rope_theta"),
    "codebook_nan": (nan_codebook, "predecessor_codebook"),
    "codebook_renamed": (renamed_codebook, "codebook.weight"),
    "no_selector_top_k": (lambda: swap_field(drop="selector_top_k"), "selector_top_k"),
    "embedding_scale": (lambda: swap_field(input_embedding_scale=2.0), "input_embedding_scale"),
    "architectures": (lambda: swap_field(architectures=["DFlashDraftModel"]), "architectures"),
    "no_softcap": (lambda: swap_field(drop="final_logit_softcapping"), "final_logit_softcapping"),
}


def test_doctor_passes_a_good_dflash2_export(tmp_path):
    doc = doctor.Doctor()
    doctor.check_export(doc, write_export(tmp_path / "good"))
    rows = [r for r in doc.rows if r["check"] == "export"]
    assert rows and rows[0]["status"] == doctor.PASS, rows
    assert "DFlash2" in rows[0]["detail"] and "num_speculative_tokens 3" in rows[0]["detail"]


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_doctor_fails_a_broken_dflash2_export(tmp_path, case):
    make, needle = BROKEN[case]
    cfg, tensors = make()
    doc = doctor.Doctor()
    doctor.check_export(doc, write_export(tmp_path / case, cfg, tensors))
    rows = [r for r in doc.rows if r["check"] == "export"]
    assert rows and rows[0]["status"] == doctor.FAIL, rows
    assert needle in rows[0]["detail"]


def auto_model(path):
    from transformers import AutoModel
    m = AutoModel.from_pretrained(path, trust_remote_code=True, dtype=torch.float32)
    assert type(m).__name__ == "DFlash2DraftModel" and type(m).__module__.endswith("modeling_dflash")
    return m.eval()


def test_automodel_builds_dflash2_with_the_projects_math(tmp_path):
    """AutoModel(trust_remote_code) of a DFlash2 export loads every tensor, its layers compute
    the variant's layers.DFlash2DecoderLayer's, and compute_logits / propose give its selector.py's results."""
    tensors = random_tensors(seed=3, scale=0.1)
    auto = auto_model(write_export(unique_dir(tmp_path, "d2auto"), tensors=tensors))
    assert {k: tuple(v.shape) for k, v in auto.state_dict().items()} == {k: tuple(v.shape) for k, v in
                                                                         tensors.items()}
    assert all(torch.equal(auto.state_dict()[k], v) for k, v in tensors.items())
    g = torch.Generator().manual_seed(1)
    ctx = 9
    feats = torch.randn(2, ctx, len(LAYER_IDS) * H, generator=g)
    embeds = torch.randn(2, BLOCK, H, generator=g)
    pos = torch.arange(ctx + BLOCK)[None]
    with torch.no_grad():
        hidden = auto(position_ids=pos, noise_embedding=embeds, target_hidden=feats)
        # the project's DFlash2 layer on the same weights and inputs
        layer = dflash2.DFlash2DecoderLayer(drafter_config(), SETTINGS)
        layer.load_state_dict({k[len("layers.0."):]: v for k, v in tensors.items() if k.startswith("layers.0.")})
        model_ctx = auto.hidden_norm(auto.fc(feats))
        rope_q = auto._rotary(pos[:, ctx:].expand(2, -1), torch.float32)
        rope_c = auto._rotary(pos[:, :ctx].expand(2, -1), torch.float32)
        rope_k = (torch.cat([rope_c[0], rope_q[0]], 1), torch.cat([rope_c[1], rope_q[1]], 1))
        mask = torch.ones(2, BLOCK, ctx + BLOCK, dtype=torch.bool)
        sdpa = (mask[:, None], mask.any(-1)[:, None, :, None])
        ours = layer(embeds, model_ctx, rope_q, rope_k, sdpa, "sdpa")
        theirs = auto.layers[0](embeds, model_ctx, rope_q, rope_k, sdpa)
        torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-6)
        assert (theirs - auto.layers[0].self_attn(auto.layers[0].input_layernorm(embeds), model_ctx, rope_q, rope_k,
                                                  sdpa) - embeds).abs().max() > 1e-3   # the convs act
        head = torch.randn(V, H, generator=g)
        torch.testing.assert_close(auto.compute_logits(hidden, head), transform_logits(hidden @ head.t(), 0.7, 3.0))
        anchors = torch.tensor([5, 17])
        selector = dflash2.CandidateSelector(H, V, 6)
        selector.load_state_dict({k[len("candidate_selector."):]: v for k, v in tensors.items()
                                  if k.startswith("candidate_selector.")})
        want = propose(selector, hidden, anchors, head, 5, 0.7, 3.0)
        got = auto.propose(hidden, anchors, _linear(head), 0.0)    # lm_head as a module, as z-lab passes it
        for a, b in zip(got, want):
            assert torch.equal(a, b)
        for t in (0.5, 1.3):
            got = auto.propose(hidden, anchors, head, t, torch.Generator().manual_seed(9))
            want = propose(selector, hidden, anchors, head, 5, 0.7, 3.0, t, torch.Generator().manual_seed(9))
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
            torch.testing.assert_close(got[2], want[2])


def _linear(weight):
    lin = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    lin.weight = torch.nn.Parameter(weight, requires_grad=False)
    return lin



def test_load_export_refuses_a_dflash2_config_an_engine_would_misread(tmp_path):
    cfg = dflash2_config()
    del cfg["dflash_config"]["conv_group_size"]
    from dflash_dist.export.load import load_export
    with pytest.raises(ExportError, match="conv_group_size"):
        load_export(write_export(tmp_path / "bad", cfg))
    for case in ("multiplier_inf", "codebook_nan"):     # what the doctor fails, loading refuses too
        cfg, tensors = BROKEN[case][0]()
        with pytest.raises(ExportError, match=BROKEN[case][1]):
            load_export(write_export(tmp_path / case, cfg, tensors))


def random_dflash2(target_config: dict, block_size: int, num_feature_layers: int, seed: int = 8):
    """(resolved spec, model, generator) of a 2-layer DFlash2 drafter of the tests' settings, every weight random (norms
    near 1); the generator goes on where the weights left it."""
    from dflash_dist.config import DrafterConfig
    from dflash_dist.model.spec import resolve_drafter
    dc = DrafterConfig(num_layers=2, block_size=block_size, variant="dflash2",
                       dflash2={"conv_group_size": 8, "selector_rank": 6, "selector_top_k": 5,
                                "output_multiplier": 0.7, "final_logit_softcapping": 3.0})
    spec = resolve_drafter(dc, target_config, num_feature_layers, "cpu")
    model = spec.build_model().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1 + (1.0 if name.endswith("norm.weight") else 0.0))
    return spec, model, g


def test_automodel_of_a_dflash2_export_equals_load_export(tmp_path):
    """A trained-shape DFlash2 checkpoint (the dflash2 variant, every weight random) through dflash-export:
    load_export rebuilds the variant, AutoModel(trust_remote_code) builds modeling_dflash.DFlash2DraftModel, and
    both give the same hidden states and the same selector proposals."""
    from transformers import AutoModel

    from dflash_dist.export.write import export_checkpoint
    from dflash_dist.export.load import load_export
    from dflash_dist.checkpoint.store import save_checkpoint
    from dflash_dist.config import JobConfig, TargetConfig
    from dflash_dist.targets.hf import TINY_DIR
    from tests.unit.export.test_export import TARGET_HF, multi_block_inputs

    spec, model, g = random_dflash2(target_config_dict(), BLOCK, len(LAYER_IDS))
    settings = spec.to_meta()
    job = JobConfig(target=TargetConfig(hf_config=dict(TARGET_HF), tokenizer=TINY_DIR, layer_ids=LAYER_IDS))
    meta = {"cursor": 5, "total_messages": 10, "layer_ids": LAYER_IDS, "mask_token_id": MASK,
            "drafter_config": settings.pop("model"), "drafter": settings, "target_config": target_config_dict(),
            "tokenizer": TINY_DIR, "job_config": job.to_dict(), "final": False}
    ckpt = save_checkpoint(str(tmp_path / "run"), 3, model.state_dict(), None, meta)
    out = export_checkpoint(ckpt, unique_dir(tmp_path, "d2real"), dtype="float32", tokenizer=False)
    back, info = load_export(out)
    auto = AutoModel.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()
    assert type(auto).__name__ == "DFlash2DraftModel" and set(auto.state_dict()) == set(back.state_dict())
    feats, embeds, cpos, bpos, mask = multi_block_inputs()
    with torch.no_grad():
        ref = back(embeds, feats, cpos, bpos, mask)
        got = auto(position_ids=torch.cat([cpos, bpos], 1), noise_embedding=embeds, target_hidden=feats,
                   attention_mask=mask)
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-6)
        assert torch.equal(ref, model(embeds, feats, cpos, bpos, mask))
        head = torch.randn(V, H, generator=g)
        blocks = got[0].unflatten(0, (-1, BLOCK))                    # [n, B, H], one row per block
        anchors = torch.tensor([5, 17, 900])
        assert torch.equal(auto.propose(blocks, anchors, head)[0], back.propose(blocks, head, anchors))
