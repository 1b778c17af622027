"""The bench/ scripts run end to end at toy sizes on CPU (--tiny) and write the JSON they promise.

They are GPU benchmarks; here they only prove the harness: the real modules are built, a step runs, the tables
print and the numbers are positive. On CPU the drafter's flex rows are forward-only (no flex backward on CPU).
The scripts run as two concurrent chains (one process each at a time) to keep the module under a minute.
"""

import json
import os
import subprocess
import sys
import time

import pytest
from helpers.launch_util import REPO as REPO_ROOT

REPO = REPO_ROOT
BENCH = os.path.join(REPO, "bench")


def _cmd(script, *args):
    return [sys.executable, os.path.join(BENCH, script), *[str(a) for a in args]]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    p = {name: str(out / f"{name}.json") for name in
         ("drafter_step", "target_capture", "hybrid", "pipeline", "threaded", "plan_split")}
    chains = [
        [("pipeline", _cmd("pipeline.py", "--tiny", "--steps", 4, "--profile-step", 3, "--out", p["pipeline"],
                           "--workdir", out / "pw")),
         ("threaded", _cmd("experiments/threaded_baseline.py", "--tiny", "--steps", 4, "--out", p["threaded"],
                           "--workdir", out / "tw", "--compare", p["pipeline"]))],
        [("drafter_step", _cmd("drafter_step.py", "--tiny", "--configs", "40x8", "--repeats", 2, "--peak-n", 128,
                               "--backends", "flex,flex_layers,sdpa",
                               "--out", p["drafter_step"])),
         # padded and packed only: compiling the layers (packed_compiled) takes too long on a 2-core CPU
         ("target_capture", _cmd("target_capture.py", "--tiny", "--mixes", 64, "--budgets", 256, "--repeats", 1,
                                 "--warmup", 0, "--variants", "padded,packed", "--out", p["target_capture"])),
         ("hybrid", _cmd("target_capture.py", "--tiny", "--hybrid", "--mixes", 64, "--budgets", 256, "--repeats", 1,
                         "--warmup", 0, "--out", p["hybrid"])),
         ("plan_split", _cmd("plan_split.py", "--target-json", p["target_capture"], "--drafter-json",
                             p["drafter_step"], "--target-mix", 64, "--target-budget", 256, "--drafter-config", "40x8",
                             "--drafter-backend", "sdpa", "--gpus", 8, "--out", p["plan_split"], "--png",
                             out / "plan.png"))],
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", WANDB_MODE="disabled",
               TOKENIZERS_PARALLELISM="false")
    logs, rcs = {}, {}
    pending = [list(c) for c in chains]
    active = {}  # chain index -> (name, Popen, log file, start)
    deadline = time.time() + 300
    while any(pending) or active:
        for i, chain in enumerate(pending):
            if i not in active and chain:
                name, cmd = chain.pop(0)
                f = open(out / f"{name}.log", "w+")
                active[i] = (name, subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT), f)
        for i, (name, proc, f) in list(active.items()):
            if proc.poll() is not None or time.time() > deadline:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                f.seek(0)
                logs[name], rcs[name] = f.read(), proc.returncode
                f.close()
                del active[i]
        time.sleep(0.2)
    return {"paths": p, "logs": logs, "rcs": rcs, "out": out}


def _load(runs, name):
    assert runs["rcs"][name] == 0, runs["logs"][name][-3000:]
    with open(runs["paths"][name]) as f:
        return json.load(f)


def test_drafter_step(runs):
    d = _load(runs, "drafter_step")
    rows = {r["backend"]: r for r in d["rows"]}
    assert set(rows) == {"flex", "flex_layers", "sdpa"}
    assert rows["sdpa"]["mode"] == "train"
    assert rows["flex"]["mode"] == rows["flex_layers"]["mode"] == "forward-only"  # no flex backward on CPU
    for r in rows.values():
        assert "error" not in r, r
        assert r["ms_per_step"] > 0 and r["samples_per_s"] > 0 and r["first_step_s"] > 0
        f = r["flops"]
        assert f["model"] == pytest.approx(f["matmul"] + f["attention"] + f["lm_head"])
        assert 0 < f["attention"] < f["attention_if_dense"]     # visible pairs only
    assert rows["sdpa"]["flops"]["hardware"] == rows["sdpa"]["flops"]["model"]  # fused loss: no lm_head recompute
    # the step's memory plan next to the peak (a GPU measures the peak; the sdpa row plans its dense masks)
    assert 0 < rows["flex"]["planned_gb"] < rows["sdpa"]["planned_gb"] < 1
    assert d["peak_matmul"]["tflops"] > 0
    assert "| backend |" in runs["logs"]["drafter_step"]


def test_bench_uses_the_package_flop_formula():
    sys.path.insert(0, BENCH)
    import drafter_step

    from dflash_dist.telemetry.flops import drafter_step_flops
    assert drafter_step.step_flops is drafter_step_flops   # one formula (tests/unit/telemetry/test_flops.py checks it)


def test_drafter_labels_carry_settings():
    """--drafters VARIANT@BLOCK[:SECTION.KEY=VALUE]: each suffix a setting of drafter.SECTION; the preset's other
    keys of that section stay."""
    import pytest
    sys.path.insert(0, BENCH)
    import drafter_step

    dc = drafter_step.drafter_variant_config(False, "dflash2@8:tuning.ctx_bucket=128:dflash2.conv_dtype=compute")
    assert (dc.variant, dc.block_size, dc.tuning.ctx_bucket, dc.dflash2.conv_dtype) == ("dflash2", 8, 128, "compute")
    assert dc.tuning.loss_chunk_rows == 4096 != type(dc.tuning)().loss_chunk_rows   # the preset's, kept
    assert drafter_step.drafter_variant_config(False, "dflash@16:dflash2.selector_top_k=8").dflash2.selector_top_k == 8
    with pytest.raises(ValueError, match="SECTION.KEY=VALUE"):
        drafter_step.drafter_variant_config(False, "dflash2@8:conv_dtype=compute")
    with pytest.raises(ValueError, match="SECTION.KEY=VALUE"):
        drafter_step.drafter_variant_config(False, "dflash@16:shadow")


def test_breakdown_puts_both_flex_kernel_families_under_attention():
    """FlashAttention-4's CuTe kernel names hold "cutlass", as GEMM kernels do: the profile breakdown must count
    them as flex attention, as it does inductor's Triton templates."""
    sys.path.insert(0, BENCH)
    import drafter_step

    def category(name):
        low = name.lower()
        return next((c for c, keys in drafter_step._CATEGORIES if any(k in low for k in keys)), "other")

    assert category("kernel_cutlass_kernel_flash_attncuteflash_fwd_sm90FlashAttentionForwardSm90_object_at_0") \
        == "flex attention fwd"
    assert category("kernel_cutlass_kernel_flash_attncuteflash_bwd_sm90FlashAttentionBackwardSm90_object_at_1") \
        == "flex attention bwd"
    assert category("triton_tem_fused_flex_attention_backward_1") == "flex attention bwd"
    assert category("triton_tem_fused_flex_attention_0") == "flex attention fwd"
    assert category("sm90_xmma_gemm_bf16bf16_bf16f32") == category("cutlass_80_wmma_tensorop_bf16_s161616gemm") \
        == "matmul (GEMM)"


def test_target_capture(runs):
    d = _load(runs, "target_capture")
    rows = {r["variant"]: r for r in d["rows"]}
    assert d["variants"] == ["padded", "packed"] and set(rows) == {"padded", "packed"}
    for r in rows.values():
        assert "error" not in r, r
        assert r["capture_tokens_per_s"] > 0 and r["speedup_vs_padded"] > 0
        assert r["layers_run"] == max(d["layer_ids"]) + 1 <= d["num_layers"]  # stopped after the last capture layer
    pad, packed = rows["padded"], rows["packed"]
    assert pad["full_tokens_per_s"] > 0 and pad["capture_speedup_vs_full"] > 0 and pad["speedup_vs_padded"] == 1
    assert pad["capture_path"] == "padded (sdpa), compiled layers: no"
    assert packed["capture_path"] == "packed (flex document-causal), compiled layers: no"
    # every attention layer of every batch (one pass: --warmup 0 --repeats 1) went through the flex function
    assert packed["flex_calls_uncompiled"] == packed["layers_run"] * packed["batches"]
    assert packed["tokens_run"] == packed["real_tokens"] < pad["tokens_run"] == pad["padded_tokens"]
    assert "| variant |" in runs["logs"]["target_capture"] and "| packed |" in runs["logs"]["target_capture"]


def test_hybrid_reports_bindings(runs):
    d = _load(runs, "hybrid")
    assert d["mode"] == "hybrid" and d["model_class"].startswith("Qwen3Next")
    assert d["fast_path"]["hybrid"] is True
    kinds = d["fast_path"]["kinds"]
    assert kinds and all("fla" in k and "causal_conv1d" in k for k in kinds.values())
    assert d["rows"][0]["capture_tokens_per_s"] > 0
    assert d["layer_ids"] == [1, 2, 3, 4, 5] and d["rows"][0]["layers_run"] == 6
    assert "fast path" in runs["logs"]["hybrid"]


def test_pipeline(runs):
    d = _load(runs, "pipeline")
    assert d["alone"]["backend"] == "sdpa"                       # CPU: auto -> sdpa
    assert d["alone_samples_per_s"] > 0 and d["e2e_samples_per_s"] > 0 and d["ratio"] > 0
    assert d["e2e"]["to_step"] == 4 and d["e2e"]["from_step"] == 2
    assert d["alone"]["rate"]["from_step"] == 2 and d["alone"]["rate"]["to_step"] == 4
    assert "error" not in d["e2e"], d["e2e"].get("log_tail")
    # same job: (a) saw the messages the real job trained
    assert d["alone"]["total_messages"] == 4
    # (a)'s step 3 traced: its phases, and the written trace reads back to the same timeline
    from dflash_dist.telemetry.step_trace import load_trace, timeline
    phases = ["group0 forward", "group0 loss", "group0 backward", "clip and optimizer"]
    assert [x["name"] for x in d["alone"]["timeline"]["phases"]] == phases
    tl = timeline(load_trace(str(runs["out"] / "pw" / "alone_trace_step3.json")))
    assert tl["clock"] == "host" and tl["phases"] == d["alone"]["timeline"]["phases"]


def test_threaded(runs):
    d = _load(runs, "threaded")
    assert d["errors"] == [] and d["hung_threads"] == []
    assert d["samples_per_s"] > 0 and d["steps_done"] == 4
    assert d["compare"]["threaded_over_pipeline"] > 0
    assert d["hit_compile_error"] is False
    assert d["opt_steps"] == 4 and d["captures"] >= 4  # the exposure counters saw every step and capture
    assert 0 <= d["opt_steps_while_other_compiles"] <= 4
    assert d["target_fast_path"].startswith("no hybrid layers")  # the rank's kernel report, same policy


def test_plan_split(runs):
    d = _load(runs, "plan_split")
    assert [r["targets"] for r in d["rows"]] == list(range(8)) and d["gpus"] == 8  # colocated (0), then 1..7
    best = d["best"]
    assert best["samples_per_s"] == max(r["samples_per_s"] for r in d["rows"])
    s, dm = d["supply_per_target_gpu"], d["demand_per_drafter_gpu"]
    assert d["rows"][0]["samples_per_s"] == pytest.approx(8 / (1 / s + 1 / dm))
    for r in d["rows"][1:]:
        assert r["samples_per_s"] == pytest.approx(min(r["targets"] * s, r["drafters"] * dm))


def test_summarize(runs, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    for name, dst in [("drafter_step", "drafter_step"), ("target_capture", "target_capture"),
                      ("hybrid", "hybrid_without_cc1d"), ("hybrid", "hybrid_with_cc1d"), ("pipeline", "pipeline"),
                      ("threaded", "threaded"), ("plan_split", "plan_split")]:
        with open(runs["paths"][name]) as src, open(work / f"{dst}.json", "w") as f:
            f.write(src.read())
    (work / "rcs").write_text("drafter_step 0\npipeline 124\n")
    r = subprocess.run([sys.executable, os.path.join(BENCH, "summarize.py"), str(work), "--json",
                        str(tmp_path / "results.json"), "--md", str(tmp_path / "summary.md")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    md = (tmp_path / "summary.md").read_text()
    for title in ("1. Drafter step", "2. Target capture", "2b. Hybrid", "3. Pipeline", "4. Threaded", "5. Split"):
        assert title in md
    assert "causal-conv1d speed-up: 1.000x" in md
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["exit_codes"] == {"drafter_step": "0", "pipeline": "124"}


def test_gpu_driver_parses():
    """bench/run_gpu.sh is the one driver of the GPU set (no per-occasion scripts beside it)."""
    import glob
    path = os.path.join(BENCH, "run_gpu.sh")
    r = subprocess.run(["bash", "-n", path], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert sorted(glob.glob(os.path.join(BENCH, "*.sh"))) == [path]


def test_send_overlap_runs_every_scenario(tmp_path):
    """Two gloo ranks, a toy GEMM chain: every scenario timed, the table and the JSON written."""
    out = tmp_path / "so.json"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        os.path.join(BENCH, "experiments", "send_overlap.py"), "--tokens", "64", "--hidden", "64",
                        "--payload-mb", "1", "--delay-s", "0.05", "--repeats", "2", "--out", str(out)],
                       capture_output=True, text=True, timeout=180, cwd=REPO)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.load(open(out))
    scenarios = [row["scenario"] for row in res["rows"]]
    assert scenarios == ["alone", "pending", "pending_alloc", "pending_h2d", "received", "pending_side",
                         "recv_pending", "recv_pending_side"]
    assert all(len(res["times_s"][s]) == 2 and min(res["times_s"][s]) > 0 for s in scenarios)
    assert res["rows"][0]["vs_alone"] == 1.0 and "| pending |" in r.stdout


@pytest.mark.parametrize("rendezvous", ["--rendezvous", "--no-rendezvous"])
def test_transport_check_verifies_every_message(tmp_path, rendezvous):
    """Two gloo ranks: every message's digest matches its regenerated reference, END arrives, JSON written."""
    out = tmp_path / "tc.json"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        os.path.join(BENCH, "transport_check.py"), "--messages", "30", rendezvous, "--out", str(out)],
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.load(open(out))
    assert res["received"] == 30 and res["corrupted"] == 0 and res["end_of_stream"]
    assert res["transport"] == "posted from the host (no CUDA streams)" and "| posted from the host" in r.stdout


def test_compile_race_window(tmp_path):
    """bench/experiments/compile_race.py part 1 (deterministic): while one thread holds a compile session open, a thread
    that compiles nothing reads is_compiling() True and its AdamW runs and DrafterTrainer steps take compile-only
    branches (their result differs from the same run before); the target's capture does not change. If a torch release makes the flag
    thread-local, this fails and docs/benchmarks.md's section on it must change."""
    out = tmp_path / "cr.json"
    r = subprocess.run(_cmd("experiments/compile_race.py", "--window-only", "--out", out), cwd=REPO,
                       capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    w = json.load(open(out))["window"]
    assert w["is_compiling_before"] is False and w["is_compiling_after"] is False
    assert w["is_compiling_in_other_thread_during"] is True
    rows = w["workloads"]
    assert rows["adamw_single"]["differ"] + rows["adamw_single"]["errors"] == 1
    assert rows["adamw_foreach"]["differ"] + rows["adamw_foreach"]["errors"] == 1
    assert rows["drafter_steps"]["differ"] + rows["drafter_steps"]["errors"] == 1  # the real DrafterTrainer too
    assert rows["target_capture"] == {"runs": 1, "differ": 0, "max_abs_diff": 0.0, "errors": 0, "first_error": None}


def test_head_serve(tmp_path):
    """bench/head_serve.py --tiny: every (rows, chunk) row timed, rows cut to whole blocks, FLOPs 4 x R x H x V."""
    out = tmp_path / "hs.json"
    r = subprocess.run(_cmd("head_serve.py", "--tiny", "--out", out), cwd=REPO, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.load(open(out))
    assert [(x["rows"], x["chunk_rows"]) for x in res["rows"]] == [(150, 64), (150, 128), (300, 64), (300, 128)]
    assert all(x["ms"] > 0 and x["tflops"] == pytest.approx(4 * x["rows"] * 64 * 1000 / (x["ms"] / 1e3) / 1e12)
               for x in res["rows"])
    assert "| 300 | 128 | no |" in r.stdout


def test_head_serve_in_vocabulary_slices(tmp_path):
    """--slices 2: per (rows, chunk) also one rank's slice and the drafter's combine, timed, the combined loss and
    gradient within fp32 rounding of the whole head's."""
    out = tmp_path / "hs.json"
    r = subprocess.run(_cmd("head_serve.py", "--tiny", "--slices", "2", "--rows", "150", "--chunk-rows", "64",
                            "--out", out), cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    whole, sliced = json.load(open(out))["rows"]
    assert "slices" not in whole and sliced["slices"] == 2 and sliced["rows"] == whole["rows"] == 150
    assert sliced["slice_ms"] > 0 and sliced["combine_ms"] > 0
    assert sliced["loss_rel_diff"] < 1e-5 and sliced["grad_rel_diff"] < 1e-5, sliced


def test_target_fresh_shapes_pad_multiples(tmp_path):
    """bench/target_fresh_shapes.py: each pad multiple a row, the same shapes twice (--repeat), a new shape's and a
    seen shape's top ops (--profile), and the rows really rounded (the capture says so)."""
    out = tmp_path / "fs.json"
    r = subprocess.run(_cmd("target_fresh_shapes.py", "--target", "tiny", "--variants", "padded", "--pad-multiples",
                            "1,64", "--batches", 3, "--samples-per-batch", 2, "--repeat", "--profile", "--out", out),
                       cwd=REPO, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = json.load(open(out))["rows"]
    assert [x["pad_multiple"] for x in rows] == [1, 64]
    assert rows[0]["capture"].startswith("padded (sdpa)") and "multiple of 64" in rows[1]["capture"]
    for x in rows:
        assert len(x["batch_s"]) == len(x["repeat_batch_s"]) == 3 and x["median_seen_s"] > 0
        assert x["new_shape_cost_s"] == pytest.approx(x["median_new_s"] - x["median_seen_s"])
        assert any(o["op"].startswith("aten::") for o in x["profile_new"]) and x["profile_seen"]
    assert "| padded | 64 |" in r.stdout


def test_profiler_gloo_window_runs_its_safe_modes(tmp_path):
    """bench/experiments/profiler_gloo_window.py: the harness runs and counts finished runs (the modes that finish:
    blocking sends, and isends drained at both ends of the window; the crashing mode is not run here)."""
    out = tmp_path / "pg.json"
    r = subprocess.run(_cmd("experiments/profiler_gloo_window.py", "--modes", "send,drain", "--runs", 1, "--out", out,
                            "--workdir", tmp_path / "w"), cwd=REPO, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = json.load(open(out))["rows"]
    assert [(x["mode"], x["runs"], x["finished"]) for x in rows] == [("send", 1, 1), ("drain", 1, 1)]
    assert (tmp_path / "w" / "drain_rank0.json").exists()


def test_drafter_step_times_variants_side_by_side(tmp_path):
    """--drafters: DFlash and DFlash2 at two block sizes in one run, each row its own drafter and FLOPs."""
    out = tmp_path / "variants.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", WANDB_MODE="disabled", PYTHONPATH=REPO)
    r = subprocess.run(_cmd("drafter_step.py", "--tiny", "--configs", "40x8", "--repeats", 1, "--peak-n", 128,
                            "--backends", "sdpa", "--drafters", "dflash@8,dflash2@8,dflash2@16", "--out", out),
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    d = json.load(open(out))
    rows = {x["drafter"]: x for x in d["rows"]}
    assert set(rows) == {"dflash@8", "dflash2@8", "dflash2@16"}
    assert all("error" not in x and x["mode"] == "train" and x["ms_per_step"] > 0 for x in rows.values())
    assert (rows["dflash2@16"]["variant"], rows["dflash2@16"]["block_size"]) == ("dflash2", 16)
    f, plain = rows["dflash2@8"]["flops"], rows["dflash@8"]["flops"]
    assert plain["variant"] == 0 and f["variant"] > 0
    assert f["model"] == pytest.approx(f["matmul"] + f["attention"] + f["lm_head"] + f["variant"])
    params = {x["drafter"]: x["trainable_params"] for x in d["drafters"]}
    assert params["dflash2@8"] > params["dflash@8"]  # the convs and the selector's codebooks
    assert "| dflash2@8 | sdpa |" in r.stdout
