"""Target role: the frozen HF model and the capture of the selected layers' hidden states.

Layer id i means "output of decoder layer i", which is HF ``hidden_states[i+1]``. We never ask HF for the
full hidden-state tuple and never run the lm_head: forward hooks copy the needed layer outputs into one
preallocated [b, S, n*H] buffer, and the hook on the last needed layer stops the forward, so the decoder
layers after it do not run.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Optional

import torch

from .config import ConfigError, TargetConfig

log = logging.getLogger(__name__)

ASSETS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets")
TINY_DIR = os.path.join(ASSETS, "tiny")


def resolve_source(tcfg: TargetConfig) -> tuple[Optional[str], Optional[dict]]:
    """(path or hub id to load, or None; HF config dict for random init, or None)."""
    if tcfg.name_or_path:
        return tcfg.name_or_path, None
    cfg = dict(tcfg.hf_config)
    if cfg.get("builtin") == "tiny":
        if os.path.exists(os.path.join(TINY_DIR, "model.safetensors")):
            return TINY_DIR, None
        with open(os.path.join(TINY_DIR, "config.json")) as f:
            return None, json.load(f)
    if "model_type" not in cfg:
        raise ConfigError("target.hf_config needs a model_type (e.g. qwen3) or builtin: tiny")
    return None, cfg


def load_hf_config(tcfg: TargetConfig):
    """The target's HF config without loading weights (used to validate before anything heavy)."""
    from transformers import AutoConfig, CONFIG_MAPPING
    path, cfg = resolve_source(tcfg)
    if path is not None:
        return AutoConfig.from_pretrained(path)
    cfg = dict(cfg)
    model_type = cfg.pop("model_type")
    for k in ("architectures", "transformers_version", "builtin"):
        cfg.pop(k, None)
    return CONFIG_MAPPING[model_type](**cfg)


def text_config(hf_config):
    """Multimodal wrappers (Qwen3.5) keep the language model's fields in text_config."""
    return getattr(hf_config, "text_config", None) or hf_config


def tokenizer_path(tcfg: TargetConfig) -> str:
    if tcfg.tokenizer:
        return tcfg.tokenizer
    path, _ = resolve_source(tcfg)
    if path is not None:
        return path
    if tcfg.hf_config.get("builtin") == "tiny" or not tcfg.name_or_path:
        return TINY_DIR
    raise ConfigError("set target.tokenizer for a random-init target")


def resolve_dtype(name: str, device: str) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device == "cuda" else torch.float32
    return getattr(torch, name)


def build_target_model(tcfg: TargetConfig, device: str):
    """Load or random-init the frozen target (eval mode, no grad)."""
    from transformers import AutoModelForCausalLM
    dtype = resolve_dtype(tcfg.dtype, device)
    path, _ = resolve_source(tcfg)
    if path is not None:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=tcfg.attn_implementation)
    else:
        hf_config = load_hf_config(tcfg)
        # initialise on the device itself: a CPU init of a multi-billion-parameter model takes minutes
        with torch.random.fork_rng(devices=[]), torch.device(device):
            torch.manual_seed(tcfg.init_seed)
            if device == "cuda":
                torch.cuda.manual_seed(tcfg.init_seed)
            model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype,
                                                     attn_implementation=tcfg.attn_implementation)
    model.to(device).eval().requires_grad_(False)
    return model


def decoder_layers(model):
    base = model.get_decoder()
    layers = getattr(base, "layers", None)
    if layers is None:
        raise ConfigError(f"cannot find the decoder layers of {type(model).__name__} (expected .get_decoder().layers)")
    return base, layers


def head_weights(model) -> tuple[torch.Tensor, torch.Tensor]:
    """(input embedding [V, H], lm_head [V, H]) of a loaded target."""
    return model.get_input_embeddings().weight, model.get_output_embeddings().weight


def load_head_from_checkpoint(path: str, tied: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Read only the embedding and lm_head tensors of a local safetensors checkpoint (drafter ranks)."""
    from safetensors import safe_open
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            wmap = json.load(f)["weight_map"]
    else:
        single = os.path.join(path, "model.safetensors")
        with safe_open(single, "pt") as f:
            wmap = {k: "model.safetensors" for k in f.keys()}

    def find(suffixes):
        for key in wmap:
            if any(key.endswith(s) for s in suffixes):
                with safe_open(os.path.join(path, wmap[key]), "pt") as f:
                    return f.get_tensor(key)
        return None

    embed = find(["embed_tokens.weight"])
    head = None if tied else find(["lm_head.weight"])
    if embed is None:
        raise ConfigError(f"no embed_tokens.weight in {path}")
    return embed, (embed if head is None else head)


class StopForward(Exception):
    """Raised by the hook of the last needed layer: the rest of the model does not run."""


@dataclass
class CaptureResult:
    features: torch.Tensor  # [T, n*H] packed over the batch's real tokens
    cu_seqlens: torch.Tensor


class FeatureCapture:
    """Runs the target up to the last needed layer and returns the selected layers' outputs."""

    def __init__(self, model, layer_ids: list[int]):
        self.model = model
        self.base, self.layers = decoder_layers(model)
        self.layer_ids = list(layer_ids)
        self.last = max(self.layer_ids)
        self.hidden = text_config(model.config).hidden_size
        self.num_layers = len(self.layers)
        # HF's last hidden state is taken after the final norm; keep that convention for id L-1.
        self.norm_last = (self.last == self.num_layers - 1)
        self._buf: Optional[torch.Tensor] = None
        self._handles = [self.layers[i].register_forward_hook(self._hook(slot, i))
                         for slot, i in enumerate(self.layer_ids)]
        self.layers_run = 0

    def _hook(self, slot: int, layer_id: int):
        def hook(module, args, output):
            out = output[0] if isinstance(output, (tuple, list)) else output
            if layer_id == self.num_layers - 1:
                out = self.base.norm(out)
            h = self.hidden
            self._buf[:, :, slot * h:(slot + 1) * h].copy_(out)
            if layer_id == self.last:
                self.layers_run = layer_id + 1
                raise StopForward
        return hook

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """input_ids [b, S] right-padded; returns features [sum(lengths), n*H] of the real tokens.

        Right padding needs no attention mask: every model here is causal, so the real tokens never see
        the padding after them (this keeps SDPA on its fast causal path)."""
        b, s = input_ids.shape
        dtype = next(self.model.parameters()).dtype
        self._buf = torch.empty(b, s, len(self.layer_ids) * self.hidden, dtype=dtype, device=input_ids.device)
        try:
            self.base(input_ids=input_ids, use_cache=False)
        except StopForward:
            pass
        else:
            raise RuntimeError("the target forward finished without reaching the last capture layer")
        keep = torch.arange(s, device=input_ids.device)[None, :] < lengths.to(input_ids.device)[:, None]
        feats = self._buf[keep]
        self._buf = None
        return feats

    def close(self) -> None:
        for h in self._handles:
            h.remove()
