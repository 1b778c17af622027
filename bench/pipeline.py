#!/usr/bin/env python3
"""Pipeline efficiency: samples/s of the real 1 target + 1 drafter job vs the drafter alone on the same messages.

(a) drafter alone (a subprocess, so its GPU memory is gone before (b)): the real ``DrafterTrainer`` (DDP over a
    world-size-1 group, compile guard, make_batch, flex, decayed CE, AdamW) on cuda:0, fed in-process messages
    of exactly the sizes the transport delivers (same Hydra config, same synthetic dataset and batching plan,
    features [tokens, 5*H] random bf16). Per-step bookkeeping as ``run_drafter`` (stop vote, read_window).
(b) the real job: ``torchrun --standalone --nproc-per-node 2 -m dflash_dist.train <the same overrides>``; samples/s
    read from its metrics.jsonl after the warm-up steps (windows weighted by duration). The run is stopped once
    the last training window is logged (its final checkpoint is not waited for).

ratio = (b) / (num_drafters x (a)); the goal is >= 0.97: the transport and the target hide behind the drafter.

    python bench/pipeline.py --out pipeline.json                  # 2 GPUs: qwen3_8b_random target, dflash drafter
    python bench/pipeline.py --tiny --out /tmp/pipe.json          # CPU smoke (gloo, tiny target and drafter)

Defaults keep a step inside one GPU: 550-token samples (275..825), at most 4 samples per message
(target.max_batch_samples=4, target.max_batch_tokens=4096) and the dflash drafter's 512 anchors per sample, i.e.
<= 4 x 8192 query rows per step. Any other Hydra override: --override key=value (repeatable).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402
import _standalone as S  # noqa: E402
import torch  # noqa: E402

from dflash_dist.telemetry.step_trace import format_timeline, traced_step  # noqa: E402


def add_job_args(p: argparse.ArgumentParser) -> None:
    """Options that define the job (shared with bench/experiments/threaded_baseline.py)."""
    p.add_argument("--tiny", action="store_true", help="CPU smoke: tiny target, tiny drafter, gloo")
    p.add_argument("--out", default=None)
    p.add_argument("--target", default=None, help="conf/target group (default qwen3_8b_random; tiny: tiny)")
    p.add_argument("--drafter", default=None, help="conf/drafter group (default dflash; tiny: tiny)")
    p.add_argument("--mean-len", type=int, default=None, help="synthetic mean sample length (550; tiny 48)")
    p.add_argument("--num-samples", type=int, default=0, help="synthetic samples (0: enough for --steps)")
    p.add_argument("--max-batch-tokens", type=int, default=None, help="target.max_batch_tokens (4096; tiny 256)")
    p.add_argument("--max-batch-samples", type=int, default=4, help="target.max_batch_samples")
    p.add_argument("--steps", type=int, default=None, help="train.max_steps (40; tiny 6)")
    p.add_argument("--warmup-steps", type=int, default=None, help="steps left out of the rate (10; tiny 2)")
    p.add_argument("--log-every", type=int, default=None, help="logging.log_every (5; tiny 2)")
    p.add_argument("--nproc", type=int, default=2, help="processes of the real job")
    p.add_argument("--target-ranks", type=int, default=1)
    p.add_argument("--override", action="append", default=[], help="extra Hydra override key=value (repeatable)")
    p.add_argument("--workdir", default=None, help="run directories and logs (default: a new temp dir)")


def finish_job_args(args, p: argparse.ArgumentParser):
    t = args.tiny
    args.mean_len = args.mean_len or (48 if t else 550)
    args.max_batch_tokens = args.max_batch_tokens or (256 if t else 4096)
    args.steps = args.steps or (6 if t else 40)
    args.warmup_steps = args.warmup_steps if args.warmup_steps is not None else (2 if t else 10)
    args.log_every = args.log_every or (2 if t else 5)
    if args.warmup_steps % args.log_every:
        p.error("--warmup-steps must be a multiple of --log-every (rates are read per logging window)")
    if args.steps <= args.warmup_steps:
        p.error("--steps must exceed --warmup-steps")
    drafters = args.nproc - args.target_ranks
    if not args.num_samples:
        args.num_samples = args.steps * drafters * args.max_batch_samples + 64
    if args.workdir is None:
        args.workdir = tempfile.mkdtemp(prefix="dflash_bench_")
    os.makedirs(args.workdir, exist_ok=True)
    return args


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_job_args(p)
    p.add_argument("--alone-timeout", type=float, default=300, help="seconds for (a)")
    p.add_argument("--e2e-timeout", type=float, default=420, help="seconds for (b), start-up included")
    p.add_argument("--grace-s", type=float, default=3.0, help="wait after the last window before stopping (b)")
    p.add_argument("--skip-alone", action="store_true")
    p.add_argument("--profile-step", type=int, default=-1, help="(a): profile this step, print the top kernels")
    p.add_argument("--skip-e2e", action="store_true")
    p.add_argument("--goal", type=float, default=0.97)
    p.add_argument("--_alone", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--alone-out", default=None, help=argparse.SUPPRESS)
    return finish_job_args(p.parse_args(argv), p)


def overrides(args, output_dir: str) -> list[str]:
    extra = [f"topology.target_ranks={args.target_ranks}"] + list(args.override)
    return S.job_overrides(args.tiny, args.target, args.drafter, args.mean_len, args.num_samples,
                           args.max_batch_tokens, args.max_batch_samples, args.steps, args.log_every, output_dir,
                           extra)


# ---------------------------------------------------------------------------------------------- (a)

def drafter_alone(args) -> int:
    from dflash_dist.config import resolve_device
    run_dir = os.path.join(args.workdir, "alone_run")
    ov = overrides(args, run_dir)
    cfg = S.compose_job_config(ov)
    dev_type = resolve_device(cfg)
    dev = torch.device("cuda", 0) if dev_type == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    out = {"bench": "pipeline/drafter_alone", "env": C.env_info(dev), "overrides": ov}
    t0 = time.time()
    S.init_single_process_group(dev)
    job, ds = S.make_job(cfg, args.nproc, dev, run_dir)
    trainer = S.make_trainer(job)
    out.update({"backend": trainer.backend, "setup_s": time.time() - t0, "total_messages": job.total_messages,
                "num_drafters": job.dist.topo.num_drafters,
                "trainable_params": sum(p.numel() for p in trainer.model.parameters())})
    mine = S.my_messages(job)
    toks = [S.message_tokens(job, ds, j) for j in mine]
    dtype = trainer.lm_head.dtype
    g = torch.Generator(device=dev).manual_seed(0)
    pool = torch.randn(max(toks), trainer.feature_width, generator=g, device=dev, dtype=dtype)
    msgs = [S.make_message(job, ds, j, dev, pool[:t]) for j, t in zip(mine, toks)]
    out["samples_per_message"] = sum(m.num_samples for m in msgs) / max(len(msgs), 1)
    out["tokens_per_message"] = sum(toks) / max(len(toks), 1)
    C.log(f"drafter alone: {len(msgs)} messages, {out['samples_per_message']:.2f} samples and "
          f"{out['tokens_per_message']:.0f} tokens per message, backend {trainer.backend}, device {dev}")
    topo = job.dist.topo
    steps = topo.num_steps(job.total_messages - job.start_cursor)
    out["precompile_s"] = trainer.precompile()  # as the trainer does before its first message
    meter = S.WindowMeter(trainer, cfg.logging.log_every, dev)
    C.reset_peak(dev)
    for s in range(steps):
        t1 = time.monotonic()
        j = s * topo.num_drafters + topo.index
        msg = msgs[s] if s < len(msgs) else None
        batch = trainer.build(msg, job.start_cursor + j)
        if s == args.profile_step:
            trace = os.path.join(args.workdir, f"alone_trace_step{s}.json")
            out["profile_top"], out["timeline"] = profiled(lambda: trainer.train_step(batch), dev, trace)
            C.log("step %d, top CUDA kernels by time:\n%s" % (s, "\n".join(
                f"  {k['ms']:9.2f} ms  x{k['calls']:<4d} {k['name']}" for k in out["profile_top"])))
            C.log(format_timeline(out["timeline"], f"step {s} (trace {trace})"))
        else:
            trainer.train_step(batch)
        if s == 0:
            C.sync(dev)
            out["first_step_s"] = time.monotonic() - t1
            C.log(f"first step (compile included) {out['first_step_s']:.1f} s")
        trainer.step += 1
        trainer.cursor = min(job.start_cursor + (s + 1) * topo.num_drafters, job.total_messages)
        meter.after_step(trainer.step, msg.num_samples if msg else 0, msg.num_tokens if msg else 0,
                         s == steps - 1, time.monotonic() - t1)
        if meter.windows and meter.windows[-1]["step"] == trainer.step:
            w = meter.windows[-1]
            C.log(f"step {trainer.step}: {w['samples_per_s']:.2f} samples/s (window), loss {w['loss']:.3f}")
            out.update({"windows": meter.windows, "rate": meter.rate_after(args.warmup_steps),
                        "steps_done": trainer.step, "peak_mem_gb": C.mem_gb(dev)["peak_gb"]})
            C.write_json(args.alone_out, out)
    out["wall_s"] = time.time() - t0
    if trainer.guard is not None:
        out["compile_guard"] = trainer.guard.summary()
    C.write_json(args.alone_out, out)
    return 0


def profiled(step_fn, dev, trace_path: str, top: int = 15) -> tuple[list, dict]:
    """Run one step under torch.profiler, its Chrome trace written to ``trace_path``: the ``top`` kernels (CUDA;
    CPU ops on CPU) by total device time, and the step's phase timeline (dflash_dist.telemetry.step_trace)."""
    tl, prof = traced_step(step_fn, trace_path, dev)
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", 0) if dev.type == "cuda" else e.self_cpu_time_total
        if t > 0 and (dev.type != "cuda" or getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA):
            rows.append({"name": e.key[:120], "ms": t / 1e3, "calls": int(e.count)})
    rows.sort(key=lambda r: -r["ms"])
    total = sum(r["ms"] for r in rows)
    return [{"name": "TOTAL", "ms": total, "calls": sum(r["calls"] for r in rows)}] + rows[:top], tl


# ---------------------------------------------------------------------------------------------- (b)

class Interrupted(Exception):
    """SIGTERM/SIGINT to this script (e.g. the outer `timeout`): stop the children, keep what was measured."""


INTERRUPTED: list = []


def _on_signal(signum, frame):
    INTERRUPTED.append(signal.Signals(signum).name)
    raise Interrupted(signal.Signals(signum).name)


def _kill_group(proc: subprocess.Popen) -> None:
    """Stop a child we started in its own session (and everything it started): SIGTERM, then SIGKILL."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=5)
    except (subprocess.TimeoutExpired, ProcessLookupError):
        pass
    try:  # always: ranks stuck in NCCL outlive their torchrun agent and spin on the GPUs (seen on 2x H200)
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


def supervise(cmd: list, log_path: str, timeout_s: float, env: dict, done=None, grace_s: float = 0.0):
    """Run cmd in its own session with output to log_path; stop it on timeout, on a signal to this script, or
    grace_s after done() first returns True. Returns (returncode, why it was stopped or None, wall seconds)."""
    t0 = time.time()
    stopped = None
    with open(log_path, "w") as logf:
        proc = subprocess.Popen(cmd, cwd=C.REPO, env=env, stdout=logf, stderr=subprocess.STDOUT,
                                start_new_session=True)
        done_at = None
        try:
            while proc.poll() is None:
                time.sleep(0.5)
                if done is not None and done_at is None and done():
                    done_at = time.time()
                if done_at is not None and time.time() - done_at > grace_s:
                    stopped = "after the last training window (final checkpoint not awaited)"
                    _kill_group(proc)
                elif time.time() - t0 > timeout_s:
                    stopped = f"timeout after {timeout_s:.0f} s"
                    _kill_group(proc)
        except Interrupted as e:
            stopped = f"{e} to bench/pipeline.py (outer time box)"
            _kill_group(proc)
    return proc.returncode, stopped, time.time() - t0


def _last_step(metrics_path: str) -> int:
    last = 0
    try:
        with open(metrics_path) as f:
            for line in f:
                if '"kind": "train"' in line:
                    try:
                        last = max(last, int(line.split('"step": ', 1)[1].split(",", 1)[0]))
                    except (IndexError, ValueError):
                        pass
    except OSError:
        pass
    return last


def run_e2e(args) -> dict:
    run_dir = os.path.join(args.workdir, "e2e_run")
    shutil.rmtree(run_dir, ignore_errors=True)
    ov = overrides(args, run_dir)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc),
           "-m", "dflash_dist.train"] + ov
    env = dict(os.environ, PYTHONUNBUFFERED="1", WANDB_MODE="disabled",
               PYTHONPATH=C.REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    log_path = os.path.join(args.workdir, "e2e.log")
    metrics = os.path.join(run_dir, "metrics.jsonl")
    C.log("e2e: " + " ".join(cmd[1:]))
    rc, stopped, wall = supervise(cmd, log_path, args.e2e_timeout, env, done=lambda: _last_step(metrics) >= args.steps,
                                  grace_s=args.grace_s)
    with open(log_path) as f:
        log_text = f.read()
    res = {"command": " ".join(cmd[1:]), "overrides": ov, "returncode": rc, "stopped": stopped, "wall_s": wall,
           "log_tail": log_text[-4000:], "log": log_path}
    res.update(S.parse_metrics(metrics, args.warmup_steps))
    rep = os.path.join(run_dir, "startup_report.json")
    if os.path.exists(rep):
        import json
        with open(rep) as f:
            res["startup_report"] = json.load(f)
    ok_rc = rc == 0 or (stopped or "").startswith("after the last")
    if not ok_rc:
        res["error"] = f"exit code {rc}" + (f" ({stopped})" if stopped else "")
    for line in log_text.splitlines():
        if "attention backend=" in line or "target loaded" in line or "target fast path" in line:
            res.setdefault("log_lines", []).append(line.strip()[:300])
    if not ok_rc:  # the ranks' own errors (torchrun's summary at the end of the log does not say what failed)
        errs = [ln.strip()[:400] for ln in log_text.splitlines() if ("Error" in ln or "ERROR" in ln)
                and "torch/distributed/elastic" not in ln and "ChildFailedError" not in ln]
        res["error_lines"] = errs[:20]
    return res


# ---------------------------------------------------------------------------------------------- main

def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args._alone:
        return drafter_alone(args)
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    t_start = time.time()
    result = {"bench": "pipeline", "tiny": args.tiny, "nproc": args.nproc, "target_ranks": args.target_ranks,
              "num_drafters": args.nproc - args.target_ranks, "steps": args.steps,
              "warmup_steps": args.warmup_steps, "log_every": args.log_every, "goal": args.goal,
              "overrides": overrides(args, "<run_dir>"), "workdir": args.workdir}
    dev = C.pick_device("auto")
    result["env"] = C.env_info(dev)
    if not args.skip_alone:
        alone_json = os.path.join(args.workdir, "alone.json")
        cmd = [sys.executable, os.path.abspath(__file__)] + argv + ["--_alone", "--alone-out", alone_json,
                                                                    "--workdir", args.workdir]
        C.log("(a) drafter alone: " + " ".join(cmd[1:]))
        # torchrun gives each worker OMP_NUM_THREADS=1 (unless set): the drafter alone runs with the same
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONUNBUFFERED="1")
        log_path = os.path.join(args.workdir, "alone.log")
        rc, stopped, wall = supervise(cmd, log_path, args.alone_timeout, env)
        with open(log_path) as f:
            text = f.read()
        print(text[-3000:], flush=True)
        alone = {"returncode": rc, "stopped": stopped, "wall_s": wall, "log_tail": text[-3000:], "log": log_path}
        if os.path.exists(alone_json):
            import json
            with open(alone_json) as f:
                alone.update(json.load(f))
        if rc != 0:
            alone["error"] = f"exit {rc}" + (f" ({stopped})" if stopped else "")
        result["alone"] = alone
        C.write_json(args.out, result)
    if INTERRUPTED:
        result["interrupted"] = INTERRUPTED[0]
    elif not args.skip_e2e:
        C.log("(b) real job under torchrun")
        result["e2e"] = run_e2e(args)
        C.write_json(args.out, result)
    a = (result.get("alone") or {}).get("rate", {}).get("samples_per_s")
    e = (result.get("e2e") or {}).get("samples_per_s")
    nd = result["num_drafters"]
    result["alone_samples_per_s"] = a
    result["e2e_samples_per_s"] = e
    result["ratio"] = e / (nd * a) if a and e else None
    result["goal_met"] = result["ratio"] >= args.goal if result["ratio"] is not None else None
    result["wall_s"] = time.time() - t_start
    if INTERRUPTED:
        result["interrupted"] = INTERRUPTED[0]
    rows = [{"what": "(a) drafter alone, synthetic features", "samples_per_s": a,
             "tokens_per_s": (result.get("alone") or {}).get("rate", {}).get("tokens_per_s"),
             "steps": (result.get("alone") or {}).get("rate", {}).get("steps_measured"),
             "error": (result.get("alone") or {}).get("error")},
            {"what": f"(b) real job, {args.target_ranks} target + {nd} drafter", "samples_per_s": e,
             "tokens_per_s": (result.get("e2e") or {}).get("tokens_per_s"),
             "steps": None if not result.get("e2e") or result["e2e"].get("to_step") is None
             else result["e2e"]["to_step"] - result["e2e"]["from_step"],
             "error": (result.get("e2e") or {}).get("error")},
            {"what": f"ratio (b) / ({nd} x (a)), goal >= {args.goal}", "samples_per_s": result["ratio"],
             "error": None if result["goal_met"] is None else ("met" if result["goal_met"] else "NOT met")}]
    print()
    print(C.table(rows, [("what", "measurement"), ("samples_per_s", "samples/s (or ratio)"),
                         ("tokens_per_s", "tokens/s"), ("steps", "steps measured"), ("error", "note")],
                  title=f"pipeline ({'tiny, CPU' if args.tiny else 'GPU'}; steps {args.warmup_steps}..{args.steps})"))
    C.write_json(args.out, result)
    return 0 if result["ratio"] is not None or (args.skip_alone or args.skip_e2e) else 1


if __name__ == "__main__":
    sys.exit(main())
