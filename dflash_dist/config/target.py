"""``target.*``: the frozen target model: which checkpoint, its dtype, layers, packing, fast path and quantization."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from dflash_dist.config.base import _check_choices, _require, _sub


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
    None: on CUDA where the model packs (faster than the uncompiled packed capture for seconds of compile;
    measured: docs/benchmarks.md#target-capture), off on CPU. Hybrids compile around their GatedDeltaNet modules,
    which run eager (their fla and causal-conv1d kernels are fused already)."""

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
