"""Anchor sampling and block construction."""

import torch

from dflash_dist.model.blocks import make_batch, sample_anchors
from dflash_dist.model.masks import dense_mask

MASK = 99


def _candidates(lm):
    return {a for a in range(len(lm) - 1) if lm[a] and lm[a + 1]}


def test_sample_anchors_rule_sorted_unique_padded():
    g = torch.Generator().manual_seed(0)
    for trial in range(60):
        s = int(torch.randint(1, 40, (1,), generator=g))
        lm = torch.rand(s, generator=g) < float(torch.rand(1, generator=g))
        n = int(torch.randint(1, 20, (1,), generator=g))
        anchors, valid = sample_anchors(lm, n, g)
        assert anchors.shape == (n,) and valid.shape == (n,)
        assert anchors.dtype == torch.long and valid.dtype == torch.bool
        cand = _candidates(lm.tolist())
        k = int(valid.sum())
        assert k == min(len(cand), n)
        assert valid[:k].all() and not valid[k:].any()          # valid first, padding after
        got = anchors[:k].tolist()
        assert got == sorted(set(got))                            # sorted, unique
        assert set(got) <= cand                                   # lm[a] and lm[a+1], a <= S-2
        assert (anchors[k:] == 0).all()


def test_sample_anchors_all_candidates_when_few():
    lm = torch.tensor([0, 1, 1, 1, 0, 1, 1], dtype=torch.bool)
    anchors, valid = sample_anchors(lm, 8, torch.Generator().manual_seed(3))
    assert anchors.tolist() == [1, 2, 5, 0, 0, 0, 0, 0]
    assert valid.tolist() == [True] * 3 + [False] * 5


def test_sample_anchors_uniform_and_reproducible():
    lm = torch.tensor([1, 1, 0, 1, 1, 1, 0, 1, 1], dtype=torch.bool)   # candidates 0, 3, 4, 7
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(9)
    draws = 4000
    for _ in range(draws):
        a, v = sample_anchors(lm, 2, g)
        counts[a[v]] += 1
    # each candidate is in a 2-of-4 subset with probability 1/2
    expected = draws / 2
    assert ((counts[[0, 3, 4, 7]] - expected).abs() < 0.06 * expected).all(), counts
    assert counts.sum() == 2 * draws
    a1 = sample_anchors(lm, 2, torch.Generator().manual_seed(5))
    a2 = sample_anchors(lm, 2, torch.Generator().manual_seed(5))
    assert torch.equal(a1[0], a2[0]) and torch.equal(a1[1], a2[1])


def test_sample_anchors_degenerate():
    for lm in (torch.zeros(0, dtype=torch.bool), torch.ones(1, dtype=torch.bool), torch.zeros(10, dtype=torch.bool)):
        a, v = sample_anchors(lm, 3, torch.Generator().manual_seed(0))
        assert a.tolist() == [0, 0, 0] and v.tolist() == [False] * 3


def _hand_batch():
    # sample 0: ids 10..17, supervised at 2,3,4,6,7 -> candidates a = 2, 3, 6 (exactly N=3, so deterministic)
    # sample 1: ids 20..24, supervised at 0,1 -> candidate a = 0 only, two padding blocks
    ids = torch.tensor([10, 11, 12, 13, 14, 15, 16, 17, 20, 21, 22, 23, 24])
    lm = torch.tensor([0, 0, 1, 1, 1, 0, 1, 1, 1, 1, 0, 0, 0], dtype=torch.bool)
    cu = torch.tensor([0, 8, 13])
    feats = torch.arange(13 * 6, dtype=torch.float32).view(13, 6) + 1.0
    batch = make_batch(ids, lm, cu, feats, num_anchors=3, block_size=4, mask_token_id=MASK, ctx_bucket=16,
                       generator=torch.Generator().manual_seed(0))
    return batch, feats


def test_make_batch_hand_built_example():
    batch, feats = _hand_batch()
    X = -100
    assert batch.anchors.tolist() == [[2, 3, 6], [0, 0, 0]]
    assert batch.valid.tolist() == [[True, True, True], [True, False, False]]
    assert batch.block_ids.tolist() == [
        [12, MASK, MASK, MASK, 13, MASK, MASK, MASK, 16, MASK, MASK, MASK],
        [20, MASK, MASK, MASK, MASK, MASK, MASK, MASK, MASK, MASK, MASK, MASK],
    ]
    assert batch.block_positions.tolist() == [
        [2, 3, 4, 5, 3, 4, 5, 6, 6, 7, 8, 9],
        [0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3],
    ]
    # slot 0: -100; slot k: id[a+k] if a+k < len and supervised; padding blocks: -100
    assert batch.labels.tolist() == [
        [X, 13, 14, X, X, 14, X, 16, X, 17, X, X],
        [X, 21, X, X, X, X, X, X, X, X, X, X],
    ]
    assert batch.features.shape == (2, 16, 6)
    assert torch.equal(batch.features[0, :8], feats[:8]) and (batch.features[0, 8:] == 0).all()
    assert torch.equal(batch.features[1, :5], feats[8:13]) and (batch.features[1, 5:] == 0).all()
    assert batch.ctx_positions.tolist() == [list(range(16))] * 2
    assert batch.num_samples == 2 and batch.num_tokens == 13


def test_make_batch_ctx_bucket_and_no_padding_visible():
    g = torch.Generator().manual_seed(1)
    lens = [37, 5, 20]
    total = sum(lens)
    ids = torch.randint(0, 50, (total,), generator=g)
    lm = torch.rand(total, generator=g) < 0.7
    cu = torch.tensor([0, 37, 42, 62])
    feats = torch.randn(total, 10, generator=g)
    batch = make_batch(ids, lm, cu, feats, num_anchors=8, block_size=4, mask_token_id=MASK, ctx_bucket=16,
                       generator=g)
    assert batch.features.shape == (3, 48, 10)
    assert batch.block_ids.shape == batch.labels.shape == batch.block_positions.shape == (3, 32)
    m = dense_mask(batch.anchors, batch.valid, 48, 4)
    for s, n in enumerate(lens):
        assert not m[s, :, n:48].any()                     # padded context never visible
        assert (batch.anchors[s][batch.valid[s]] <= n - 2).all()
    # every label is the token at its position within the sample, on a supervised position
    for s, lo in enumerate(cu[:-1].tolist()):
        lab, pos = batch.labels[s], batch.block_positions[s]
        has = lab != -100
        assert torch.equal(lab[has], ids[lo + pos[has]])
        assert lm[lo + pos[has]].all()


def test_make_batch_draws_the_keys_sample_anchors_would():
    """make_batch draws every sample's anchor keys up front (one device copy, no host sync on CUDA): the anchors
    must be exactly those of sample_anchors drawing per sample from the same generator, in sample order."""
    g = torch.Generator().manual_seed(5)
    lens = [37, 1, 0, 64, 12]
    mask = torch.rand(sum(lens), generator=g) > 0.3
    cu = torch.tensor([0] + lens).cumsum(0)
    ids = torch.randint(0, 1000, (sum(lens),), generator=g)
    batch = make_batch(ids, mask, cu, torch.randn(sum(lens), 4), num_anchors=8, block_size=4, mask_token_id=MASK,
                       ctx_bucket=16, generator=torch.Generator().manual_seed(11))
    ref = torch.Generator().manual_seed(11)
    for i in range(len(lens)):
        a, v = sample_anchors(mask[cu[i]:cu[i + 1]], 8, ref)
        assert torch.equal(batch.anchors[i], a) and torch.equal(batch.valid[i], v), f"sample {i}"
    assert batch.valid[0].sum() > 0 and batch.valid[3].sum() > 0


def test_anchors_and_labels_are_per_document_not_per_packed_row():
    """The loss's weight sum counts each document's own anchors: two packed documents give two samples of up to
    num_anchors anchors each (the same as each alone), and no label of a block crosses its document's end."""
    B, n = 4, 6
    lens = [5, 9]
    ids = torch.arange(1, sum(lens) + 1)
    mask = torch.ones(sum(lens), dtype=torch.bool)
    feats = torch.zeros(sum(lens), 2)

    def batch(cu, gen_seed=0):
        return make_batch(ids[cu[0]:cu[-1]], mask[cu[0]:cu[-1]], torch.tensor(cu) - cu[0], feats[cu[0]:cu[-1]],
                          num_anchors=n, block_size=B, mask_token_id=0, ctx_bucket=8,
                          generator=torch.Generator().manual_seed(gen_seed))

    packed = batch([0, 5, 14])
    assert packed.anchors.shape == (2, n)
    assert packed.valid.sum(1).tolist() == [4, 6]            # 4 candidates in the 5-token document, 6 of 8 in the other
    assert packed.valid[0].sum() == batch([0, 5]).valid.sum()
    lab = packed.labels.view(2, n, B)
    assert int(lab[0].max()) <= 5 and int(lab[1][lab[1] >= 0].min()) >= 6  # document 0's labels stay in it
    assert (lab[0, :, 1:] != -100).sum() == sum(min(B - 1, 4 - int(a)) for a in packed.anchors[0][packed.valid[0]])
