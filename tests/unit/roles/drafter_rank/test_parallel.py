"""roles/drafter_rank/parallel.py: the drafter wrapped for DDP or FSDP2, its whole state in torch.optim's own format, and the
settings FSDP refuses (one gloo process here; several ranks: tests/integration/test_fsdp.py)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from helpers.standalone_drafter import init_single_process_group

from dflash_dist.config import ConfigError, DrafterConfig
from dflash_dist.roles.drafter_rank.optim import make_step
from dflash_dist.roles.drafter_rank.parallel import (
    DrafterParallel,
    optimizer_state_by_index,
    optimizer_state_by_name,
    resolve_mode,
)
from dflash_dist.model.drafter import DFlashDrafter, DrafterModelConfig

CPU = torch.device("cpu")


def tiny_drafter(seed: int = 0) -> DFlashDrafter:
    torch.manual_seed(seed)
    cfg = DrafterModelConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                             intermediate_size=48, num_layers=2, num_feature_layers=2, rms_norm_eps=1e-6,
                             rope_theta=10000.0, block_size=4, vocab_size=64, max_position_embeddings=256)
    return DFlashDrafter(cfg, "sdpa")


def batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    b, s, q = 2, 8, 8
    mask = torch.rand(b, q, s + q, generator=g) > 0.3
    return (torch.randn(b, q, 32, generator=g), torch.randn(b, s, 64, generator=g),
            torch.arange(s).expand(b, s), torch.arange(s, s + q).expand(b, q), mask)


def train(par: DrafterParallel, opt, step, steps: int = 3) -> list:
    norms = []
    for i in range(steps):
        loss = par.module(*batch(i)).square().mean()
        par.backward(loss, last=True, held=None)
        norms.append(float(step(list(par.model.parameters()), 0.05)))
        opt.zero_grad(set_to_none=True)
    return norms


@pytest.fixture(scope="module")
def group():
    init_single_process_group(CPU)
    return dist.group.WORLD


def test_fsdp_shards_every_layer_and_the_root_and_trains_as_the_plain_model(group):
    plain = tiny_drafter()
    sharded = copy.deepcopy(plain)
    ref = DrafterParallel(plain, "none", None, CPU)
    par = DrafterParallel(sharded, "fsdp", group, CPU, why="drafter.parallel=fsdp")
    assert par.sharded and par.wrapped and not ref.wrapped and ref.module is plain
    assert all(type(p).__name__ == "DTensor" for p in sharded.parameters())
    assert all(hasattr(m, "unshard") for m in [sharded, *sharded.layers])  # FSDP units: each layer, then the root
    assert "FSDP2 over 1 drafter rank(s) (drafter.parallel=fsdp)" in par.describe()
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (plain, sharded)]
    a = train(ref, opts[0], make_step(opts[0], "fused"))
    b = train(par, opts[1], make_step(opts[1], "fused", sharded=True))
    assert a == pytest.approx(b, rel=1e-6) and a[0] > 0.05  # clipped: the norm is over the limit
    weights, optim = par.full_state(opts[1])
    ref_w, ref_o = ref.full_state(opts[0])
    assert list(weights) == list(ref_w) and all(type(v) is torch.Tensor for v in weights.values())
    for k in ref_w:
        torch.testing.assert_close(weights[k], ref_w[k], rtol=0, atol=1e-6)
    # the optimizer state as torch.optim saves it: index-keyed, the same settings
    assert optim["param_groups"] == ref_o["param_groups"] and optim["state"].keys() == ref_o["state"].keys()
    for k, st in ref_o["state"].items():
        torch.testing.assert_close(optim["state"][k]["exp_avg_sq"], st["exp_avg_sq"], rtol=0, atol=1e-9)

    # a checkpoint's state into a new sharded drafter (loaded before sharding, the optimizer after): the same state
    again = tiny_drafter(seed=1)
    again.load_state_dict(weights)
    par2 = DrafterParallel(again, "fsdp", group, CPU)
    opt2 = torch.optim.AdamW(again.parameters(), lr=1e-3)
    par2.load_optimizer(opt2, optim)
    w2, o2 = par2.full_state(opt2)
    assert o2["param_groups"] == optim["param_groups"] and isinstance(o2["param_groups"][0]["betas"], tuple)
    for k in optim["state"]:
        torch.testing.assert_close(o2["state"][k]["exp_avg"], optim["state"][k]["exp_avg"], rtol=0, atol=0)
    assert par2.gathered_weights().keys() == w2.keys() and ref.gathered_weights() is None


def test_ddp_holds_the_whole_model_and_fsdp_refuses_what_it_cannot_keep(group):
    model = tiny_drafter()
    par = DrafterParallel(model, "ddp", group, CPU)
    assert not par.sharded and par.module.module is model and "DDP" in par.describe()
    assert par.fingerprint() == pytest.approx(float(next(model.parameters()).detach().double().sum()))
    with pytest.raises(ValueError, match="none, ddp or fsdp"):
        DrafterParallel(tiny_drafter(), "auto", group, CPU)
    opt = torch.optim.AdamW(tiny_drafter().parameters())
    with pytest.raises(ValueError, match="optimizer_step=auto or fused"):
        make_step(opt, "compiled", sharded=True)
    with pytest.raises(ConfigError, match="unknown keys"):  # the bf16 weight copies were removed
        DrafterConfig(parallel="fsdp", tuning={"compute_weights": "cast"})
    with pytest.raises(ConfigError, match="optimizer_step=auto or fused"):
        DrafterConfig(parallel="fsdp", tuning={"optimizer_step": "compiled"})
    with pytest.raises(ConfigError):
        DrafterConfig(parallel="zero3")


def test_the_mode_an_explicit_setting_or_a_lone_drafter_gets():
    job = SimpleNamespace(cfg=SimpleNamespace(drafter=DrafterConfig(parallel="auto")), dist=SimpleNamespace(drafters=None))
    assert resolve_mode(job, CPU)[0] == "none"
    job.dist.drafters = object()
    job.cfg.drafter = DrafterConfig(parallel="fsdp")
    assert resolve_mode(job, CPU) == ("fsdp", "drafter.parallel=fsdp")


def test_optimizer_state_by_name_and_back():
    state = {"state": {0: {"step": 1}, 2: {"step": 2}},
             "param_groups": [{"lr": 0.1, "betas": (0.9, 0.95), "params": [0, 1, 2]}]}
    names = ["fc.weight", "norm.weight", "layers.0.mlp.up_proj.weight"]
    by_name = optimizer_state_by_name(state, names)
    assert by_name["state"].keys() == {"fc.weight", "layers.0.mlp.up_proj.weight"}
    assert by_name["param_groups"][0]["params"] == names
    assert optimizer_state_by_index(by_name, names) == state
