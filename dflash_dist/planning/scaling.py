"""A scaling model on paper: predicted samples/s and per-link load of a dflash_dist job at 8, 64 and 512 GPUs, with
and without node-local routing, for an 8B and a 235B-A22B target (docs/scaling.md is this module's output).

Every number is tagged measured (docs/benchmarks.md, with where) or assumed. The model:

* A job of N nodes x G GPUs runs R target replicas of k GPUs and D drafter GPUs. Node-local: every node runs the
  same split (t_n target GPUs, a multiple of k, and G - t_n drafters); global: the single-node layout (drafters
  first), any T multiple of k, replicas never span nodes.
* Job rate = min(R x replica supply, D x drafter demand'), where demand' is the measured per-GPU demand with the
  drafters' gradient all-reduce added wherever it is not hidden behind the backward.
* Drafter all-reduce: ``grad_bytes_per_param`` x trainable params per step, ring all-reduce time
  2 (n-1)/n x bytes / bus bandwidth (NVLink inside a node, the NIC of each GPU across nodes), plus a latency term
  of 2 (n-1) x ``ring_step_latency_s``; DDP overlaps it with the backward: ``overlap_fraction`` of the step hides it.
* Features: ``feature_bytes_per_token`` x tokens per sample per sample, from a replica's sending rank to its
  drafter: NVLink when both are on one node, else the network (the NICs of the sending node).

``python -m dflash_dist.planning.scaling`` prints the tables (``--markdown`` as in docs/scaling.md, ``--json``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, field

GB = 1e9


@dataclass(frozen=True)
class Value:
    v: float
    source: str  # "measured: <where>" or "assumed: <why>"

    @property
    def measured(self) -> bool:
        return self.source.startswith("measured")


@dataclass
class Target:
    name: str
    replica_gpus: int                 # k
    supply_per_gpu: Value             # samples/s per target GPU inside a replica
    note: str = ""


@dataclass
class Setup:
    gpus_per_node: Value = Value(8, "assumed: HGX H200 nodes")
    drafter_demand_per_gpu: Value = Value(15.67, "measured: docs/benchmarks.md, dflash-plan on an H200, 2026-11-29 (Qwen3-8B-shaped "
                                                "drafter, 550-token samples, 256 anchors, 4-sample messages)")
    samples_per_step: Value = Value(4, "measured config: 4-sample messages (dflash-plan, 2026-11-29), one message per drafter step")
    tokens_per_sample: Value = Value(550, "measured config: synthetic:550 (dflash-plan, 2026-11-29)")
    feature_bytes_per_token: Value = Value(40 * 1024, "measured: Qwen3-8B, 5 layers x 4096 x bf16 (docs/benchmarks.md); "
                                                     "the same for Qwen3-235B-A22B (hidden 4096)")
    drafter_params: Value = Value(1.05e9, "measured: 5-layer Qwen3-8B-shaped drafter (docs/benchmarks.md); assumed "
                                          "the same for the 235B target (same hidden size 4096)")
    grad_bytes_per_param: Value = Value(2, "assumed: bf16 gradient all-reduce (DDP in this repo reduces fp32 "
                                           "gradients today: 4 bytes, twice the traffic)")
    nvlink_p2p: Value = Value(369 * GB, "measured: H200 NVLink send/recv (docs/benchmarks.md)")
    nvlink_allreduce_busbw: Value = Value(300 * GB, "assumed: NCCL ring all-reduce bus bandwidth inside an H200 node "
                                                     "(not measured here: no 8-GPU run was lent)")
    nic_per_gpu: Value = Value(40 * GB, "assumed: one 400 Gb/s NIC per GPU at 80% efficiency (InfiniBand NDR)")
    ring_step_latency_s: Value = Value(20e-6, "assumed: per ring step (NCCL over IB, large messages pipelined)")
    overlap_fraction: Value = Value(0.5, "assumed: DDP hides the all-reduce behind about half of the step "
                                         "(the backward's share, bucketed)")
    targets: list = field(default_factory=lambda: [
        Target("Qwen3-8B", 1, Value(81.3, "measured: docs/benchmarks.md (2026-11-29), packed + compiled capture, one "
                                          "H200")),
        Target("Qwen3-235B-A22B", 8, Value(81.3 * 8.2 / 22 * 0.5,
                                           "assumed: the 8B's measured 81.3 samples/s/GPU scaled by active "
                                           "parameters (8.2B / 22B) and 50% tensor/expert-parallel efficiency"),
               note="470 GB of bf16 weights: a replica is a whole 8-GPU node (k=8); k=4 leaves ~90 GB of "
                    "headroom per GPU and is the node-local alternative"),
        Target("Qwen3-235B-A22B", 4, Value(81.3 * 8.2 / 22 * 0.5,
                                           "assumed: as for k=8 (same efficiency at k=4)"),
               note="k=4: a node holds one replica and 4 drafters"),
    ])


def allreduce_s(s: Setup, drafters: int, nodes_spanned: int) -> float:
    """One drafter step's gradient all-reduce (ring) over ``drafters`` GPUs on ``nodes_spanned`` nodes."""
    if drafters <= 1:
        return 0.0
    nbytes = s.drafter_params.v * s.grad_bytes_per_param.v
    bw = s.nvlink_allreduce_busbw.v if nodes_spanned <= 1 else s.nic_per_gpu.v
    return 2 * (drafters - 1) / drafters * nbytes / bw + 2 * (drafters - 1) * s.ring_step_latency_s.v


def layouts(s: Setup, gpus: int, t: Target, node_local: bool) -> list[dict]:
    """Every split of ``gpus`` (whole replicas; node-local: the same on every node)."""
    g = int(s.gpus_per_node.v)
    nodes = max(1, gpus // g)
    k = t.replica_gpus
    out = []
    if node_local or nodes == 1:
        for t_n in range(k, g, k):
            out.append({"targets": t_n * nodes, "drafters": (g - t_n) * nodes, "nodes": nodes, "node_local": True})
    else:
        for tt in range(k, gpus, k):
            if (gpus - tt) % 1 == 0 and all(((gpus - tt) + i * k) // g == ((gpus - tt) + i * k + k - 1) // g
                                            for i in range(tt // k)):
                out.append({"targets": tt, "drafters": gpus - tt, "nodes": nodes, "node_local": False})
    return out


def evaluate(s: Setup, gpus: int, t: Target, node_local: bool) -> dict:
    """The best split and its loads; ``feasible`` False (with ``why``) when no split exists."""
    g = int(s.gpus_per_node.v)
    rows = []
    for lay in layouts(s, gpus, t, node_local):
        R = lay["targets"] // t.replica_gpus
        D = lay["drafters"]
        supply = R * t.replica_gpus * t.supply_per_gpu.v
        step = s.samples_per_step.v / s.drafter_demand_per_gpu.v
        drafter_nodes = lay["nodes"] if lay["node_local"] else -(-D // g)
        ar = allreduce_s(s, D, drafter_nodes)
        exposed = max(0.0, ar - s.overlap_fraction.v * step)
        demand = D * s.samples_per_step.v / (step + exposed)
        rate = min(supply, demand)
        sample_bytes = s.tokens_per_sample.v * s.feature_bytes_per_token.v
        feat_per_replica = rate / R * sample_bytes               # B/s out of each sending rank
        if lay["node_local"]:
            cross = 0.0
        else:  # the fraction of messages whose replica and drafter sit on different nodes
            D0 = D
            rep_nodes = [(D0 + i * t.replica_gpus) // g for i in range(R)]
            pairs = math.lcm(R, D)
            cross = sum(rep_nodes[j % R] != (j % D) // g for j in range(pairs)) / pairs
        nic_node = 0.0
        if cross:  # the busiest sending node: all its replicas' crossing features leave through its NICs
            per_node = {}
            for i in range(R):
                n = (D + i * t.replica_gpus) // g
                per_node[n] = per_node.get(n, 0.0) + feat_per_replica * cross
            nic_node = max(per_node.values())
        rows.append({**lay, "replicas": R, "supply": supply, "demand": demand, "samples_per_s": rate,
                     "per_gpu": rate / gpus, "bound": "target" if supply < demand else "drafter",
                     "allreduce_ms": ar * 1e3, "allreduce_exposed_ms": exposed * 1e3, "step_ms": step * 1e3,
                     "allreduce_nic_gb_s": (2 * s.drafter_params.v * s.grad_bytes_per_param.v / (step + exposed)
                                            / GB) if drafter_nodes > 1 else 0.0,
                     "features_per_sender_gb_s": feat_per_replica / GB,
                     "nvlink_load": feat_per_replica * (1 - cross) / s.nvlink_p2p.v,
                     "cross_fraction": cross, "features_nic_per_node_gb_s": nic_node / GB,
                     "nic_node_load": nic_node / (g * s.nic_per_gpu.v)})
    if not rows:
        g_ = int(s.gpus_per_node.v)
        return {"gpus": gpus, "target": t.name, "k": t.replica_gpus, "node_local": node_local, "feasible": False,
                "why": f"a replica of {t.replica_gpus} GPUs leaves no drafter on a node of {g_}"}
    best = max(rows, key=lambda r: (r["samples_per_s"], -r["targets"]))
    return {"gpus": gpus, "target": t.name, "k": t.replica_gpus, "node_local": node_local, "feasible": True, **best}


def table(s: Setup, sizes=(8, 64, 512)) -> list[dict]:
    return [evaluate(s, n, t, nl) for t in s.targets for n in sizes for nl in ((True,) if n <= 8 else (True, False))]


def sensitivity(s: Setup) -> list[dict]:
    """Where the drafter all-reduce stops hiding: Qwen3-8B at 512 GPUs, node-local, with the inputs changed one
    at a time (``what`` says which)."""
    from dataclasses import replace
    t = s.targets[0]
    cases = [("as assumed (bf16 gradients, 4-sample steps)", s),
             ("fp32 gradients (what DDP reduces in this repo today)",
              replace(s, grad_bytes_per_param=Value(4, "fp32"))),
             ("1-sample steps (64 ms)", replace(s, samples_per_step=Value(1, "1 sample per message"),
                                                 drafter_demand_per_gpu=Value(15.67, "same per-sample rate"))),
             ("fp32 gradients and a 100 Gb/s NIC per GPU", replace(s, grad_bytes_per_param=Value(4, "fp32"),
                                                                   nic_per_gpu=Value(10 * GB, "100 Gb/s")))]
    out = []
    for what, ss in cases:
        r = evaluate(ss, 512, t, True)
        out.append({"what": what, **r})
    return out


def format_sensitivity(rows: list[dict]) -> str:
    lines = ["| Qwen3-8B, 512 GPUs, node-local | samples/s | /GPU | step ms | all-reduce ms | exposed ms |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['what']} | {r['samples_per_s']:.0f} | {r['per_gpu']:.2f} | {r['step_ms']:.0f} | "
                     f"{r['allreduce_ms']:.0f} | {r['allreduce_exposed_ms']:.0f} |")
    return "\n".join(lines)


def format_markdown(rows: list[dict]) -> str:
    head = ("| target (k) | GPUs | routing | split T+D | samples/s | /GPU | bound | drafter all-reduce ms (exposed) | "
            "features per sender GB/s | crossing nodes | busiest NIC load (features) | DP all-reduce GB/s per GPU NIC |")
    lines = [head, "|" + " --- |" * 12]
    for r in rows:
        route = "node-local" if r["node_local"] else "global"
        if r["gpus"] <= 8:
            route = "one node"
        if not r["feasible"]:
            lines.append(f"| {r['target']} ({r['k']}) | {r['gpus']} | {route} | - | - | - | - | - | - | - | - | "
                         f"not possible: {r['why']} |")
            continue
        lines.append(f"| {r['target']} ({r['k']}) | {r['gpus']} | {route} | {r['targets']}+{r['drafters']} | "
                     f"{r['samples_per_s']:.0f} | {r['per_gpu']:.2f} | {r['bound']} | {r['allreduce_ms']:.0f} "
                     f"({r['allreduce_exposed_ms']:.0f}) | {r['features_per_sender_gb_s']:.2f} | "
                     f"{100 * r['cross_fraction']:.0f}% | {100 * r['nic_node_load']:.1f}% | "
                     f"{r['allreduce_nic_gb_s']:.1f} |")
    return "\n".join(lines)


def format_inputs(s: Setup) -> str:
    lines = ["| input | value | source |", "| --- | --- | --- |"]
    for name, v in asdict(s).items():
        if name == "targets":
            continue
        lines.append(f"| {name} | {v['v']:.4g} | {v['source']} |")
    for t in s.targets:
        lines.append(f"| {t.name} supply per GPU (k={t.replica_gpus}) | {t.supply_per_gpu.v:.4g} samples/s | "
                     f"{t.supply_per_gpu.source} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dflash_dist.planning.scaling", description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--gpus", default="8,64,512")
    args = ap.parse_args(argv)
    s = Setup()
    rows = table(s, tuple(int(x) for x in args.gpus.split(",")))
    if args.json:
        json.dump({"rows": rows, "sensitivity": sensitivity(s)}, sys.stdout, indent=1)
        return 0
    print(format_inputs(s))
    print()
    print(format_markdown(rows))
    print()
    print(format_sensitivity(sensitivity(s)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
