"""FP8 targets as users serve them: the FP8 format a checkpoint declares (``quantization_config`` in its
config.json), loading its FP8 linears into :class:`~dflash_dist.targets.quant.fp8.FP8Linear`, and quantizing a bf16
target's decoder linears on load (``target.quantization=fp8``).

Formats that load (the ones transformers loads, without transformers' quantizers: its fine-grained FP8 path needs
the ``kernels`` package, which fetches compiled code from the Hub at run time, and on CPU it dequantizes silently):

* fine-grained FP8 (``quant_method: fp8``, e4m3, ``weight_scale_inv`` per 128x128 weight block or per tensor,
  dynamic activations), as Qwen/Qwen3-8B-FP8 ships;
* compressed-tensors float8 (``quant_method: compressed-tensors``, ``format: float-quantized``, 8-bit float
  weights with ``weight_scale`` per channel, per tensor or per block), as llm-compressor writes FP8 / FP8_DYNAMIC.

The GEMM takes one scale per output channel: per-channel and per-tensor scales load exactly; block scales are
dequantized and requantized per output channel (reported). Activations are always scaled per token at run time (a
checkpoint's static ``input_scale`` is not used). The model is first built by transformers from the config without
its ``quantization_config`` (the FP8 tensors read as plain values, their scales left over), then every Linear with
an FP8 weight in the checkpoint is replaced from the checkpoint's tensors. An FP8 tensor no nn.Linear takes (e.g.
fused MoE experts) is refused: it would otherwise run unscaled.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from dflash_dist.config import ConfigError
from dflash_dist.targets.quant import shards
from dflash_dist.targets.quant.fp8 import FP8_DTYPE, KERNEL_NAMES, FP8Linear, expand_block_scales, quantize_rows

log = logging.getLogger(__name__)
ATTR = "_dflash_quantization"  # the model attribute holding what was asked for and done (read by the report)
FORMATS_HELP = ("fine-grained FP8 (quant_method: fp8) or compressed-tensors float8 (format: float-quantized); "
                "or load the bf16 checkpoint with target.quantization=fp8")


@dataclass
class CheckpointFormat:
    """A pre-quantized checkpoint's FP8 format: its quant_method, the name of the weight-scale tensors, and a
    one-line description for the report."""
    method: str
    scale_key: str
    detail: str
    block: Optional[tuple] = None  # fine-grained FP8's weight_block_size: the scale grid it implies is required


def _qc_dict(hf_config, where: str) -> Optional[dict]:
    qc = hf_config.get("quantization_config") if isinstance(hf_config, dict) else \
        getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    if not isinstance(qc, dict) and callable(getattr(qc, "to_dict", None)):
        qc = qc.to_dict()
    if not isinstance(qc, dict):
        raise ConfigError(f"{where}: quantization_config={str(qc)[:80]!r}: an object (quant_method and its fields)")
    return dict(qc)


def _field(qc: dict, key: str, where: str, kinds: tuple, allowed: str, default=None):
    """``qc[key]`` (``default`` when absent), refused in one line unless one of ``kinds``."""
    v = qc.get(key, default)
    if v is not None and (not isinstance(v, kinds) or isinstance(v, bool) and bool not in kinds):
        raise ConfigError(f"{where}: quantization_config.{key}={v!r}: {allowed}")
    return v


def _fine_grained(qc: dict, where: str) -> CheckpointFormat:
    if _field(qc, "fmt", where, (str,), "a string (e4m3)", "e4m3") != "e4m3":
        raise ConfigError(f"{where}: quantization_config.fmt={qc.get('fmt')!r}: only e4m3 FP8 weights load")
    if _field(qc, "activation_scheme", where, (str,), "a string (dynamic)", "dynamic") != "dynamic":
        raise ConfigError(f"{where}: quantization_config.activation_scheme={qc.get('activation_scheme')!r}: only "
                          "dynamic activation scales load")
    block = _field(qc, "weight_block_size", where, (list, tuple), "two whole numbers > 0 (e.g. [128, 128]) or null")
    if block is not None and (len(block) != 2 or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0
                                                         for b in block)):
        raise ConfigError(f"{where}: quantization_config.weight_block_size={block!r}: two whole numbers > 0 (e.g. "
                          "[128, 128]) or null")
    how = f"{block[0]}x{block[1]} weight blocks" if block else "per-tensor weight scales"
    return CheckpointFormat("fp8", "weight_scale_inv", f"fine-grained FP8 e4m3, {how}", tuple(block) if block else None)


def _compressed_tensors(qc: dict, where: str) -> CheckpointFormat:
    fmt = qc.get("format")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise ConfigError(f"{where}: compressed-tensors format {fmt!r} does not load as FP8 (float-quantized "
                          f"does); use {FORMATS_HELP}")
    strategies = set()
    groups = _field(qc, "config_groups", where, (dict,), "an object of named groups, each with its weights")
    for name, group in (groups or {}).items():
        w = group.get("weights") if isinstance(group, dict) else None
        w = w if isinstance(w, dict) else {}
        if w.get("num_bits") != 8 or w.get("type") != "float" or w.get("strategy") not in ("channel", "tensor",
                                                                                          "block"):
            raise ConfigError(f"{where}: compressed-tensors config_groups.{name}.weights (num_bits={w.get('num_bits')}"
                              f", type={w.get('type')}, strategy={w.get('strategy')}): only 8-bit float weights per "
                              "channel, tensor or block load")
        strategies.add(w["strategy"])
    if not strategies:
        raise ConfigError(f"{where}: compressed-tensors quantization_config has no config_groups")
    return CheckpointFormat("compressed-tensors", "weight_scale",
                            f"compressed-tensors float8, {'/'.join(sorted(strategies))} weight scales")


def checkpoint_format(hf_config, where: str = "target.name_or_path") -> Optional[CheckpointFormat]:
    """The FP8 format ``hf_config`` (object or config.json dict) declares, None for an unquantized checkpoint; any
    other quantization, and a field of the wrong type, refused in one line."""
    qc = _qc_dict(hf_config, where)
    if qc is None:
        return None
    method = qc.get("quant_method")
    if method == "fp8":
        return _fine_grained(qc, where)
    if method == "compressed-tensors":
        return _compressed_tensors(qc, where)
    raise ConfigError(f"{where}: quantization_config.quant_method={method!r} does not load; FP8 targets load from "
                      f"{FORMATS_HELP}")


def strip_quantization(hf_config):
    """``hf_config`` without its quantization_config, so transformers builds plain modules from it."""
    for c in (hf_config, getattr(hf_config, "text_config", None)):
        if c is not None and hasattr(c, "quantization_config"):
            delattr(c, "quantization_config")
    return hf_config


# ---------------------------------------------------------------------------------------------- checkpoint tensors

def _weight_map(path: str) -> dict:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            return json.load(f)["weight_map"]
    from safetensors import safe_open
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        return {k: "model.safetensors" for k in f.keys()}


class _Tensors:
    """Reads single tensors of a (sharded) safetensors checkpoint, one open handle per file."""

    def __init__(self, path: str):
        self.path, self.map, self.files = path, _weight_map(path), {}

    def get(self, key: str) -> torch.Tensor:
        from safetensors import safe_open
        name = self.map[key]
        if name not in self.files:
            self.files[name] = safe_open(os.path.join(self.path, name), "pt")
        return self.files[name].get_tensor(key)

    def dtype(self, key: str):
        from safetensors import safe_open
        name = self.map[key]
        if name not in self.files:
            self.files[name] = safe_open(os.path.join(self.path, name), "pt")
        return self.files[name].get_slice(key).get_dtype()


def _module_for(prefix: str, linears: dict) -> Optional[str]:
    """The model's Linear for a checkpoint prefix: the same name, else the one name ending like it from its
    ``layers.`` part on (a wrapper's checkpoint names its text model differently)."""
    if prefix in linears:
        return prefix
    at = prefix.find("layers.")
    if at < 0:
        return None
    tail = "." + prefix[at:]
    found = [n for n in linears if n.endswith(tail) or n == prefix[at:]]
    return found[0] if len(found) == 1 else None


def check_scale(path: str, key: str, scale: torch.Tensor, shape: tuple, block: Optional[tuple]) -> None:
    """A checkpoint's FP8 weight scale for a weight of ``shape`` [out, in]: floating point, every value finite and
    > 0 (a zero, negative or NaN scale would scale the weight to nothing, flip it or poison every feature), and of
    a shape the loader reads: one value, one per output row ([out] or [out, 1]), or a 2-D block grid (the one
    ``block`` = weight_block_size implies, where the format declares it). A ConfigError naming the tensor."""
    out, inp = shape
    if not scale.is_floating_point():
        raise ConfigError(f"{path}: {key} is {scale.dtype}: FP8 weight scales are floating point")
    s = scale.float()
    if not bool(torch.isfinite(s).all()) or not bool((s > 0).all()):
        bad = s[~(torch.isfinite(s) & (s > 0))].flatten()[0].item()
        raise ConfigError(f"{path}: {key} holds {bad!r}: FP8 weight scales are finite and > 0")
    if s.numel() == 1 or (s.numel() == out and (s.dim() == 1 or s.dim() == 2 and s.shape[-1] == 1)):
        return
    if block is not None:
        want = (-(-out // block[0]), -(-inp // block[1]))
        ok = tuple(s.shape) == want
    else:
        want = "a grid of whole blocks"
        ok = s.dim() == 2 and s.shape[0] <= out and s.shape[1] <= inp and \
            -(-out // -(-out // s.shape[0])) == s.shape[0] and -(-inp // -(-inp // s.shape[1])) == s.shape[1]
    if not ok:
        raise ConfigError(f"{path}: {key} has shape {tuple(s.shape)} for a [{out}, {inp}] weight: an FP8 weight scale "
                          f"is one value, one per output row ([{out}] or [{out}, 1]) or the block grid {want}")


def _row_scaled(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(float8 weight, scale per output row, requantized?) from a checkpoint weight and its scale tensor (checked
    by ``check_scale``): a scalar or [out(, 1)] scale as it is; a block grid through dequantize + per-row
    requantize."""
    out, inp = q.shape
    scale = scale.float()
    if scale.numel() == 1:
        return q, scale.reshape(1).expand(out).clone(), False
    if scale.numel() == out and (scale.dim() == 1 or scale.shape[-1] == 1):
        return q, scale.reshape(out), False
    block = (-(-out // scale.shape[0]), -(-inp // scale.shape[1]))
    wq, ws = quantize_rows(q.float() * expand_block_scales(scale, (out, inp), block))
    return wq, ws, True


def _reduce_group(layout: Optional[shards.Layout]):
    """The group a rowwise shard's partial outputs are summed over (None: the output is this rank's as it is)."""
    return layout.group if layout is not None and layout.style == "rowwise" else None


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


def load_fp8_linears(model: nn.Module, path: str, fmt: CheckpointFormat, kernel: str) -> dict:
    """Replace every Linear whose checkpoint weight is FP8 by an FP8Linear from the checkpoint's weight and scale;
    returns (and records on the model) what was done. Refuses FP8 tensors no Linear takes."""
    tensors = _Tensors(path)
    suffix = "." + fmt.scale_key
    prefixes = sorted(k[: -len(suffix)] for k in tensors.map if k.endswith(suffix))
    fp8_weights = {k for k in tensors.map if k.endswith(".weight") and tensors.dtype(k) in ("F8_E4M3", "F8_E5M2")}
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    done, requantized, orphans = 0, 0, []
    for prefix in prefixes:
        name = _module_for(prefix, linears)
        if name is None or prefix + ".weight" not in tensors.map:
            orphans.append(prefix)
            continue
        q = tensors.get(prefix + ".weight")
        if q.dtype != FP8_DTYPE:
            raise ConfigError(f"{path}: {prefix}.weight is {q.dtype}; only float8_e4m3fn FP8 weights load")
        scale = tensors.get(prefix + suffix)
        check_scale(path, prefix + suffix, scale, tuple(q.shape), fmt.block)
        wq, ws, req = _row_scaled(q, scale)
        old = linears[name]
        layout = shards.layout_of(old)  # a replica's shard: the whole row-scaled weight sliced as loaded
        local_shape = tuple(shards.local_tensor(old.weight).shape)
        wq = shards.local_slice(wq, layout, local_shape)
        if layout is not None and layout.style == "colwise":
            ws = ws.chunk(layout.size)[layout.index]
        _set_module(model, name, FP8Linear(wq, ws, shards.local_bias(old), kernel, fmt.detail,
                                           reduce_group=_reduce_group(layout)))
        fp8_weights.discard(prefix + ".weight")
        done, requantized = done + 1, requantized + int(req)
    orphans += sorted(k[: -len(".weight")] for k in fp8_weights)
    if orphans:
        raise ConfigError(f"{path}: {len(orphans)} FP8 tensors (e.g. {orphans[0]}) are no nn.Linear of "
                          f"{type(model).__name__} (fused MoE experts do not load as FP8 yet); load the bf16 "
                          "checkpoint with target.quantization=fp8, which keeps experts bf16")
    if done == 0:
        raise ConfigError(f"{path}: config.json declares {fmt.detail} but no *{suffix} tensors are in the checkpoint")
    log.info("FP8 checkpoint %s: %d linears loaded as FP8 (%s) with their *%s tensors (the ones transformers' load "
             "report lists as UNEXPECTED)", path, done, fmt.detail, suffix)
    info = {"method": "fp8", "source": f"checkpoint ({fmt.detail})", "kernel": kernel,
            "kernel_name": KERNEL_NAMES[kernel], "fp8_linears": done,
            "requantized_per_channel": requantized}
    setattr(model, ATTR, info)
    return info


# ---------------------------------------------------------------------------------------------- on load

_SKIP_LEAVES = ("gate", "router", "shared_expert_gate")  # MoE routers: tiny GEMMs whose rounding moves the routing


def quantize_linears(model: nn.Module, layers: nn.Module, kernel: str) -> dict:
    """``target.quantization=fp8``: every Linear inside the decoder ``layers`` becomes an FP8Linear (per output
    channel scales), except MoE routers and shapes the FP8 GEMM cannot take (dims not multiples of 16); the
    embedding, lm_head and fused expert weights stay as loaded. Returns (and records on the model) what was done."""
    kept = []
    done = 0
    for name, mod in list(layers.named_modules()):
        if not isinstance(mod, nn.Linear):
            continue
        out, inp = shards.local_tensor(mod.weight).shape  # a replica's shard: its own dims go to the GEMM
        if name.rpartition(".")[2] in _SKIP_LEAVES or inp % 16 or out % 16:
            kept.append(name)
            continue
        layout = shards.layout_of(mod)
        q, scale = shards.quantize_local(mod, layout)
        _set_module(layers, name, FP8Linear(q, scale, shards.local_bias(mod), kernel, "quantized on load",
                                            reduce_group=_reduce_group(layout)))
        done += 1
    if done == 0:
        raise ConfigError("target.quantization=fp8: the target's decoder layers have no nn.Linear to quantize "
                          f"({type(model).__name__}); set target.quantization=null")
    info = {"method": "fp8", "source": "quantized on load (per-channel weight scales)", "kernel": kernel,
            "kernel_name": KERNEL_NAMES[kernel], "fp8_linears": done, "kept_bf16": len(kept)}
    setattr(model, ATTR, info)
    return info
