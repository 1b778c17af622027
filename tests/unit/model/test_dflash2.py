"""DFlash2 layers and selector: the contract's hand vectors, block-local causality, init, names and shapes, the
decoding walk, the selector loss, FLOPs and the export fields."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dflash_dist.config import ConfigError
from dflash_dist.model.variants.dflash2.layers import (
    DFlash2DecoderLayer,
    DFlash2Settings,
    GroupedDynamicConv,
    conv_flops_per_row,
    expected_shapes,
    export_fields,
    reset_dflash2_parameters,
    selector_flops_per_row,
)
from dflash_dist.model.variants.dflash2.selector import (
    CandidateSelector,
    accepted_lengths,
    block_gold,
    candidate_logits,
    greedy_walk,
    lattice,
    propose,
    selector_loss,
    selector_rows,
    teacher_forced_predecessors,
    topk_candidates,
    unary_topk,
    walk,
)
from dflash_dist.model.drafter import DFlashDecoderLayer, DrafterModelConfig, RMSNorm, rotary_cos_sin
from dflash_dist.model.masks import dense_mask

H, HEADS, KV, D, INTER, BS, V = 32, 4, 2, 8, 48, 4, 50
SETTINGS = DFlash2Settings(conv_kernel_size=2, conv_group_size=8, selector_rank=6, selector_top_k=5)


def cfg(layers=1):
    return DrafterModelConfig(hidden_size=H, num_attention_heads=HEADS, num_key_value_heads=KV, head_dim=D,
                              intermediate_size=INTER, num_layers=layers, num_feature_layers=3, rms_norm_eps=1e-6,
                              rope_theta=10000.0, block_size=BS, vocab_size=V, max_position_embeddings=256)


def randomize(module, seed=0, scale=0.3):
    """Every parameter random (norms around 1), so a skipped or misplaced piece changes the output."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * scale + (1.0 if name.endswith("norm.weight") else 0.0))
    return module


def layer_inputs(b=2, ctx_len=12, anchors=((1, 4, 9), (0, 6, 7)), seed=1):
    """Training-layout inputs of one layer: h [b, Q, H], ctx [b, S, H], rope, the sdpa backend's mask."""
    g = torch.Generator().manual_seed(seed)
    anchors = torch.tensor(anchors)
    valid = torch.ones_like(anchors, dtype=torch.bool)
    q = anchors.shape[1] * BS
    block_pos = (anchors[:, :, None] + torch.arange(BS)).reshape(b, q)
    ctx_pos = torch.arange(ctx_len).expand(b, ctx_len)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, D, 2).float() / D))
    rope_q = rotary_cos_sin(block_pos, inv_freq, torch.float32)
    rope_c = rotary_cos_sin(ctx_pos, inv_freq, torch.float32)
    rope_k = (torch.cat([rope_c[0], rope_q[0]], 1), torch.cat([rope_c[1], rope_q[1]], 1))
    mask = dense_mask(anchors, valid, ctx_len, BS)
    sdpa_mask = (mask[:, None], mask.any(-1)[:, None, :, None])
    return dict(h=torch.randn(b, q, H, generator=g), ctx=torch.randn(b, ctx_len, H, generator=g), rope_q=rope_q,
                rope_k=rope_k, mask=sdpa_mask, backend="sdpa")


def reference_conv(x, base, delta, block_size):
    """The contract's formula, one position at a time: out[t] = sum_tap coef[t, tap] * x[t - tap] for the taps
    with tap <= position in block; coef[t, tap, c] = base[tap, c] + delta[t, tap, c // g]."""
    b, q, hidden = x.shape
    k, groups = delta.shape[-2], delta.shape[-1]
    g = hidden // groups
    out = torch.zeros_like(x)
    for i in range(b):
        for t in range(q):
            for tap in range(k):
                if t % block_size >= tap:
                    coef = base[tap] + delta[i, t, tap].repeat_interleave(g)
                    out[i, t] += coef * x[i, t - tap]
    return out


# --- the grouped dynamic convolution -------------------------------------------------------------------------------

def test_conv_hand_vector():
    """Section 7: H=4, g=2, k=2, one block of two; base tap 0 = 1, tap 1 = 0.5; delta(pos 1, tap 1) = [0.1, -0.1]."""
    conv = GroupedDynamicConv(4, 2, 2)
    x = torch.tensor([[[1.0, 2, 3, 4], [5, 6, 7, 8]]])
    expected = torch.tensor([[1.0, 2, 3, 4], [5.6, 7.2, 8.2, 9.6]])
    with torch.no_grad():
        conv.base_kernel[:, 1] = 0.5
        # output index (side, tap, group) = side*k*G + tap*G + group: side 0, tap 1 -> rows 2, 3; x1[0] = 5
        conv.kernel_projection.weight[2, 0] = 0.02
        conv.kernel_projection.weight[3, 0] = -0.02
    out, delta_out = conv.prepare(x, block_size=2)
    torch.testing.assert_close(out[0], expected)
    assert torch.equal(delta_out, torch.zeros(1, 2, 2, 2))                   # side 1 rows of the projection are 0
    delta = torch.zeros(1, 2, 2, 2)
    delta[0, 1, 1] = torch.tensor([0.1, -0.1])
    torch.testing.assert_close(conv.finish(x, delta, block_size=2)[0], expected)  # the output side, same rule


def test_conv_matches_the_formula_position_by_position():
    torch.manual_seed(0)
    conv = randomize(GroupedDynamicConv(H, 3, 8))
    x = torch.randn(2, 3 * BS, H)
    out, delta_out = conv.prepare(x, BS)
    delta = conv.kernel_projection(x).view(2, 3 * BS, 2, 3, H // 8)
    torch.testing.assert_close(delta_out, delta[:, :, 1])
    torch.testing.assert_close(out, reference_conv(x, conv.base_kernel[0], delta[:, :, 0], BS))
    y = torch.randn_like(x)
    torch.testing.assert_close(conv.finish(y, delta_out, BS), reference_conv(y, conv.base_kernel[1], delta_out, BS))


def test_conv_gradients_match_the_formula():
    """The matmul form of the coefficients ([delta, 1] @ [E; base]) gives autograd the same gradients wrt x,
    the deltas, the base kernel and the projection as the position-by-position formula."""
    torch.manual_seed(3)
    conv = randomize(GroupedDynamicConv(H, 3, 8))
    x = torch.randn(2, 2 * BS, H, requires_grad=True)
    go = torch.randn(2, 2 * BS, H)
    out, d = conv.prepare(x, BS)
    ((out + conv.finish(x, d, BS)) * go).sum().backward()
    got = [x.grad.clone()] + [p.grad.clone() for p in conv.parameters()]
    x.grad = None
    conv.zero_grad(set_to_none=True)
    delta = conv.kernel_projection(x).view(2, 2 * BS, 2, 3, H // 8)
    ref = reference_conv(x, conv.base_kernel[0], delta[:, :, 0], BS)
    ((ref + reference_conv(x, conv.base_kernel[1], delta[:, :, 1], BS)) * go).sum().backward()
    want = [x.grad] + [p.grad for p in conv.parameters()]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert conv.base_kernel.grad.abs().sum() > 0 and conv.kernel_projection.weight.grad.abs().sum() > 0


def test_conv_never_crosses_a_block():
    """Changing block 1 leaves block 2 as it was; a conv that read across the block start would not."""
    conv = randomize(GroupedDynamicConv(H, 2, 8))
    x = torch.randn(1, 2 * BS, H)
    x2 = x.clone()
    x2[:, :BS] = torch.randn(1, BS, H)
    out, d = conv.prepare(x, BS)
    out2, d2 = conv.prepare(x2, BS)
    torch.testing.assert_close(out2[:, BS:], out[:, BS:], rtol=0, atol=0)
    torch.testing.assert_close(conv.finish(x2, d2, BS)[:, BS:], conv.finish(x, d, BS)[:, BS:], rtol=0, atol=0)
    assert not torch.allclose(out2[:, :BS], out[:, :BS])


def test_conv_is_identity_at_init_and_after_reset():
    conv = GroupedDynamicConv(H, 2, 8)
    x = torch.randn(2, 2 * BS, H)
    out, d = conv.prepare(x, BS)
    assert torch.equal(out, x) and torch.equal(conv.finish(x, d, BS), x)
    assert conv.base_kernel.shape == (2, 2, H) and conv.kernel_projection.weight.shape == (2 * 2 * H // 8, H)
    model = nn.Sequential(conv, CandidateSelector(H, V, 6))
    for p in model.parameters():             # a generic init (the drafter's N(0, std) over Linear weights)
        nn.init.normal_(p, std=0.5)
    reset_dflash2_parameters(model)
    assert torch.equal(conv.prepare(x, BS)[0], x)
    assert torch.equal(model[1].successor_codebook, torch.zeros(V, 6))
    assert model[1].predecessor_codebook.std() < 0.05


def test_conv_bf16_and_fullgraph():
    conv = randomize(GroupedDynamicConv(H, 2, 8))
    x = torch.randn(2, 2 * BS, H)
    ref, _ = conv.prepare(x, BS)
    out, _ = copy.deepcopy(conv).to(torch.bfloat16).prepare(x.bfloat16(), BS)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=0.05, atol=0.05)
    compiled = torch.compile(conv.prepare, backend="eager", fullgraph=True)  # no graph break
    torch.testing.assert_close(compiled(x, BS)[0], ref)


# --- the decoder layer ---------------------------------------------------------------------------------------------

def test_layer_at_init_is_the_dflash_layer():
    torch.manual_seed(0)
    base = randomize(DFlashDecoderLayer(cfg()))
    layer = DFlash2DecoderLayer(cfg(), SETTINGS)
    missing = layer.load_state_dict(base.state_dict(), strict=False).missing_keys
    assert sorted(missing) == sorted(f"{c}.{n}" for c in ("attention_conv", "mlp_conv")
                                     for n in ("base_kernel", "kernel_projection.weight"))
    inp = layer_inputs()
    torch.testing.assert_close(layer(**inp), base(**inp))


def test_layer_wraps_attention_and_mlp_in_their_convs():
    """The five steps, written out with the layer's own pieces; context keys/values unconvolved."""
    layer = randomize(DFlash2DecoderLayer(cfg(), SETTINGS), seed=3)
    inp = layer_inputs()
    h, ctx = inp["h"], inp["ctx"]
    x, d = layer.attention_conv.prepare(layer.input_layernorm(h), BS)
    a = layer.self_attn(x, ctx, inp["rope_q"], inp["rope_k"], inp["mask"], "sdpa")
    h1 = h + layer.attention_conv.finish(a, d, BS)
    x, d = layer.mlp_conv.prepare(layer.post_attention_layernorm(h1), BS)
    expected = h1 + layer.mlp_conv.finish(layer.mlp(x), d, BS)
    torch.testing.assert_close(layer(**inp), expected)
    assert not torch.allclose(expected, DFlashDecoderLayer.forward(layer, **inp), atol=1e-3)  # the convs matter


def test_layer_blocks_stay_independent():
    layer = randomize(DFlash2DecoderLayer(cfg(), SETTINGS), seed=4)
    inp = layer_inputs()
    out = layer(**inp)
    changed = dict(inp, h=inp["h"].clone())
    changed["h"][:, :BS] += torch.randn(2, BS, H)
    out2 = layer(**changed)
    torch.testing.assert_close(out2[:, BS:], out[:, BS:])
    assert not torch.allclose(out2[:, :BS], out[:, :BS])


def test_a_block_alone_gives_what_it_gives_in_the_training_layout():
    """Decoding runs one block [anchor, MASK x (B-1)] against its context: the same rows as that block inside the
    training layout (the conv's position is the flattened index mod B)."""
    layer = randomize(DFlash2DecoderLayer(cfg(), SETTINGS), seed=6, scale=0.1)
    inp = layer_inputs()
    full = layer(**inp)
    ctx_len = inp["ctx"].shape[1]
    rows = slice(BS, 2 * BS)                                            # sample 0, block 1 (anchor 4)
    allowed = inp["mask"][0][:1, :, rows]
    keys = torch.cat([torch.arange(ctx_len), ctx_len + torch.arange(2 * BS, 3 * BS) - BS])
    one = dict(h=inp["h"][:1, rows], ctx=inp["ctx"][:1], rope_q=tuple(t[:1, rows] for t in inp["rope_q"]),
               rope_k=tuple(t[:1, keys] for t in inp["rope_k"]), backend="sdpa",
               mask=(allowed[..., keys], torch.ones(1, 1, BS, 1, dtype=torch.bool)))
    torch.testing.assert_close(layer(**one), full[:1, rows])


def test_parameter_names_and_shapes_match_the_contract():
    mc = cfg(layers=2)
    model = nn.Module()
    model.fc = nn.Linear(mc.num_feature_layers * H, H, bias=False)
    model.hidden_norm, model.norm = RMSNorm(H, 1e-6), RMSNorm(H, 1e-6)
    model.layers = nn.ModuleList(DFlash2DecoderLayer(mc, SETTINGS) for _ in range(2))
    model.candidate_selector = CandidateSelector(H, V, SETTINGS.selector_rank)
    got = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert got == expected_shapes(mc, SETTINGS)
    assert got["candidate_selector.predecessor_codebook"] == (V, 6)
    assert "candidate_selector.successor_codebook.weight" not in got
    # z-lab's released header: H = 6656, g = 16, k = 2 gives a kernel_projection of [1664, 6656]
    big = DrafterModelConfig(hidden_size=6656, num_attention_heads=52, num_key_value_heads=4, head_dim=128,
                             intermediate_size=17920, num_layers=5, num_feature_layers=5, rms_norm_eps=1e-6,
                             rope_theta=1e7, block_size=8, vocab_size=248320, max_position_embeddings=4096)
    shapes = expected_shapes(big, DFlash2Settings())
    assert shapes["layers.4.mlp_conv.kernel_projection.weight"] == (1664, 6656)
    assert shapes["candidate_selector.successor_codebook"] == (248320, 256)
    assert len(shapes) == 3 + 5 * 15 + 3


# --- the selector --------------------------------------------------------------------------------------------------

def hand_selector():
    """Section 7: A[0] = [1, 0], W_h h = [1, -1] (W_h = I, h = [1, -1]), B[1] = [0, 1], B[2] = [2, 0]."""
    sel = CandidateSelector(2, 3, 2)
    with torch.no_grad():
        sel.hidden_projection.weight.copy_(torch.eye(2))
        sel.predecessor_codebook.copy_(torch.tensor([[1.0, 0], [0, 0], [0, 0]]))
        sel.successor_codebook.copy_(torch.tensor([[0.0, 0], [0, 1], [2, 0]]))
    return sel


def test_selector_hand_vector():
    s = hand_selector().scores(torch.tensor([1.0, -1.0]), torch.tensor(0), torch.tensor([1, 2]),
                               torch.tensor([0.5, 0.4]))
    torch.testing.assert_close(s, torch.tensor([0.5, 2.4]))


def test_predecessor_shift():
    gold = torch.tensor([[2, 3, 4, 5, 8, 9, 10, 11]])
    assert teacher_forced_predecessors(gold, 4).view(2, 4).tolist() == [[2, 2, 3, 4], [8, 8, 9, 10]]


def test_unary_topk_multiplies_then_caps():
    logits = torch.tensor([[10.0, -2.0, 4.0, 1.0]])
    unary, ids = unary_topk(logits, 2, output_multiplier=0.5, softcap=3.0)
    assert ids.tolist() == [[0, 2]]
    torch.testing.assert_close(unary, 3.0 * torch.tanh(torch.tensor([[5.0, 2.0]]) / 3.0))
    assert not torch.allclose(unary, 0.5 * 3.0 * torch.tanh(torch.tensor([[10.0, 4.0]]) / 3.0))
    w, h = torch.randn(V, H), torch.randn(7, H)
    ref_u, ref_ids = unary_topk(h @ w.t(), 5, 0.5, 3.0)
    assert torch.equal(topk_candidates(h, w, 5, chunk_rows=3), ref_ids)
    torch.testing.assert_close(candidate_logits(h, w, ref_ids, 0.5, 3.0), ref_u)


def test_greedy_walk_follows_the_chosen_predecessor_and_breaks_ties_low():
    s = torch.zeros(1, 3, 3, 3)
    s[0, 0, :] = torch.tensor([1.0, 5.0, 5.0])       # row 0 (same for every p): tie 1 vs 2 -> 1
    s[0, 1, 1] = torch.tensor([0.0, 0.0, 9.0])       # from 1 -> 2 (row 1's argmax over all p would differ)
    s[0, 1, 2] = torch.tensor([7.0, 0.0, 0.0])
    s[0, 2, 2] = torch.tensor([2.0, 2.0, 1.0])       # from 2: tie 0 vs 1 -> 0
    s[0, 2, 0] = torch.tensor([0.0, 0.0, 8.0])
    assert greedy_walk(s).tolist() == [[1, 2, 0]]
    idx, rows = walk(s)
    assert torch.equal(rows[0, 2], s[0, 2, 2])
    s[0, 0, :, 2], s[0, 2, 2, 1] = 4.0, 1.0          # no tie left: sampling at a large scale is the greedy path
    g = torch.Generator().manual_seed(0)
    assert walk(s * 100.0, temperature=1.0, generator=g)[0].tolist() == greedy_walk(s).tolist() == [[1, 2, 0]]



def test_sampled_walk_draws_from_the_softmax_of_the_row():
    s = torch.tensor([0.0, 1.0, 2.0]).expand(4000, 1, 3, 3)
    picks, _ = walk(s, temperature=1.5, generator=torch.Generator().manual_seed(0))
    freq = torch.bincount(picks.flatten(), minlength=3).float() / 4000
    torch.testing.assert_close(freq, torch.softmax(torch.tensor([0.0, 1.0, 2.0]) / 1.5, -1), rtol=0, atol=0.03)


def test_propose_walks_the_lattice_and_starts_as_unary():
    torch.manual_seed(0)
    sel = CandidateSelector(H, V, 6)
    w = torch.randn(V, H)
    hidden, anchor = torch.randn(2, BS, H), torch.tensor([3, 7])
    tokens, cand, q = propose(sel, hidden, anchor, w, top_k=5)
    assert torch.equal(tokens, (hidden[:, 1:] @ w.t()).argmax(-1))       # zero successor codebook: unary argmax
    assert torch.equal(q.sum(-1), torch.ones(2, BS - 1)) and q.max() == 1.0
    randomize(sel, seed=5, scale=1.0)
    tokens, cand, q = propose(sel, hidden, anchor, w, top_k=5, output_multiplier=0.5, softcap=4.0)
    unary, ids = unary_topk(hidden[:, 1:] @ w.t(), 5, 0.5, 4.0)
    assert torch.equal(cand, ids)
    lat = lattice(sel, hidden[:, 1:], anchor, ids, unary)
    for n in range(2):                                                  # the walk, one step at a time
        prev = anchor[n]
        for j in range(BS - 1):
            s = sel.scores(hidden[n, 1 + j], prev, ids[n, j], unary[n, j])
            torch.testing.assert_close(lat[n, j, 0 if j == 0 else int((ids[n, j - 1] == prev).nonzero())], s)
            prev = ids[n, j, int(s.argmax())]
            assert tokens[n, j] == prev
    _, _, q_t = propose(sel, hidden, anchor, w, top_k=5, temperature=0.7, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(q_t.sum(-1), torch.ones(2, BS - 1))


def loss_case(seed=0):
    g = torch.Generator().manual_seed(seed)
    sel = randomize(CandidateSelector(H, V, 6), seed=seed, scale=1.0)
    w, h = torch.randn(V, H, generator=g), torch.randn(6, H, generator=g)
    cand = topk_candidates(h, w, 5)
    gold = torch.stack([cand[0, 2], cand[1, 0], cand[2, 4], cand[3, 1], cand[4, 0], cand[5, 0]])
    outside = next(t for t in range(V) if t not in cand[3].tolist())
    gold[3] = outside                                 # row 3: gold outside the top-K
    gold[4] = -100                                    # row 4: no label
    pred = torch.tensor([1, 2, 3, 4, 5, -1])          # row 5: unknown predecessor
    weights = torch.rand(6, generator=g) + 0.5
    return sel, w, h, cand, gold, pred, weights


@pytest.mark.parametrize("mode", ["exclude", "replace_last"])
def test_selector_loss(mode):
    sel, w, h, cand, gold, pred, weights = loss_case()
    parts = selector_loss(sel, h, w, pred, cand, gold, weights, mode, 0.5, 4.0)
    rows = [0, 1, 2, 3] if mode == "replace_last" else [0, 1, 2]
    expected = 0.0
    for r in rows:
        ids = cand[r].clone()
        if r == 3:
            ids[-1] = gold[3]                        # replace_last: the gold token keeps its own unary logit
        unary = 4.0 * torch.tanh(0.5 * (h[r] @ w[ids].t()) / 4.0)
        s = sel.scores(h[r], pred[r], ids, unary)
        expected = expected + weights[r] * F.cross_entropy(s[None], (ids == gold[r]).int().argmax()[None])
    torch.testing.assert_close(parts.loss_sum, expected)
    torch.testing.assert_close(parts.weight_sum, weights[rows].sum())
    assert parts.supervised.tolist() == [r in rows for r in range(6)]
    assert parts.gold_in_topk.tolist() == [True, True, True, False, False, True]
    assert parts.unary_correct.tolist() == [False, True, False, False, False, True]
    parts.loss_sum.backward()
    assert sel.successor_codebook.grad.abs().sum() > 0


def test_selector_rows_and_stats_on_the_training_layout():
    block_ids = torch.tensor([[2, 0, 0, 0, 8, 0, 0, 0]])
    labels = torch.tensor([[-100, 3, 4, 5, -100, 9, -100, 11]])        # slot 2 of block 2 has no label
    hidden = torch.arange(8.0)[None, :, None].expand(1, 8, 2)
    h, pred, gold, wt = selector_rows(hidden, block_ids, labels, torch.ones(1, 8), 4)
    assert h[:, 0].tolist() == [1, 2, 3, 5, 6, 7]
    assert pred.tolist() == [2, 3, 4, 8, 9, -100] and gold.tolist() == [3, 4, 5, 9, -100, 11]
    assert torch.equal(block_gold(block_ids, labels, 4)[0, :4], torch.tensor([2, 3, 4, 5]))


def test_accepted_lengths():
    correct = torch.tensor([1, 1, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0], dtype=torch.bool)
    supervised = torch.tensor([1, 1, 1, 1, 1, 1, 0, 1, 0, 0, 0, 0], dtype=torch.bool)
    lengths, has = accepted_lengths(correct, supervised, 5)      # a miss; an unsupervised row; nothing
    assert lengths.tolist() == [3.0, 3.0, 1.0] and has.tolist() == [True, True, False]


def test_zero_selector_matches_unary_choice():
    """With a zero successor codebook (the init) the selector's choice is the unary argmax."""
    _, w, h, cand, gold, pred, weights = loss_case(seed=2)
    sel = CandidateSelector(H, V, 6)
    parts = selector_loss(sel, h, w, pred, cand, gold, weights, "exclude")
    assert parts.selector_correct.any()
    assert torch.equal(parts.selector_correct, parts.unary_correct & parts.gold_in_topk & (pred >= 0))


# --- settings, FLOPs, export ---------------------------------------------------------------------------------------

def test_settings_refuse_what_cannot_work():
    with pytest.raises(ConfigError, match="selector_gold"):
        DFlash2Settings(selector_gold="insert")
    with pytest.raises(ConfigError, match="output_multiplier"):
        DFlash2Settings(output_multiplier=0.0)
    with pytest.raises(ConfigError, match="conv_group_size"):
        DFlash2DecoderLayer(cfg(), DFlash2Settings(conv_group_size=5))
    with pytest.raises(ConfigError, match="conv_kernel_size"):
        DFlash2DecoderLayer(cfg(), DFlash2Settings(conv_kernel_size=BS + 1, conv_group_size=8))
    assert DFlash2Settings(final_logit_softcapping=0).final_logit_softcapping is None


def test_export_fields():
    fields = export_fields(DFlash2Settings(output_multiplier=0.196, final_logit_softcapping=20))
    assert fields == {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16,
                      "output_multiplier": 0.196, "final_logit_softcapping": 20.0}
    assert export_fields(DFlash2Settings())["final_logit_softcapping"] == 0.0
    assert "input_embedding_scale" not in fields


def test_flops_count_what_runs():
    s = DFlash2Settings()                     # k = 2, g = 16, r = 256, K = 16
    conv = conv_flops_per_row(64, s)
    assert conv["matmul"] == 2 * 2 * 64 * (2 * 2 * 4)           # two convs, projection H -> 2kG, G = 4
    assert conv["elementwise"] == 4 * (2 * 64 + 2 * 2 * 64)     # per side: coef adds kH + tap MACs 2kH
    sel = selector_flops_per_row(64, s)
    assert sel == {"matmul": 2 * 64 * 256, "gathered": 256 + 2 * 16 * 256 + 2 * 16 * 64}
    assert selector_flops_per_row(64, s, predecessors=16, unary_recompute=False)["gathered"] == 16 * (256 + 32 * 256)
    assert math.isclose(conv["matmul"], 2 * sum(p.numel() for p in GroupedDynamicConv(64, 2, 16).kernel_projection
                                                .parameters()) * 2)


def test_candidate_logits_keep_no_gathered_head_rows_for_backward():
    """The unary logits of the candidates and their gradient equal the gathered-rows reference, and backward keeps
    no [rows, K, H] tensor (an embedding_bag of the head rows instead)."""
    g = torch.Generator().manual_seed(4)
    w, ids = torch.randn(50, 24, generator=g), torch.randint(0, 50, (2, 7, 5), generator=g)
    h = torch.randn(2, 7, 24, generator=g, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        u = candidate_logits(h, w, ids, 0.5, 3.0)
    assert max(saved) < ids.numel() * 24
    ref = 3.0 * torch.tanh(0.5 * torch.matmul(w[ids], h[..., None]).squeeze(-1) / 3.0)
    torch.testing.assert_close(u, ref)
    grad = torch.randn(u.shape, generator=g)
    torch.testing.assert_close(torch.autograd.grad(u, h, grad)[0], torch.autograd.grad(ref, h, grad)[0])
    with pytest.raises(ValueError, match="frozen"):
        candidate_logits(h, w.requires_grad_(), ids)
