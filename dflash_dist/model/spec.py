"""The drafter's resolved description, derived once from the job: model shape, backend, compile flags, loss.

``resolve_drafter`` is the one place the drafter's shape is derived from the target (``job.build_job`` calls it;
the bench scripts call it too); the role views carry the result (``role_jobs``), and the trainer, evaluation,
export, FLOP counting and checkpoint meta read it. ``from_meta`` reads the one a checkpoint recorded.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Optional

from dflash_dist.config import ConfigError, DrafterConfig, drafter_backend
from dflash_dist.model.drafter import DrafterModelConfig

__all__ = ["LossSpec", "DrafterSpec", "resolve_drafter"]


@dataclass(frozen=True)
class LossSpec:
    """The objective and its settings (``drafter.loss.*`` and the loss knobs of ``drafter.tuning``)."""
    objective: str
    """``drafter.loss.objective``: a registered name or ``package.module:ClassName``."""
    gamma: Optional[float]
    """``drafter.loss.gamma`` (None: the objective's default for the block size)."""
    chunk_rows: int
    """Rows of the vocab projection at once (``drafter.tuning.loss_chunk_rows``)."""
    compiled: bool
    """The fused loss's chunk math through torch.compile (``drafter.tuning.compile_loss``; None meant flex)."""
    labels: str = "data"
    """``drafter.loss.labels``: data or target (a checkpoint written before it: data)."""
    kind: str = "ce"
    """``drafter.loss.kind``: ce or kl."""
    kl_top_k: int = 20
    """``drafter.loss.kl_top_k``."""
    weighting: str = "decay"
    """``drafter.loss.weighting``: decay or dpace."""
    dpace_alpha: float = 0.5
    """``drafter.loss.dpace_alpha``."""


@dataclass(frozen=True)
class DrafterSpec:
    """Everything about the drafter that follows from the config and the target, resolved."""
    model: DrafterModelConfig
    """The module's shape (its ``block_size`` is the job's, the only copy)."""
    variant: str
    """``drafter.variant``: a registered name or ``package.module:ClassName``."""
    backend: str
    """Attention backend of training, flex or sdpa (``drafter.attention_backend`` on this device)."""
    compile_mask: bool
    """``drafter.compile``: the flex mask builder compiled."""
    flex_dynamic: bool
    """The dynamic-shape flex kernel and mask builder (flex on CUDA with ``drafter.tuning.compile_dynamic``)."""
    compile_layers: bool
    """Each decoder layer through torch.compile (``drafter.tuning.compile_layers``; None meant flex)."""
    flex_kernel_options: Optional[dict]
    """``drafter.tuning.flex_kernel_options`` (None: the device's defaults, model/drafter.py
    ``default_flex_kernel_options``; {}: inductor's)."""
    loss: LossSpec
    """The objective and its settings."""

    @property
    def block_size(self) -> int:
        return self.model.block_size

    def variant_impl(self):
        """The variant object (model/variants/)."""
        from dflash_dist.model.variants import variant_class
        return variant_class(self.variant)()

    def make_objective(self):
        """The objective object (model/objectives/), built for this drafter."""
        from dflash_dist.model.objectives import objective_class
        objective = objective_class(self.loss.objective)(self)
        if self.loss.kind == "kl":  # the objective's slot weights, KL to the target's distribution in place of CE
            from dflash_dist.model.objectives.distill import DistillKL
            return DistillKL(self, objective)
        return objective

    def build_model(self, backend: Optional[str] = None):
        """The variant's module on the CPU, for ``backend`` (default: the training backend), compile flags not
        applied (``DFlashDrafter.configure_compile``)."""
        return self.variant_impl().build(self.model, backend or self.backend)

    def to_meta(self) -> dict:
        """What a checkpoint records: the settings, the model config under ``model``."""
        out = asdict(self)
        out["model"] = dict(self.model.__dict__)
        return out

    @staticmethod
    def from_meta(d: dict) -> "DrafterSpec":
        d = dict(d)
        return DrafterSpec(**dict(d, model=DrafterModelConfig(**d["model"]), loss=LossSpec(**d["loss"])))


def resolve_drafter(dc: DrafterConfig, hf_config: Any, num_feature_layers: int, device_type: str) -> DrafterSpec:
    """The drafter of ``drafter.*`` on a target whose (text) HF config is ``hf_config``, trained on
    ``device_type`` ("cuda" / "cpu"). Raises ConfigError for a target the drafter cannot mirror."""
    model = DrafterModelConfig.from_target(hf_config, num_layers=dc.num_layers, num_feature_layers=num_feature_layers,
                                           block_size=dc.block_size, intermediate_size=dc.intermediate_size,
                                           layer_types=dc.layer_types, sliding_window=dc.sliding_window)
    from dflash_dist.model.variants import variant_class
    model.variant_settings = variant_class(str(dc.variant))().model_settings(dc, model)
    backend = drafter_backend(dc, device_type)
    flex = backend == "flex"
    t = dc.tuning
    spec = DrafterSpec(
        model=model, variant=str(dc.variant), backend=backend, compile_mask=bool(dc.compile),
        flex_dynamic=flex and bool(t.compile_dynamic) and device_type == "cuda",
        compile_layers=flex if t.compile_layers is None else bool(t.compile_layers),
        flex_kernel_options=None if t.flex_kernel_options is None else dict(t.flex_kernel_options),
        loss=LossSpec(objective=str(dc.loss.objective), gamma=dc.loss.gamma, chunk_rows=int(t.loss_chunk_rows),
                      compiled=flex if t.compile_loss is None else bool(t.compile_loss),
                      labels=str(dc.loss.labels), kind=str(dc.loss.kind), kl_top_k=int(dc.loss.kl_top_k),
                      weighting=str(dc.loss.weighting), dpace_alpha=float(dc.loss.dpace_alpha)))
    variant = spec.variant_impl()   # an unknown variant or objective is refused here, before any model loads
    objective = spec.make_objective()
    terms = variant.model_class.loss_term_names
    if terms and objective.weights_served and t.loss_on_target:
        # a served group's weights arrive with its reply, after the variant's terms were weighted
        raise ConfigError(f"drafter.variant={dc.variant} weights its own loss ({', '.join(terms)}) like the "
                          f"objective's rows, but {objective.describe()} computes those weights on the target with "
                          "drafter.tuning.loss_on_target: remove drafter.tuning.loss_on_target=true or use "
                          "drafter.loss.weighting=decay")
    return spec
