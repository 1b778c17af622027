"""Domino: DFlash plus a bias-free GRU over the block's previous tokens whose projection corrects the logits.

The math (head, teacher tokens, chunked loss, greedy decode, curriculum, FLOPs, export layout) is ``head.py``,
the served class ``serving.py``; this module wires them into the variant seam. Training adds one loss term to the
objective's base cross-entropy so that the step's loss is SpecForge's mix::

    objective:  sum w CE(base)
    term:       (1 - lambda) * sum w (CE(corrected) - CE(base))
    total:      sum w ((1 - lambda) CE(corrected) + lambda CE(base)),  lambda = lambda_base(step, the run's steps)

with ``w`` the objective's own row weights. The GRU reads the sequence's tokens (teacher forcing) and the
target's embedding, which the trainer hands over through ``set_context``; evaluation hands over the block's ids.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from dflash_dist.config import ConfigError
from dflash_dist.model import loss as L
from dflash_dist.model.drafter import DFlashDrafter, DrafterModelConfig
from dflash_dist.model.variants.dflash.variant import DFlash
from dflash_dist.model.variants.domino import head as D
from dflash_dist.model.variants.registry import VARIANTS

__all__ = ["Domino", "DominoDrafter", "settings_of"]


def settings_of(model_config: DrafterModelConfig) -> D.DominoSettings:
    """The checked ``drafter.domino`` settings a model config carries (its defaults when it carries none)."""
    return D.DominoSettings(**(model_config.variant_settings or {}))


def _term_chunk(h: Tensor, e: Tensor, corrected: Tensor, head_weight: Tensor, proj_weight: Tensor, y: Tensor,
                w: Tensor, lam: float) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """One chunk of loss rows of term = (1 - lam) sum w (CE(corrected) - CE(base)), corrected = base + m corr:
    (sum w CE(corrected), sum w CE(base), the corrected argmax, d term / d base = (1 - lam) w (softmax(corrected)
    - softmax(base)), d term / d corr = (1 - lam) w m (softmax(corrected) - onehot)). fp32 softmax, in place over
    the two [rows, V] fp32 logits (the one-hots of the two CEs cancel in d term / d base)."""
    m = corrected.to(torch.float32)[:, None]
    base = (h @ head_weight.t()).float()
    final = (e @ proj_weight.t()).float().mul_(m).add_(base)
    y_col = y.clamp_min(0)[:, None]
    lse_f, lse_b = torch.logsumexp(final, -1, keepdim=True), torch.logsumexp(base, -1, keepdim=True)
    ce_f = ((lse_f - final.gather(1, y_col))[:, 0] * w).sum()
    ce_b = ((lse_b - base.gather(1, y_col))[:, 0] * w).sum()
    pred = final.argmax(-1)
    scale = ((1.0 - lam) * w)[:, None]
    p_f = final.sub_(lse_f).exp_()
    d_base = base.sub_(lse_b).exp_().neg_().add_(p_f).mul_(scale)
    d_corr = p_f.mul_(scale * m).scatter_add_(1, y_col, -(scale * m))
    return ce_f, ce_b, pred, d_base, d_corr


class _MixedTerm(torch.autograd.Function):
    """The term over all loss rows, chunk by chunk, with its gradients wrt the rows, the correction features and
    ``embed_proj[2]``'s weight computed in the forward (the head is frozen, the term linear in them per chunk):
    one pass over the vocabulary, where recomputing each chunk in the backward took two."""

    @staticmethod
    def forward(ctx, rows_h, rows_e, corrected, head_weight, proj_weight, labels, w, lam, chunk_rows):
        grad_h, grad_e = torch.empty_like(rows_h), torch.empty_like(rows_e)
        grad_p = torch.zeros(proj_weight.shape, dtype=torch.float32, device=proj_weight.device)
        final = rows_h.new_zeros((), dtype=torch.float32)
        base, preds = final.clone(), [labels[:0]]
        for lo in range(0, labels.numel(), chunk_rows):
            sl = slice(lo, lo + chunk_rows)
            f, b, pred, d_base, d_corr = _term_chunk(rows_h[sl], rows_e[sl], corrected[sl], head_weight,
                                                     proj_weight, labels[sl], w[sl], lam)
            d_corr = d_corr.to(rows_e.dtype)
            grad_h[sl] = d_base.to(rows_h.dtype) @ head_weight
            grad_e[sl] = d_corr @ proj_weight
            grad_p += (d_corr.t() @ rows_e[sl]).float()
            final, base = final + f, base + b
            preds.append(pred)
            del d_base, d_corr
        ctx.save_for_backward(grad_h, grad_e, grad_p)
        ctx.p_dtype = proj_weight.dtype
        pred = torch.cat(preds)
        ctx.mark_non_differentiable(final, pred)
        return (1.0 - lam) * (final - base), final, pred

    @staticmethod
    def backward(ctx, grad_term, _final, _pred):
        grad_h, grad_e, grad_p = ctx.saved_tensors
        return (grad_h * grad_term.to(grad_h.dtype), grad_e * grad_term.to(grad_e.dtype), None, None,
                (grad_p * grad_term).to(ctx.p_dtype), None, None, None, None)


def mixed_term(rows_h: Tensor, rows_e: Tensor, corrected: Tensor, head_weight: Tensor, proj_weight: Tensor,
               labels: Tensor, weights: Tensor, lam: float, chunk_rows: int) -> tuple[Tensor, Tensor, Tensor]:
    """(1 - lam) * sum w (CE(corrected) - CE(base)) over the loss rows (``_MixedTerm``: at most one chunk of
    [rows, V] logits alive, no recomputation; the head frozen), the detached sum w CE(corrected) and the
    corrected logits' argmax of every row [R]."""
    if head_weight.requires_grad:
        raise ValueError("the Domino term needs a frozen lm_head (its gradient is computed in the forward)")
    w = weights.float() * (labels >= 0)
    if not labels.numel():                                       # no rows: the graph stays connected
        term = (rows_h.sum() + rows_e.sum()).float() * 0.0
        return term, term.detach(), labels
    return _MixedTerm.apply(rows_h, rows_e, corrected, head_weight, proj_weight, labels, w, float(lam),
                            max(1, int(chunk_rows)))


class DominoDrafter(DFlashDrafter):
    """The DFlash drafter with ``domino`` (a ``DominoHead``: ``prefix_gru``, ``embed_proj``)."""

    loss_term_names = ("domino",)
    """``loss_domino``: what the correction changes in the mixed loss (negative once it helps)."""

    def add_modules(self, cfg: DrafterModelConfig) -> None:
        self.settings = settings_of(cfg)
        self.settings.check_model(cfg.block_size)
        s = self.settings
        self.domino = D.DominoHead(cfg.hidden_size, cfg.vocab_size, s.gru_hidden_dim, s.emb_dim,
                                   s.pure_draft_prefix_len)
        self.context: dict = {}

    @torch.no_grad()
    def reset_parameters(self) -> None:
        super().reset_parameters()          # the Linear weights N(0, initializer_range); the GRU keeps torch's
        self.domino.prefix_gru.reset_parameters()

    def _need(self, key: str) -> Any:
        if key not in self.context:
            raise RuntimeError(f"the Domino drafter needs {key!r} from set_context before this call")
        return self.context[key]

    def loss_terms(self, hidden: Tensor, labels: Tensor, lm_head: Tensor, block_ids: Optional[Tensor] = None,
                   row_weights: Optional[Tensor] = None) -> dict:
        group, embed, objective = self._need("group"), self._need("embed"), self._need("objective")
        lam = D.lambda_base(int(self._need("step")), int(self._need("total_steps")), self.settings)
        B = self.config.block_size
        tokens = F.embedding(group.block_tokens, embed).to(hidden.dtype)
        feats = self.domino.features(hidden, tokens, B)
        rows_h, rows_e, corrected, rows_y, _ = D.domino_rows(hidden, feats, labels, labels, B,
                                                              self.settings.suffix_start)
        # the weights the objective's loss used (D-PACE's depend on it); without them its slot weights
        weights = objective.rows(hidden, labels)[2] if row_weights is None else row_weights
        term, _, pred = mixed_term(rows_h, rows_e, corrected, lm_head.to(hidden.dtype),
                                   self.domino.embed_proj[2].weight.to(hidden.dtype), rows_y, weights, lam,
                                   objective.chunk_rows)
        with torch.no_grad():                      # per slot 1..B-1: the corrected argmax, teacher forced
            labelled = rows_y >= 0
            stats = {"domino_rows": labelled.reshape(-1, B - 1).sum(0).double(),
                     "domino_correct": ((pred == rows_y) & labelled).reshape(-1, B - 1).sum(0).double()}
        return {"domino": term, **stats}

    def stat_slots(self) -> dict:
        n = self.config.block_size - 1
        return {"domino_rows": n, "domino_correct": n}

    def window_metrics(self, sums: dict) -> dict:
        """The proposals Domino serves (the corrected logits' argmax; slot 1 the backbone's alone), teacher
        forced: ``served_acc`` over slots 1..B-1, ``served_acc_slot_k`` and ``tau_from_served_acc``, the
        training side of the train/serve gap (the objective's ``acc`` is the uncorrected head's)."""
        rows, correct = sums["domino_rows"], sums["domino_correct"]
        acc = [c / max(r, 1) for c, r in zip(correct, rows)]
        out = {"served_acc": sum(correct) / max(sum(rows), 1), "tau_from_served_acc": L.tau_from_slot_acc(acc)}
        out.update({f"served_acc_slot_{k}": a for k, a in enumerate(acc, start=1)})
        return out

    def propose(self, hidden: Tensor, lm_head: Tensor, anchor_ids: Optional[Tensor] = None) -> Tensor:
        """The head's sequential greedy decode (``domino.propose``) of the block whose ids were set."""
        block_ids, embed = self._need("block_ids"), self._need("embed")
        dev = hidden.device
        tokens, _ = D.propose(self.domino, hidden.to(self.domino.embed_proj[0].weight.dtype),
                              block_ids[:, 0].to(dev), lm_head.to(dev, self.domino.embed_proj[0].weight.dtype),
                              embed.to(dev, self.domino.embed_proj[0].weight.dtype))
        return tokens


@VARIANTS.register
class Domino(DFlash):
    name = "domino"
    model_class = DominoDrafter
    architecture = D.ARCHITECTURE
    title = "Domino"
    serving_source = os.path.join(os.path.dirname(os.path.abspath(__file__)), "serving.py")
    auto_model = "modeling_dflash.DominoDraftModel"
    export_description = (
        "Domino: architectures [\"DominoDraftModel\"] (SGLang's), emb_dim, dflash_config.{projector_type, emb_dim, "
        "gru_hidden_dim, pure_draft_prefix_len, shift_label}; tensors prefix_gru.* and embed_proj.*")
    settings_key = "domino"
    """The ``drafter.*`` section the model config carries as ``variant_settings``."""
    size_bounds = {"emb_dim": 1 << 16, "gru_hidden_dim": 1 << 16, "pure_draft_prefix_len": 4096}
    export_size_fields = ("emb_dim", "dflash_config.emb_dim", "dflash_config.gru_hidden_dim",
                          "dflash_config.pure_draft_prefix_len")

    def extra_flops(self, model_config: DrafterModelConfig, b: int, s_pad: int, n_blocks: int, vocab: int) -> float:
        """The head's forward FLOPs per slot (``domino.flops_per_block_token``) x3 with backward, over the
        step's b * N * B slots."""
        per = D.flops_per_block_token(model_config.hidden_size, vocab, model_config.block_size,
                                      settings_of(model_config))
        return 3.0 * sum(per.values()) * b * n_blocks * model_config.block_size

    def extra_activation_bytes(self, model_config: DrafterModelConfig, rows: int, chunk: int, ab: int) -> int:
        """Per row: the GRU's input gates (3 G) and its saved tensors (``gru_scan``), its states and their
        padded copy (2 G), the projection's input and hidden layer (H + G + 2 E), the block tokens' embeddings
        (H) (the term keeps its gradients wrt its row copies of the hidden states and features, [R, H + E], in place
        of the copies); then the projection's fp32 gradient (V E) and one loss chunk's base and corrected logits (2
        [chunk, V] fp32, ``_MixedTerm``). Within 10% of a measured CPU step: tests/unit/planning/test_memory.py."""
        s = model_config.variant_settings or {}
        g, e, h = int(s.get("gru_hidden_dim", 0)), int(s.get("emb_dim", 0)), model_config.hidden_size
        per_row = (3 + D.GRU_SAVED_PER_STEP + 2) * g + 2 * h + g + 2 * e
        return rows * per_row * ab + (2 * chunk + e) * model_config.vocab_size * 4

    def export_fields(self, model_config: DrafterModelConfig) -> dict[str, Any]:
        return D.export_fields(settings_of(model_config))

    def extra_tensor_shapes(self, config: dict) -> dict[str, tuple]:
        return D.expected_shapes(int(config["hidden_size"]), int(config["vocab_size"]), settings_from_export(config))

    def export_names(self, tensors: dict) -> dict:
        """The head's weights without the module prefix (``domino.prefix_gru...`` -> ``prefix_gru...``), the
        names SGLang's ``DominoDraftModel`` loads."""
        return {k.removeprefix("domino."): v for k, v in tensors.items()}

    def import_names(self, tensors: dict) -> dict:
        return {("domino." + k if k.split(".")[0] in _HEAD_MODULES else k): v for k, v in tensors.items()}

    def settings_from_export(self, config: dict) -> dict:
        """The ``dflash_config`` fields SGLang parses (the curriculum keeps its defaults: it trains only)."""
        return vars(settings_from_export(config))


_HEAD_MODULES = ("prefix_gru", "embed_proj")


def settings_from_export(config: dict) -> D.DominoSettings:
    """The Domino settings an exported config.json carries (``dflash_config``)."""
    dc = config.get("dflash_config") or {}
    if dc.get("projector_type") != D.PROJECTOR_TYPE:
        raise ConfigError(f"dflash_config.projector_type={dc.get('projector_type')!r}: a Domino export has "
                          f"{D.PROJECTOR_TYPE!r}")
    try:
        return D.DominoSettings(emb_dim=dc["emb_dim"], gru_hidden_dim=dc["gru_hidden_dim"],
                                pure_draft_prefix_len=dc["pure_draft_prefix_len"], shift_label=dc["shift_label"])
    except KeyError as e:
        raise ConfigError(f"config.json: dflash_config has no {e.args[0]} (a Domino export needs it)") from None
