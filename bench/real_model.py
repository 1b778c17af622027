"""The worked example on a real trained target, end to end, with the project's own commands: SmolLM2-135M-Instruct
(``dflash-fetch-real``), its own replies to ShareGPT prompts (``dflash-regenerate``), drafters of every variant and
objective trained on them (``dflash-train``, one process per GPU: colocated), each exported (``dflash-export``,
``dflash-doctor --export``) and measured by real speculative decoding (``dflash-eval``) on HumanEval, MT-Bench
and held-out ShareGPT prompts. One table at the end (``real_model.md`` / ``real_model.json`` in ``--out``).

    python bench/real_model.py --out OUT --work WORK                      # every stage, one GPU
    python bench/real_model.py --out OUT --work WORK --stages regen       # one stage (they resume from WORK)

Stages (``--stages``, comma separated, in this order):
* ``fetch``: the model and the prompt files into ``--real`` (cached; checksums checked).
* ``speed``: dflash-regenerate's tokens/s at batch 16 / 64 / 256 (``--speed-new-tokens`` new tokens each).
* ``regen``: the first ``--rows`` training prompts answered by the target (greedy, up to ``--new-tokens``), in
  ``--regen-procs`` processes on the device(s) (each generation is latency-bound: several share a GPU well).
  The first ``--small-rows`` of its output are the small data set (the two data sizes share their prompts).
* ``train``: the runs of ``RUNS`` (``--runs`` picks some), all at ``--steps`` steps, ``--parallel`` at a time;
  each ends with its in-training evaluation on ``--eval-prompts`` held-out prompts of its data. A run that ran
  out of device memory beside the others runs again alone; a rerun of the stage continues each run from its
  newest checkpoint (``train.resume=auto``; a finished run ends at once).
* ``eval``: each run's last checkpoint exported and checked by ``dflash-doctor --export``, then ``dflash-eval
  --export`` on the three prompt sets (``--eval-prompts`` each; the lossless check on ``--lossless`` runs);
  ``dflash-eval`` on the run's own held-out prompts (``--data``), to compare with its in-training evaluation; the
  drafter of the bf16 target is also evaluated against the FP8 target (the FP8 run's own evaluations load its FP8
  target, as it trained).
  Every evaluation, in training too, decodes ``--eval-batch`` prompts together.
* ``report``: ``dflash-report`` of each run (acceptance per position, train/serve gap) and the table.

SIGTERM (a scheduler's time limit, ``timeout``) stops the running jobs as their time box does (a training job
checkpoints), starts no job or stage after it, records what ran, writes the table and exits 143; a rerun goes on.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = [sys.executable, "-m"]
SETS = {"humaneval": "humaneval.jsonl", "mtbench": "mtbench.jsonl", "holdout": "sharegpt_holdout.jsonl"}

# label -> (data size, overrides): every run has the same steps and batching; only these differ
RUNS = {
    "dflash_small": ("small", ["drafter=dflash"]),
    "dflash": ("large", ["drafter=dflash", "train.checkpoint_every=200", "train.keep_checkpoints=50"]),
    "dflash2": ("large", ["drafter=dflash2"]),
    "domino": ("large", ["drafter=domino"]),
    "dpace": ("large", ["drafter=dflash", "drafter.loss.weighting=dpace"]),
    "dpace_small": ("small", ["drafter=dflash", "drafter.loss.weighting=dpace"]),
    "domino_dpace": ("large", ["drafter=domino", "drafter.loss.weighting=dpace"]),
    "labels_target": ("large", ["drafter=dflash", "drafter.loss.labels=target"]),
    "kl": ("large", ["drafter=dflash", "drafter.loss.labels=target", "drafter.loss.kind=kl"]),
    "fp8_target": ("large", ["drafter=dflash", "target.quantization=fp8"]),
}


def say(msg: str) -> None:
    print(f"[real_model {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run(cmd: list, log: str, timeout: float) -> tuple[int, float]:
    """One command, its output to ``log``; (exit code, seconds)."""
    return parallel([(cmd, log, timeout)], 1)[0]


class Stop:
    """SIGTERM to the bench (a scheduler's time limit, ``timeout``): its running jobs stop as a time box stops them
    (a training job checkpoints), no job or stage starts after it, and what ran is recorded."""
    requested = False

    @classmethod
    def on_signal(cls, signum, frame) -> None:
        cls.requested = True


def parallel(jobs: list, n: int, grace: float = 90.0) -> list:
    """``jobs``: [(cmd, log, timeout)], ``n`` processes at a time (they share the device); [(rc, seconds)] in
    order, 124 for one past its timeout or stopped by :class:`Stop` (SIGTERM, killed ``grace`` seconds later),
    None for one never started."""
    out: list = [None] * len(jobs)
    running: dict = {}
    stopped: set = set()
    todo = list(enumerate(jobs))
    while todo or running:
        if Stop.requested:
            for i, _ in todo:
                out[i] = (None, 0.0)
            todo = []
        while todo and len(running) < max(1, n):
            i, (cmd, log, timeout) = todo.pop(0)
            f = open(log, "w")
            f.write("$ " + " ".join(cmd) + "\n")
            f.flush()
            running[i] = (subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT), f, time.monotonic(),
                          timeout)
        for i, (proc, f, t0, timeout) in list(running.items()):
            rc = proc.poll()
            over = time.monotonic() - t0 - timeout
            if rc is None and (over > 0 or Stop.requested) and i not in stopped:
                proc.terminate()  # dflash-train checkpoints on SIGTERM and exits 143
                stopped.add(i)
            elif rc is None and over > grace:
                proc.kill()
            if rc is not None:
                f.close()
                out[i] = (124 if i in stopped else rc, time.monotonic() - t0)
                del running[i]
        time.sleep(0.5)
    return out


def model_dir(args) -> str:
    return os.path.join(args.real, "smollm2-135m-instruct")


def data_file(args, size: str) -> str:
    return os.path.join(args.work, f"regen_{size}.jsonl")


# ----------------------------------------------------------------------------------------------- stages

def stage_fetch(args, res: dict) -> None:
    rc, s = run(PY + ["dflash_dist.cli.fetch_real", args.real], os.path.join(args.out, "fetch.log"), 1800)
    res["fetch"] = {"rc": rc, "seconds": round(s, 1)}
    if rc and not Stop.requested:
        raise SystemExit(f"dflash-fetch-real failed: {args.out}/fetch.log")


def tokens_per_s(log: str) -> dict:
    m = re.search(r"(\d+) new tokens in ([\d.]+) s", open(log).read())
    return {"new_tokens": int(m.group(1)), "seconds": float(m.group(2)),
            "tokens_per_s": int(m.group(1)) / float(m.group(2))} if m else {}


def regen_cmd(args, out: str, rows: int, new_tokens: int, batch: int, procs: int = 1) -> list:
    tail = ["--prompts", os.path.join(args.real, "sharegpt_train.jsonl"), "--out", out, "--target", model_dir(args),
            "--max-new-tokens", str(new_tokens), "--batch-size", str(batch), "--limit", str(rows),
            "--device", args.device]
    if procs == 1:
        return PY + ["dflash_dist.cli.regenerate"] + tail
    return PY + ["torch.distributed.run", "--standalone", f"--nproc-per-node={procs}", "-m",
                 "dflash_dist.cli.regenerate"] + tail


def stage_speed(args, res: dict) -> None:
    rows = []
    for batch in (16, 64, 256):
        n = {16: 64, 64: 128, 256: 256}[batch]
        out = os.path.join(args.work, f"speed_b{batch}.jsonl")
        for p in glob.glob(out + "*"):
            os.unlink(p)
        log = os.path.join(args.out, f"speed_b{batch}.log")
        rc, s = run(regen_cmd(args, out, n, args.speed_new_tokens, batch), log, 900)
        rows.append({"batch": batch, "rows": n, "rc": rc, "wall_s": round(s, 1), **tokens_per_s(log)})
        say(f"regenerate batch {batch}: {rows[-1]}")
    res["regen_speed"] = rows


def stage_regen(args, res: dict) -> None:
    out = data_file(args, "large")
    log = os.path.join(args.out, "regen.log")
    rc, s = run(regen_cmd(args, out, args.rows, args.new_tokens, args.regen_batch, args.regen_procs), log, 3600)
    res["regen"] = {"rc": rc, "seconds": round(s, 1), "rows": args.rows, "procs": args.regen_procs,
                    "max_new_tokens": args.new_tokens, "batch": args.regen_batch}
    if Stop.requested:
        return  # its part files keep the rows written: a rerun resumes from them
    if rc:
        raise SystemExit(f"dflash-regenerate failed ({rc}): {log}")
    with open(out, encoding="utf-8") as f:
        lines = f.readlines()
    with open(data_file(args, "small"), "w", encoding="utf-8") as f:
        f.writelines(lines[:args.small_rows])
    res["regen"].update(rows_written=len(lines), small_rows=min(len(lines), args.small_rows),
                        summary=[x.strip() for x in open(log) if "wrote " in x or "new tokens in" in x])
    say(f"regenerated {len(lines)} rows in {s:.0f} s")


def train_overrides(args, label: str) -> list:
    size, extra = RUNS[label]
    return ["target=hf", f"target.name_or_path={model_dir(args)}", "data=jsonl", "train=paper",
            f"data.source={data_file(args, size)}", f"data.holdout={args.eval_prompts}",
            f"target.max_batch_tokens={args.batch_tokens}", f"train.max_steps={args.steps}",
            # one in-training evaluation, at the end: on this target one takes minutes (see docs/benchmarks.md)
            f"train.eval_prompts={args.eval_prompts}", "train.eval_every=0", f"train.eval_batch_size={args.eval_batch}",
            "logging.wandb.mode=disabled",
            "logging.progress_bar=false",
            f"logging.log_every={args.log_every}", f"train.output_dir={os.path.join(args.work, 'runs', label)}",
            # a rerun continues a run that was cut (time box, SIGTERM) or failed, instead of being refused
            "train.resume=auto"] + extra + args.extra


def stage_train(args, res: dict) -> None:
    jobs = [(PY + ["dflash_dist.cli.train", "--nproc-per-node", "1"] + train_overrides(args, label),
             os.path.join(args.out, f"train-{label}.log"), args.train_timeout) for label in args.runs]
    t0 = time.monotonic()
    out, retry = parallel_then_alone(jobs, args.parallel)
    res["train_wall_s"] = round(time.monotonic() - t0, 1)
    res.setdefault("runs", {})
    for i, (label, (rc, s)) in enumerate(zip(args.runs, out)):
        # what the run's own records say, so the table is right before the report stage runs
        train = train_records(read_metrics(os.path.join(args.work, "runs", label)))
        res["runs"][label] = {"train_rc": rc, "train_s": round(s, 1), "retried_alone": i in retry,
                              "data_rows": count_rows(data_file(args, RUNS[label][0])),
                              "command": "dflash-train " + " ".join(train_overrides(args, label)),
                              **train_summary(train)}
        say(f"trained {label}: rc {rc} in {s:.0f} s" if rc is not None else f"{label}: not started (stopped)")


def count_rows(path: str) -> int | None:
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        return sum(1 for line in f if line.strip())


def parallel_then_alone(jobs: list, n: int) -> tuple[list, list]:
    """:func:`parallel`, then each job that ran out of device memory (beside the others) again alone: with
    ``train.resume=auto`` it continues from its checkpoint. Returns ([(rc, seconds)], indices run again); the
    first attempt's log is kept as ``<log>.oom``."""
    out = parallel(jobs, n)
    retry = [i for i, (rc, _) in enumerate(out)
             if rc not in (None, 0, 124) and not Stop.requested and out_of_memory(jobs[i][1])]
    for i in retry:
        cmd, log, timeout = jobs[i]
        say(f"{os.path.basename(log)}: out of device memory beside other jobs; running it again alone")
        os.replace(log, log + ".oom")
        rc, s = run(cmd, log, timeout)
        out[i] = (rc, out[i][1] + s)
    return out, retry


def out_of_memory(log: str) -> bool:
    with open(log, errors="replace") as f:
        return any("OutOfMemoryError" in line or "CUDA out of memory" in line for line in f)


def last_checkpoint(run_dir: str) -> str | None:
    cks = sorted(glob.glob(os.path.join(run_dir, "checkpoints", "step_*")))
    return cks[-1] if cks else None


def read_metrics(run_dir: str) -> list:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    out = []
    for line in open(path, encoding="utf-8", errors="replace"):
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def eval_jobs(args, label: str, export: str) -> list:
    """(key, command, log) of a run's evaluations."""
    jobs = []
    for name, rel in SETS.items():
        cmd = PY + ["dflash_dist.cli.eval", "--export", export, "--prompts", os.path.join(args.real, rel),
                    "--num-prompts", str(args.eval_prompts), "--out", os.path.join(args.work, "evals",
                                                                                  f"{label}-{name}.json")]
        if label not in args.lossless:
            cmd.append("--no-lossless-check")
        jobs.append((name, cmd + ["--batch-size", str(args.eval_batch)]))
    return jobs


def own_holdout_job(args, label: str) -> tuple | None:
    """The run's last in-training evaluation that has a checkpoint of its step: (step, checkpoint) for
    ``dflash-eval --export`` of that checkpoint on the same held-out prompts (the two must agree)."""
    run_dir = os.path.join(args.work, "runs", label)
    for rec in reversed([x for x in read_metrics(run_dir) if x.get("kind") == "eval"]):
        ck = os.path.join(run_dir, "checkpoints", f"step_{rec['step']:08d}")
        if os.path.isdir(ck):
            return rec["step"], ck
    return None


def fp8_jobs(args, label: str, export: str) -> list:
    jobs = []
    if label in args.on_fp8:  # the bf16-trained drafter against the FP8 target
        for name, rel in SETS.items():
            jobs.append((f"{name}_on_fp8", PY + [
                "dflash_dist.cli.eval", "--export", export, "--prompts", os.path.join(args.real, rel),
                "--num-prompts", str(args.eval_prompts), "--target-quantization", "fp8", "--no-lossless-check",
                "--batch-size", str(args.eval_batch),
                "--out", os.path.join(args.work, "evals", f"{label}-{name}_on_fp8.json")]))
    return jobs


def stage_eval(args, res: dict) -> None:
    os.makedirs(os.path.join(args.work, "evals"), exist_ok=True)
    res.setdefault("runs", {})
    exports = {}  # key -> (label, checkpoint, export directory)
    for label in args.runs:
        ck = last_checkpoint(os.path.join(args.work, "runs", label))
        res["runs"].setdefault(label, {})["checkpoint"] = ck
        if ck is not None:
            exports[label] = (label, ck, os.path.join(args.work, "exports", label))
        own = own_holdout_job(args, label)
        if own is not None:
            res["runs"][label]["own_holdout_step"] = own[0]
            exports[label + "@eval"] = (label, own[1], os.path.join(args.work, "exports", f"{label}-step{own[0]}"))
    done = parallel([(PY + ["dflash_dist.cli.export", ck, export, "--overwrite"],
                      os.path.join(args.out, f"export-{key}.log"), 600) for key, (_, ck, export) in exports.items()],
                    args.eval_parallel)
    plan = []
    for (key, (label, ck, export)), (rc, _) in zip(exports.items(), done):
        if key.endswith("@eval"):
            size = RUNS[label][0]
            if rc == 0:
                plan.append((label, "own_holdout", PY + [
                    "dflash_dist.cli.eval", "--export", export, "--data", data_file(args, size), "--num-prompts",
                    str(args.eval_prompts), "--no-lossless-check", "--batch-size", str(args.eval_batch),
                    "--out", os.path.join(args.work, "evals", f"{label}-own_holdout.json")]))
            continue
        res["runs"][label]["export_rc"] = rc
        if rc == 0:
            plan.append((label, "doctor", PY + ["dflash_dist.cli.doctor", "--export", export,
                                                 "logging.wandb.mode=disabled"]))
            plan += [(label, k, cmd) for k, cmd in eval_jobs(args, label, export) + fp8_jobs(args, label, export)]
    t0 = time.monotonic()
    out = parallel([(cmd, os.path.join(args.out, f"eval-{label}-{key}.log"), args.eval_timeout)
                    for label, key, cmd in plan], args.eval_parallel)
    res["eval_wall_s"] = round(time.monotonic() - t0, 1)
    for (label, key, cmd), (rc, s) in zip(plan, out):
        if key == "doctor":
            res["runs"][label]["doctor_rc"] = rc
            continue
        path = cmd[cmd.index("--out") + 1]
        r = res["runs"][label].setdefault("evals", {})
        r[key] = {"rc": rc, "seconds": round(s, 1)}
        if rc == 0 and os.path.exists(path):
            e = json.load(open(path))
            r[key].update({k: e.get(k) for k in ("acceptance_length", "tau", "tau_stderr", "tau_all_prompts",
                                                 "prompts_scored", "prompts_one_step", "lossless_fraction",
                                                 "per_position_acceptance", "quantization")})
        say(f"eval {label} {key}: rc {rc} {r[key].get('acceptance_length')}")


def train_records(recs: list) -> list:
    return [x for x in recs if x.get("kind") == "train"]


def train_summary(train: list) -> dict:
    """From a run's training records: its last step, the last window's training accuracy (of the proposals the
    variant serves where it logs them: DFlash2's selector, Domino's corrected logits) and the median samples/s of
    the second half of its windows (past compilation)."""
    if not train:
        return {"steps": None, "train_acc": None, "samples_per_s": None}
    late = sorted(x["samples_per_s"] for x in train[len(train) // 2:])
    return {"steps": train[-1]["step"], "train_acc": train[-1].get("served_acc", train[-1].get("acc")),
            "samples_per_s": late[len(late) // 2]}


def stage_report(args, res: dict) -> None:
    for label in args.runs:
        run_dir = os.path.join(args.work, "runs", label)
        r = res.setdefault("runs", {}).setdefault(label, {})
        rc, _ = run(PY + ["dflash_dist.cli.report", run_dir, "--out", os.path.join(args.out, "report", label)],
                    os.path.join(args.out, f"report-{label}.log"), 300)
        recs = read_metrics(run_dir)
        train = train_records(recs)
        evals = [x for x in recs if x.get("kind") == "eval"]
        r.update(report_rc=rc, **train_summary(train))
        step = r.get("own_holdout_step")
        evals = [x for x in evals if x.get("step") == step] or evals
        if evals:
            e = evals[-1]
            r["in_training_eval"] = {k: e.get(k) for k in ("step", "acceptance_length", "tau", "train_serve_gap",
                                                          "tau_from_train_acc", "train_acc")}


# ----------------------------------------------------------------------------------------------- the table

def fmt(x, p=2) -> str:
    return "-" if x is None else f"{x:.{p}f}"


def table(res: dict) -> str:
    head = ("| run | data rows | steps | HumanEval AL / tau | MT-Bench AL / tau | ShareGPT holdout AL / tau | "
            "accept pos 1-4 (MT-Bench) | train acc | in-training AL (own holdout) | dflash-eval AL (same prompts) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    rows = res.get("regen", {})
    for label, r in res.get("runs", {}).items():
        ev = r.get("evals", {})

        def cell(k):
            e = ev.get(k) or {}
            return f"{fmt(e.get('acceptance_length'))} / {fmt(e.get('tau'))}"
        pos = (ev.get("mtbench") or {}).get("per_position_acceptance") or []
        it = r.get("in_training_eval") or {}
        size = RUNS.get(label, ("?",))[0]
        n = r.get("data_rows") or (rows.get("small_rows") if size == "small" else rows.get("rows_written"))
        steps = "not trained" if r.get("steps") is None else r["steps"]
        n = "-" if n is None else n
        lines.append(f"| {label} | {n} | {steps} | {cell('humaneval')} | {cell('mtbench')} | "
                     f"{cell('holdout')} | {' '.join(fmt(x) for x in pos[:4])} | {fmt(r.get('train_acc'), 3)} | "
                     f"{fmt(it.get('acceptance_length'), 4)} | "
                     f"{fmt((ev.get('own_holdout') or {}).get('acceptance_length'), 4)} |")
    fp8 = (res.get("runs", {}).get("dflash") or {}).get("evals", {})
    if any(k.endswith("_on_fp8") for k in fp8):
        lines.append("")
        lines.append("bf16-target DFlash drafter against the FP8 target: " + ", ".join(
            f"{k[:-7]} {fmt((fp8[k] or {}).get('acceptance_length'))}" for k in fp8 if k.endswith("_on_fp8")))
    return "\n".join(lines)


def environment() -> dict:
    import torch
    import transformers
    env = {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
           "date": time.strftime("%Y-%m-%d")}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
    return env


DEVICE_STAGES = ("speed", "regen", "train", "eval")


def record_environment(res: dict, stage: str, env: dict) -> None:
    """Each stage's machine, and as ``environment`` the one its figures were measured on: a stage rerun elsewhere
    (the report's plots on a laptop) must not relabel a GPU run's results."""
    res.setdefault("stage_environment", {})[stage] = env
    if stage in DEVICE_STAGES or "environment" not in res:
        res["environment"] = env


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/real_model"), help="logs, table, reports")
    ap.add_argument("--work", default="/tmp/real_model_work", help="data, runs, exports (large)")
    ap.add_argument("--real", default=os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                                                   "dflash_dist", "real"), help="dflash-fetch-real's directory")
    ap.add_argument("--stages", default="fetch,speed,regen,train,eval,report")
    ap.add_argument("--runs", default=",".join(RUNS), help="comma separated labels of RUNS")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--rows", type=int, default=8000, help="training prompts regenerated (the large data set)")
    ap.add_argument("--small-rows", type=int, default=2000, help="the small data set: its first rows")
    ap.add_argument("--new-tokens", type=int, default=512)
    ap.add_argument("--regen-batch", type=int, default=256)
    ap.add_argument("--regen-procs", type=int, default=4)
    ap.add_argument("--speed-new-tokens", type=int, default=256)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch-tokens", type=int, default=4096, help="target.max_batch_tokens (tokens per step)")
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--eval-prompts", type=int, default=64)
    ap.add_argument("--lossless", default="dflash", help="runs whose evaluations check losslessness")
    ap.add_argument("--on-fp8", default="dflash", help="runs whose drafter is also evaluated against the FP8 target")
    ap.add_argument("--extra", default="", help="overrides added to every run (space separated)")
    # colocated jobs on this target held 10-35 GiB each of an 80 GB H100 (8, 5, and 3 with Domino, at once ran out)
    ap.add_argument("--parallel", type=int, default=2, help="training jobs at a time (sharing the device)")
    ap.add_argument("--eval-parallel", type=int, default=6)
    ap.add_argument("--eval-batch", type=int, default=1, help="prompts decoded together by every evaluation: "
                    "dflash-eval --batch-size and the runs' train.eval_batch_size")
    ap.add_argument("--train-timeout", type=float, default=3600)
    ap.add_argument("--eval-timeout", type=float, default=1800)
    args = ap.parse_args()
    args.runs = [x for x in args.runs.split(",") if x]
    args.extra = args.extra.split()
    args.lossless = set(x for x in args.lossless.split(",") if x)
    args.on_fp8 = set(x for x in args.on_fp8.split(",") if x)
    unknown = [x for x in args.runs if x not in RUNS]
    if unknown:
        ap.error(f"--runs: unknown {unknown}; known: {list(RUNS)}")
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.work, exist_ok=True)
    path = os.path.join(args.out, "real_model.json")
    res = json.load(open(path)) if os.path.exists(path) else {}
    env = environment()
    signal.signal(signal.SIGTERM, Stop.on_signal)
    stages = [s for s in args.stages.split(",") if s]
    for k, stage in enumerate(stages):
        if Stop.requested:
            say(f"stopped by SIGTERM: stages not run: {', '.join(stages[k:])}")
            break
        t0 = time.monotonic()
        say(f"stage {stage}")
        {"fetch": stage_fetch, "speed": stage_speed, "regen": stage_regen, "train": stage_train,
         "eval": stage_eval, "report": stage_report}[stage](args, res)
        record_environment(res, stage, env)
        res.setdefault("stage_seconds", {})[stage] = round(time.monotonic() - t0, 1)
        with open(path, "w") as f:
            json.dump(res, f, indent=1, default=str)
    with open(os.path.join(args.out, "real_model.md"), "w") as f:
        f.write(table(res) + "\n")
    print(table(res))
    return 143 if Stop.requested else 0


if __name__ == "__main__":
    sys.exit(main())
