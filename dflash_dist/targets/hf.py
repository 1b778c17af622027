"""The target's HF pieces both roles need: config, tokenizer, dtype, model construction, and the frozen
embedding / lm_head weights (loaded by key, so a drafter never loads the whole target)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Optional

import torch

from dflash_dist.config import ConfigError, JobConfig, TargetConfig
from dflash_dist.targets.families import text_config  # noqa: F401  (the family registry's; imported from here by many)

log = logging.getLogger(__name__)


from dflash_dist.paths import ASSETS_DIR as ASSETS

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
    """The target's HF config without loading weights (used to validate before anything heavy): a local directory's
    files and a ``target.hf_config`` dict are checked before transformers reads them, and the loaded config's RoPE
    values after (targets/target_files.py); transformers' errors on them are one ConfigError line."""
    from transformers import CONFIG_MAPPING, AutoConfig

    from dflash_dist.targets.target_files import CONFIG_ERRORS, check_model_type, check_rope, check_target_dir, config_error
    path, cfg = resolve_source(tcfg)
    where = f"target.name_or_path={path}" if path is not None else "target.hf_config"
    if path is not None:
        check_target_dir(path)
        try:
            hf_config = AutoConfig.from_pretrained(path)
        except CONFIG_ERRORS as e:
            raise config_error(where, e) from None
    else:
        cfg = dict(cfg)
        check_model_type(cfg, where)
        check_rope(cfg, where)
        model_type = cfg.pop("model_type")
        for k in ("architectures", "transformers_version", "builtin"):
            cfg.pop(k, None)
        try:
            hf_config = CONFIG_MAPPING[model_type](**cfg)
        except CONFIG_ERRORS as e:
            raise config_error(where, e) from None
    check_rope(hf_config, where)
    return hf_config


def causal_lm_config(hf_config):
    """The config to build the causal LM from: a multimodal wrapper's (``text_config`` + ``vision_config``, e.g.
    qwen3_5 / qwen3_5_moe) text config, so no vision tower is built; any other config as it is."""
    if getattr(hf_config, "vision_config", None) is not None and getattr(hf_config, "text_config", None) is not None:
        return hf_config.text_config
    return hf_config


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


# what a model class declares per attention implementation (transformers' PreTrainedModel flags)
_ATTN_FLAGS = {"sdpa": "_supports_sdpa", "flex_attention": "_supports_flex_attn",
               "flash_attention_2": "_supports_flash_attn", "flash_attention_3": "_supports_flash_attn",
               "flash_attention_4": "_supports_flash_attn"}


def target_model_class(hf_config):
    """The causal-LM class transformers builds for ``hf_config`` (its text model for a multimodal wrapper), or
    None when transformers has no causal LM for it."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
    for c in (hf_config, causal_lm_config(hf_config)):
        try:
            return MODEL_FOR_CAUSAL_LM_MAPPING[type(c)]
        except KeyError:
            continue
    return None


def _flash_attn_installed() -> bool:
    from transformers.utils import is_flash_attn_2_available
    return bool(is_flash_attn_2_available())


def attn_choices(cls, device_type: str) -> list[str]:
    """The attention implementations ``cls`` supports on ``device_type``, best first (eager always works)."""
    out = [name for name in ("sdpa", "flex_attention") if getattr(cls, _ATTN_FLAGS[name], False)]
    if device_type == "cpu":
        out = [x for x in out if x != "flex_attention"]  # uncompiled flex on CPU: slower than eager, and dense
    elif getattr(cls, "_supports_flash_attn", False) and _flash_attn_installed():
        out.append("flash_attention_2")
    return out + ["eager"]


def resolve_attn_implementation(tcfg: TargetConfig, hf_config, device_type: str) -> str:
    """The attention implementation the target is built with, from ``target.attn_implementation`` and what the
    model class declares: auto takes the first of :func:`attn_choices`; an explicit one the class does not
    support (or a flash kernel on CPU) is refused here, before any model loads, naming the choices. Every place
    that builds the target (training, dflash-eval, dflash-regenerate, dflash-plan) resolves it through here."""
    want, device_type = tcfg.attn_implementation, str(device_type).split(":")[0]
    cls = target_model_class(hf_config)
    model_type = getattr(hf_config, "model_type", "?")
    if cls is None:
        if want == "auto":
            raise ConfigError(f"target.attn_implementation=auto: transformers has no causal LM class for "
                              f"model_type {model_type!r} to ask; set target.attn_implementation to sdpa, "
                              "flex_attention, flash_attention_2 or eager")
        return want
    choices = attn_choices(cls, device_type)
    if want == "auto":
        return choices[0]
    flag = _ATTN_FLAGS.get(want)
    unsupported = flag is not None and not getattr(cls, flag, False)
    if unsupported or (want.startswith("flash_attention") and device_type == "cpu"):
        why = f"{cls.__name__} does not support it" if unsupported else "flash attention kernels need CUDA"
        raise ConfigError(f"target.attn_implementation={want}: {why}; choose one of auto, {', '.join(choices)} "
                          f"(auto picks {choices[0]} on {device_type})")
    return want


def attn_note(tcfg: TargetConfig, hf_config, device_type: str) -> Optional[str]:
    """How ``target.attn_implementation=auto`` chose, for the fast-path line; None for an explicit choice."""
    cls = target_model_class(hf_config)
    if tcfg.attn_implementation != "auto" or cls is None:
        return None
    device_type = str(device_type).split(":")[0]
    return f"auto: {cls.__name__} on {device_type} supports {', '.join(attn_choices(cls, device_type))}"


def build_target_model(tcfg: TargetConfig, device: str, local_files_only: bool = False):
    """Load or random-init the frozen target (eval mode, no grad). ``local_files_only``: a location read from a
    file (a checkpoint's job section) is loaded from a local directory or the local HF cache, never the network."""
    from transformers import AutoModelForCausalLM

    from dflash_dist.targets.quant import apply_quantization, checkpoint_format, strip_quantization
    dtype = resolve_dtype(tcfg.dtype, device)
    path, _ = resolve_source(tcfg)
    hf_config = load_hf_config(tcfg)
    fmt = checkpoint_format(hf_config) if path is not None else None
    kw = {"attn_implementation": resolve_attn_implementation(tcfg, hf_config, device)}
    if getattr(tcfg, "experts_implementation", None):
        kw["experts_implementation"] = tcfg.experts_implementation
    if fmt is not None:  # a pre-quantized FP8 checkpoint: plain modules first, its FP8 linears swapped in below
        kw["config"] = strip_quantization(hf_config)
    if path is not None:
        # a multimodal checkpoint (Qwen3.5 ...ForConditionalGeneration): AutoModelForCausalLM maps it to the text
        # model (transformers drops the vision tower's weights), which is all the capture runs
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, use_safetensors=True, **kw,
                                                     **({"local_files_only": True} if local_files_only else {}))
    else:
        # random init of a multimodal wrapper config: the text model from its text_config (no vision tower)
        hf_config = causal_lm_config(load_hf_config(tcfg))
        # initialise on the device itself: a CPU init of a multi-billion-parameter model takes minutes
        with torch.random.fork_rng(devices=[]), torch.device(device):
            torch.manual_seed(tcfg.init_seed)
            if device == "cuda":
                torch.cuda.manual_seed(tcfg.init_seed)
            model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype, **kw)
    model.to(device).eval().requires_grad_(False)
    apply_quantization(model, decoder_layers(model)[1], tcfg, fmt, path, device)  # FP8 targets (targets/quant)
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


# ---- target replicas: the target sharded over the k ranks of a replica (target.tensor_parallel) ----

def _from_pretrained_tp(path: str, group, device: str, **kwargs):
    """``from_pretrained`` with transformers' tensor-parallel plan (``tp_plan="auto"``: the model's
    ``base_model_tp_plan``) on a device mesh of the ranks of ``group``, which need not be the whole world (the
    drafter ranks are not part of it). transformers >= 5.2x builds its mesh from a ``DistributedConfig`` over the
    whole world (``initialize_distributed_mesh`` refuses a tensor-parallel size other than WORLD_SIZE), so for the
    length of this call its mesh is replaced by ours; older releases take ``tp_plan="auto", device_mesh=mesh``
    and use the mesh as given. Either way transformers shards the parameters while it reads the checkpoint: no rank
    materialises the whole model."""
    from torch.distributed.device_mesh import DeviceMesh
    from transformers import AutoModelForCausalLM
    mesh = DeviceMesh.from_group(group, device, mesh_dim_names=("tp",))
    k = mesh.size()
    try:
        import transformers.distributed.mixin as mixin
        from transformers.distributed import DistributedConfig
    except ImportError:
        mixin = None
    if mixin is None or not hasattr(mixin, "initialize_distributed_mesh"):
        return AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", device_mesh=mesh, **kwargs)

    class _ReplicaMesh:  # transformers.distributed.utils.TransformersDeviceMesh for a dense model: every axis but tp is 1
        def get_mesh(self, dims):
            return mesh

    here = torch.device(device, torch.cuda.current_device()) if device == "cuda" else torch.device(device)
    own = mixin.initialize_distributed_mesh
    mixin.initialize_distributed_mesh = lambda distributed_config: (here, _ReplicaMesh())
    try:
        return AutoModelForCausalLM.from_pretrained(
            path, distributed_config=DistributedConfig(tp_size=k, tp_plan="auto", **_expert_split(path, k)), **kwargs)
    finally:
        mixin.initialize_distributed_mesh = own


def _expert_split(path: str, k: int) -> dict:
    """The DistributedConfig fields that split an MoE target's experts over the replica's k ranks. transformers >= 5.25
    names the experts in the model's expert-parallel plan only (its tensor-parallel plan leaves them whole on every
    rank): ``ep_size=k`` over the same ranks, with the ``all_reduce`` dispatch, where each rank runs its share of the
    experts on the batch the replica shares and the outputs are summed, as the tensor-parallel experts were. Empty for
    a dense model, and for an older transformers whose tensor-parallel plan shards the experts itself."""
    from transformers import AutoConfig
    cfg = AutoConfig.from_pretrained(path)
    cfg = getattr(cfg, "get_text_config", lambda: cfg)()
    ep_plan = getattr(cfg, "base_model_ep_plan", None) or {}
    tp_plan = getattr(cfg, "base_model_tp_plan", None) or {}
    if "ep_dispatch_experts" not in ep_plan.values() or any(".experts" in key for key in tp_plan):
        return {}
    return {"ep_size": k, "ep_implementation": "all_reduce"}


def local_parameter_bytes(model) -> tuple[int, int]:
    """(bytes of the parameters this rank holds, bytes of the whole model's parameters)."""
    local = full = 0
    for p in model.parameters():
        t = p.to_local() if hasattr(p, "to_local") else p
        local += t.numel() * t.element_size()
        full += p.numel() * p.element_size()
    return local, full


def random_target_dir(run_dir: str, node: int) -> str:
    return os.path.join(run_dir, "random_target", f"node{node}")


def build_target_replica(tcfg: TargetConfig, device: str, group, random_dir: Optional[str] = None,
                         build_random: bool = False, ready=None):
    """One rank's shard of a target replica (``target.tensor_parallel`` > 1), loaded with transformers' plan on the
    replica's mesh. A random-init target (``hf_config``) is built once per node, whole and seeded exactly as
    ``build_target_model`` builds it (so a k-rank replica computes what one rank would), by the rank with
    ``build_random`` into ``random_dir`` as a safetensors checkpoint, then loaded sharded like a real one. That one
    rank holds the whole random model while it writes it; the ranks of a real checkpoint never do. ``ready``:
    (announce, wait) callables around the write."""
    from dflash_dist.targets.quant import apply_quantization, checkpoint_format, strip_quantization
    dtype = resolve_dtype(tcfg.dtype, device)
    path, _ = resolve_source(tcfg)
    hf_config = load_hf_config(tcfg)
    fmt = checkpoint_format(hf_config) if path is not None else None
    kw = {"config": strip_quantization(hf_config)} if fmt is not None else {}  # its FP8 linears swapped in below
    if path is None:
        if build_random:  # written unquantized (save_pretrained of FP8 linears is not a checkpoint format)
            model = build_target_model(dataclasses.replace(tcfg, quantization=None), device)
            model.save_pretrained(random_dir)
            del model
            ready[0]()
        else:
            ready[1]()
        path = random_dir
    attn = resolve_attn_implementation(tcfg, hf_config, device)
    model = _from_pretrained_tp(path, group, device, dtype=dtype, attn_implementation=attn, use_safetensors=True, **kw)
    model.eval().requires_grad_(False)
    local, full = local_parameter_bytes(model)
    if local >= full:
        raise RuntimeError(f"tensor-parallel load of {path}: this rank holds all {full} parameter bytes (the plan "
                           "sharded nothing)")
    apply_quantization(model, decoder_layers(model)[1], tcfg, fmt, path, device, replica=True)
    return model


def looks_like_path(s: str) -> bool:
    """A local path rather than a hub id ("org/name"): absolute, ./ ../ ~, or more than one '/'."""
    return s.startswith(("/", ".", "~")) or s.count("/") > 1 or s.endswith("/") or os.sep != "/" and os.sep in s


def check_target_paths(cfg: JobConfig) -> None:
    """A target or tokenizer that looks like a local path and is not there: say so (before transformers reads it
    as a hub id and answers "Repo id must be in the form 'repo_name'...")."""
    for key, value in (("target.name_or_path", cfg.target.name_or_path), ("target.tokenizer", cfg.target.tokenizer)):
        if value and looks_like_path(str(value)) and not os.path.isdir(os.path.expanduser(str(value))):
            what = "is a file, not a model directory" if os.path.exists(os.path.expanduser(str(value))) \
                else "no such directory"
            raise ConfigError(f"{key}={value}: {what} (a local model directory with config.json, or a hub id "
                              f"such as Qwen/Qwen3-8B)")


def unused_special_token(tok, chat_template_kwargs: Optional[dict] = None) -> Optional[int]:
    """The highest id among the tokenizer's special tokens that no tokenized training row can hold, or None: a
    special token (the data reader refuses content that spells one, and plain text never tokenizes to one) that
    names no role (bos, eos, pad, unk, ...), does not appear in the chat template's source and is not written
    by it into a probe conversation (SmolLM2: ``<empty_output>``, 16). It depends on the tokenizer alone, so
    every rank picks the same one."""
    roles = {getattr(tok, f"{r}_token_id", None) for r in ("bos", "eos", "pad", "unk", "sep", "cls", "mask")}
    template = getattr(tok, "chat_template", None)
    source = template if isinstance(template, str) else json.dumps(template or "")
    written: set = set()
    if template:
        probe = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                 {"role": "assistant", "content": "a"}, {"role": "user", "content": "v"}]
        for msgs in (probe, probe[1:]):
            try:
                text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True,
                                               **(chat_template_kwargs or {}))
            except Exception:  # a template that refuses a system turn: the other probe still renders
                continue
            written.update(tok(text, add_special_tokens=False)["input_ids"])
    free = [int(i) for i, t in (getattr(tok, "added_tokens_decoder", None) or {}).items()
            if getattr(t, "special", False) and i not in roles and i not in written and str(t) not in source
            and getattr(t, "content", str(t)) not in source]
    return max(free) if free else None


def resolve_mask_token_id(cfg: JobConfig, tok, vocab_size: int) -> int:
    """MASK's token id: ``drafter.mask_token_id``; else the tokenizer's mask token (``mask_token`` or
    ``<|MASK|>``); else the first embedding row no token uses (Qwen3: 151669); else a special token the training
    data never holds (:func:`unused_special_token`; a target whose vocabulary has no spare row, SmolLM2)."""
    if cfg.drafter.mask_token_id is not None:
        return int(cfg.drafter.mask_token_id)
    if getattr(tok, "mask_token_id", None) is not None:
        return int(tok.mask_token_id)
    mid = tok.convert_tokens_to_ids("<|MASK|>")
    if isinstance(mid, int) and mid != tok.unk_token_id and mid is not None and mid >= 0:
        return int(mid)
    if len(tok) < vocab_size:  # first embedding row no token uses (Qwen3: 151669)
        return len(tok)
    mid = unused_special_token(tok, cfg.data.chat_template_kwargs)
    if mid is not None and mid < vocab_size:
        if os.environ.get("RANK", "0") == "0":
            log.info("mask token: %d %r, a special token the chat template does not use (no mask token and no "
                     "spare embedding row in a vocabulary of %d; drafter.mask_token_id overrides)", mid,
                     tok.convert_ids_to_tokens(mid), vocab_size)
        return mid
    raise ConfigError("no mask token: set drafter.mask_token_id to an id in the target vocabulary")
