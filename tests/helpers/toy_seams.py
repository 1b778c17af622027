"""A toy drafter variant and a toy objective, registered from test code alone (no edit of the package).

Named ``toy_seams:ScaledDFlash`` (drafter.variant) and ``toy_seams:UniformCE`` (drafter.loss.objective): a
torchrun job with this directory on PYTHONPATH imports them on every rank.
"""

import torch
from torch import nn

from dflash_dist.model.drafter import DFlashDrafter
from dflash_dist.model.objectives import SlotWeightedCE
from dflash_dist.model.variants import DFlash


class ScaledDrafter(DFlashDrafter):
    """DFlash with a learnt per-channel scale after the final norm, and a small L2 pull of it towards 1."""

    loss_term_names = ("scale_l2",)

    def add_modules(self, cfg):
        self.out_scale = nn.Parameter(torch.ones(cfg.hidden_size))

    def after_layers(self, h):
        return self.norm(h) * self.out_scale

    def loss_terms(self, hidden, labels, lm_head, block_ids=None, row_weights=None):
        return {"scale_l2": 1e-3 * (self.out_scale.float() - 1.0).pow(2).sum()}


class ScaledDFlash(DFlash):
    name = "toy_scaled"
    model_class = ScaledDrafter
    architecture = "ScaledDFlashDraftModel"

    def extra_flops(self, model_config, b, s_pad, n_blocks, vocab):
        return 3.0 * b * n_blocks * model_config.block_size * model_config.hidden_size  # the scale, fwd + bwd

    def export_fields(self, model_config):
        fields = super().export_fields(model_config)
        fields["dflash_config"] = {"output_scale": True}
        return fields

    def extra_tensor_shapes(self, config):
        return {"output_scale.weight": (int(config["hidden_size"]),)}

    def export_names(self, tensors):
        out = dict(tensors)
        if "out_scale" in out:
            out["output_scale.weight"] = out.pop("out_scale")
        return out


class UniformCE(SlotWeightedCE):
    """CE with every supervised slot weighted 1 (slot 0, the anchor, 0); reports its mean row weight."""

    name = "toy_uniform"

    def slot_weights(self, device=None):
        w = torch.ones(self.block_size, dtype=torch.float32, device=device)
        return torch.where(torch.arange(self.block_size, device=device) == 0, torch.zeros_like(w), w)

    def window_metrics(self, sums):
        out = super().window_metrics(sums)
        out["mean_row_weight"] = sums["weight_sum"][0] / max(sum(sums["slot_count"]), 1)
        return out


class WholeHeadCE(UniformCE):
    """UniformCE without the vocabulary-slice math (as an objective of one's own may be): on a target replica
    its loss is served by the replica's feeder with the whole lm_head."""

    name = "toy_whole_head"
    vocab_parallel = False
