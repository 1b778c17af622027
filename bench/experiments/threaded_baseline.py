#!/usr/bin/env python3
"""The design dflash_dist replaces: ONE process, two Python threads, a queue.Queue between them.

Thread 1 runs the frozen target on cuda:0 (``build_target_model`` + ``FeatureCapture``, the same batches of the
same plan) and puts each message's features, copied to cuda:1, into a bounded ``queue.Queue``
(``topology.max_in_flight``). Thread 2 trains the drafter on cuda:1 with the real ``DrafterTrainer``
(torch.compile'd flex_attention, compiled and run inside the thread) -- the same models, config and messages as
``bench/pipeline.py`` (1 target + 1 drafter). Reported: samples/s after the warm-up steps (same windows as the
pipeline), the target's busy share, the drafter's queue wait, and every exception either thread raised (compile
errors such as the FX-tracing / dynamo races of compiling in one thread while another runs PyTorch code are
caught, classified and recorded, not fatal to the report). ``--compare pipeline.json`` adds the ratio to the
multi-process pipeline measured by bench/pipeline.py.

    python bench/experiments/threaded_baseline.py --out threaded.json --compare pipeline.json       # 2 GPUs
    python bench/experiments/threaded_baseline.py --tiny --out /tmp/thr.json                         # CPU smoke (sdpa)

On CPU both threads share the CPU and the drafter uses sdpa (flex_attention has no CPU backward): the smoke run
proves the harness, not the GPU behaviour.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import sys
import threading
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: _common
import _common as C  # noqa: E402
import _standalone as S  # noqa: E402
import torch  # noqa: E402
from pipeline import add_job_args, finish_job_args, overrides  # noqa: E402

# Imported here, in the main thread: a first import inside a thread races the other thread's import of
# torch._dynamo (importlib's module lock reports a deadlock).
from dflash_dist.comm.transport import Message  # noqa: E402
from dflash_dist.targets.fast_path import check_target_fast_path  # noqa: E402
from dflash_dist.roles.target_rank.batch import pad_batch  # noqa: E402
from dflash_dist.roles.target_rank.capture import build_capture  # noqa: E402

COMPILE_MARKERS = ("torch._dynamo", "torch._inductor", "torch/_dynamo", "torch/_inductor", "torch.fx", "torch/fx",
                   "FX", "symbolic_trace", "is_fx_tracing", "compile", "Dynamo", "Inductor", "BackendCompilerFailed")


def classify(tb: str) -> str:
    return "compile" if any(m in tb for m in COMPILE_MARKERS) else "other"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_job_args(p)
    p.add_argument("--compare", default=None, help="pipeline.json from bench/pipeline.py")
    p.add_argument("--timeout", type=float, default=400, help="give up (and report) after this many seconds")
    args = finish_job_args(p.parse_args(argv), p)
    t_start = time.time()
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        dev_t, dev_d = torch.device("cuda", 0), torch.device("cuda", 1 if n > 1 else 0)
    else:
        dev_t = dev_d = torch.device("cpu")
    run_dir = os.path.join(args.workdir, "threaded_run")
    ov = overrides(args, run_dir)
    cfg = S.compose_job_config(ov)
    if dev_d.type == "cuda":
        torch.cuda.set_device(dev_d)
    S.init_single_process_group(dev_d)
    job, ds = S.make_job(cfg, args.nproc, dev_d, run_dir)
    topo = job.dist.topo
    result = {"bench": "threaded_baseline", "tiny": args.tiny, "env": C.env_info(dev_d), "overrides": ov,
              "target_device": str(dev_t), "drafter_device": str(dev_d), "total_messages": job.total_messages,
              "steps": args.steps, "warmup_steps": args.warmup_steps, "log_every": args.log_every,
              "threads": "target thread -> queue.Queue(max_in_flight) -> drafter thread", "errors": []}
    if topo.num_drafters != 1:
        result["note"] = f"the threaded design has one drafter; trained drafter 0's {topo.num_drafters}-way share"
    mine = S.my_messages(job)
    steps = topo.num_steps(job.total_messages - job.start_cursor)
    q: queue.Queue = queue.Queue(maxsize=cfg.topology.max_in_flight)
    stop = threading.Event()
    state: dict = {"target_busy_s": 0.0, "target_put_wait_s": 0.0, "drafter_get_wait_s": 0.0, "steps_done": 0,
                   # exposure to the other thread's compiles (bench/experiments/compile_race.py:
                   # torch.compiler.is_compiling() is process-wide, and eager code such as the optimizer takes
                   # compile-only branches under it): captures and optimizer steps that began while the flag was set
                   # by the other thread
                   "captures": 0, "captures_while_other_compiles": 0, "opt_steps": 0,
                   "opt_steps_while_other_compiles": 0}
    lock = threading.Lock()

    def record(where: str, e: BaseException) -> None:
        tb = traceback.format_exc()
        with lock:
            result["errors"].append({"thread": where, "error": C.short_error(e, 600), "kind": classify(tb),
                                     "traceback_tail": tb[-3000:]})
        C.log(f"{where} thread: {C.short_error(e)}")
        stop.set()

    def put(item) -> bool:
        t0 = time.monotonic()
        while not stop.is_set():
            try:
                q.put(item, timeout=0.5)
                state["target_put_wait_s"] += time.monotonic() - t0
                return True
            except queue.Full:
                continue
        return False

    def target_thread():
        try:
            if dev_t.type == "cuda":
                torch.cuda.set_device(dev_t)
            model, how, build_s = C.build_target_on_device(cfg.target, dev_t)
            state["target_build_s"], state["target_build"] = build_s, how
            # the kernels the target rank would bind, under the same policy (auto: required on CUDA)
            state["target_fast_path"] = check_target_fast_path(model, cfg.target.fast_path, dev_t.type)["summary"]
            # the target path of the real target rank (packing, compile, padding resolved the same way)
            capture = build_capture(cfg.target, model, job.layer_ids, dev_t.type)
            packed = capture.packing
            state["target_capture"] = capture.describe()
            t_first = None
            for j in mine:
                if stop.is_set():
                    break
                k = job.start_cursor + j
                samples = [ds[i] for i in job.plan[k]]
                t0 = time.monotonic()
                ids, lengths, packed_ids, packed_mask = pad_batch(samples, dev_t, packed)
                state["captures"] += 1
                state["captures_while_other_compiles"] += torch.compiler.is_compiling()  # eager here: not ours
                feats = capture(ids, lengths)
                C.sync(dev_t)
                state["target_busy_s"] += time.monotonic() - t0
                t_first = t_first or time.monotonic()
                msg = Message.build(k, torch.tensor(job.plan[k], dtype=torch.long, device=dev_d),
                                    Message.cu_of(lengths).to(dev_d), packed_ids.to(dev_d), packed_mask.to(dev_d),
                                    feats.to(dev_d), src=topo.target_for(j))
                if not put(msg):
                    break
            put(None)
            state["target_wall_s"] = time.monotonic() - (t_first or time.monotonic())
        except BaseException as e:  # noqa: BLE001 - recorded, then both threads stop
            record("target", e)

    def drafter_thread():
        try:
            if dev_d.type == "cuda":
                torch.cuda.set_device(dev_d)
            trainer = S.make_trainer(job)
            state["backend"] = trainer.backend
            state["precompile_s"] = trainer.precompile()  # as the trainer does before its first message
            opt_step = trainer.opt.step

            def counted_step(*a, **kw):  # the flag seen at the start of each step: a lower bound on exposure
                state["opt_steps"] += 1
                state["opt_steps_while_other_compiles"] += torch.compiler.is_compiling()
                return opt_step(*a, **kw)
            trainer.opt.step = counted_step
            meter = S.WindowMeter(trainer, cfg.logging.log_every, dev_d)
            state["meter"] = meter
            C.reset_peak(dev_d)
            for s in range(steps):
                t0 = time.monotonic()
                msg = None
                while not stop.is_set():
                    try:
                        msg = q.get(timeout=0.5)
                        break
                    except queue.Empty:
                        continue
                if stop.is_set() and msg is None:
                    break
                if msg is None:  # END
                    break
                state["drafter_get_wait_s"] += time.monotonic() - t0
                t1 = time.monotonic()
                batch = trainer.build(msg, msg.index)
                trainer.train_step(batch)
                if s == 0:
                    C.sync(dev_d)
                    state["first_step_s"] = time.monotonic() - t1
                trainer.step += 1
                trainer.cursor = min(job.start_cursor + (s + 1) * topo.num_drafters, job.total_messages)
                meter.after_step(trainer.step, msg.num_samples, msg.num_tokens, s == steps - 1,
                                 time.monotonic() - t1)
                state["steps_done"] = trainer.step
                if meter.windows and meter.windows[-1]["step"] == trainer.step:
                    w = meter.windows[-1]
                    C.log(f"step {trainer.step}: {w['samples_per_s']:.2f} samples/s (window), loss {w['loss']:.3f}")
            state["peak_mem_gb"] = C.mem_gb(dev_d)["peak_gb"]
            if trainer.guard is not None:
                state["compile_guard"] = trainer.guard.summary()
        except BaseException as e:  # noqa: BLE001
            record("drafter", e)
        finally:
            stop.set()  # the target thread may be blocked on a full queue after the last step

    threads = [threading.Thread(target=target_thread, name="target", daemon=True),
               threading.Thread(target=drafter_thread, name="drafter", daemon=True)]
    for t in threads:
        t.start()
    deadline = time.time() + args.timeout
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.time()))
    hung = [t.name for t in threads if t.is_alive()]
    meter = state.pop("meter", None)
    result.update({k: v for k, v in state.items()})
    result["hung_threads"] = hung
    if meter is not None:
        result["windows"] = meter.windows
        result["rate"] = meter.rate_after(args.warmup_steps)
    rate = (result.get("rate") or {}).get("samples_per_s")
    result["samples_per_s"] = rate
    result["compile_errors"] = [e for e in result["errors"] if e["kind"] == "compile"]
    result["hit_compile_error"] = bool(result["compile_errors"])
    tw = result.get("target_wall_s")
    if tw:
        result["target_busy_frac"] = result["target_busy_s"] / tw
    if args.compare and os.path.exists(args.compare):
        with open(args.compare) as f:
            pipe = json.load(f)
        result["compare"] = {"path": args.compare, "pipeline_e2e_samples_per_s": pipe.get("e2e_samples_per_s"),
                             "pipeline_alone_samples_per_s": pipe.get("alone_samples_per_s")}
        e2e = pipe.get("e2e_samples_per_s")
        result["compare"]["threaded_over_pipeline"] = rate / e2e if rate and e2e else None
        alone = pipe.get("alone_samples_per_s")
        result["compare"]["threaded_over_drafter_alone"] = rate / alone if rate and alone else None
    result["wall_s"] = time.time() - t_start
    rows = [{"what": "threaded (1 process, 2 threads)", "samples_per_s": rate,
             "note": ("; ".join(f"{e['thread']}: {e['error'][:120]}" for e in result["errors"]) or
                      ("hung: " + ",".join(hung) if hung else "ok"))}]
    cmp_ = result.get("compare") or {}
    if cmp_:
        rows.append({"what": "multi-process pipeline (bench/pipeline.py)",
                     "samples_per_s": cmp_.get("pipeline_e2e_samples_per_s")})
        rows.append({"what": "threaded / pipeline", "samples_per_s": cmp_.get("threaded_over_pipeline")})
    print()
    print(C.table(rows, [("what", "design"), ("samples_per_s", "samples/s (or ratio)"), ("note", "errors")],
                  title=f"threaded baseline (target {dev_t}, drafter {dev_d}, backend {state.get('backend')}; "
                        f"target kernels: {state.get('target_fast_path')}; "
                        f"compile errors: {'YES' if result['hit_compile_error'] else 'no'}; begun while the other "
                        f"thread compiled: {result['opt_steps_while_other_compiles']} of {result['opt_steps']} "
                        f"optimizer steps, {result['captures_while_other_compiles']} of {result['captures']} "
                        f"captures)"))
    C.write_json(args.out, result)
    if hung:
        C.log(f"threads still running after {args.timeout:.0f} s: {hung}; exiting hard")
        sys.stdout.flush()
        os._exit(3)
    return 0 if rate is not None or result["errors"] else 1


if __name__ == "__main__":
    rc = main()
    # The result is written and both threads have ended; the interpreter's own teardown can still abort
    # ("terminate called without an active exception", SIGABRT) on a native thread that torch started from one of
    # them (seen once in CI on a CPU run): leave without it, the exit status being the measurement's.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
