"""Greedy speculative decoding: lossless against the target's greedy decoding, exact acceptance accounting,
train/eval feature and mask parity, τ arithmetic, and the dflash-eval CLI end to end."""

import json
import time

import helpers.tiny_decoding as helper
import pytest
import torch

from dflash_dist.eval.spec_decode import (
    TargetRunner,
    evaluate_prompts,
    evaluate_steps,
    format_table,
    make_dflash_draft_fn,
    pack_state,
    run_to_end,
    speculative_generate,
    speculative_steps,
    summarize_acceptance,
    target_greedy,
    unpack_state_,
)
from dflash_dist.model.drafter import DFlashDrafter, DrafterModelConfig
from dflash_dist.targets.hf import head_weights
from dflash_dist.model.masks import dense_mask
from dflash_dist.roles.target_rank.capture import FeatureCapture

V, H, L, B, MASK = 96, 32, 5, 4, 95
LAYER_IDS = [1, 2, 4]          # 4 = last layer: taken after the final norm, as in training


def tiny_target(seed=0, dtype=torch.float64):
    return helper.tiny_target(V, H, L, seed, dtype)


def tiny_drafter(target, seed=0, dtype=torch.float64):
    return helper.tiny_drafter(target, len(LAYER_IDS), B, seed, dtype)


@pytest.fixture(scope="module")
def target():
    return tiny_target()


def prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V - 1, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def oracle(prompt, greedy, wrong_slot=None):
    """A perfect drafter (the target's own continuation), optionally wrong at one block slot."""
    full = list(prompt) + list(greedy) + [0] * (2 * B)

    def draft(ctx, block, p):
        assert ctx.shape[1] == p and int(block[0, 0]) == full[p]  # context = features of positions < p
        d = torch.tensor(full[p + 1:p + B])
        if wrong_slot is not None:
            d[wrong_slot - 1] = (d[wrong_slot - 1] + 1) % V
        return d
    return draft


@pytest.mark.parametrize("use_cache", [True, False])
def test_random_drafter_is_lossless(target, use_cache):
    drafter = tiny_drafter(target)
    for prompt in prompts(3):
        toks, st = speculative_generate(target, drafter, None, None, prompt, LAYER_IDS, MASK, B, 20, [],
                                        use_cache=use_cache)
        assert toks == target_greedy(target, prompt, 20, [], use_cache=use_cache)
        assert len(toks) == 20 and st["stop"] == "max_new_tokens"
        assert all(1 <= a <= B for a in st["acceptance_lengths"]) and st["tau"] >= 1
        assert 1 + sum(st["acceptance_lengths"][:-1]) < 20 <= 1 + sum(st["acceptance_lengths"])
        assert st["accepted_per_position"] == [sum(a > k for a in st["acceptance_lengths"]) for k in range(1, B)]


def test_greedy_reference_matches_hf_generate(target):
    prompt = prompts(1, seed=3)[0]
    ids = torch.tensor([prompt])
    hf = target.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                         temperature=None, top_p=None, top_k=None, pad_token_id=0, eos_token_id=None)
    assert hf[0, len(prompt):].tolist() == target_greedy(target, prompt, 16) == target_greedy(target, prompt, 16,
                                                                                                use_cache=False)


@pytest.mark.parametrize("use_cache", [True, False])
def test_oracle_drafters_give_exact_acceptance(target, use_cache):
    prompt = prompts(1, seed=1)[0]
    n = 1 + 5 * B                                   # bonus + 5 full blocks
    greedy = target_greedy(target, prompt, n + B)
    toks, st = speculative_generate(target, oracle(prompt, greedy), None, None, prompt, LAYER_IDS, MASK, B, n, [],
                                    use_cache=use_cache)
    assert toks == greedy[:n] and st["acceptance_lengths"] == [B] * 5 and st["tau"] == B
    for slot in range(1, B):                         # wrong at `slot`: slots < slot accepted, then the target's token
        toks, st = speculative_generate(target, oracle(prompt, greedy, slot), None, None, prompt, LAYER_IDS, MASK,
                                        B, 13, [], use_cache=use_cache)
        assert toks == greedy[:13]
        assert set(st["acceptance_lengths"]) == {slot}
        assert st["accepted_per_position"] == [st["steps"] if k < slot else 0 for k in range(1, B)]


def test_eos_stops_both_paths_at_the_same_token(target):
    drafter = tiny_drafter(target, seed=2)
    prompt = prompts(1, seed=5)[0]
    free = target_greedy(target, prompt, 30)
    eos = free[7]
    ref = target_greedy(target, prompt, 30, [eos])
    toks, st = speculative_generate(target, drafter, None, None, prompt, LAYER_IDS, MASK, B, 30, [eos])
    assert toks == ref and toks[-1] == eos and len(toks) <= 8 and st["stop"] == "eos"
    wrong = lambda ctx, block, p: torch.full((B - 1,), MASK)  # noqa: E731  never accepted: tau exactly 1
    toks, st = speculative_generate(target, wrong, None, None, prompt, LAYER_IDS, MASK, B, 30, [eos])
    assert toks == ref and st["tau"] == 1.0 and st["steps"] == len(toks) - 1


def test_features_and_draft_match_training(target):
    """TargetRunner features == FeatureCapture's (what the drafter trained on), and the eval draft equals the
    training forward of one block at anchor p over a zero-padded context (masks.dense_mask rule)."""
    ids = torch.tensor([prompts(1, seed=7)[0] + [5, 6, 7, 8, 9, 10]])
    s = ids.shape[1]
    cap = FeatureCapture(target, LAYER_IDS)
    train_feats = cap(ids, torch.tensor([s]))
    runner = TargetRunner(target, LAYER_IDS)
    with runner.attached():                          # FeatureCapture's hooks are set aside meanwhile
        logits, feats = runner(ids, 0)
    assert torch.equal(feats[0], train_feats)
    assert torch.equal(cap(ids, torch.tensor([s])), train_feats)  # ...and back afterwards
    cap.close()
    assert torch.allclose(logits, target(ids).logits)  # a plain forward would trip the capture's hooks before

    drafter = tiny_drafter(target, seed=3)
    embed, head = head_weights(target)
    p = s - 3
    blk = torch.full((1, B), MASK)
    blk[0, 0] = ids[0, p]
    got = make_dflash_draft_fn(drafter, embed, head)(feats[:, :p], blk, p)
    pad = 16                                          # training: context padded to a bucket, anchor p masks the rest
    ctx = torch.zeros(1, pad, feats.shape[-1], dtype=feats.dtype)
    ctx[:, :s] = feats
    mask = dense_mask(torch.tensor([[p]]), torch.tensor([[True]]), pad, B)
    with torch.no_grad():
        hid = drafter(torch.nn.functional.embedding(blk, embed), ctx, torch.arange(pad)[None],
                      torch.arange(p, p + B)[None], mask)
    assert torch.equal(got, (hid[0, 1:] @ head.T).argmax(-1))
    flex = DFlashDrafter(drafter.config, "flex").to(torch.float64)   # a training (flex) drafter drafts via SDPA
    flex.load_state_dict(drafter.state_dict())
    assert torch.equal(make_dflash_draft_fn(flex, embed, head)(feats[:, :p], blk, p), got) and flex.backend == "flex"


def test_summarize_acceptance_by_hand():
    r = summarize_acceptance([[4, 1, 2], [3], []], 4)
    # [3] ended in its first block: out of z-lab's tau by default, in the pooled figure always
    assert r["tau"] == pytest.approx(7 / 3) and r["tau_pooled"] == pytest.approx(10 / 4)
    assert r["acceptance_length"] == r["tau_pooled"] and r["tau_all_prompts"] == pytest.approx((7 / 3 + 3) / 2)
    r = summarize_acceptance([[4, 1, 2], [3], []], 4, exclude_one_step=False)
    assert r["tau"] == pytest.approx((7 / 3 + 3) / 2) and r["tau_pooled"] == pytest.approx(10 / 4)
    assert r["per_position_acceptance"] == pytest.approx([3 / 4, 2 / 4, 1 / 4])
    assert r["per_position_conditional"] == pytest.approx([3 / 4, 2 / 3, 1 / 2])
    assert r["acceptance_histogram"] == pytest.approx([0, 0.25, 0.25, 0.25, 0.25])
    assert r["total_steps"] == 4
    empty = summarize_acceptance([[]], 4)
    assert empty["tau"] is None and empty["per_position_acceptance"] == [None] * 3
    with pytest.raises(ValueError):
        summarize_acceptance([[5]], 4)


def test_tau_both_ways_on_a_hand_made_trace():
    """The README's situation: short prompts that end inside their first block weigh as much as long ones in
    z-lab's tau (mean over prompts of per-prompt means) and inflate it; the headline is the pooled acceptance
    length (tokens / verify steps), and z-lab's tau leaves those prompts out unless asked to count them."""
    B = 16
    trace = [[12], [9], [16], [2, 1, 3, 1, 2, 1, 1, 3], [1, 2, 1, 1, 2, 1], [3, 1, 2, 2]]
    r = summarize_acceptance(trace, B, exclude_one_step=False)
    per_prompt = [12, 9, 16, 14 / 8, 8 / 6, 8 / 4]
    assert r["tau"] == pytest.approx(sum(per_prompt) / 6)             # 7.01: z-lab's "Average Acceptance length"
    assert r["tau_pooled"] == pytest.approx((12 + 9 + 16 + 14 + 8 + 8) / (1 + 1 + 1 + 8 + 6 + 4))  # 67/21 = 3.19
    assert r["acceptance_length"] == r["tau_pooled"] and r["tau_all_prompts"] == r["tau"]
    assert r["prompts_one_step"] == 3 and r["prompts_scored"] == 6 and r["total_steps"] == 21
    assert r["prompts_in_tau"] == 6 and r["one_step_excluded"] is False
    m = sum(per_prompt) / 6
    sd = (sum((x - m) ** 2 for x in per_prompt) / 5) ** 0.5
    assert r["tau_stderr"] == pytest.approx(sd / 6 ** 0.5)
    # by default the one-step prompts are counted and left out of z-lab's tau: it comes close to the pooled figure
    d = summarize_acceptance(trace, B)
    assert d["one_step_excluded"] is True and d["prompts_one_step"] == 3 and d["prompts_in_tau"] == 3
    assert d["tau"] == pytest.approx(sum(per_prompt[3:]) / 3) and abs(d["tau"] - d["acceptance_length"]) < 1.5
    assert d["acceptance_length"] == r["acceptance_length"] and d["tau_all_prompts"] == pytest.approx(r["tau"])
    # without the one-step prompts both figures are close: the gap comes from how prompts are weighed
    r2 = summarize_acceptance(trace[3:], B)
    assert r2["prompts_one_step"] == 0 and abs(r2["tau"] - r2["tau_pooled"]) < 0.2
    assert summarize_acceptance([[3]], B)["tau"] is None                       # its only prompt left out
    assert summarize_acceptance([[3]], B, exclude_one_step=False)["tau_stderr"] is None
    table = format_table({**d, "n_prompts": 6, "block_size": B, "max_new_tokens": 64, "mean_new_tokens": 11.2,
                          "lossless_fraction": None})
    first, second, third = table.splitlines()[:3]
    assert "ended in their first block 3" in first
    assert second.startswith("acceptance length (pooled") and "3.190" in second
    assert "z-lab" in third and "left out" in third and "all prompts: 7.014" in third
    assert "max_new_tokens 64" in table and "prompts 6" in table


def test_evaluate_prompts_with_capture_attached(target):
    """On a target rank the training FeatureCapture stays registered: evaluation must not trip its hooks.
    The drafter arrives as one flat tensor (what the leader would dist.send)."""
    cap = FeatureCapture(target, LAYER_IDS)
    sent = tiny_drafter(target, seed=4)
    drafter = unpack_state_(tiny_drafter(target, seed=99), pack_state(sent, torch.float64)).train()
    assert all(torch.equal(a, b) for a, b in zip(drafter.state_dict().values(), sent.state_dict().values()))
    with pytest.raises(ValueError):
        unpack_state_(drafter, torch.zeros(3))
    res = evaluate_prompts(target, drafter, None, None, prompts(3, seed=9), LAYER_IDS, MASK, B, 12, [0])
    assert res["n_prompts"] == 3 and res["lossless_fraction"] == 1.0 and res["tau"] >= 1
    assert len(res["per_position_acceptance"]) == B - 1 and drafter.training  # mode restored
    assert sum(r["new_tokens"] for r in res["per_prompt"]) == pytest.approx(3 * res["mean_new_tokens"])
    ids = torch.tensor([[1, 2, 3]])
    assert cap(ids, torch.tensor([3])).shape == (3, len(LAYER_IDS) * H)
    cap.close()


def _same_result(a, b):
    """Everything but timings."""
    strip = lambda r: {k: v for k, v in r.items() if k not in ("wall_s", "tokens_per_s")}  # noqa: E731
    return strip(a) == strip(b)


def run_sliced(gen, between=lambda k: None):
    """Advance an evaluation generator to its end, calling ``between(k)`` after its k-th slice (k = 0, 1, ...);
    returns (its result, slices)."""
    k = 0
    while True:
        try:
            next(gen)
        except StopIteration as e:
            return e.value, k
        between(k)
        k += 1


@pytest.mark.parametrize("use_cache", [True, False])
def test_sliced_evaluation_equals_unsliced(target, use_cache):
    """evaluate_steps advanced one slice at a time == evaluate_prompts; it yields after the prefill and after each
    verify step of every prompt, and the drafter's mode is restored when it finishes."""
    drafter = tiny_drafter(target, seed=5).train()
    ps = prompts(3, seed=11)
    args = (target, drafter, None, None, ps, LAYER_IDS, MASK, B, 14, [0])
    ref = evaluate_prompts(*args, use_cache=use_cache, keep_outputs=True)
    assert drafter.training
    def between(_):
        assert not drafter.training and not torch.is_inference_mode_enabled()  # caller's mode between slices
    res, slices = run_sliced(evaluate_steps(*args, use_cache=use_cache, keep_outputs=True), between)
    assert drafter.training
    assert res["tau"] == ref["tau"] and res["lossless_fraction"] == 1.0 and _same_result(res, ref)
    assert [r["tokens"] for r in res["per_prompt"]] == [r["tokens"] for r in ref["per_prompt"]]
    assert [r["acceptance_lengths"] for r in res["per_prompt"]] == [r["acceptance_lengths"] for r in ref["per_prompt"]]
    assert slices == sum(r["steps"] + 1 for r in ref["per_prompt"]) > len(ps)

    toks, st = run_to_end(speculative_steps(target, drafter, None, None, ps[0], LAYER_IDS, MASK, B, 14, [0],
                                            use_cache=use_cache))
    assert toks == ref["per_prompt"][0]["tokens"] and st["acceptance_lengths"] == ref["per_prompt"][0][
        "acceptance_lengths"]


def test_sliced_evaluation_closed_early_restores_drafter(target):
    drafter = tiny_drafter(target, seed=5).train()
    gen = evaluate_steps(target, drafter, None, None, prompts(2, seed=11), LAYER_IDS, MASK, B, 14, [0])
    next(gen)
    next(gen)
    assert not drafter.training
    gen.close()
    assert drafter.training


def test_capture_forward_between_slices(target):
    """A training FeatureCapture stays registered and works between slices (the evaluator's hooks are not held
    across a yield), and the evaluation's result is unchanged by those forwards."""
    drafter = tiny_drafter(target, seed=6)
    ps = prompts(2, seed=13)
    args = (target, drafter, None, None, ps, LAYER_IDS, MASK, B, 12, [0])
    ref = evaluate_prompts(*args, keep_outputs=True)
    cap = FeatureCapture(target, LAYER_IDS)
    try:
        ids = torch.tensor([prompts(1, seed=14)[0] + [7, 8, 9]])
        lens = torch.tensor([ids.shape[1]])
        alone = cap(ids, lens).clone()              # no generator alive
        captures = []

        def between(k):
            if k < 6:                               # the same forward a training step would run
                assert torch.equal(cap(ids, lens), alone)
                captures.append(k)
        res, _ = run_sliced(evaluate_steps(*args, keep_outputs=True), between)
        assert len(captures) == 6
        assert _same_result(res, ref) and res["lossless_fraction"] == 1.0
        assert torch.equal(cap(ids, lens), alone)
    finally:
        cap.close()


def test_sliced_wall_time_excludes_suspension(target):
    drafter = tiny_drafter(target, seed=7)
    args = (target, drafter, None, None, prompts(1, seed=15), LAYER_IDS, MASK, B, 8, [])
    ref = evaluate_prompts(*args, check_lossless=False)
    res, slices = run_sliced(evaluate_steps(*args, check_lossless=False), lambda k: k == 0 and time.sleep(0.5))
    assert slices >= 1 and _same_result(res, ref)
    assert res["wall_s"] < ref["wall_s"] + 0.4
    spec_s = res["mean_new_tokens"] * res["n_prompts"] / res["tokens_per_s"]   # speculative running time
    assert spec_s < ref["wall_s"] + 0.4
    spec = speculative_steps(target, drafter, None, None, prompts(1, seed=15)[0], LAYER_IDS, MASK, B, 8, [])
    next(spec)
    time.sleep(0.5)
    _, st = run_to_end(spec)
    assert st["wall_s"] < 0.4 + ref["wall_s"]


def test_dflash_eval_cli(tmp_path):
    """checkpoint -> dflash-eval --checkpoint and export -> dflash-eval --export on a random-init target."""
    from dflash_dist.export.write import export_checkpoint
    from dflash_dist.checkpoint.store import save_checkpoint
    from dflash_dist.cli.eval import main as eval_main
    from dflash_dist.config import JobConfig, TargetConfig
    from dflash_dist.targets.hf import TINY_DIR, build_target_model
    hf = dict(model_type="qwen3", vocab_size=2048, hidden_size=H, intermediate_size=64, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512, rope_theta=1e4)
    tcfg = TargetConfig(hf_config=hf, tokenizer=TINY_DIR, layer_ids=[1, 2], init_seed=1, dtype="float32")
    tgt = build_target_model(tcfg, "cpu")
    dcfg = DrafterModelConfig.from_target(tgt.config, num_layers=1, num_feature_layers=2, block_size=B)
    drafter = DFlashDrafter(dcfg, "sdpa")
    meta = {"layer_ids": [1, 2], "mask_token_id": 3, "block_size": B, "drafter_config": dcfg.__dict__,
            "target_config": tgt.config.to_dict(), "tokenizer": TINY_DIR,
            "job_config": JobConfig(target=tcfg).to_dict(), "chat_template_kwargs": {"enable_thinking": False}}
    ckpt = save_checkpoint(str(tmp_path / "run"), 1, drafter.state_dict(), None, meta)
    rows = tmp_path / "p.jsonl"
    rows.write_text("\n".join(json.dumps(r) for r in [
        {"messages": [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi"}]},
        {"prompt": "How are you?"}, {"messages": []}]) + "\n")
    out = tmp_path / "eval.json"
    assert eval_main(["--checkpoint", ckpt, "--prompts", str(rows), "--max-new-tokens", "6", "--out", str(out)]) == 0
    res = json.load(open(out))
    assert res["n_prompts"] == 2 and res["lossless_fraction"] == 1.0 and res["eos_ids"] == [0, 2]
    assert res["chat_template_kwargs"] == {"enable_thinking": False}  # what training recorded
    assert res["prompts_one_step"] is not None and res["tau_pooled"] is not None
    assert res["acceptance_length"] == res["tau_pooled"] and res["one_step_excluded"] is True
    exp = export_checkpoint(ckpt, str(tmp_path / "export"), dtype="float32")
    out2 = tmp_path / "eval2.json"
    assert eval_main(["--export", exp, "--prompts", str(rows), "--max-new-tokens", "6", "--out", str(out2)]) == 0
    res2 = json.load(open(out2))
    assert res2["chat_template_kwargs"] == {"enable_thinking": False}  # recorded in the export too
    assert [r["acceptance_lengths"] for r in res2["per_prompt"]] == [r["acceptance_lengths"] for r in res["per_prompt"]]
    out3 = tmp_path / "eval3.json"  # the prompts decoded together: each as alone
    assert eval_main(["--export", exp, "--prompts", str(rows), "--max-new-tokens", "6", "--batch-size", "2",
                      "--out", str(out3)]) == 0
    res3 = json.load(open(out3))
    assert res3["batch_size"] == 2 and res3["lossless_fraction"] == 1.0
    assert [r["acceptance_lengths"] for r in res3["per_prompt"]] == [r["acceptance_lengths"] for r in res["per_prompt"]]


def test_spread_subset_draws_across_the_held_out_set():
    from dflash_dist.eval.prompts import spread_subset
    rows = list(range(256))
    got = spread_subset(rows, 16)
    assert len(got) == 16 and got == sorted(got) and got == spread_subset(rows, 16)  # fixed seed, corpus order kept
    assert max(got) >= 128 and min(got) < 128      # not the front of the corpus
    assert spread_subset(rows[:10], 16) == rows[:10]
