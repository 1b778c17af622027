"""What a target family entry is (``TargetFamily``) and the config lookups its rules share; the registry
itself is ``dflash_dist.targets.families``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from dflash_dist.config import ConfigError

__all__ = ["TargetFamily", "cfg_get", "text_config", "model_type"]


def cfg_get(cfg: Any, key: str, default: Any = None) -> Any:
    """A field of an HF config object or of its dict form."""
    if isinstance(cfg, dict):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def text_config(hf_config: Any) -> Any:
    """The language model's config: multimodal wrappers (Qwen3.5) keep its fields in ``text_config``; any other
    config (object or dict) as it is."""
    return cfg_get(hf_config, "text_config", None) or hf_config


def model_type(hf_config: Any) -> str:
    """The text config's ``model_type`` (the wrapper's when the text config has none)."""
    return str(cfg_get(text_config(hf_config), "model_type", "") or cfg_get(hf_config, "model_type", "") or "")


@dataclass(frozen=True)
class TargetFamily:
    """One family of target models and the rules the project applies to it. Rules take the text config
    (``text_config``) and, where a built model is at hand, its decoder layers (None before weights load). An
    entry is ``dataclasses.replace(dense.DEFAULT, ...)``: the default rules, some replaced."""

    name: str
    """Short name for messages and tests (dense, qwen3, qwen3_moe, gpt_oss, qwen3_next, ...)."""
    model_types: tuple = ()
    """HF ``model_type`` values of the family: the text config's and a multimodal wrapper's."""
    matches: Optional[Callable[[Any], bool]] = None
    """A test on the text config for a family known by its fields rather than its model_type (refused attention
    kinds); None: the family is found by ``model_types``."""
    refusal: Optional[str] = None
    """Why the DFlash drafter cannot mirror this family (messages put the model_type before it); None: it can."""
    mlp_width: Optional[Callable[[Any], Optional[int]]] = None
    """The drafter's MLP width when ``drafter.intermediate_size`` is unset, from the text config; None: unknown."""
    packing_problem: Optional[Callable[[Any, Optional[list]], Optional[str]]] = None
    """Why the packed capture cannot run this target (text config, decoder layers or None), or None."""
    sliding_windows: Optional[Callable[[Any, Optional[list]], tuple]] = None
    """The sliding windows its attention layers pass to their attention function, sorted."""
    attention_sinks: Optional[Callable[[list], bool]] = None
    """Whether its attention layers carry a learned sink logit (passed to attention as ``s_aux``)."""
    linear_layer_markers: tuple = ()
    """Class-name markers of its linear-attention layers, whose fast kernels ``targets/fast_path.py`` checks."""

    def drafter_refusal(self, hf_config: Any) -> Optional[str]:
        """The refusal with the target's model_type in front, or None."""
        return f"{model_type(hf_config)}: {self.refusal}" if self.refusal else None

    def drafter_intermediate(self, hf_config: Any) -> int:
        """The drafter's default MLP width, or a ConfigError naming ``drafter.intermediate_size``."""
        width = self.mlp_width(text_config(hf_config))
        if not width:
            raise ConfigError(f"the target config ({self.name} family) gives no MLP width for the drafter (no "
                              "intermediate_size; a MoE or hybrid family also reads moe_intermediate_size x "
                              "num_experts_per_tok): set drafter.intermediate_size")
        return int(width)
