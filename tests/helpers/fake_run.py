"""A run directory as a finished job leaves it, for the run-resolution tests."""

import json
import os

from dflash_dist.checkpoint import identity as ident


def fake_run(run_dir, identity_, step=4, total=8):
    """A run directory as a finished job leaves it: run.json, metrics.jsonl, one complete checkpoint."""
    os.makedirs(run_dir / "checkpoints" / f"step_{step:08d}")
    ident.write_run_json(str(run_dir), identity_)
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    ck = run_dir / "checkpoints" / f"step_{step:08d}"
    import torch
    from safetensors.torch import save_file
    save_file({"w": torch.zeros(1)}, str(ck / "model.safetensors"))  # a real header: checkpoint_problem reads it
    meta = {"step": step, "cursor": total, "total_messages": total,
            "files": {"model.safetensors": os.path.getsize(ck / "model.safetensors")},
            "identity": dict(identity_, plan={"hash": "p" * 16, "label": "plan"})}
    (ck / "meta.json").write_text(json.dumps(meta))
    return str(ck)
