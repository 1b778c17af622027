"""planning/training_state.py: the drafter's training state in the memory plan: DDP's whole copies, FSDP2's shards
over the drafter ranks and the moment of its step that peaks, and the choice between them (``drafter.parallel=auto``)
for a drafter too large for DDP."""

from __future__ import annotations

from helpers.standalone_drafter import compose_job_config

from dflash_dist.job import check_job_config
from dflash_dist.planning import limits as L
from dflash_dist.planning import memory as M
from dflash_dist.planning import training_state as TS


def _n_h8192(layers: int = 5) -> int:
    """Trainable parameters of the DFlash drafter of a hidden-8192 target, from its shapes: per layer q/o (64 heads of
    128), k/v (8 KV heads), gate/up/down (28,672), input/post-attention norms, q/k norms; fc (5 feature layers ->
    H) and two norms."""
    H, A, KV, d, inter = 8192, 64 * 128, 8 * 128, 128, 28672
    layer = 2 * H * A + 2 * H * KV + 3 * H * inter + 2 * H + 2 * d
    return layers * layer + 5 * H * H + 2 * H


def test_fsdp_divides_the_training_state_over_the_drafters():
    cfg = compose_job_config([])
    c = check_job_config(cfg, 3, "cpu")
    tc, spec = c["text_config"], c["drafter"]
    ddp = M.drafter_plan(cfg, tc, spec, "cpu", num_drafters=3)
    n = ddp.parts["parameters"] // 4
    u = TS.drafter_units(spec, 3)
    assert u["total"] == n and len(u["layers"]) == 2 and u["root"] == n - sum(u["layers"])
    for D in (2, 3):
        f = M.drafter_plan(cfg, tc, spec, "cpu", num_drafters=D, parallel="fsdp")
        shard = f.parts["parameters (shard)"] // 4
        assert n / D <= shard <= n / D * 1.01  # each tensor split on its first dimension, padded to D rows
        assert f.parts["AdamW state (shard)"] == 8 * shard
        # the shards are written in the backward as the activations are freed: only their excess adds to the peak
        acts = sum(f.parts[k] for k in M.step_activations(cfg, spec, "cpu", 1, 1, 4, 4))
        assert f.parts["gradients (shard)"] == max(0, 4 * shard - acts)
        # two anchor groups: the first group's backward keeps whole gradients unreduced, the shards come in full
        g2 = M.drafter_plan(compose_job_config(["drafter.tuning.micro_batches=2"]), tc, spec, "cpu", num_drafters=D,
                            parallel="fsdp")
        assert g2.parts["unreduced gradients (earlier anchor groups)"] == 4 * n
        assert g2.parts["gradients (shard)"] == 4 * shard
        # fp32 on CPU. The peak is the larger of two moments: the forward's end (the loss's chunk; only the root's
        # weights gathered) and the backward's start (the loss freed; the root, a layer and the next gathered, the
        # layer's gradients and their reduce-scatter's output)
        layer = max(u["layers"])
        forward_end = ddp.parts["loss"] + 4 * u["root"]
        backward_start = 4 * (u["root"] + 2 * layer) + 4 * layer * (1 + 1 / D)
        assert forward_end >= backward_start  # the tiny drafter's loss (its chunk of logits) outweighs its weights
        assert f.parts["loss"] == ddp.parts["loss"] and f.parts["gathered weights"] == 4 * u["root"]
        assert "gathered gradients" not in f.parts
        assert "parameters" not in f.parts and f.parts["layer activations"] == ddp.parts["layer activations"]
        assert "more drafter ranks" in f.knobs["AdamW state (shard)"]
    assert "drafter.parallel=fsdp" in ddp.knobs["AdamW state"]


def test_the_h8192_drafter_needs_fsdp_on_80_gib_cards(monkeypatch):
    """The paper's drafter of a Llama-3.x-70B-shaped target: 4.62B parameters; DDP's fp32 weights, gradients (and
    DDP's bucket copy) and AdamW moments alone are 20 bytes each, more than an 80 GiB card; FSDP2 over 8 drafters
    holds 16/8 bytes of each and the step fits."""
    cfg = compose_job_config(["target=llama3_70b_random", "drafter=dflash_h8192", "train.memory_check=off"])
    c = check_job_config(cfg, None, "cuda")
    tc, spec = c["text_config"], c["drafter"]
    n = _n_h8192()
    assert TS.drafter_units(spec)["total"] == n and 4.6e9 < n < 4.65e9
    ddp = M.drafter_plan(cfg, tc, spec, "cuda", num_drafters=8, parallel="ddp")
    fsdp = M.drafter_plan(cfg, tc, spec, "cuda", num_drafters=8, parallel="fsdp")
    card = 80 * M.GiB
    assert ddp.parts["parameters"] + ddp.parts["gradients"] + ddp.parts["AdamW state"] == 20 * n > card
    assert ddp.total > card
    state = sum(fsdp.parts[k] for k in ("parameters (shard)", "AdamW state (shard)"))
    assert 12 * n / 8 <= state <= 12 * n / 8 * 1.001
    assert 0 <= fsdp.parts["gradients (shard)"] <= 4 * n / 8 * 1.001
    # the backward's start is its peak: gathered in bf16, the root (fc, 5 x 8192 -> 8192), a layer and the next
    # (prefetched); the layer's gradients in fp32 and their reduce-scatter's output (an eighth); the loss freed.
    # The compiled layers on bf16 weights keep less than the eager count DDP's plan uses.
    layer = (n - 5 * 8192 * 8192 - 2 * 8192) // 5
    assert fsdp.parts["gathered weights"] == 2 * (5 * 8192 * 8192 + 2 * 8192 + 2 * layer)
    assert fsdp.parts["gathered gradients"] == int(4 * layer * (1 + 1 / 8))
    assert "loss" not in fsdp.parts and "loss" in ddp.parts
    assert fsdp.parts["layer activations"] == int(TS.COMPILED_BF16_LAYERS * ddp.parts["layer activations"])
    assert fsdp.total < 0.9 * card  # fits without the 10% warning
    # auto: the memory check of a 16-GPU job (8 target + 8 drafter ranks) on 80 GiB cards picks FSDP, and it fits
    monkeypatch.setattr(L, "device_memory", lambda device: (card, "an 80 GiB GPU's memory"))
    monkeypatch.setattr(L, "address_space_left", lambda: None)
    auto = compose_job_config(["target=llama3_70b_random", "drafter=dflash_h8192", "drafter.parallel=auto",
                               "topology.target_ranks=8", "target.tensor_parallel=8", "target.quantization=fp8"])
    out = M.check_memory(auto, tc, c["hf_config"], spec, "cuda", 5, 16, steps=M.largest_steps(auto))
    assert out["parallel"] == "fsdp" and out["problems"] == []
    assert out["plans"]["drafter"].total == fsdp.total
    assert M.choose_parallel(auto, c["hf_config"], spec, "cuda", 5, 8)[0] == "fsdp"
    # the 8B drafter (1.05B parameters) keeps DDP at the 3072-token step of docs/benchmarks.md
    small = compose_job_config(["target=qwen3_8b_random", "drafter=dflash", "train.memory_check=off"])
    s = check_job_config(small, None, "cuda")
    assert M.choose_parallel(small, s["hf_config"], s["drafter"], "cuda", 5, 8, steps=[(1, 3072)])[0] == "ddp"
    assert M.choose_parallel(small, s["hf_config"], s["drafter"], "cuda", 5, 1)[0] == "ddp"  # nothing to shard


def test_fsdp_on_a_gpu_peaks_at_the_loss_of_an_8b_drafter():
    """Qwen3-8B shape, 512 anchors x 16, 4 samples of 1,024: the end of the forward is FSDP2's peak (measured on
    one H100: docs/benchmarks.md#memory-plan-h100): the compiled loss's chunk of logits and their gradient in
    bf16, only the root's weights gathered, no layer's gradients yet."""
    cfg = compose_job_config(["target=qwen3_8b_random", "drafter=dflash", "train.memory_check=off"])
    c = check_job_config(cfg, None, "cuda")
    spec = c["drafter"]
    f = M.drafter_plan(cfg, c["text_config"], spec, "cuda", steps=[(4, 1024)], parallel="fsdp")
    ddp = M.drafter_plan(cfg, c["text_config"], spec, "cuda", steps=[(4, 1024)], parallel="ddp")
    rows, V, H = 4 * 512 * 16, spec.model.vocab_size, spec.model.hidden_size
    chunk = min(rows, spec.loss.chunk_rows)
    assert f.parts["loss"] == 2 * chunk * V * 2 + rows * H * 4 < ddp.parts["loss"]
    assert f.parts["gathered weights"] == 2 * TS.drafter_units(spec)["root"]
    assert "gathered gradients" not in f.parts
    assert f.total < ddp.total
    # every part a step allocates is one the FSDP2 and colocated moments know
    assert set(M.step_activations(cfg, spec, "cuda", 4, 1024, 2, 2)) <= set(M.STEP_PARTS)
