"""Domino against independent implementations: SpecForge 0.2.0's ``specforge/modeling/draft/domino.py`` (the
head, its block decoding), its training objective and curriculum; SGLang 0.5.23's serving rollout
(``sglang/srt/speculative/domino_utils.py``).

Both packages are installed once, ``--no-deps``, into the shared side directory (``ref_packages``). SpecForge's
full draft model would build a DFlash backbone; only the head is built here (``_init_draft_head`` on a bare
module), and the project's state dict loads into it strictly, so every tensor name and shape must be the
engines'. Of SGLang only the rollout file is loaded (it imports torch alone; the package needs CUDA kernels).
"""

import importlib.util
import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from helpers.ref_packages import install
from test_domino import BS, E, G, H, N, V, crossing_corrected, inputs, make_head
from torch import nn

from dflash_dist.model.variants.domino.head import DominoSettings, domino_loss, domino_rows, expected_shapes, lambda_base, propose

TOL = dict(rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def sf():
    """SpecForge's Domino model module, its training wrapper and its strategy module."""
    install("specforge-0.2.0", ["specforge==0.2.0"])
    import specforge.algorithms.common.dflash_family_model as family
    import specforge.modeling.draft.domino as domino
    import specforge.training.strategies.base as strategies
    return SimpleNamespace(domino=domino, family=family, strategies=strategies)


@pytest.fixture(scope="module")
def sglang_rollout():
    """SGLang's ``domino_greedy_rollout``, from its module file alone."""
    root = install("sglang-0.5.23", ["sglang==0.5.23"])
    path = os.path.join(root, "sglang", "srt", "speculative", "domino_utils.py")
    spec = importlib.util.spec_from_file_location("sglang_domino_utils", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.domino_greedy_rollout


def theirs_head(sf, ours, prefix=1):
    model = sf.domino.DominoDraftModel.__new__(sf.domino.DominoDraftModel)
    nn.Module.__init__(model)
    cfg = SimpleNamespace(hidden_size=H, vocab_size=V)
    model._init_draft_head(cfg, {"emb_dim": E, "gru_hidden_dim": G, "pure_draft_prefix_len": prefix,
                                 "shift_label": False})
    model.load_state_dict(ours.state_dict(), strict=True)
    return model


def theirs_logits(model, hidden, tokens, embed, w):
    b = hidden.shape[0]
    out = model.apply_logits_head((hidden @ w.t()).view(b, N, BS, V), hidden_states=hidden.view(b, N, BS, H),
                                  prev_token_embeddings=F.embedding(tokens, embed).view(b, N, BS, H))
    return out.reshape(b, N * BS, V)


def test_names_and_shapes_are_specforges(sf):
    model = theirs_head(sf, make_head())
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == \
        expected_shapes(H, V, DominoSettings(emb_dim=E, gru_hidden_dim=G))


@pytest.mark.parametrize("prefix", [0, 1])
def test_corrected_logits_parity_on_the_training_layout(sf, prefix):
    ours = make_head(seed=prefix, prefix=prefix)
    model = theirs_head(sf, ours, prefix)
    hidden, tokens, embed, w = inputs(b=3, seed=10 + prefix)
    mine = ours.corrected_logits(hidden @ w.t(), hidden, F.embedding(tokens, embed), BS)
    torch.testing.assert_close(mine, theirs_logits(model, hidden, tokens, embed, w), **TOL)


def test_a_gru_across_blocks_fails_the_parity(sf):
    ours = make_head(seed=3)
    hidden, tokens, embed, w = inputs(seed=4)
    ref = theirs_logits(theirs_head(sf, ours), hidden, tokens, embed, w)
    assert (crossing_corrected(ours, hidden, tokens, embed, w) - ref)[:, BS:].abs().max() > 1e-2


def test_one_decode_block_parity(sf):
    """SpecForge's sequential block sampling (greedy), its target's lm_head and embedding the same as ours:
    the same proposals, and each slot's logits those of its head on the proposed prefix."""
    ours = make_head(seed=5)
    model = theirs_head(sf, ours)
    hidden, _, embed, w = inputs(b=6, seed=6)
    hidden = hidden[:, :BS]
    anchor = torch.tensor([0, 3, 8, 21, 22, 39])
    target = nn.Module()
    target.lm_head = nn.Linear(H, V, bias=False)
    target.model = nn.Module()
    target.model.embed_tokens = nn.Embedding(V, H)
    with torch.no_grad():
        target.lm_head.weight.copy_(w)
        target.model.embed_tokens.weight.copy_(embed)
    block = torch.cat([anchor[:, None], torch.full((6, BS - 1), V - 1)], 1)   # anchor, then mask ids
    with torch.no_grad():
        ref_tokens = model._sample_draft_tokens(target, hidden, block)
        tokens, logits = propose(ours, hidden, anchor, w, embed)
        done = torch.cat([anchor[:, None], ref_tokens], 1)
        ref_logits = model.apply_logits_head(target.lm_head(hidden)[:, None], hidden_states=hidden[:, None],
                                             prev_token_embeddings=target.model.embed_tokens(done)[:, None])
    assert torch.equal(tokens, ref_tokens)
    assert not torch.equal(tokens, (hidden[:, 1:] @ w.t()).argmax(-1))      # the correction decides some
    torch.testing.assert_close(logits, ref_logits[:, 0, 1:], **TOL)


def test_one_decode_block_equals_sglangs_rollout(sglang_rollout):
    """SGLang's serving chain (``shift_label: false``, scoring the full vocabulary) proposes our tokens."""
    ours = make_head(seed=11)
    hidden, _, embed, w = inputs(b=6, seed=12)
    hidden = hidden[:, :BS]
    anchor = torch.tensor([2, 4, 6, 11, 30, 38])
    embedding = nn.Embedding(V, H)
    with torch.no_grad():
        embedding.weight.copy_(embed)
        tokens, _ = propose(ours, hidden, anchor, w, embed)
        ref = sglang_rollout(draft_hidden=hidden, bonus_tokens=anchor, target_embedding=embedding, lm_head_weight=w,
                             prefix_gru=ours.prefix_gru, embed_proj=ours.embed_proj, vocab_size=V, shift_label=False,
                             candidate_pool_size=0, in_cuda_graph=False)
    assert not torch.equal(tokens, (hidden[:, 1:] @ w.t()).argmax(-1))      # the correction decides some
    assert torch.equal(tokens, ref)


def test_mixed_loss_parity(sf):
    """SpecForge's per-chunk objective terms (corrected and base CE sums, weight sum), fed the same weights
    (loss-mask holes included: the GRU still reads those tokens), equal ours; the mixed loss and its gradients
    into the backbone's hidden states and every head weight agree."""
    ours = make_head(seed=7)
    model = theirs_head(sf, ours)
    hidden, tokens, embed, w = inputs(b=2, seed=8)
    slot = torch.arange(N * BS) % BS
    g = torch.Generator().manual_seed(9)
    weights = torch.rand(2, N * BS, generator=g) * (slot > 0) * (torch.rand(2, N * BS, generator=g) > 0.25)
    labels = torch.where(weights > 0, tokens, -100)
    lam = 0.35

    wrapper = sf.family.OnlineDominoModel.__new__(sf.family.OnlineDominoModel)
    nn.Module.__init__(wrapper)
    wrapper.draft_model, wrapper.shift_label = model, False
    wrapper.lm_head = nn.Linear(H, V, bias=False)
    wrapper.embed_tokens = nn.Embedding(V, H)
    with torch.no_grad():
        wrapper.lm_head.weight.copy_(w)
        wrapper.embed_tokens.weight.copy_(embed)
    h_ref = hidden.clone().requires_grad_()
    tgt, wm = tokens.view(2, N, BS), weights.view(2, N, BS)
    fin, base, den, *_ = wrapper._domino_objective_chunk_terms(h_ref.view(2, N, BS, H), tgt, tgt, wm, wm)
    ((1 - lam) * fin / den + lam * base / den).backward()

    h = hidden.clone().requires_grad_()
    feats = ours.features(h, F.embedding(tokens, embed), BS)
    rh, re, rc, ry, rw = domino_rows(h, feats, labels, weights, BS, ours.suffix_start)
    parts = domino_loss(rh, re, rc, w, ours.embed_proj[2].weight, ry, rw, lam, chunk_rows=4)
    (parts.loss_sum / parts.weight_sum).backward()

    torch.testing.assert_close(parts.final_ce_sum, fin.detach(), **TOL)
    torch.testing.assert_close(parts.base_ce_sum, base.detach(), **TOL)
    torch.testing.assert_close(parts.weight_sum, den, **TOL)
    torch.testing.assert_close(h.grad, h_ref.grad, **TOL)
    theirs = dict(model.named_parameters())
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, theirs[name].grad, **TOL)


@pytest.mark.parametrize("start,ratio", [(1.0, 0.5), (0.6, 0.25), (1.0, 1.0), (0.9, 0.0)])
def test_curriculum_parity(sf, start, ratio):
    s = DominoSettings(lambda_base_start=start, lambda_base_decay_ratio=ratio)
    for total in (1, 7, 100, 1000):
        for step in sorted({0, 1, 3, total // 4, total // 2, total - 1, total}):
            assert lambda_base(step, total, s) == sf.strategies.linear_lambda_base(step, total, start, ratio)
