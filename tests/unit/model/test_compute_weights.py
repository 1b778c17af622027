"""model/compute_weights.py: bf16 compute copies of the fp32 master weights give the numbers autocast's per-forward
casts give (outputs and gradients bit for bit, eager and compiled), are recast whenever a master weight changes in
place, stay out of the state dict, and are written by the optimizer step."""

import copy

import pytest
import torch
from torch import nn

from dflash_dist.config.drafter import DrafterTuning
from dflash_dist.roles.drafter_rank.optim import make_step
from dflash_dist.model.compute_weights import Shadows, resolve_mode


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(64, 96, bias=False)
        self.b = nn.Linear(96, 32, bias=False)
        self.norm = nn.LayerNorm(96)  # not a Linear: no copy

    def forward(self, x):
        return self.b(torch.nn.functional.silu(self.norm(self.a(x))))


def _pair(device="cpu"):
    torch.manual_seed(0)
    ref = _Net().to(device)
    return ref, copy.deepcopy(ref)


def _step(model, x, fn=None):
    model.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        y = (model if fn is None else fn)(x)
    y.float().square().sum().backward()
    return y, x.grad, [p.grad for p in model.parameters()]


@pytest.mark.parametrize("compiled", [False, True])
def test_outputs_and_gradients_equal_autocasts_casts(compiled):
    ref, model = _pair()
    shadows = Shadows(model)
    assert len(shadows.modules) == 2 and shadows.recasts == 2
    x = torch.randn(2, 24, 64)
    fns = (torch.compile(ref), torch.compile(model)) if compiled else (None, None)
    y0, gx0, gw0 = _step(ref, x, fns[0])
    y1, gx1, gw1 = _step(model, x, fns[1])
    assert y1.dtype == torch.bfloat16 and torch.equal(y0, y1) and torch.equal(gx0, gx1)
    assert all(g.dtype == torch.float32 and torch.equal(g0, g) for g0, g in zip(gw0, gw1))
    assert list(model.state_dict()) == list(ref.state_dict())  # the copies are not saved


def test_an_in_place_change_is_recast_before_the_next_forward():
    """A checkpoint load, an optimizer step or any other in-place write to a master weight: the next forward uses
    its new value (without the recast the output would be the stale copy's)."""
    ref, model = _pair()
    shadows = Shadows(model)
    x = torch.randn(3, 64)
    with torch.no_grad():
        for m in (ref, model):
            m.a.weight.mul_(-2.0)
    before = shadows.recasts
    y0, _, _ = _step(ref, x)
    y1, _, _ = _step(model, x)
    assert torch.equal(y0, y1) and shadows.recasts == before + 1  # only the changed weight
    model.load_state_dict(ref.state_dict())
    assert shadows.ensure_fresh() == 2 and shadows.ensure_fresh() == 0


def test_outside_autocast_the_master_weights_compute():
    ref, model = _pair()
    Shadows(model)
    x = torch.randn(4, 64)
    assert torch.equal(ref(x), model(x)) and model(x).dtype == torch.float32


def test_the_fused_step_keeps_the_copies_current():
    _, model = _pair()
    shadows = Shadows(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = make_step(opt, "fused", shadows)
    for _ in range(2):
        _step(model, torch.randn(4, 64))
        step(list(model.parameters()), 1.0)
        assert all(torch.equal(m.weight_compute, m.weight.bfloat16()) for m in shadows.modules)
        assert shadows.ensure_fresh() == 0


def test_modes():
    """cast everywhere; shadow on CUDA only (the CPU computes in fp32: refused, not silently idle)."""
    assert resolve_mode("cast", torch.device("cpu")) == "cast"
    assert resolve_mode("shadow", torch.device("cuda")) == "shadow"
    with pytest.raises(ValueError, match="fp32 on cpu"):
        resolve_mode("shadow", torch.device("cpu"))
    with pytest.raises(ValueError, match="compute_weights"):
        resolve_mode("half", torch.device("cpu"))
    from dflash_dist.config import ConfigError
    with pytest.raises(ConfigError, match="compute_weights"):
        DrafterTuning(compute_weights="half")
    assert DrafterTuning().compute_weights == "cast"
    with pytest.raises(ValueError, match="no fp32"):
        Shadows(nn.Sequential(nn.LayerNorm(4)))


def test_ddp_leaves_the_copies_alone(tmp_path):
    """Each drafter rank writes its own copies: DDP (one gloo rank here) neither broadcasts nor syncs them, while
    the model's other buffers stay its to broadcast."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    _, model = _pair()
    model.register_buffer("table", torch.zeros(3))
    shadows = Shadows(model)
    DDP._set_params_and_buffers_to_ignore_for_model(model, shadows.buffer_names)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        ddp = DDP(model)
        names = {n for n, _ in ddp.module.named_buffers() if n not in ddp.parameters_to_ignore}
        assert shadows.buffer_names == ["a.weight_compute", "b.weight_compute"]
        assert names == {"table"}
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled optimizer step runs on CUDA")
def test_compiled_steps_on_cuda_train_as_autocasts_casts():
    """Three compiled clip + AdamW steps: the copies written inside the compiled region, the weights, outputs and
    gradients bit for bit those of the same steps with autocast's casts."""
    ref, model = _pair("cuda")
    shadows = Shadows(model)
    steps = [make_step(torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True), "compiled", s)
             for m, s in ((ref, None), (model, shadows))]
    recasts = shadows.recasts
    for i in range(3):
        x = torch.randn(8, 64, device="cuda")
        y0, _, g0 = _step(ref, x)
        y1, _, g1 = _step(model, x)
        assert torch.equal(y0, y1) and all(torch.equal(a, b) for a, b in zip(g0, g1)), i
        steps[0](list(ref.parameters()), 1.0)
        steps[1](list(model.parameters()), 1.0)
        assert all(torch.equal(p, q) for p, q in zip(ref.parameters(), model.parameters())), i
        assert all(torch.equal(m.weight_compute, m.weight.bfloat16()) for m in shadows.modules), i
    assert shadows.recasts == recasts  # the optimizer wrote every copy: no recast before a forward
