"""Domino head: settings, block-local and causal teacher forcing, the pure draft prefix, decoding against the
training forward, the chunked mixed loss, the curriculum, FLOPs, names, shapes and export fields."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from dflash_dist.config import ConfigError
from dflash_dist.model.variants.domino.head import (
    DominoHead,
    DominoSettings,
    domino_loss,
    domino_rows,
    expected_shapes,
    export_fields,
    flops_per_block_token,
    gru_scan,
    lambda_base,
    propose,
    teacher_tokens,
)

H, V, G, E, BS, N = 12, 40, 6, 10, 5, 3
SETTINGS = DominoSettings(emb_dim=E, gru_hidden_dim=G)


def make_head(seed=0, prefix=1):
    """Every weight random and of order 1, so a misplaced piece changes the logits far beyond fp32 rounding."""
    torch.manual_seed(seed)
    head = DominoHead(H, V, G, E, pure_draft_prefix_len=prefix)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0.0, 0.5)
    return head


def inputs(b=2, seed=1):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, N * BS, H, generator=g)
    tokens = torch.randint(0, V, (b, N * BS), generator=g)
    embed, w = torch.randn(V, H, generator=g), torch.randn(V, H, generator=g) * 0.5
    return hidden, tokens, embed, w


def corrected(head, hidden, tokens, embed, w):
    return head.corrected_logits(hidden @ w.t(), hidden, F.embedding(tokens, embed), BS)


def crossing_corrected(head, hidden, tokens, embed, w):
    """A broken head: one GRU sequence over the whole flattened row, so block 2 reads block 1's tokens."""
    x = F.embedding(tokens, embed)
    out, _ = head.prefix_gru(x)
    states = torch.cat([out.new_zeros(out.shape[0], 1, G), out[:, :-1]], 1)
    corr = head.embed_proj(torch.cat([hidden, states], -1))
    slot = torch.arange(hidden.shape[1]) % BS
    return hidden @ w.t() + corr * (slot >= head.suffix_start).float()[:, None]


def test_settings_refuse_what_the_engines_cannot_serve():
    assert SETTINGS.suffix_start == 2
    with pytest.raises(ConfigError, match="drafter.domino.pure_draft_prefix_len"):
        DominoSettings(pure_draft_prefix_len=0)
    with pytest.raises(ConfigError, match="drafter.domino.shift_label"):
        DominoSettings(shift_label=True)
    with pytest.raises(ConfigError, match="drafter.domino.gru_hidden_dim"):
        DominoSettings(gru_hidden_dim=0)
    with pytest.raises(ConfigError, match="drafter.domino.lambda_base_start"):
        DominoSettings(lambda_base_start=1.5)
    with pytest.raises(ConfigError, match="drafter.domino.lambda_base_decay_ratio"):
        DominoSettings(lambda_base_decay_ratio=-0.1)
    with pytest.raises(ConfigError, match="drafter.block_size=2"):
        SETTINGS.check_model(2)
    SETTINGS.check_model(3)


def block_locality_gap(fn, head):
    """Largest change of blocks 2..N's logits when block 1's tokens and hidden states change."""
    hidden, tokens, embed, w = inputs()
    out = fn(head, hidden, tokens, embed, w)
    hidden2, tokens2 = hidden.clone(), tokens.clone()
    hidden2[:, :BS] += 1.0
    tokens2[:, :BS] = (tokens2[:, :BS] + 7) % V
    out2 = fn(head, hidden2, tokens2, embed, w)
    assert (out2[:, :BS] - out[:, :BS]).abs().max() > 1e-2          # block 1 itself does change
    return (out2[:, BS:] - out[:, BS:]).abs().max()


def test_the_training_recurrence_is_nn_grus_in_values_and_gradients():
    """``gru_scan`` (what training runs) against the module the engines run, float64, forward and backward."""
    torch.manual_seed(3)
    gru = torch.nn.GRU(H, G, bias=False, batch_first=True).double()
    with torch.no_grad():
        for p in gru.parameters():
            p.normal_(0.0, 0.5)
    x = torch.randn(4, BS - 1, H, dtype=torch.float64, requires_grad=True)
    ref, _ = gru(x)
    out = gru_scan(x, gru.weight_ih_l0, gru.weight_hh_l0)
    assert torch.allclose(out, ref, rtol=0, atol=1e-12)
    w = torch.randn_like(ref)
    want = torch.autograd.grad((ref * w).sum(), [x, *gru.parameters()])
    got = torch.autograd.grad((out * w).sum(), [x, *gru.parameters()])
    for a, b in zip(got, want):
        assert torch.allclose(a, b, rtol=0, atol=1e-12)


def test_the_gru_never_crosses_a_block():
    head = make_head()
    assert block_locality_gap(corrected, head) == 0
    assert block_locality_gap(crossing_corrected, head) > 1e-2      # the check sees a GRU that crosses


def test_slot_k_reads_the_blocks_tokens_before_k_only():
    """Changing token t_j of a block changes slots k > j (from the corrected slots on), never slots <= j: the
    GRU input of slot k is t_0..t_{k-1} (the anchor, then the gold tokens, teacher forced)."""
    head = make_head()
    hidden, tokens, embed, w = inputs()
    out = corrected(head, hidden, tokens, embed, w)
    for j in range(BS):
        t2 = tokens.clone()
        t2[:, BS + j] = (t2[:, BS + j] + 3) % V                  # block 2's slot j
        d = (corrected(head, hidden, t2, embed, w) - out).abs().amax((0, 2))[BS:2 * BS]
        for k in range(BS):
            assert (d[k] > 1e-3) == (k > j and k >= head.suffix_start), (j, k, d)


@pytest.mark.parametrize("prefix", [0, 1])
def test_the_pure_draft_prefix_keeps_the_base_logits(prefix):
    head = make_head(prefix=prefix)
    hidden, tokens, embed, w = inputs()
    out, base = corrected(head, hidden, tokens, embed, w), hidden @ w.t()
    slot = torch.arange(N * BS) % BS
    keep = slot < 1 + prefix
    assert torch.equal(out[:, keep], base[:, keep])
    assert (out[:, ~keep] - base[:, ~keep]).abs().amax(-1).min() > 1e-3


def test_propose_equals_the_training_forward_on_its_own_tokens():
    """Decoding feeds its own proposals to the GRU one by one; teacher forcing on those same tokens gives the
    same logits at every slot, and each proposal is its slot's argmax."""
    head = make_head(seed=2)
    hidden, _, embed, w = inputs(b=4, seed=3)
    hidden = hidden[:, :BS]
    anchor = torch.tensor([1, 5, 9, 33])
    tokens, logits = propose(head, hidden, anchor, w, embed)
    assert tokens.shape == (4, BS - 1)
    row = torch.cat([anchor[:, None], tokens], 1)
    ref = head.corrected_logits(hidden @ w.t(), hidden, F.embedding(row, embed), BS)[:, 1:]
    torch.testing.assert_close(logits, ref, rtol=0, atol=1e-5)
    assert torch.equal(tokens, ref.argmax(-1))
    assert not torch.equal(tokens, (hidden[:, 1:] @ w.t()).argmax(-1))   # the correction changes proposals


def test_teacher_tokens_are_the_sequence_whatever_the_loss_mask():
    ids = torch.arange(100, 120)[None]
    got = teacher_tokens(ids, torch.tensor([[2, 17]]), 4)
    assert got.tolist() == [[102, 103, 104, 105, 117, 118, 119, 119]]


def dense_loss(head, hidden, tokens, embed, w, labels, weights, lam):
    logits = corrected(head, hidden, tokens, embed, w).float()
    base = (hidden @ w.t()).float()
    y = labels.clamp_min(0)
    wt = weights * (labels >= 0)
    ce = lambda z: F.cross_entropy(z.flatten(0, 1), y.flatten(), reduction="none").view_as(y)  # noqa: E731
    return ((1 - lam) * ce(logits) * wt + lam * ce(base) * wt).sum()


@pytest.mark.parametrize("chunk", [1, 4, 1000])
def test_chunked_loss_equals_the_dense_loss_and_its_gradients(chunk):
    head = make_head(seed=4)
    hidden, tokens, embed, w = inputs(seed=5)
    slot = torch.arange(N * BS) % BS
    g = torch.Generator().manual_seed(6)
    weights = torch.rand(2, N * BS, generator=g) * (slot > 0)
    labels = torch.where((slot > 0) & (torch.rand(2, N * BS, generator=g) > 0.2), tokens, -100)
    lam = 0.3
    h1 = hidden.clone().requires_grad_()
    feats = head.features(h1, F.embedding(tokens, embed), BS)
    rh, re, rc, ry, rw = domino_rows(h1, feats, labels, weights, BS, head.suffix_start)
    parts = domino_loss(rh, re, rc, w, head.embed_proj[2].weight, ry, rw, lam, chunk)
    parts.loss_sum.backward()
    ours = [h1.grad] + [p.grad for p in head.parameters()]
    head.zero_grad()
    h2 = hidden.clone().requires_grad_()
    ref = dense_loss(head, h2, tokens, embed, w, labels, weights, lam)
    ref.backward()
    torch.testing.assert_close(parts.loss_sum, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(parts.weight_sum, (weights * (labels >= 0)).sum())
    for a, b in zip(ours, [h2.grad] + [p.grad for p in head.parameters()]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        pred = corrected(head, hidden, tokens, embed, w).unflatten(1, (N, BS))[:, :, 1:].argmax(-1).flatten()
    assert torch.equal(parts.final_correct, (pred == ry) & (ry >= 0))


def test_lambda_decays_linearly_then_stays_zero():
    s = DominoSettings(lambda_base_start=0.8, lambda_base_decay_ratio=0.5)
    assert [lambda_base(t, 100, s) for t in (0, 25, 50, 90)] == [0.8, pytest.approx(0.4), 0.0, 0.0]
    with pytest.raises(ConfigError, match="the run.s step count"):
        lambda_base(0, 0, s)


def test_flops_equal_a_counted_forward():
    """The head's training forward over one block (features, then the mixed loss), as torch's FLOP counter sees
    it, less the lm_head's base logits (counted with the drafter): B x the per-slot count."""
    head = make_head()
    hidden, tokens, embed, w = inputs(b=1)
    hidden, tokens = hidden[:, :BS], tokens[:, :BS]
    labels = torch.where(torch.arange(BS) > 0, tokens, -100)
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        feats = head.features(hidden, F.embedding(tokens, embed), BS)
        rows = domino_rows(hidden, feats, labels, torch.ones(1, BS), BS, head.suffix_start)
        domino_loss(*rows[:3], w, head.embed_proj[2].weight, *rows[3:], 0.5, 2)
    base = 2 * (BS - 1) * H * V
    assert fc.get_total_flops() - base == pytest.approx(BS * sum(flops_per_block_token(H, V, BS, SETTINGS).values()))


def test_names_shapes_and_export_fields():
    head = make_head()
    assert {k: tuple(v.shape) for k, v in head.state_dict().items()} == expected_shapes(H, V, SETTINGS)
    assert export_fields(SETTINGS) == {
        "architectures": ["DominoDraftModel"], "emb_dim": E,
        "dflash_config": {"projector_type": "domino", "emb_dim": E, "gru_hidden_dim": G,
                          "pure_draft_prefix_len": 1, "shift_label": False}}
