"""``dflash-eval``: acceptance length τ of a trained drafter with real greedy speculative decoding.

    dflash-eval --checkpoint OUT/checkpoints/step_00001000 [--num-prompts 256] [--max-new-tokens N]
    dflash-eval --export EXPORT_DIR [--target NAME_OR_PATH] [--prompts prompts.jsonl] [--out eval.json]
    torchrun --nproc-per-node K -m dflash_dist.cli.eval --export EXPORT_DIR ...   # a target too large for one GPU

The target is rebuilt from the checkpoint's ``job_config.target`` section (``dflash_dist.config.TargetConfig``
+ ``target.build_target_model``; a random-init target comes back identical from its ``init_seed``), or from
the export's ``dflash_dist_meta.json``, or from ``--target``. What a checkpoint or export names is data: its
tokenizer / target locations load from a local directory or the local Hugging Face cache only, its attention /
experts implementations must be transformers' own (``--attn-implementation`` / ``--tokenizer`` / ``--target``
name anything else, Hub kernels and ids included); a file that does not check out is one ``checkpoint error:``
line, exit 2.

Prompts default to the training run's held-out conversations (``data.split_holdout`` over the same source with
the same seed): each one's messages before its first assistant turn, rendered with the chat template and the
generation prompt; a source other than a packaged corpus is read only when ``--data SOURCE`` names it.
``--prompts`` takes a JSONL of ``{"messages": [...]}`` (same rule) or ``{"prompt": "text"}`` rows.

Under torchrun (K processes on one node) the target is sharded over all K with transformers' tensor-parallel
plan, as a training job's replica (``target.tensor_parallel``): every rank runs the verify forwards, rank 0 runs
the drafter (the target's embedding and lm_head read whole from its checkpoint) and broadcasts each block's
proposals (eval/replica.py ``EvalReplica``). The result is that of one process (the same fields,
``tensor_parallel`` K).

Prints progress (prompts done, elapsed, ETA) as it goes, then a table (the pooled acceptance length, all
accepted+1 tokens / all verify steps, first; z-lab's τ, the mean over prompts, beside it, the prompts that ended in
their first block left out unless ``--include-one-step``; acceptance per block slot, losslessness against the
target's own greedy decoding) and
writes the full result as JSON beside what it read (``<checkpoint or export directory>.eval.json``, e.g.
``checkpoints/step_00001000.eval.json``), or to ``--out PATH``; never into the current directory.

Helpers used by training (no torch.distributed here): :func:`eos_token_ids`, :func:`prompt_messages`,
:func:`encode_prompts`, :func:`prompts_from_jsonl`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
from typing import Optional

import torch

from dflash_dist.export.load import META_NAME
from dflash_dist.checkpoint.safe_io import check_tokenizer_files, local_dir
from dflash_dist.checkpoint.store import CheckpointError
from dflash_dist.checkpoint.validate import local_attention, local_experts
from dflash_dist.config import ConfigError, DataConfig, TargetConfig, TrainConfig
from dflash_dist.data.conversations import PACKAGED_SOURCES
from dflash_dist.data.sources import parse_template_kwargs
from dflash_dist.eval.prompts import (
    check_pair,
    encode_prompts,
    eos_token_ids,
    holdout_conversations,
    load_drafter,
    prompts_from_jsonl,
    spread_subset,
)
from dflash_dist.eval.replica import EvalReplica
from dflash_dist.eval.spec_decode import evaluate_prompts, format_table, make_dflash_draft_fn

log = logging.getLogger("dflash_dist")


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(prog="dflash-eval", description="Acceptance length of a DFlash drafter with real "
                                "greedy speculative decoding against its target.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="a training checkpoint directory (…/checkpoints/step_XXXXXXXX)")
    src.add_argument("--export", help="a dflash-export directory (or a z-lab release with --target)")
    p.add_argument("--target", default=None, help="target name_or_path (default: the run's target section)")
    p.add_argument("--target-dtype", default=None, choices=["auto", "bfloat16", "float16", "float32"])
    p.add_argument("--target-quantization", default=None, choices=["none", "fp8"], help="quantize the target on "
                   "load (fp8) or not (none); default: as the run trained (e.g. a bf16-trained drafter against the "
                   "FP8 target it will be served with)")
    p.add_argument("--attn-implementation", default=None, help="the target's attention implementation (default: "
                   "the run's; a Hub kernel org/name only from here, never from a checkpoint)")
    p.add_argument("--experts-implementation", default=None, help="an MoE target's experts implementation "
                   "(default: the run's, if transformers' own)")
    p.add_argument("--tokenizer", default=None, help="tokenizer (default: the checkpoint's / export's)")
    p.add_argument("--prompts", default=None, help="JSONL of {messages} or {prompt} rows (default: held-out data)")
    p.add_argument("--data", default=None, help="the run's data.source to take the held-out prompts from (default: "
                   "the recorded one when it is a packaged corpus; a location named in a checkpoint or export is "
                   "read only when given here)")
    p.add_argument("--num-prompts", type=int, default=256, help="prompts to evaluate (at most the held-out ones); 256: "
                   "tau's standard deviation over prompts is about 5%% of tau on the tiny default")
    p.add_argument("--max-new-tokens", type=int, default=None, help="tokens generated per prompt (default: the "
                   "checkpoint's train.eval_max_new_tokens, as its in-training evaluation; else %d)"
                   % TrainConfig.eval_max_new_tokens)
    p.add_argument("--include-one-step", action="store_true", help="count in z-lab's tau the prompts that ended "
                   "inside their first block (left out by default, as train.eval_exclude_one_step; the headline "
                   "pooled acceptance length counts every verify step either way)")
    p.add_argument("--block-size", type=int, default=None, help="drafted block size (default: the trained one)")
    p.add_argument("--no-lossless-check", action="store_true", help="skip the target-only greedy reference")
    p.add_argument("--use-cache", default="auto", choices=["auto", "yes", "no"], help="target KV cache")
    p.add_argument("--batch-size", type=int, default=1, help="prompts decoded together, each as it would be alone "
                   "(one verify forward per step for all; a full-attention target with sdpa or eager attention, no "
                   "tensor-parallel replica); 1: one prompt at a time, as the in-training evaluation")
    p.add_argument("--chat-template-kwargs", default=None, help='JSON, e.g. \'{"enable_thinking": false}\', or a '
                   "run's config.json / meta.json (default: what the checkpoint or export recorded from training)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--out", default=None, help="where to write the JSON result (default: beside the checkpoint or "
                   "export read, DIR.eval.json)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    try:
        return _run(args)
    except CheckpointError as e:
        print(f"dflash-eval: checkpoint error: {e}", file=sys.stderr)
        return 2
    except ConfigError as e:
        print(f"dflash-eval: {e}", file=sys.stderr)
        return 2


class Progress:
    """``progress(done, total)`` of the evaluation: one line per prompt at most every ``every_s`` seconds (and the
    last), with the elapsed time and the ETA at the mean time per prompt so far."""

    def __init__(self, every_s: float = 5.0, clock=time.monotonic, write=None):
        self.every_s, self.clock = every_s, clock
        self.write = write or (lambda line: print(line, file=sys.stderr, flush=True))
        self.t0 = clock()
        self.last = None

    def __call__(self, done: int, total: int) -> None:
        now = self.clock()
        if done < total and self.last is not None and now - self.last < self.every_s:
            return
        self.last = now
        elapsed = now - self.t0
        eta = elapsed / done * (total - done) if done else float("nan")
        self.write(f"dflash-eval: prompts {done}/{total}, elapsed {_hms(elapsed)}, ETA {_hms(eta)}")


def _hms(s: float) -> str:
    if s != s:
        return "?"
    s = int(round(s))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def result_path(args) -> str:
    """``--out``, or ``<checkpoint or export directory>.eval.json`` beside the directory that was evaluated."""
    if args.out:
        return os.path.abspath(args.out)
    return os.path.abspath(os.path.normpath(args.checkpoint or args.export)) + ".eval.json"


def lossless_note(fraction: Optional[float], dtype: torch.dtype) -> Optional[str]:
    """Why a check below 1 need not be a bug: the verify forward over a block and the reference's one-token
    forwards round differently below float32, and a near tie then flips a greedy token."""
    if fraction is None or fraction >= 1 or dtype == torch.float32:
        return None
    name = str(dtype).removeprefix("torch.")
    return (f"note: with a {name} target a lossless check below 1 can be rounding: its block forwards and one-token "
            f"forwards round differently and a near tie flips a greedy token; --target-dtype float32 checks exactness")


def _run(args) -> int:
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    replica = EvalReplica(device) if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None
    try:
        rc = _evaluate(args, device, replica)
    except BaseException:
        if replica is not None:
            replica.close(ok=False)  # no barrier: the other ranks may be inside a verify step; torchrun ends them
        raise
    if replica is not None:
        replica.close()
    return rc


def _evaluate(args, device: str, replica: Optional[EvalReplica]) -> int:
    from transformers import AutoTokenizer

    from dflash_dist.targets.hf import build_target_model, tokenizer_path
    from dflash_dist.targets.quant import quantization_report
    feeder = replica is None or replica.is_feeder
    if not feeder:
        logging.getLogger().setLevel(logging.WARNING)
    # a replica's other ranks only verify: their copy of the drafter (for its settings) stays on the host
    setup = load_drafter(args.checkpoint, args.export, device if feeder else "cpu")
    tcfg = setup.target
    if args.target is not None:
        tcfg = TargetConfig(name_or_path=args.target, layer_ids=list(setup.layer_ids))
    if tcfg is None:
        raise ConfigError(f"{setup.source} does not say which target it was trained on: pass --target NAME_OR_PATH")
    if args.target_dtype:
        tcfg.dtype = args.target_dtype
    if args.target_quantization:
        tcfg.quantization = None if args.target_quantization == "none" else args.target_quantization
    meta_file = os.path.join(setup.source, "meta.json" if args.checkpoint else META_NAME)
    section = "job_config.target" if args.checkpoint else "target"
    # what the checkpoint or export names: transformers' own implementations, locations loaded local-only;
    # a Hub kernel or Hub id only when given here
    if args.attn_implementation:
        tcfg.attn_implementation = args.attn_implementation
    elif args.target is None:
        local_attention(meta_file, f"{section}.attn_implementation", tcfg.attn_implementation)
    if args.experts_implementation:
        tcfg.experts_implementation = args.experts_implementation
    elif args.target is None:
        local_experts(meta_file, f"{section}.experts_implementation", tcfg.experts_implementation)
    tok_path = args.tokenizer or setup.tokenizer or tokenizer_path(tcfg)
    tok_from_file = args.tokenizer is None and (setup.tokenizer is not None or args.target is None)
    tokenizer = _from_file(meta_file, "tokenizer" if setup.tokenizer else f"{section}.tokenizer", "--tokenizer",
                           tok_path, tok_from_file, "tokenizer_config.json", AutoTokenizer.from_pretrained)

    checkpoint_dir = []

    def build(where, **kw):
        if replica is not None:  # a local directory (read from a file), --target's location, or random init
            model, path = replica.build_target(tcfg, where)
            checkpoint_dir.append(path)
            return model
        tcfg.name_or_path = where
        return build_target_model(tcfg, device, **kw)
    target = build(None) if tcfg.name_or_path is None else _from_file(
        meta_file, f"{section}.name_or_path", "--target", tcfg.name_or_path, args.target is None, "config.json",
        build)
    check_pair(target, setup)
    kwargs = parse_template_kwargs(args.chat_template_kwargs) if args.chat_template_kwargs is not None \
        else (setup.chat_template_kwargs or None)

    if args.prompts:
        convs, prompt_source = prompts_from_jsonl(args.prompts), os.path.abspath(args.prompts)
    else:
        convs = holdout_conversations(_holdout_data(setup.data or DataConfig(), args.data, meta_file))
        prompt_source = "held-out conversations of the run's data"
    if len(convs) < args.num_prompts:
        log.warning("only %d prompts available (asked for %d): tau is less certain (see its standard error)",
                    len(convs), args.num_prompts)
    convs = spread_subset(convs, args.num_prompts)
    if not convs:
        raise ConfigError("no prompts to evaluate")
    prompts = encode_prompts(tokenizer, convs, kwargs)
    eos = eos_token_ids(tokenizer, target.config)
    block = args.block_size or setup.block_size
    use_cache = {"auto": None, "yes": True, "no": False}[args.use_cache]
    # the same length as the run's in-training evaluation, so the two figures compare
    max_new = args.max_new_tokens or setup.eval_max_new_tokens or TrainConfig.eval_max_new_tokens
    log.info("evaluating %s on %d prompts (%s), block %d, %d new tokens, eos %s, device %s", setup.source,
             len(prompts), prompt_source, block, max_new, eos, device)
    drafter, embed, head = setup.drafter, None, None
    if replica is not None:
        tied = bool(getattr(target.config, "tie_word_embeddings", False))
        drafter, embed, head = replica.draft_fn(lambda e, h: make_dflash_draft_fn(setup.drafter, e, h),
                                                checkpoint_dir[0], tied, next(target.parameters()).dtype, block)
        log.info("target replica of %d ranks: every rank verifies, rank 0 drafts", replica.k)
    if args.batch_size > 1:
        _check_batch(target, replica)
    result = evaluate_prompts(target, drafter, embed, head, prompts, setup.layer_ids, setup.mask_token_id, block,
                              max_new, eos, check_lossless=not args.no_lossless_check, use_cache=use_cache,
                              exclude_one_step=not args.include_one_step,
                              progress=Progress() if feeder else None, batch_size=max(1, args.batch_size))
    if not feeder:
        return 0
    result.update({"source": setup.source, "target": tcfg.name_or_path or tcfg.hf_config,
                   "prompt_source": prompt_source, "eos_ids": eos, "layer_ids": list(setup.layer_ids),
                   "mask_token_id": setup.mask_token_id, "device": device, "chat_template_kwargs": kwargs or {},
                   "tensor_parallel": replica.k if replica is not None else 1,
                   "quantization": (quantization_report(target) or {}).get("summary")})
    _report(args, result, next(target.parameters()).dtype)
    return 0


def _check_batch(target, replica) -> None:
    from dflash_dist.eval.batched import check_batchable
    if replica is not None:
        raise ConfigError("--batch-size > 1 with a tensor-parallel target replica: not supported (use --batch-size 1)")
    try:
        check_batchable(target)
    except ValueError as e:
        raise ConfigError(f"--batch-size: {e}") from None


def _report(args, result: dict, dtype: torch.dtype) -> None:
    """The table, the note on losslessness, and the JSON result (written atomically)."""
    result["target_dtype"] = str(dtype).removeprefix("torch.")
    print(format_table(result))
    note = lossless_note(result.get("lossless_fraction"), dtype)
    if note:
        print(note)
    out = result_path(args)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = out + f".tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1, default=str)
    os.replace(tmp, out)
    print(f"wrote {out}")


def _holdout_data(data: DataConfig, source: Optional[str], meta_file: str) -> DataConfig:
    """The data section whose held-out split gives the prompts: the recorded one, its source replaced by
    ``--data``; a recorded source other than a packaged corpus (a path or dataset named in a file) is refused."""
    if source is not None:
        return dataclasses.replace(data, source=source)
    if data.source not in PACKAGED_SOURCES:
        raise CheckpointError(f"{meta_file}: data.source: {data.source!r} is not read because a file names it: "
                              f"pass --data {data.source} (its held-out conversations) or --prompts FILE")
    return data


def _from_file(meta_file: str, field: str, flag: str, location: str, from_file: bool, probe: str, load):
    """``load(location)``; a location read from the checkpoint or export (``from_file``) only from a local
    directory or its local Hugging Face cache snapshot (holding ``probe``), its failure a CheckpointError naming
    the file, the field and the flag that names it instead."""
    if not from_file:
        return load(location)
    where = local_dir(location, probe)
    if where is not None:
        check_tokenizer_files(where)   # a FIFO or /dev/zero link there would hang or flood the loader
    try:
        if where is None:
            raise FileNotFoundError(location)
        return load(where, local_files_only=True)
    except ConfigError:
        raise
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{meta_file}: {field}: cannot load {location!r} from a local directory or the local "
                              f"Hugging Face cache ({type(e).__name__}); a location named in a file is never "
                              f"downloaded: pass {flag} PATH_OR_HUB_ID") from None


if __name__ == "__main__":
    sys.exit(main())
