"""The target side of speculative decoding: prefill and verify forwards that return the DFlash features of
the configured layers and the target's greedy tokens, over an HF cache cropped after each verify (or none)."""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Optional, Sequence

import torch
from torch import Tensor

from dflash_dist.targets.hf import decoder_layers, text_config


def _forward_params(model) -> set:
    try:
        return set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return set()


def cache_supported(model) -> bool:
    """True when an HF DynamicCache of this target can be cropped back exactly (pure full attention)."""
    params = _forward_params(model)
    if not ({"cache", "past_key_values"} & params):
        return False
    types = getattr(text_config(model.config), "layer_types", None)
    return types is None or all(t == "full_attention" for t in types)


def new_cache(model):
    from transformers import DynamicCache
    try:
        return DynamicCache(config=model.config)
    except TypeError:
        return DynamicCache()


def _cache_len(cache) -> int:
    return int(cache.get_seq_length())


def crop_cache(cache, new_len: int) -> None:
    """Keep the first ``new_len`` positions. A negative argument removes that many tokens both in transformers
    5.2x (``crop(tokens_to_remove)``, positive values refused) and in 4.x (``crop(max_length)``)."""
    cur = _cache_len(cache)
    if new_len > cur:
        raise RuntimeError(f"cannot crop a cache of {cur} positions to {new_len}")
    if new_len < cur:
        cache.crop(new_len - cur)
    if _cache_len(cache) != new_len:
        raise RuntimeError(f"cache crop to {new_len} left {_cache_len(cache)} positions")


class TargetRunner:
    """Full forwards of the HF target returning logits and the selected layers' outputs.

    Layer id i is the output of decoder layer i (HF ``hidden_states[i+1]``); the last layer's output is taken
    after the final norm, as HF and :class:`~dflash_dist.roles.target_rank.capture.FeatureCapture` do, so the drafter sees the
    features it was trained on. Use inside :meth:`attached`, which registers the hooks and, for its duration,
    sets aside any other forward hooks on the decoder layers (a training FeatureCapture's hooks would
    otherwise stop the forward), restoring them afterwards.
    """

    def __init__(self, model, layer_ids: Sequence[int]):
        self.model = model
        self.base, self.layers = decoder_layers(model)
        self.layer_ids = [int(i) for i in layer_ids]
        self.num_layers = len(self.layers)
        bad = [i for i in self.layer_ids if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"layer ids {bad} out of range for a target with {self.num_layers} decoder layers")
        params = _forward_params(model)
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        self.has_logits_to_keep = "logits_to_keep" in params
        self._captured: dict[int, Tensor] = {}
        self._active = False

    def _hook(self, layer_id: int):
        def hook(module, args, output):
            out = output[0] if isinstance(output, (tuple, list)) else output
            if layer_id == self.num_layers - 1:
                out = self.base.norm(out)
            self._captured[layer_id] = out
        return hook

    @contextlib.contextmanager
    def attached(self):
        if self._active:
            yield self
            return
        stashed = []
        for layer in self.layers:
            stashed.append(dict(layer._forward_hooks))
            layer._forward_hooks.clear()
        handles = [self.layers[i].register_forward_hook(self._hook(i)) for i in sorted(set(self.layer_ids))]
        self._active = True
        try:
            yield self
        finally:
            self._active = False
            for h in handles:
                h.remove()
            for layer, hooks in zip(self.layers, stashed):
                layer._forward_hooks.clear()
                layer._forward_hooks.update(hooks)
            self._captured = {}

    def __call__(self, input_ids: Tensor, start: int, cache=None, keep: int = 0, attention_mask: Optional[Tensor] = None,
                 position_ids: Optional[Tensor] = None) -> tuple[Tensor, Optional[Tensor]]:
        """input_ids [b, S] at positions start..start+S-1 (``cache`` must hold exactly ``start`` positions), or at
        ``position_ids`` [b, S] under a 4-D ``attention_mask`` (batched decoding: eval/batched.py).

        Returns (logits [b, keep or S, V] of the last ``keep`` positions, features [b, S, n*H] or None)."""
        if not self._active:
            raise RuntimeError("TargetRunner must be used inside `with runner.attached():`")
        s = input_ids.shape[1]
        if cache is not None and _cache_len(cache) != start:
            raise RuntimeError(f"cache holds {_cache_len(cache)} positions, forward starts at {start}")
        kwargs: dict[str, Any] = {"input_ids": input_ids, "use_cache": cache is not None}
        if position_ids is not None:
            kwargs.update(position_ids=position_ids, attention_mask=attention_mask)
        elif cache is None and start:
            kwargs["position_ids"] = torch.arange(start, start + s, device=input_ids.device)[None]
        # else HF's default positions (cache length + arange) are exactly start..start+S-1, and models with
        # their own position scheme (multimodal RoPE) keep it
        if cache is not None:
            kwargs[self.cache_kw] = cache
        if keep and self.has_logits_to_keep:
            kwargs["logits_to_keep"] = keep
        self._captured = {}
        out = self.model(**kwargs)
        logits = out.logits
        if keep:
            logits = logits[:, -keep:]
        feats = None
        if self.layer_ids:
            feats = torch.cat([self._captured[i] for i in self.layer_ids], dim=-1)
        self._captured = {}
        return logits, feats
