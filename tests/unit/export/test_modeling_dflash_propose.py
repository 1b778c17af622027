"""The exported DFlash2 drafter driven as z-lab's ``dflash_generate`` drives it: the hidden states of the B-1 mask
slots (``model(...)[:, 1 - block_size:]``) and the target's head module go to ``propose`` / ``compute_logits``.
A decoding loop written here after z-lab's (drafter KV cache, target cache cropped after each verify) over an
AutoModel(trust_remote_code) export is lossless and accepts exactly what dflash-eval reports for the same export."""

import inspect
import os

import pytest
import torch
from transformers import DynamicCache

from dflash_dist.export.write import export_checkpoint
from dflash_dist.checkpoint.store import save_checkpoint
from dflash_dist.config import JobConfig, TargetConfig
from dflash_dist.eval.prompts import load_drafter
from dflash_dist.eval.spec_decode import evaluate_prompts
from dflash_dist.eval.target_runner import crop_cache
from dflash_dist.targets.hf import TINY_DIR, build_target_model
from tests.unit.export.test_export_dflash2 import random_dflash2

V, H, BLOCK, MASK, LAYER_IDS = 12, 32, 4, 11, [1, 3, 4]   # a small vocabulary: random drafts get accepted
TARGET_HF = dict(model_type="qwen3", vocab_size=V, hidden_size=H, intermediate_size=96, num_hidden_layers=6,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
                 rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0,
                 pad_token_id=0)
MAX_NEW = 24
PROMPTS = [[t % (V - 1) for t in p] for p in ([5, 9, 17, 2], [40, 41, 42, 43, 44, 45, 46], [7], [11, 3, 11, 3, 11],
                                               [1, 2, 3, 4, 5, 6, 7, 8])]


def _target():
    tcfg = TargetConfig(hf_config=dict(TARGET_HF), tokenizer=TINY_DIR, layer_ids=LAYER_IDS, init_seed=4,
                        dtype="float32")
    return build_target_model(tcfg, "cpu"), tcfg


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(target, AutoModel of a DFlash2 export, the export's directory): every drafter weight random."""
    from transformers import AutoModel
    tmp = tmp_path_factory.mktemp("propose")
    target, tcfg = _target()
    spec, model, _ = random_dflash2(target.config.to_dict(), BLOCK, len(LAYER_IDS))
    settings = spec.to_meta()
    meta = {"cursor": 5, "total_messages": 10, "layer_ids": LAYER_IDS, "mask_token_id": MASK,
            "drafter_config": settings.pop("model"), "drafter": settings, "target_config": target.config.to_dict(),
            "tokenizer": TINY_DIR, "job_config": JobConfig(target=tcfg).to_dict(), "final": False}
    ckpt = save_checkpoint(str(tmp / "run"), 3, model.state_dict(), None, meta)
    # transformers caches remote code per directory basename: one name per process
    out = export_checkpoint(ckpt, str(tmp / f"d2propose_{os.getpid()}"), dtype="float32", tokenizer=False)
    auto = AutoModel.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()
    assert type(auto).__name__ == "DFlash2DraftModel" and type(auto).__module__.endswith("modeling_dflash")
    return target, auto, out


def _features(hidden_states, layer_ids):
    """The captured layer features: HF ``hidden_states[i + 1]`` of each target layer id, concatenated."""
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)


@torch.inference_mode()
def zlab_style_generate(model, target, prompt, max_new_tokens):
    """Greedy decoding as z-lab's ``dflash_generate`` (dflash/model.py) does it, step by step: prefill the target;
    per block, the drafter on [anchor, MASK x (B-1)] with its KV cache over the new context rows, the B-1 mask rows
    kept, ``propose(rows, anchors, target.lm_head, 0.0)``, one target forward to verify, the longest matching
    prefix plus the target's own token, both caches cropped (``crop_cache``: the same cut in transformers 4.x
    and 5.x). Stops once ``max_new_tokens`` tokens are out (dflash-eval's rule). Returns (new token ids,
    acceptance lengths)."""
    cache_kw = "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"
    block_size, mask_id = model.block_size, model.mask_token_id
    ids = torch.tensor([prompt])
    n_in = ids.shape[1]
    max_length = n_in + max_new_tokens
    output_ids = torch.full((1, max_length + block_size), mask_id, dtype=torch.long)
    position_ids = torch.arange(output_ids.shape[1])[None]
    cache_target, cache_draft = DynamicCache(), DynamicCache()
    out = target(ids, position_ids=position_ids[:, :n_in], use_cache=True, output_hidden_states=True,
                 **{cache_kw: cache_target})
    output_ids[:, :n_in] = ids
    output_ids[:, n_in] = out.logits[:, -1].argmax(-1)
    target_hidden = _features(out.hidden_states, model.target_layer_ids)
    start, acceptance_lengths = n_in, []
    while start + 1 < max_length:          # tokens out so far: start - n_in + 1
        block = output_ids[:, start:start + block_size].clone()
        draft_hidden = model(target_hidden=target_hidden, noise_embedding=target.model.embed_tokens(block),
                             position_ids=position_ids[:, cache_draft.get_seq_length():start + block_size],
                             past_key_values=cache_draft, use_cache=True)[:, 1 - block_size:, :]
        crop_cache(cache_draft, start)
        tokens, candidates, q = model.propose(draft_hidden, block[:, 0], target.lm_head, 0.0)
        assert tokens.shape == (1, block_size - 1) and q.shape == candidates.shape
        block[:, 1:] = tokens
        out = target(block, position_ids=position_ids[:, start:start + block_size], use_cache=True,
                     output_hidden_states=True, **{cache_kw: cache_target})
        posterior = out.logits.argmax(-1)
        acc = int((block[:, 1:] == posterior[:, :-1]).cumprod(dim=1).sum(dim=1)[0])
        output_ids[:, start:start + acc + 1] = block[:, :acc + 1]
        output_ids[:, start + acc + 1] = posterior[:, acc]
        start += acc + 1
        crop_cache(cache_target, start)
        acceptance_lengths.append(acc + 1)
        target_hidden = _features(out.hidden_states, model.target_layer_ids)[:, :acc + 1]
    return output_ids[0, n_in:min(start + 1, max_length)].tolist(), acceptance_lengths


@torch.inference_mode()
def target_greedy(target, prompt, max_new_tokens):
    ids = torch.tensor([prompt])
    for _ in range(max_new_tokens):
        ids = torch.cat([ids, target(ids).logits[:, -1:].argmax(-1)], dim=1)
    return ids[0, len(prompt):].tolist()


def test_zlab_decoding_loop_on_the_export_is_lossless_and_matches_dflash_eval(setup):
    target, auto, export_dir = setup
    loaded = load_drafter(export=export_dir)
    assert loaded.block_size == BLOCK and loaded.layer_ids == LAYER_IDS and loaded.mask_token_id == MASK
    ours = evaluate_prompts(target, loaded.drafter, None, None, PROMPTS, loaded.layer_ids, loaded.mask_token_id,
                            loaded.block_size, MAX_NEW, keep_outputs=True)
    assert ours["lossless_fraction"] == 1.0
    longest = 0
    for prompt, row in zip(PROMPTS, ours["per_prompt"]):
        tokens, lengths = zlab_style_generate(auto, target, prompt, MAX_NEW)
        assert tokens == target_greedy(target, prompt, MAX_NEW) == row["tokens"]
        assert lengths == row["acceptance_lengths"]
        longest = max(longest, *lengths)
    assert longest >= 3     # drafts past the first slot accepted: the proposals are compared, not only the output


def test_propose_takes_the_mask_rows_or_the_whole_block_and_refuses_other_lengths(setup):
    target, auto, _ = setup
    g = torch.Generator().manual_seed(3)
    block = torch.randn(2, BLOCK, H, generator=g)
    anchors = torch.tensor([5, 9])
    head = target.lm_head
    with torch.no_grad():
        zlab = auto.propose(block[:, 1:], anchors, head, 0.0)          # z-lab: the B-1 mask slots
        whole = auto.propose(block, anchors, head, 0.0)                # the whole block, anchor row first
        weight = auto.propose(block[:, 1:], anchors, head.weight, 0.0)  # the head's weight tensor
        assert zlab[0].shape == (2, BLOCK - 1)
        for a, b, c in zip(zlab, whole, weight):
            assert torch.equal(a, b) and torch.equal(a, c)
        torch.testing.assert_close(auto.compute_logits(block[:, 1:], head),
                                   auto.compute_logits(block[:, 1:], head.weight), rtol=0, atol=0)
        # a head that is only a callable (no weight to read) is called
        called = auto.propose(block[:, 1:], anchors, lambda h: head(h), 0.0)
        assert torch.equal(called[0], zlab[0]) and torch.equal(called[1], zlab[1])
        for rows in (BLOCK - 2, BLOCK + 1, 2 * BLOCK):
            with pytest.raises(ValueError, match="mask"):
                auto.propose(torch.randn(2, rows, H), anchors, head, 0.0)
        with pytest.raises(ValueError, match="anchor ids"):
            auto.propose(block[:, 1:], torch.tensor([5]), head, 0.0)
        with pytest.raises(TypeError, match="lm_head"):
            auto.compute_logits(block[:, 1:], "lm_head")
