"""eval/batched.py: several prompts decoded together give each prompt what it gets decoded alone (float64, CPU):
the same tokens, acceptance lengths, accepted slots and stop reason, with rows accepting different amounts."""

import helpers.tiny_decoding as helper
import pytest
import torch
from torch import nn

from dflash_dist.eval.batched import batched_speculative, check_batchable
from dflash_dist.eval.spec_decode import (draft_rows, evaluate_prompts, make_dflash_draft_fn, speculative_generate,
                                          target_greedy)
from dflash_dist.targets.hf import head_weights

V, H, L, B, MASK = 96, 32, 5, 5, 95
LAYER_IDS = [1, 2, 4]


def tiny_target(seed=0):
    return helper.tiny_target(V, H, L, seed)


def tiny_drafter(target, seed=0):
    return helper.tiny_drafter(target, len(LAYER_IDS), B, seed)


class Oracle(nn.Module):
    """A drafter module that proposes the target's own continuation of each row's prompt, wrong at one slot that
    depends on the anchor: every row accepts a different, varying number of tokens."""

    def __init__(self, full_rows):
        super().__init__()
        self.fc = nn.Linear(1, 1, bias=False).double()
        self.backend = "sdpa"
        self.full = [list(r) + [0] * (2 * B) for r in full_rows]

    def forward(self, block_embeds, ctx, ctx_pos, blk_pos, mask):
        self.anchor = blk_pos[:, 0].tolist()
        return block_embeds

    def set_context(self, **kw):
        pass

    def propose(self, hidden, lm_head, anchor_ids):
        out = []
        for r, p in enumerate(self.anchor):
            d = (self.full[r] + [0] * (p + B))[p + 1:p + B]  # a finished row rides along past its end
            wrong = (p * 7) % B  # B: no slot wrong
            if wrong >= 1:
                d[wrong - 1] = (d[wrong - 1] + 1) % (V - 1)
            out.append(d)
        return torch.tensor(out)


@pytest.fixture(scope="module")
def target():
    return tiny_target()


def prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V - 1, (int(torch.randint(1, 14, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def alone(target, drafter_for, ps, n_new, eos=()):
    return [speculative_generate(target, drafter_for(i), None, None, p, LAYER_IDS, MASK, B, n_new, eos, use_cache=True)
            for i, p in enumerate(ps)]


def same(a, b):
    for (ta, sa), (tb, sb) in zip(a, b):
        assert ta == tb
        for k in ("acceptance_lengths", "accepted_per_position", "stop", "new_tokens", "prompt_tokens"):
            assert sa[k] == sb[k], k
    assert len(a) == len(b)


@pytest.mark.parametrize("batch", [3, 7])
def test_rows_accepting_different_amounts_decode_as_alone(target, batch):
    ps, n_new = prompts(7), 24
    full = [p + target_greedy(target, p, n_new + B) for p in ps]
    one = alone(target, lambda i: Oracle([full[i]]), ps, n_new)
    assert len({tuple(s["acceptance_lengths"]) for _, s in one}) > 3  # the rows really differ
    assert any(max(s["acceptance_lengths"]) == B for _, s in one) and any(1 in s["acceptance_lengths"] for _, s in one)
    got = []
    for i in range(0, len(ps), batch):  # each batch's oracle knows its own rows
        got += batched_speculative(target, Oracle(full[i:i + batch]), None, None, ps[i:i + batch], LAYER_IDS, MASK,
                                   B, n_new, batch_size=batch)
    same(got, one)
    assert all(toks == full[i][len(ps[i]):len(ps[i]) + n_new] for i, (toks, _) in enumerate(got))  # lossless


def test_a_real_drafter_drafts_each_row_as_alone_and_eos_ends_rows_apart(target):
    drafter = tiny_drafter(target)
    embed, head = head_weights(target)
    ps = prompts(5, seed=3)
    # the drafts of rows with different contexts, padded into one batch, equal each row's own
    feats = [torch.randn(len(p) + 3, len(LAYER_IDS) * H, dtype=torch.float64) for p in ps]
    block = torch.full((len(ps), B), MASK)
    block[:, 0] = torch.tensor([p[-1] for p in ps])
    pos = torch.tensor([f.shape[0] for f in feats])
    batched = draft_rows(drafter, embed, head, feats, block, pos)
    one_fn = make_dflash_draft_fn(drafter, embed, head)
    for r, f in enumerate(feats):
        assert torch.equal(batched[r], one_fn(f[None], block[r:r + 1], int(pos[r])))
    # end to end, with an EOS that stops the rows at different steps
    greedy = [target_greedy(target, p, 30) for p in ps]
    eos = [max(set(greedy[0]), key=greedy[0].count)]
    one = alone(target, lambda i: drafter, ps, 30, eos)
    got = batched_speculative(target, drafter, None, None, ps, LAYER_IDS, MASK, B, 30, eos, batch_size=5)
    same(got, one)
    assert {s["stop"] for _, s in got} == {"eos", "max_new_tokens"} or len({len(t) for t, _ in got}) > 1


def test_evaluate_prompts_in_batches_gives_the_same_summary(target):
    drafter = tiny_drafter(target, seed=1)
    ps = prompts(6, seed=5)
    a = evaluate_prompts(target, drafter, None, None, ps, LAYER_IDS, MASK, B, 16, use_cache=True)
    b = evaluate_prompts(target, drafter, None, None, ps, LAYER_IDS, MASK, B, 16, use_cache=True, batch_size=4)
    for k in ("acceptance_length", "tau", "per_position_acceptance", "lossless_fraction", "total_steps",
              "mean_new_tokens"):
        assert a[k] == b[k], k
    assert a["lossless_fraction"] == 1.0 and b["batch_size"] == 4 and a["batch_size"] == 1
    c = evaluate_prompts(target, drafter, None, None, ps, LAYER_IDS, MASK, B, 16, use_cache=True, batch_size=4,
                         check_lossless=False)
    # the batches' time counted once: the rows' shares add up to the evaluation's time
    assert abs(c["wall_s"] - c["mean_new_tokens"] * c["n_prompts"] / c["tokens_per_s"]) < 0.05 * c["wall_s"]


def test_a_target_that_cannot_take_the_mask_is_refused(target):
    target.config._attn_implementation = "flex_attention"
    try:
        with pytest.raises(ValueError, match="attention implementation 'flex_attention'"):
            check_batchable(target)
    finally:
        target.config._attn_implementation = "sdpa"
    check_batchable(target)


@pytest.mark.parametrize("variant", ["dflash2", "domino"])
def test_each_variants_proposal_in_a_batch_is_its_proposal_alone(target, variant):
    from dflash_dist.config import DrafterConfig, DrafterDomino
    from dflash_dist.model.spec import resolve_drafter
    extra = {"domino": DrafterDomino(emb_dim=8, gru_hidden_dim=6)} if variant == "domino" else {}
    dc = DrafterConfig(num_layers=2, block_size=B, variant=variant, **extra)
    torch.manual_seed(2)
    model = resolve_drafter(dc, target.config, len(LAYER_IDS), "cpu").build_model().double().eval()
    with torch.no_grad():
        for prm in model.parameters():
            prm.normal_(0, 0.5)  # weights that make the variant's own head change the argmaxes
    embed, head = head_weights(target)
    feats = [torch.randn(n, len(LAYER_IDS) * H, dtype=torch.float64) for n in (3, 9, 6)]
    block = torch.full((3, B), MASK)
    block[:, 0] = torch.tensor([5, 17, 40])
    pos = torch.tensor([3, 9, 6])
    with torch.no_grad():
        batched = draft_rows(model, embed, head, feats, block, pos)
    one_fn = make_dflash_draft_fn(model, embed, head)
    for r, f in enumerate(feats):
        assert torch.equal(batched[r], one_fn(f[None], block[r:r + 1], int(pos[r])))
