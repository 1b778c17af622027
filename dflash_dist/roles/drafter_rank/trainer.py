"""The drafter's training step: model, optimizer, data parallelism (roles/drafter_rank/parallel.py), compile guard, micro-batched backward, metrics."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dflash_dist.checkpoint.meta import checkpoint_meta
from dflash_dist.checkpoint.resume import checkpoint_totals, earlier_totals, resume_command
from dflash_dist.checkpoint.store import (
    CheckpointSaveError,
    checkpoint_bytes,
    load_checkpoint,
    save_checkpoint,
    space_problem,
    state_bytes,
)
from dflash_dist.roles.drafter_rank.compile_guard import install_guard
from dflash_dist.roles.drafter_rank.optim import make_step
from dflash_dist.roles.drafter_rank.parallel import DrafterParallel
from dflash_dist.roles.drafter_rank.parallel import resolve_mode as resolve_parallel
from dflash_dist.roles.drafter_rank.shape_plan import batch_shape, expected_shapes, plan_step_lengths, precompile_steps
from dflash_dist.model.blocks import make_batch, split_anchors, target_labels
from dflash_dist.targets.hf import load_head_from_checkpoint, resolve_dtype, resolve_source, text_config
from dflash_dist.model.loss import LossParts
from dflash_dist.model.masks import dense_mask, flex_block_mask, layer_masks, visible_pairs
from dflash_dist.telemetry.flops import attention_flops_per_pair, drafter_step_flops
from dflash_dist.telemetry.step_stats import StepStats
from dflash_dist.telemetry.step_trace import phase

LEAKY_MASK_ENV = "DFLASH_LEAKY_MASK_DEMO"

log = logging.getLogger("dflash_dist")


class TrainingDiverged(RuntimeError):
    """Training cannot go on: non-finite gradient norms for ``train.max_nonfinite_steps`` steps in a row (or at a
    save), or a launch that trained none of its samples. The job stops without a checkpoint, exit code 3."""


def empty_batch_inputs(feature_width: int, device, dtype):
    """A one-sample message with nothing supervised: every block is padding, the loss is exactly 0."""
    ids = torch.zeros(2, dtype=torch.long, device=device)
    mask = torch.zeros(2, dtype=torch.bool, device=device)
    cu = torch.tensor([0, 2], dtype=torch.long)
    feats = torch.zeros(2, feature_width, dtype=dtype, device=device)
    return ids, mask, cu, feats


class DrafterTrainer:
    def __init__(self, job, head_weights=None):
        """``job``: the drafter's view of the job (``role_jobs.DrafterJob``; the calibration of
        topology.target_ranks=auto passes the whole ``job.Job``, which has the same fields).
        ``head_weights``: (embedding, lm_head) given instead of read/received. With ``job.dist.drafters`` None
        the trainer runs alone (the calibration of topology.target_ranks=auto, plan.py): the same step, without
        DDP and without the all-reduce of the loss weight."""
        self.job = job
        cfg, d = job.cfg, job.dist
        self.cfg, self.d, self.topo = cfg, d, d.topo
        self.device = d.device
        self.spec = spec = job.drafter  # the resolved drafter (model/spec.py): shape, backend, compile, loss
        self.mcfg, self.backend = spec.model, spec.backend
        self.flex_dynamic, self.compile_layers, self.compile_loss = (spec.flex_dynamic, spec.compile_layers,
                                                                     spec.loss.compiled)
        self.variant = spec.variant_impl()
        self.objective = spec.make_objective()
        tc = text_config(job.hf_config)
        torch.manual_seed(cfg.train.seed)
        self.model = self.variant.build(self.mcfg, self.backend).to(self.device).configure_compile(
            flex_dynamic=self.flex_dynamic, compile_layers=self.compile_layers,
            kernel_options=spec.flex_kernel_options)
        self.objective.head_topk = int(self.model.head_topk)  # DFlash2: its candidates from the loss pass
        log.info("drafter RoPE: %s, through transformers' %s init (model/rope.py)", self.model.rope.describe(),
                 self.model.rope.rope_type)
        self.embed, self.lm_head = head_weights if head_weights is not None else receive_head_weights(job, self.device)
        self.feature_width = len(job.layer_ids) * tc.hidden_size
        self.step = job.start_step
        self.cursor = job.start_cursor
        self.last_checkpoint = None  # the newest checkpoint this run wrote (the leader)
        meta = opt_state = None
        if job.resume_from:  # whole tensors, whichever way they were trained: loaded before any sharding
            weights, opt_state, meta = load_checkpoint(job.resume_from)
            self.model.load_state_dict(weights)
        self.before = earlier_totals(meta, job.resume_from, job.run_dir, job.plan)  # the run's earlier launches
        mode, why = resolve_parallel(job, self.device)  # drafter.parallel: DDP or FSDP2 (roles/drafter_rank/parallel.py)
        reduce_dtype = torch.bfloat16 if cfg.drafter.tuning.grad_reduce_dtype == "bfloat16" else torch.float32
        self.parallel = DrafterParallel(self.model, mode, d.drafters, self.device, reduce_dtype, why)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.train.lr, betas=tuple(cfg.train.betas),
                                     weight_decay=cfg.train.weight_decay, fused=self.device.type == "cuda")
        self.opt_step = make_step(self.opt, cfg.drafter.tuning.optimizer_step,
                                  sharded=self.parallel.sharded)  # roles/drafter_rank/optim.py
        if opt_state is not None:
            self.parallel.load_optimizer(self.opt, opt_state)
        self.autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if self.device.type == "cuda"
                         else torch.autocast("cpu", enabled=False))
        self.counts = {"messages_received": 0, "samples_received": 0, "samples_trained": 0,
                       "samples_skipped_nonfinite": 0, "samples_skipped_shape": 0, "empty_steps": 0}
        # per-step statistics accumulated on device, read once per logging window (one all-reduce): the
        # objective's, the variant's loss terms, and the step's own
        slots = dict(self.objective.stat_slots())
        slots.update({name: 1 for name in self._loss_term_names()})
        slots.update(self.model.stat_slots())
        slots.update({"grad_norm": 1, "steps": 1, "model_flops": 1, "nonfinite_by_target": self.topo.num_replicas})
        self.stats = StepStats(slots, self.device)
        self.nonfinite_by_target = [0] * self.topo.num_replicas
        # steps in a row whose gradient norm was not finite, and the first of them: device scalars (no sync), read
        # by check_finite at the logging window and before a save
        self.nonfinite_run = torch.zeros((), dtype=torch.long, device=self.device)
        self.nonfinite_since = torch.zeros((), dtype=torch.long, device=self.device)
        self.micro_batches = cfg.drafter.tuning.micro_batches
        # A bug on purpose, for scripts/leak_demo.sh only (never a config key): blocks see the target state at
        # their own anchor (kv <= a), the classic leak of other trainers.
        self.leaky_mask = os.environ.get(LEAKY_MASK_ENV) == "1"
        self.heads = None  # head_offload.HeadLossClient, set by run_drafter with drafter.tuning.loss_on_target
        self.planned_steps = self._planned_steps()
        dc = cfg.drafter
        self.block_size = spec.block_size
        self.precompile_plan = (precompile_steps(self._dry_step_source(), dc.tuning.ctx_bucket)
                                if self.backend == "flex" and dc.tuning.precompile and self.planned_steps else [])
        self.precompile_s: float | None = None  # seconds of the dry steps, once run
        self.guard = self.make_guard() if self.backend == "flex" else None

    def _planned_steps(self):
        """Sample lengths of each of this drafter's steps, in order (a list; None when the lengths are unknown)."""
        job = self.job
        if job.sample_lengths is None:
            return None
        return list(plan_step_lengths(job.plan, job.sample_lengths, job.start_cursor,
                                      job.total_messages - job.start_cursor, self.topo.num_drafters,
                                      self.topo.index))

    def _dry_step_source(self):
        """The steps precompile picks its dry steps from: this drafter's; under FSDP every drafter's (a forward
        gathers the weights, so every drafter must run the same dry steps)."""
        job = self.job
        if not self.parallel.sharded or job.sample_lengths is None:
            return self.planned_steps
        return list(plan_step_lengths(job.plan, job.sample_lengths, job.start_cursor,
                                      job.total_messages - job.start_cursor, 1, 0))

    def make_guard(self):
        """Compile guard (flex backend): eager flex -> error, recompiles bounded, none after warm-up unless the
        step's shape is one the plan says this drafter will see (see compile_guard, shape_plan)."""
        dc = self.cfg.drafter
        steps = self.planned_steps or []
        shapes = expected_shapes(steps + [[2]], dc.tuning.ctx_bucket, dc.num_anchors * self.block_size)  # + empty
        # dynamo: static, then dynamic b, dynamic S_pad, b == 1 specialised -> at most ~4 variants per function;
        # the dry steps of precompile() are warm-up steps too
        return install_guard(num_shape_buckets=min(len(shapes), 4), margin=2,
                             warmup_steps=2 + len(self.precompile_plan),
                             expected_shapes=shapes if self.planned_steps is not None else None)

    # ------------------------------------------------------------------ one step
    def build(self, msg, k: int):
        """DrafterBatch for message k (None: an empty batch). Samples with non-finite features get no loss
        and zeroed features (device ops, no sync); they are counted per source target."""
        cfg = self.cfg.drafter
        gen = torch.Generator().manual_seed(self.cfg.train.seed * 1_000_003 + k)  # topology-independent
        src = msg.src if msg is not None else None  # its target expects head requests even for a skipped message
        if msg is not None and msg.features.shape[1] != self.feature_width:
            log.warning("message %d from rank %d has features of width %d, expected %d: skipped (%d samples)",
                        k, msg.src, msg.features.shape[1], self.feature_width, msg.num_samples)
            self.counts["samples_skipped_shape"] += msg.num_samples
            msg = None
        if msg is None:
            ids, mask, cu, feats = empty_batch_inputs(self.feature_width, self.device, self.lm_head.dtype)
        else:
            ids, mask, cu, feats = msg.input_ids, msg.loss_mask, msg.cu_seqlens, msg.features
        batch = make_batch(ids, mask, cu, feats, num_anchors=cfg.num_anchors, block_size=self.block_size,
                           mask_token_id=self.job.mask_token_id, ctx_bucket=cfg.tuning.ctx_bucket, generator=gen,
                           **target_labels(self.spec.loss, msg, ids.numel()))
        bad = ~torch.isfinite(batch.features).flatten(1).all(1)                        # [b]
        batch.features = torch.nan_to_num(batch.features, nan=0.0, posinf=0.0, neginf=0.0)
        batch.labels = batch.labels.masked_fill(bad[:, None], -100)
        if msg is not None:
            nonfinite = torch.zeros(self.topo.num_replicas, dtype=torch.long, device=self.device)
            nonfinite[self.topo.replica_of(msg.src)] = bad.sum()
            self.stats.add("nonfinite_by_target", nonfinite)
        batch.src, batch.index = src, k
        return batch

    def attention_mask(self, batch):
        B = self.block_size
        leak = self.leaky_mask  # False except in the leak demonstration
        if self.backend == "flex":
            def build(w):
                return flex_block_mask(batch.anchors, batch.valid, batch.ctx_len, B, compile=self.spec.compile_mask,
                                       context_inclusive=leak, dynamic=self.flex_dynamic, sliding_window=w)
        else:
            def build(w):
                return dense_mask(batch.anchors, batch.valid, batch.ctx_len, B, context_inclusive=leak,
                                  sliding_window=w)
        # one mask, or {kind: mask} when some layers are sliding_attention (each kind built once per step)
        return layer_masks(self.mcfg.layer_types, build, self.mcfg.sliding_window)

    def train_step(self, batch) -> None:
        if self.guard is None:
            return self._train_step(batch)
        with self.guard.step(batch_shape(batch)):
            self._train_step(batch)

    def _group_losses(self, batch) -> list:
        """Forward of one batch (what a training step and a dry step share), drafter.tuning.micro_batches groups of
        anchors, each its own forward; per group in order its LossParts (loss here) or, with loss_on_target and a
        batch from a target, its posted head request (the target that sent the batch computes one group's loss
        while this rank runs the next group's forward; ``_backward`` collects the reply)."""
        dc = self.cfg.drafter
        remote = self.heads is not None and batch.src is not None
        groups = split_anchors(batch, self.micro_batches)
        out = []
        for i, group in enumerate(groups):
            # DDP's reducer is armed by the last forward only (see DrafterParallel.backward)
            with self.parallel.forward_context(later=i < len(groups) - 1):
                with phase(f"group{i} forward"):
                    mask = self.attention_mask(group)
                    block_embeds = F.embedding(group.block_ids, self.embed)
                    with self.autocast:
                        hidden = self.parallel.module(block_embeds, batch.features, batch.ctx_positions, group.block_positions,
                                          mask)
                with self.autocast:
                    if remote and i < len(groups) - dc.tuning.local_loss_groups:
                        with phase(f"group{i} head request"):
                            out.append(self.heads.request(batch.src, batch.index, hidden, group.labels, group.soft))
                    else:
                        with phase(f"group{i} loss"):
                            soft = () if group.soft is None else (group.soft,)  # drafter.loss.kind=kl
                            out.append(self.objective.loss(hidden, self.lm_head, group.labels, *soft))
                    self.model.set_context(group=group, embed=self.embed, objective=self.objective, step=self.step,
                                           total_steps=self.total_steps(),
                                           head_topk_ids=getattr(out[-1], "topk_ids", None))
                    terms = self.model.loss_terms(hidden, group.labels, self.lm_head, block_ids=group.block_ids,
                                                  row_weights=self._row_weights(hidden, group.labels, out[-1]))
                    if terms:  # a variant's own losses, named; a served group's are added once its reply is in
                        out[-1] = (out[-1], terms)
        return out

    def total_steps(self) -> int:
        """The run's optimizer steps in all, as the loop counts them: train.max_steps, or what the plan of
        train.epochs comes to (train.max_steps is -1 then)."""
        job = self.job
        return job.start_step + self.topo.num_steps(job.total_messages - job.start_cursor)

    def _row_weights(self, hidden, labels, parts):
        """The objective's detached weights of the loss rows, for a variant's own terms (None: it has none): those
        its loss used (D-PACE's depend on it), or ``rows``' for a group served on a target (known in advance)."""
        if not self._loss_term_names():
            return None
        if isinstance(parts, LossParts) and parts.row_weights is not None:
            return parts.row_weights
        return self.objective.rows(hidden.detach(), labels)[2].detach()

    def _loss_term_names(self) -> list:
        """The names of the variant's loss terms (``DFlashDrafter.loss_terms``), declared by the model class."""
        return list(self.model.loss_term_names)

    @staticmethod
    def _weight_sum(groups: list):
        """The step's local loss weight sum (known before any reply: the normalisation needs it first)."""
        return sum((g[0] if isinstance(g, tuple) else g).weight_sum for g in groups).detach().float()

    def _with_terms(self, group, src) -> LossParts:
        """A group's LossParts, its reply collected, the variant's loss terms added (each also kept by name)."""
        group, terms = group if isinstance(group, tuple) else (group, {})
        part = group if isinstance(group, LossParts) else self.heads.complete(group, src)
        if terms:
            part.loss_sum = part.loss_sum + sum(terms[name] for name in self._loss_term_names())
            part.extra = dict(terms)
        return part

    def _backward(self, groups: list, src, scale) -> LossParts:
        """Backward of each group in order, each once its own reply is in (``HeadLossClient.complete`` makes the
        stream wait for that reply only): the targets' last replies arrive while the earlier groups' backward
        runs. How the groups' gradients add up and reach the reduction is ``DrafterParallel.backward``'s (DDP:
        the earlier ones kept out of ``.grad`` until the last; FSDP: reduce-scattered after the last). ``scale``
        multiplies each loss sum. Returns the step's LossParts."""
        parts = []
        held = None
        for i, g in enumerate(groups):
            with phase(f"group{i} backward"):
                part = self._with_terms(g, src)
                parts.append(part)
                held = self.parallel.backward(part.loss_sum * scale, last=i == len(groups) - 1, held=held)
        return LossParts.total(parts)

    def precompile(self) -> float:
        """Dry steps of ``precompile_plan`` (see shape_plan.precompile_steps): forward and backward of a
        synthetic batch with each step's sample lengths, under the guard as warm-up steps; no update, gradients
        dropped, no all-reduce (DDP's no_sync; FSDP gathers and reduces, every drafter running the same dry steps),
        the optimizer and the step counters untouched. Returns seconds."""
        plan = self.precompile_plan
        if not plan:
            return 0.0
        t0 = time.monotonic()
        dc = self.cfg.drafter
        gen = torch.Generator().manual_seed(0)
        vocab = self.lm_head.shape[0]
        for lens in plan:
            t = sum(lens)
            cu = torch.zeros(len(lens) + 1, dtype=torch.long)
            cu[1:] = torch.tensor(lens).cumsum(0)
            ids = torch.randint(0, vocab, (t,), generator=gen).to(self.device)
            sup = torch.ones(t, dtype=torch.bool, device=self.device)
            feats = torch.zeros(t, self.feature_width, dtype=self.lm_head.dtype, device=self.device)
            batch = make_batch(ids, sup, cu, feats, num_anchors=dc.num_anchors, block_size=self.block_size,
                               mask_token_id=self.job.mask_token_id, ctx_bucket=dc.tuning.ctx_bucket, generator=gen,
                               **target_labels(self.spec.loss, None, t, ids))
            no_sync = self.parallel.dry_context()
            guard = self.guard.step(batch_shape(batch)) if self.guard is not None else contextlib.nullcontext()
            with guard, no_sync:
                groups = self._group_losses(batch)
                wsum = self._weight_sum(groups)
                self._backward(groups, batch.src, 1.0 / wsum.clamp_min(1e-6))
            self.opt.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.precompile_s = time.monotonic() - t0
        return self.precompile_s

    def _train_step(self, batch) -> None:
        """Forward of every group, one all-reduce of the step's weight sum over the drafter ranks, then backward
        with each loss sum scaled num_drafters / that sum (DDP averages over the ranks): every objective is
        normalised by the weight sum of the whole step, so the update does not depend on how its samples are split
        over ranks and micro-batches. An objective whose weights come from its own forward (D-PACE) knows them when
        the group's loss is computed, so the order costs it nothing more."""
        cfg = self.cfg
        mult = cosine_lr(self.cursor, self.job.total_messages, cfg.train.warmup_ratio, cfg.train.min_lr_ratio)
        for g in self.opt.param_groups:
            g["lr"] = cfg.train.lr * mult
        groups = self._group_losses(batch)
        wsum = self._weight_sum(groups).clone()  # known before the replies
        if self.d.drafters is not None:
            dist.all_reduce(wsum, group=self.d.drafters)
        parts = self._backward(groups, batch.src, self.topo.num_drafters / wsum.clamp_min(1e-6))
        with phase("clip and optimizer"):
            gnorm = self.opt_step(list(self.model.parameters()), cfg.train.grad_clip)
            self.opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            self.stats.add_all(self.objective.stats(parts))
            self.stats.add_all({k: v.detach() for k, v in parts.extra.items()})
            self.stats.add_all({"grad_norm": gnorm, "steps": 1.0, "model_flops": self.step_flops(batch)})
            # the norm of the all-reduced gradients: the same on every drafter, non-finite when any rank's loss is
            self.nonfinite_run = (self.nonfinite_run + 1) * ~torch.isfinite(gnorm)
            self.nonfinite_since = torch.where(self.nonfinite_run == 1, self.step + 1, self.nonfinite_since)
        self.lr = cfg.train.lr * mult

    def step_flops(self, batch) -> torch.Tensor:
        """Model FLOPs of this step (flops.drafter_step_flops) as a device scalar: the shape terms are host
        integers, the attention term needs the anchors (visible pairs), summed on the device (no sync)."""
        B = self.block_size
        b, n = batch.anchors.shape
        vocab = self.lm_head.shape[0]
        fixed = drafter_step_flops(self.mcfg, b, batch.ctx_len, n, vocab, 0.0)
        fixed["model"] += self.variant.extra_flops(self.mcfg, b, batch.ctx_len, n, vocab)
        if self.heads is not None and batch.src is not None:  # the head's FLOPs of the served groups: the target's
            dc = self.cfg.drafter
            fixed["model"] -= fixed["lm_head"] * (dc.tuning.micro_batches - dc.tuning.local_loss_groups) / dc.tuning.micro_batches
        fixed = fixed["model"]
        kinds = self.mcfg.kinds
        n_swa = kinds.count("sliding_attention")
        pairs = visible_pairs(batch.anchors, batch.valid, B)
        if n_swa:  # mean over the layers: a sliding layer's queries see fewer keys
            swa = visible_pairs(batch.anchors, batch.valid, B, self.mcfg.sliding_window)
            pairs = (pairs * (len(kinds) - n_swa) + swa * n_swa) / len(kinds)
        return pairs * attention_flops_per_pair(self.mcfg) + fixed

    # ------------------------------------------------------------------ bookkeeping
    def note_received(self, msg) -> None:
        """A message arrived for this rank (counted before its step)."""
        self.counts["messages_received"] += 1
        self.counts["samples_received"] += msg.num_samples

    def finish_step(self, s: int, msg) -> None:
        """Step ``s`` of this run is done (``msg`` None: an empty step): the step counter, the cursor (messages
        of the plan trained by all drafters) and the counts move on."""
        if msg is None:
            self.counts["empty_steps"] += 1
        self.step += 1
        job = self.job
        self.cursor = min(job.start_cursor + (s + 1) * self.topo.num_drafters, job.total_messages)

    def read_window(self) -> dict:
        """The metrics of the steps since the last read, over all drafters (one all-reduce of the statistics)."""
        v = self.stats.read(group=self.d.drafters)
        bad = [int(x) for x in v["nonfinite_by_target"]]
        for t, n in enumerate(bad):
            self.nonfinite_by_target[t] += n
            if n:
                log.warning("target rank %d sent %d samples with non-finite hidden states in this window "
                            "(skipped; %d so far)", self.topo.feeders[t], n, self.nonfinite_by_target[t])
        out = {"loss": None, "lr": self.lr, "model_flops": v["model_flops"][0],  # loss: the objective's, below
               "grad_norm": v["grad_norm"][0] / max(v["steps"][0], 1) / self.topo.num_drafters}
        out.update(self.objective.window_metrics(v))
        wsum = max(v["weight_sum"][0], 1e-9) if "weight_sum" in v else 1.0
        for name in self._loss_term_names():
            out[f"loss_{name}"] = v[name][0] / wsum
        out.update(self.model.window_metrics(v))
        out["skipped_nonfinite"] = sum(bad)
        self.check_finite()
        return out

    def check_finite(self, saving: bool = False) -> None:
        """Raise TrainingDiverged once ``train.max_nonfinite_steps`` steps in a row had a non-finite gradient norm
        (``saving``: after any such step, so no checkpoint holds non-finite weights and pruning, which follows a
        save, never removes the newest finite one). Called at the logging window and before a save, where the
        host already waits for the device: no sync is added to a step. Every drafter decides alike."""
        run = int(self.nonfinite_run)
        if run == 0 or (run < self.cfg.train.max_nonfinite_steps and not saving):
            return
        since, limit = int(self.nonfinite_since), self.cfg.train.max_nonfinite_steps
        why = f"train.max_nonfinite_steps={limit}" if run >= limit else "a checkpoint now would hold them"
        raise TrainingDiverged(
            f"training diverged at step {since}: the loss or gradient norm was not finite for {run} step(s) in a "
            f"row, through step {since + run - 1} ({why}); stopping without a checkpoint (the newest: "
            f"{self.last_checkpoint or self.job.resume_from or 'none'}); lower train.lr or raise train.warmup_ratio")

    def check_trained(self, launch: dict) -> None:
        """A launch that received samples and trained none of them (all skipped) did not train: TrainingDiverged."""
        if launch["received"] and launch["received"] == launch["skipped"]:
            raise TrainingDiverged(
                f"step {self.step}: this launch trained none of the {launch['received']} samples it received (all "
                f"skipped: non-finite hidden states or features of the wrong width, see the warnings above); no "
                f"final checkpoint written")

    def launch_counts(self) -> dict:
        """This launch's samples received and skipped so far, over all drafters (every drafter calls it at the
        same point: the nonfinite counts not yet read by a logging window are summed here too)."""
        v = torch.stack([torch.tensor(float(self.counts["samples_received"]), dtype=torch.float64),
                         torch.tensor(float(self.counts["samples_skipped_shape"]), dtype=torch.float64),
                         self.stats.peek("nonfinite_by_target").sum().cpu()]).to(self.device)
        if self.d.drafters is not None:
            dist.all_reduce(v, group=self.d.drafters)
        received, shape, pending = (int(round(x)) for x in v.tolist())
        return {"received": received, "skipped": shape + pending + sum(self.nonfinite_by_target)}

    def save(self, final: bool = False, reason: str = "periodic") -> None:
        """Every drafter calls it at the same point (the run's totals are summed over them); the leader writes."""
        self.check_finite(saving=True)
        launch = self.launch_counts()
        if final:
            self.check_trained(launch)
        model_state, opt_state = self.parallel.full_state(self.opt)  # whole tensors on the leader (FSDP: gathered)
        if not self.topo.is_leader:
            return
        meta = checkpoint_meta(self.job, self.topo, self.spec, cursor=self.cursor, counts=self.counts, final=final,
                               reason=reason)
        meta["run_totals"] = checkpoint_totals(self.before, launch)
        previous = self.last_checkpoint or self.job.resume_from
        needed = (checkpoint_bytes(previous) if previous else 0) or state_bytes(model_state) + state_bytes(opt_state)
        problem = space_problem(self.job.run_dir, needed)
        if problem:
            log.warning("checkpoint at step %d: %s", self.step, problem)
        try:
            path = save_checkpoint(self.job.run_dir, self.step, model_state, opt_state, meta,
                                   keep=self.cfg.train.keep_checkpoints)
        except CheckpointSaveError as e:
            kept = f"the checkpoint {previous} is intact" if previous else "no earlier checkpoint of this run"
            raise CheckpointSaveError(
                f"{e}. Nothing of it is left behind; {kept}. To go on: {e.fix}, then resume with "
                f"{resume_command(self.job.run_dir)}", e.errno, e.needed, e.fix) from None
        self.last_checkpoint = path
        log.info("checkpoint %s", path)


def cosine_lr(step: int, total: int, warmup_ratio: float, min_ratio: float = 0.0) -> float:
    """Multiplier of the peak lr: linear warmup over warmup_ratio*total steps, then cosine to min_ratio."""
    warm = max(1, int(round(warmup_ratio * total)))
    if step < warm:
        return (step + 1) / warm
    progress = min(1.0, (step - warm) / max(1, total - warm))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def receive_head_weights(job, device):
    """Frozen target embedding and lm_head on the drafter: read by key from the target checkpoint, or
    (random-init target) received once from the first target rank; on a colocated rank, the tensors of its own
    target half (no second copy)."""
    local = getattr(job, "local", None)
    if local is not None:
        return local.heads
    cfg = job.cfg
    tc = text_config(job.hf_config)
    dtype = resolve_dtype(cfg.target.dtype, device.type)
    path, _ = resolve_source(cfg.target)
    if path is not None and os.path.isdir(path):
        embed, head = load_head_from_checkpoint(path, bool(getattr(job.hf_config, "tie_word_embeddings", False)))
    elif path is not None:  # hub id: let HF resolve the files
        from huggingface_hub import snapshot_download
        local = snapshot_download(path, allow_patterns=["*.safetensors", "*.json"])
        embed, head = load_head_from_checkpoint(local, bool(getattr(job.hf_config, "tie_word_embeddings", False)))
    else:
        shape = (tc.vocab_size, tc.hidden_size)
        embed = torch.empty(shape, dtype=dtype, device=device)
        head = torch.empty(shape, dtype=dtype, device=device)
        src = job.dist.topo.feeders[0]
        dist.recv(embed, src, group=job.dist.data)
        dist.recv(head, src, group=job.dist.data)
    return embed.to(device=device, dtype=dtype), head.to(device=device, dtype=dtype)
