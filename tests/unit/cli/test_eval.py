"""dflash-eval writes its JSON beside the checkpoint or export it read, or to --out; never into the current
directory."""

import json
import os

from dflash_dist.checkpoint.export import export_checkpoint
from dflash_dist.cli.eval import main as eval_main
from tests.unit.checkpoint.test_export import make_checkpoint


def test_result_lands_beside_what_was_evaluated_or_at_out(tmp_path, monkeypatch):
    ckpt, _ = make_checkpoint(tmp_path)
    export = export_checkpoint(ckpt, str(tmp_path / "export"), dtype="float32")
    rows = tmp_path / "p.jsonl"
    rows.write_text(json.dumps({"prompt": "Hello"}) + "\n")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    common = ["--prompts", str(rows), "--max-new-tokens", "4", "--no-lossless-check"]
    assert eval_main(["--checkpoint", ckpt + "/", *common]) == 0
    beside = os.path.normpath(ckpt) + ".eval.json"                   # checkpoints/step_00000007.eval.json
    assert json.load(open(beside))["n_prompts"] == 1
    assert eval_main(["--export", export, *common]) == 0
    assert json.load(open(os.path.normpath(export) + ".eval.json"))["source"]
    out = tmp_path / "results" / "mine.json"
    assert eval_main(["--checkpoint", ckpt, *common, "--out", str(out)]) == 0
    assert json.load(open(out))["n_prompts"] == 1
    assert os.listdir(cwd) == []                                      # nothing written where it ran


class SelectorDrafter:
    """A DFlash drafter proposing with the DFlash2 selector's walk from the block's anchor (the draft step's
    contract: ``set_context(block_ids=...)`` just before ``propose``)."""

    @staticmethod
    def build(seed=0):
        import torch

        from dflash_dist.model.dflash2_selector import CandidateSelector, propose
        from tests.unit.checkpoint.test_export import make_drafter

        model = make_drafter(seed)
        torch.manual_seed(seed)
        model.candidate_selector = CandidateSelector(model.config.hidden_size, model.config.vocab_size, 6)
        with torch.no_grad():
            for p in model.candidate_selector.parameters():   # a selector term as large as the unary logits
                p.normal_(0.0, 1.0)
        model.propose = lambda hidden, lm_head: propose(model.candidate_selector, hidden,
                                                        model.context["block_ids"][:, 0], lm_head, 5)[0]
        return model


def test_the_draft_step_proposes_with_the_selector_walk_from_the_blocks_anchor():
    """The eval's draft step gives ``propose`` the block's anchor: a DFlash2 drafter's proposals are the walk's
    (dflash2_selector.propose on the block's final hidden states from that anchor)."""
    import torch

    from dflash_dist.eval.spec_decode import make_dflash_draft_fn
    from dflash_dist.model.dflash2_selector import propose
    from dflash_dist.model.masks import dense_mask
    from tests.unit.checkpoint.test_export import BLOCK, LAYER_IDS, MASK

    model = SelectorDrafter.build()
    g = torch.Generator().manual_seed(3)
    vocab, hidden_size = model.config.vocab_size, model.config.hidden_size
    embed, head = torch.randn(vocab, hidden_size, generator=g), torch.randn(vocab, hidden_size, generator=g)
    ctx_len = 7
    context = torch.randn(1, ctx_len, len(LAYER_IDS) * hidden_size, generator=g)
    draft = make_dflash_draft_fn(model, embed, head)
    anchor_mattered = False
    for anchor in (11, 900):
        block = torch.tensor([[anchor] + [MASK] * (BLOCK - 1)])
        with torch.no_grad():
            hidden = model(embed[block], context, torch.arange(ctx_len)[None],
                           torch.arange(ctx_len, ctx_len + BLOCK)[None],
                           dense_mask(torch.tensor([[ctx_len]]), torch.tensor([[True]]), ctx_len, BLOCK))
        want = propose(model.candidate_selector, hidden, torch.tensor([anchor]), head, 5)[0][0]
        got = draft(context, block, ctx_len)
        assert torch.equal(got, want)
        other = propose(model.candidate_selector, hidden, torch.tensor([anchor + 1]), head, 5)[0][0]
        anchor_mattered |= not torch.equal(other, want)
    assert anchor_mattered   # a draft step walking from another predecessor would be caught
