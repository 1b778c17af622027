"""The DFlash mask rule: dense mask vs a naive per-element reference, flex mask_mod/BlockMask vs dense."""

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, create_mask

from dflash_dist.model import masks
from dflash_dist.model.drafter import flex_attention_compiled
from dflash_dist.model.masks import dense_mask, flex_block_mask, make_mask_mod

B = 4
CTX = 24


def naive_mask(anchors, valid, ctx_len, block_size, inclusive=False):
    """Per-element restatement of the rule, written independently of masks.py."""
    b, n = anchors.shape
    q_len = n * block_size
    out = torch.zeros(b, q_len, ctx_len + q_len, dtype=torch.bool)
    for s in range(b):
        for q in range(q_len):
            i = q // block_size
            if not valid[s, i]:
                continue
            a = int(anchors[s, i])
            for j in range(ctx_len + q_len):
                if j < ctx_len:
                    out[s, q, j] = (j <= a) if inclusive else (j < a)
                else:
                    out[s, q, j] = (j - ctx_len) // block_size == i
    return out


def cases():
    """Overlapping (a, a+1, a+2), adjacent (a, a+B), anchor 0, last anchor, padding blocks, random."""
    anchors = torch.tensor([
        [0, 1, 2, 6, 10, 0],          # anchor 0, overlapping 0/1/2, adjacent 6/10, one padding block
        [3, 4, 5, 9, 13, 22],         # overlapping, adjacent, anchor at ctx_len-2
        [0, 0, 0, 0, 0, 0],           # all padding
    ])
    valid = torch.tensor([
        [1, 1, 1, 1, 1, 0],
        [1, 1, 1, 1, 1, 1],
        [0, 0, 0, 0, 0, 0],
    ], dtype=torch.bool)
    g = torch.Generator().manual_seed(0)
    ra = torch.randint(0, CTX - 1, (2, 6), generator=g).sort(-1).values
    rv = torch.rand(2, 6, generator=g) > 0.3
    return torch.cat([anchors, torch.where(rv, ra, 0)]), torch.cat([valid, rv])


def test_dense_mask_matches_naive_reference():
    anchors, valid = cases()
    for inclusive in (False, True):
        got = dense_mask(anchors, valid, CTX, B, context_inclusive=inclusive)
        assert got.dtype == torch.bool and got.shape == (5, 6 * B, CTX + 6 * B)
        assert torch.equal(got, naive_mask(anchors, valid, CTX, B, inclusive))


def test_spot_values():
    anchors = torch.tensor([[5, 6]])
    valid = torch.tensor([[True, False]])
    m = dense_mask(anchors, valid, 8, 2)
    # block 0 (anchor 5): context 0..4, not 5; its own slots (keys 8, 9); not block 1 (keys 10, 11)
    assert m[0, 0, :8].tolist() == [True] * 5 + [False] * 3
    assert m[0, 1, 8:].tolist() == [True, True, False, False]
    assert not m[0, 2:].any()  # padding block sees nothing


def test_context_inclusive_differs_exactly_on_anchor_column():
    anchors, valid = cases()
    diff = dense_mask(anchors, valid, CTX, B, True) ^ dense_mask(anchors, valid, CTX, B, False)
    expect = torch.zeros_like(diff)
    for s in range(anchors.shape[0]):
        for i in range(anchors.shape[1]):
            if valid[s, i]:
                expect[s, i * B:(i + 1) * B, int(anchors[s, i])] = True
    assert torch.equal(diff, expect)
    assert diff.any()


def test_mask_mod_materialised_equals_dense():
    anchors, valid = cases()
    q_len = anchors.shape[1] * B
    for inclusive in (False, True):
        mm = make_mask_mod(anchors, valid, CTX, B, inclusive)
        got = create_mask(mm, anchors.shape[0], None, q_len, CTX + q_len, device="cpu")
        assert torch.equal(got[:, 0], dense_mask(anchors, valid, CTX, B, inclusive))


def _tile_any(dense, tile):
    b, q, k = dense.shape
    pq, pk = -q % tile, -k % tile
    d = F.pad(dense, (0, pk, 0, pq))
    return d.view(b, d.shape[1] // tile, tile, d.shape[2] // tile, tile).any(-1).any(2)


def test_flex_block_mask_equals_dense():
    # 40 blocks of 4 -> Q=160, K=184: several 128-tiles, partial tiles on both axes
    g = torch.Generator().manual_seed(1)
    n = 40
    anchors = torch.randint(0, CTX - 1, (2, n), generator=g).sort(-1).values
    valid = torch.rand(2, n, generator=g) > 0.2
    anchors = torch.where(valid, anchors, 0)
    before = dict(masks.mask_build_calls)
    bm = flex_block_mask(anchors, valid, CTX, B, compile=True)
    # full attention: the tile tables from the block intervals (masks.tile_tables), no mask evaluation
    assert masks.mask_build_calls["tables"] == before["tables"] + 1
    dense = dense_mask(anchors, valid, CTX, B)
    assert bm.seq_lengths == (n * B, CTX + n * B)
    assert torch.equal(bm.to_dense()[:, 0].bool(), _tile_any(dense, 128))
    mat = create_mask(bm.mask_mod, 2, None, n * B, CTX + n * B, device="cpu")[:, 0]
    assert torch.equal(mat, dense)


def test_tile_tables_block_mask_equals_create_block_mask():
    """The BlockMask built from the block intervals (masks.tile_tables, both sides ordered by
    masks.block_mask_from_tables) is torch's create_block_mask of the same mask_mod, tensor for tensor: block
    sizes that do and do not divide the 128 tile, padding blocks, partial tiles on both axes, the inclusive (leak
    demonstration) rule, sliding windows narrower than a block, than the context and wider than both."""
    g = torch.Generator().manual_seed(3)
    fields = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks", "q_indices",
              "full_q_num_blocks", "full_q_indices")
    for trial, bsz in enumerate((2, 3, 4, 5, 16, 32, 16, 8)):
        b, n, ctx = 1 + trial % 2, int(torch.randint(1, 70, (1,), generator=g)), int(torch.randint(40, 500, (1,), generator=g))
        anchors = torch.randint(0, ctx - 1, (b, n), generator=g).sort(-1).values
        valid = torch.rand(b, n, generator=g) > (0.0 if trial % 3 == 0 else 0.2)
        anchors = torch.where(valid, anchors, 0)
        inclusive = trial in (5, 6)
        for w in (None, 1, max(1, bsz // 2), bsz + 1, 100, 129, ctx + n * bsz + 1):
            before = masks.mask_build_calls["tables"]
            got = flex_block_mask(anchors, valid, ctx, bsz, context_inclusive=inclusive, sliding_window=w)
            assert masks.mask_build_calls["tables"] == before + 1
            ref = create_block_mask(make_mask_mod(anchors, valid, ctx, bsz, inclusive, sliding_window=w), b, None,
                                    n * bsz, ctx + n * bsz, device="cpu")
            assert got.seq_lengths == ref.seq_lengths and got.BLOCK_SIZE == ref.BLOCK_SIZE
            for f in fields:
                assert torch.equal(getattr(got, f), getattr(ref, f)), (trial, w, f)


def test_from_tables_false_builds_through_create_block_mask():
    """from_tables=False (the benchmarks' comparison) takes torch's builder, and builds the same BlockMask."""
    anchors, valid = cases()
    before = dict(masks.mask_build_calls)
    ref = flex_block_mask(anchors, valid, CTX, B, from_tables=False)
    assert masks.mask_build_calls["eager"] == before["eager"] + 1            # CPU: never the compiled builder
    assert masks.mask_build_calls["tables"] == before["tables"]
    got = flex_block_mask(anchors, valid, CTX, B)
    assert masks.mask_build_calls["tables"] == before["tables"] + 1
    assert torch.equal(got.to_dense(), ref.to_dense()) and torch.equal(got.kv_indices, ref.kv_indices)


def test_flex_attention_with_block_mask_equals_dense_attention():
    """Compiled flex forward with the BlockMask == softmax attention under the dense mask (0 on empty rows)."""
    anchors, valid = cases()
    b, n = anchors.shape
    q_len, k_len = n * B, CTX + n * B
    g = torch.Generator().manual_seed(2)
    q = torch.randn(b, 4, q_len, 8, generator=g)
    k = torch.randn(b, 2, k_len, 8, generator=g)
    v = torch.randn(b, 2, k_len, 8, generator=g)
    bm = flex_block_mask(anchors, valid, CTX, B)
    out = flex_attention_compiled(q, k, v, block_mask=bm, enable_gqa=True)
    dense = dense_mask(anchors, valid, CTX, B)
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    scores = (q @ kk.transpose(-1, -2)) * 8 ** -0.5
    p = scores.masked_fill(~dense[:, None], float("-inf")).softmax(-1).nan_to_num(0.0)
    ref = p @ vv
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert (out[2] == 0).all()  # all-padding sample: zero output


def naive_sliding_mask(anchors, valid, ctx_len, block_size, window):
    """Per-element restatement of the sliding-window rule (z-lab's / vLLM's non-causal window on absolute
    positions): slot s of block i (position a+s) sees context j iff j < a and a+s-j < W, own-block slot t iff
    |s-t| < W."""
    b, n = anchors.shape
    q_len = n * block_size
    out = torch.zeros(b, q_len, ctx_len + q_len, dtype=torch.bool)
    for r in range(b):
        for q in range(q_len):
            i, s = divmod(q, block_size)
            if not valid[r, i]:
                continue
            a = int(anchors[r, i])
            for j in range(ctx_len + q_len):
                if j < ctx_len:
                    out[r, q, j] = j < a and (a + s) - j < window
                else:
                    t = (j - ctx_len) % block_size
                    out[r, q, j] = (j - ctx_len) // block_size == i and abs(s - t) < window
    return out


def test_sliding_window_mask_round_trip():
    """dense == per-element reference == flex mask_mod materialised == BlockMask tiles == full mask & window from
    positions, for windows narrower and wider than the context; W >= ctx+B is the full mask again."""
    anchors, valid = cases()
    b, n = anchors.shape
    q_len = n * B
    block_pos = (anchors[:, :, None] + torch.arange(B)).reshape(b, q_len)
    k_pos = torch.cat([torch.arange(CTX).expand(b, CTX), block_pos], dim=1)
    full = dense_mask(anchors, valid, CTX, B)
    for w in (1, 3, B, 7, 12, CTX + B):
        got = dense_mask(anchors, valid, CTX, B, sliding_window=w)
        assert torch.equal(got, naive_sliding_mask(anchors, valid, CTX, B, w)), w
        assert torch.equal(got, full & masks.window_mask(block_pos, k_pos, w)), w
        mat = create_mask(make_mask_mod(anchors, valid, CTX, B, sliding_window=w), b, None, q_len, CTX + q_len,
                          device="cpu")[:, 0]
        assert torch.equal(mat, got), w
        bm = flex_block_mask(anchors, valid, CTX, B, sliding_window=w)
        assert torch.equal(bm.to_dense()[:, 0].bool(), _tile_any(got, 128)), w
        if w < CTX:
            assert (got.sum() < full.sum()) and not (got & ~full).any()   # strictly fewer keys, never new ones
    assert torch.equal(dense_mask(anchors, valid, CTX, B, sliding_window=CTX + B), full)
    # the FLOP count's visible pairs (drafter/trainer.step_flops) are the mask's True entries
    assert masks.visible_pairs(anchors, valid, B) == full.sum()
    for w in (B, 7, 12, CTX + B):
        assert masks.visible_pairs(anchors, valid, B, w) == dense_mask(anchors, valid, CTX, B, sliding_window=w).sum()
    # the z-lab window counts the query itself: W=1 leaves each slot only itself
    one = dense_mask(anchors, valid, CTX, B, sliding_window=1)
    assert not one[..., :CTX].any() and torch.equal(one[..., CTX:], full[..., CTX:] & torch.eye(q_len, dtype=torch.bool))


def test_layer_masks_one_mask_or_per_kind():
    anchors, valid = cases()

    def build(w):
        return dense_mask(anchors, valid, CTX, B, sliding_window=w)

    assert torch.equal(masks.layer_masks(None, build, None), build(None))
    assert torch.equal(masks.layer_masks(["full_attention"] * 2, build, None), build(None))
    mixed = masks.layer_masks(["sliding_attention", "full_attention"], build, 5)
    assert set(mixed) == {"full_attention", "sliding_attention"}
    assert torch.equal(mixed["sliding_attention"], build(5)) and torch.equal(mixed["full_attention"], build(None))
    assert set(masks.layer_masks(["sliding_attention"] * 3, build, 5)) == {"sliding_attention"}


def test_mask_mod_captures_only_tensors():
    """The mask_mod closes over device tensors alone: a captured Python number (context length, block size, window)
    becomes a symbolic scalar under dynamic shapes, which flex's FLASH backend refuses to compile. Its result is
    checked against the dense mask above; here, what it captures."""
    anchors, valid = cases()
    for w in (None, 3, 2 * B):
        mm = make_mask_mod(anchors, valid, CTX, B, sliding_window=w)
        captured = [c.cell_contents for c in (mm.__closure__ or ())]
        assert captured and all(isinstance(c, torch.Tensor) for c in captured), [type(c) for c in captured]
        assert all(c.dtype == torch.int32 and c.shape == (anchors.shape[0], anchors.shape[1] * B) for c in captured)
