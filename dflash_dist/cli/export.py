"""``dflash-export CKPT_DIR OUT_DIR``: write the z-lab DFlash layout (see export/write.py)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Optional

import torch

from dflash_dist.export.write import DTYPES, export_checkpoint
from dflash_dist.export.load import ExportError, safetensors_shapes
from dflash_dist.checkpoint.store import CheckpointError

log = logging.getLogger(__name__)


def main(argv: Optional[list] = None) -> int:
    from dflash_dist.model.variants import registered_variants
    p = argparse.ArgumentParser(prog="dflash-export", description="Export a dflash_dist checkpoint as a z-lab "
                                "DFlashDraftModel directory (vLLM / SGLang).",
                                epilog="What each drafter variant's export holds: "
                                + "; ".join(v.export_description for v in registered_variants()) + ".")
    p.add_argument("checkpoint_dir", help="a checkpoint directory (…/checkpoints/step_XXXXXXXX)")
    p.add_argument("out_dir", help="the export directory to write")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES), help="weight dtype (default bfloat16)")
    p.add_argument("--tokenizer", default=None, help="tokenizer to copy, a path or hub id (default: the checkpoint "
                   "meta's, read from a local directory or the local Hugging Face cache only)")
    p.add_argument("--no-tokenizer", action="store_true", help="do not copy tokenizer files")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty out_dir")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    try:
        out = export_checkpoint(args.checkpoint_dir, args.out_dir, dtype=args.dtype, tokenizer=not args.no_tokenizer,
                                overwrite=args.overwrite, tokenizer_path=args.tokenizer)
    except CheckpointError as e:
        print(f"dflash-export: checkpoint error: {e}", file=sys.stderr)
        return 2
    except ExportError as e:
        print(f"dflash-export: {e}", file=sys.stderr)
        return 2
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    shapes = safetensors_shapes(os.path.join(out, "model.safetensors"))   # every tensor, a variant's too
    n = sum(int(torch.Size(t.shape).numel()) for t in shapes.values())
    print(f"exported {args.checkpoint_dir} -> {out}: {cfg['num_hidden_layers']} layers, {n / 1e6:.2f}M params, "
          f"{args.dtype}, block {cfg['block_size']}, target layers {cfg['dflash_config']['target_layer_ids']} "
          f"of {cfg['num_target_layers']} (vLLM aux {cfg['eagle_aux_hidden_state_layer_ids']}), mask token "
          f"{cfg['dflash_config']['mask_token']!r} = {cfg['dflash_config']['mask_token_id']}, rope_theta "
          f"{cfg['rope_theta']:g}, layers {', '.join(cfg['layer_types'])}"
          + (f" (window {cfg['sliding_window']})" if cfg.get("sliding_window") else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
