"""DFlash (z-lab): the default drafter variant, and the base class of every other.

A variant subclass overrides what differs: ``model_class`` (a ``DFlashDrafter`` subclass), ``extra_flops``,
``extra_activation_bytes``, ``export_fields``, ``extra_tensor_shapes`` / ``export_names``, ``serving_source``
and the export's checks (``export_problems``, ``config_tensor_shapes``, ``size_bounds``, ``export_detail``).
Everything here reads the resolved drafter description (``model/spec.DrafterSpec``) or its model config, never
the job config.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional

from torch import nn

from dflash_dist.model.drafter import DFlashDrafter, DrafterModelConfig
from dflash_dist.model.variants.registry import VARIANTS

__all__ = ["DFlash"]

_HERE = os.path.dirname(os.path.abspath(__file__))


@VARIANTS.register
@VARIANTS.set_base
class DFlash:
    name = "dflash"
    model_class = DFlashDrafter
    """The module trained and evaluated (``forward`` -> final hidden states, ``propose``, ``loss_terms``)."""
    architecture = "DFlashDraftModel"
    """config.json ``architectures`` of the export (what vLLM and SGLang dispatch on)."""
    title = "DFlash"
    """The variant's name in messages."""
    serving_source = os.path.join(_HERE, "serving.py")
    """Its part of the standalone transformers module an export carries as ``modeling_dflash.py`` (the export
    assembles the base DFlash part and the variants' parts: export/serving.py); None: nothing of its own. A
    variant's part starts with a comment block ending in ``serving.MARKER``; what follows is appended."""
    auto_model = "modeling_dflash.DFlashDraftModel"
    """config.json ``auto_map.AutoModel`` of the export: the class of ``modeling_dflash.py`` that serves it."""
    export_description = ("DFlash (z-lab): architectures [\"DFlashDraftModel\"], dflash_config.{mask_token_id, "
                          "mask_token, target_layer_ids, block_size}")
    """One line on what its export holds (``dflash-export --help`` lists every variant's)."""
    size_bounds: dict[str, int] = {}
    """Upper bounds of its own sizes (``variant_settings`` keys, and the export fields ``export_size_fields``
    names), checked before any file's values reach a model build (checkpoint/validate.py)."""
    export_size_fields: tuple[str, ...] = ()
    """config.json fields of its export (``dflash_config.<key>`` or a top-level key) bounded by ``size_bounds``."""

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
        into DFlash's (export/write.build_export_config)."""
        return {"architectures": [self.architecture], "dflash_config": {}}

    def extra_activation_bytes(self, model_config: DrafterModelConfig, rows: int, chunk: int, ab: int) -> int:
        """Activation bytes of one drafter step beyond DFlash's (planning/memory.py): ``rows`` query rows,
        ``chunk`` loss rows at a time, ``ab`` bytes per activation element; DFlash: none."""
        return 0

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

    # ---- the export's checks: each is asked of every registered variant, and answers only for its own export
    def claims_export(self, config: dict) -> bool:
        """An exported config.json means to be this variant's (by default: it names its ``architecture``)."""
        return self.architecture in (config.get("architectures") or [])

    def export_problems(self, config: dict) -> list[str]:
        """What in an exported config.json of this variant a serving engine would refuse or read otherwise
        ([] for a config that is not this variant's); DFlash's own fields are checked by the export code."""
        return []

    def config_tensor_shapes(self, config: dict) -> dict[str, tuple]:
        """The tensors beyond DFlash's that an exported config.json's fields imply, read from the fields alone
        (independent of the module code; {} for a config that is not this variant's)."""
        return {}

    def tensor_hints(self, unexpected: list) -> list[str]:
        """Why unexpected tensor names of an export may be this variant's, misnamed (appended to the refusal)."""
        return []

    def export_detail(self, config: dict) -> str:
        """Appended to ``dflash-doctor --export``'s passing line: its fields and how to serve it ('' for a
        config that is not this variant's)."""
        return ""
