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
from ref_packages import install
from test_dflash2 import BS, HEADS, INTER, KV, D, H, V, cfg, layer_inputs, randomize

from dflash_dist.model.dflash2 import DFlash2DecoderLayer, DFlash2Settings, GroupedDynamicConv
from dflash_dist.model.dflash2_selector import (
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
