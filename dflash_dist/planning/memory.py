"""Memory plan of a rank, before anything loads: what the target, drafter or colocated rank will hold, in bytes.

Pure arithmetic over the config, the target's HF config and the resolved drafter (``model/spec.DrafterSpec``); the
only tensors made are parameters on the meta device, to count them. ``check_job_config`` compares the plan with the
device's memory (``limits.device_memory``) and refuses a job that cannot fit (``train.memory_check``); ``dflash-doctor``
prints it; the drafter's startup report prints it next to the measured peak.

The step's shape is the largest the config allows unless the planned steps are given: a message holds at most
``target.max_batch_samples`` samples with ``n * max_len <= target.max_batch_tokens`` (a longer sample alone, up to
``data.max_length``), every sample carries ``drafter.num_anchors`` blocks of ``block_size`` queries (padding blocks
included: the shapes are static), and the context is padded to ``drafter.tuning.ctx_bucket``. The parts are
estimates of what is alive at the step's peak; activations saved for the backward are counted per tensor the
drafter's layers keep (``layer_saved``), not measured.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from dflash_dist.config import ConfigError, JobConfig
from dflash_dist.planning import limits
from dflash_dist.planning.limits import GiB, format_bytes
from dflash_dist.planning.training_state import drafter_units, fsdp_peak, training_state

__all__ = ["MemoryPlan", "target_plan", "drafter_plan", "plan_rank", "check_memory",
           "choose_parallel", "drafter_units", "largest_steps", "format_bytes"]

log = logging.getLogger("dflash_dist")

# A process's own memory beyond its tensors: torch, transformers and the interpreter on CPU (resident after the
# imports), the CUDA context and the caching allocator's slack on a GPU.
PROCESS_BASE = {"cpu": 600 << 20, "cuda": 1 * GiB}
WARN_FRACTION = 0.9
# On CPU, glibc's heap keeps what a step frees and the next allocations of other sizes miss it: a CPU step's
# resident peak is its live tensors plus 20-90% of its activations, varying from one process to the next (90%:
# Domino's GRU step of many small tensors; tests/unit/planning/test_memory.py measures both). A GPU's caching
# allocator reuses blocks; its slack is in PROCESS_BASE.
CPU_HEAP_SLACK = 0.6
# What a drafter step allocates and frees (``step_activations``), and a target's passes beside the capture buffer
STEP_PARTS = ("features + context", "layer activations", "dense masks", "flex block masks", "loss", "variant head")
TARGET_PASSES = ("layer forward", "lm_head logits", "evaluation")


@dataclass
class MemoryPlan:
    """What one rank holds at its peak: ``parts`` {name: bytes}, largest first when printed."""
    role: str
    device: str
    parts: dict = field(default_factory=dict)
    shape: Optional[tuple] = None  # the drafter step planned for: (b, S_pad, Q)
    knobs: dict = field(default_factory=dict)  # part name -> the setting that shrinks it

    @property
    def total(self) -> int:
        return int(sum(self.parts.values()))

    def largest(self, n: int = 3) -> list:
        return sorted(self.parts.items(), key=lambda kv: -kv[1])[:n]

    def describe(self) -> str:
        shape = "" if self.shape is None else f", step b={self.shape[0]} S_pad={self.shape[1]} Q={self.shape[2]}"
        lines = [f"{self.role} rank ({self.device}{shape}): {format_bytes(self.total)}"]
        lines += [f"  {format_bytes(v):>11}  {k}" for k, v in self.largest(len(self.parts)) if v > 0]
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return {"role": self.role, "device": self.device, "total_bytes": self.total, "shape": self.shape,
                "parts": dict(self.parts)}


def _sum(role: str, plans: Sequence[MemoryPlan]) -> MemoryPlan:
    out = MemoryPlan(role, plans[0].device, shape=next((p.shape for p in plans if p.shape), None))
    for p in plans:
        for k, v in p.parts.items():
            name = k if k == "process" else f"{p.role}: {k}"
            out.parts[name] = max(out.parts.get(name, 0), v) if k == "process" else v
            if k in p.knobs:
                out.knobs[name] = p.knobs[k]
    return out


# ------------------------------------------------------------------------------------------------ counting

def _meta_numel(build) -> int:
    import torch
    with torch.device("meta"):
        m = build()
    return int(sum(p.numel() for p in m.parameters()))


def target_param_count(hf_config: Any) -> int:
    """Parameters of the target's causal LM (its text model for a multimodal wrapper), built on the meta device."""
    from transformers import AutoModelForCausalLM

    from dflash_dist.targets.hf import causal_lm_config
    return _meta_numel(lambda: AutoModelForCausalLM.from_config(causal_lm_config(hf_config)))


def _dtype_bytes(name: str, device: str) -> int:
    return {"bfloat16": 2, "float16": 2, "float32": 4}.get(name, 2 if device == "cuda" else 4)


def _fp8(cfg: JobConfig, hf_config: Any) -> bool:
    q = getattr(hf_config, "quantization_config", None) or {}
    method = q.get("quant_method") if isinstance(q, dict) else getattr(q, "quant_method", None)
    return cfg.target.quantization == "fp8" or method in ("fp8", "compressed-tensors")


def largest_steps(cfg: JobConfig) -> list:
    """Every (b, S_pad) a message of this config can have at its largest context: b samples, each at most
    ``min(max_length, max_batch_tokens // b)`` long (one sample: up to ``data.max_length``)."""
    t, bucket, ml = cfg.target, cfg.drafter.tuning.ctx_bucket, cfg.data.max_length
    out = []
    for b in range(1, t.max_batch_samples + 1):
        s = ml if b == 1 else min(ml, t.max_batch_tokens // b)
        if s < 2:
            break
        out.append((b, max(1, math.ceil(s / bucket)) * bucket))
    return out


def _max_tokens(cfg: JobConfig) -> tuple[int, int]:
    """(tokens, samples) of the largest target forward: the token budget, or one sample of data.max_length."""
    t, ml = cfg.target, cfg.data.max_length
    return max(min(t.max_batch_tokens, t.max_batch_samples * ml), ml), t.max_batch_samples


# ------------------------------------------------------------------------------------------------ target

def target_plan(cfg: JobConfig, tc: Any, hf_config: Any, num_feature_layers: int, device: str,
                drafter_params: int = 0, attn_implementation: str = "sdpa") -> MemoryPlan:
    """The target rank: weights (its share of a tensor-parallel replica), the capture buffer of the captured
    layers' outputs, one decoder layer's forward at the largest message (inference: nothing saved), the
    lm_head's logits when the target labels or computes the loss, and the in-training evaluation (a drafter copy
    and the KV cache of one prompt)."""
    t = cfg.target
    ab = _dtype_bytes(t.dtype, device)
    tp = max(1, int(t.tensor_parallel))
    H, V = int(tc.hidden_size), int(tc.vocab_size)
    heads = int(tc.num_attention_heads)
    kv = int(getattr(tc, "num_key_value_heads", None) or heads)
    d = int(getattr(tc, "head_dim", None) or H // heads)
    inter = int(getattr(tc, "intermediate_size", None) or 4 * H)
    L = int(tc.num_hidden_layers)
    n = target_param_count(hf_config)
    embed = V * H * (1 if getattr(tc, "tie_word_embeddings", False) else 2)
    plan = MemoryPlan("target", device)
    if _fp8(cfg, hf_config):  # decoder linears: 1 byte per weight and one fp32 scale per output channel
        linear = max(n - embed, 0)
        plan.parts["weights"] = (embed * ab + linear + 4 * L * (heads * d + 2 * kv * d + H + 3 * inter)) // tp
    else:
        plan.parts["weights"] = n * ab // tp
    tokens, samples = _max_tokens(cfg)
    pad = t.tuning.pad_multiple or (64 if device == "cuda" else 1)
    rows = tokens + samples * (pad - 1)
    plan.parts["capture buffer"] = rows * num_feature_layers * H * ab
    act = rows * (4 * H + (heads + 2 * kv) * d + 3 * inter // tp) * ab
    if attn_implementation == "eager":  # [b, heads, S, S] scores and probabilities
        act += 2 * heads * rows * min(rows, cfg.data.max_length) * ab // tp
    elif device == "cpu":  # transformers' 4-D boolean mask of the padded rows
        act += rows * min(rows, cfg.data.max_length)
    plan.parts["layer forward"] = act
    plan.knobs["capture buffer"] = plan.knobs["layer forward"] = "target.max_batch_tokens"
    plan.knobs["weights"] = "target.quantization=fp8, target.tensor_parallel" if device == "cuda" else \
        "a smaller target"
    if cfg.drafter.loss.labels == "target" or cfg.drafter.tuning.loss_on_target:
        chunk = rows if cfg.drafter.loss.labels == "target" else 4096  # the served loss's row chunk, at most
        plan.parts["lm_head logits"] = min(rows, chunk) * V * 4 * 2
        plan.knobs["lm_head logits"] = "target.max_batch_tokens"
    if cfg.train.eval_prompts > 0:
        ctx = cfg.data.max_length + cfg.train.eval_max_new_tokens
        plan.parts["evaluation"] = drafter_params * ab + 2 * L * kv * d * ctx * ab // tp
        plan.knobs["evaluation"] = "train.eval_prompts=0"
    plan.parts["process"] = PROCESS_BASE.get(device, 0)
    return plan


# ------------------------------------------------------------------------------------------------ drafter

def layer_saved(R: int, C: int, H: int, heads: int, kv: int, d: int, inter: int) -> int:
    """Elements one drafter layer keeps for its backward, for R query rows over C context rows, as counted by
    autograd's saved-tensor hooks on an eager (sdpa) layer: on the query side the input norm's input, q_proj's
    input, the post-attention norm's input and output, the MLP's input (5 H); q before and after its norm, q after
    RoPE, the attention's output and o_proj's input (5 A); gate, up, their activation and product (4 inter);
    RoPE's cos and sin (2 d) and the attention's log-sum-exp (heads). On the key side, over C + R rows: k_proj's
    input (H); k before and after its norm, k after RoPE and v (4 Akv); RoPE's cos and sin (2 d). The additive
    mask is ``dense masks``; compiled layers keep fewer (inductor recomputes pointwise ops)."""
    A, Akv = heads * d, kv * d
    q_side = R * (5 * H + 5 * A + 4 * inter + 2 * d + heads)
    kv_side = (C + R) * (H + 4 * Akv + 2 * d)
    return q_side + kv_side


def drafter_plan(cfg: JobConfig, tc: Any, spec: Any, device: str, steps: Optional[Sequence] = None,
                 num_drafters: int = 1, parallel: str = "ddp") -> MemoryPlan:
    """The drafter rank at its largest step (``steps``: the planned (b, S_pad) pairs; None: every one the config
    allows, ``largest_steps``): its training state for ``parallel`` (``ddp``, or ``fsdp`` over ``num_drafters``:
    ``training_state``), the frozen embedding and lm_head, and the step's activations for the resolved backend."""
    m = spec.model
    ab = 2 if device == "cuda" else 4  # activations: bf16 autocast on CUDA, fp32 on CPU
    H, V = m.hidden_size, m.vocab_size
    head_b = _dtype_bytes(cfg.target.dtype, device)
    base = MemoryPlan("drafter", device)
    training_state(base, spec, device, num_drafters, parallel, cfg)
    base.parts["embedding + lm_head"] = 2 * V * H * head_b
    base.parts["process"] = PROCESS_BASE.get(device, 0)
    best = None
    for b, s_pad in (steps if steps is not None else largest_steps(cfg)):
        acts = step_activations(cfg, spec, device, int(b), int(s_pad), ab, head_b)
        if best is None or sum(acts.values()) > sum(best[1].values()):
            best = ((int(b), int(s_pad), cfg.drafter.num_anchors * spec.block_size), acts)
    plan = MemoryPlan("drafter", device, dict(base.parts), best[0] if best else None, dict(base.knobs))
    if best:
        plan.parts.update(best[1])
        if parallel == "fsdp":
            fsdp_peak(plan, spec, device, cfg, STEP_PARTS)
        dense = "drafter.num_anchors, drafter.tuning.micro_batches" + (", a GPU (flex)" if device == "cpu" else "")
        if device == "cpu":
            plan.parts["heap slack (CPU)"] = int(CPU_HEAP_SLACK * sum(best[1].values()))
        plan.knobs.update({"dense masks": dense, "variant head": "drafter.num_anchors",
                           "heap slack (CPU)": "drafter.num_anchors",
                           "layer activations": "drafter.num_anchors, target.max_batch_samples",
                           "features + context": "target.max_batch_tokens",
                           "loss": "drafter.tuning.loss_chunk_rows"})
    return plan


def step_activations(cfg: JobConfig, spec: Any, device: str, b: int, s_pad: int, ab: int, head_b: int) -> dict:
    """{part: bytes} alive at the peak of one step of b samples with context S_pad: the features and the
    context rows, every layer's saved activations of every anchor group (all groups' forwards run before the
    first backward), the dense masks (sdpa), the loss's chunk of logits and the hidden rows' gradient. The
    coefficients were checked against the resident peak of a CPU step of the tiny drafters
    (tests/unit/planning/test_memory.py)."""
    m, dc = spec.model, cfg.drafter
    g = max(1, int(dc.tuning.micro_batches))
    H, heads, kv, d, inter, V = (m.hidden_size, m.num_attention_heads, m.num_key_value_heads, m.head_dim,
                                 m.intermediate_size, m.vocab_size)
    q = dc.num_anchors * spec.block_size
    qg = q // g
    R, C = b * qg, b * s_pad
    kinds = set(m.kinds)
    out = {"features + context": b * s_pad * m.num_feature_layers * H * head_b + 3 * C * H * ab * g}
    out["layer activations"] = g * m.num_layers * layer_saved(R, C, H, heads, kv, d, inter) * ab
    if spec.backend == "sdpa":
        # torch's sdpa (CPU flash kernel, CUDA memory-efficient kernel) forms no [heads, Q, K] scores, but turns
        # the bool mask into an additive mask [b, 1, Q, K] in every layer and keeps it for the backward; the mask
        # itself, its clone and the window's are bool
        out["dense masks"] = g * b * qg * (s_pad + qg) * (m.num_layers * ab + 5 * len(kinds))
    else:
        out["flex block masks"] = len(kinds) * g * b * (qg // 128 + 1) * ((s_pad + qg) // 128 + 1) * 4 * 4
    chunk = min(b * q, spec.loss.chunk_rows)
    out["loss"] = 2 * chunk * V * 4 + b * q * H * 4 * 2
    extra = _variant_rows(spec, b * q, chunk, ab)
    if extra:
        out["variant head"] = extra
    return out


def _variant_rows(spec: Any, rows: int, chunk: int, ab: int) -> int:
    """A variant's activations beyond the layers (its ``extra_activation_bytes``)."""
    return int(spec.variant_impl().extra_activation_bytes(spec.model, rows, chunk, ab))


# ------------------------------------------------------------------------------------------------ the rank

def plan_rank(cfg: JobConfig, tc: Any, hf_config: Any, drafter_spec: Any, role: str, device: str,
              num_feature_layers: int, steps: Optional[Sequence] = None, num_drafters: int = 1,
              attn_implementation: str = "sdpa", parallel: str = "ddp") -> MemoryPlan:
    """The plan of a rank of ``role``: target, drafter, or colocated (a target and a drafter on one device: the
    sum of the two, one process's base counted once). ``parallel``: the drafter's (``ddp`` / ``fsdp``)."""
    if role not in ("target", "drafter", "colocated"):
        raise ValueError(f"role={role!r}: target, drafter or colocated")
    plans = []
    if role in ("drafter", "colocated"):
        plans.append(drafter_plan(cfg, tc, drafter_spec, device, steps, num_drafters, parallel))
    if role in ("target", "colocated"):
        dp = _meta_numel(drafter_spec.build_model) if cfg.train.eval_prompts > 0 else 0
        plans.append(target_plan(cfg, tc, hf_config, num_feature_layers, device, dp, attn_implementation))
    if len(plans) == 1:
        return plans[0]
    drafter, target = plans
    drafter.parts.pop("embedding + lm_head")  # a colocated drafter uses its target half's tensors
    if device == "cuda":
        _one_moment(drafter, target)
    return _sum("colocated", [target, drafter])


def _one_moment(drafter: MemoryPlan, target: MemoryPlan) -> None:
    """A colocated rank's one thread runs the capture, the drafter's step and the evaluation in turn, and a GPU's
    caching allocator hands what one frees to the next: the target's passes and the drafter's step are never alive
    at once. The peak is the larger of the two beside what both keep (weights, capture buffer, training state). On
    CPU both stay counted: glibc's heap keeps what the capture frees for allocations of its sizes."""
    passes = sum(target.parts.get(k, 0) for k in TARGET_PASSES)
    step = sum(drafter.parts.get(k, 0) for k in STEP_PARTS)
    gone, plan = (TARGET_PASSES, target) if step >= passes else (STEP_PARTS, drafter)
    for k in gone:
        plan.parts.pop(k, None)


# ------------------------------------------------------------------------------------------------ the check

def _splits(cfg: JobConfig, world_size: Optional[int]) -> list:
    """(targets, drafters, colocated) ranks on this host for every split the job may run (``auto``: any; unknown
    world size: one rank of each role alone)."""
    if world_size is None:
        return [(1, 0, 0), (0, 1, 0)]
    from dflash_dist.config import split_targets
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    t = split_targets(cfg, world_size)
    if t == 0:
        return [(0, 0, local)]
    if t != "auto" and local == world_size:
        return [(t, world_size - t, 0)]
    # several nodes (this one holds some share of the split) or auto: any mix of the two roles on this host
    return [(0, 0, local)] * (t == "auto") + [(n, local - n, 0) for n in range(0, local + 1)]


def _refusal(what_needs: str, need: int, limit: int, what: str, plans: Sequence[MemoryPlan]) -> str:
    parts = sorted(((f"{p.role} {k}", v, p.knobs.get(k)) for p in plans for k, v in p.parts.items()),
                   key=lambda x: -x[1])
    top = ", ".join(f"{name} {format_bytes(v)}" for name, v, _ in parts[:3])
    knobs = []
    for _, _, k in parts[:3]:
        knobs += [x for x in (k or "").split(", ") if x and x not in knobs]
    return (f"memory plan: {what_needs} need {format_bytes(need)} but {what} is {format_bytes(limit)} "
            f"(largest: {top}); lower or change {', '.join(knobs) or 'the batch'} "
            f"(train.memory_check=warn or off to run anyway)")


def plan_steps(lengths: Sequence[int], plan: Sequence[Sequence[int]], ctx_bucket: int) -> list:
    """The distinct (b, S_pad) drafter steps of a batching plan (sample ids per message) over these lengths."""
    return sorted({(len(m), max(1, math.ceil(max(lengths[i] for i in m) / ctx_bucket)) * ctx_bucket)
                   for m in plan if m})


def check_memory_for_data(cfg: JobConfig, checked: dict, lengths: Sequence[int], plan: Sequence,
                          world_size: Optional[int], device: str) -> dict:
    """``check_memory`` at the steps the tokenized data and its batching plan really make (refused here: before
    any model loads), where the check before the data could only assume the largest message the batching allows."""
    return check_memory(cfg, checked["text_config"], checked["hf_config"], checked["drafter"], device,
                        len(checked["layer_ids"]), world_size, checked["attn_implementation"],
                        steps=plan_steps(lengths, plan, cfg.drafter.tuning.ctx_bucket))


def fsdp_allowed(cfg: JobConfig) -> bool:
    """Whether the drafter's other settings allow FSDP (``config/drafter.py`` refuses the rest with fsdp)."""
    t = cfg.drafter.tuning
    return t.optimizer_step != "compiled"


def _checks(cfg: JobConfig, plans: dict, split, world_size: Optional[int], device: str, limit: tuple) -> list:
    """(who, bytes needed, (bytes, what) it must fit, plans) of every check, the tightest first."""
    checks = []
    if device == "cuda":  # auto: a split's ranks must fit (a colocated choice that would not: see the plan)
        checks += [(f"a {r} rank", p.total, limit, [p]) for r, p in plans.items()
                   if not (split == "auto" and r == "colocated")]
    else:
        for t, d, c in _splits(cfg, world_size):
            count = {"target": t, "drafter": d, "colocated": c}
            need = sum(n * plans[r].total for r, n in count.items() if n)
            who = " + ".join(f"{n} {r} rank{'s' * (n > 1)}" for r, n in count.items() if n)
            checks.append((who + " on this machine", need, limit, [plans[r] for r, n in count.items() if n]))
    per_process = limits.address_space_left()
    if per_process is not None:
        checks += [(f"a {r} rank's process", p.total, per_process, [p]) for r, p in plans.items()]
    checks.sort(key=lambda c: -(c[1] / max(c[2][0], 1)))
    return checks


def check_memory(cfg: JobConfig, tc: Any, hf_config: Any, spec: Any, device: str, num_feature_layers: int,
                 world_size: Optional[int], attn_implementation: str = "sdpa",
                 steps: Optional[Sequence] = None) -> dict:
    """The target and drafter plans and the device they must fit: refused (ConfigError) when they do not and
    ``train.memory_check=refuse``, a warning within 10% of the limit (or over it with ``warn``). A GPU holds one
    rank; a CPU machine holds all of its ranks at once (every split of ``topology.target_ranks=auto``); a
    ``ulimit -v`` bounds each process. The drafter's plan is ``drafter.parallel``'s; ``auto``: DDP's, or FSDP's
    over the drafters where DDP's does not fit (``choose_parallel`` at startup makes the same choice). Returns
    {"plans": {role: MemoryPlan}, "limit": (bytes, what), "parallel": "ddp" | "fsdp", "problems": [...]}."""
    from dflash_dist.config import split_targets
    mode = cfg.train.memory_check
    split = None if world_size is None else split_targets(cfg, world_size)
    drafters = 1 if split in (None, "auto") else (world_size - split if split else world_size)
    roles = ("colocated",) if split == 0 else ("target", "drafter", "colocated") if split == "auto" else \
        ("target", "drafter")
    limit = limits.device_memory(device)

    def plans_for(parallel: str) -> dict:
        return {r: plan_rank(cfg, tc, hf_config, spec, r, device, num_feature_layers, steps, drafters,
                             attn_implementation, parallel) for r in roles}

    parallel = "ddp" if cfg.drafter.parallel == "auto" else cfg.drafter.parallel
    plans = plans_for(parallel)
    checks = _checks(cfg, plans, split, world_size, device, limit)
    if (cfg.drafter.parallel == "auto" and drafters > 1 and fsdp_allowed(cfg)
            and checks[0][1] > checks[0][2][0]):  # DDP does not fit: auto shards
        parallel = "fsdp"
        plans = plans_for(parallel)
        checks = _checks(cfg, plans, split, world_size, device, limit)
    out = {"plans": plans, "limit": limit, "parallel": parallel, "problems": []}
    if mode == "off":
        return out
    who, need, (cap, what), ps = checks[0]
    if need > cap:
        msg = _refusal(who, need, cap, what, ps)
        out["problems"].append(msg)
        if mode == "refuse" and steps is not None:
            raise ConfigError(msg)
        # before the data: the largest message the batching allows, which the data may never make
        _warn(msg if steps is not None else msg + "; at the largest message target.max_batch_tokens and "
              "target.max_batch_samples allow: checked again at the data's own batches before any model loads")
    elif need > WARN_FRACTION * cap:
        _warn(f"memory plan: {who} need {format_bytes(need)}, within 10% of {what} ({format_bytes(cap)})")
    return out


def choose_parallel(cfg: JobConfig, hf_config: Any, spec: Any, device: str, num_feature_layers: int,
                    num_drafters: int, role: str = "drafter", steps: Optional[Sequence] = None) -> tuple[str, str]:
    """``drafter.parallel=auto`` on a drafter (or colocated) rank of a job with ``num_drafters``: (``fsdp``, why)
    where the rank's DDP plan does not fit its device (a GPU's memory; on CPU the machine's available memory,
    shared by this node's ranks, ``LOCAL_WORLD_SIZE``) and FSDP is allowed, else (``ddp``, why)."""
    from dflash_dist.targets.hf import text_config
    if num_drafters <= 1:
        return "ddp", "one drafter rank, nothing to shard"
    if not fsdp_allowed(cfg):
        return "ddp", "drafter.tuning.optimizer_step=compiled keeps DDP"
    tc = text_config(hf_config)
    plan = plan_rank(cfg, tc, hf_config, spec, role, device, num_feature_layers, steps, num_drafters, "sdpa", "ddp")
    cap, what = limits.device_memory(device)
    need = plan.total * (1 if device == "cuda" else int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    if need <= cap:
        return "ddp", f"DDP's plan, {format_bytes(need)}, fits {what} ({format_bytes(cap)})"
    fsdp = plan_rank(cfg, tc, hf_config, spec, role, device, num_feature_layers, steps, num_drafters, "sdpa", "fsdp")
    return "fsdp", (f"DDP's plan, {format_bytes(need)}, does not fit {what} ({format_bytes(cap)}); FSDP over "
                    f"{num_drafters} drafters: {format_bytes(fsdp.total)} per rank")


def _warn(msg: str) -> None:
    if os.environ.get("RANK", "0") == "0":
        log.warning("%s", msg)
