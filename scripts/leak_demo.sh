#!/usr/bin/env bash
# Train two drafters on the embedded default, one with the correct DFlash mask (context kv < anchor) and one
# with the classic leak (kv <= anchor), then compare training accuracy with the acceptance length measured by
# real speculative decoding on held-out prompts. Usage: bash scripts/leak_demo.sh [OUT_DIR] [extra overrides]
set -euo pipefail
OUT=${1:-outputs/leak_demo}; shift || true
for variant in correct leaky; do
  leak=0; [ "$variant" = leaky ] && leak=1
  rm -rf "$OUT/$variant"
  DFLASH_LEAKY_MASK_DEMO=$leak torchrun --standalone --nproc-per-node 3 -m dflash_dist.train train.output_dir="$OUT/$variant" \
    logging.progress_bar=false logging.wandb.mode=disabled "$@" 2>&1 \
    | grep -E "acceptance at step|done:" || true
done
python3 - "$OUT" <<'PY'
import json, sys, os
out = sys.argv[1]
rows = []
for v in ("correct", "leaky"):
    recs = [json.loads(l) for l in open(os.path.join(out, v, "metrics.jsonl"))]
    train = [r for r in recs if r["kind"] == "train"]
    ev = [r for r in recs if r["kind"] == "eval"]
    tail = train[-5:]
    acc = sum(r["acc"] for r in tail) / len(tail)
    rows.append((v, acc, sum(r["tau_from_acc"] for r in tail) / len(tail), ev[-1]["tau"] if ev else float("nan")))
print(f"{'mask':8s} {'train acc (last 5 logs)':>24s} {'tau predicted by train acc':>27s} {'measured tau':>13s}")
for v, acc, pred, tau in rows:
    print(f"{v:8s} {acc:24.3f} {pred:27.3f} {tau:13.3f}")
with open(os.path.join(out, "leak_demo.json"), "w") as f:
    json.dump([dict(zip(("mask", "train_acc", "tau_from_train_acc", "measured_tau"), r)) for r in rows], f, indent=1)
PY
