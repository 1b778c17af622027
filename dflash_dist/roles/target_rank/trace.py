"""What a target rank records of its capture: the FLOPs of each batch as it runs (the target's MFU, through the
stats every header carries) and, with logging.debug.trace_target, one JSON line per message in
<run_dir>/target_trace/rank<r>.jsonl (its size, stall, forward, backpressure and evaluation time; dflash-report
summarises the file). Both only read what the loop measured and never change what the rank runs, so the loop
keeps the stream's order and this module the bookkeeping of it.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass

from dflash_dist.targets.hf import decoder_layers, text_config
from dflash_dist.telemetry.flops import target_capture_flops, target_layers_profile

log = logging.getLogger("dflash_dist")


def capture_flops_fn(model, job, packed: bool = False, pad_multiple: int = 1, own_labels: bool = False):
    """lengths [b] -> forward FLOPs of one capture batch (decoder layers up to the last captured one, no lm_head)
    as it runs: padded, b x max(lengths) tokens rounded up to ``pad_multiple``; packed, each sample on its own
    (attention stays inside a sample).
    For the target's MFU in the metrics (``flops.target_forward_flops``). ``own_labels`` (drafter.loss.labels=target):
    every layer and the lm_head over the real tokens."""
    _, layers = decoder_layers(model)
    run = list(layers) if own_labels else list(layers)[: max(job.layer_ids) + 1]
    tc = text_config(job.hf_config)
    head = 2 * tc.hidden_size * tc.vocab_size if own_labels else 0
    # active experts only (MoE), linear-attention layers as they compute, sliding windows their window
    profile = target_layers_profile(run, tc)
    if packed:
        return lambda lengths: (target_capture_flops(profile, tc, [(1, int(n)) for n in lengths])
                                + head * sum(lengths))
    return lambda lengths: (target_capture_flops(profile, tc, [(len(lengths),
                                                                -(-int(max(lengths)) // pad_multiple) * pad_multiple)])
                            + head * sum(lengths))


@dataclass
class MessageTimes:
    """One message's timings, for its trace line: the stream stall and forward before it, then the counters and
    wall time read just before its send (what the send and what follows it add is read off them)."""
    stall_s: float
    capture_s: float
    waited_s: float = 0.0
    evaluated_s: float = 0.0
    wall_s: float = 0.0


def open_trace(job):
    """logging.debug.trace_target: <run_dir>/target_trace/rank<r>.jsonl, one line per message, appended (a resumed job
    continues the file)."""
    path = os.path.join(job.run_dir, "target_trace")
    os.makedirs(path, exist_ok=True)
    log.info("target trace: %s", os.path.join(path, f"rank{job.dist.rank}.jsonl"))
    return open(os.path.join(path, f"rank{job.dist.rank}.jsonl"), "a", buffering=1)


def write_message_line(trace, topo, rank: int, to: int, msg, times: MessageTimes, tx) -> None:
    """Message ``msg``'s line, from ``rank`` to drafter ``to``: its size, wall time, stall and forward, and the
    backpressure and evaluation of ``tx`` (the Sender) since just before its send."""
    trace.write(json.dumps({"message": msg.index, "from": rank, "from_node": topo.node_of(rank),
                            "to": to, "to_node": topo.node_of(to), "samples": msg.num_samples,
                            "tokens": int(msg.cu_seqlens[-1]), "t_s": round(times.wall_s, 4),
                            "stall_ms": round(times.stall_s * 1e3, 3),
                            "capture_ms": round(times.capture_s * 1e3, 3),
                            "backpressure_ms": round((tx.wait_s - times.waited_s) * 1e3, 3),
                            "eval_ms": round((tx.idle_work_s - times.evaluated_s) * 1e3, 3)}) + "\n")
