"""DFlash2 (``drafter.variant=dflash2``): DFlash with a grouped dynamic causal convolution around attention and
around the MLP of every layer, and a candidate selector that re-ranks the unary top-K by the previous token.

What vLLM (``DFlash2DraftModel``) and SGLang (``DFLASH``) serve. The math is ``layers.py`` (the layers, the
settings, the FLOPs and the export contract) and ``selector.py`` (the selector, its walk and its loss), the
export's checks ``export_checks.py``, the served class ``serving.py``; this module puts them on the variant seam. At init the convolutions are the identity and the successor
codebook is zero, so a fresh DFlash2 drafter's unary logits are those of a DFlash drafter with the same weights.

Training adds the selector's K-way cross-entropy with teacher-forced predecessors over the unary top-K, each row
weighted by the base objective's weight of its position (times ``drafter.dflash2.selector_loss_weight``) and
normalised with the base loss by the step's weight sum. The proposals of the in-training evaluation are the
selector's greedy walk from the anchor, ties to the lowest candidate index, as the engines decode.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional

import torch
from torch import Tensor, nn

from dflash_dist.model.drafter import DFlashDrafter, DrafterModelConfig
from dflash_dist.model.variants.dflash.variant import DFlash
from dflash_dist.model.variants.dflash2 import export_checks as CHECKS
from dflash_dist.model.variants.dflash2 import layers as D2
from dflash_dist.model.variants.dflash2 import selector as SEL
from dflash_dist.model.variants.registry import VARIANTS

__all__ = ["DFlash2", "DFlash2Drafter", "settings_of"]


def settings_of(model_config: DrafterModelConfig) -> D2.DFlash2Settings:
    """The DFlash2 settings a model config records (``variant_settings``; the defaults when it has none)."""
    return D2.DFlash2Settings(**(model_config.variant_settings or {}))


class DFlash2Drafter(DFlashDrafter):
    """The DFlash drafter with ``DFlash2DecoderLayer`` layers and a ``candidate_selector`` after them."""

    loss_term_names = ("selector",)

    def __init__(self, cfg: DrafterModelConfig, backend: str):
        settings = settings_of(cfg)
        settings.check_model(cfg.hidden_size, cfg.block_size, cfg.vocab_size)
        object.__setattr__(self, "dflash2", settings)  # read by make_layer / add_modules, before nn.Module.__init__
        super().__init__(cfg, backend)
        # after the generic init: identity convs, zero successor codebook (its N(0, std) would undo both)
        D2.reset_dflash2_parameters(self, cfg.initializer_range)

    @property
    def head_topk(self) -> int:
        """The selector's candidates come from the loss pass's own logits (no second pass over the vocabulary)."""
        return self.dflash2.selector_top_k

    def make_layer(self, cfg: DrafterModelConfig, index: int) -> nn.Module:
        return D2.DFlash2DecoderLayer(cfg, self.dflash2)

    def add_modules(self, cfg: DrafterModelConfig) -> None:
        self.candidate_selector = SEL.CandidateSelector(cfg.hidden_size, cfg.vocab_size, self.dflash2.selector_rank,
                                                        cfg.initializer_range)

    def propose(self, hidden: Tensor, lm_head: Tensor, anchor_ids: Optional[Tensor] = None) -> Tensor:
        """The selector's greedy walk over the unary top-K of slots 1..B-1, from the anchor tokens [b]."""
        if anchor_ids is None:
            raise ValueError("DFlash2 proposes from the anchor token: pass anchor_ids")
        s = self.dflash2
        head = lm_head.to(hidden.device)
        h = hidden.to(self.candidate_selector.hidden_projection.weight.dtype)
        return SEL.propose(self.candidate_selector, h, anchor_ids.to(hidden.device), head, s.selector_top_k,
                           s.output_multiplier, s.final_logit_softcapping)[0]

    def loss_terms(self, hidden: Tensor, labels: Tensor, lm_head: Tensor, block_ids: Optional[Tensor] = None,
                   row_weights: Optional[Tensor] = None) -> dict:
        """``selector``: the weighted K-way CE sum (row_weights None: weight 1 on every labelled row); and the
        statistics of ``stat_slots`` (per position over slots 1..B-1)."""
        if block_ids is None:
            raise ValueError("the DFlash2 selector loss needs the blocks' token ids (block_ids): the anchor is the "
                             "first predecessor")
        s, bsz = self.dflash2, self.config.block_size
        rows_h, pred, gold, _ = SEL.selector_rows(hidden, block_ids, labels, labels, bsz)
        weights = (gold >= 0).float() if row_weights is None else row_weights.float()
        head = lm_head.to(hidden.device)
        cand = getattr(self, "context", {}).get("head_topk_ids")  # from the objective's fused pass, when it ran
        if cand is None or tuple(cand.shape) != (rows_h.shape[0], s.selector_top_k):
            cand = SEL.topk_candidates(rows_h.detach(), head, s.selector_top_k)
        sel_h = rows_h.to(self.candidate_selector.hidden_projection.weight.dtype)
        parts = SEL.selector_loss(self.candidate_selector, sel_h, head, pred, cand, gold, weights, s.selector_gold,
                                  s.output_multiplier, s.final_logit_softcapping)
        with torch.no_grad():
            labelled = gold >= 0
            tau, has_block = SEL.accepted_lengths(parts.selector_correct, labelled, bsz)

            def per_slot(x: Tensor) -> Tensor:
                return x.reshape(-1, bsz - 1).sum(0).double()

            stats = {"selector_ce_sum": parts.loss_sum.detach(), "selector_weight_sum": parts.weight_sum,
                     "selector_rows": per_slot(labelled), "selector_unary_correct": per_slot(parts.unary_correct),
                     "selector_correct": per_slot(parts.selector_correct),
                     "selector_gold_in_topk": per_slot(parts.gold_in_topk),
                     "selector_tau_sum": (tau * has_block).sum(), "selector_blocks": has_block.sum()}
        return {"selector": parts.loss_sum * float(s.selector_loss_weight), **stats}

    def stat_slots(self) -> dict:
        n = self.config.block_size - 1
        return {"selector_ce_sum": 1, "selector_weight_sum": 1, "selector_rows": n, "selector_unary_correct": n,
                "selector_correct": n, "selector_gold_in_topk": n, "selector_tau_sum": 1, "selector_blocks": 1}

    def window_metrics(self, sums: dict) -> dict:
        """selector_ce (its weighted mean CE), acc_unary / acc_selected (per slot k and over all slots: the
        unary argmax and the selector's choice given the gold predecessor), gold_in_topk, and tau_selector (the
        greedy walk's accepted length under teacher forcing, exact up to the first miss). What it serves is the
        selector's choice: ``served_acc[_slot_k]`` = acc_selected[_slot_k], ``tau_from_served_acc`` =
        tau_selector (the training side of the train/serve gap)."""
        rows = sums["selector_rows"]
        out = {"selector_ce": sums["selector_ce_sum"][0] / max(sums["selector_weight_sum"][0], 1e-9),
               "tau_selector": sums["selector_tau_sum"][0] / max(sums["selector_blocks"][0], 1),
               "gold_in_topk": sum(sums["selector_gold_in_topk"]) / max(sum(rows), 1),
               "acc_unary": sum(sums["selector_unary_correct"]) / max(sum(rows), 1),
               "acc_selected": sum(sums["selector_correct"]) / max(sum(rows), 1)}
        for k in range(1, len(rows) + 1):
            n = max(rows[k - 1], 1)
            out[f"acc_unary_slot_{k}"] = sums["selector_unary_correct"][k - 1] / n
            out[f"acc_selected_slot_{k}"] = out[f"served_acc_slot_{k}"] = sums["selector_correct"][k - 1] / n
        out["served_acc"], out["tau_from_served_acc"] = out["acc_selected"], out["tau_selector"]
        return out


@VARIANTS.register
class DFlash2(DFlash):
    name = "dflash2"
    model_class = DFlash2Drafter
    architecture = D2.ARCHITECTURE
    title = "DFlash2"
    serving_source = os.path.join(os.path.dirname(os.path.abspath(__file__)), "serving.py")
    auto_model = "modeling_dflash.DFlash2DraftModel"
    """serving.py's DFlash2 class in the exported modeling_dflash.py (trust_remote_code)."""
    export_description = (
        "DFlash2: architectures [\"DFlash2DraftModel\"], dflash_config.{conv_kernel_size, conv_group_size, "
        "selector_rank, selector_top_k} (vLLM reads them with []), output_multiplier and final_logit_softcapping "
        "(read with defaults, written anyway), no input_embedding_scale (SGLang ignores it); tensors "
        "layers.i.{attention,mlp}_conv.* and candidate_selector.* (codebooks without .weight)")
    size_bounds = {"conv_kernel_size": 4096, "conv_group_size": 1 << 16, "selector_rank": 1 << 14,
                   "selector_top_k": 1 << 14}

    settings_key = "dflash2"
    """The ``drafter.*`` section of the variant's settings (``identity_fields``; ``model_settings`` checks it)."""

    def identity_fields(self, drafter_config) -> dict[str, Any]:
        """Every ``drafter.dflash2.*`` setting of the model and its loss, as the settings normalise it (a soft cap
        of 0 is None); not ``conv_dtype``, a numerics setting of the step (``D2.STEP_SETTINGS``)."""
        settings = D2.DFlash2Settings(**dataclasses.asdict(drafter_config.dflash2))
        return {f"drafter.dflash2.{k}": v for k, v in dataclasses.asdict(settings).items()
                if k not in D2.STEP_SETTINGS}

    def model_settings(self, drafter_config, model_config: DrafterModelConfig) -> Optional[dict]:
        """``drafter.dflash2.*``, checked against the drafter's shape."""
        settings = D2.DFlash2Settings(**dataclasses.asdict(drafter_config.dflash2))
        settings.check_model(model_config.hidden_size, model_config.block_size, model_config.vocab_size)
        return dataclasses.asdict(settings)

    def extra_flops(self, model_config: DrafterModelConfig, b: int, s_pad: int, n_blocks: int, vocab: int) -> float:
        """The convs of every layer over all query rows, and the selector over the loss rows: its trainable
        matmul and gathered products (x3 with backward). The unary top-K reads the logits the loss already made
        (``head_topk``: the decayed CE, D-PACE and KL fused passes give them), so it adds no pass over the
        vocabulary; where none ran (the loss on the target, a checkpointed loss) that second pass runs and is
        hardware work, not model FLOPs."""
        s, h, bsz = settings_of(model_config), model_config.hidden_size, model_config.block_size
        conv = D2.conv_flops_per_row(h, s)
        sel = D2.selector_flops_per_row(h, s)
        rows_q, rows_l = b * n_blocks * bsz, b * n_blocks * (bsz - 1)
        convs = 3.0 * model_config.num_layers * rows_q * (conv["matmul"] + conv["elementwise"])
        selector = rows_l * 3.0 * (sel["matmul"] + sel["gathered"])
        return float(convs + selector)

    def extra_activation_bytes(self, model_config: DrafterModelConfig, rows: int, chunk: int, ab: int) -> int:
        """The convolutions of every layer and the candidate selector's rows."""
        s = model_config.variant_settings or {}
        per_layer = 15 * model_config.hidden_size
        return rows * (model_config.num_layers * per_layer + 4 * int(s.get("selector_rank", 0))
                       + 4 * int(s.get("selector_top_k", 0))) * ab

    # ---- export (layers.py holds the contract, export_checks.py what the engines need of it)
    def export_fields(self, model_config: DrafterModelConfig) -> dict[str, Any]:
        fields = super().export_fields(model_config)
        fields["dflash_config"] = D2.export_fields(settings_of(model_config))
        return fields

    def extra_tensor_shapes(self, config: dict) -> dict[str, tuple]:
        """The conv and selector tensors of an export's config.json (DFlash's own are checked as DFlash's are)."""
        mc = _model_config_of(config)
        every = D2.expected_shapes(mc, settings_of(mc), bool(config.get("attention_bias", False)))
        return {k: v for k, v in every.items() if "_conv." in k or k.startswith("candidate_selector.")}

    def export_names(self, tensors: dict) -> dict:
        """The module's names are the engines' (codebooks without ``.weight``, ``layers.i.*_conv.*``)."""
        return dict(tensors)

    def settings_from_export(self, config: dict) -> Optional[dict]:
        """The DFlash2 settings an export's ``dflash_config`` records (training-only fields at their defaults)."""
        return _model_config_of(config).variant_settings

    def claims_export(self, config: dict) -> bool:
        """Its architecture, or any DFlash2 field (SGLang turns the conv on for ``conv_kernel_size`` under any
        architecture)."""
        return CHECKS.is_dflash2(config)

    def export_problems(self, config: dict) -> list[str]:
        return CHECKS.dflash2_problems(config)

    def config_tensor_shapes(self, config: dict) -> dict[str, tuple]:
        return CHECKS.dflash2_tensor_shapes(config)

    def tensor_hints(self, unexpected: list) -> list[str]:
        return (["a codebook has a .weight suffix: SGLang skips it and serves zeros without an error"]
                if any(k.endswith("codebook.weight") for k in unexpected) else [])

    def export_detail(self, config: dict) -> str:
        return CHECKS.dflash2_detail(config)


def _model_config_of(config: dict) -> DrafterModelConfig:
    """The shape fields of an export's config.json with its ``dflash_config`` DFlash2 fields as settings."""
    dc = config.get("dflash_config") or {}
    keys = {f.name for f in dataclasses.fields(D2.DFlash2Settings)}
    settings = {k: dc[k] for k in keys if k in dc}
    return DrafterModelConfig(
        hidden_size=int(config["hidden_size"]), num_attention_heads=int(config["num_attention_heads"]),
        num_key_value_heads=int(config.get("num_key_value_heads") or config["num_attention_heads"]),
        head_dim=int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]),
        intermediate_size=int(config["intermediate_size"]), num_layers=int(config["num_hidden_layers"]),
        num_feature_layers=len(dc.get("target_layer_ids") or [0]), rms_norm_eps=1e-6, rope_theta=1e4,
        block_size=int(config.get("block_size") or dc.get("block_size") or 2), vocab_size=int(config["vocab_size"]),
        max_position_embeddings=int(config.get("max_position_embeddings", 32768)), variant_settings=settings)
