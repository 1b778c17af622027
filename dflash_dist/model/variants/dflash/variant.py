"""DFlash (z-lab): the default drafter variant, and the base class of every other.

A variant subclass overrides what differs: ``model_class`` (a ``DFlashDrafter`` subclass), ``extra_flops``,
``export_fields``, ``extra_tensor_shapes`` / ``export_names`` and ``modeling_source``. Everything here reads the
resolved drafter description (``model/spec.DrafterSpec``) or its model config, never the job config.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional

from torch import nn

from dflash_dist.model.drafter import DFlashDrafter, DrafterModelConfig
from dflash_dist.model.variants.registry import VARIANTS

__all__ = ["DFlash"]

_CHECKPOINT_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                               "checkpoint")


@VARIANTS.register
@VARIANTS.set_base
class DFlash:
    name = "dflash"
    model_class = DFlashDrafter
    """The module trained and evaluated (``forward`` -> final hidden states, ``propose``, ``loss_terms``)."""
    architecture = "DFlashDraftModel"
    """config.json ``architectures`` of the export (what vLLM and SGLang dispatch on)."""
    modeling_source = os.path.join(_CHECKPOINT_DIR, "modeling_dflash.py")
    """The standalone transformers module copied into the export (its ``auto_map`` class serves this variant)."""
    auto_model = "modeling_dflash.DFlashDraftModel"
    """config.json ``auto_map.AutoModel`` of the export: the class of ``modeling_source`` that serves it."""

    def model_settings(self, drafter_config, model_config: DrafterModelConfig) -> Optional[dict]:
        """The variant's own settings from ``drafter.*`` (checked against the shape), recorded in the model config
        as ``variant_settings`` (so a checkpoint or export rebuilds the same module): the section ``settings_key``
        names (e.g. ``drafter.domino``), as it is; DFlash: none."""
        key = getattr(self, "settings_key", None)
        return dataclasses.asdict(getattr(drafter_config, key)) if key else None

    def identity_fields(self, drafter_config) -> dict[str, Any]:
        """The variant's settings a resume must match, by config key (``drafter.<section>.<field>``: value): part
        of the drafter's checkpoint identity, so a run is never continued with other ones. The section
        ``settings_key`` names, as ``model_settings`` records it; DFlash: none."""
        key = getattr(self, "settings_key", None)
        return {f"drafter.{key}.{k}": v for k, v in dataclasses.asdict(getattr(drafter_config, key)).items()} \
            if key else {}

    def build(self, model_config: DrafterModelConfig, backend: str) -> nn.Module:
        """The variant's module on the CPU, initialised (the trainer moves it and applies the compile flags)."""
        return self.model_class(model_config, backend)

    def extra_flops(self, model_config: DrafterModelConfig, b: int, s_pad: int, n_blocks: int, vocab: int) -> float:
        """Training FLOPs of one step beyond DFlash's (telemetry/flops.drafter_step_flops); DFlash: none."""
        return 0.0

    def export_fields(self, model_config: DrafterModelConfig) -> dict[str, Any]:
        """config.json fields of the export beyond DFlash's: ``architectures`` and a ``dflash_config`` dict merged
        into DFlash's (checkpoint/export.build_export_config)."""
        return {"architectures": [self.architecture], "dflash_config": {}}

    def extra_tensor_shapes(self, config: dict) -> dict[str, tuple]:
        """Names and shapes of the export's tensors beyond DFlash's (checked as DFlash's are); DFlash: none."""
        return {}

    def export_names(self, tensors: dict) -> dict:
        """The trained state dict under the export's tensor names; DFlash: the module's names are z-lab's."""
        return dict(tensors)

    def import_names(self, tensors: dict) -> dict:
        """An export's tensors under the module's names (the inverse of ``export_names``)."""
        return dict(tensors)

    def settings_from_export(self, config: dict) -> Optional[dict]:
        """The model config's ``variant_settings`` an exported config.json implies; DFlash: none."""
        return None
