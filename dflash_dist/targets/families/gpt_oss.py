"""gpt-oss: alternating sliding-window / full attention, a learned sink logit per head, and its own MoE.

What the default rules read from it: every attention layer's ``self_attn.sliding_window`` (the packed capture
builds one BlockMask per window) and ``self_attn.sinks`` (passed to attention as ``s_aux``; the packed flex output
is renormalised with the sink logit through flex's log-sum-exp, as transformers' flex path does). Its
``intermediate_size`` is the experts' width, which the drafter's MLP takes; its experts are reported by
``moe.experts_report``. transformers declares no sdpa for it (the sinks), so ``target.attn_implementation=auto``
picks eager on CPU and flex_attention on CUDA (``targets/hf.py``)."""

from __future__ import annotations

from dataclasses import replace

from dflash_dist.targets.families.dense import DEFAULT

FAMILIES = (
    replace(DEFAULT, name="gpt_oss", model_types=("gpt_oss",)),
)
