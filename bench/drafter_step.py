#!/usr/bin/env python3
"""One full DFlash drafter training step: ms/step, samples/s, peak memory, MFU, first-step (compile) time.

The drafter is the project's (``DFlashDrafter`` with the shape ``model.spec.resolve_drafter`` gives for the
Qwen3-8B-shaped target of ``conf/target/qwen3_8b_random.yaml``: 5 layers, hidden 4096, 32 heads, 8 kv heads, head
dim 128, intermediate 12288, fc 5*4096 -> 4096), block 16, frozen bf16 embedding and lm_head [151936, 4096].
A step is what ``DrafterTrainer`` does per message: ``make_batch`` (anchors, blocks, labels) -> mask
(``flex_block_mask`` compiled, or ``dense_mask`` for sdpa) -> embedding -> drafter forward -> ``decayed_ce`` (row
chunks under checkpoint) -> backward -> grad clip -> fused AdamW step, in bf16 autocast over fp32 master weights.
Inputs are random (features ~ N(0,1) bf16, random token ids), 30% of each sample a prompt (no loss), as in
``dflash_dist.data.synthetic``.

Two times per configuration: ``ms/step``, the median of steps timed one by one (the device synchronised before
each, so its host work before the first kernel, make_batch and the mask, is on the clock), and ``b2b``, the mean
of steps launched back to back, as the trainer runs them (its step makes no host sync; the next step's host work
overlaps this one's GPU tail). MFU is given for both. ``--trace DIR`` writes one step's Chrome trace and prints
its phases (batch, mask, forward, loss, variant_loss, backward, optimizer) with the GPU's busy and idle time.

FLOPs (model FLOPs, what MFU divides; the formula is in docs/benchmarks.md and ``dflash_dist.telemetry.flops``):
trainable matmuls x3 (forward + grad input + grad weight) except fc x2 (its input, the target features, needs no
grad); attention over VISIBLE (query, key) pairs only, 4*d per pair and head forward, x3.5 with backward; frozen
lm_head x2 (forward + grad wrt its input). The loss's default (fused) path computes the hidden-state gradient in
the forward pass; with --loss-mode checkpoint the lm_head forward is recomputed in backward: that extra 1x is
reported as hardware FLOPs (HFU), not in MFU.

    python bench/drafter_step.py --out drafter_step.json                 # GPU: both backends, 4 configs
    python bench/drafter_step.py --tiny --out /tmp/ds.json               # CPU smoke: sdpa train, flex forward-only
    python bench/drafter_step.py --shape llama31_8b --out ds_llama.json  # Llama-3.1-8B-shaped drafter (vocab 128,256,
                                                                         # llama3 RoPE); --tiny: tiny_llama3

On CPU, flex_attention has no backward (torch 2.13): the flex rows there are forward-only (+ loss), and say so.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402  (puts the repo root on sys.path)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from dflash_dist.roles.drafter_rank import startup_report as SR  # noqa: E402  (the flex kernel names of both families)
from dflash_dist.roles.drafter_rank.optim import make_step  # noqa: E402
from dflash_dist.model.blocks import make_batch  # noqa: E402
from dflash_dist.model.drafter import DrafterModelConfig  # noqa: E402
from dflash_dist.targets.hf import load_hf_config, resolve_dtype, text_config  # noqa: E402
from dflash_dist.model.loss import slot_weights, weighted_ce  # noqa: E402
from dflash_dist.model.masks import dense_mask, flex_block_mask  # noqa: E402
from dflash_dist.model.rope import DrafterRope  # noqa: E402
from dflash_dist.model.spec import resolve_drafter  # noqa: E402
from dflash_dist.telemetry.flops import drafter_step_flops as step_flops  # noqa: E402,F401  (the one formula)
from dflash_dist.telemetry.step_trace import format_timeline, phase, traced_step  # noqa: E402

GPU_CONFIGS = "3072x512,550x256,3072x256,550x512"
TINY_CONFIGS = "96x16,40x8,96x8,40x16"


# ---------------------------------------------------------------------------------------------- FLOPs

def visible_pairs(batch, block_size: int) -> float:
    a = batch.anchors.double()
    v = batch.valid.double()
    return float((block_size * (a + block_size) * v).sum())


# ---------------------------------------------------------------------------------------------- model

# --shape name -> (conf/target of the real shape, tiny conf/target of the same family)
SHAPES = {"qwen3_8b": ("qwen3_8b_random", "tiny"), "llama31_8b": ("llama31_8b_random", "tiny_llama3")}


def target_of(tiny: bool, shape: str = "qwen3_8b"):
    """The TargetConfig of this shape's target (its tiny twin with --tiny)."""
    full, small = SHAPES[shape]
    return C.target_config(small if tiny else full)


def drafter_spec(tiny: bool, dc, device_type: str, shape: str = "qwen3_8b"):
    """The drafter train.py would build for ``dc`` (DrafterConfig) on this shape's target
    (model.spec.resolve_drafter: model shape, gamma, chunking; the backends below are the bench's own)."""
    tcfg = target_of(tiny, shape)
    tc = text_config(load_hf_config(tcfg))
    return resolve_drafter(dc, tc, tcfg.num_feature_layers, device_type)


def planned_gb(runner, b: int, s_pad: int, anchors: int, backend: str) -> Optional[float]:
    """The memory plan of this step (``planning.memory.drafter_plan`` at (b, S_pad), this backend's activations:
    sdpa's dense masks or flex's block masks) without the process's own part: what ``peak_mem_gb`` measures.
    None for a runner made without its target's config."""
    import dataclasses
    if runner.tcfg is None:
        return None
    from dflash_dist.config import JobConfig
    from dflash_dist.planning.memory import drafter_plan
    cfg = JobConfig(target=runner.tcfg, drafter=dataclasses.replace(runner.dc, num_anchors=anchors))
    spec = dataclasses.replace(runner.spec, backend="sdpa" if backend.startswith("sdpa") else "flex")
    plan = drafter_plan(cfg, None, spec, runner.device.type, [(b, s_pad)])
    return (plan.total - plan.parts.get("process", 0) - plan.parts.get("heap slack (CPU)", 0)) / 2**30


def drafter_variant_config(tiny: bool, entry: str):
    """``VARIANT@BLOCK`` (--drafters) -> the DrafterConfig of that variant at that block size on the tiny preset
    (--tiny) or the paper's; DFlash2 with the released convolution and selector sizes (the ``drafter.dflash2``
    defaults; not the released layer window: the rows compare the variants at one shape). Each ``:``-suffix is
    ``SECTION.KEY=VALUE``, a setting of ``drafter.SECTION`` (``dflash2@8:dflash2.conv_dtype=compute``; VALUE read
    as YAML)."""
    import yaml
    entry, *suffixes = entry.strip().split(":")
    variant, _, block = entry.partition("@")
    overrides: dict = {"variant": variant}
    if block:
        overrides["block_size"] = int(block)
    for suffix in suffixes:
        key, eq, value = suffix.partition("=")
        section, dot, name = key.partition(".")
        if not (eq and dot):
            raise ValueError(f"--drafters {entry}:{suffix}: a setting is SECTION.KEY=VALUE of drafter.SECTION")
        overrides.setdefault(section, {})[name] = yaml.safe_load(value)
    return C.drafter_config("tiny" if tiny else "dflash", **overrides)


def make_inputs(ctx: int, b: int, mc: DrafterModelConfig, device, feat_dtype, prompt_frac: float, seed: int):
    """A packed message of b samples of ctx tokens, tensors placed as the transport receiver places them."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, mc.vocab_size, (b * ctx,), generator=g).to(device)
    pos = torch.arange(ctx).repeat(b)
    loss_mask = (pos >= int(prompt_frac * ctx)).to(device)
    cu = torch.arange(b + 1) * ctx  # on the host: the transport's control channel delivers cu_seqlens there
    gd = torch.Generator(device=device).manual_seed(seed)
    feats = torch.randn(b * ctx, mc.num_feature_layers * mc.hidden_size, generator=gd, device=device,
                        dtype=feat_dtype)
    return ids, loss_mask, cu, feats


def load_kernel_options(arg: Optional[str]) -> Optional[dict]:
    """--kernel-options: a JSON dict, or the path of a bench/flex_tune.py result (its best_kernel_options)."""
    if not arg:
        return None
    if arg.endswith(".json") and not os.path.exists(arg):
        C.log(f"--kernel-options {arg}: no such file (did the tune fail?); +ko backends run the defaults")
        return None
    if os.path.exists(arg):
        with open(arg) as f:
            data = json.load(f)
        return data.get("best_kernel_options") if "best_kernel_options" in data else data
    return json.loads(arg)


class Runner:
    def __init__(self, spec, dc, device, lr: float, dynamic: bool = False, optimizer_step: str = "auto",
                 tcfg=None):
        mc = spec.model
        self.spec, self.mc, self.dc, self.device, self.tcfg = spec, mc, dc, device, tcfg
        objective = spec.make_objective()
        self.gamma = getattr(getattr(objective, "base", objective), "gamma", None)  # kind=kl: its base's
        self.dynamic = dynamic  # drafter.tuning.compile_dynamic: dynamic-shape flex kernel and mask builder
        self.loss_mode = "auto"  # loss.decayed_ce: auto = fused (frozen head), or checkpoint
        self.kernel_options: Optional[dict] = None  # --kernel-options, used by the "+ko" backends
        # bench/objectives.py: the loss through the objective object (drafter.loss.*), as DrafterTrainer runs it, and
        # the message's target labels (make_batch's target_ids / target_probs) for labels=target
        self.use_objective = False
        self.target_inputs: dict = {}
        torch.manual_seed(0)
        self.variant = spec.variant_impl()
        self.objective = spec.make_objective()
        with torch.device(device):  # fp32 master weights, initialised on the device (the variant's module)
            self.model = spec.build_model("sdpa")
        self.objective.head_topk = int(self.model.head_topk)  # as the trainer: DFlash2's candidates from the loss pass
        hdt = resolve_dtype("auto", device.type)       # the target's dtype: bf16 on CUDA
        g = torch.Generator(device=device).manual_seed(1)
        self.embed = (torch.randn(mc.vocab_size, mc.hidden_size, generator=g, device=device) * 0.02).to(hdt)
        self.lm_head = (torch.randn(mc.vocab_size, mc.hidden_size, generator=g, device=device) * 0.02).to(hdt)
        self.feat_dtype = hdt
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0,
                                     fused=device.type == "cuda")
        self.opt_step = make_step(self.opt, optimizer_step)  # drafter.tuning.optimizer_step
        self.autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
                         else torch.autocast("cpu", enabled=False))
        self.n_params = sum(p.numel() for p in self.model.parameters())

    def step(self, inputs, k: int, backend: str, train: bool, num_anchors: int):
        """One step (DrafterTrainer.build + _train_step without DDP); returns the batch for FLOP counting."""
        dc = self.dc
        B = self.mc.block_size
        ids, loss_mask, cu, feats = inputs
        with phase("batch"):
            batch = make_batch(ids, loss_mask, cu, feats, num_anchors=num_anchors, block_size=B,
                               mask_token_id=self.mc.vocab_size - 1, ctx_bucket=dc.tuning.ctx_bucket,
                               generator=torch.Generator().manual_seed(1_000_003 + k), **self.target_inputs)
        # flex_layers = flex + drafter.tuning.compile_layers (each decoder layer through torch.compile), with the
        # job's default tile options; a "+ko" suffix runs --kernel-options instead (drafter.tuning.flex_kernel_options;
        # {} = inductor's defaults)
        # "+eagerloss": the fused loss's chunk math eager (drafter.tuning.compile_loss=false; compiled by default with flex)
        # "+builder": the BlockMask from torch's create_block_mask (compiled) instead of the block intervals
        base, *suffixes = backend.split("+")
        flex = base in ("flex", "flex_layers")
        opts = (self.kernel_options or {}) if "ko" in suffixes else None   # None: the job's defaults for the device
        compiled_loss = flex and "eagerloss" not in suffixes
        want = ("flex" if flex else "sdpa", base == "flex_layers", opts)
        if getattr(self, "configured", None) != want:
            self.configured = want
            self.model.backend = "flex" if flex else "sdpa"
            self.model.configure_compile(flex_dynamic=self.dynamic and flex, compile_layers=base == "flex_layers",
                                         kernel_options=opts)
        with torch.set_grad_enabled(train):
            with phase("mask"):
                if flex:
                    mask = flex_block_mask(batch.anchors, batch.valid, batch.ctx_len, B,
                                           compile=dc.compile, from_tables="builder" not in suffixes,
                                           dynamic=self.dynamic)
                else:
                    mask = dense_mask(batch.anchors, batch.valid, batch.ctx_len, B)
            with self.autocast:
                with phase("forward"):
                    block_embeds = F.embedding(batch.block_ids, self.embed)
                    hidden = self.model(block_embeds, batch.features, batch.ctx_positions, batch.block_positions,
                                        mask)
                with phase("loss"):
                    if self.use_objective:  # bench/objectives.py: the loss through the objective object
                        soft = () if batch.soft is None else (batch.soft,)
                        parts = self.objective.loss(hidden, self.lm_head, batch.labels, *soft)
                    else:  # the trainer's objective call (decayed_ce), with the top-K ids a variant asks of its pass
                        parts = weighted_ce(hidden, self.lm_head, batch.labels,
                                            slot_weights(B, self.gamma, batch.labels.device),
                                            self.spec.loss.chunk_rows, mode=self.loss_mode, compiled=compiled_loss,
                                            topk=self.model.head_topk)
                    self.model.set_context(head_topk_ids=getattr(parts, "topk_ids", None))
                with phase("variant_loss"):
                    loss_sum = parts.loss_sum + self.variant_loss(hidden, batch)
                self.last_loss_sum = parts.loss_sum.detach()  # the objective's, read after the timed steps
            if train:
                with phase("backward"):
                    loss = loss_sum / parts.weight_sum.clamp_min(1e-6)
                    loss.backward()
                with phase("optimizer"):
                    self.opt_step(list(self.model.parameters()), 1.0)  # the trainer's clip + step
                    self.opt.zero_grad(set_to_none=True)
        return batch


    def variant_loss(self, hidden, batch):
        """The variant's own loss terms (DrafterTrainer._group_losses; DFlash: none), weighted by the objective."""
        names = self.model.loss_term_names
        if not names:
            return 0.0
        weights = self.objective.rows(hidden.detach(), batch.labels)[2].detach()
        terms = self.model.loss_terms(hidden, batch.labels, self.lm_head, block_ids=batch.block_ids,
                                      row_weights=weights)
        return sum(terms[n] for n in names)


# kernel name (lower case) -> category of the step-time breakdown (first match wins; the flex kernels of both
# families, Triton and FlashAttention-4, before "cutlass", which FlashAttention-4's CuTe kernel names also hold)
_CATEGORIES = [
    ("flex attention bwd", SR.FLEX_BWD_KERNEL + SR.FLASH_BWD_KERNEL),
    ("flex attention fwd", SR.FLEX_FWD_KERNEL + SR.FLASH_FWD_KERNEL),
    ("matmul (GEMM)", ("gemm", "cutlass", "sm90_xmma", "nvjet", "cublas", "ampere_", "sm80_", "wgmma")),
    ("optimizer (fused AdamW)", ("adam", "multi_tensor")),
    ("loss softmax/CE", ("logsumexp", "log_softmax", "softmax", "nll", "argmax", "scatter", "gather", "reduce_kernel")),
    ("compiled fused (norms, RoPE, SiLU, ...)", ("triton_",)),
    ("copies and casts", ("copy", "cast", "fill", "memset", "memcpy", "cat")),
]


def kernel_breakdown(step, dev) -> dict:
    """GPU time of one step by kernel category (ms), from torch.profiler's CUDA activity."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize(dev)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize(dev)
    out: dict = {}
    top: list = []
    for ev in prof.key_averages():
        t = float(getattr(ev, "self_device_time_total", 0.0) or getattr(ev, "self_cuda_time_total", 0.0) or 0.0)
        if t <= 0:
            continue
        name = ev.key
        low = name.lower()
        cat = next((c for c, keys in _CATEGORIES if any(k in low for k in keys)), "other")
        out[cat] = out.get(cat, 0.0) + t / 1e3
        top.append((t / 1e3, int(ev.count), name[:90]))
    out["total"] = sum(v for k, v in out.items())
    out["top_kernels"] = [[round(ms, 3), n, calls] for ms, calls, n in sorted(top, reverse=True)[:30]]
    return out


def run_one(runner: Runner, ctx: int, anchors: int, b: int, backend: str, train: bool, args, peak: dict,
            nominal) -> dict:
    dev = runner.device
    row = {"ctx": ctx, "anchors": anchors, "batch": b, "backend": backend,
           "mode": "train" if train else "forward-only", "drafter": runner.label,
           "variant": runner.spec.variant, "block_size": runner.mc.block_size}
    inputs = make_inputs(ctx, b, runner.mc, dev, runner.feat_dtype, args.prompt_frac, seed=ctx * 7919 + anchors + b)
    timer = C.StepTimer(dev)
    C.free_memory(dev)
    C.reset_peak(dev)
    before = C.mem_gb(dev)["allocated_gb"]
    k = 0
    try:
        t0 = time.perf_counter()
        timer.start()
        runner.step(inputs, k, backend, train, anchors)
        first = timer.stop()
        row["first_step_s"] = first
        row["flex_kernel_options"] = runner.model.flex_kernel_options  # as the step ran them (None: inductor's)
        row["first_step_wall_s"] = time.perf_counter() - t0
        k += 1
        for _ in range(max(0, args.warmup - 1)):
            runner.step(inputs, k, backend, train, anchors)
            k += 1
        C.sync(dev)
        times, flops, valid = [], [], []
        for _ in range(args.repeats):
            timer.start()
            batch = runner.step(inputs, k, backend, train, anchors)
            times.append(timer.stop())
            k += 1
            fl = step_flops(runner.mc, b, batch.ctx_len, anchors, runner.mc.vocab_size,
                            visible_pairs(batch, runner.mc.block_size), train,
                            recompute_head=runner.loss_mode == "checkpoint")
            extra = runner.variant.extra_flops(runner.mc, b, batch.ctx_len, anchors, runner.mc.vocab_size)
            fl["variant"] = extra  # the variant's convs / selector (telemetry's model FLOPs add them too)
            fl["model"] += extra
            fl["hardware"] += extra
            flops.append(fl)
            valid.append(float(batch.valid.float().mean()))
        s_pad = batch.ctx_len
        # back-to-back steps, one sync at the end (the launch of step k+1 may overlap the tail of step k)
        C.sync(dev)
        t0 = time.perf_counter()
        for _ in range(args.repeats):
            runner.step(inputs, k, backend, train, anchors)
            k += 1
        C.sync(dev)
        row["ms_per_step_back_to_back"] = (time.perf_counter() - t0) / args.repeats * 1e3
        if args.profile and dev.type == "cuda" and f"{ctx}x{anchors}" in args.profile.split(","):
            row["breakdown_ms"] = kernel_breakdown(lambda: runner.step(inputs, k + 1, backend, train, anchors), dev)
        if getattr(args, "sync_debug", False) and dev.type == "cuda":  # what keeps the next step's host work from overlapping this one
            row["host_syncs"] = C.host_sync_sites(lambda: runner.step(inputs, k + 3, backend, train, anchors), dev)
            C.log(f"{runner.label} {ctx}x{anchors} host syncs per step: "
                  + ("; ".join(f"{e['count']}x {e['site']}" for e in row["host_syncs"]) or "none"))
        if args.trace:  # one more step as a Chrome trace (CPU and GPU), and its phases: where the GPU sits idle
            path = os.path.join(args.trace, f"{runner.label.replace('@', '_')}_{backend}_{ctx}x{anchors}_b{b}.json")
            tl, _ = traced_step(lambda: runner.step(inputs, k + 2, backend, train, anchors), path, dev)
            row["timeline"] = tl
            C.log(format_timeline(tl, f"{runner.label} {backend} {ctx}x{anchors} b{b}"))
    except Exception as e:
        row["error"] = C.short_error(e)
        row["oom"] = C.is_oom(e)
        C.log(f"{backend} ctx={ctx} anchors={anchors} b={b}: {row['error']}")
        runner.opt.zero_grad(set_to_none=True)
        del e
        C.free_memory(dev)
        return row
    med = C.median(times)
    fl = {key: sum(f[key] for f in flops) / len(flops) for key in flops[0]}
    m = C.mem_gb(dev)
    row.update({
        "ms_per_step": med * 1e3, "ms_min": min(times) * 1e3, "ms_max": max(times) * 1e3, "repeats": len(times),
        "samples_per_s": b / med, "tokens_per_s": b * ctx / med,
        "compile_s": max(0.0, first - med),
        "peak_mem_gb": m["peak_gb"], "mem_before_gb": before, "reserved_gb": m["reserved_gb"],
        "planned_gb": planned_gb(runner, b, s_pad, anchors, backend),
        "s_pad": s_pad, "q_rows": int(fl["rows_q"]), "valid_blocks_frac": sum(valid) / len(valid),
        "flops": fl, "tflops_model": fl["model"] / med / 1e12, "tflops_hw": fl["hardware"] / med / 1e12,
    })
    row["mfu_measured_peak"] = row["tflops_model"] / peak["tflops"] if peak.get("tflops") else None
    # back to back, as the trainer runs its steps (no host sync inside a step, checked at its startup): the next
    # step's host work (make_batch, the mask, the launches) overlaps this step's GPU tail
    b2b = row.get("ms_per_step_back_to_back")
    row["mfu_back_to_back_pct"] = (100 * fl["model"] / (b2b / 1e3) / 1e12 / peak["tflops"]
                                   if b2b and peak.get("tflops") else None)
    row["hfu_measured_peak"] = row["tflops_hw"] / peak["tflops"] if peak.get("tflops") else None
    row["mfu_nominal_peak"] = row["tflops_model"] / nominal if nominal else None
    for key in ("mfu_measured_peak", "hfu_measured_peak", "mfu_nominal_peak"):
        row[key.replace("peak", "pct")] = None if row[key] is None else 100 * row[key]
    row["attention_flop_share"] = fl["attention"] / fl["model"]
    C.free_memory(dev)
    return row


def run_drafter(runner, backends, configs, batches, args, peak, nominal, result, t_start, dev) -> None:
    """Every backend x config x batch of one drafter, rows appended to ``result`` (written after each)."""
    # backend outermost: a backend change recompiles the layers, a shape change does not (dynamic shapes)
    for backend in backends:
        for ctx, anchors in configs:
            for b in batches:
                if args.time_budget_s and time.time() - t_start > args.time_budget_s:
                    result["skipped"].append({"ctx": ctx, "anchors": anchors, "batch": b, "backend": backend,
                                              "reason": "time budget"})
                    continue
                train = not (backend.startswith("flex") and dev.type == "cpu")
                C.log(f"run {backend} ctx={ctx} anchors={anchors} b={b} ({'train' if train else 'forward-only'})")
                row = run_one(runner, ctx, anchors, b, backend, train, args, peak, nominal)
                result["rows"].append(row)
                if "error" not in row:
                    C.log(f"  {row['ms_per_step']:.1f} ms/step, {row['samples_per_s']:.2f} samples/s, "
                          f"MFU {100 * (row['mfu_measured_peak'] or 0):.1f}% of measured peak, "
                          f"peak mem {row['peak_mem_gb']} GB, first step {row['first_step_s']:.1f} s")
                result["wall_s"] = time.time() - t_start
                C.write_json(args.out, result)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="CPU-sized smoke run (tiny target shape, 2-layer drafter)")
    p.add_argument("--shape", default="qwen3_8b", choices=sorted(SHAPES),
                   help="the target whose drafter is measured (llama31_8b: vocab 128,256, llama3 RoPE)")
    p.add_argument("--out", default=None, help="JSON output path (rewritten after every configuration)")
    p.add_argument("--device", default="auto")
    p.add_argument("--configs", default=None, help=f"CTXxANCHORS list (default {GPU_CONFIGS}; tiny {TINY_CONFIGS})")
    p.add_argument("--batch", default="1", help="samples per step, comma list (e.g. 1,4)")
    p.add_argument("--backends", default="flex_layers,sdpa",
                   help="comma list of flex, flex_layers (flex + drafter.tuning.compile_layers), sdpa; suffixes: +ko "
                        "(--kernel-options), +eagerloss (drafter.tuning.compile_loss=false; flex rows compile the loss), "
                        "+builder (the block mask from torch's compiled create_block_mask, not the block intervals)")
    p.add_argument("--kernel-options", default=None,
                   help="flex tile options (drafter.tuning.flex_kernel_options) for backends with a +ko suffix, e.g. "
                        "flex_layers+ko: a JSON dict, or a bench/flex_tune.py JSON file (its 'best_kernel_options')")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps incl. the first (default 2; tiny 1)")
    p.add_argument("--repeats", type=int, default=None, help="timed steps (default 10; tiny 3)")
    p.add_argument("--prompt-frac", type=float, default=0.3, help="leading share of each sample without loss")
    p.add_argument("--dynamic", choices=["off", "auto", "on"], default="on",
                   help="off: every shape compiles static (clean per-config compile time); auto: torch default; "
                        "on: the trainer's CUDA default (drafter.tuning.compile_dynamic: dynamic-shape flex kernel and "
                        "mask builder, compiled once for all shapes)")
    p.add_argument("--peak-n", type=int, default=None, help="matmul size of the peak measurement (8192; tiny 256)")
    p.add_argument("--time-budget-s", type=float, default=0,
                   help="start no new configuration after this many seconds (0: no limit); skipped ones are listed")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--profile", default="", help="CTXxANCHORS list: also profile one step of these configs (CUDA) "
                                                 "and print the GPU time by kernel category")
    p.add_argument("--optimizer-step", choices=["auto", "fused", "compiled"], default="auto",
                   help="drafter.tuning.optimizer_step (auto: compiled on CUDA, the trainer's default)")
    p.add_argument("--trace", default=None, help="DIR: also trace one step of every run (Chrome trace, CPU and GPU) "
                                                 "into DIR, and record its phase timeline (GPU busy and idle)")
    p.add_argument("--sync-debug", action="store_true",
                   help="CUDA: list where one step makes the host wait for the device (torch's sync debug mode; "
                        "row['host_syncs']): a back-to-back step should make none")
    p.add_argument("--drafters", default=None,
                   help="comma list of VARIANT@BLOCK drafters timed in one run (drafter.variant, drafter.block_size), "
                        "e.g. dflash@16,dflash2@16,dflash@8,dflash2@8 (conf/drafter/dflash2.yaml's DFlash2 sizes "
                        "unless --tiny), each optionally with "
                        ":SECTION.KEY=VALUE settings (e.g. dflash2@8:dflash2.conv_dtype=compute); "
                        "default: the preset's drafter")
    p.add_argument("--loss-mode", choices=["auto", "checkpoint"], default="auto",
                   help="decayed_ce: auto (fused: hidden-state gradient computed in forward, the trainer's "
                        "path) or checkpoint (logits recomputed in backward)")
    args = p.parse_args(argv)
    tiny = args.tiny
    args.warmup = args.warmup if args.warmup is not None else (1 if tiny else 2)
    args.repeats = args.repeats if args.repeats is not None else (3 if tiny else 10)
    configs = [tuple(int(x) for x in c.split("x")) for c in (args.configs or (TINY_CONFIGS if tiny else GPU_CONFIGS)).split(",")]
    batches = [int(x) for x in args.batch.split(",")]
    backends = [x.strip() for x in args.backends.split(",") if x.strip()]
    dev = C.pick_device(args.device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    t_start = time.time()

    import torch._dynamo as _dynamo  # noqa: F401  (a bare `import torch._dynamo` here would make `torch` local)
    dyn = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):  # the name differs between torch versions
        if hasattr(dyn, name):
            setattr(dyn, name, 64)
            break
    if args.dynamic == "off":
        dyn.automatic_dynamic_shapes = False

    drafters = [(None, C.drafter_config("tiny" if tiny else "dflash"))]
    if args.drafters:
        drafters = [(d, drafter_variant_config(tiny, d)) for d in args.drafters.split(",") if d.strip()]
    label0, dc = drafters[0]
    spec = drafter_spec(tiny, dc, dev.type, args.shape)
    mc = spec.model
    peak = C.peak_matmul_tflops(dev, n=args.peak_n or (256 if tiny else 8192))
    nominal = C.nominal_peak_tflops(dev)
    C.log(f"measured matmul peak {peak['tflops']:.1f} TFLOP/s ({peak['dtype']} {peak['n']}^3); nominal {nominal}")
    kernel_options = load_kernel_options(args.kernel_options)

    def make_runner(label, dc):
        r = Runner(drafter_spec(tiny, dc, dev.type, args.shape), dc, dev, args.lr,
                   dynamic=args.dynamic == "on" and dev.type == "cuda", optimizer_step=args.optimizer_step,
                   tcfg=target_of(tiny, args.shape))
        r.loss_mode, r.kernel_options = args.loss_mode, kernel_options
        r.label = label or f"{dc.variant}@{dc.block_size}"
        return r

    runner = make_runner(label0, dc)
    if any("+ko" in b for b in backends) and not kernel_options:
        C.log("a +ko backend without --kernel-options (or the tune found none): it runs inductor's defaults")
    result = {"bench": "drafter_step", "env": C.env_info(dev), "tiny": tiny, "peak_matmul": peak,
              "nominal_peak_tflops": nominal, "drafter_config": mc.__dict__, "trainable_params": runner.n_params,
              "drafter_yaml": "tiny" if tiny else "dflash", "shape": args.shape,
              "rope": DrafterRope(mc.rope_params(), head_dim=mc.head_dim, hidden_size=mc.hidden_size,
                                  num_attention_heads=mc.num_attention_heads,
                                  max_position_embeddings=mc.max_position_embeddings).describe(),
              "loss_chunk_rows": dc.tuning.loss_chunk_rows,
              "ctx_bucket": dc.tuning.ctx_bucket, "gamma": runner.gamma, "prompt_frac": args.prompt_frac,
              "dynamic": args.dynamic, "optimizer_step": args.optimizer_step, "loss_mode": args.loss_mode, "kernel_options": runner.kernel_options, "warmup": args.warmup, "repeats": args.repeats,
              "flop_formula": "docs/benchmarks.md#drafter-step-flops", "rows": [], "skipped": [], "drafters": []}
    C.log(f"drafter: {mc.num_layers} layers, hidden {mc.hidden_size}, {runner.n_params / 1e6:.1f}M trainable params, "
          f"vocab {mc.vocab_size}, device {dev}")
    # one drafter at a time (its weights and optimizer state freed before the next)
    first = [runner]  # built above for the result's header
    del runner
    for label, dc in drafters:
        runner = first.pop() if first else make_runner(label, dc)
        result["drafters"].append({"drafter": runner.label, "variant": runner.spec.variant,
                                   "drafter_config": dict(runner.mc.__dict__), "trainable_params": runner.n_params})
        run_drafter(runner, backends, configs, batches, args, peak, nominal, result, t_start, dev)
        del runner
        C.free_memory(dev)
    cols = [("drafter", "drafter"), ("backend", "backend"), ("mode", "mode"), ("ctx", "ctx"), ("anchors", "anchors"), ("batch", "b"),
            ("ms_per_step", "ms/step"), ("ms_per_step_back_to_back", "ms/step b2b"), ("samples_per_s", "samples/s"),
            ("tflops_model", "TFLOP/s"), ("mfu_measured_pct", "MFU % (meas.)"), ("mfu_back_to_back_pct", "MFU % b2b"), ("mfu_nominal_pct", "MFU % (nom.)"),
            ("attention_flop_share", "attn share"), ("peak_mem_gb", "peak GB"), ("planned_gb", "planned GB"),
            ("first_step_s", "1st step s"), ("error", "error")]
    print()
    print(C.table(result["rows"], cols, title=f"drafter step ({'tiny' if tiny else args.shape + '-shaped'}, {dev.type}; "
                                               f"matmul peak {C.fmt(peak['tflops'])} TFLOP/s measured)"))
    for r in result["rows"]:
        bd = r.get("breakdown_ms")
        if bd:
            print(f"\nstep time breakdown, {r['backend']} ctx={r['ctx']} anchors={r['anchors']} b={r['batch']} "
                  f"(GPU ms of one profiled step; wall {C.fmt(r['ms_per_step'])} ms):")
            print("| category | ms | share |\n| --- | --- | --- |")
            for cat, ms in sorted(((c, v) for c, v in bd.items() if c not in ("total", "top_kernels")),
                                  key=lambda kv: -kv[1]):
                print(f"| {cat} | {ms:.1f} | {100 * ms / max(bd['total'], 1e-9):.0f}% |")
            print("top kernels (ms, calls): " + "; ".join(f"{n} {ms} ms x{c}" for ms, n, c in bd["top_kernels"][:30]))
    if any(r.get("mode") == "forward-only" for r in result["rows"]):
        print("\nforward-only: flex_attention has no CPU backward in torch; those rows time forward + loss only.")
    if result["skipped"]:
        print(f"\nskipped (time budget): {len(result['skipped'])} runs")
    result["wall_s"] = time.time() - t_start
    C.write_json(args.out, result)
    ok = [r for r in result["rows"] if "error" not in r]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
