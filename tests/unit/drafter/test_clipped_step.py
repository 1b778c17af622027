"""drafter/trainer.py clipped_step: gradient clipping folded into a fused optimizer's own pass."""

import copy

import pytest
import torch

from dflash_dist.drafter.trainer import clipped_step


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
