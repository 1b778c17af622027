"""The DFlash2 grouped dynamic causal convolution as one Triton kernel per direction (CUDA): a measured
alternative to the package's torch form (``GroupedDynamicConv._conv``), not used by the package.

One forward kernel reads x and the per-token deltas once and writes the output; one backward kernel reads the
output gradient and x once and writes the input gradient, the delta gradient (each group's channel sum) and
per-tile partial sums of the base kernel's gradient, which one small reduction finishes. Coefficients in fp32.
The ops are ``torch.library.triton_op`` s with their autograd registered, so compiled graphs keep them whole.

Each kernel alone runs near the copy bandwidth on an H200 (4096 x 4096: forward 21 us bf16 / 37 us fp32, a clone
19 / 33 us; backward 56 / 75 us), but wired into the drafter step it saved no step time: inductor fuses the torch
form's forward into the norm and residual kernels around it, which a separate kernel cannot join
(docs/benchmarks.md#dflash2-step). ``bench/dflash2_conv.py --forms triton`` times it.
"""

from __future__ import annotations

import importlib.util

import torch
from torch import Tensor

__all__ = ["supports", "available", "grouped_dynamic_conv"]

HAVE_TRITON = importlib.util.find_spec("triton") is not None
# tiles of 64 rows x 64 channels, 4 warps: the fastest forward + backward of a sweep on an H200 at 4096 x 4096
ROWS_PER_TILE, MAX_CHANNELS_PER_TILE, NUM_WARPS = 64, 64, 4


def channels_per_tile(hidden: int, group_size: int) -> int:
    """The widest channel tile (<= MAX_CHANNELS_PER_TILE) that divides the hidden size and holds whole groups;
    0 when none."""
    for bc in (64, 32, 16):
        if bc > MAX_CHANNELS_PER_TILE:
            continue
        if hidden % bc == 0 and bc % group_size == 0:
            return bc
    return 0


def supports(group_size: int, hidden: int) -> bool:
    """Whether the kernels take this shape on CUDA: triton importable, a power-of-two group that tiles H."""
    pow2 = group_size > 0 and group_size & (group_size - 1) == 0
    return HAVE_TRITON and pow2 and channels_per_tile(hidden, group_size) > 0


def available(x: Tensor, group_size: int, hidden: int) -> bool:
    """Whether ``grouped_dynamic_conv`` takes this input (otherwise the caller runs the torch form)."""
    return x.is_cuda and supports(group_size, hidden)


if HAVE_TRITON:
    import triton
    import triton.language as tl
    from torch.library import triton_op, wrap_triton

    @triton.jit
    def _group_deltas(d_ptr, rows, tile_groups, live, tap, d_row_stride, d_tap_stride, BT: tl.constexpr,
                      BC: tl.constexpr, GROUP: tl.constexpr):
        """The tile's deltas [BT, BC] in fp32: one load per group, broadcast over its channels (a load per
        channel of the same address measured 5-7x slower)."""
        dg = tl.load(d_ptr + rows[:, None] * d_row_stride + tap * d_tap_stride + tile_groups[None, :],
                     mask=live[:, None], other=0.0).to(tl.float32)
        return tl.reshape(tl.broadcast_to(dg[:, :, None], (BT, BC // GROUP, GROUP)), (BT, BC))

    @triton.jit
    def _conv_fwd_kernel(x_ptr, d_ptr, b_ptr, out_ptr, n_rows, hidden, d_row_stride, d_tap_stride,
                         BLOCK_SIZE: tl.constexpr, TAPS: tl.constexpr, GROUP: tl.constexpr,
                         BT: tl.constexpr, BC: tl.constexpr):
        rows = tl.program_id(0) * BT + tl.arange(0, BT)
        cols = tl.program_id(1) * BC + tl.arange(0, BC)
        in_rows = rows < n_rows
        pos = rows % BLOCK_SIZE                      # position in the block: a tap never crosses a block start
        tile_groups = tl.program_id(1) * (BC // GROUP) + tl.arange(0, BC // GROUP)
        acc = tl.zeros((BT, BC), dtype=tl.float32)
        for tap in tl.static_range(TAPS):
            live = in_rows & (pos >= tap)
            xv = tl.load(x_ptr + (rows - tap)[:, None] * hidden + cols[None, :], mask=live[:, None], other=0.0)
            dv = _group_deltas(d_ptr, rows, tile_groups, in_rows, tap, d_row_stride, d_tap_stride, BT, BC, GROUP)
            bv = tl.load(b_ptr + tap * hidden + cols)
            acc += xv.to(tl.float32) * (bv.to(tl.float32)[None, :] + dv)
        tl.store(out_ptr + rows[:, None] * hidden + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=in_rows[:, None])

    @triton.jit
    def _conv_bwd_kernel(go_ptr, x_ptr, d_ptr, b_ptr, gx_ptr, gd_ptr, gb_ptr, n_rows, hidden, d_row_stride,
                         d_tap_stride, BLOCK_SIZE: tl.constexpr, TAPS: tl.constexpr, GROUP: tl.constexpr,
                         BT: tl.constexpr, BC: tl.constexpr):
        pid_t, pid_c = tl.program_id(0), tl.program_id(1)
        rows = pid_t * BT + tl.arange(0, BT)
        cols = pid_c * BC + tl.arange(0, BC)
        in_rows = rows < n_rows
        pos = rows % BLOCK_SIZE
        n_groups = hidden // GROUP
        tile_groups = pid_c * (BC // GROUP) + tl.arange(0, BC // GROUP)
        go = tl.load(go_ptr + rows[:, None] * hidden + cols[None, :], mask=in_rows[:, None], other=0.0)
        go = go.to(tl.float32)
        gx = tl.zeros((BT, BC), dtype=tl.float32)
        for tap in tl.static_range(TAPS):
            # x[t] feeds out[t + tap] through tap `tap`, unless t + tap starts a new block (position < tap)
            dst = rows + tap
            feeds = (dst < n_rows) & ((dst % BLOCK_SIZE) >= tap)
            go_dst = tl.load(go_ptr + dst[:, None] * hidden + cols[None, :], mask=feeds[:, None], other=0.0)
            d_dst = _group_deltas(d_ptr, dst, tile_groups, feeds, tap, d_row_stride, d_tap_stride, BT, BC, GROUP)
            bv = tl.load(b_ptr + tap * hidden + cols).to(tl.float32)
            gx += go_dst.to(tl.float32) * (bv[None, :] + d_dst)
            # d out[t] / d coef[t, tap] = x[t - tap] where the tap is live at t
            live = in_rows & (pos >= tap)
            xv = tl.load(x_ptr + (rows - tap)[:, None] * hidden + cols[None, :], mask=live[:, None], other=0.0)
            prod = go * xv.to(tl.float32)
            gd = tl.sum(tl.reshape(prod, (BT, BC // GROUP, GROUP)), axis=2)
            tl.store(gd_ptr + rows[:, None] * (TAPS * n_groups) + tap * n_groups + tile_groups[None, :],
                     gd.to(gd_ptr.dtype.element_ty), mask=in_rows[:, None])
            tl.store(gb_ptr + pid_t * (TAPS * hidden) + tap * hidden + cols, tl.sum(prod, axis=0))
        tl.store(gx_ptr + rows[:, None] * hidden + cols[None, :], gx.to(gx_ptr.dtype.element_ty),
                 mask=in_rows[:, None])

    def _rows(x: Tensor, delta: Tensor) -> tuple[Tensor, Tensor]:
        """x as [N, H] and delta as [N, k, G] rows (views where the layouts allow), group stride 1."""
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        d3 = delta.reshape(-1, delta.shape[-2], delta.shape[-1])
        if d3.stride(-1) != 1:
            d3 = d3.contiguous()
        return x2, d3

    @triton_op("dflash_bench::grouped_dynamic_conv_fwd", mutates_args=())
    def _conv_fwd(x: Tensor, delta: Tensor, base: Tensor, block_size: int, group_size: int) -> Tensor:
        x2, d3 = _rows(x, delta)
        n, hidden = x2.shape
        out = torch.empty_like(x2)
        bc = channels_per_tile(hidden, group_size)
        bt = ROWS_PER_TILE
        grid = (triton.cdiv(n, bt), hidden // bc)
        wrap_triton(_conv_fwd_kernel)[grid](x2, d3, base, out, n, hidden, d3.stride(0), d3.stride(1),
                                            BLOCK_SIZE=block_size, TAPS=base.shape[0], GROUP=group_size,
                                            BT=bt, BC=bc, num_warps=NUM_WARPS)
        return out.view(x.shape)

    @triton_op("dflash_bench::grouped_dynamic_conv_bwd", mutates_args=())
    def _conv_bwd(grad_out: Tensor, x: Tensor, delta: Tensor, base: Tensor, block_size: int, group_size: int
                  ) -> tuple[Tensor, Tensor, Tensor]:
        x2, d3 = _rows(x, delta)
        go = grad_out.reshape(x2.shape).contiguous()
        n, hidden = x2.shape
        bt = ROWS_PER_TILE
        taps, tiles = base.shape[0], triton.cdiv(n, bt)
        bc = channels_per_tile(hidden, group_size)
        gx = torch.empty_like(x2)
        gd = torch.empty(n, taps, hidden // group_size, device=x.device, dtype=delta.dtype)
        gb_tiles = torch.empty(tiles, taps, hidden, device=x.device, dtype=torch.float32)
        wrap_triton(_conv_bwd_kernel)[(tiles, hidden // bc)](
            go, x2, d3, base, gx, gd, gb_tiles, n, hidden, d3.stride(0), d3.stride(1), BLOCK_SIZE=block_size,
            TAPS=taps, GROUP=group_size, BT=bt, BC=bc, num_warps=NUM_WARPS)
        return gx.view(x.shape), gd.view(delta.shape), gb_tiles.sum(0).to(base.dtype)

    def _setup_context(ctx, inputs, output) -> None:
        x, delta, base, block_size, group_size = inputs
        ctx.save_for_backward(x, delta, base)
        ctx.block_size, ctx.group_size = block_size, group_size

    def _backward(ctx, grad_out):
        x, delta, base = ctx.saved_tensors
        gx, gd, gb = _conv_bwd(grad_out, x, delta, base, ctx.block_size, ctx.group_size)
        return gx, gd, gb, None, None

    _conv_fwd.register_autograd(_backward, setup_context=_setup_context)


def grouped_dynamic_conv(x: Tensor, delta: Tensor, base: Tensor, block_size: int, group_size: int) -> Tensor:
    """out[t] = sum_tap (base[tap] + delta[t, tap, c // g]) * x[t - tap], a tap zeroed where the position in
    the block (row index mod ``block_size``) is < tap. x [..., Q, H]; delta [..., Q, k, G]; base [k, H] (the
    side's kernel, any float dtype). Output in x's dtype. Only where ``available`` says so."""
    if not available(x, group_size, x.shape[-1]):
        raise RuntimeError("grouped_dynamic_conv needs a CUDA tensor, triton and a power-of-two group that tiles "
                           "the hidden size: run the torch form")
    return _conv_fwd(x, delta, base, int(block_size), int(group_size))
