"""The compile guard has teeth: eager flex, a recompile after warm-up, a graph break and a hit recompile limit
all raise; the startup report names the backend that ran (CPU: sdpa)."""

import atexit
import itertools
import os
import shutil
import tempfile
import warnings

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from helpers.compile_settings import compile_settings_restored

from dflash_dist.roles.drafter_rank import compile_guard as cg
from dflash_dist.roles.drafter_rank import shape_plan as sp
from dflash_dist.roles.drafter_rank.startup_report import dense_attention_bytes, startup_report
from dflash_dist.model.blocks import make_batch
from dflash_dist.model.drafter import DFlashDrafter, DrafterModelConfig
from dflash_dist.model.loss import decayed_ce
from dflash_dist.model.masks import dense_mask


@pytest.fixture(autouse=True)
def _restore_dynamo():
    """install_guard changes process-wide dynamo settings and warning filters: put them back after each test
    (dynamo's config through its own patch(), tests/helpers/compile_settings.py)."""
    with compile_settings_restored(), warnings.catch_warnings():
        yield
    torch.compiler.set_stance("default")


def _toy(dynamic=False):
    """A compiled function with a code object of its own (dynamo caches per code object, so toys of different
    tests must not share one). backend="eager": dynamo's guards and recompiles are those of inductor, without
    the codegen time. Its source is a file of its own: torch < 2.13 wraps a function without a source file in
    one shared frame (external_utils.wrap_inline), whose cache every toy would then fill."""
    src = "import torch\n\n\ndef toy(x):\n    return torch.sin(x) * 2 + 1\n"
    path = os.path.join(_TOY_DIR, f"toy_{next(_TOY_IDS)}.py")
    with open(path, "w") as f:
        f.write(src)
    ns = {"torch": torch}
    exec(compile(src, path, "exec"), ns)
    return torch.compile(ns["toy"], backend="eager", dynamic=dynamic)


_TOY_IDS = itertools.count()
_TOY_DIR = tempfile.mkdtemp(prefix="dflash-toys-")
atexit.register(shutil.rmtree, _TOY_DIR, True)


def test_eager_flex_attention_raises_guard_error():
    from torch.nn.attention.flex_attention import flex_attention
    guard = cg.install_guard(num_shape_buckets=2)
    q = torch.randn(1, 2, 16, 8)
    with pytest.raises(cg.CompileGuardError, match="WITHOUT torch.compile") as ei:
        with guard.step((1, 0, 16)):
            flex_attention(q, q, q)
    assert "(b=1, S_pad=0, Q=16)" in str(ei.value)
    # the warn-once registry did not swallow it: a second eager call raises again
    with pytest.raises(cg.CompileGuardError):
        with guard.step((1, 0, 16)):
            flex_attention(q, q, q)


def test_swallowed_eager_flex_warning_is_still_caught():
    """A library that ignores warnings around the call cannot hide the eager path: torch's warn-once registry
    records it and the step raises afterwards."""
    from torch.nn.attention.flex_attention import flex_attention
    guard = cg.install_guard(num_shape_buckets=2)
    q = torch.randn(1, 1, 16, 8)
    with pytest.raises(cg.CompileGuardError, match="swallowed"):
        with guard.step((1, 0, 16)):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                flex_attention(q, q, q)
    cg.install_guard(num_shape_buckets=2)  # re-arms torch's once-only warning for later tests


def test_eager_flex_in_a_drafter_forward_raises():
    """The real drafter with its compiled flex swapped for the raw function (what a lost torch.compile does)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    import dflash_dist.model.drafter as drafter_mod
    cfg = DrafterModelConfig(hidden_size=16, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                             intermediate_size=32, num_layers=1, num_feature_layers=1, rms_norm_eps=1e-6,
                             rope_theta=1e4, block_size=4, vocab_size=11, max_position_embeddings=64)
    m = DFlashDrafter(cfg, "flex")
    guard = cg.install_guard(num_shape_buckets=1, check_flex_compiled=True)
    bm = create_block_mask(lambda b, h, q, k: k <= q + 8, 1, None, 4, 12, device="cpu")
    saved = drafter_mod.flex_attention_compiled
    drafter_mod.flex_attention_compiled = flex_attention
    try:
        with pytest.raises(cg.CompileGuardError, match="flex_attention ran WITHOUT torch.compile"):
            with guard.step((1, 8, 4)), torch.no_grad():   # flex has no CPU backward: forward only
                m(torch.randn(1, 4, 16), torch.randn(1, 8, 16), torch.arange(8)[None], torch.arange(4)[None], bm)
    finally:
        drafter_mod.flex_attention_compiled = saved


def test_shape_change_after_warmup_raises_with_shape_named():
    f = _toy()
    guard = cg.install_guard(num_shape_buckets=2, warmup_steps=1)
    with guard.step((2, 64, 8)):
        f(torch.randn(2, 64, 8))
    with guard.step((2, 64, 8)):          # same shape in steady state: cached graph, no error
        f(torch.randn(2, 64, 8))
    with pytest.raises(cg.CompileGuardError) as ei:
        with guard.step((3, 128, 8)):
            f(torch.randn(3, 128, 8))
    msg = str(ei.value)
    assert "(b=3, S_pad=128, Q=8)" in msg and "new shape" in msg
    assert "(b=2, S_pad=64, Q=8)" in msg            # the warm-up shape it is compared with
    assert "size mismatch" in msg                    # dynamo's own reason is kept
    assert guard.warmup_shapes == [(2, 64, 8)]


def test_recompile_for_a_seen_shape_is_named_as_non_shape_guard():
    scale = {"v": 2.0}
    f = torch.compile(lambda x: x * scale["v"], backend="eager")
    guard = cg.install_guard(num_shape_buckets=1, warmup_steps=1)
    with guard.step((1, 8, 4)):
        f(torch.randn(4))
    scale["v"] = 3.0                                  # a per-step Python constant: a recompile, same shape
    with pytest.raises(cg.CompileGuardError, match="already compiled"):
        with guard.step((1, 8, 4)):
            f(torch.randn(4))


def test_planned_shape_may_compile_late_but_unplanned_may_not():
    f = _toy()
    guard = cg.install_guard(num_shape_buckets=3, warmup_steps=1, expected_shapes=[(1, 8, 4), (2, 8, 4)])
    with guard.step((1, 8, 4)):
        f(torch.randn(1, 8, 4))
    with guard.step((2, 8, 4)):                       # planned, first seen after warm-up: allowed, recorded
        f(torch.randn(2, 8, 4))
    assert [s for _, s in guard.compiled_in_steady_state] == [(2, 8, 4)]
    with pytest.raises(cg.CompileGuardError, match=r"\(b=5, S_pad=8, Q=4\)"):
        with guard.step((5, 8, 4)):
            f(torch.randn(5, 9, 4))


def test_recompile_limit_is_applied_and_raises():
    guard = cg.install_guard(num_shape_buckets=1, margin=0, warmup_steps=None)  # warm-up never ends
    assert guard.applied["recompile_limit_attr"] in ("recompile_limit", "cache_size_limit")
    assert guard.applied["fail_attr"] in ("fail_on_recompile_limit_hit", "fail_on_cache_limit_hit")
    f = _toy()
    with guard.step((1, 1, 3)):
        f(torch.randn(3))
    with pytest.raises(cg.CompileGuardError, match="recompile limit"):
        with guard.step((1, 1, 4)):
            f(torch.randn(4))


def test_graph_break_is_reported():
    def broken(x):
        x = x + 1
        print("host side effect")                      # deliberate graph break
        return x * 2

    base = cg.graph_break_reasons()
    before = cg.dynamo_counters()
    torch.compile(broken, backend="eager")(torch.randn(4))
    new = cg.report_graph_breaks(base, raise_on_break=False)
    assert sum(new.values()) >= 1 and any("print" in r or "builtin" in r.lower() for r in new)
    assert cg.dynamo_counters()["graph_breaks"] > before["graph_breaks"]
    with pytest.raises(cg.CompileGuardError, match="graph break"):
        cg.report_graph_breaks(base)


def test_steady_state_context_and_counters():
    f = _toy()
    f(torch.randn(6))
    with pytest.raises(cg.CompileGuardError, match=r"\(b=1, S_pad=7, Q=1\)"):
        with cg.steady_state(shape=(1, 7, 1), seen=[(1, 6, 1)]):
            f(torch.randn(7))
    c = cg.dynamo_counters()
    for k in ("frames", "unique_graphs", "graph_breaks", "recompiles", "fx_graph_cache_hit", "fx_graph_cache_miss",
              "aot_autograd_cache_hit", "aot_autograd_cache_miss", "compile_s"):
        assert k in c


def test_expected_shapes_from_plan():
    shapes = sp.expected_shapes([[10, 300], [2], [257]], ctx_bucket=256, q_len=64)
    assert shapes == {(2, 512, 64): 1, (1, 256, 64): 1, (1, 512, 64): 1}
    plan = [[0, 1], [2], [3, 4, 5]]                 # 3 messages, 2 drafters: drafter 1 gets message 1, then empty
    lengths = [10, 20, 300, 5, 6, 7]
    assert list(sp.plan_step_lengths(plan, lengths, 0, 3, 2, 0)) == [[10, 20], [5, 6, 7]]
    assert list(sp.plan_step_lengths(plan, lengths, 0, 3, 2, 1)) == [[300], [2]]
    assert list(sp.plan_step_lengths(plan, lengths, 1, 2, 2, 0)) == [[300]]    # resumed at cursor 1


# ------------------------------------------------------------------------------------------ startup report

def _tiny_step():
    H, NF, BS, NA, V = 32, 2, 4, 3, 40
    cfg = DrafterModelConfig(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                             intermediate_size=48, num_layers=2, num_feature_layers=NF, rms_norm_eps=1e-6,
                             rope_theta=1e4, block_size=BS, vocab_size=V, max_position_embeddings=256)
    torch.manual_seed(0)
    model = DFlashDrafter(cfg, "sdpa")
    embed, head = torch.randn(V, H), torch.randn(V, H)
    lens = [20, 13]
    ids = torch.randint(0, V - 1, (sum(lens),))
    cu = torch.tensor([0, 20, 33])
    batch = make_batch(ids, torch.ones(sum(lens), dtype=torch.bool), cu, torch.randn(sum(lens), NF * H),
                       num_anchors=NA, block_size=BS, mask_token_id=V - 1, ctx_bucket=16,
                       generator=torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step():
        mask = dense_mask(batch.anchors, batch.valid, batch.ctx_len, BS)
        hidden = model(F.embedding(batch.block_ids, embed), batch.features, batch.ctx_positions,
                       batch.block_positions, mask)
        parts = decayed_ce(hidden, head, batch.labels, BS, 7.0, 64)
        (parts.loss_sum / parts.weight_sum.clamp_min(1e-6)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return model, batch, step


def test_startup_report_names_sdpa_backend_on_cpu():
    model, batch, step = _tiny_step()
    step()  # warm-up
    shape = sp.batch_shape(batch)
    lines = []
    rep = startup_report(step, model, {"b": shape[0], "S_pad": shape[1], "Q": shape[2], "first_step_s": 0.1,
                                       "precompile_s": 12.5}, "cpu", print_fn=lines.append)
    assert rep["backend"] == "sdpa" and rep["ok"]
    assert "dry steps before training 12.5 s, first step 0.1 s" in "\n".join(lines)
    assert rep["attention_calls"]["sdpa"] == model.config.num_layers
    assert any("scaled_dot_product" in k for k in rep["attention_ops"])
    assert rep["peak_memory_bytes"] is None
    assert rep["compile"]["from_cache"].startswith(("n/a", "yes", "no", "partial"))
    assert rep["cache"]["dir"]
    assert "attention backend : sdpa" in lines[0]
    d = dense_attention_bytes(2, 4, 12, 44, 2, 4)
    assert d["scores_plus_probs_per_layer"] == 2 * 2 * 4 * 12 * 44 * 4


def test_dense_score_matrix_detection():
    """A hand-written dense attention on CPU is flagged (the check the CUDA path asserts on)."""
    from dflash_dist.roles.drafter_rank import startup_report as sr
    q, k = torch.randn(1, 2, 12, 8), torch.randn(1, 2, 44, 8)
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        torch.softmax(q @ k.transpose(-1, -2), -1)
    scan = sr._scan_events(prof.events(), 12, 44, cuda=False)
    kinds = {d["kind"] for d in scan["dense"]}
    assert kinds == {"matmul", "softmax"}


def test_cuda_flex_assertions_on_fake_kernel_events():
    """The decision the H200 run makes, fed with a kernel list like the profiler's (no GPU needed)."""
    from types import SimpleNamespace

    from dflash_dist.roles.drafter_rank import startup_report as sr
    cuda = torch.autograd.DeviceType.CUDA

    def ev(name, device_type=cuda, shapes=()):
        return SimpleNamespace(name=name, device_type=device_type, input_shapes=list(shapes))

    good = [ev("triton_tem_fused_flex_attention_0"), ev("triton_tem_fused_flex_attention_backward_1"),
            ev("triton_per_fused__to_copy_mul_sum_2"), ev("aten::mm", torch.autograd.DeviceType.CPU,
                                                           [[64, 32], [32, 48]])]
    scan = sr._scan_events(good, 12, 44, cuda=True)
    fwd, bwd = sr.flex_kernels(scan["kernels"])
    assert list(fwd) == ["triton_tem_fused_flex_attention_0"]
    assert list(bwd) == ["triton_tem_fused_flex_attention_backward_1"]
    assert sr.flex_problems("flex", fwd, bwd, scan["dense"], {"flex_compiled": 2}, 2, 12, 44) == []
    # the eager fallback: no flex kernels, a [.., Q, d] @ [.., d, K] matmul and a softmax over [.., Q, K]
    bad = [ev("aten::matmul", torch.autograd.DeviceType.CPU, [[1, 2, 12, 8], [1, 2, 8, 44]]),
           ev("aten::_softmax", torch.autograd.DeviceType.CPU, [[1, 2, 12, 44], []]), ev("ampere_sgemm_64x64_nn")]
    scan = sr._scan_events(bad, 12, 44, cuda=True)
    fwd, bwd = sr.flex_kernels(scan["kernels"])
    problems = sr.flex_problems("flex", fwd, bwd, scan["dense"], {"flex_compiled": 0}, 2, 12, 44)
    assert len(problems) == 4 and "dense [Q=12, K=44]" in problems[2]


def test_projection_with_a_score_like_shape_is_not_a_score_matrix():
    """Call 20 (H200): 64 anchors x 16 = 1,024 queries, 512 + 1,024 keys, and a kv width of 1,024 give the k_proj
    of [context | block] rows the shapes [1536, 1024] @ [1024, 1024]: 2-D, no head dimension, not scores. The
    same shapes with a head dimension, or a one-head model, still are."""
    from types import SimpleNamespace

    from dflash_dist.roles.drafter_rank import startup_report as sr
    cpu = torch.autograd.DeviceType.CPU

    def ev(name, shapes):
        return SimpleNamespace(name=name, device_type=cpu, input_shapes=shapes)

    projection = [ev("aten::mm", [[1536, 1024], [1024, 1024], [1536, 1024]]),
                  ev("aten::mm", [[1024, 1536], [1536, 1024]])]
    assert sr._scan_events(projection, 1024, 1536, cuda=True)["dense"] == []
    assert len(sr._scan_events(projection, 1024, 1536, cuda=True, min_dims=2)["dense"]) == 2
    per_head = [ev("aten::bmm", [[16, 1024, 128], [16, 128, 1536]]), ev("aten::_softmax", [[1, 16, 1024, 1536], []])]
    assert [d["kind"] for d in sr._scan_events(per_head, 1024, 1536, cuda=True)["dense"]] == ["matmul", "softmax"]


def test_precompile_steps_pick_one_and_several_samples_two_lengths_each():
    """One-sample and several-sample batches apart (dynamo specialises a size of 1), the first two context
    lengths of each, in plan order; the steps after them compile nothing new."""
    from dflash_dist.roles.drafter_rank.shape_plan import precompile_steps
    plan = [[100, 90], [80, 70, 60], [300, 10], [120], [700, 5], [260], [900], [2]]
    # S_pad at bucket 256: 256, 256, 512, 256, 768, 512, 1024, 256
    assert precompile_steps(plan, 256) == [[100, 90], [300, 10], [120], [260]]
    assert precompile_steps([], 256) == []


def test_activation_whose_width_equals_the_micro_batch_queries_is_not_a_score_matrix():
    """drafter.tuning.micro_batches=2 on the embedded default (CPU): 8 anchors x 16 = 128 queries per forward, 128 + 128
    keys, hidden size 128: the k_proj input [b=15, S+Q=256, H=128] has [K, Q]'s last two dimensions. Its leading
    dimension is the batch, not heads or batch x heads; a real [b, heads, Q, K] or [b*heads, Q, K] still counts."""
    from types import SimpleNamespace

    from dflash_dist.roles.drafter_rank import startup_report as sr
    cpu = torch.autograd.DeviceType.CPU

    def ev(name, shapes):
        return SimpleNamespace(name=name, device_type=cpu, input_shapes=shapes)

    lead = {4, 15 * 4}
    activation = [ev("aten::matmul", [[15, 256, 128], [128, 64]])]
    assert len(sr._scan_events(activation, 128, 256, cuda=False)["dense"]) == 1  # the rule without heads
    assert sr._scan_events(activation, 128, 256, cuda=False, lead=lead)["dense"] == []
    scores = [ev("aten::matmul", [[15, 4, 128, 32], [15, 4, 32, 256]]), ev("aten::bmm", [[60, 128, 32], [60, 32, 256]]),
              ev("aten::_softmax", [[15, 4, 128, 256], []])]
    assert len(sr._scan_events(scores, 128, 256, cuda=False, lead=lead)["dense"]) == 3
