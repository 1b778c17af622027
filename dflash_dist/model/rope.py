"""The drafter's rotary embedding, computed by transformers' own RoPE code for the config the drafter exports.

A served DFlash drafter is a ``model_type: qwen3`` model (``export/write.py``): the z-lab
``DFlashDraftModel``, vLLM and SGLang build its rotary embedding from the exported ``rope_parameters``
(transformers: ``Qwen3RotaryEmbedding`` -> ``ROPE_INIT_FUNCTIONS[rope_type]``). The drafter trains with exactly
that embedding: :class:`DrafterRope` builds a ``Qwen3Config`` from the drafter's rope parameters and asks
transformers for ``(inv_freq, attention_scaling)``, for every rope type transformers implements (default,
linear, dynamic, yarn, longrope, llama3, ...); 'default', which transformers keeps in each model class, is
:func:`default_rope_parameters`, Qwen3's to the bit. cos/sin are ``cat(pos * inv_freq, pos * inv_freq).cos() *
attention_scaling`` (rotate_half layout), the formula of every transformers rotary forward.

What the drafter takes from the target (:func:`drafter_rope_parameters`): the target's rope type, theta and
scaling fields. Not taken:

* ``partial_rotary_factor`` (Qwen3-Next, Qwen3.5): the exported model is a Qwen3, whose attention rotates the
  whole head; a partial factor in the export would make the served drafter's cos/sin shorter than its heads.
  The drafter rotates every dimension, with the target's theta and scaling.
* ``mrope_section`` / ``mrope_interleaved`` (Qwen3.5, Qwen-VL text): with text-only positions every M-RoPE
  axis carries the same position, and the interleaved/sectioned frequencies are the 1-D ones; the drafter
  has no vision positions, so M-RoPE is the 1-D RoPE here.

Dynamic types follow transformers' forward-time updates without their state: ``dynamic`` recomputes
``inv_freq`` for ``seq_len = max(position) + 1`` when that exceeds ``max_position_embeddings``; ``longrope``
takes the long factors when ``seq_len`` exceeds ``original_max_position_embeddings``.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import Tensor

from dflash_dist.config import ConfigError

__all__ = ["ROPE_FIELDS", "DROPPED_FIELDS", "drafter_rope_parameters", "DrafterRope", "rope_init_functions",
           "default_rope_parameters"]

# rope_parameters keys the export keeps (what transformers' init functions read)
ROPE_FIELDS = ("rope_type", "rope_theta", "factor", "original_max_position_embeddings", "low_freq_factor",
               "high_freq_factor", "beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim",
               "short_factor", "long_factor", "truncate")
# keys of a target's rope parameters the drafter does not mirror (module docstring says why)
DROPPED_FIELDS = ("partial_rotary_factor", "mrope_section", "mrope_interleaved", "type")


def default_rope_parameters(config: Any, device: Optional[torch.device] = None, seq_len: Optional[int] = None,
                            ) -> tuple[Tensor, float]:
    """The 'default' rope type: ``1 / theta ** (arange(0, dim, 2) / dim)``, scaling 1. transformers (5.x) keeps it
    out of ``ROPE_INIT_FUNCTIONS``, in each model's ``compute_default_rope_parameters``; this is Qwen3's, operation
    for operation (a test checks bitwise equality), so a drafter rank need not import transformers' modeling stack,
    which loads torch._dynamo (seconds of CPU per process, for nothing on the uncompiled paths)."""
    base = config.rope_parameters["rope_theta"]
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float, device=device) / dim))
    return inv_freq, 1.0


def rope_init_functions() -> dict:
    """transformers' rope_type -> init function (``ROPE_INIT_FUNCTIONS``), plus 'default'."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    fns = dict(ROPE_INIT_FUNCTIONS)
    fns.setdefault("default", default_rope_parameters)
    return fns


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    if isinstance(cfg, dict):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def _is_nested(params: dict) -> bool:
    return bool(params) and all(isinstance(v, dict) or v is None for v in params.values())


def drafter_rope_parameters(target_config: Any) -> dict:
    """The drafter's ``rope_parameters`` (transformers 5 form: one dict with rope_type and rope_theta) from the
    target's HF config (object or dict; a multimodal wrapper's text_config is read). transformers 4 form
    (``rope_theta`` + ``rope_scaling``) is accepted too. Raises ConfigError for per-layer-type RoPE."""
    if not isinstance(target_config, dict) and hasattr(target_config, "get_text_config"):
        target_config = target_config.get_text_config()
    elif isinstance(target_config, dict) and isinstance(target_config.get("text_config"), dict):
        target_config = target_config["text_config"]
    params = _get(target_config, "rope_parameters") or {}
    scaling = _get(target_config, "rope_scaling") or {}
    if not isinstance(params, dict) or not isinstance(scaling, dict):
        raise ConfigError(f"target rope_parameters/rope_scaling must be dicts, got {params!r} / {scaling!r}")
    if _is_nested(params):
        raise ConfigError(f"target RoPE differs by layer type ({sorted(params)}): the drafter's attention is one "
                          "kind (full attention) and cannot mirror per-layer-type RoPE")
    merged = {**scaling, **params}
    out: dict[str, Any] = {}
    rope_type = merged.get("rope_type") or merged.get("type") or "default"
    out["rope_type"] = str(rope_type)
    theta = merged.get("rope_theta", _get(target_config, "rope_theta"))
    if theta is None:
        raise ConfigError("target config has neither rope_theta nor rope_parameters['rope_theta']")
    out["rope_theta"] = float(theta)
    for k in ROPE_FIELDS[2:]:
        if merged.get(k) is not None:
            out[k] = merged[k]
    # transformers (standardize_rope_params) defaults original_max_position_embeddings from the config
    if out["rope_type"] in ("llama3", "yarn", "longrope") and "original_max_position_embeddings" not in out:
        omax = _get(target_config, "original_max_position_embeddings") or _get(target_config,
                                                                                 "max_position_embeddings")
        if omax is not None:
            out["original_max_position_embeddings"] = int(omax)
    if out["rope_type"] not in rope_init_functions():
        raise ConfigError(f"target rope type {out['rope_type']!r} is not one transformers implements "
                          f"({sorted(rope_init_functions())})")
    return out


def _text(cfg: Any) -> Any:
    """A multimodal wrapper's text config (object or dict), else the config itself."""
    if not isinstance(cfg, dict) and hasattr(cfg, "get_text_config"):
        return cfg.get_text_config()
    if isinstance(cfg, dict) and isinstance(cfg.get("text_config"), dict):
        return cfg["text_config"]
    return cfg


# rope types whose ``factor`` stretches the positions the model was trained on
_SCALING_TYPES = ("linear", "dynamic", "yarn", "longrope", "llama3")


def position_limit(target_config: Any) -> tuple[Optional[int], Optional[str]]:
    """(the most positions the target covers, how RoPE scaling reaches them or None): ``max_position_embeddings``,
    or a scaled RoPE's ``factor`` x ``original_max_position_embeddings`` (else x ``max_position_embeddings``)
    where that is more; per-layer-type RoPE: the smallest of its types. (None, None) where the config names no
    ``max_position_embeddings``."""
    target_config = _text(target_config)
    mpe = _get(target_config, "max_position_embeddings")
    if not isinstance(mpe, int) or mpe <= 0:
        return None, None
    params = _get(target_config, "rope_parameters") or {}
    scaling = _get(target_config, "rope_scaling") or {}
    params = params if isinstance(params, dict) else {}
    scaling = scaling if isinstance(scaling, dict) else {}
    kinds = [v for v in params.values() if isinstance(v, dict)] if _is_nested(params) else [{**scaling, **params}]
    best = None
    for p in kinds or [{}]:
        kind = p.get("rope_type") or p.get("type") or "default"
        factor, base = p.get("factor"), p.get("original_max_position_embeddings") or mpe
        covered, how = mpe, None
        if kind in _SCALING_TYPES and isinstance(factor, (int, float)) and factor > 1 and isinstance(base, int):
            scaled = int(factor * base)
            if scaled > mpe:
                covered, how = scaled, f"{kind} RoPE scaling, factor {factor:g} x {base}"
        if best is None or covered < best[0]:
            best = (covered, how)
    return best


def check_positions(max_length: int, target_config: Any) -> Optional[str]:
    """Refuse samples longer than the target's positions reach (a ConfigError naming both); returns a note when
    RoPE scaling is what lets ``max_length`` past ``max_position_embeddings``, None otherwise."""
    limit, how = position_limit(target_config)
    if limit is None:
        return None
    mpe = _get(_text(target_config), "max_position_embeddings")
    if max_length > limit:
        raise ConfigError(f"data.max_length={max_length} is beyond the target's positions: max_position_embeddings "
                          f"{mpe}" + (f", {how} = {limit}" if how else " and no RoPE scaling that reaches further")
                          + f"; set data.max_length <= {limit}")
    if max_length > mpe:
        return (f"data.max_length={max_length} is beyond the target's max_position_embeddings {mpe}: allowed by its "
                f"{how} = {limit} positions")
    return None


class DrafterRope:
    """cos/sin of the drafter's RoPE: transformers' init function for ``rope_parameters`` on a Qwen3 config of
    the drafter's attention shape (what a serving engine builds from the export). fp32 on the CPU, moved to the
    device on first use (kept out of the module's buffers so ``.to(bfloat16)`` cannot round it)."""

    def __init__(self, rope_parameters: dict, *, head_dim: int, hidden_size: int, num_attention_heads: int,
                 max_position_embeddings: int):
        from transformers import Qwen3Config
        self.rope_parameters = dict(rope_parameters)
        self.rope_type = self.rope_parameters.get("rope_type", "default")
        self.hf_config = Qwen3Config(hidden_size=hidden_size, num_attention_heads=num_attention_heads,
                                     num_key_value_heads=num_attention_heads, head_dim=head_dim,
                                     max_position_embeddings=max_position_embeddings,
                                     rope_parameters=dict(self.rope_parameters))
        fns = rope_init_functions()
        if self.rope_type not in fns:
            raise ConfigError(f"rope type {self.rope_type!r}: transformers implements {sorted(fns)}")
        self._fn = fns[self.rope_type]
        inv_freq, scaling = self._init(None)
        self.inv_freq = inv_freq.float()
        if self.inv_freq.shape[0] * 2 != head_dim:
            raise ConfigError(f"rope parameters {self.rope_parameters} give {2 * self.inv_freq.shape[0]} rotary "
                              f"dims for head_dim {head_dim}: the drafter rotates the whole head")
        self.attention_scaling = float(scaling)
        self.max_position_embeddings = int(max_position_embeddings)
        self._long: Optional[Tensor] = None
        self._on: dict = {}

    def _init(self, seq_len: Optional[int]) -> tuple[Tensor, float]:
        # on the CPU even inside a meta-device context (the export builds the module on meta to check names)
        with torch.device("cpu"):
            if seq_len is None:
                return self._fn(self.hf_config, device=torch.device("cpu"))
            return self._fn(self.hf_config, device=torch.device("cpu"), seq_len=seq_len)

    def _inv_freq_for(self, seq_len: Optional[int]) -> tuple[Tensor, bool]:
        """(inv_freq, cacheable)."""
        if seq_len is None:
            return self.inv_freq, True
        if "dynamic" in self.rope_type and seq_len > self.max_position_embeddings:
            return self._init(seq_len)[0].float(), False
        if self.rope_type == "longrope":
            omax = int(self.rope_parameters["original_max_position_embeddings"])
            if seq_len > omax:
                if self._long is None:
                    self._long = self._init(omax + 1)[0].float()
                return self._long, True
        return self.inv_freq, True

    @property
    def depends_on_length(self) -> bool:
        return "dynamic" in self.rope_type or self.rope_type == "longrope"

    def inv_freq_on(self, device, seq_len: Optional[int] = None) -> Tensor:
        inv, cacheable = self._inv_freq_for(seq_len)
        if not cacheable:
            return inv.to(device)
        key = (str(device), id(inv))
        hit = self._on.get(key)
        if hit is None:
            hit = self._on[key] = inv.to(device)
        return hit

    def cos_sin(self, positions: Tensor, dtype: torch.dtype, inv_freq: Optional[Tensor] = None
                ) -> tuple[Tensor, Tensor]:
        """cos/sin [..., head_dim] for integer positions, in ``dtype`` (computed in fp32, as transformers)."""
        if inv_freq is None:
            inv_freq = self.inv_freq_on(positions.device)
        freqs = positions.float()[..., None] * inv_freq.float()
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_scaling != 1.0:
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)

    def describe(self) -> str:
        extra = {k: v for k, v in self.rope_parameters.items() if k not in ("rope_type", "rope_theta")
                 and not isinstance(v, list)}
        s = f"{self.rope_type} (theta {self.rope_parameters.get('rope_theta'):g}"
        if extra:
            s += ", " + ", ".join(f"{k}={v}" for k, v in sorted(extra.items()))
        if not math.isclose(self.attention_scaling, 1.0):
            s += f", attention scaling {self.attention_scaling:.4f}"
        return s + ")"
