"""The target's own labels (drafter.loss.labels=target): its greedy next token on the true prefix, from the full
forward, and the block labels the drafter trains on."""

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from dflash_dist.checkpoint.identity import drafter_identity
from dflash_dist.config import ConfigError, DrafterLoss, JobConfig
from dflash_dist.model.blocks import IGNORE_INDEX, make_batch, target_labels
from dflash_dist.model.spec import LossSpec
from dflash_dist.roles.target_rank.capture import FeatureCapture, top_next_tokens


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                      num_key_value_heads=2, num_hidden_layers=6, head_dim=8)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()


def _batch(lengths):
    g = torch.Generator().manual_seed(1)
    samples = [torch.randint(0, 128, (n,), generator=g) for n in lengths]
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    for i, s in enumerate(samples):
        ids[i, :len(s)] = s
    return samples, ids, torch.tensor(lengths)


def _hf_logits(model, samples):
    """Each sample alone through the plain HF model: [T, V] logits of the real tokens, samples in order."""
    with torch.no_grad():
        return torch.cat([model(s[None]).logits[0] for s in samples])


@pytest.mark.parametrize("packing", [False, True])
def test_target_labels_are_hf_greedy_tokens(model, packing):
    """The capture with labels: the same features as without, and at every real token the argmax of the plain
    HF forward's logits (all layers, final norm, lm_head) over the sample alone, padded or packed."""
    samples, ids, lengths = _batch([13, 6, 9])
    cap = FeatureCapture(model, [1, 3], packing=packing)
    try:
        inp = torch.cat(samples)[None] if packing else ids
        feats, greedy, probs = cap.with_labels(inp, lengths)
        plain = cap(inp, lengths)
    finally:
        cap.close()
    ref = _hf_logits(model, samples)
    assert greedy.shape == (28, 1) and probs is None
    assert torch.equal(greedy[:, 0], ref.argmax(-1))
    torch.testing.assert_close(feats, plain, rtol=1e-5, atol=1e-5)


def test_top_k_distribution_is_renormalised_over_the_k(model):
    samples, ids, lengths = _batch([10, 4])
    cap = FeatureCapture(model, [2])
    try:
        _, top, probs = cap.with_labels(ids, lengths, top_k=5, probs=True)
    finally:
        cap.close()
    ref = _hf_logits(model, samples).float()
    want_logits, want_ids = ref.topk(5, -1)
    assert torch.equal(top, want_ids)
    torch.testing.assert_close(probs, torch.softmax(ref, -1).gather(1, want_ids)
                               / torch.softmax(ref, -1).gather(1, want_ids).sum(-1, keepdim=True))
    torch.testing.assert_close(probs.sum(-1), torch.ones(14))
    # in row chunks (LABEL_CHUNK_ROWS) as in one piece
    head = model.get_output_embeddings()
    h = torch.randn(9, 32)
    import dflash_dist.roles.target_rank.capture as capture
    whole = top_next_tokens(h, head, 3, True)
    old, capture.LABEL_CHUNK_ROWS = capture.LABEL_CHUNK_ROWS, 2
    try:
        parts = top_next_tokens(h, head, 3, True)
    finally:
        capture.LABEL_CHUNK_ROWS = old
    assert torch.equal(whole[0], parts[0]) and torch.allclose(whole[1], parts[1])


def test_drafter_trains_on_the_targets_greedy_tokens(model):
    """make_batch with the target's ids: slot k of the block at anchor a is labelled with the HF argmax at
    position a+k-1 (its next token given the true prefix), on the same slots as the data's labels; the data's
    labels are the corpus tokens a+k, which differ (a random-init target does not predict random text)."""
    samples, ids, lengths = _batch([40, 25])
    cap = FeatureCapture(model, [1, 3])
    try:
        feats, greedy, _ = cap.with_labels(ids, lengths)
    finally:
        cap.close()
    flat = torch.cat(samples)
    mask = torch.ones_like(flat, dtype=torch.bool)
    mask[:5] = False  # a prompt: unsupervised slots stay unsupervised
    cu = torch.tensor([0, 40, 65])
    kw = dict(num_anchors=8, block_size=4, mask_token_id=127, ctx_bucket=16)
    spec = LossSpec("decayed_ce", None, 64, False, labels="target")
    msg = SimpleNamespace(target_ids=greedy, target_probs=None, index=0, src=1)
    own = make_batch(flat, mask, cu, feats, generator=torch.Generator().manual_seed(3),
                     **kw, **target_labels(spec, msg, 65))
    data = make_batch(flat, mask, cu, feats, generator=torch.Generator().manual_seed(3), **kw)
    assert torch.equal(own.anchors, data.anchors) and torch.equal(own.block_ids, data.block_ids)
    assert torch.equal(own.labels == IGNORE_INDEX, data.labels == IGNORE_INDEX)
    ref = _hf_logits(model, samples).argmax(-1)
    checked = 0
    for i in range(2):
        for n, a in enumerate(own.anchors[i].tolist()):
            if not own.valid[i, n]:
                continue
            for k in range(1, 4):
                y = int(own.labels[i, n * 4 + k])
                if y != IGNORE_INDEX:
                    assert y == int(ref[int(cu[i]) + a + k - 1])
                    checked += 1
    assert checked > 20
    assert not torch.equal(own.labels, data.labels)


def test_a_message_without_target_labels_is_refused():
    spec = LossSpec("decayed_ce", None, 64, False, labels="target")
    msg = SimpleNamespace(target_ids=None, target_probs=None, index=7, src=2)
    with pytest.raises(RuntimeError, match="message 7 from rank 2 carries no target labels"):
        target_labels(spec, msg, 10)
    assert target_labels(LossSpec("decayed_ce", None, 64, False), msg, 10) == {}
    kl = LossSpec("decayed_ce", None, 64, False, labels="target", kind="kl", kl_top_k=3)
    dry = target_labels(kl, None, 4, torch.tensor([5, 6, 7, 8]))  # a dry step: its own tokens, uniform
    assert dry["target_ids"].shape == (4, 3) and torch.equal(dry["target_ids"][:, 0], torch.tensor([5, 6, 7, 8]))
    assert torch.allclose(dry["target_probs"], torch.full((4, 3), 1 / 3))


def test_loss_settings_are_checked():
    with pytest.raises(ConfigError, match="drafter.loss.labels"):
        DrafterLoss(labels="teacher")
    with pytest.raises(ConfigError, match="set drafter.loss.labels=target"):
        DrafterLoss(kind="kl")
    with pytest.raises(ConfigError, match="kl_top_k"):
        DrafterLoss(labels="target", kind="kl", kl_top_k=0)
    from dflash_dist.config import validate_job
    cfg = JobConfig.from_dict({"target": {"hf_config": {"builtin": "tiny"}},
                               "drafter": {"loss": {"labels": "target", "kind": "kl"},
                                           "tuning": {"loss_on_target": True}}})
    validate_job(cfg, 2, 4, 128, 127)  # kind=kl is served on the target too (the rows carry their top-k)


def test_identity_records_the_label_source_and_kind():
    """Runs on the data's labels keep their hash; another label source or kind is another drafter."""
    def ident(**loss):
        cfg = JobConfig.from_dict({"target": {"hf_config": {"builtin": "tiny"}}, "drafter": {"loss": loss}})
        return drafter_identity(cfg, [1, 3], 127, 32)
    base = ident()
    assert base == ident(labels="data", kind="ce", kl_top_k=7)
    own, kl = ident(labels="target"), ident(labels="target", kind="kl")
    assert len({base["hash"], own["hash"], kl["hash"], ident(labels="target", kind="kl", kl_top_k=5)["hash"]}) == 4
    assert "labels target, loss ce" in own["label"] and "loss kl top-20" in kl["label"]


def test_flops_count_every_layer_and_the_head_with_own_labels(model):
    from dflash_dist.roles.target_rank.trace import capture_flops_fn
    job = SimpleNamespace(layer_ids=[1, 3], hf_config=model.config)
    truncated, full = capture_flops_fn(model, job)([20, 10]), capture_flops_fn(model, job, own_labels=True)([20, 10])
    layers = SimpleNamespace(layer_ids=[5], hf_config=model.config)
    assert full == pytest.approx(capture_flops_fn(model, layers)([20, 10]) + 2 * 32 * 128 * 30)
    assert full > truncated


def test_a_checkpoint_naming_another_label_source_is_refused():
    """meta.json's drafter.loss.{labels, kind, kl_top_k} are checked like every field a file gives; a meta written
    before them (no such keys) still reads."""
    from dflash_dist.checkpoint.safe_io import CheckpointError
    from dflash_dist.checkpoint.validate import _drafter_settings
    ok = {"variant": "dflash", "loss": {"objective": "decayed_ce", "labels": "target", "kind": "kl", "kl_top_k": 8}}
    _drafter_settings("meta.json", "drafter", ok)
    _drafter_settings("meta.json", "drafter", {"variant": "dflash", "loss": {"objective": "decayed_ce"}})
    for key, bad in (("labels", "teacher"), ("kind", "mse"), ("kl_top_k", 0), ("kl_top_k", "8")):
        with pytest.raises(CheckpointError, match=f"drafter.loss.{key}"):
            _drafter_settings("meta.json", "drafter", {"variant": "dflash", "loss": dict(ok["loss"], **{key: bad})})


def test_builtin_original_is_the_packaged_corpus_unregenerated():
    from dflash_dist.data.conversations import builtin_conversations, chatterbot_conversations
    original, regenerated = builtin_conversations("builtin_original"), builtin_conversations()
    assert original == chatterbot_conversations() and original != regenerated
    # the same prompts, other responses (the regenerated file keeps the dialogues' user turns)
    prompts = {c["messages"][0]["content"] for c in regenerated}
    assert sum(c["messages"][0]["content"] in prompts for c in original) > 0.5 * len(original)
