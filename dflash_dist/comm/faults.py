"""Fault injection for the failure tests (never active unless the variable is set).

``DFLASH_INJECT_FAULT=<rank>:<message>:<kind>`` makes global rank <rank> misbehave at its <message>-th
message (counting from 0): ``raise`` (an exception, as a bad sample or an OOM would), ``nan`` (non-finite
hidden states in that message), ``nan_all`` (from that message on), ``narrow`` (features one column short
in that message: a wrongly shaped hidden state), ``exit`` (os._exit(3), a hard crash), ``stall`` (a target or
drafter rank that sleeps ``DFLASH_INJECT_STALL_S`` seconds, default 5, before that message's work, as a long
first compile does), ``slow_eval`` (a target whose <message>-th in-training evaluation request sleeps as long after
each of its prompts, as a real model's long decoding takes).
"""

from __future__ import annotations

import os
import time
from typing import Optional


def fault_for(rank: int) -> Optional[tuple[int, str]]:
    spec = os.environ.get("DFLASH_INJECT_FAULT")
    if not spec:
        return None
    r, at, kind = spec.split(":")
    if int(r) != rank:
        return None
    if kind not in ("raise", "nan", "nan_all", "narrow", "exit", "stall", "slow_eval"):
        raise ValueError(f"DFLASH_INJECT_FAULT kind {kind!r}: use raise, nan, nan_all, narrow, exit, stall or "
                         "slow_eval")
    return int(at), kind


def stall_if_due(fault, count: int) -> None:
    """Called by a rank before its count-th message's work: the ``stall`` fault sleeps there."""
    if fault is not None and fault == (count, "stall"):
        time.sleep(float(os.environ.get("DFLASH_INJECT_STALL_S", "5")))


def slow_eval_if_due(fault, request: int) -> None:
    """Called by the evaluating target after each prompt of its request-th evaluation request: ``slow_eval`` sleeps
    there."""
    if fault is not None and fault == (request, "slow_eval"):
        time.sleep(float(os.environ.get("DFLASH_INJECT_STALL_S", "5")))


def apply_target_fault(fault, count: int, features):
    """Called by a target before sending its count-th message."""
    if fault is None:
        return features
    at, kind = fault
    if kind == "raise" and count == at:
        raise RuntimeError(f"injected fault at message {count} (DFLASH_INJECT_FAULT)")
    if kind == "exit" and count == at:
        os._exit(3)
    if kind == "narrow" and count == at:
        return features[:, :-1].contiguous()
    if (kind == "nan" and count == at) or (kind == "nan_all" and count >= at):
        features = features.clone()
        features[0, 0] = float("nan")
    return features
