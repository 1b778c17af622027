"""The packed row's pieces alone: its length rule and the packed attention function (the packed capture against
the padded one: test_target.py, test_packing_families.py, test_hybrid_packed_capture.py)."""

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import dflash_dist.roles.target_rank.packing as packing
from dflash_dist.roles.target_rank.packing import packed_row_tokens


def test_packed_row_tokens():
    """The packed row is padded (with one more sample) so the compiled flex kernels never meet a one-block row:
    CPU to a power of two >= 256, CUDA to at least 256 tokens and no further."""
    assert [packed_row_tokens(t, "cpu") for t in (1, 100, 256, 257, 3000)] == [256, 256, 256, 512, 4096]
    assert [packed_row_tokens(t, "cuda") for t in (1, 100, 128, 256, 257, 3000)] == [256, 256, 256, 256, 257, 3000]


def test_sink_lse_renormalisation_matches_eager_sinks():
    """The CUDA path of sinks (flex log-sum-exp renormalisation, as transformers' flex path) equals gpt-oss's eager
    softmax over [scores | sink]; run here with flex uncompiled on tiny sizes."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 128, 8, generator=g) for _ in range(3))
    sinks = torch.randn(4, generator=g)
    causal = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, 128, 128, device="cpu")
    orig = packing._flex_static
    packing._flex_static = flex_attention  # eager flex: CPU's compiled one cannot return the LSE
    try:
        out, _ = packing.packed_flex_attention(None, q, k, v, causal, scaling=8 ** -0.5, s_aux=sinks)
    finally:
        packing._flex_static = orig
    scores = (q @ k.transpose(-1, -2)) * 8 ** -0.5
    scores = scores.masked_fill(~torch.ones(128, 128, dtype=torch.bool).tril(), float("-inf"))
    logits = torch.cat([scores, sinks.view(1, -1, 1, 1).expand(1, 4, 128, 1)], -1)
    ref = (torch.softmax(logits, -1)[..., :-1] @ v).transpose(1, 2)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
