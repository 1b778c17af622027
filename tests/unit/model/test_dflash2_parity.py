"""DFlash2 against an independent implementation: speculators 0.9.0's model modules (``speculators/models/dflash2``).

The package is installed once, ``--no-deps``, into a side directory under the user's cache
(``$DFLASH_TEST_REFS``, else ``$XDG_CACHE_HOME`` or ``~/.cache``, then ``dflash_dist_test_refs/``) with what its
``__init__`` imports; only its model modules are used. Both sides run on the same weights: the project's state
dicts load into speculators' modules strictly, so every tensor name must be the engines'. Speculators has no
output multiplier or soft cap: its selector gets the already transformed logits.
"""

import pytest
import torch
import torch.nn.functional as F
from helpers.ref_packages import install
from test_dflash2 import BS, HEADS, INTER, KV, D, H, V, cfg, layer_inputs, randomize

from dflash_dist.model.variants.dflash2.layers import DFlash2DecoderLayer, DFlash2Settings, GroupedDynamicConv
from dflash_dist.model.variants.dflash2.selector import (
    CandidateSelector,
    greedy_walk,
    lattice,
    propose,
    selector_loss,
    topk_candidates,
    transform_logits,
    unary_topk,
)

PACKAGES = ["speculators==0.9.0", "hs-connectors", "openai", "jiter", "loguru"]
TOL = dict(rtol=0, atol=1e-5)
MULT, CAP = 0.7, 3.0


@pytest.fixture(scope="module")
def spec():
    """speculators.models.dflash2.model_definitions, installed on first use and reused."""
    install("speculators-0.9.0", PACKAGES)
    from speculators.models.dflash2 import model_definitions
    return model_definitions


def spec_config():
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Config
    c = Qwen3Config(hidden_size=H, num_attention_heads=HEADS, num_key_value_heads=KV, head_dim=D,
                    intermediate_size=INTER, rms_norm_eps=1e-6, attention_bias=False, vocab_size=V)
    c._attn_implementation = "eager"
    return c


@pytest.mark.parametrize("kernel", [2, 3])
def test_conv_parity(spec, kernel):
    ours = randomize(GroupedDynamicConv(H, kernel, 8), seed=kernel)
    theirs = spec.GroupedDynamicCausalConv(H, block_size=BS, kernel_size=kernel, group_size=8)
    theirs.load_state_dict(ours.state_dict(), strict=True)
    x, y = torch.randn(3, 5 * BS, H), torch.randn(3, 5 * BS, H)
    out, d = ours.prepare(x, BS)
    ref, ref_d = theirs.prepare(x)
    torch.testing.assert_close(out, ref, **TOL)
    torch.testing.assert_close(d, ref_d, **TOL)
    torch.testing.assert_close(ours.finish(y, d, BS), theirs.finish(y, ref_d), **TOL)


def test_layer_parity_on_the_training_layout(spec):
    """One DFlash2 layer over blocks at several anchors: attention over [context | own block], both convs."""
    ours = randomize(DFlash2DecoderLayer(cfg(), DFlash2Settings(conv_kernel_size=2, conv_group_size=8)), seed=7,
                     scale=0.1)  # outputs of order 1: fp32 rounding far below the tolerance
    theirs = spec.Qwen3DFlash2DecoderLayer(spec_config(), 0, block_size=BS, conv_kernel_size=2, conv_group_size=8)
    theirs.load_state_dict(ours.state_dict(), strict=True)
    inp = layer_inputs()
    allowed, _ = inp["mask"]
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    ref = theirs(target_hidden=inp["ctx"], hidden_states=inp["h"], attention_mask=additive,
                 position_embeddings=inp["rope_k"])   # its queries take the last Q rows of the keys' cos/sin
    torch.testing.assert_close(ours(**inp), ref, **TOL)


def selectors(spec, seed=0):
    ours = randomize(CandidateSelector(H, V, 6), seed=seed, scale=1.0)
    theirs = spec.CandidateSelector(vocab_size=V, hidden_size=H, rank=6, top_k=5)
    theirs.load_state_dict(ours.state_dict(), strict=True)
    return ours, theirs


def test_selector_scores_parity(spec):
    ours, theirs = selectors(spec)
    g = torch.Generator().manual_seed(3)
    h, logits = torch.randn(2, 7, H, generator=g), torch.randn(2, 7, V, generator=g) * 4
    pred = torch.randint(0, V, (2, 7), generator=g)
    unary, ids = unary_topk(logits, 5, MULT, CAP)
    ref_ids, ref = theirs.select(transform_logits(logits, MULT, CAP), h, pred)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(ours.scores(h, pred, ids, unary), ref, **TOL)


def test_lattice_and_greedy_walk_parity(spec):
    """The lattice assembled from speculators' edge scores (row 0 from the anchor, row j from slot j-1's
    candidates), walked greedily in plain Python, ties to the lowest index: the same tokens as ``propose``."""
    ours, theirs = selectors(spec, seed=1)
    g = torch.Generator().manual_seed(4)
    hidden, anchor, w = torch.randn(3, BS, H, generator=g), torch.randint(0, V, (3,), generator=g), torch.randn(V, H)
    tokens, cand, _ = propose(ours, hidden, anchor, w, 5, MULT, CAP)
    full = transform_logits(hidden[:, 1:] @ w.t(), MULT, CAP)
    unary, ids = unary_topk(hidden[:, 1:] @ w.t(), 5, MULT, CAP)
    ref = torch.stack([torch.stack([theirs.score_candidates(full[:, j], hidden[:, 1 + j],
                                                            anchor if j == 0 else ids[:, j - 1, p], ids[:, j])
                                    for p in range(5)], 1) for j in range(BS - 1)], 1)
    torch.testing.assert_close(lattice(ours, hidden[:, 1:], anchor, ids, unary), ref, **TOL)
    assert torch.equal(cand, ids)
    for n in range(3):
        p, path = 0, []
        for j in range(BS - 1):
            row = ref[n, j, p].tolist()
            p = row.index(max(row))
            path.append(p)
        assert greedy_walk(ref)[n].tolist() == path
        assert tokens[n].tolist() == [int(ids[n, j, p]) for j, p in enumerate(path)]


def test_replace_last_loss_parity(spec):
    """Speculators' training candidates (the gold token replaces the weakest candidate when missing) scored by its
    selector, K-way CE, weighted: the same sum as ``selector_loss(..., "replace_last")``."""
    from speculators.models.dflash2.metrics import selector_training_candidates
    ours, theirs = selectors(spec, seed=2)
    g = torch.Generator().manual_seed(5)
    h, w = torch.randn(40, H, generator=g), torch.randn(V, H, generator=g)
    pred, weights = torch.randint(0, V, (40,), generator=g), torch.rand(40, generator=g)
    cand = topk_candidates(h, w, 5)
    rank = torch.randint(0, 5, (40, 1), generator=g)
    gold = torch.where(torch.arange(40) < 20, cand.gather(1, rank)[:, 0], torch.randint(0, V, (40,), generator=g))
    assert 20 <= int((cand == gold[:, None]).any(-1).sum()) < 40        # gold inside and outside the top-K
    parts = selector_loss(ours, h, w, pred, cand, gold, weights, "replace_last", MULT, CAP)
    ids, target, _ = selector_training_candidates(cand, gold)
    s = theirs.score_candidates(transform_logits(h @ w.t(), MULT, CAP), h, pred, ids)
    ref = (F.cross_entropy(s, target, reduction="none") * weights).sum()
    torch.testing.assert_close(parts.loss_sum, ref, **TOL)


def test_a_swapped_or_renamed_codebook_is_caught(spec):
    """The checks above would see either mistake: swapped codebooks change the scores far beyond the tolerance,
    and a codebook saved as ``...codebook.weight`` does not load strictly (SGLang would skip it silently)."""
    ours, theirs = selectors(spec, seed=3)
    sd = ours.state_dict()
    swapped = dict(sd, predecessor_codebook=sd["successor_codebook"], successor_codebook=sd["predecessor_codebook"])
    theirs.load_state_dict(swapped, strict=True)
    h, pred, ids = torch.randn(6, H), torch.randint(0, V, (6,)), torch.randint(0, V, (6, 5))
    unary = torch.randn(6, 5)
    full = torch.zeros(6, V).scatter(1, ids, unary)
    gap = (ours.scores(h, pred, ids, unary) - theirs.score_candidates(full, h, pred, ids)).abs().max()
    assert gap > 1e-2
    renamed = {k.replace("successor_codebook", "successor_codebook.weight"): v for k, v in sd.items()}
    with pytest.raises(RuntimeError, match="successor_codebook"):
        theirs.load_state_dict(renamed, strict=True)


# --- the export: speculators' drafter from the exported config.json fields and model.safetensors ---------------

def spec_drafter(spec, export_dir):
    """Speculators' DFlash2 modules (decoder layers, selector; transformers' Qwen3 norms and RoPE) sized from
    nothing but the export's config.json, with its model.safetensors loaded strictly: every tensor name and
    shape must be what they load (speculators' own drafter also holds embed_tokens and lm_head: the target's)."""
    import json
    import os

    from safetensors.torch import load_file
    from torch import nn
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Config, Qwen3RMSNorm, Qwen3RotaryEmbedding
    with open(os.path.join(export_dir, "config.json")) as f:
        cfg = json.load(f)
    dfc = cfg["dflash_config"]
    fields = {k: cfg[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                                  "intermediate_size", "rms_norm_eps", "vocab_size", "rope_parameters")}
    qc = Qwen3Config(**fields, attention_bias=False)
    qc._attn_implementation = "eager"
    h, n_feat = cfg["hidden_size"], len(dfc["target_layer_ids"])
    m = nn.Module()
    m.fc = nn.Linear(n_feat * h, h, bias=False)
    m.hidden_norm, m.norm = Qwen3RMSNorm(h, qc.rms_norm_eps), Qwen3RMSNorm(h, qc.rms_norm_eps)
    m.layers = nn.ModuleList(
        spec.Qwen3DFlash2DecoderLayer(qc, i, block_size=dfc["block_size"], conv_kernel_size=dfc["conv_kernel_size"],
                                      conv_group_size=dfc["conv_group_size"])
        for i in range(cfg["num_hidden_layers"]))
    m.candidate_selector = spec.CandidateSelector(vocab_size=cfg["vocab_size"], hidden_size=h,
                                                  rank=dfc["selector_rank"], top_k=dfc["selector_top_k"])
    m.load_state_dict(load_file(os.path.join(export_dir, "model.safetensors")), strict=True)
    m.rotary, m.cfg = Qwen3RotaryEmbedding(qc), cfg
    return m.eval()


def spec_block(m, feats, embeds, positions):
    """Speculators' final hidden states of one block per row: every query sees the whole context and block."""
    ctx = m.hidden_norm(m.fc(feats))
    rope = m.rotary(feats, positions.expand(feats.shape[0], -1))
    mask = torch.zeros(feats.shape[0], 1, embeds.shape[1], positions.shape[1])
    h = embeds
    for layer in m.layers:
        h = layer(target_hidden=ctx, hidden_states=h, attention_mask=mask, position_embeddings=rope)
    return m.norm(h)


def spec_walk(m, hidden, anchors, head):
    """Speculators' unary logits (multiplier, then soft cap, applied here: it has neither), candidates, the
    lattice from its edge scores and the greedy walk over it in plain Python (ties to the lowest index)."""
    dfc = m.cfg["dflash_config"]
    unary = transform_logits(hidden[:, 1:] @ head.t(), dfc["output_multiplier"], dfc["final_logit_softcapping"])
    ids = unary.topk(dfc["selector_top_k"], dim=-1).indices
    k, sel = ids.shape[-1], m.candidate_selector
    lat = torch.stack([torch.stack([sel.score_candidates(unary[:, j], hidden[:, 1 + j],
                                                         anchors if j == 0 else ids[:, j - 1, p], ids[:, j])
                                    for p in range(k)], 1) for j in range(ids.shape[1])], 1)
    tokens = []
    for n in range(hidden.shape[0]):
        p, row_tokens = 0, []
        for j in range(ids.shape[1]):
            row = lat[n, j, p].tolist()
            p = row.index(max(row))
            row_tokens.append(int(ids[n, j, p]))
        tokens.append(row_tokens)
    return unary, ids, lat, torch.tensor(tokens)


def export_gap(spec, export_dir, served, seed=1):
    """(max |d| of the unary logits, max |d| of the lattice scores, greedy tokens equal) between speculators on
    the export's files and ``served``: the project's DFlash2 drafter with the weights it was exported from."""
    from dflash_dist.model.variants.dflash2.selector import lattice as our_lattice
    from tests.unit.export.test_export_dflash2 import LAYER_IDS
    m = spec_drafter(spec, export_dir)
    g = torch.Generator().manual_seed(seed)
    ctx, block, hsz = 11, m.cfg["block_size"], m.cfg["hidden_size"]
    feats = torch.randn(3, ctx, len(LAYER_IDS) * hsz, generator=g)
    embeds = torch.randn(3, block, hsz, generator=g)
    positions = torch.arange(ctx + block)[None]
    head = torch.randn(m.cfg["vocab_size"], hsz, generator=g)
    anchors = torch.randint(0, m.cfg["vocab_size"], (3,), generator=g)
    with torch.no_grad():
        ref_hidden = spec_block(m, feats, embeds, positions)
        ref_unary, ref_ids, ref_lat, ref_tokens = spec_walk(m, ref_hidden, anchors, head)
        hidden = served(position_ids=positions, noise_embedding=embeds, target_hidden=feats)
        unary = served.compute_logits(hidden[:, 1:], head)
        tokens, cand, _ = served.propose(hidden[:, 1:], anchors, head, 0.0)   # the mask slots, as z-lab passes
        lat = our_lattice(served.candidate_selector, hidden[:, 1:], anchors, cand, unary.gather(-1, cand))
    same_choice = torch.equal(cand, ref_ids) and torch.equal(tokens, ref_tokens)
    return float((unary - ref_unary).abs().max()), float((lat - ref_lat).abs().max()), same_choice


def served_model(cfg, tensors):
    """The project's DFlash2 drafter as served (the exported modeling_dflash.DFlash2DraftModel, which
    tests/unit/export/test_export_dflash2.py checks against the variant's layers.py) holding ``tensors`` in
    memory, not read back from the export: a naming mistake in the file shows as a gap."""
    from transformers import Qwen3Config

    from tests.unit.export.test_export_dflash2 import modeling_module
    model = modeling_module().DFlash2DraftModel(Qwen3Config(**cfg))
    model.load_state_dict(tensors, strict=True)
    return model.eval()


def test_export_parity_with_speculators(spec, tmp_path):
    """Speculators' drafter built from the exported config.json and loaded strictly from the exported
    model.safetensors: the same unary logits (fp32, max |d| <= 1e-5), selector scores and greedy choices as the
    project's drafter on the same hidden states and block inputs."""
    from tests.unit.export.test_export_dflash2 import dflash2_config, random_tensors, write_export
    cfg, tensors = dflash2_config(), random_tensors(seed=5, scale=0.1)
    out = write_export(tmp_path / "export", cfg, tensors)
    unary_gap, score_gap, same = export_gap(spec, out, served_model(cfg, tensors))
    assert unary_gap <= 1e-5 and score_gap <= 1e-5 and same, (unary_gap, score_gap, same)


def test_export_parity_fails_on_a_renamed_or_swapped_codebook(spec, tmp_path):
    """The parity check sees both mistakes: a codebook saved as ``...codebook.weight`` does not load strictly
    (SGLang would skip it silently), and a file with the predecessor and successor codebooks swapped scores
    differently from the drafter it was exported from."""
    from tests.unit.export.test_export_dflash2 import dflash2_config, random_tensors, write_export
    cfg, tensors = dflash2_config(), random_tensors(seed=5, scale=0.1)
    a, b = "candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook"
    renamed = {(k + ".weight" if k == b else k): v for k, v in tensors.items()}
    with pytest.raises(RuntimeError, match="successor_codebook"):
        spec_drafter(spec, write_export(tmp_path / "renamed", cfg, renamed))
    swapped = dict(tensors, **{a: tensors[b], b: tensors[a]})
    _, score_gap, _ = export_gap(spec, write_export(tmp_path / "swapped", cfg, swapped), served_model(cfg, tensors))
    assert score_gap > 1e-2
