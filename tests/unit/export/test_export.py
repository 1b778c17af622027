"""dflash-export: z-lab layout (config fields, tensor names/shapes, dtype, tokenizer), exact reload, refusals."""

import json
import os

import pytest
import torch
from safetensors import safe_open

from dflash_dist.export.write import export_checkpoint, mask_token_string
from dflash_dist.export.load import (
    META_NAME,
    ExportError,
    expected_tensor_shapes,
    export_problems,
    load_export,
)
from dflash_dist.checkpoint.store import save_checkpoint
from dflash_dist.cli.export import main
from dflash_dist.config import JobConfig, TargetConfig
from dflash_dist.model.drafter import DFlashDrafter, DrafterModelConfig, RMSNorm
from dflash_dist.targets.hf import TINY_DIR
from dflash_dist.model.masks import dense_mask

H, LAYERS, TARGET_LAYERS, BLOCK, MASK = 32, 2, 6, 4, 3
LAYER_IDS = [1, 3, 4]
TARGET_HF = dict(model_type="qwen3", vocab_size=2048, hidden_size=H, intermediate_size=96, num_hidden_layers=TARGET_LAYERS,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
                 rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0,
                 pad_token_id=0)


def target_config_dict(**over):
    from transformers import Qwen3Config
    cfg = {k: v for k, v in {**TARGET_HF, **over}.items() if k != "model_type"}
    return Qwen3Config(**cfg).to_dict()


def make_drafter(seed=0, layer_types=None, sliding_window=None, rope_theta=None):
    tc = target_config_dict(**({"rope_theta": rope_theta} if rope_theta else {}))
    dcfg = DrafterModelConfig.from_target(tc, num_layers=LAYERS, num_feature_layers=len(LAYER_IDS),
                                          block_size=BLOCK, intermediate_size=48, layer_types=layer_types,
                                          sliding_window=sliding_window)
    torch.manual_seed(seed)
    m = DFlashDrafter(dcfg, "sdpa").eval()
    with torch.no_grad():
        for mod in m.modules():
            if isinstance(mod, RMSNorm):
                mod.weight.uniform_(0.5, 1.5)
    return m


def make_checkpoint(tmp_path, model=None, step=7, target_config=None, mask=MASK, run="run"):
    model = model or make_drafter()
    job = JobConfig(target=TargetConfig(hf_config=dict(TARGET_HF), tokenizer=TINY_DIR, layer_ids=LAYER_IDS))
    meta = {"cursor": 5, "total_messages": 10, "layer_ids": LAYER_IDS, "mask_token_id": mask, "block_size": BLOCK,
            "drafter_config": model.config.__dict__, "target_config": target_config or target_config_dict(),
            "tokenizer": TINY_DIR, "job_config": job.to_dict(), "final": False}
    return save_checkpoint(str(tmp_path / run), step, model.state_dict(), None, meta), model


def drafter_out(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    ctx, p = 9, 9
    feats = torch.randn(1, ctx, len(LAYER_IDS) * H, generator=g)
    embeds = torch.randn(1, BLOCK, H, generator=g)
    mask = dense_mask(torch.tensor([[p]]), torch.tensor([[True]]), ctx, BLOCK)
    with torch.no_grad():
        return model(embeds, feats, torch.arange(ctx)[None], torch.arange(p, p + BLOCK)[None], mask)


def test_config_fields_and_tensor_layout(tmp_path):
    ckpt, model = make_checkpoint(tmp_path)
    out = export_checkpoint(ckpt, str(tmp_path / "export"))
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
              "vocab_size", "rms_norm_eps", "bos_token_id", "eos_token_id", "pad_token_id"):
        assert cfg[k] == TARGET_HF[k], k
    assert cfg["intermediate_size"] == 48  # the drafter's, not the target's 96
    assert cfg["rope_parameters"] == {"rope_theta": 10000.0, "rope_type": "default"}  # transformers 5
    assert cfg["rope_theta"] == 10000.0 and cfg["rope_scaling"] is None                # transformers 4.x
    assert cfg["num_hidden_layers"] == LAYERS and cfg["num_target_layers"] == TARGET_LAYERS
    assert cfg["block_size"] == BLOCK
    assert cfg["dflash_config"] == {"mask_token_id": MASK, "mask_token": "<|MASK|>", "target_layer_ids": LAYER_IDS,
                                    "block_size": BLOCK}
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in LAYER_IDS]      # vLLM's capture points
    assert cfg["auto_map"] == {"AutoModel": "modeling_dflash.DFlashDraftModel"}
    assert os.path.exists(os.path.join(out, "modeling_dflash.py"))
    assert export_problems(cfg, out) == []
    assert cfg["layer_types"] == ["full_attention"] * LAYERS
    assert cfg["use_sliding_window"] is False and cfg["sliding_window"] is None and "use_swa" not in cfg["dflash_config"]
    assert cfg["torch_dtype"] == cfg["dtype"] == "bfloat16"
    assert cfg["use_cache"] is False and cfg["is_causal"] is False and cfg["tie_word_embeddings"] is False
    assert cfg["hidden_act"] == "silu" and cfg["attention_bias"] is False and cfg["attention_dropout"] == 0.0

    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        names = set(f.keys())
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in names}
        dtypes = {f.get_tensor(k).dtype for k in names}
    assert shapes == expected_tensor_shapes(cfg)
    assert names == set(model.state_dict())
    assert not any(n.startswith("model.") or "embed_tokens" in n or "lm_head" in n for n in names)
    assert shapes["fc.weight"] == (H, len(LAYER_IDS) * H)
    assert {"hidden_norm.weight", "norm.weight", "layers.1.mlp.down_proj.weight"} <= names
    assert dtypes == {torch.bfloat16}

    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(out)
    ref = AutoTokenizer.from_pretrained(TINY_DIR)
    text = "<|im_start|>user\nhello there<|im_end|>\n"
    assert tok(text)["input_ids"] == ref(text)["input_ids"] and len(tok) == len(ref)
    side = json.load(open(os.path.join(out, META_NAME)))
    assert side["target"]["hf_config"]["hidden_size"] == H and side["step"] == 7


def test_reload_gives_identical_logits(tmp_path):
    ckpt, model = make_checkpoint(tmp_path)
    ref = drafter_out(model)
    out32 = export_checkpoint(ckpt, str(tmp_path / "e32"), dtype="float32")
    back, meta = load_export(out32)
    assert torch.equal(drafter_out(back), ref)
    assert meta["layer_ids"] == LAYER_IDS and meta["mask_token_id"] == MASK and meta["block_size"] == BLOCK
    assert meta["tokenizer"] == out32 and meta["target"]["layer_ids"] == LAYER_IDS
    lm_head = torch.randn(2048, H, generator=torch.Generator().manual_seed(5))
    assert torch.equal(drafter_out(back) @ lm_head.T, ref @ lm_head.T)

    # bf16 export: exactly the original with its weights rounded to bf16
    out16 = export_checkpoint(ckpt, str(tmp_path / "e16"))
    back16, _ = load_export(out16)
    rounded = make_drafter()
    rounded.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in model.state_dict().items()})
    assert torch.equal(drafter_out(back16), drafter_out(rounded))
    assert back16.fc.weight.dtype == torch.float32
    assert load_export(out16, dtype=None)[0].fc.weight.dtype == torch.bfloat16


def test_partial_or_mismatched_checkpoint_refused(tmp_path):
    ckpt, model = make_checkpoint(tmp_path)
    with open(os.path.join(ckpt, "model.safetensors"), "r+b") as f:  # truncated weights
        f.truncate(100)
    with pytest.raises(ExportError, match="truncated"):
        export_checkpoint(ckpt, str(tmp_path / "x"))
    assert not os.path.exists(tmp_path / "x")
    os.unlink(os.path.join(ckpt, "meta.json"))                      # no meta.json
    with pytest.raises(ExportError, match="meta.json"):
        export_checkpoint(ckpt, str(tmp_path / "x"))
    assert main([ckpt, str(tmp_path / "x")]) == 2

    sd = model.state_dict()
    sd.pop("layers.1.mlp.up_proj.weight")
    sd["lm_head.weight"] = torch.zeros(2048, H)
    job = {"layer_ids": LAYER_IDS, "mask_token_id": MASK, "block_size": BLOCK, "drafter_config": model.config.__dict__,
           "target_config": target_config_dict(), "tokenizer": TINY_DIR}
    bad = save_checkpoint(str(tmp_path / "bad"), 1, sd, None, job)
    with pytest.raises(ExportError, match="missing.*up_proj.*unexpected.*lm_head"):
        export_checkpoint(bad, str(tmp_path / "y"))


def test_cli_overwrite_and_prefixed_state_dict(tmp_path):
    model = make_drafter()
    ckpt, _ = make_checkpoint(tmp_path, model)
    out = str(tmp_path / "cli")
    assert main([ckpt, out, "--dtype", "float32"]) == 0
    assert main([ckpt, out]) == 2                       # not empty
    assert main([ckpt, out, "--overwrite", "--no-tokenizer"]) == 0
    assert not os.path.exists(os.path.join(out, "tokenizer.json"))
    assert json.load(open(os.path.join(out, "config.json")))["dtype"] == "bfloat16"
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp_export")]

    # a DDP/compile-wrapped state dict exports under the bare names
    wrapped = {"module." + k: v for k, v in model.state_dict().items()}
    meta = json.load(open(os.path.join(ckpt, "meta.json")))
    ck2 = save_checkpoint(str(tmp_path / "wrapped"), 3, wrapped, None, {k: v for k, v in meta.items() if k != "files"})
    back, _ = load_export(export_checkpoint(ck2, str(tmp_path / "e2"), dtype="float32"))
    assert torch.equal(drafter_out(back), drafter_out(model))


def test_load_zlab_style_config(tmp_path):
    """A release config with only rope_theta and a top-level block_size loads too."""
    model = make_drafter()
    ckpt, _ = make_checkpoint(tmp_path, model)
    out = export_checkpoint(ckpt, str(tmp_path / "z"), dtype="float32", tokenizer=False)
    cfg = json.load(open(os.path.join(out, "config.json")))
    cfg.pop("rope_parameters")
    cfg["rope_theta"] = 10000.0
    cfg["dflash_config"].pop("block_size")
    json.dump(cfg, open(os.path.join(out, "config.json"), "w"))
    os.unlink(os.path.join(out, META_NAME))
    back, meta = load_export(out)
    assert meta["block_size"] == BLOCK and meta["tokenizer"] is None and "target" not in meta
    assert torch.equal(drafter_out(back), drafter_out(model))


def multi_block_inputs(seed=2):
    """Three blocks (one padding) over a 12-token context: the mask matters (anchors 2, 6, pad)."""
    g = torch.Generator().manual_seed(seed)
    ctx, n = 12, 3
    anchors, valid = torch.tensor([[2, 6, 0]]), torch.tensor([[True, True, False]])
    feats = torch.randn(1, ctx, len(LAYER_IDS) * H, generator=g)
    embeds = torch.randn(1, n * BLOCK, H, generator=g)
    blk_pos = (anchors[:, :, None] + torch.arange(BLOCK)).reshape(1, -1)
    return feats, embeds, torch.arange(ctx)[None], blk_pos, dense_mask(anchors, valid, ctx, BLOCK)


def auto_model(path):
    from transformers import AutoModel
    m = AutoModel.from_pretrained(path, trust_remote_code=True, dtype=torch.float32)
    assert type(m).__name__ == "DFlashDraftModel" and type(m).__module__.endswith("modeling_dflash")
    return m.eval()


def unique_dir(tmp_path, name):
    # transformers caches remote code per directory basename: a name no other test (or helper) uses
    return str(tmp_path / f"{name}_{os.getpid()}_{tmp_path.name}")


@pytest.mark.parametrize("sliding", [False, True])
def test_automodel_trust_remote_code_equals_load_export(tmp_path, sliding):
    """AutoModel.from_pretrained(export, trust_remote_code=True) builds the exported drafter (modeling_dflash.py)
    with outputs identical to load_export's: one block with no mask, and several blocks under the training mask
    (for a sliding-window drafter the window comes from the positions in both)."""
    kw = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 5} if sliding else {}
    model = make_drafter(**kw)
    ckpt, _ = make_checkpoint(tmp_path, model)
    out = export_checkpoint(ckpt, unique_dir(tmp_path, "auto_swa" if sliding else "auto"), dtype="float32")
    back, _ = load_export(out)
    auto = auto_model(out)
    assert set(auto.state_dict()) == set(back.state_dict())
    g = torch.Generator().manual_seed(1)
    ctx, p = 9, 9
    feats = torch.randn(1, ctx, len(LAYER_IDS) * H, generator=g)
    embeds = torch.randn(1, BLOCK, H, generator=g)
    pos = torch.arange(ctx + BLOCK)[None]
    with torch.no_grad():
        ref = back(embeds, feats, pos[:, :ctx], pos[:, ctx:], dense_mask(torch.tensor([[p]]), torch.tensor([[True]]),
                                                                         ctx, BLOCK))
        got = auto(position_ids=pos, noise_embedding=embeds, target_hidden=feats)
        assert torch.equal(got, ref) and torch.equal(ref, drafter_out(model))
        feats, embeds, cpos, bpos, mask = multi_block_inputs()
        ref = back(embeds, feats, cpos, bpos, mask)
        got = auto(position_ids=torch.cat([cpos, bpos], 1), noise_embedding=embeds, target_hidden=feats,
                   attention_mask=mask)
        assert torch.equal(got, ref)
        lm_head = torch.randn(2048, H, generator=g)
        assert torch.equal(got @ lm_head.T, ref @ lm_head.T)
    if sliding:  # the window changed something, so the equality above tested it
        full = make_drafter()
        full.load_state_dict(model.state_dict())
        with torch.no_grad():
            assert not torch.equal(full(embeds, feats, cpos, bpos, mask), ref)


def test_qwen3_8b_shaped_target_exports_rope_theta_1e6(tmp_path):
    """transformers 5 saves a Qwen3-8B config with rope_parameters only; the export still carries the top-level
    rope_theta that a transformers-4.57 Qwen3Config reads (it would default to 10000), and 5.x reads 1e6 too."""
    tc = target_config_dict(rope_theta=1_000_000.0)
    assert tc.get("rope_theta") is None and tc["rope_parameters"]["rope_theta"] == 1e6  # what tf 5 writes
    ckpt, model = make_checkpoint(tmp_path, make_drafter(rope_theta=1_000_000.0), target_config=tc)
    out = export_checkpoint(ckpt, str(tmp_path / "e8b"), tokenizer=False)
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert cfg["rope_theta"] == 1e6 and cfg["rope_scaling"] is None
    assert cfg["rope_parameters"] == {"rope_theta": 1e6, "rope_type": "default"}
    from transformers import AutoConfig
    assert AutoConfig.from_pretrained(out).rope_parameters["rope_theta"] == 1e6
    back, _ = load_export(out)
    assert back.config.rope_theta == 1e6


def test_mask_token_string_is_the_tokenizers(tmp_path):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(TINY_DIR)
    assert mask_token_string(tok, MASK) == "<|MASK|>" == tok.convert_ids_to_tokens(MASK)
    assert mask_token_string(tok, 7) == tok.convert_ids_to_tokens(7)   # any id with a token: that token
    with pytest.raises(ExportError, match="no token"):                 # nothing names the id for SGLang
        mask_token_string(tok, len(tok) + 3)
    ckpt, _ = make_checkpoint(tmp_path, mask=7)
    cfg = json.load(open(os.path.join(export_checkpoint(ckpt, str(tmp_path / "m7"), tokenizer=False), "config.json")))
    assert cfg["dflash_config"]["mask_token_id"] == 7
    assert tok.get_vocab()[cfg["dflash_config"]["mask_token"]] == 7    # the check SGLang's worker makes


def test_sliding_window_export_round_trip(tmp_path):
    types = ["sliding_attention", "sliding_attention"]
    model = make_drafter(layer_types=types, sliding_window=6)
    ckpt, _ = make_checkpoint(tmp_path, model)
    out = export_checkpoint(ckpt, str(tmp_path / "swa"), dtype="float32", tokenizer=False)
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert cfg["layer_types"] == types and cfg["sliding_window"] == 6 and cfg["use_sliding_window"] is True
    assert cfg["is_causal"] is False and cfg["dflash_config"]["use_swa"] is True
    from transformers import AutoConfig
    hf = AutoConfig.from_pretrained(out)          # what the z-lab model reads: window kept, per-layer types
    assert hf.sliding_window == 6 and hf.layer_types == types
    back, _ = load_export(out)
    assert back.config.layer_types == types and back.config.sliding_window == 6
    feats, embeds, cpos, bpos, mask = multi_block_inputs()
    with torch.no_grad():
        assert torch.equal(back(embeds, feats, cpos, bpos, mask), model(embeds, feats, cpos, bpos, mask))

    def refused(match, **edit):
        bad = dict(cfg, **edit)
        json.dump(bad, open(os.path.join(out, "config.json"), "w"))
        with pytest.raises(ExportError, match=match):
            load_export(out)

    refused("use_sliding_window", use_sliding_window=False)   # transformers would drop the window
    refused("sliding_window=None", sliding_window=None)
    refused("is_causal", is_causal=True)
    refused("swa_window_size", dflash_config={**cfg["dflash_config"], "swa_window_size": 8})
    no_causal = {k: v for k, v in cfg.items() if k != "is_causal"}
    json.dump(no_causal, open(os.path.join(out, "config.json"), "w"))
    with pytest.raises(ExportError, match="is_causal"):
        load_export(out, require_complete=False)             # vLLM would make these layers causal
    full_swa = dict(cfg, layer_types=["full_attention"] * LAYERS)
    json.dump(full_swa, open(os.path.join(out, "config.json"), "w"))
    with pytest.raises(ExportError, match="use_swa"):
        load_export(out)                                      # vLLM: SWA everywhere, the z-lab model: none


def test_load_export_refuses_an_incomplete_export(tmp_path):
    ckpt, _ = make_checkpoint(tmp_path)
    out = export_checkpoint(ckpt, str(tmp_path / "inc"), dtype="float32", tokenizer=False)
    path = os.path.join(out, "config.json")
    good = json.load(open(path))
    for drop, match in [("rope_theta", "rope_theta"), ("rope_scaling", "rope_scaling"),
                        ("eagle_aux_hidden_state_layer_ids", "eagle_aux"), ("auto_map", "auto_map")]:
        json.dump({k: v for k, v in good.items() if k != drop}, open(path, "w"))
        with pytest.raises(ExportError, match=match):
            load_export(out)
    dfc = {k: v for k, v in good["dflash_config"].items() if k != "mask_token"}
    json.dump(dict(good, dflash_config=dfc), open(path, "w"))
    with pytest.raises(ExportError, match="mask_token"):
        load_export(out)
    json.dump(dict(good, eagle_aux_hidden_state_layer_ids=LAYER_IDS), open(path, "w"))  # off by one
    with pytest.raises(ExportError, match=r"target_layer_ids \+ 1"):
        load_export(out)
    json.dump(good, open(path, "w"))
    os.unlink(os.path.join(out, "modeling_dflash.py"))
    with pytest.raises(ExportError, match="modeling_dflash.py"):
        load_export(out)
    load_export(out, require_complete=False)                  # the weights themselves still load


@pytest.mark.parametrize("rope", [
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
     "truncate": False, "original_max_position_embeddings": 64}])
def test_scaled_rope_export_automodel_equals_load_export(tmp_path, rope):
    """A drafter with the target's scaled RoPE (Llama-3.1 llama3, gpt-oss yarn with its attention factor): the
    export writes it under rope_parameters and rope_scaling, load_export and AutoModel(trust_remote_code) both
    compute it, with outputs identical to the trained drafter's."""
    tc = target_config_dict(rope_parameters=dict(rope))
    dcfg = DrafterModelConfig.from_target(tc, num_layers=LAYERS, num_feature_layers=len(LAYER_IDS),
                                          block_size=BLOCK, intermediate_size=48)
    assert dcfg.rope_parameters["rope_type"] == rope["rope_type"]
    torch.manual_seed(0)
    model = DFlashDrafter(dcfg, "sdpa").eval()
    ckpt, _ = make_checkpoint(tmp_path, model, target_config=tc)
    out = export_checkpoint(ckpt, unique_dir(tmp_path, f"rope_{rope['rope_type']}"), dtype="float32")
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert cfg["rope_parameters"]["rope_type"] == rope["rope_type"] == cfg["rope_scaling"]["rope_type"]
    assert not export_problems(cfg, out)
    back, _ = load_export(out)
    auto = auto_model(out)
    feats, embeds, cpos, bpos, mask = multi_block_inputs()
    with torch.no_grad():
        ref = model(embeds, feats, cpos, bpos, mask)
        assert torch.equal(back(embeds, feats, cpos, bpos, mask), ref)
        got = auto(position_ids=torch.cat([cpos, bpos], 1), noise_embedding=embeds, target_hidden=feats,
                   attention_mask=mask)
    assert torch.equal(got, ref)
    assert auto.attention_scaling == back.rope.attention_scaling


def _tree(path) -> dict:
    """{relative path: bytes} of every file under ``path``."""
    out = {}
    for root, _, files in os.walk(path):
        for n in files:
            p = os.path.join(root, n)
            out[os.path.relpath(p, path)] = open(p, "rb").read()
    return out


def test_export_never_replaces_a_run_or_a_checkpoint(tmp_path, capsys):
    """OUT that is, holds or lies inside the checkpoint or a run directory is refused with one line, exit 2,
    whatever --overwrite says; --overwrite replaces only an earlier export (its .dflash-export marker)."""
    ckpt, _ = make_checkpoint(tmp_path)
    run = os.path.dirname(os.path.dirname(ckpt))
    with open(os.path.join(run, "run.json"), "w") as f:
        json.dump({"identity": {}}, f)
    before = _tree(run)
    other = tmp_path / "other_run"
    (other / "checkpoints").mkdir(parents=True)
    claimed = tmp_path / "claimed"
    claimed.mkdir()
    (claimed / ".dflash-claim").write_text("{}")
    for out in (run, ckpt, os.path.join(ckpt, "sub"), os.path.dirname(ckpt), os.path.join(run, "exports", "e"),
                str(other), str(claimed / "e")):
        for extra in ([], ["--overwrite"]):
            capsys.readouterr()
            assert main([ckpt, out, "--no-tokenizer", *extra]) == 2, (out, extra)
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1 and err[0].startswith("dflash-export: "), err
    assert _tree(run) == before and os.path.isdir(other / "checkpoints") and (claimed / ".dflash-claim").exists()

    # a directory of someone else's files is never replaced; an earlier export is, and its marker says so
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    assert main([ckpt, str(mine), "--overwrite", "--no-tokenizer"]) == 2
    assert (mine / "notes.txt").read_text() == "keep"
    out = str(tmp_path / "exported")
    assert main([ckpt, out, "--no-tokenizer"]) == 0
    assert json.load(open(os.path.join(out, ".dflash-export")))["source_checkpoint"] == os.path.abspath(ckpt)
    assert main([ckpt, out, "--overwrite", "--no-tokenizer"]) == 0
    # an earlier export that a checkpoint was copied into since is not replaced either
    os.makedirs(os.path.join(out, "keep"))
    for name in ("meta.json", "model.safetensors"):
        with open(os.path.join(ckpt, name), "rb") as src, open(os.path.join(out, "keep", name), "wb") as dst:
            dst.write(src.read())
    assert main([ckpt, out, "--overwrite", "--no-tokenizer"]) == 2
    assert os.path.exists(os.path.join(out, "keep", "meta.json"))
