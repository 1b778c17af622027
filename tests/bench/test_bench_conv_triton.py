"""bench/_conv_triton.py: the DFlash2 convolution's Triton kernels against the package's torch form.

On CUDA the kernels run as the bench runs them; where triton is installed without a GPU they run in triton's
interpreter (a subprocess with TRITON_INTERPRET=1, on CPU tensors). The torch form is the one the hand vectors and
the parity with speculators hold (tests/unit/model/test_dflash2.py)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch
from helpers.launch_util import REPO

from dflash_dist.model.variants.dflash2.layers import GroupedDynamicConv

sys.path.insert(0, os.path.join(REPO, "bench"))
import _conv_triton as DC  # noqa: E402

HAVE_TRITON = importlib.util.find_spec("triton") is not None
CUDA = torch.cuda.is_available() and HAVE_TRITON
# (batch, rows per sample, hidden, block size, taps, group): full tiles, partial row tiles, 3 taps, group 8
SHAPES = [(1, 128, 128, 8, 2, 16), (2, 48, 96, 16, 3, 8), (1, 40, 32, 4, 2, 16)]


def test_channel_tile_holds_whole_groups_and_divides_hidden():
    assert DC.channels_per_tile(4096, 16) == 64
    assert DC.channels_per_tile(6656, 16) == 64
    assert DC.channels_per_tile(96, 8) == 32
    assert DC.channels_per_tile(48, 16) == 16
    assert DC.channels_per_tile(40, 16) == 0       # no tile: the torch form runs
    assert not DC.supports(24, 4096)               # not a power of two
    assert DC.supports(16, 4096) == HAVE_TRITON


def test_cpu_tensors_take_the_torch_form():
    conv = GroupedDynamicConv(32, 2, 16)
    x = torch.randn(1, 8, 32)
    assert not DC.available(x, 16, 32)
    with pytest.raises(RuntimeError, match="torch form"):
        DC.grouped_dynamic_conv(x, torch.zeros(1, 8, 2, 2), conv.base_kernel[0], 4, 16)


def compare(device: str, dtype=torch.float32, compiled: bool = False) -> list[float]:
    """Largest |kernel - torch form| of the output and of the x, base and projection gradients, both sides, over
    SHAPES; the torch form in fp32 on the same (dtype-rounded) values."""
    torch.manual_seed(0)
    worst = []
    for b, q, hidden, block, taps, group in SHAPES:
        conv = GroupedDynamicConv(hidden, taps, group).to(device)
        with torch.no_grad():  # away from the identity init, so every term counts
            conv.base_kernel.normal_(0, 0.5)
            conv.kernel_projection.weight.normal_(0, 0.1)
        x = torch.randn(b, q, hidden, device=device).to(dtype).float()
        go = torch.randn(b, q, hidden, device=device).to(dtype).float()
        kernel = DC._conv_fwd
        if compiled:
            kernel = torch.compile(DC._conv_fwd, fullgraph=True)
        for side in (0, 1):
            results = []
            for form in ("torch", "kernel"):
                xx = (x if form == "torch" else x.to(dtype)).detach().requires_grad_()
                conv.zero_grad(set_to_none=True)
                delta = conv.kernel_projection(xx.float()).unflatten(-1, (2, taps, hidden // group))[..., side, :, :]
                if form == "torch":
                    out = conv._conv(xx, delta, side, block)
                else:
                    out = kernel(xx, delta.to(dtype), conv.base_kernel[side], block, group)
                (out.float() * go).sum().backward()
                results.append([out.float(), xx.grad.float(), conv.base_kernel.grad.clone(),
                                conv.kernel_projection.weight.grad.clone()])
            ref, got = results
            worst.append(max(float(((g - r).abs().max() / r.abs().max().clamp_min(1.0))) for g, r in zip(got, ref)))
    return worst


def leak(device: str) -> tuple[float, float]:
    """(change of block 1's first output row, gradient reaching block 0's last input row from block 1's first
    output) when block 0's last row moves: both 0 for a conv causal within the block."""
    conv = GroupedDynamicConv(32, 2, 16).to(device)
    with torch.no_grad():
        conv.base_kernel.fill_(1.0)
    x = torch.randn(1, 8, 32, device=device, requires_grad=True)
    delta = torch.zeros(1, 8, 2, 2, device=device)
    out = DC._conv_fwd(x, delta, conv.base_kernel[0], 4, 16)
    x2 = x.detach().clone()
    x2[0, 3] += 100.0
    moved = float((DC._conv_fwd(x2, delta, conv.base_kernel[0], 4, 16)[0, 4] - out[0, 4]).abs().max())
    out[0, 4].sum().backward()
    return moved, float(x.grad[0, 3].abs().max())


@pytest.mark.skipif(not CUDA, reason="CUDA with triton")
@pytest.mark.parametrize("dtype,compiled,tol", [(torch.float32, False, 1e-5), (torch.float32, True, 1e-5),
                                                (torch.bfloat16, True, 2e-2)])
def test_kernels_equal_the_torch_form_on_cuda(dtype, compiled, tol):
    assert max(compare("cuda", dtype, compiled)) < tol


@pytest.mark.skipif(not CUDA, reason="CUDA with triton")
def test_no_tap_crosses_a_block_on_cuda():
    assert leak("cuda") == (0.0, 0.0)


_INTERPRETED = """
import sys
sys.path[:0] = [{here!r}, {tests!r}]
from test_bench_conv_triton import compare, leak
print(max(compare("cpu")), *leak("cpu"))
"""


@pytest.mark.skipif(not HAVE_TRITON, reason="triton installed (its interpreter runs the kernels on CPU)")
def test_kernels_in_triton_interpreter_equal_the_torch_form():
    env = dict(os.environ, TRITON_INTERPRET="1")
    here = os.path.dirname(os.path.abspath(__file__))
    code = _INTERPRETED.format(here=here, tests=os.path.dirname(here))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    worst, moved, grad = map(float, r.stdout.split()[-3:])
    assert worst < 1e-5 and moved == 0.0 and grad == 0.0
