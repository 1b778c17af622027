#!/usr/bin/env python3
"""Combine the JSON files of one bench/run_gpu.sh run into results.json and a markdown summary.

    python bench/summarize.py WORK_DIR --json OUT/results.json --md OUT/summary.md

Reads (each optional): drafter_step.json, target_capture.json, hybrid_without_cc1d.json, hybrid_with_cc1d.json,
pipeline.json, threaded.json, plan_split.json, fresh_shapes.json, head_serve.json, send_overlap.json,
transport_check.json, rcs (lines "part exit_code"). Prints the markdown.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

PARTS = ["drafter_step", "target_capture", "hybrid_without_cc1d", "hybrid_with_cc1d", "pipeline", "threaded",
         "plan_split"]
# parts shown as a generic table of their "rows" (or their top-level numbers)
OTHER_PARTS = ["fresh_shapes", "head_serve", "send_overlap", "transport_check"]


def load(work: str) -> dict:
    out = {}
    for name in PARTS + OTHER_PARTS:
        path = os.path.join(work, f"{name}.json")
        if os.path.exists(path):
            try:
                with open(path) as f:
                    out[name] = json.load(f)
            except json.JSONDecodeError as e:
                out[name] = {"error": f"unreadable JSON: {e}"}
    rcs = {}
    path = os.path.join(work, "rcs")
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 2:
                    rcs[parts[0]] = parts[1]
    out["exit_codes"] = rcs
    return out


def hybrid_row(name: str, d: dict) -> dict:
    rows = [r for r in d.get("rows", []) if "error" not in r]
    r = rows[0] if rows else {}
    fp = d.get("fast_path") or {}
    kinds = list((fp.get("kinds") or {}).values())
    k = kinds[0] if kinds else {}
    return {"run": name, "fla": k.get("fla"), "causal_conv1d": k.get("causal_conv1d"),
            "tok_s": r.get("capture_tokens_per_s"), "mix": r.get("mix"), "budget": r.get("budget"),
            "summary": d.get("fast_path_summary")}


def markdown(res: dict) -> str:
    out = ["# dflash_dist GPU benchmarks", ""]
    env = next((res[p].get("env") for p in PARTS if isinstance(res.get(p), dict) and res[p].get("env")), {}) or {}
    out.append(f"GPU: {env.get('gpu')} x{env.get('visible_gpus')} | torch {env.get('torch')} | CUDA {env.get('cuda')} "
               f"| transformers {env.get('transformers')} | triton {env.get('triton')} | {env.get('time')}")
    out.append("")
    out.append("exit codes (124 = hit its time box): " + ", ".join(f"{k}={v}" for k, v in res["exit_codes"].items()))
    out.append("")
    ds = res.get("drafter_step")
    if ds:
        pk = ds.get("peak_matmul", {})
        out.append(C.table(ds.get("rows", []), [
            ("backend", "backend"), ("mode", "mode"), ("ctx", "ctx"), ("anchors", "anchors"), ("batch", "b"),
            ("ms_per_step", "ms/step"), ("samples_per_s", "samples/s"), ("tflops_model", "model TFLOP/s"),
            ("mfu_measured_pct", "MFU % (measured peak)"), ("mfu_nominal_pct", "MFU % (nominal)"),
            ("peak_mem_gb", "peak GB"), ("first_step_s", "first step s"), ("error", "error")],
            title=f"1. Drafter step (Qwen3-8B-shaped, 5 layers; matmul peak {C.fmt(pk.get('tflops'))} TFLOP/s "
                  f"measured, {C.fmt(ds.get('nominal_peak_tflops'))} nominal)"))
        if ds.get("skipped"):
            out.append(f"\nskipped for time: {[(s['backend'], s['ctx'], s['anchors']) for s in ds['skipped']]}")
        out.append("")
    tc = res.get("target_capture")
    if tc:
        out.append(C.table(tc.get("rows", []), [
            ("mix", "mix"), ("budget", "budget"), ("variant", "variant"), ("mean_samples_per_batch", "samples/batch"),
            ("pad_frac", "pad"), ("capture_tokens_per_s", "capture tok/s"), ("speedup_vs_padded", "vs padded"),
            ("capture_samples_per_s", "samples/s"),
            ("capture_tflops", "TFLOP/s"), ("full_tokens_per_s", "full fwd tok/s"),
            ("capture_speedup_vs_full", "capture / full"), ("error", "error")],
            title=f"2. Target capture ({tc.get('target')}, layers {tc.get('layer_ids')})"))
        out.append("")
    hy = [hybrid_row(n, res[n]) for n in ("hybrid_without_cc1d", "hybrid_with_cc1d") if res.get(n)]
    if hy:
        out.append(C.table(hy, [("run", "run"), ("fla", "fla bound"), ("causal_conv1d", "causal-conv1d bound"),
                                ("tok_s", "capture tok/s"), ("mix", "mix"), ("budget", "budget")],
                           title="2b. Hybrid (reduced Qwen3-Next) target"))
        if len(hy) == 2 and hy[0]["tok_s"] and hy[1]["tok_s"]:
            out.append(f"\ncausal-conv1d speed-up: {hy[1]['tok_s'] / hy[0]['tok_s']:.3f}x")
            res["hybrid_cc1d_speedup"] = hy[1]["tok_s"] / hy[0]["tok_s"]
        out.append("")
    pipe = res.get("pipeline")
    if pipe:
        a, e = pipe.get("alone") or {}, pipe.get("e2e") or {}
        rows = [{"what": "(a) drafter alone", "v": pipe.get("alone_samples_per_s"), "note": a.get("error")},
                {"what": "(b) 1 target + 1 drafter (torchrun)", "v": pipe.get("e2e_samples_per_s"),
                 "note": e.get("error") or e.get("stopped")},
                {"what": f"ratio (goal >= {pipe.get('goal')})", "v": pipe.get("ratio"),
                 "note": None if pipe.get("goal_met") is None else ("met" if pipe["goal_met"] else "NOT met")}]
        out.append(C.table(rows, [("what", "measurement"), ("v", "samples/s or ratio"), ("note", "note")],
                           title=f"3. Pipeline efficiency (steps {pipe.get('warmup_steps')}..{pipe.get('steps')})"))
        out.append("")
    th = res.get("threaded")
    if th:
        cmp_ = th.get("compare") or {}
        errs = "; ".join(f"{x['thread']}/{x['kind']}: {x['error'][:100]}" for x in th.get("errors", []))
        hung = th.get("hung_threads") or []
        note = errs or (("hung: " + ",".join(hung)) if hung else "ok")
        rows = [{"what": "threaded, 1 process 2 threads", "v": th.get("samples_per_s"), "note": note},
                {"what": "multi-process pipeline", "v": cmp_.get("pipeline_e2e_samples_per_s")},
                {"what": "threaded / pipeline", "v": cmp_.get("threaded_over_pipeline")}]
        out.append(C.table(rows, [("what", "design"), ("v", "samples/s or ratio"), ("note", "errors")],
                           title=f"4. Threaded baseline (compile errors: {'YES' if th.get('hit_compile_error') else 'no'})"))
        out.append("")
    ps = res.get("plan_split")
    if ps:
        out.append(C.table(ps.get("rows", []), [("targets", "T"), ("drafters", "D"), ("samples_per_s", "samples/s"),
                                                 ("per_gpu", "samples/s/GPU"), ("bottleneck", "bound by")],
                           title=f"5. Split projection, W={ps.get('gpus')} (supply {C.fmt(ps.get('supply_per_target_gpu'))}"
                                 f", demand {C.fmt(ps.get('demand_per_drafter_gpu'))} samples/s per GPU)"))
        b = ps.get("best") or {}
        out.append(f"\nbest: {b.get('targets')}T + {b.get('drafters')}D -> {C.fmt(b.get('samples_per_s'))} samples/s "
                   f"({C.fmt(b.get('per_gpu'))}/GPU)")
        out.append("")
    for i, name in enumerate(n for n in OTHER_PARTS if isinstance(res.get(n), dict)):
        out.append(generic(name, res[name], f"6{chr(ord('a') + i)}"))
        out.append("")
    return "\n".join(out)


def _scalar(v) -> bool:
    return isinstance(v, (int, float, str, bool)) or v is None


def generic(name: str, d: dict, number: str) -> str:
    """A part without a dedicated table: its rows' scalar columns, else its top-level scalars."""
    rows = [r for r in d.get("rows", []) if isinstance(r, dict)]
    if rows:
        keys = [k for k in rows[0] if _scalar(rows[0][k])]
        return C.table(rows, [(k, k) for k in keys], title=f"{number}. {name}")
    items = [{"key": k, "value": v} for k, v in d.items() if _scalar(v) and k != "bench"]
    return C.table(items, [("key", "key"), ("value", "value")], title=f"{number}. {name}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("work")
    p.add_argument("--json", default=None)
    p.add_argument("--md", default=None)
    args = p.parse_args(argv)
    res = load(args.work)
    md = markdown(res)
    C.write_json(args.json, res)
    if args.md:
        with open(args.md, "w") as f:
            f.write(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
