"""The split arithmetic, torch-free: the job rate of every target/drafter split from measured per-rank rates,
the choice (fewest targets within the noise), and how rates are summarised from timed rounds (bench/plan_split.py
runs it without torch)."""

from __future__ import annotations

import math
import statistics
import time
from typing import Callable, Optional

MAX_ROUNDS_FACTOR = 10  # plan_min_seconds adds rounds up to this many times plan_rounds


def _spread(name: str, value: float, rng) -> tuple[float, float]:
    if rng is None:
        return value, value
    lo, hi = float(rng[0]), float(rng[1])
    if not (0 < lo <= value <= hi and math.isfinite(hi)):
        raise ValueError(f"{name} spread {rng}: need 0 < min <= {value} (the median) <= max, finite")
    return lo, hi


def choose_split(world_size: int, supply_per_rank: float, demand_per_rank: float,
                 supply_range: Optional[tuple[float, float]] = None,
                 demand_range: Optional[tuple[float, float]] = None, tensor_parallel: int = 1,
                 colocated: bool = True) -> dict:
    """Every split T + D = W with its predicted job rate min(T * supply, D * demand) samples/s, and colocated
    (T = 0: every rank captures and trains, W / (1/supply + 1/demand) samples/s; with ``tensor_parallel`` 1 only),
    and the chosen one (``colocated`` False: among the T + D splits only): the fastest, unless a split with fewer
    targets is a near-tie (the drafters are the ranks that train; colocated counts as none). Colocated never predicts less than a split (it is the balance the splits
    approach in whole ranks); what it costs, a whole target on every GPU, is the memory plan's to refuse.

    ``supply_range`` / ``demand_range``: the measured (min, max) around each median rate. Each row then also
    has ``samples_per_s_low`` / ``_high`` (both sides at their slowest / fastest round), and a split is a
    near-tie of the fastest when its predicted rate (medians) reaches the fastest split's ``samples_per_s_low``:
    the fewest targets among those is chosen. Without ranges the spread is zero: exact ties go to fewer targets.
    ``tensor_parallel`` k > 1: splits of whole replicas of k ranks (T a multiple of k); ``supply_per_rank`` is then
    a replica's supply / k.

    Returns ``rows`` (one per T: targets, drafters, supply, demand, samples_per_s, per_gpu, bottleneck,
    target_util, drafter_util[, samples_per_s_low, samples_per_s_high]), ``best`` (the chosen row),
    ``target_ranks``, ``drafter_ranks``, ``predicted_samples_per_s``, ``bottleneck`` (the side that sets the
    pace: target, drafter or both), ``fastest_targets`` (T of the fastest row by the medians), ``near_tie``
    (the choice has fewer targets than that), ``continuous_optimum_targets`` (T* = W d / (s + d), where both
    sides balance) and ``ideal_samples_per_s``."""
    w, s, d = int(world_size), float(supply_per_rank), float(demand_per_rank)
    k = int(tensor_parallel)
    if w < 2 and (k > 1 or not colocated):
        raise ValueError(f"world_size={world_size}: a split needs at least 2 ranks (one target, one drafter)")
    if not (s > 0 and d > 0 and math.isfinite(s) and math.isfinite(d)):
        raise ValueError(f"supply {supply_per_rank} and demand {demand_per_rank} must be positive and finite")
    s_lo, s_hi = _spread("supply", s, supply_range)
    d_lo, d_hi = _spread("demand", d, demand_range)
    spread = supply_range is not None or demand_range is not None
    if k > 1 and w <= k:
        raise ValueError(f"world_size={world_size}: a replica of {k} ranks leaves no drafter")
    rows = []
    if k == 1 and colocated:  # colocated: each rank captures a sample (1/s) and trains on it (1/d), one after the other
        rate = w * s * d / (s + d)
        row = {"targets": 0, "drafters": w, "supply": w * s, "demand": w * d, "samples_per_s": rate, "per_gpu": rate / w,
               "bottleneck": "colocated", "target_util": rate / (w * s), "drafter_util": rate / (w * d)}
        if spread:
            row.update(samples_per_s_low=w * s_lo * d_lo / (s_lo + d_lo), samples_per_s_high=w * s_hi * d_hi / (s_hi + d_hi))
        rows.append(row)
    for t in range(k, w, k):  # whole replicas of k ranks; supply_per_rank is then a replica's supply / k
        sup, dem = t * s, (w - t) * d
        rate = min(sup, dem)
        row = {"targets": t, "drafters": w - t, "supply": sup, "demand": dem, "samples_per_s": rate,
               "per_gpu": rate / w,
               "bottleneck": "target" if sup < dem else ("drafter" if dem < sup else "both"),
               "target_util": rate / sup, "drafter_util": rate / dem}
        if spread:
            row.update(samples_per_s_low=min(t * s_lo, (w - t) * d_lo), samples_per_s_high=min(t * s_hi, (w - t) * d_hi))
        rows.append(row)
    fastest = max(rows, key=lambda r: (r["samples_per_s"], -r["targets"]))
    floor = fastest.get("samples_per_s_low", fastest["samples_per_s"])
    best = min((r for r in rows if r["samples_per_s"] >= floor), key=lambda r: r["targets"])
    res = {"world_size": w, "supply_per_rank": s, "demand_per_rank": d, "rows": rows, "best": best,
           "target_ranks": best["targets"], "drafter_ranks": best["drafters"],
           "predicted_samples_per_s": best["samples_per_s"], "bottleneck": best["bottleneck"],
           "fastest_targets": fastest["targets"], "near_tie": best["targets"] < fastest["targets"],
           "continuous_optimum_targets": w * d / (s + d), "ideal_samples_per_s": w * s * d / (s + d)}
    if spread:
        res.update(supply_range=[s_lo, s_hi], demand_range=[d_lo, d_hi])
    return res


def format_splits(res: dict) -> str:
    """The table of one ``choose_split`` result and the choice, as printed by rank 0 and dflash-plan."""
    spread = "samples_per_s_low" in res["rows"][0]
    rng = f" {'spread (min..max)':>19}" if spread else ""
    lines = [f"  {'targets':>7} {'drafters':>8} {'supply':>10} {'demand':>10} {'job samples/s':>13}{rng} "
             f"{'target load':>11} {'drafter load':>12}  bound by"]
    for r in res["rows"]:
        mark = "  <- chosen" if r["targets"] == res["target_ranks"] else ""
        if r["targets"] == res.get("fastest_targets") and res.get("near_tie"):
            mark = "  <- fastest by the medians"
        cell = f" {r['samples_per_s_low']:>9.4g}..{r['samples_per_s_high']:<8.4g}" if spread else ""
        lines.append(f"  {r['targets']:>7} {r['drafters']:>8} {r['supply']:>10.4g} {r['demand']:>10.4g} "
                     f"{r['samples_per_s']:>13.4g}{cell} {100 * r['target_util']:>10.0f}% "
                     f"{100 * r['drafter_util']:>11.0f}%  {r['bottleneck']}{mark}")
    lines.append(f"  chosen: {split_name(res['target_ranks'], res['drafter_ranks'])}, predicted "
                 f"{res['predicted_samples_per_s']:.4g} samples/s, bottleneck: {res['bottleneck']}")
    if any(r["targets"] == 0 for r in res["rows"]):
        lines.append("  (0 targets: colocated, every rank captures its own messages and trains on them)")
    if res.get("near_tie"):
        fast = next(r for r in res["rows"] if r["targets"] == res["fastest_targets"])
        lines.append(f"  near-tie: {fast['targets']} + {fast['drafters']} predicts {fast['samples_per_s']:.4g} "
                     f"samples/s but as little as {fast['samples_per_s_low']:.4g} within the measured spread, which "
                     f"{res['target_ranks']} + {res['drafter_ranks']} reaches: the fewer targets win")
    return "\n".join(lines)


def split_name(targets: int, drafters: int) -> str:
    return (f"colocated on {drafters} rank(s)" if targets == 0
            else f"{targets} target + {drafters} drafter ranks")


def _spread_text(m: dict) -> str:
    if "samples_per_s_min" not in m:
        return ""
    med = m["samples_per_s"]
    return (f" [median of {m['rounds']} rounds; min {m['samples_per_s_min']:.4g}, median {med:.4g}, max "
            f"{m['samples_per_s_max']:.4g}: {100 * (m['samples_per_s_min'] / med - 1):+.0f}%/"
            f"{100 * (m['samples_per_s_max'] / med - 1):+.0f}%]")


def format_rates(supply: dict, demand: dict) -> str:
    path = f", {supply['capture']}" if supply.get("capture") else ""  # which capture path was timed
    if supply.get("source") == "--replica-supply":
        head = (f"  target supply  {supply['replica_samples_per_s']:.4g} samples/s per replica of "
                f"{supply['tensor_parallel']} ranks (given with --replica-supply, not measured here)\n")
        return head + format_rates({**supply, "source": None, "tokens_per_s": 0, "batches": 0, "warmup_batches": 0, "seconds": 0,
                                    "device": "-"}, demand).split("\n", 1)[1]
    return (f"  target supply  {supply['samples_per_s']:.4g} samples/s ({supply['tokens_per_s']:.4g} tokens/s) per "
            f"target rank: {supply['batches']} batches timed after {supply['warmup_batches']} warm-up, "
            f"{supply['seconds']:.3g} s on {supply['device']}{path}{_spread_text(supply)}\n"
            f"  drafter demand {demand['samples_per_s']:.4g} samples/s ({demand['tokens_per_s']:.4g} tokens/s) per "
            f"drafter rank: {demand['steps']} steps ({demand['backend']}) timed after {demand['warmup_steps']} "
            f"warm-up, {demand['seconds']:.3g} s on {demand['device']}{_spread_text(demand)}")


def measured_range(m: dict) -> Optional[tuple[float, float]]:
    """(min, max) samples/s of a measurement's rounds (None for one without rounds)."""
    if "samples_per_s_min" not in m:
        return None
    return m["samples_per_s_min"], m["samples_per_s_max"]


def timed_rounds(one_pass, rounds: int, min_seconds: float, clock=time.perf_counter,
                 agree: Optional[Callable[[bool], bool]] = None) -> list[float]:
    """Seconds of each call of ``one_pass`` (which syncs the device itself): ``rounds`` calls, then more until
    they add up to ``min_seconds``, at most ``MAX_ROUNDS_FACTOR * rounds`` in all. ``agree``: for passes that are
    collectives of several processes (the ranks of a target replica), maps this process's "one more round" to the
    group's, so every process runs the same number of passes (each one's clock alone would leave one waiting in a
    collective the others never enter)."""
    rounds = max(1, int(rounds))
    secs: list[float] = []
    while True:
        more = len(secs) < rounds or (sum(secs) < min_seconds and len(secs) < MAX_ROUNDS_FACTOR * rounds)
        if agree is not None and len(secs) >= rounds:
            more = agree(more) and len(secs) < MAX_ROUNDS_FACTOR * rounds
        if not more:
            return secs
        t0 = clock()
        one_pass()
        secs.append(clock() - t0)


def rate_summary(round_seconds: list[float], samples: int, tokens: int) -> dict:
    """One measurement's rates from the seconds of its rounds (each the same ``samples`` / ``tokens``): the median
    round's samples/s and tokens/s, the min and max samples/s."""
    rates = sorted(samples / x for x in round_seconds)
    med = statistics.median(rates)
    return {"samples_per_s": med, "tokens_per_s": med * tokens / samples, "samples_per_s_min": rates[0],
            "samples_per_s_max": rates[-1], "rounds": len(round_seconds), "round_seconds": list(round_seconds),
            "seconds": sum(round_seconds)}
