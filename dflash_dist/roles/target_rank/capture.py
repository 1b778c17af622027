"""Target role: the frozen HF model and the capture of the selected layers' hidden states.

Layer id i means "output of decoder layer i", which is HF ``hidden_states[i+1]``. We never ask HF for the
full hidden-state tuple and never run the lm_head: forward hooks copy the needed layer outputs into one
preallocated [b, S, n*H] buffer, and the hook on the last needed layer stops the forward, so the decoder
layers after it do not run.

Two input layouts give the same features (``target.packing``): right-padded rows [b, S] through the model's own
attention (``target.attn_implementation``), or packed: the samples concatenated into one row [1, T] without
padding, positions restarting at each sample, and document-causal attention by a compiled ``flex_attention``
with a BlockMask (``packing.py``, registered with transformers' AttentionInterface as ``PACKED_ATTN``).

Packed rows are exact for sliding-window layers (Mistral, gpt-oss): the capture builds one more BlockMask per
window (document-causal and ``q - kv < window``, transformers' ``sliding_window_overlay``) and the attention
function picks it by the ``sliding_window`` the layer passes; and for attention sinks (gpt-oss ``s_aux``): the
flex output is renormalised with the sink logit through flex's log-sum-exp, as transformers' flex path does.
MoE attention-only targets pack like dense ones (the experts see tokens, not rows). Linear-attention (hybrid)
layers pack through the varlen forms of their fast kernels (``targets/families/hybrid_packing.py``: the row's sample
boundaries as fla's ``cu_seqlens`` and causal-conv1d's ``seq_idx``), so their recurrent and convolution state restart
at every sample; without those kernels packing is refused and such targets run padded.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Optional

import torch

from dflash_dist.config import ConfigError, TargetConfig
from dflash_dist.targets.families import family_for, hybrid_packing, text_config
from dflash_dist.targets.hf import decoder_layers
from dflash_dist.roles.target_rank.packing import (
    PACKED_ATTN,
    WINDOW_MASKS_KWARG,
    document_causal_block_mask,
    packed_row_tokens,
    packed_stats,
    register_packed_attention,
)

log = logging.getLogger(__name__)


def packing_problem(model) -> Optional[str]:
    """Why the packed capture cannot run this model, or None: the target family's rule on its config and decoder
    layers (hybrids' linear attention, softcapped or chunked attention are refused)."""
    _, layers = decoder_layers(model)
    return family_for(model.config).packing_problem(text_config(model.config), list(layers))


def _refuse_packing_on(tcfg: TargetConfig, problem: Optional[str]) -> None:
    if tcfg.packing == "on" and problem:
        raise ConfigError(f"target.packing=on: {problem}. Use target.packing=auto or off for this model.")


def check_packing_config(tcfg: TargetConfig, hf_config) -> None:
    """Refuse target.packing=on from the config, before weights load (e.g. a hybrid whose kernels are missing)."""
    _refuse_packing_on(tcfg, family_for(hf_config).packing_problem(text_config(hf_config), None))


def resolve_packing(tcfg: TargetConfig, model, device_type: str) -> bool:
    """target.packing -> whether the capture runs packed: auto = on CUDA wherever the model packs (attention-only
    models: measured 1.23-1.97x padded, docs/benchmarks.md#target-capture). Hybrids pack only with fla's and
    causal-conv1d's varlen kernels bound (otherwise ``packing_problem`` names what is missing and auto stays
    padded); with them (and compiled layers, ``resolve_compile``) the Qwen3.5-9B shape measured 1.32x (550-token
    mix) and 1.41x (256..3072) padded, for a first pass about a minute longer (fla's autotune and the compile):
    docs/benchmarks.md#hybrid-packing."""
    problem = packing_problem(model)
    _refuse_packing_on(tcfg, problem)
    auto = tcfg.packing == "auto" and device_type == "cuda" and problem is None
    return tcfg.packing == "on" or auto


def resolve_compile(tcfg: TargetConfig, model, device_type: str) -> bool:
    """target.compile -> whether the captured layers run compiled: None = on CUDA wherever the model packs
    (measured there; hybrids with their GatedDeltaNet modules eager inside the compiled layers: 1.32x / 1.41x padded
    on the Qwen3.5-9B shape against 1.16x / 1.23x packed alone, docs/benchmarks.md#hybrid-packing)."""
    if tcfg.compile is not None:
        return bool(tcfg.compile)
    return device_type == "cuda" and packing_problem(model) is None


def resolve_pad_multiple(tcfg: TargetConfig, model, device_type: str, packed: bool) -> int:
    """target.tuning.pad_multiple -> the padded capture's row-length multiple: None = 64 on CUDA (SDPA's cuDNN kernel
    plans each new [b, S] once, tens of ms; measured: docs/benchmarks.md#new-shapes), 1 on CPU; packed rows: 1
    (rounded on their own)."""
    if packed:
        return 1
    if tcfg.tuning.pad_multiple is not None:
        return tcfg.tuning.pad_multiple
    return 64 if device_type == "cuda" else 1


class StopForward(Exception):
    """Raised by the hook of the last needed layer: the rest of the model does not run."""


class FeatureCapture:
    """Runs the target up to the last needed layer and returns the selected layers' outputs.

    ``packing``: the input is the batch's samples concatenated ([1, T]); attention is document-causal through
    ``packed_flex_attention``. ``compile``: the decoder layers that run go through ``torch.compile`` (dynamic
    shapes); the hooks stay outside the compiled graphs (StopForward must not be raised inside one). Both are
    switched on only for the capture's own forward, so other users of the model (the evaluator with its KV cache)
    run it as it was built."""

    def __init__(self, model, layer_ids: list[int], packing: bool = False, compile: bool = False,
                 pad_multiple: int = 1):
        self.model = model
        # padded rows run at a length rounded up to this multiple: fewer distinct shapes for kernels that plan
        # each new shape (see TargetConfig.pad_multiple)
        self.pad_multiple = max(1, int(pad_multiple))
        self.base, self.layers = decoder_layers(model)
        self.layer_ids = list(layer_ids)
        self.last = max(self.layer_ids)
        self.hidden = text_config(model.config).hidden_size
        self.num_layers = len(self.layers)
        self.packing, self.compile = bool(packing), bool(compile)
        run = list(self.layers)[: self.last + 1]
        self.attention_layers_run = sum(1 for layer in run if hasattr(layer, "self_attn"))
        self.attention_layers_total = sum(1 for layer in self.layers if hasattr(layer, "self_attn"))
        # GatedDeltaNet layers (hybrids): packed rows hand them the samples' boundaries (hybrid_packing)
        self.linear_layers_run = len(hybrid_packing.linear_layers(run))
        self.linear_layers_total = len(hybrid_packing.linear_layers(list(self.layers)))
        # why this model is not packed (the padded fallback's reason, for the capture report), or None
        self.unpacked_reason = None if self.packing else packing_problem(model)
        family = family_for(model.config)  # its sliding windows and sink logits, as the attention layers pass them
        self.windows = family.sliding_windows(text_config(model.config), list(self.layers))
        self.sinks = family.attention_sinks(list(self.layers))
        if self.packing:
            problem = packing_problem(model)
            if problem:
                raise ConfigError(f"packed capture: {problem}")
            register_packed_attention()
            # a model whose attention does not dispatch through AttentionInterface would ignore PACKED_ATTN and
            # attend across samples: transformers' own check refuses to switch such a model
            built = model.config._attn_implementation
            model.set_attn_implementation(PACKED_ATTN)
            switched = self.base.config._attn_implementation == PACKED_ATTN
            model.set_attn_implementation(built)
            if not switched:
                raise ConfigError(f"packed capture: {type(model).__name__} does not take its attention from "
                                  "transformers' AttentionInterface; use target.packing=off")
        # layer.forward -> compiled forward while capturing; nn.Module.__call__ runs the hooks around it. CPU:
        # static shapes, as for _flex_static (inductor's C++ flex template traced into a dynamic layer graph emits
        # code that does not build: torch 2.13 with transformers 5.25, "'cur_kvSplitSize6' was not declared")
        on_cpu = next(iter(model.parameters()), torch.empty(0)).device.type == "cpu"
        self._forwards = [(layer, layer.__dict__.get("forward"), torch.compile(layer.forward, dynamic=not on_cpu))
                          for layer in run] if self.compile else []
        # hybrids: each GatedDeltaNet module runs eager inside its compiled layer (dynamo breaks the graph around
        # it): fla's and causal-conv1d's kernels are fused already, and tracing into them did not finish a first
        # pass in 310 s; the norms, residuals and MLP around them compile. The proof of the boundaries then
        # still counts every linear-attention layer's kernel calls.
        self._eager_linear = [(m, m.__dict__.get("forward"), torch.compiler.disable(m.forward, recursive=True))
                              for m in hybrid_packing.linear_layers(run)] if self.compile else []
        # HF's last hidden state is taken after the final norm; keep that convention for id L-1.
        self.norm_last = (self.last == self.num_layers - 1)
        self._buf: Optional[torch.Tensor] = None
        self._full = False  # the forward runs every layer (the target's own labels need its logits)
        self._handles = [self.layers[i].register_forward_hook(self._hook(slot, i))
                         for slot, i in enumerate(self.layer_ids)]
        self.layers_run = 0

    def describe(self) -> str:
        attn = "flex document-causal" if self.packing else self.base.config._attn_implementation
        if self.packing and self.windows:
            attn += f", sliding window {'/'.join(map(str, self.windows))}"
        if self.packing and self.sinks:
            attn += ", attention sinks"
        if self.packing and self.linear_layers_total:
            attn += ", GatedDeltaNet varlen: fla cu_seqlens, causal-conv1d seq_idx"
        rows = "packed" if self.packing else ("padded" + (f" to a multiple of {self.pad_multiple}"
                                                            if self.pad_multiple > 1 else ""))
        why = f"; not packed: {self.unpacked_reason}" if self.unpacked_reason and self.linear_layers_total else ""
        compiled = ("yes, GatedDeltaNet modules eager" if self.compile and self._eager_linear
                    else "yes" if self.compile else "no")
        return f"{rows} ({attn}), compiled layers: {compiled}{why}"

    def _hook(self, slot: int, layer_id: int):
        def hook(module, args, output):
            if self._buf is None:
                return  # not this capture's forward (another user of the model, e.g. an unclosed capture's)
            out = output[0] if isinstance(output, (tuple, list)) else output
            if layer_id == self.num_layers - 1:
                out = self.base.norm(out)
            h = self.hidden
            self._buf[:, :, slot * h:(slot + 1) * h].copy_(out)
            if layer_id == self.last and not self._full:
                self.layers_run = layer_id + 1
                raise StopForward
        return hook

    @contextlib.contextmanager
    def _capture_mode(self):
        config = self.base.config
        built = config._attn_implementation
        if self.packing:
            config._attn_implementation = PACKED_ATTN  # read by every attention layer at call time
        swapped = self._forwards + self._eager_linear
        for module, _, forward in swapped:
            module.forward = forward
        try:
            yield
        finally:
            config._attn_implementation = built
            for module, own, _ in swapped:
                if own is None:
                    del module.forward  # back to the class's forward
                else:
                    module.forward = own

    def __call__(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Returns features [sum(lengths), n*H] of the real tokens, samples in order.

        Padded: input_ids [b, S] right-padded. That needs no attention mask: every model here is causal, so the
        real tokens never see the padding after them (this keeps SDPA on its fast causal path).
        Packed: input_ids [1, T] (or [T]), the samples concatenated; the buffer row is the result."""
        return self._run(input_ids, lengths, full=False)[0]

    def with_labels(self, input_ids: torch.Tensor, lengths: torch.Tensor, top_k: int = 1,
                    probs: bool = False) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """(features, ids [T, top_k] int64, probabilities [T, top_k] fp32 or None): the features as ``__call__``
        and, at every real token, the target's ``top_k`` most likely next tokens given the true prefix (column 0
        its greedy token) from the full forward (every layer, final norm, lm_head in row chunks); ``probs``: their
        probabilities renormalised over those k (what ``drafter.loss.kind=kl`` distils)."""
        feats, last = self._run(input_ids, lengths, full=True)
        ids, p = top_next_tokens(last, self.model.get_output_embeddings(), top_k, probs)
        return feats, ids, p

    def for_loss(self, input_ids: torch.Tensor, lengths: torch.Tensor, loss
                 ) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
        """The forward the drafter's objective needs (``loss``: the resolved drafter.loss): (features, the target's
        label ids or None, their probabilities or None). labels=target runs the whole model and its lm_head
        (kind=kl keeps the top kl_top_k and their probabilities); every rank of a replica runs this same forward
        (the model's collectives need them all)."""
        if loss.labels != "target":
            return self(input_ids, lengths), None, None
        kl = loss.kind == "kl"
        return self.with_labels(input_ids, lengths, top_k=loss.kl_top_k if kl else 1, probs=kl)

    @torch.inference_mode()
    def _run(self, input_ids: torch.Tensor, lengths: torch.Tensor, full: bool):
        """(features [T, n*H], the final normed hidden state [T, H] of the real tokens with ``full``, else None)."""
        kwargs = {}
        if self.packing:
            input_ids = input_ids.reshape(1, -1)
            total = input_ids.shape[1]
            pad = packed_row_tokens(total, input_ids.device.type) - total
            if pad:
                input_ids = torch.nn.functional.pad(input_ids, (0, pad))
                lengths = torch.cat([lengths.cpu(), torch.tensor([pad])])
            # attention sinks: an extra key column on CPU (compiled CPU flex has no log-sum-exp), the LSE
            # renormalisation elsewhere
            sink_column = self.sinks and input_ids.device.type == "cpu"
            built = document_causal_block_mask(lengths, input_ids.shape[1], input_ids.device, self.windows,
                                               sink_column)
            mask, positions = built[0], built[1]
            kwargs = {"attention_mask": mask, "position_ids": positions[None]}
            if len(built) == 3:
                kwargs[WINDOW_MASKS_KWARG] = built[2]
            if self.linear_layers_total:
                # hybrids: the mask per layer kind (no padding mask for the linear layers), the boundaries
                kwargs["attention_mask"] = {"full_attention": mask, "linear_attention": None}
                kwargs.update(hybrid_packing.varlen_kwargs(lengths, input_ids.device))
        elif input_ids.shape[1] % self.pad_multiple:
            # more right padding: as invisible to the real tokens as the rest (causal, see above)
            extra = -input_ids.shape[1] % self.pad_multiple
            input_ids = torch.nn.functional.pad(input_ids, (0, extra))
        b, s = input_ids.shape
        dtype = next(self.model.parameters()).dtype
        buf = self._buf = torch.empty(b, s, len(self.layer_ids) * self.hidden, dtype=dtype, device=input_ids.device)
        flex_calls = packed_stats["flex_calls"]
        linear_calls = dict(hybrid_packing.varlen_calls)
        # the linear-attention modules run eager even in compiled layers, so their kernels can be wrapped
        checked = (hybrid_packing.checked_kernels(list(self.layers), kwargs)
                   if self.packing and self.linear_layers_total else contextlib.nullcontext())
        self._full, last = full, None
        try:
            with self._capture_mode(), checked:
                out = self.base(input_ids=input_ids, use_cache=False, **kwargs)
            if not full:
                raise RuntimeError("the target forward finished without reaching the last capture layer")
            last = out.last_hidden_state  # after the final norm (HF's convention)
        except StopForward:
            pass
        finally:
            self._buf, self._full = None, False
        if self.packing:
            # proof that the model really attended through PACKED_ATTN (a model that ignored it would attend
            # across samples); inside compiled layers the call is part of the graph and is not counted
            ran = packed_stats["flex_calls"] - flex_calls
            expected = self.attention_layers_total if full else self.attention_layers_run
            if not self.compile and ran != expected:
                raise RuntimeError(f"packed capture: {ran} of {expected} attention layers went through {PACKED_ATTN}")
            self._check_linear_calls(linear_calls, full)
            return buf[0, :total], None if last is None else last[0, :total]
        keep = torch.arange(s, device=input_ids.device)[None, :] < lengths.to(input_ids.device)[:, None]
        return buf[keep], None if last is None else last[keep]

    def _check_linear_calls(self, before: dict, full: bool) -> None:
        """Proof that every GatedDeltaNet layer that ran handed the packed row's boundaries to both kernels."""
        expected = self.linear_layers_total if full else self.linear_layers_run
        for name, n in hybrid_packing.varlen_calls.items():
            ran = n - before[name]
            if ran != expected:  # eager in compiled layers too (_eager_linear)
                raise RuntimeError(f"packed capture: {ran} of {expected} linear-attention layers called {name} with "
                                   "the packed row's sample boundaries")

    def close(self) -> None:
        for h in self._handles:
            h.remove()


LABEL_CHUNK_ROWS = 4096
"""Rows of the target's lm_head at once when it forms its labels: [rows, V] logits, never [T, V]."""


@torch.inference_mode()
def top_next_tokens(hidden: torch.Tensor, head: torch.nn.Module, k: int, probs: bool
                    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """hidden [T, H] (final-normed) -> (the ``k`` most likely next tokens [T, k] int64, most likely first;
    with ``probs`` their softmax probabilities renormalised over the k, fp32 [T, k], else None)."""
    ids, ps = [], []
    for lo in range(0, hidden.shape[0], LABEL_CHUNK_ROWS):
        logits = head(hidden[lo:lo + LABEL_CHUNK_ROWS]).float()
        top, idx = logits.topk(k, dim=-1) if k > 1 else logits.max(-1, keepdim=True)
        ids.append(idx)
        if probs:
            ps.append(torch.softmax(top, -1))  # softmax over the k = the full softmax renormalised on them
    ids_t = torch.cat(ids) if ids else hidden.new_zeros(0, k, dtype=torch.long)
    probs_t = (torch.cat(ps) if ps else hidden.new_zeros(0, k, dtype=torch.float32)) if probs else None
    return ids_t.long(), probs_t


def build_capture(tcfg: TargetConfig, model, layer_ids: list[int], device_type: str) -> FeatureCapture:
    """The capture a target rank runs: target.packing, target.compile and target.tuning.pad_multiple resolved for this
    model and device (one place, so the rank, dflash-plan's calibration and the benchmarks run the same path)."""
    packed = resolve_packing(tcfg, model, device_type)
    return FeatureCapture(model, layer_ids, packing=packed, compile=resolve_compile(tcfg, model, device_type),
                          pad_multiple=resolve_pad_multiple(tcfg, model, device_type, packed))
