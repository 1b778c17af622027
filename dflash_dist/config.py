"""Typed configuration for dflash_dist.

Hydra composes the YAML tree in ``conf/``; ``JobConfig.from_omegaconf`` turns it into these dataclasses,
which validate themselves in ``__post_init__``. Checks that need the world size or the target's HF config
live in ``validate_job`` and run before any model is loaded, so a wrong run fails in seconds with a
message that says what to change.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Optional


class ConfigError(ValueError):
    """A configuration that cannot work. The message says which key to change and to what."""


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _check_choices(obj, section: str) -> None:
    """Every ``Literal[...]`` field of a config dataclass holds one of its choices (checked once, here)."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        tp = hints[f.name]
        args = typing.get_args(tp) if typing.get_origin(tp) is not Literal else (tp,)
        for lit in [tp] + [a for a in args if typing.get_origin(a) is Literal]:
            if typing.get_origin(lit) is Literal:
                choices = typing.get_args(lit)
                allowed = choices + ((None,) if type(None) in args else ())
                v = getattr(obj, f.name)
                _require(v in allowed, f"{section}.{f.name}={v!r}: use one of {', '.join(map(str, choices))}")
                break


def _sub(value, cls, section: str):
    """A nested sub-group given as a dict (from YAML / Hydra) becomes its dataclass, unknown keys refused."""
    if isinstance(value, cls):
        return value
    value = dict(value or {})
    names = {f.name for f in dataclasses.fields(cls)}
    bad = set(value) - names
    _require(not bad, f"unknown keys {sorted(bad)} in '{section}'; known: {sorted(names)}")
    return cls(**value)


@dataclass
class TargetTuning:
    """Performance knobs of the target capture; the defaults are the measured best."""

    pad_multiple: Optional[int] = None
    """Padded capture (packing off: hybrids, CPU): each message's rows run right-padded to a multiple of this many
    tokens, so the target meets a few dozen row lengths instead of one per message. The extra padding is invisible
    to the real tokens (causal). Why: SDPA's cuDNN attention builds a plan for every new [b, S], tens of ms of host
    time per new length on an H200, a few times a capture on a seen length (measured:
    docs/benchmarks.md#new-shapes). None: 64 on CUDA, 1 on CPU. Packed rows have their own rounding."""

    def __post_init__(self) -> None:
        _require(self.pad_multiple is None or (type(self.pad_multiple) is int and self.pad_multiple >= 1),
                 f"target.tuning.pad_multiple={self.pad_multiple!r}: use an integer >= 1 or null")


@dataclass
class TargetConfig:
    name_or_path: Optional[str] = None
    """Local directory or hub id of a HF causal LM to load. None: build a random-init model from ``hf_config``."""

    hf_config: dict = field(default_factory=dict)
    """HF config fields (with ``model_type``) for a random-init target; ignored when ``name_or_path`` is set.
    The special value ``{builtin: tiny}`` selects the packaged tiny target (config, weights, tokenizer)."""

    init_seed: int = 0
    """Seed of a random-init target. Drafter ranks rebuild the same embedding and lm_head from it."""

    tokenizer: Optional[str] = None
    """Tokenizer path or hub id; None: the model's own (``name_or_path`` or the packaged tiny tokenizer)."""

    layer_ids: Optional[list] = None
    """Target layers whose outputs feed the drafter (id i = output of decoder layer i = HF hidden_states[i+1]),
    each below the last layer L-1 (vLLM never captures the last layer's output: refused). None:
    ``round(1 + k*(L-4)/(n-1))`` for k < num_feature_layers (Qwen3-8B: [1, 9, 17, 25, 33]); a target too shallow
    for that many distinct ids by this rule (L < n+3) gets min(n, L-1) ids spread evenly over 0..L-2 (4 layers:
    [0, 1, 2])."""

    num_feature_layers: int = 5
    """How many target layers feed the drafter when ``layer_ids`` is None (DFlash uses 5)."""

    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    """Target weights/activations: auto (bf16 on CUDA, fp32 on CPU), bfloat16, float16 or float32."""

    attn_implementation: str = "auto"
    """HF attention implementation of the target's attention layers: auto, sdpa, flex_attention,
    flash_attention_2, eager. auto = what the model class declares it supports (``_supports_sdpa``, ...), in that
    order: sdpa; else flex_attention on CUDA; else flash_attention_2 on CUDA when flash-attn is installed; else
    eager (gpt-oss: flex_attention on CUDA, eager on CPU). An explicit choice the class does not support is refused
    before any model loads. The choice is reported in the target fast-path line."""

    fast_path: Literal["auto", "require", "warn", "allow"] = "auto"
    """Target fast paths (hybrid kernels fla / causal-conv1d; MoE experts not on eager on CUDA): require | warn |
    allow. auto = require on CUDA, allow on CPU."""

    experts_implementation: Optional[str] = None
    """MoE targets: transformers' ``experts_implementation`` (grouped_mm, batched_mm, eager, ...); None:
    transformers' default (grouped_mm where the class supports it). What really runs is reported at startup."""

    quantization: Optional[Literal["fp8"]] = None
    """fp8: quantize the decoder layers' linears of a bf16 target on load (float8 e4m3 weights, one scale per
    output channel, activations scaled per token; ``torch._scaled_mm`` on CUDA with compute capability >= 8.9).
    None: the checkpoint as it is; a pre-quantized FP8 checkpoint (``quantization_config`` fine-grained ``fp8``
    or ``compressed-tensors`` float8) always runs FP8. The kernel bound is reported in the fast-path line."""

    max_batch_tokens: int = 8192
    """Token budget of one target forward (= one message). Samples of similar length are grouped up to it."""

    max_batch_samples: int = 64
    """Upper bound on samples per message, whatever their length."""

    packing: Literal["auto", "on", "off"] = "auto"
    """Feature capture over packed batches: on | off | auto. on: the batch's samples run as one row without padding
    (per-sample positions, document-causal attention through compiled flex_attention); off: right-padded rows
    through ``attn_implementation``. Same features either way. auto = on for CUDA, off on CPU. Hybrids
    (GatedDeltaNet layers) pack only through fla's and causal-conv1d's varlen kernels, which restart the recurrent
    and convolution state at each sample: without both, on is refused and auto runs them padded; with both,
    auto packs them on CUDA as it does attention-only models. Other users of the model (evaluation) keep
    ``attn_implementation``."""

    compile: Optional[bool] = None
    """torch.compile (dynamic shapes) the forward of each decoder layer the capture runs (up to the last captured
    one), with packing or without; the capture hooks stay outside the compiled graphs. Evaluation runs uncompiled.
    None: on CUDA (faster than the uncompiled packed capture for seconds of compile; measured:
    docs/benchmarks.md#target-capture), off on CPU."""

    tuning: TargetTuning = field(default_factory=TargetTuning)
    """Performance knobs (``target.tuning.*``); the defaults are the measured best."""

    tensor_parallel: int = 1
    """Ranks per target replica: each replica is this many ranks of one node holding one copy of the target,
    sharded by transformers' tensor-parallel plan (``tp_plan="auto"``) on a device mesh of those ranks. Every rank of
    a replica runs the same messages; the first one sends the features. ``topology.target_ranks`` counts ranks and
    must be a multiple of it. 1: every target rank holds the whole model."""

    def __post_init__(self) -> None:
        _check_choices(self, "target")
        self.tuning = _sub(self.tuning, TargetTuning, "target.tuning")
        _require(type(self.tensor_parallel) is int and self.tensor_parallel >= 1,
                 f"target.tensor_parallel={self.tensor_parallel!r}: use an integer >= 1")
        _require(self.compile is None or isinstance(self.compile, bool),
                 f"target.compile={self.compile!r}: use true, false or null (on CUDA, off on CPU)")
        _require(self.num_feature_layers >= 1, "target.num_feature_layers must be >= 1")
        _require(self.max_batch_tokens >= 16, "target.max_batch_tokens must be >= 16")
        _require(self.max_batch_samples >= 1, "target.max_batch_samples must be >= 1")
        if self.layer_ids is not None:
            self.layer_ids = [int(i) for i in self.layer_ids]
            _require(len(self.layer_ids) >= 1, "target.layer_ids is empty: give at least one layer id or null")
            _require(len(set(self.layer_ids)) == len(self.layer_ids),
                     f"target.layer_ids={self.layer_ids} has duplicates")
            _require(self.layer_ids == sorted(self.layer_ids),
                     f"target.layer_ids={self.layer_ids} must be increasing")
        _require(self.name_or_path is not None or bool(self.hf_config),
                 "target: set target.name_or_path (a local dir or hub id) or target.hf_config (random init)")


@dataclass
class DrafterTuning:
    """Compile, kernel and scheduling knobs of the drafter step; the defaults are the measured best."""

    compile_dynamic: bool = True
    """On CUDA, compile flex_attention and the mask builder with dynamic shapes: one kernel serves every (b, S_pad),
    instead of a static compile (tens of seconds each) per new shape. Ignored on CPU, where inductor's C++ flex
    template does not build with dynamic shapes (torch 2.13)."""

    compile_layers: Optional[bool] = None
    """torch.compile each drafter layer (fullgraph; norms, RoPE, SiLU-gate and residuals fuse around the flex
    kernel). None: on with the flex backend, off with sdpa (true with sdpa is an error). Faster steps at Qwen3-8B
    shapes for one more compile at startup (measured: docs/benchmarks.md#drafter-step, backend flex_layers). Needs
    two inductor/dynamo settings that DFlashDrafter.configure_compile applies and explains."""

    compile_loss: Optional[bool] = None
    """torch.compile the per-chunk softmax / CE / logit gradient of the fused loss (one fused pass over the
    bf16 logits instead of ~10 eager passes over an fp32 copy). None: on with the flex backend, off with sdpa."""

    precompile: bool = True
    """Flex backend: before the first message, a dry step (forward and backward of a synthetic batch, nothing
    updated, no collective) of each planned batch shape that would compile (one sample / several, the first
    two context lengths of each), so that no compile stalls training later. The time is logged."""

    flex_kernel_options: Optional[dict] = None
    """Triton tile options passed to every flex_attention call (``kernel_options``), e.g. the backward tiles
    ``{bwd_BLOCK_M1: 64, bwd_BLOCK_N1: 128, bwd_BLOCK_M2: 128, bwd_BLOCK_N2: 64, bwd_num_warps: 8,
    bwd_num_stages: 3}`` (``fwd_``/``bwd_`` prefixes pick the kernel). None: inductor's defaults for the GPU.
    ``python bench/flex_tune.py`` autotunes them for your shapes and prints the dict to paste here."""

    loss_chunk_rows: int = 2048
    """Rows of the vocab projection computed at once (the [rows, V] logits never exist whole)."""

    ctx_bucket: int = 256
    """Context lengths are padded up to a multiple of this, so the number of compiled shapes stays small."""

    micro_batches: int = 1
    """Split each step's anchors into this many groups, each its own forward (same context, a mask for its blocks:
    the numbers do not change, each block sees what it saw), then each group's backward in order, one optimizer
    step. With ``loss_on_target`` the target computes a group's loss while the drafter runs the next group's
    forward or the earlier groups' backward. Costs one more pass of the context through fc and k/v_proj per extra
    group and smaller kernels (the drafter alone, per group count, measured: docs/benchmarks.md#head-on-target).
    num_anchors must divide."""

    loss_on_target: bool = False
    """Run the frozen lm_head and the loss (any ``drafter.loss``) of each training step on the target rank that sent
    its message (dflash_dist/comm/head_offload.py): the drafter sends its final hidden rows and labels [rows, H] (kind=kl:
    and their top-k) and gets back the loss sum, the argmax and the gradient with respect to those rows (D-PACE: and
    their weights, which the step's weight sum then waits for). Moves ~28% of a drafter step's FLOPs (550
    tokens, 256 anchors) onto targets that would otherwise idle in a drafter-bound job. Use micro_batches >= 2 so
    the drafter does not wait for the reply. Needs target ranks that can serve while they wait: rendezvous sends
    (forced on). Faster than the local loss with 2 or 4 groups in a drafter-bound
    job, the same loss curve (measured: docs/benchmarks.md#head-on-target). ``topology.target_ranks=auto`` and
    dflash-plan still measure the drafter with its loss local."""

    local_loss_groups: int = 0
    """With ``loss_on_target``: the last this many anchor groups keep their loss on the drafter, computed while the
    target serves the first ones: for targets too busy to serve every group in time. Each group's backward waits
    for its own reply only, so the last reply arrives during the earlier groups' backward; on an idle target
    serving every group is faster (2x H200, 8B shapes, 2 groups: 1 local 1.06x, none local 1.18x). Must be
    < micro_batches."""

    def __post_init__(self) -> None:
        _require(self.loss_chunk_rows >= 16, "drafter.tuning.loss_chunk_rows must be >= 16")
        _require(self.ctx_bucket >= 16 and self.ctx_bucket % 16 == 0,
                 f"drafter.tuning.ctx_bucket={self.ctx_bucket}: must be a multiple of 16")
        _require(self.micro_batches >= 1, f"drafter.tuning.micro_batches={self.micro_batches}: must be >= 1")
        _require(0 <= self.local_loss_groups < self.micro_batches,
                 f"drafter.tuning.local_loss_groups={self.local_loss_groups}: must be >= 0 and < "
                 f"drafter.tuning.micro_batches={self.micro_batches} (at least one group's loss goes to the target)")
        if self.flex_kernel_options is not None:
            opts = dict(self.flex_kernel_options)
            bad = {k: v for k, v in opts.items() if not isinstance(k, str) or not isinstance(v, (bool, int))}
            _require(not bad, f"drafter.tuning.flex_kernel_options: keys must be option names and values int/bool, "
                              f"got {bad}")
            self.flex_kernel_options = opts


@dataclass
class DrafterLoss:
    """The drafter's training objective (``drafter.loss.*``; the objectives live in dflash_dist/model/objectives/)."""

    objective: str = "decayed_ce"
    """The objective by registry name (``decayed_ce``: cross-entropy on the data's labels, slot k weighted
    exp(-(k-1)/gamma), normalised by the weight sum of the whole step) or ``package.module:ClassName`` of one
    registered elsewhere (docs/design.md, "Adding an objective")."""

    gamma: Optional[float] = None
    """Slot weight exp(-(k-1)/gamma) of ``decayed_ce``. None: the paper's gamma for the block size (7, 5, 4 for
    B = 16, 10, 8); other B get ``objectives.decayed_ce.paper_gamma``'s piecewise-linear interpolation through
    those three points (a rule of this project, not the paper's)."""

    labels: Literal["data", "target"] = "data"
    """What each block slot is supervised with: ``data`` = the corpus's next token (regenerate the corpus with the
    target first, ``dflash-regenerate``, so it is the target's own text), ``target`` = the target's greedy next token
    given the true prefix, computed on the target rank from its final layer (the forward then runs every layer,
    final norm and lm_head) and sent as 8 bytes per token: no regeneration needed."""

    kind: Literal["ce", "kl"] = "ce"
    """The loss of a slot: ``ce`` = cross-entropy on its label; ``kl`` = KL(target || drafter) on the target's
    next-token distribution restricted to its ``kl_top_k`` most likely tokens and renormalised there (the target
    sends their ids and probabilities; needs ``labels=target``, whose greedy token the accuracy statistics use)."""

    kl_top_k: int = 20
    """Tokens of the target's distribution that ``kind=kl`` distils (each costs 12 bytes per position on the wire)."""

    weighting: Literal["decay", "dpace"] = "decay"
    """Per-position weights of the CE objectives: ``decay`` (slot k weighted exp(-(k-1)/gamma)) or ``dpace``
    (D-PACE: slot j weighted by the drafter's own detached confidences, sum over t >= j of prod over i <= t of
    (1-alpha) exp(-CE_i) + alpha; model/objectives/dpace.py)."""

    dpace_alpha: float = 0.5
    """Smoothing alpha of ``weighting=dpace``, in (0, 1]: 1 gives every valid slot of a block the weight of the
    number of valid slots from it to the block's end."""

    def __post_init__(self) -> None:
        _check_choices(self, "drafter.loss")
        _require(0.0 < self.dpace_alpha <= 1.0, f"drafter.loss.dpace_alpha={self.dpace_alpha}: must be in (0, 1]")
        _require(self.gamma is None or self.gamma > 0, f"drafter.loss.gamma={self.gamma}: must be > 0")
        _require(1 <= self.kl_top_k <= 1024, f"drafter.loss.kl_top_k={self.kl_top_k}: must be in 1..1024")
        _require(self.kind != "kl" or self.labels == "target",
                 "drafter.loss.kind=kl distils the target's distribution: set drafter.loss.labels=target")
        _require(bool(self.objective), "drafter.loss.objective: name an objective (decayed_ce)")


@dataclass
class DrafterDomino:
    """The Domino variant's additions (``drafter.domino.*``, read when ``drafter.variant=domino``): a GRU over
    the block's previous tokens whose projection corrects the logits (model/domino.py checks the values)."""

    emb_dim: int = 256
    """Width E of the correction's hidden layer (Linear(H + G_r -> E) -> SiLU -> Linear(E -> V))."""
    gru_hidden_dim: int = 1024
    """State width G_r of the GRU over the previous tokens' embeddings."""
    pure_draft_prefix_len: int = 1
    """Proposals at the block start that keep the backbone's logits; SGLang serves only 1."""
    shift_label: bool = False
    """Engine label alignment; false (slot k predicts anchor + k) is the only one this drafter trains."""
    lambda_base_start: float = 1.0
    """Weight lambda of the base cross-entropy at step 0: loss = (1 - lambda) CE(corrected) + lambda CE(base)."""
    lambda_base_decay_ratio: float = 0.5
    """Fraction of ``train.max_steps`` over which lambda decays linearly to 0."""


@dataclass
class DrafterDFlash2:
    """The DFlash2 additions (``drafter.dflash2.*``, used when ``drafter.variant=dflash2``); the same fields as
    ``model/dflash2.DFlash2Settings``, which checks them against the drafter's shape."""

    conv_kernel_size: int = 2
    """Taps k of each grouped dynamic convolution (tap t reads the token t slots earlier in the same block)."""

    conv_group_size: int = 16
    """Channels g sharing one dynamic coefficient; must divide the hidden size."""

    selector_rank: int = 256
    """Rank r of the candidate selector's codebooks and hidden projection (the codebooks are 2 x V x r)."""

    selector_top_k: int = 16
    """Candidates K per position: the top-K of the target head's logits, re-ranked by the selector."""

    output_multiplier: float = 1.0
    """Scale of the top-K unary logits before the soft cap (the engines' ``output_multiplier``)."""

    final_logit_softcapping: Optional[float] = None
    """Soft cap c of the unary logits, c * tanh(x / c), after the multiplier; None or 0 = off."""

    selector_loss_weight: float = 1.0
    """Weight of the selector's K-way cross-entropy, added to the base objective (same per-position weights,
    same whole-step normaliser)."""

    selector_gold: Literal["exclude", "replace_last"] = "replace_last"
    """A gold token outside the top-K: ``exclude`` (that position has no selector loss) or ``replace_last`` (it
    takes the last candidate's place with its own unary logit). ``replace_last`` by measurement: on a larger CPU
    run (``bench/tau_compare.py --epochs 5 --holdout 128``, 371 steps, 128 prompts, seeds 0 and 1) its tau was
    4.21 against 4.20 (pooled 2.65 against 2.61; paired over the prompts +0.015 +- 0.024), within the standard
    error; on the tiny default (231 steps, 16 prompts) 4.14 against 4.18, pooled 2.63 against 2.47
    (docs/benchmarks.md)."""

    def __post_init__(self) -> None:
        _check_choices(self, "drafter.dflash2")


@dataclass
class DrafterConfig:
    variant: str = "dflash"
    """The drafter variant by registry name (``dflash``: the z-lab DFlash drafter) or ``package.module:ClassName``
    of one registered elsewhere. A variant adds its weights, proposal step, FLOPs and export fields to the
    DFlash drafter (dflash_dist/model/variants/; docs/design.md, "Adding a drafter variant"); a checkpoint of
    another variant is never resumed."""

    num_layers: int = 5
    """Number of DFlash draft layers (Qwen3 decoder layers with target features as extra keys/values)."""

    block_size: int = 16
    """Tokens drafted per block: slot 0 is the anchor (known) token, slots 1..B-1 are MASK tokens to predict."""

    num_anchors: int = 512
    """Blocks per sample per step: anchors sampled from supervised positions; fewer are padded (static shapes)."""

    layer_types: Optional[list[str]] = None
    """Attention kind of each drafter layer, ``full_attention`` or ``sliding_attention`` (num_layers entries).
    None: every layer full attention, or every layer sliding when ``sliding_window`` is set."""

    sliding_window: Optional[int] = None
    """Window W of the sliding_attention layers: a block query at position p sees context keys before its anchor
    with p - k < W, and its own block (model/masks.py), as the z-lab model and vLLM serve it; the export writes
    ``layer_types``, ``use_sliding_window``, ``sliding_window``. W >= block_size: the block then sees itself whole,
    so loaders with a left-only window (SGLang keeps ``sliding_window - 1`` as window_left) and with a symmetric
    one (vLLM, z-lab) agree. None: no sliding layers."""

    mask_token_id: Optional[int] = None
    """Token id of MASK. None: the tokenizer's mask token (``<|MASK|>``/``mask_token``) or the packaged tiny one."""

    attention_backend: Literal["auto", "flex", "sdpa"] = "auto"
    """flex (compiled flex_attention + BlockMask; CUDA default), sdpa (dense bool mask; needed on CPU:
    flex_attention has no CPU backward) or auto (flex on CUDA, sdpa on CPU). The choice is printed at startup."""

    compile: bool = True
    """torch.compile the flex attention kernel and the mask builder (fullgraph). Required for flex."""

    domino: DrafterDomino = field(default_factory=DrafterDomino)
    """The Domino variant's settings (``drafter.domino.*``; used only with ``drafter.variant=domino``)."""

    dflash2: DrafterDFlash2 = field(default_factory=DrafterDFlash2)
    """The DFlash2 convolutions and candidate selector (``drafter.dflash2.*``; ``drafter.variant=dflash2``)."""





    intermediate_size: Optional[int] = None
    """MLP width; None: the target's."""

    tuning: DrafterTuning = field(default_factory=DrafterTuning)
    """Compile, kernel and scheduling knobs (``drafter.tuning.*``); the defaults are the measured best."""

    loss: DrafterLoss = field(default_factory=DrafterLoss)
    """The training objective (``drafter.loss.*``)."""

    def __post_init__(self) -> None:
        _require(self.num_layers >= 1, f"drafter.num_layers={self.num_layers}: must be >= 1")
        _require(self.block_size >= 2, f"drafter.block_size={self.block_size}: must be >= 2 (slot 0 is the anchor)")
        _require(self.num_anchors > 0, f"drafter.num_anchors={self.num_anchors}: must be > 0")
        _check_choices(self, "drafter")
        self.tuning = _sub(self.tuning, DrafterTuning, "drafter.tuning")
        self.loss = _sub(self.loss, DrafterLoss, "drafter.loss")
        self.domino = _sub(self.domino, DrafterDomino, "drafter.domino")
        self.dflash2 = _sub(self.dflash2, DrafterDFlash2, "drafter.dflash2")
        _require(bool(self.variant), "drafter.variant: name a variant (dflash)")
        _require(self.num_anchors % self.tuning.micro_batches == 0,
                 f"drafter.tuning.micro_batches={self.tuning.micro_batches}: must divide drafter.num_anchors="
                 f"{self.num_anchors}")
        if self.layer_types is not None:
            self.layer_types = [str(t) for t in self.layer_types]
            bad = sorted(set(self.layer_types) - {"full_attention", "sliding_attention"})
            _require(not bad and len(self.layer_types) == self.num_layers,
                     f"drafter.layer_types={self.layer_types}: give drafter.num_layers={self.num_layers} entries, "
                     "each full_attention or sliding_attention")
        elif self.sliding_window is not None:
            self.layer_types = ["sliding_attention"] * self.num_layers
        sliding = "sliding_attention" in (self.layer_types or [])
        _require(not sliding or self.sliding_window is not None,
                 "drafter.layer_types has sliding_attention layers: set drafter.sliding_window")
        if self.sliding_window is not None:
            _require(sliding, f"drafter.sliding_window={self.sliding_window} but drafter.layer_types has no "
                     "sliding_attention layer")
            _require(int(self.sliding_window) >= self.block_size,
                     f"drafter.sliding_window={self.sliding_window}: must be >= drafter.block_size="
                     f"{self.block_size} (a block sees itself whole)")
            self.sliding_window = int(self.sliding_window)
        if self.attention_backend == "flex" and not self.compile:
            raise ConfigError("drafter.attention_backend=flex needs drafter.compile=true: uncompiled flex_attention "
                              "runs the dense fallback (43x slower, 200x the memory). Use sdpa to run without compile.")


@dataclass
class DataConfig:
    source: str = "builtin"
    """builtin (the packaged corpus, regenerated by the tiny target), builtin_original (the same dialogues as written,
    not regenerated) or a path to a JSONL file of
    ``{"messages": [{"role": ..., "content": ...}]}`` conversations (loss on assistant tokens only)."""

    max_length: int = 3072
    """Longest sample in tokens (the paper's 3072)."""

    overlong: Literal["truncate", "skip"] = "truncate"
    """What to do with a sample longer than max_length: truncate or skip (counted either way)."""

    max_bad_fraction: float = 0.05
    """Fail the run with a summary if more than this fraction of rows is malformed or unusable."""

    num_workers: int = 2
    """Most worker processes for tokenization (processes, never threads: the step must not fight for the GIL),
    used only where they pay off: one per 16,384 rows and at most the CPUs, none below 32,768 rows (a spawned
    worker's start-up costs seconds; ``data.tokenize.tokenize_workers``, measured by bench/tokenize_workers.py)."""

    shuffle_seed: int = 1234
    """Seed of the per-epoch shuffle. The batching plan depends only on it, the data and the target batching."""

    sort_window_batches: int = 32
    """Length bucketing: samples are sorted by length within windows of this many batches before packing
    (less padding on the target). 1 = no bucketing: every batch mixes lengths (smoother loss on tiny data)."""

    holdout: int = 256
    """Conversations kept out of training for acceptance evaluation (prompts only), at most 10% of the data's
    conversations (none for fewer than 10; the log says how many). 256: on the tiny default the
    pooled tau over 256 held-out prompts has a bootstrap standard deviation of 0.10 (5% of 1.87) and z-lab's
    per-prompt-mean tau 0.36 (5% of 7.07); over 16 prompts they are 0.70 and 1.40 (docs/benchmarks.md)."""

    cache_dir: Optional[str] = None
    """Where the pre-tokenized dataset is cached; None: <output_dir>/data_cache."""

    chat_template_kwargs: Optional[dict] = None
    """Extra ``apply_chat_template`` arguments, e.g. ``{enable_thinking: false}`` for Qwen3-family templates.
    Applied identically when tokenizing the training data, in the in-training evaluation, in dflash-eval and
    dflash-regenerate (both read it from the checkpoint or export), and recorded in the checkpoint and the
    export: a drafter trained on non-thinking renderings serves non-thinking requests. None (the default, so that a
    Hydra override ``data.chat_template_kwargs={enable_thinking:false}`` replaces it) reads as ``{}``."""

    def __post_init__(self) -> None:
        _require(self.max_length >= 8, f"data.max_length={self.max_length}: must be >= 8")
        _check_choices(self, "data")
        _require(0.0 <= self.max_bad_fraction <= 1.0, "data.max_bad_fraction must be in [0, 1]")
        _require(self.num_workers >= 0, "data.num_workers must be >= 0")
        _require(self.holdout >= 0, "data.holdout must be >= 0")
        if self.chat_template_kwargs is None:
            self.chat_template_kwargs = {}
        _require(isinstance(self.chat_template_kwargs, dict) and all(isinstance(k, str)
                                                                     for k in self.chat_template_kwargs),
                 f"data.chat_template_kwargs={self.chat_template_kwargs!r}: must be a mapping of names to values")
        self.chat_template_kwargs = dict(self.chat_template_kwargs)


@dataclass
class TopologyTuning:
    """Transport knobs; the defaults are the measured best."""

    rendezvous_sends: Optional[bool] = None
    """Post each payload send only after the drafter has posted the matching receive (a counter per link in the
    rendezvous store). An NCCL send posted earlier runs on the target GPU until the drafter takes it and slowed
    the target's capture 1.4-1.5x on an H200 (bench/send_overlap.py). None: on when the payloads go over NCCL,
    off over gloo (CPU: a waiting gloo send costs nothing, and the target could post a payload only between its
    synchronous CPU forwards). False: send at once."""


@dataclass
class TopologyConfig:
    target_ranks: Any = 1
    """How many ranks run the target (one node: the last T global ranks, W-T..W-1; several nodes: the same share of
    every node, see comm/topology.py); the rest train the drafter. A multiple of ``target.tensor_parallel``. ``auto``:
    measure on this job's ranks (rank 0 times drafter steps, rank W-1 target batches) and take the split with
    the highest predicted samples/s (``dflash_dist.cli.plan``; W = 2 is always 1 + 1, without measuring)."""

    plan: Optional[str] = None
    """With ``target_ranks=auto``: a dflash-plan plan.json. The job takes the split the plan chose for its world
    size instead of measuring, and logs the plan's predicted samples/s next to the samples/s it measures."""

    cross_node: bool = False
    """Multi-node jobs: let features cross nodes. False (default): every node runs the same split (its own target
    replicas and the drafters they feed) and a split that cannot be node-local is refused; True: a split that
    cannot be node-local runs with the single-node layout (drafters first), and most messages cross the network."""

    max_in_flight: int = 4
    """Messages a target may have sent but not yet seen received, per drafter link (backpressure)."""

    timeout_s: float = 60.0
    """A rank that waits this long on a peer after warm-up declares the job dead and exits non-zero."""

    warmup_timeout_s: float = 900.0
    """The same limit during model load and compilation (and for the calibration of ``target_ranks=auto``)."""

    plan_target_batches: int = 8
    """``target_ranks=auto`` and dflash-plan: target batches (the first messages of the plan) timed to measure
    target supply, after an untimed warm-up pass over them (steady state)."""

    plan_drafter_steps: int = 8
    """``target_ranks=auto`` and dflash-plan: drafter training steps (on the same first messages, random
    features) timed to measure drafter demand, after an untimed warm-up pass over them. dflash-plan on CPU
    rehearses each split instead: windows of this many steps of the real job, after one warm-up window."""

    plan_rounds: int = 5
    """``target_ranks=auto`` and dflash-plan: each side times its batches (steps) this many times over; its rate is
    the median round's, and the spread of the rounds (min..max) makes near-ties, which go to fewer targets.
    dflash-plan on CPU: the rehearsal's steady windows."""

    plan_min_seconds: float = 2.0
    """``target_ranks=auto`` and dflash-plan: more rounds (up to 10 x plan_rounds) until each side has timed at
    least this long (a few tenths of a second on a busy machine flip the choice between runs)."""

    tuning: TopologyTuning = field(default_factory=TopologyTuning)
    """Transport knobs (``topology.tuning.*``)."""

    def __post_init__(self) -> None:
        self.tuning = _sub(self.tuning, TopologyTuning, "topology.tuning")
        t = self.target_ranks
        if isinstance(t, str) and t.strip().isdigit():
            t = int(t)
        if isinstance(t, float) and t.is_integer():
            t = int(t)
        _require(t == "auto" or (isinstance(t, int) and not isinstance(t, bool) and t >= 1),
                 f"topology.target_ranks={self.target_ranks!r}: give a positive integer (>= 1 target rank) or auto")
        self.target_ranks = t
        _require(self.plan is None or t == "auto", f"topology.plan={self.plan}: set topology.target_ranks=auto "
                 f"to take the split from the plan (or drop topology.plan)")
        _require(self.max_in_flight >= 1, "topology.max_in_flight must be >= 1")
        _require(self.timeout_s > 0 and self.warmup_timeout_s > 0, "topology timeouts must be > 0")
        _require(self.plan_target_batches >= 1, "topology.plan_target_batches must be >= 1")
        _require(self.plan_drafter_steps >= 1, "topology.plan_drafter_steps must be >= 1")
        _require(self.plan_rounds >= 1, "topology.plan_rounds must be >= 1")
        _require(self.plan_min_seconds >= 0, "topology.plan_min_seconds must be >= 0")


@dataclass
class TrainTuning:
    """Scheduling knobs of the training run; the defaults are the measured best."""

    eval_in_slices: bool = True
    """Run an in-training evaluation one verify step at a time while the target waits for its drafters to take
    messages (its idle time in a drafter-bound job), so it does not delay the features. An evaluation still running
    when the next one is due makes the leader skip that one (logged); the last one runs whole after the stream.
    Needs waits the target can poll (NCCL, or rendezvous sends); else, and with false, each evaluation runs whole
    between two messages and the drafters wait for it."""


@dataclass
class TrainConfig:
    output_dir: Optional[str] = None
    """Run directory: run.json (what the run belongs to: data, tokenizer, target, drafter, plan, by content),
    config.json (the resolved config), metrics.jsonl, checkpoints, wandb files. One run per directory. None: a new
    ``outputs/run-YYYYmmdd-HHMMSS`` under the current directory for every run (rank 0 picks it, every rank uses
    it). A directory that already holds a run is refused unless ``resume`` continues that run."""

    max_steps: int = -1
    """Train exactly this many optimizer steps, repeating the data as needed (more epochs in the plan); -1: run
    ``epochs`` over the data. A resume with a larger value extends the run (logged)."""

    epochs: int = 6
    """Passes over the training data (the paper's 6); used only when ``max_steps`` is -1. A resume with a larger
    value extends the run (logged)."""

    lr: float = 6e-4
    """Peak AdamW learning rate."""

    warmup_ratio: float = 0.04
    """Fraction of steps of linear warmup before the cosine decay."""

    min_lr_ratio: float = 0.0
    """Cosine floor as a fraction of lr."""

    weight_decay: float = 0.0
    """AdamW weight decay."""

    betas: list = field(default_factory=lambda: [0.9, 0.95])
    """AdamW betas."""

    grad_clip: float = 1.0
    """Global gradient-norm clip."""

    seed: int = 0
    """Seed for drafter init and anchor sampling (per rank: seed + rank)."""

    device: Literal["auto", "cuda", "cpu"] = "auto"
    """auto (cuda if available), cuda or cpu."""

    checkpoint_every: int = 0
    """Save resumable state every N steps (0: only at the end and on SIGTERM/SIGINT)."""

    keep_checkpoints: int = 2
    """How many step checkpoints to keep."""

    resume: str = "none"
    """none (a new run), auto (the newest complete checkpoint of ``output_dir``; without ``output_dir``, of the
    newest run under outputs/ with the same data, tokenizer, target and drafter), or a checkpoint directory.
    A checkpoint of other data, tokenizer, target, drafter shape or batching plan is refused before any model
    loads, naming what differs; one with nothing left to train ends the job at once (exit 0)."""

    eval_every: int = 0
    """Acceptance-length evaluation every N steps on the target ranks (0: only at the end if eval_prompts > 0)."""

    eval_prompts: int = 0
    """Held-out prompts per evaluation (0 disables in-training evaluation)."""

    eval_max_new_tokens: int = 128
    """Tokens generated per evaluation prompt."""

    tuning: TrainTuning = field(default_factory=TrainTuning)
    """Scheduling knobs (``train.tuning.*``)."""

    def __post_init__(self) -> None:
        _check_choices(self, "train")
        self.tuning = _sub(self.tuning, TrainTuning, "train.tuning")
        _require(self.max_steps == -1 or self.max_steps > 0, f"train.max_steps={self.max_steps}: -1 or > 0")
        _require(self.epochs >= 1, f"train.epochs={self.epochs}: must be >= 1")
        _require(self.lr > 0, "train.lr must be > 0")
        _require(0 <= self.warmup_ratio < 1, "train.warmup_ratio must be in [0, 1)")
        _require(self.grad_clip > 0, "train.grad_clip must be > 0")
        _require(self.checkpoint_every >= 0 and self.eval_every >= 0, "checkpoint_every/eval_every must be >= 0")
        _require(self.keep_checkpoints >= 1, "train.keep_checkpoints must be >= 1")
        _require(len(self.betas) == 2, "train.betas needs two values")


@dataclass
class WandbConfig:
    mode: Optional[Literal["online", "offline", "disabled"]] = None
    """online, offline or disabled. None: online only if credentials are configured, else offline
    (never wait ~90 s on a network that is not there)."""

    project: str = "dflash_dist"
    """wandb project."""

    entity: Optional[str] = None
    """wandb entity (team)."""

    name: Optional[str] = None
    """Run name; None: the output directory's name."""

    def __post_init__(self) -> None:
        _check_choices(self, "logging.wandb")


@dataclass
class LoggingDebug:
    """Audits, traces and profiles for finding out why a run is slow or wrong; all off by default."""

    record_sample_ids: bool = False
    """Append the sample ids of every trained message to <output_dir>/sample_log/rank<r>.jsonl (audits and
    tests of the no-loss/no-repeat guarantee; costs a host sync per step on GPU)."""

    trace_target: bool = False
    """Each target rank appends one line per message to <output_dir>/target_trace/rank<r>.jsonl: samples,
    tokens, and where its time went (stream stall before the capture, the capture itself, backpressure wait
    before the send), for finding which side of the pipeline is slow and why."""

    profile_step: int = -1
    """Drafter ranks train this step (0-based, counted in this run) under torch.profiler, write its Chrome trace
    to <output_dir>/profile/drafter_rank<r>_step<N>.json and log its phase timeline: each anchor group's forward,
    its loss or head request, each group's backward (waiting for its head reply), optimizer
    (``bench/profile_timeline.py`` prints a written trace). The device is synchronized around that step. Target
    ranks trace their first message for that step the same way (target_rank<r>_step<N>.json: capture, send, the
    drafter taking it), after their earlier sends are taken (target.loop.MessageTrace says why). -1: off."""

    def __post_init__(self) -> None:
        _require(self.profile_step == -1 or self.profile_step >= 4,
                 f"logging.debug.profile_step={self.profile_step}: use -1 (off) or a step >= 4 (steps 0-3 compile, "
                 "run the startup report's profile and the host-sync check)")


@dataclass
class LoggingConfig:
    log_every: int = 10
    """Log metrics every N steps (console, metrics.jsonl, wandb)."""

    progress_bar: bool = True
    """Rank 0 shows a progress bar with samples/s and ETA when its stderr is a terminal (else, and with false, one
    log line per logged step)."""

    wandb: WandbConfig = field(default_factory=WandbConfig)
    """Weights & Biases settings."""

    peak_tflops: Optional[float] = None
    """bf16 peak of one GPU (TFLOP/s) for the MFU metrics (drafter_mfu, target<r>_mfu). None: the vendor figure
    for known GPUs (H100/H200 989.4, A100 312, ...); no MFU on CPU or unknown devices. Set it to a measured
    matmul rate to report MFU against that instead. An FP8 target's target<r>_mfu counts against the FP8 peak
    (the vendor figure, H100/H200 1978.9; or twice this value when set)."""

    debug: LoggingDebug = field(default_factory=LoggingDebug)
    """Audits, traces and profiles (``logging.debug.*``); all off by default."""

    def __post_init__(self) -> None:
        self.wandb = _sub(self.wandb, WandbConfig, "logging.wandb")
        self.debug = _sub(self.debug, LoggingDebug, "logging.debug")
        _require(self.log_every >= 1, "logging.log_every must be >= 1")
        _require(self.peak_tflops is None or self.peak_tflops > 0, "logging.peak_tflops must be > 0 (or null)")


@dataclass
class JobConfig:
    target: TargetConfig
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    data: DataConfig = field(default_factory=DataConfig)
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    @staticmethod
    def from_dict(d: dict) -> "JobConfig":
        known = {f.name for f in dataclasses.fields(JobConfig)}
        unknown = set(d) - known - {"hydra"}
        _require(not unknown, f"unknown config groups {sorted(unknown)}; known: {sorted(known)}")
        parts = {}
        for name, cls in GROUPS.items():
            section = dict(d.get(name) or {})
            names = {f.name for f in dataclasses.fields(cls)}
            bad = set(section) - names
            _require(not bad, f"unknown keys {sorted(bad)} in '{name}'; known: {sorted(names)}")
            parts[name] = cls(**section)
        return JobConfig(**parts)

    @staticmethod
    def from_omegaconf(cfg) -> "JobConfig":
        from omegaconf import OmegaConf
        return JobConfig.from_dict(OmegaConf.to_container(cfg, resolve=True))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


GROUPS = {"target": TargetConfig, "drafter": DrafterConfig, "data": DataConfig, "topology": TopologyConfig,
          "train": TrainConfig, "logging": LoggingConfig}


def group_defaults(cls) -> dict:
    """A config dataclass's field defaults as a plain dict (sub-groups nested), without validating them."""
    out = {}
    for f in dataclasses.fields(cls):
        v = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        out[f.name] = dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v
    return out


def register_config_groups() -> None:
    """Each group's dataclass defaults become its ``base`` option in Hydra's ConfigStore: the YAML presets in
    ``conf/`` list ``base`` first and hold only what they change, so every default lives in this file alone."""
    from hydra.core.config_store import ConfigStore
    cs = ConfigStore.instance()
    for group, cls in GROUPS.items():
        cs.store(group=group, name="base", node=group_defaults(cls))


def compose_config(overrides: list[str], conf_dir: str):
    """The job's Hydra config (the ``DictConfig``) from ``conf_dir`` and command-line style overrides, outside
    ``@hydra.main`` (dflash-plan, dflash-doctor, benchmarks)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    register_config_groups()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=os.path.abspath(conf_dir), version_base=None):
        return compose(config_name="config", overrides=list(overrides))


def check_overrides(args: list[str], conf_dir: str) -> None:
    """Compose the job's config from the command line once, before ``@hydra.main`` does: an unknown key or
    group option, or an override Hydra cannot parse, becomes a ``ConfigError`` (printed once by one rank, exit 2)
    instead of Hydra's message and exit 1 on every rank. ``hydra.*`` overrides take part (``hydra.searchpath``
    adds config directories); Hydra's own flags (``--help``, ``--cfg``, ``-m``) are left to Hydra."""
    if any(a.startswith("-") for a in args):
        return
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException
    try:
        compose_config(list(args), conf_dir)
    except (HydraException, OmegaConfBaseException) as e:
        msg = str(e).split("\nConfig search path:")[0].strip()
        key = getattr(e.__cause__, "full_key", None)
        if key and "not in struct" in str(e.__cause__):  # Hydra's hint (append with +key) would not help here
            parent, _, _leaf = key.rpartition(".")
            node = {g: group_defaults(c) for g, c in GROUPS.items()}
            for part in parent.split(".") if parent else ():
                node = node.get(part) if isinstance(node, dict) else None
            known = "" if not isinstance(node, dict) else \
                f"; known in '{parent}': {sorted(node)}" if parent else f"; the groups: {sorted(node)}"
            raise ConfigError(f"unknown key '{key}'{known}") from None
        cause = e.__cause__
        while cause is not None and not str(cause).strip():
            cause = cause.__cause__
        if cause is not None:
            first = str(cause).strip().splitlines()[0]
            if first and first not in msg:
                msg += f" ({first})"
        raise ConfigError(msg) from None


def default_layer_ids(num_target_layers: int, n: int = 5) -> list[int]:
    """DFlash's default feature layers: round(1 + k*(L-4)/(n-1)), k=0..n-1 (Qwen3-8B, L=36: [1,9,17,25,33]).
    A target too shallow for n distinct ids by that rule (L < n+3) gets min(n, L-1) ids spread evenly over
    0..L-2. Never the last layer L-1 (vLLM does not capture its output); [] for a 1-layer target."""
    n_layers = num_target_layers
    if n == 1:
        return [n_layers // 2] if n_layers >= 3 else [0] * (n_layers == 2)
    ids = [int(round(1 + k * (n_layers - 4) / (n - 1))) for k in range(n)]
    if n_layers >= 4 and len(set(ids)) == n:
        return ids
    m = min(n, n_layers - 1)  # distinct ids below the last layer: 0..L-2
    if m <= 1:
        return [0] * m
    return [int(round(k * (n_layers - 2) / (m - 1))) for k in range(m)]  # steps >= 1: distinct after rounding


def resolve_layer_ids(cfg: JobConfig, num_target_layers: int) -> list[int]:
    """``target.layer_ids`` or the default for this depth, refused when a layer id is out of range or the last
    layer (whose output vLLM never captures: the served drafter would get other features than it trained on)."""
    n_layers, explicit = num_target_layers, cfg.target.layer_ids
    layer_ids = list(explicit) if explicit else default_layer_ids(n_layers, cfg.target.num_feature_layers)
    _require(bool(layer_ids), f"a {n_layers}-layer target has no layer below its last one to feed the drafter "
                              "(vLLM never captures the last layer's output): use a target with at least 2 layers")
    bad = [i for i in layer_ids if not 0 <= i < n_layers]
    _require(not bad, f"target.layer_ids {bad} out of range for a target with {n_layers} decoder layers "
                      f"(valid: 0..{n_layers - 2}; id i = output of decoder layer i)")
    if n_layers - 1 in layer_ids:
        fix = default_layer_ids(n_layers, len(layer_ids))
        raise ConfigError(f"target.layer_ids={layer_ids} holds {n_layers - 1}, the last decoder layer of this "
                          f"{n_layers}-layer target: vLLM never captures its output, so the served drafter would "
                          f"get other features than it trained on. Use ids below {n_layers - 1}, e.g. "
                          f"target.layer_ids=[{','.join(map(str, fix))}], or leave target.layer_ids unset")
    return layer_ids


def check_split(cfg: JobConfig, world_size: int) -> None:
    """``topology.target_ranks`` leaves at least one drafter in a world of ``world_size`` ranks and forms whole
    replicas of ``target.tensor_parallel`` ranks (the one place of these rules: the job's setup and its full
    validation both ask it before any topology is built; ``comm.topology.Topology`` only asserts them)."""
    if cfg.topology.target_ranks != "auto":
        t, k = int(cfg.topology.target_ranks), cfg.target.tensor_parallel
        _require(t < world_size,
                 f"topology.target_ranks={t} leaves no drafter rank in a world of {world_size}: "
                 f"set topology.target_ranks to at most {world_size - 1} or start more processes")
        _require(t % k == 0, f"topology.target_ranks={t} is not a multiple of target.tensor_parallel={k}: "
                             f"the target ranks form replicas of {k} ranks (use {max(k, t - t % k)})")
    else:
        _require(world_size >= 2, f"topology.target_ranks=auto needs at least 2 processes (one target, one "
                                  f"drafter), got a world of {world_size}: start more processes")


def validate_job(cfg: JobConfig, world_size: Optional[int], num_target_layers: int, vocab_size: int,
                 mask_token_id: int) -> list[int]:
    """Checks that need the world size and the target's config. Returns the resolved layer ids.
    ``world_size`` None (dflash-plan: no job yet) skips the checks of the split."""
    if world_size is not None:
        check_split(cfg, world_size)
    if cfg.target.tensor_parallel > 1 and world_size is not None:  # dflash-plan (no job) measures the drafter only
        _require(cfg.drafter.loss.labels == "data",
                 "drafter.loss.labels=target with target.tensor_parallel > 1 is not supported: the lm_head of a "
                 "replica is sharded; set drafter.loss.labels=data")
    _require(not (cfg.drafter.tuning.loss_on_target and cfg.topology.tuning.rendezvous_sends is False),
             "drafter.loss_on_target needs rendezvous sends (a target serves head requests while it waits for its "
             "drafters): remove topology.tuning.rendezvous_sends=false")
    layer_ids = resolve_layer_ids(cfg, num_target_layers)
    _require(0 <= mask_token_id < vocab_size,
             f"drafter.mask_token_id={mask_token_id} is outside the target vocabulary (size {vocab_size})")
    _require(cfg.drafter.num_anchors * cfg.drafter.block_size <= 1 << 20,
             "drafter.num_anchors * drafter.block_size is unreasonably large (> 1M query rows)")
    if cfg.train.device == "cpu":
        drafter_backend(cfg.drafter, "cpu")  # flex cannot train on CPU: the backend's own rule
    return layer_ids


def resolve_device(cfg: JobConfig) -> str:
    import torch
    if cfg.train.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if cfg.train.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device=cuda but no CUDA device is visible: use train.device=cpu or auto")
    return cfg.train.device


def resolve_backend(cfg: JobConfig, device: str) -> str:
    return drafter_backend(cfg.drafter, device)


def drafter_backend(dc: "DrafterConfig", device: str) -> str:
    """The attention backend drafter.attention_backend resolves to on a ``device`` ("cuda" / "cpu"), and the one
    place of the rules that depend on it: flex cannot train on CPU, compiled layers need flex
    (``DFlashDrafter.configure_compile`` only asserts the latter)."""
    b = dc.attention_backend
    if b == "auto":
        b = "flex" if device == "cuda" else "sdpa"
    elif b == "flex" and device == "cpu":
        raise ConfigError("drafter.attention_backend=flex cannot train on CPU: torch's flex_attention has no CPU "
                          "backward. Use drafter.attention_backend=sdpa (or auto) on CPU.")
    if dc.tuning.compile_layers and b == "sdpa":
        raise ConfigError(f"drafter.tuning.compile_layers=true needs the flex backend, but drafter.attention_backend="
                          f"{dc.attention_backend} is sdpa on {device}: set drafter.tuning.compile_layers=false "
                          "(or null)")
    return b


