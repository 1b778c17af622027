"""The FP8 linear: per-channel quantization, the FP8 GEMM path against the dequantize reference, no graph break
under torch.compile, and the per-layer cosine."""

import pytest
import torch
from torch import nn

from dflash_dist.targets.quant.compare import layer_cosines
from dflash_dist.targets.quant.fp8 import FP8_DTYPE, FP8Linear, default_kernel, expand_block_scales, quantize_rows


def _linear(out=96, inp=64, bias=True):
    torch.manual_seed(0)
    lin = nn.Linear(inp, out, bias=bias)
    with torch.no_grad():
        lin.weight.mul_(torch.linspace(0.1, 10, out)[:, None])  # rows of very different ranges: per-row scales matter
    return lin


def test_quantize_rows_maps_each_row_amax_to_the_largest_fp8_value():
    w = _linear().weight.detach()
    q, scale = quantize_rows(w)
    assert q.dtype == FP8_DTYPE and scale.shape == (96,)
    assert torch.allclose(q.float().abs().amax(dim=1), torch.full((96,), 448.0))
    rel = ((q.float() * scale[:, None] - w).abs() / w.abs().amax(dim=1, keepdim=True)).max()
    assert rel < 2 ** -4  # e4m3: 3 mantissa bits


def test_block_scales_expand_to_every_element():
    grid = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    full = expand_block_scales(grid, (3, 5), (2, 3))
    assert full.shape == (3, 5)
    assert full[0, 0] == 1 and full[1, 2] == 1 and full[0, 3] == 2 and full[2, 0] == 3 and full[2, 4] == 4


def test_reference_kernel_is_the_dequantized_weights_matmul():
    lin = _linear()
    fp8 = FP8Linear.from_linear(lin, "dequantize")
    x = torch.randn(3, 7, 64)
    want = torch.nn.functional.linear(x, fp8.dequantized_weight(torch.float32), lin.bias)
    assert torch.equal(fp8(x), want)
    assert torch.nn.functional.cosine_similarity(fp8(x).flatten(0, 1), lin(x).flatten(0, 1), dim=-1).min() > 0.999


def test_scaled_mm_kernel_quantizes_activations_per_token():
    """The FP8 GEMM path (torch._scaled_mm runs on CPU too in this torch): close to the reference, not equal to
    it (the activations are rounded to e4m3 per token), and every token's own scale is used: a token 1000x larger
    than the others comes out 1000x larger."""
    lin = _linear(bias=False)
    fast, ref = FP8Linear.from_linear(lin, "scaled_mm"), FP8Linear.from_linear(lin, "dequantize")
    x = torch.randn(2, 5, 64)
    x[0, 0] *= 1000
    y, r = fast(x), ref(x)
    assert y.shape == (2, 5, 96) and y.dtype == x.dtype
    assert not torch.equal(y, r)
    assert torch.nn.functional.cosine_similarity(y.flatten(0, 1), r.flatten(0, 1), dim=-1).min() > 0.998
    assert torch.allclose(y[0, 1:].norm(dim=-1), r[0, 1:].norm(dim=-1), rtol=0.02)


def test_fp8_linear_compiles_without_graph_breaks():
    fast = FP8Linear.from_linear(_linear(), "scaled_mm")
    compiled = torch.compile(fast, backend="eager", fullgraph=True, dynamic=True)  # fullgraph: a break raises
    for rows in (5, 11):
        x = torch.randn(rows, 64)
        assert torch.equal(compiled(x), fast(x))


def test_kernels_and_shapes_are_checked():
    lin = _linear()
    with pytest.raises(ValueError, match="kernel"):
        FP8Linear.from_linear(lin, "fast")
    with pytest.raises(ValueError, match="float8"):
        FP8Linear(lin.weight.detach(), torch.ones(96), None, "scaled_mm", "test")
    assert default_kernel("cpu") == "dequantize"


def test_layer_cosines_per_captured_layer():
    ref = torch.randn(10, 3 * 8)
    test = ref.clone()
    test[:, 8:16] = -test[:, 8:16]  # the second layer's features flipped
    cos = layer_cosines(ref, test, 3)
    assert [round(c["mean"], 5) for c in cos] == [1.0, -1.0, 1.0]
    with pytest.raises(ValueError, match="shapes"):
        layer_cosines(ref, test[:5], 3)
