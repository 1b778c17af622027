"""drafter.tuning.loss_on_target and drafter.tuning.micro_batches: the lm_head and the loss on the target rank, anchors in groups.

The offloaded loss runs the same function on the same inputs as the local fused loss, so on CPU the trained
weights are bit for bit those of the local run with the same groups; the groups change only the order of sums."""

import json
import os

import torch
from helpers.launch_util import torchrun
from safetensors.torch import load_file

from dflash_dist.comm.head_offload import _ReceivedGrad, head_flops, request_key
from dflash_dist.model.blocks import make_batch, split_anchors
from dflash_dist.model.drafter import DFlashDrafter, DrafterModelConfig
from dflash_dist.model.loss import LossParts, decayed_ce, frozen_head_ce, loss_rows, row_weights, slot_stats
from dflash_dist.model.masks import dense_mask
from dflash_dist.telemetry.step_trace import timeline


def _batch(seed=0, b=3, anchors=8, bsz=4):
    g = torch.Generator().manual_seed(seed)
    lens = [40, 23, 31][:b]
    t = sum(lens)
    cu = torch.tensor([0] + lens).cumsum(0)
    ids = torch.randint(0, 50, (t,), generator=g)
    sup = torch.rand(t, generator=g) > 0.3
    feats = torch.randn(t, 3 * 32, generator=g)
    return make_batch(ids, sup, cu, feats, num_anchors=anchors, block_size=bsz, mask_token_id=49, ctx_bucket=16,
                      generator=g)


def _model(bsz=4):
    torch.manual_seed(0)
    mc = DrafterModelConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            intermediate_size=64, num_layers=2, num_feature_layers=3, block_size=bsz,
                            rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=50, max_position_embeddings=256)
    return DFlashDrafter(mc, "sdpa")


def _forward(model, embed, batch, group):
    mask = dense_mask(group.anchors, group.valid, batch.ctx_len, 4)
    return model(torch.nn.functional.embedding(group.block_ids, embed), batch.features, batch.ctx_positions,
                 group.block_positions, mask)


def test_anchor_groups_give_the_same_outputs_and_loss():
    """Each block sees the context before its anchor and its own block only: splitting the anchors into groups,
    each its own forward over the same context, changes no output row and, up to the order of sums, no loss."""
    batch = _batch()
    model = _model()
    embed, head = torch.randn(50, 32), torch.randn(50, 32)
    whole = _forward(model, embed, batch, batch)
    groups = split_anchors(batch, 2)
    assert [g.block_ids.shape[1] for g in groups] == [16, 16] and groups[1].anchors.shape == (3, 4)
    parts = torch.cat([_forward(model, embed, batch, g) for g in groups], dim=1)
    torch.testing.assert_close(parts, whole, rtol=0, atol=1e-6)
    ref = decayed_ce(whole, head, batch.labels, 4, 3.0, 64)
    split = LossParts.total([decayed_ce(_forward(model, embed, batch, g), head, g.labels, 4, 3.0, 64)
                             for g in groups])
    torch.testing.assert_close(split.loss_sum, ref.loss_sum, rtol=1e-6, atol=0)
    assert torch.equal(split.slot_count, ref.slot_count) and torch.equal(split.slot_correct, ref.slot_correct)
    torch.testing.assert_close(split.weight_sum, ref.weight_sum, rtol=1e-6, atol=0)


def test_received_gradient_is_the_fused_loss_gradient_bit_for_bit():
    """What a drafter does with a reply (the loss sum added to 0, the gradient handed to its rows) against the
    local fused loss, on the same rows: the same loss and the same gradient, bit for bit."""
    torch.manual_seed(1)
    head = torch.randn(50, 32)
    labels = torch.randint(0, 50, (2, 24))
    labels[0, :5] = -100
    hidden = torch.randn(2, 24, 32, requires_grad=True)
    local = decayed_ce(hidden, head, labels, 4, 3.0, 16)
    (local.loss_sum * 0.37).backward()
    g_local, hidden.grad = hidden.grad.clone(), None

    rows, rows_y, rows_w = loss_rows(hidden, labels, 4, 3.0)
    loss_sum, pred, grad = frozen_head_ce(rows.detach(), head, rows_y, row_weights(rows_y, 4, 3.0), 16, False)
    remote = slot_stats(_ReceivedGrad.apply(rows, grad) + loss_sum.float().reshape(1)[0], pred, rows_y, rows_w, 4)
    (remote.loss_sum * 0.37).backward()
    assert torch.equal(remote.loss_sum.detach(), local.loss_sum.detach())
    assert torch.equal(hidden.grad, g_local)
    assert torch.equal(remote.slot_correct, local.slot_correct) and torch.equal(remote.weight_sum, local.weight_sum)


def test_request_keys_and_flops():
    assert request_key(0, 3, 7) == "dflash/head_request/0-3/7" != request_key(1, 3, 7)
    assert head_flops(10, 32, 50) == 4 * 10 * 32 * 50


def _final_weights(run_dir):
    ck = sorted(os.listdir(os.path.join(run_dir, "checkpoints")))[-1]
    return load_file(os.path.join(run_dir, "checkpoints", ck, "model.safetensors"))


def _job(tmp_path, name, *overrides, eval_prompts=0):
    run = tmp_path / name
    r = torchrun(3, ["-m", "dflash_dist.train", f"train.output_dir={run}", "train.max_steps=8",
                     f"train.eval_prompts={eval_prompts}",
                     "logging.log_every=4", "logging.progress_bar=false", "logging.wandb.mode=disabled",
                     *overrides], timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    return run, out


def test_loss_on_target_trains_the_same_weights(tmp_path):
    """1 target + 2 data-parallel drafters, 8 steps, anchors in 2 groups: with the loss on the target the final
    weights equal those of the local loss bit for bit; with the anchors in one group they agree to rounding.
    The target says what it served, and its FLOPs count them."""
    local, _ = _job(tmp_path, "local", "drafter.tuning.micro_batches=2")
    offload, out = _job(tmp_path, "offload", "drafter.tuning.micro_batches=2", "drafter.tuning.loss_on_target=true",
                        "logging.peak_tflops=0.001", "logging.debug.profile_step=5")
    whole, _ = _job(tmp_path, "whole")
    assert "lm_head and loss of 2 group(s) on the target that sent the message" in out
    assert "lm_head and loss of the drafters' steps run here" in out
    assert "target sends: rendezvous" in out  # forced on over gloo: the target serves while it waits
    # 8 steps x 2 drafters = 16 messages, 2 requests each
    assert "32 head requests served" in out, out[-3000:]
    w_local, w_off, w_whole = _final_weights(local), _final_weights(offload), _final_weights(whole)
    assert w_local.keys() == w_off.keys() and w_local
    assert [k for k in w_local if not torch.equal(w_local[k], w_off[k])] == []
    for k in w_local:  # one group: other sums, other roundings, amplified a little by 8 Adam steps
        assert (w_local[k] - w_whole[k]).norm() <= 1e-4 * w_local[k].norm(), k
    recs = [json.loads(x) for x in open(offload / "metrics.jsonl")]
    train = [x for x in recs if x["kind"] == "train"]
    assert train[-1]["step"] == 8 and train[-1]["target2_mfu"] > 0
    acc = [x for x in recs if x["kind"] == "accounting"][-1]
    assert acc["samples_sent"] == acc["samples_trained"] > 0
    # step 5 traced on both drafters (weights unchanged: the comparison above), its phases in order
    for r in (0, 1):
        with open(offload / "profile" / f"drafter_rank{r}_step5.json") as f:
            names = [p["name"] for p in timeline(json.load(f))["phases"]]
        assert names == ["group0 forward", "group0 head request", "group1 forward", "group1 head request",
                         "group0 backward", "group1 backward", "clip and optimizer"], names
    assert "drafter rank 0, step 5 (traced alone" in out and "| group1 backward |" in out
    # the target traced its first message for step 5 (message 10), earlier sends and replies drained first
    with open(offload / "profile" / "target_rank2_step5.json") as f:
        names = [p["name"] for p in timeline(json.load(f))["phases"]]
    assert names == ["capture", "send", "drafter takes it"], names
    assert "target rank 2, its message for step 5 (traced alone" in out


def test_loss_on_target_two_targets_one_drafter_sigterm(tmp_path):
    """Two targets feed one drafter (each message's loss goes back to the target that sent it), 4 anchor groups of
    which the last keeps its loss on the drafter, SIGTERM mid-run: both targets drop the requests of messages that
    will not be trained, every rank exits 0 after one checkpoint, and the accounting closes."""
    from test_train_e2e import accounting, check_accounting, sigterm_workers_when, train_records
    p = torchrun(3, ["-m", "dflash_dist.train", f"train.output_dir={tmp_path}", "data.source=synthetic:40:400",
                     "train.epochs=1", "topology.target_ranks=2", "drafter.tuning.loss_on_target=true",
                     "drafter.tuning.micro_batches=4", "drafter.tuning.local_loss_groups=1", "target.max_batch_samples=8",
                     "logging.log_every=2",
                     "logging.progress_bar=false", "logging.wandb.mode=disabled"], popen=True)
    out = sigterm_workers_when(p, lambda: any(r["step"] >= 6 for r in train_records(tmp_path)), tmp_path,
                               "did not reach step 6")
    assert p.returncode == 0, out[-4000:]
    assert "stopped on request" in out
    assert out.count("lm_head and loss of the drafters' steps run here") == 2
    served = [int(line.split(" head requests served")[0].rsplit(" ", 1)[1])
              for line in out.splitlines() if " head requests served" in line]
    assert len(served) == 2 and all(n > 0 for n in served), served
    last = train_records(tmp_path)[-1]["step"]
    assert sum(served) == 3 * last  # every trained step's three served groups, nothing more
    check_accounting(accounting(tmp_path))


def test_loss_on_target_with_the_evaluation_in_slices(tmp_path):
    """The target's waits serve head requests first and run the in-training evaluation's verify steps otherwise:
    both happen in one job, every requested evaluation is logged or skipped (said so), nothing is lost."""
    from test_train_e2e import accounting, check_accounting, metrics
    run, out = _job(tmp_path, "eval", "drafter.tuning.micro_batches=2", "drafter.tuning.loss_on_target=true",
                    "train.eval_every=4", "train.eval_max_new_tokens=32", eval_prompts=8)
    assert "in-training evaluation: one verify step at a time while waiting for the drafters" in out
    assert "32 head requests served" in out, out[-3000:]  # 8 steps x 2 drafters x 2 groups
    evals = [x for x in metrics(run) if x["kind"] == "eval"]
    assert evals and evals[-1]["step"] == 8 and evals[-1]["acceptance_length"] >= 1.0, evals
    assert len(evals) + out.count(" skipped: the one of step") == 2  # requested at 4 and after the last step
    check_accounting(accounting(run))
