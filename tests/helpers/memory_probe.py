"""Worker for tests/unit/planning/test_memory.py: the drafter part of the memory plan against one real sdpa step on
CPU, in a fresh process (its resident-set high-water mark is the step's alone).

Builds the job of ``helpers.standalone_drafter`` for the given overrides (synthetic data), takes this drafter's
largest planned step (the one the plan's shape names), and measures the peak resident memory (``VmHWM``, reset just
before; ``ru_maxrss`` where it cannot be) of
building the ``DrafterTrainer`` (model, optimizer, frozen embedding and lm_head) and running that step, less the
resident memory before (the interpreter and imports: the plan's ``process`` part). Prints one JSON line:
``planned`` is the plan's live tensors (without ``process`` and the CPU heap slack), ``slack`` the slack planned.

Run with ``MALLOC_MMAP_THRESHOLD_`` fixed low, glibc maps every large tensor on its own and unmaps it when freed,
so the resident peak is the live tensors' peak; without it, the peak includes the heap's slack."""

import argparse
import gc
import json
import os
import resource
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: the helpers package
import helpers.standalone_drafter as S  # noqa: E402

from dflash_dist.targets.hf import text_config  # noqa: E402
from dflash_dist.planning.memory import drafter_plan  # noqa: E402


def status(field: str = "VmRSS") -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field}")


def rss() -> int:
    return status("VmRSS")


def reset_peak() -> bool:
    """Start the high-water mark (VmHWM) afresh: whatever this process held earlier (imports, the data) is not the
    step's. Linux: writing 5 to clear_refs."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cpu = torch.device("cpu")
    run_dir = os.path.join(args.out, "run")
    cfg = S.compose_job_config(S.job_overrides(True, None, None, 96, 256, 2048, 16, 2, 1, run_dir, args.overrides))
    S.init_single_process_group(cpu)
    job, ds = S.make_job(cfg, 2, cpu, run_dir)
    lengths = ds.lengths.tolist()
    dc = cfg.drafter
    steps = [(len(job.plan[k]), max(1, -(-max(lengths[i] for i in job.plan[k]) // dc.tuning.ctx_bucket))
              * dc.tuning.ctx_bucket) for k in S.my_messages(job)]
    plan = drafter_plan(cfg, text_config(job.hf_config), job.drafter, "cpu", steps, num_drafters=1)
    j = next(k for k, s in zip(S.my_messages(job), steps) if s == plan.shape[:2])
    feats = torch.randn(S.message_tokens(job, ds, j), len(job.layer_ids) * text_config(job.hf_config).hidden_size)
    msg = S.make_message(job, ds, j, cpu, feats)
    gc.collect()
    before = rss()
    fresh = reset_peak()
    trainer = S.make_trainer(job)
    trainer.train_step(trainer.build(msg, job.start_cursor + j))
    peak = status("VmHWM") if fresh else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    slack = plan.parts.get("heap slack (CPU)", 0)
    planned = plan.total - plan.parts["process"] - slack
    out = {"overrides": args.overrides, "shape": plan.shape, "measured": peak - before, "planned": planned, "slack": slack,
           "parts": plan.parts, "rss_before": before}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
