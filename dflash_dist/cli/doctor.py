"""``dflash-doctor`` / ``python -m dflash_dist.cli.doctor``: check an environment without training.

Prints one row per check with PASS / WARN / FAIL / N/A and exits non-zero if any row FAILs:

* versions: torch, CUDA, NCCL, triton, transformers;
* GPUs, peer access between every pair and a short measured copy bandwidth (N/A on CPU or one GPU);
* flash-linear-attention and causal-conv1d (``doctor_kernels``): importable, and their kernels run (and match the PyTorch
  reference) on a small input on the GPU (N/A or WARN on CPU; FAIL on GPU when the configured target is
  hybrid and ``target.fast_path`` would require them);
* flex_attention: compiles and matches a dense reference on a small DFlash mask (``dflash_dist.model.masks``),
  forward and backward on GPU, forward only on CPU (no CPU backward), with eager flex turned into an error;
* the inductor cache directory (where compiled kernels are reused from) is writable;
* wandb: the mode a run would use and whether ``online`` would block (a <= 2 s TCP connect to the wandb host);
* the Hydra config (``conf/config.yaml`` + overrides) composes into ``JobConfig`` and passes the checks training
  makes before any model loads (``job.check_job_config``; the split's with ``--world-size N``): a config
  training refuses FAILs here with the same message;
* with ``--export DIR``: its files check out (export/validate.py: no symlink out of the directory, sizes in
  bounds, the safetensors header against the file; else a ``checkpoint error:`` line and exit 2), the export
  carries every field vLLM, SGLang, the z-lab model and transformers 4.x/5.x read
  (``export.load.export_problems``), its attention settings read the same in all of them, the tensors
  match the config (the checks ``load_export`` makes, without loading the weights; a variant's export also its
  variant's ``export_problems``: every field and tensor name vLLM and SGLang read); WARN rows for what
  dflash-export warns about and for a ``modeling_dflash.py`` that differs from this version's (it runs as code
  under trust_remote_code).

* with ``--compare-quantization`` and an FP8 target: the cosine of its captured features against the bf16
  reference's (``--bf16-reference PATH``, else see ``doctor_quant.compare_quantization``), per captured layer, on a
  few samples (WARN below 0.99).

Usage: ``dflash-doctor [--json PATH] [--no-flex] [--export DIR] [--world-size N] [--compare-quantization
[--bf16-reference PATH]] [hydra overrides ...]``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import threading
import time
import traceback
from typing import Any, Callable, Optional
from urllib.parse import urlparse

from dflash_dist.cli.doctor_kernels import _version, check_causal_conv1d, check_fla, check_flex
from dflash_dist.paths import CONF_DIR

PASS, WARN, FAIL, NA = "PASS", "WARN", "FAIL", "N/A"


class Doctor:
    def __init__(self):
        self.rows: list[dict] = []
        self.cfg = None          # JobConfig once the config check ran
        self.checkpoint_error: Optional[str] = None  # an --export directory whose files do not check out
        self.hf_config = None

    def add(self, name: str, status: str, detail: str, **data: Any) -> None:
        self.rows.append({"check": name, "status": status, "detail": detail, **({"data": data} if data else {})})

    def run(self, name: str, fn: Callable[["Doctor"], None]) -> None:
        try:
            fn(self)
        except Exception as e:  # a crashing check is a FAIL row, never a crashed doctor
            tb = traceback.format_exc(limit=3).strip().splitlines()[-1]
            self.add(name, FAIL, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else tb}"[:300])

    @property
    def failed(self) -> bool:
        return any(r["status"] == FAIL for r in self.rows)

    def table(self) -> str:
        w = max([len(r["check"]) for r in self.rows] + [5])
        lines = [f"{'CHECK'.ljust(w)}  STATUS  DETAIL", f"{'-' * w}  ------  {'-' * 40}"]
        for r in self.rows:
            detail = r["detail"].splitlines() or [""]
            lines.append(f"{r['check'].ljust(w)}  {r['status'].ljust(6)}  {detail[0]}")
            lines += [f"{' ' * w}          {d}" for d in detail[1:]]
        n = {s: sum(r["status"] == s for r in self.rows) for s in (PASS, WARN, FAIL, NA)}
        lines.append(f"\n{n[PASS]} pass, {n[WARN]} warn, {n[FAIL]} fail, {n[NA]} n/a")
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- checks

def check_versions(doc: Doctor) -> None:
    import torch
    doc.add("torch", PASS, f"{torch.__version__} (python {sys.version.split()[0]})")
    if torch.version.cuda is None:
        doc.add("CUDA", NA, "CPU build of torch")
    elif not torch.cuda.is_available():
        doc.add("CUDA", WARN, f"torch built with CUDA {torch.version.cuda} but no GPU is visible "
                              f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
    else:
        doc.add("CUDA", PASS, f"CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s), "
                              f"cuDNN {torch.backends.cudnn.version()}")
    if torch.cuda.is_available():
        import torch.distributed as dist
        if not dist.is_nccl_available():
            doc.add("NCCL", FAIL, "torch.distributed has no NCCL backend: multi-GPU training cannot start")
        else:
            v = torch.cuda.nccl.version()
            doc.add("NCCL", PASS, ".".join(map(str, v)) if isinstance(v, tuple) else str(v))
    else:
        doc.add("NCCL", NA, "no GPU (CPU runs use gloo)")
    tri = _version("triton")
    if torch.cuda.is_available():
        doc.add("triton", PASS if tri else FAIL, tri or "not installed: torch.compile/flex_attention need it on GPU")
    else:
        doc.add("triton", NA, tri or "not installed (only needed on GPU)")
    doc.add("transformers", PASS if _version("transformers") else FAIL, _version("transformers") or "not installed")


def check_gpus(doc: Doctor) -> None:
    import torch
    if not torch.cuda.is_available():
        doc.add("GPUs", NA, "no GPU")
        doc.add("P2P access", NA, "no GPU")
        doc.add("P2P bandwidth", NA, "no GPU")
        return
    n = torch.cuda.device_count()
    names = []
    for i in range(n):
        p = torch.cuda.get_device_properties(i)
        names.append(f"{i}: {p.name} {p.total_memory / 2**30:.0f} GiB sm_{p.major}{p.minor}")
    doc.add("GPUs", PASS, "\n".join(names), count=n)
    if n < 2:
        doc.add("P2P access", NA, "one GPU")
        doc.add("P2P bandwidth", NA, "one GPU")
        return
    access = {f"{i}->{j}": bool(torch.cuda.can_device_access_peer(i, j)) for i in range(n) for j in range(n) if i != j}
    no = [k for k, v in access.items() if not v]
    doc.add("P2P access", PASS if not no else WARN,
            f"all {len(access)} ordered pairs" if not no else
            f"no peer access for {', '.join(no[:12])}{' ...' if len(no) > 12 else ''} (copies go through the host)",
            pairs=access)
    nbytes = 64 << 20
    bw = {}
    for i in range(n):
        src = torch.empty(nbytes, dtype=torch.uint8, device=i)
        for j in range(n):
            if i == j:
                continue
            dst = torch.empty(nbytes, dtype=torch.uint8, device=j)
            dst.copy_(src)
            torch.cuda.synchronize(i)
            torch.cuda.synchronize(j)
            iters = 5
            t0 = time.perf_counter()
            for _ in range(iters):
                dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize(i)
            torch.cuda.synchronize(j)
            bw[f"{i}->{j}"] = round(nbytes * iters / (time.perf_counter() - t0) / 1e9, 1)
            del dst
        del src
    vals = sorted(bw.values())
    slow = min(bw, key=bw.get)
    status = PASS if vals[0] >= 10.0 else WARN
    doc.add("P2P bandwidth", status, f"{len(bw)} pairs, 64 MiB copies: min {vals[0]} GB/s ({slow}), median "
                                     f"{vals[len(vals) // 2]} GB/s, max {vals[-1]} GB/s", gbps=bw)


def check_inductor_cache(doc: Doctor) -> None:
    from dflash_dist.roles.drafter_rank.startup_report import inductor_cache_dir
    info = inductor_cache_dir()
    path = info.get("dir")
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".doctor-{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
        writable = True
    except OSError:
        writable = False
    doc.add("inductor cache", PASS if writable else WARN,
            f"{path} ({'writable' if writable else 'NOT writable: every start recompiles'}; fx_graph_cache="
            f"{info.get('fx_graph_cache')}, autograd_cache={info.get('autograd_cache')})"
            + ("; the default temp location: set TORCHINDUCTOR_CACHE_DIR to a persistent path to reuse compiled "
               "kernels across containers" if info.get("default_location") else ""), **info)


def _tcp_reachable(host: str, port: int, timeout_s: float = 2.0) -> Optional[bool]:
    """Connect within timeout_s (DNS included: done in a thread we stop waiting for). None: timed out."""
    result: dict = {}

    def probe():
        try:
            with socket.create_connection((host, port), timeout=timeout_s):
                result["ok"] = True
        except OSError as e:
            result["ok"] = False
            result["err"] = e

    t = threading.Thread(target=probe, daemon=True)
    t.start()
    t.join(timeout_s)
    return result.get("ok")


def check_wandb(doc: Doctor) -> None:
    from dflash_dist.telemetry.metrics import wandb_mode
    requested = doc.cfg.logging.wandb.mode if doc.cfg is not None else None
    mode = wandb_mode(requested)
    src = "logging.wandb.mode" if requested else ("WANDB_MODE" if os.environ.get("WANDB_MODE") else
                                                   "default (online iff credentials)")
    if mode == "disabled":
        doc.add("wandb", PASS, f"mode=disabled ({src})")
        return
    ver = _version("wandb")
    if ver is None:
        doc.add("wandb", FAIL, f"mode={mode} ({src}) but wandb is not installed: pip install wandb or set "
                               "logging.wandb.mode=disabled")
        return
    if mode != "online":
        doc.add("wandb", PASS, f"mode={mode} ({src}), wandb {ver}; no network needed")
        return
    url = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai"))
    host, port = url.hostname or "api.wandb.ai", url.port or (443 if url.scheme != "http" else 80)
    ok = _tcp_reachable(host, port, 2.0)
    if ok:
        doc.add("wandb", PASS, f"mode=online ({src}), wandb {ver}, {host}:{port} reachable")
    else:
        doc.add("wandb", WARN, f"mode=online ({src}) but {host}:{port} is "
                               f"{'unreachable' if ok is False else 'not answering within 2 s'}: wandb.init "
                               "would block (up to its init_timeout) -- set logging.wandb.mode=offline")


def check_config(doc: Doctor, overrides: list[str], world_size: Optional[int] = None) -> None:
    """Compose the config as dflash-train does and run the checks a job makes before any model loads
    (``job.check_job_config``: the same functions, so a config training refuses FAILs here with its message).
    ``world_size`` None: the checks of the target/drafter split are skipped (``--world-size`` runs them)."""
    from dflash_dist.config import ConfigError, JobConfig, compose_config, resolve_device
    from dflash_dist.data.conversations import DataError
    from dflash_dist.job import check_job_config
    from dflash_dist.targets.hf import resolve_source
    cfg = JobConfig.from_omegaconf(compose_config(overrides, CONF_DIR))
    doc.cfg = cfg
    t = cfg.target
    where = t.name_or_path or (f"random init {t.hf_config.get('model_type', t.hf_config)}")
    detail = (f"{CONF_DIR}/config.yaml{' + ' + ' '.join(overrides) if overrides else ''}: target {where}, drafter "
              f"{cfg.drafter.num_layers} layers x block {cfg.drafter.block_size}, backend "
              f"{cfg.drafter.attention_backend}, output {cfg.train.output_dir or 'a new outputs/run-<date>-<time>'}")
    path, _ = resolve_source(t)
    if path is not None and not os.path.isdir(path):
        doc.add("config", PASS, detail + "\ntarget is a hub id: its HF config is not fetched by the doctor, so the "
                                         "checks that need it run when training starts")
        return
    device = resolve_device(cfg)
    try:
        checked = check_job_config(cfg, world_size, device)
    except (ConfigError, DataError) as e:  # what dflash-train prints before it exits 2
        kind = "configuration error" if isinstance(e, ConfigError) else "data error"
        doc.add("config", FAIL, f"{kind}: {e}")
        return
    doc.hf_config = checked["hf_config"]
    tc, fp = checked["text_config"], checked["fast_path"]
    detail += (f"\ntarget config: {getattr(tc, 'model_type', '?')}, {tc.num_hidden_layers} layers, hidden "
               f"{tc.hidden_size}; {'hybrid: ' + ', '.join(fp['kinds']) if fp['hybrid'] else 'dense'}; layer ids "
               f"{checked['layer_ids']}; attention {checked['attn_implementation']} on {device}"
               + ("" if world_size else "; the split's checks need --world-size"))
    doc.add("config", PASS, detail)
    from dflash_dist.planning.memory import format_bytes
    mem = checked["memory"]
    cap, what = mem["limit"]
    doc.add("memory", WARN if mem["problems"] else PASS,
            f"{what}: {format_bytes(cap)} (train.memory_check={cfg.train.memory_check})\n"
            + "\n".join(p.describe() for p in mem["plans"].values()) + "".join("\n" + p for p in mem["problems"]))


def check_export(doc: Doctor, path: str) -> None:
    from dflash_dist.export.load import (
        CheckpointInputError,
        ExportError,
        checked_export,
        drafter_config_from_export,
        export_problems,
        nonfinite_tensors,
        safetensors_shapes,
        validate_variant_tensors,
    )
    cfg_path, st_path = os.path.join(path, "config.json"), os.path.join(path, "model.safetensors")
    if not (os.path.exists(cfg_path) and os.path.exists(st_path)):
        doc.add("export", FAIL, f"{path}: not an export directory (needs config.json and model.safetensors)")
        return
    try:  # files, sizes and the safetensors header checked before anything else reads them
        cfg, _ = checked_export(path)
    except CheckpointInputError as e:
        doc.checkpoint_error = str(e)
        doc.add("export", FAIL, f"checkpoint error: {e}")
        return
    problems = list(export_problems(cfg, path))
    try:
        dcfg = drafter_config_from_export(cfg)
        validate_variant_tensors(safetensors_shapes(st_path), cfg)   # DFlash's and its variant's tensors
        bad = nonfinite_tensors(st_path)    # a diverged drafter (codebooks included) serves garbage
        if bad:
            problems.append(f"tensors {bad[:6]} hold NaN or inf")
    except (ExportError, ValueError) as e:
        problems.append(str(e))
        dcfg = None
    _export_warnings(doc, path, cfg, dcfg)
    if problems:
        doc.add("export", FAIL, f"{path}:\n" + "\n".join(f"- {p}" for p in problems), problems=problems)
        return
    dfc = cfg["dflash_config"]
    kinds = sorted(set(dcfg.kinds))
    doc.add("export", PASS, f"{path}: {dcfg.num_layers} layers ({', '.join(kinds)}"
            + (f", window {dcfg.sliding_window}" if dcfg.sliding_window else "") + f"), block {dcfg.block_size}, "
            f"target layers {dfc['target_layer_ids']} (vLLM aux {cfg['eagle_aux_hidden_state_layer_ids']}), mask "
            f"{dfc['mask_token']!r} = {dfc['mask_token_id']}, rope_theta {cfg['rope_theta']:g}"
            + _variant_detail(cfg))


def _variant_detail(cfg: dict) -> str:
    """A variant's fields of a passing export and how to serve it (its ``export_detail``); '' for DFlash."""
    from dflash_dist.model.variants import registered_variants
    return "".join(v.export_detail(cfg) for v in registered_variants())


def _export_warnings(doc: Doctor, path: str, cfg: dict, dcfg) -> None:
    """WARN rows for what dflash-export warns about, and for a modeling file that is not the one this version
    writes (serving engines run it as code under trust_remote_code)."""
    from dflash_dist.export.serving import MODELING_NAME, modeling_source
    from dflash_dist.model.variants import DFlash, variant_of_export
    mine = os.path.join(path, MODELING_NAME)
    if os.path.isfile(mine):
        with open(mine, "rb") as a:
            if a.read() != modeling_source(variant_of_export(cfg) or DFlash()).encode("utf-8"):
                doc.add("export modeling", WARN, f"{mine} differs from the {MODELING_NAME} this version writes: it "
                        "runs as code under trust_remote_code; diff it or re-export with dflash-export")
    ids = (cfg.get("dflash_config") or {}).get("target_layer_ids") or []
    n = cfg.get("num_target_layers")
    if n is not None and ids and max(int(i) for i in ids) + 1 >= int(n):
        doc.add("export layers", WARN, f"target layer {int(n) - 1} (the last) in target_layer_ids {ids}: vLLM's aux "
                f"capture runs before each layer, so aux id {n} is never captured there")
    if dcfg is not None and len(set(dcfg.kinds)) > 1:
        doc.add("export layers", WARN, "mixed sliding/full drafter layers: vLLM serves them only with its V2 model "
                "runner (VLLM_USE_V2_MODEL_RUNNER=1)")


# ---------------------------------------------------------------------------------------------- main

def check_quantization(doc: Doctor, reference: Optional[str], **kw) -> None:
    from dflash_dist.cli.doctor_quant import compare_quantization
    status, detail, data = compare_quantization(doc.cfg, doc.hf_config, reference, **kw)
    doc.add("FP8 vs bf16 features", status, detail, **data)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="dflash-doctor", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    ap.add_argument("--no-flex", action="store_true", help="skip the flex_attention compile check")
    ap.add_argument("--export", metavar="DIR", help="also check a dflash-export directory for every loader")
    ap.add_argument("--world-size", type=int, default=None, metavar="N",
                    help="the processes dflash-train will run (also check the target/drafter split)")
    ap.add_argument("--compare-quantization", action="store_true",
                    help="an FP8 target's per-layer feature cosine against bf16")
    ap.add_argument("--bf16-reference", metavar="PATH", default=None,
                    help="with --compare-quantization: the bf16 checkpoint to compare against")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides, as for dflash-train (e.g. target=qwen3_8b_random)")
    args = ap.parse_args(argv)
    doc = Doctor()
    t0 = time.time()
    doc.run("config", lambda d: check_config(d, args.overrides, args.world_size))
    doc.run("versions", check_versions)
    doc.run("GPUs", check_gpus)
    doc.run("flash-linear-attention", check_fla)
    doc.run("causal-conv1d", check_causal_conv1d)
    if args.no_flex:
        doc.add("flex_attention", NA, "skipped (--no-flex)")
    else:
        doc.run("flex_attention", check_flex)
    doc.run("inductor cache", check_inductor_cache)
    doc.run("wandb", check_wandb)
    if args.export:
        doc.run("export", lambda d: check_export(d, args.export))
    if args.compare_quantization and doc.cfg is not None:
        doc.run("FP8 vs bf16 features", lambda d: check_quantization(d, args.bf16_reference))
    print(doc.table())
    print(f"({time.time() - t0:.1f} s)")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"rows": doc.rows, "failed": doc.failed}, f, indent=1, default=str)
    if doc.checkpoint_error:
        print(f"dflash-doctor: checkpoint error: {doc.checkpoint_error}", file=sys.stderr)
        return 2
    return 1 if doc.failed else 0


if __name__ == "__main__":
    sys.exit(main())
