"""roles/drafter_rank/optim.py: the clip and the AdamW step, fused (the clip folded into the fused kernel's own pass) and
compiled (the clip inside torch's multi-tensor AdamW, one compiled region)."""

import copy

import pytest
import torch

from dflash_dist.config import ConfigError
from dflash_dist.config.drafter import DrafterTuning
from dflash_dist.roles.drafter_rank.optim import CompiledClippedAdamW, _clipped_adamw, clip_factor, fused_clipped_step, make_step

clipped_step = fused_clipped_step


def _models():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    return m, copy.deepcopy(m)


@pytest.mark.parametrize("scale", [100.0, 1e-3])  # clipping active / inactive
def test_fused_step_equals_clip_then_step_without_the_clip_pass(monkeypatch, scale):
    """Fused AdamW (CPU has one too): the same parameters and norm as clip_grad_norm_ + step, to an ulp, and no
    separate pass over the gradients (clip_grad_norm_ / clip_grads_with_norm_ are never called)."""
    m, ref = _models()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    for _ in range(3):
        x = torch.randn(5, 8)
        for model in (m, ref):
            (model(x) ** 2).sum().mul(scale).backward()
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        ref_opt.step()
        with monkeypatch.context() as mp:
            for name in ("clip_grad_norm_", "clip_grads_with_norm_"):
                mp.setattr(torch.nn.utils, name, lambda *a, **k: pytest.fail("a separate clip pass ran"))
            got = clipped_step(opt, list(m.parameters()), 1.0)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        for p, q in zip(m.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
        assert not hasattr(opt, "grad_scale")  # not left on the optimizer
        opt.zero_grad()
        ref_opt.zero_grad()


def test_unfused_step_is_clip_then_step():
    m, ref = _models()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    x = torch.randn(5, 8)
    for model in (m, ref):
        (model(x) ** 2).sum().mul(100).backward()
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
    ref_opt.step()
    torch.testing.assert_close(clipped_step(opt, list(m.parameters()), 1.0), want, rtol=0, atol=0)
    for p, q in zip(m.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


@pytest.mark.parametrize("scale", [100.0, 1e-3])  # clipping active / inactive
def test_the_compiled_steps_math_is_torchs_adamw_on_clipped_gradients(scale):
    """The region ``CompiledClippedAdamW`` compiles, run eager on the CPU (host step counts, a float lr): the
    weights, moments and step counts of clip_grad_norm_ + torch's AdamW, bit for bit, over steps with a changing lr
    and weight decay. A clip factor applied twice, or not at all, fails the clipped case."""
    m, ref = _models()
    params = list(m.parameters())
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, foreach=True)
    exp_avg = [torch.zeros_like(p) for p in params]
    exp_avg_sq = [torch.zeros_like(p) for p in params]
    steps = [torch.tensor(0.0) for _ in params]
    for i in range(4):
        lr = 1e-2 * (i + 1) / 4
        x = torch.randn(5, 8)
        for model in (m, ref):
            (model(x) ** 2).sum().mul(scale).backward()
        ref_opt.param_groups[0]["lr"] = lr
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        ref_opt.step()
        grads = [p.grad for p in params]
        gnorm = torch.nn.utils.get_total_norm(grads, 2.0)
        with torch.no_grad():
            _clipped_adamw(params, grads, exp_avg, exp_avg_sq, steps, clip_factor(gnorm, 1.0), lr, 0.9, 0.95, 1e-8,
                           0.1, False)
        torch.testing.assert_close(gnorm, want, rtol=0, atol=0)
        for p, q, mo, vo, st in zip(params, ref.parameters(), exp_avg, exp_avg_sq, steps):
            state = ref_opt.state[q]
            torch.testing.assert_close(p, q, rtol=0, atol=0)
            torch.testing.assert_close(mo, state["exp_avg"], rtol=0, atol=0)
            torch.testing.assert_close(vo, state["exp_avg_sq"], rtol=0, atol=0)
            assert float(st) == float(state["step"]) == i + 1
        m.zero_grad()
        ref.zero_grad()


def test_step_modes():
    """auto is fused off CUDA; compiled refuses a CPU model (torch's tensor lr needs capturable, an accelerator's);
    an unknown mode is refused, in the config and in make_step."""
    m, _ = _models()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    x = torch.randn(5, 8)
    (m(x) ** 2).sum().backward()
    want = torch.nn.utils.get_total_norm([p.grad for p in m.parameters()], 2.0)
    torch.testing.assert_close(make_step(opt, "auto")(list(m.parameters()), 1.0), want)  # ran the fused step
    assert all(float(opt.state[p]["step"]) == 1 for p in m.parameters())
    with pytest.raises(ValueError, match="runs on CUDA"):
        make_step(opt, "compiled")
    with pytest.raises(ValueError, match="optimizer_step"):
        make_step(opt, "foreach")
    with pytest.raises(ConfigError, match="optimizer_step"):
        DrafterTuning(optimizer_step="foreach")
    with pytest.raises(TypeError, match="AdamW"):
        CompiledClippedAdamW(torch.optim.SGD(m.parameters(), lr=0.1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled step runs on CUDA")
def test_compiled_step_on_cuda_equals_the_fused_step_and_resumes_as_fused():
    """On CUDA: compiled vs fused, 4 steps each from the same state (weights within fp32 rounding), a parameter
    without a gradient left alone, and the compiled step's state dict loaded into a fused AdamW that goes on equal."""
    torch.manual_seed(0)
    dev = torch.device("cuda")
    m = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 32), torch.nn.Linear(32, 8)).to(dev)
    ref = copy.deepcopy(m)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    step, ref_step = make_step(opt, "compiled"), make_step(ref_opt, "fused")
    for i in range(4):
        x = torch.randn(16, 64, device=dev)
        for model, o in ((m, opt), (ref, ref_opt)):
            o.param_groups[0]["lr"] = 1e-2 / (i + 1)
            (model[1](model[0](x)) ** 2).sum().mul(50).backward()  # model[2] gets no gradient
        g, rg = step(list(m.parameters()), 1.0), ref_step(list(ref.parameters()), 1.0)
        torch.testing.assert_close(g, rg, rtol=1e-5, atol=0)  # the weights differ by rounding, so do the gradients
        # the fused kernel and the foreach ops round differently: within 1e-4 of one update (lr 1e-2). Adam
        # amplifies such differences where a moment is tiny, so each step starts again from the fused one's state
        for p, q in zip(m.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
            with torch.no_grad():
                p.copy_(q)
                for key in ("exp_avg", "exp_avg_sq", "step"):
                    if opt.state[p]:
                        opt.state[p][key].copy_(ref_opt.state[q][key])
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
    assert not opt.state[m[2].weight]  # never stepped
    resumed = copy.deepcopy(m)
    resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=1e-3, fused=True)
    resumed_opt.load_state_dict(opt.state_dict())
    x = torch.randn(16, 64, device=dev)
    for model, o in ((resumed, resumed_opt), (ref, ref_opt)):
        o.param_groups[0]["lr"] = 1e-3
        (model[1](model[0](x)) ** 2).sum().backward()
        fused_clipped_step(o, list(model.parameters()), 1.0)
    for p, q in zip(resumed.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
