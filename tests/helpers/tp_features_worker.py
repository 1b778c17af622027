"""Worker for tests/integration/test_replicas.py::test_replica_features_equal_one_rank (torchrun, gloo, 2 ranks).

Both ranks form one target replica of 2 (target.tensor_parallel=2) and capture the same messages; rank 0 also
builds the whole target alone (k=1) and captures them again. Writes a JSON report: max abs difference of the
features, and each rank's parameter bytes against the whole model's. ``--random``: a random-init target
(target.hf_config with the tiny shape), which goes through the sharded init path (built once, saved, loaded
sharded). ``--fp8``: an FP8 target, on the replica and alone."""

import argparse
import dataclasses
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: the helpers package

from dflash_dist.config import TargetConfig
from dflash_dist.targets.hf import build_target_model, build_target_replica, local_parameter_bytes, resolve_source
from dflash_dist.targets.quant import FP8Linear
from dflash_dist.roles.target_rank.capture import FeatureCapture
from helpers.worker_exit import finish  # noqa: E402

TINY = {"model_type": "qwen3", "vocab_size": 2048, "hidden_size": 128, "intermediate_size": 384,
        "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "tie_word_embeddings": False}
# Qwen3-MoE-shaped (the 235B-A22B family): the experts split over the replica by transformers' tensor-parallel
# plan ("moe_tp_experts", up to 5.24) or its expert-parallel plan (5.25: targets/hf.py _expert_split)
TINY_MOE = {**TINY, "model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
            "decoder_sparse_step": 1, "mlp_only_layers": []}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--random", action="store_true")
    ap.add_argument("--moe", action="store_true", help="a random-init Qwen3-MoE-shaped target (implies --random)")
    ap.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (nccl, one GPU per rank)")
    ap.add_argument("--fp8", choices=["quantize", "fine_grained", "compressed"], default=None,
                    help="an FP8 target: the tiny target with target.quantization=fp8, or a pre-quantized checkpoint "
                         "of it in that format (rank 0 writes it)")
    args = ap.parse_args()
    dev = args.device
    if dev == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl", device_id=torch.device("cuda", int(os.environ["LOCAL_RANK"])))
    else:
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    group = dist.new_group(ranks=[0, 1])
    store = dist.distributed_c10d._get_default_store()
    args.random = args.random or args.moe
    tcfg = TargetConfig(hf_config=dict(TINY_MOE if args.moe else TINY), init_seed=3, dtype="float32") if args.random else \
        TargetConfig(hf_config={"builtin": "tiny"}, dtype="float32")
    if args.fp8 == "quantize":
        tcfg = dataclasses.replace(tcfg, quantization="fp8")
    elif args.fp8:
        ckpt = os.path.join(os.path.dirname(args.out), f"fp8_{args.fp8}")
        if rank == 0:
            from helpers.fp8_checkpoints import write_fp8_checkpoint
            write_fp8_checkpoint(ckpt, args.fp8)
        dist.barrier()
        tcfg = TargetConfig(name_or_path=ckpt, dtype="float32")
    assert (resolve_source(tcfg)[0] is None) == args.random
    rdir = os.path.join(os.path.dirname(args.out), "random_target")
    model = build_target_replica(tcfg, dev, group, rdir, build_random=rank == 0,
                                 ready=(lambda: store.set("ready", "1"), lambda: store.wait(["ready"])))
    layer_ids = [1, 3, 5, 7]
    cap = FeatureCapture(model, layer_ids)
    g = torch.Generator().manual_seed(0)
    msgs = []
    for _ in range(4):
        lengths = torch.randint(5, 60, (3,), generator=g)
        ids = torch.zeros(3, int(lengths.max()), dtype=torch.long)
        for i, n in enumerate(lengths.tolist()):
            ids[i, :n] = torch.randint(0, 2048, (n,), generator=g)
        msgs.append((ids.to(dev), lengths))
    feats = [cap(ids, lengths) for ids, lengths in msgs]
    local, full = local_parameter_bytes(model)
    import transformers
    rep = {"transformers": transformers.__version__, "torch": torch.__version__, "device": dev, "rank": rank, "local_bytes": local, "full_bytes": full, "shapes": [list(f.shape) for f in feats]}
    fp8 = [m for m in model.modules() if isinstance(m, FP8Linear)]
    rep["fp8_linears"], rep["rowwise_shards"] = len(fp8), sum(m.reduce_group is not None for m in fp8)
    if rank == 0:
        ref = build_target_model(tcfg, dev)
        rcap = FeatureCapture(ref, layer_ids)
        refs = [rcap(ids, lengths) for ids, lengths in msgs]
        rep["max_abs_diff"] = max(float((a - b).abs().max()) for a, b in zip(feats, refs))
        rep["max_abs_ref"] = max(float(b.abs().max()) for b in refs)
        if args.fp8:  # how far FP8 moves the features: the replica's match must be much closer than this
            plain = build_target_model(TargetConfig(hf_config={"builtin": "tiny"}, dtype="float32"), dev)
            pcap = FeatureCapture(plain, layer_ids)
            rep["max_abs_diff_vs_unquantized"] = max(float((a - pcap(i, n)).abs().max())
                                                     for a, (i, n) in zip(feats, msgs))
    other = [None, None]
    dist.all_gather_object(other, [f.cpu().tolist() for f in feats])
    rep["ranks_agree"] = other[0] == other[1]
    with open(f"{args.out}.rank{rank}.json", "w") as f:
        json.dump(rep, f)
    finish()  # helpers/worker_exit.py: no interpreter finalization racing gloo's threads


if __name__ == "__main__":
    main()
