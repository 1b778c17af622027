"""``drafter.*``: the drafter model, its variant and objective, the step's tuning, and the attention backend rule."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from dflash_dist.config.base import ConfigError, _check_choices, _require, _sub

FLEX_BACKENDS = ("AUTO", "TRITON", "FLASH")
"""The values of ``drafter.tuning.flex_kernel_options.BACKEND`` (flex_attention's kernel families)."""


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
    bwd_num_stages: 3}`` (``fwd_``/``bwd_`` prefixes pick the kernel). None: inductor's defaults, with the
    forward through TMA on sm90+ GPUs (measured faster: docs/benchmarks.md#long-context-mask); {}: inductor's
    defaults only. ``python bench/flex_tune.py`` autotunes them for your shapes and prints the dict to paste here.
    ``{BACKEND: FLASH}``: flex's FlashAttention-4 kernels instead of Triton's (Hopper or newer, the
    ``flash-attn-4`` package; refused before the model builds where either is missing). Faster than Triton's in
    the job's full step with dynamic shapes (docs/benchmarks.md#flash-full-step); opt-in because it needs a
    pre-release package and its results differ from Triton's by bf16 rounding."""

    optimizer_step: Literal["auto", "fused", "compiled"] = "auto"
    """How the gradient clip and the AdamW update run (dflash_dist/roles/drafter_rank/optim.py; the same update and optimizer
    state either way): ``fused`` (the norm, then torch's AdamW, fused on CUDA), ``compiled`` (CUDA: the clip and
    torch's multi-tensor AdamW in one torch.compile region, which writes no gradient back: 8.9 vs 11.5 ms over
    the 1.05B parameters of the Qwen3-8B DFlash drafter on an H200, measured: docs/benchmarks.md#optimizer-step;
    one compile of ~20 s at the first step). ``auto``: compiled on CUDA, fused elsewhere."""

    grad_reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    """The dtype the drafter ranks reduce gradients in: ``float32``, or ``bfloat16`` (half the bytes of the
    reduction, the all-reduce across nodes being the first limit of scaling: docs/scaling.md; DDP: torch's
    ``bf16_compress_hook``, FSDP2: ``MixedPrecisionPolicy(reduce_dtype=bfloat16)``). The master weights, the
    optimizer state and the update stay fp32. bfloat16 has not been measured safe on a GPU yet."""

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
        _check_choices(self, "drafter.tuning")
        _require(self.loss_chunk_rows >= 16, "drafter.tuning.loss_chunk_rows must be >= 16")
        _require(self.ctx_bucket >= 16 and self.ctx_bucket % 16 == 0,
                 f"drafter.tuning.ctx_bucket={self.ctx_bucket}: must be a multiple of 16")
        _require(self.micro_batches >= 1, f"drafter.tuning.micro_batches={self.micro_batches}: must be >= 1")
        _require(0 <= self.local_loss_groups < self.micro_batches,
                 f"drafter.tuning.local_loss_groups={self.local_loss_groups}: must be >= 0 and < "
                 f"drafter.tuning.micro_batches={self.micro_batches} (at least one group's loss goes to the target)")
        if self.flex_kernel_options is not None:
            opts = dict(self.flex_kernel_options)
            bad = {k: v for k, v in opts.items() if not isinstance(k, str)
                   or not (isinstance(v, (bool, int)) or (k == "BACKEND" and v in FLEX_BACKENDS))}
            _require(not bad, f"drafter.tuning.flex_kernel_options: keys must be option names and values int/bool "
                              f"(BACKEND: one of {list(FLEX_BACKENDS)}), got {bad}")
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
    the block's previous tokens whose projection corrects the logits (model/variants/domino/head.py checks the
    values)."""

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
    """Fraction of the run's optimizer steps (``train.max_steps``, or what ``train.epochs`` comes to) over which
    lambda decays linearly to 0."""


@dataclass
class DrafterDFlash2:
    """The DFlash2 additions (``drafter.dflash2.*``, used when ``drafter.variant=dflash2``);
    ``model/variants/dflash2/layers``'s ``DFlash2Settings`` is this class with its values checked against each
    other and the drafter's shape."""

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

    conv_dtype: Literal["input", "compute"] = "compute"
    """The dtype the input-side convolution of each sublayer runs in under mixed precision (CUDA's bf16 autocast):
    ``compute``, autocast's (bf16, as the engines run the whole drafter), or ``input``, its input's as the RMSNorm
    returns it (fp32, the norm weights being fp32). ``compute`` by measurement: 2.3-2.7 ms off a DFlash2 @ 8 step
    of 86-92 ms on an H200 (docs/benchmarks.md#dflash2-conv-dtype). The output side runs in its sublayer output's
    dtype (bf16 under autocast) either way, and without autocast (CPU) the two are the same. A numerics setting of
    the step, like ``drafter.tuning``: not part of the checkpoint identity, not exported."""

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
    """Token id of MASK. None: the tokenizer's mask token (``<|MASK|>``/``mask_token``), else the first embedding
    row no token uses (Qwen3), else the highest-id special token the chat template does not use (SmolLM2:
    ``<empty_output>``, 16; targets/hf.py ``resolve_mask_token_id``); the checkpoint and the export record it."""

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

    parallel: Literal["auto", "ddp", "fsdp"] = "auto"
    """How the drafter ranks share the training state (dflash_dist/roles/drafter_rank/parallel.py): ``ddp`` (every rank holds
    the whole drafter, its gradients and fp32 AdamW state: 16-20 bytes per parameter), ``fsdp`` (FSDP2's
    ``fully_shard``, per decoder layer then the root: each rank holds 1/D of them and gathers one layer's weights at
    a time, in bf16 where the drafter computes in bf16), or ``auto`` (fsdp where the memory plan says DDP does not fit
    the device, else ddp). Checkpoints hold whole tensors either way: a run resumes under the other and on another
    number of drafter ranks. FSDP's step time against DDP's has not been measured on a GPU."""

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
        if self.parallel == "fsdp":
            _require(self.tuning.optimizer_step != "compiled", "drafter.parallel=fsdp steps torch's AdamW on the "
                     "shards: set drafter.tuning.optimizer_step=auto or fused")
        if self.attention_backend == "flex" and not self.compile:
            raise ConfigError("drafter.attention_backend=flex needs drafter.compile=true: uncompiled flex_attention "
                              "runs the dense fallback (43x slower, 200x the memory). Use sdpa to run without compile.")


def check_flex_backend(kernel_options: Optional[dict], device) -> None:
    """Refuse ``BACKEND: FLASH`` in the flex kernel options where it cannot run, before anything compiles:
    FlashAttention-4's CuTe kernels (the ``flash-attn-4`` package) on Hopper or newer GPUs only. Without this the
    failure would come from inductor at the first step's compile, deep in a traceback. ``device``: a
    torch.device or its type string."""
    backend = (kernel_options or {}).get("BACKEND")
    if backend != "FLASH":
        return
    import importlib.util

    import torch

    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 9:
        raise ConfigError(f"drafter.tuning.flex_kernel_options.BACKEND=FLASH: FlashAttention-4's kernels need a "
                          f"Hopper or newer GPU; this drafter runs on {device}. Drop the key (Triton kernels).")
    try:
        found = importlib.util.find_spec("flash_attn.cute") is not None
    except ImportError:  # a flash_attn without the cute subpackage
        found = False
    if not found:
        raise ConfigError("drafter.tuning.flex_kernel_options.BACKEND=FLASH: flash_attn.cute is not importable; "
                          "install FlashAttention-4 (pip install --pre 'flash-attn-4[cu13]', [cu12] for a CUDA 12 "
                          "torch) or drop the key (Triton kernels).")


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
    if b == "flex":
        check_flex_backend(dc.tuning.flex_kernel_options, device)
    return b
