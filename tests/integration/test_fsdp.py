"""FSDP2 drafters (drafter.parallel=fsdp) train as DDP drafters do, and their checkpoints are DDP's: the same
per-step losses to 1e-5 over 20 steps on 2 and 3 drafter ranks (gloo, fp32), with micro-batches and with a variant
whose loss reads its weights after the forward (DFlash2's selector), and the CPU twin of the hidden-8192 preset
(tiny_dflash_h8192 on tiny_h8192, FSDP2 by its preset); a run resumes from DDP under FSDP2 on another
number of drafter ranks and from there under DDP again, every message of the plan trained exactly once, the
resumed steps and the checkpoint written under FSDP2 those of DDP."""

import json
import shutil

import pytest
import torch
from helpers.launch_util import torchrun
from test_colocated import JOB, losses
from test_train_e2e import accounting, metrics, sample_log

from dflash_dist.checkpoint.store import load_checkpoint

WORKER = "tests/helpers/fsdp_worker.py"


def _max_abs(a: dict, b: dict) -> float:
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


@pytest.mark.parametrize("world", [2, 3])
def test_fsdp_drafters_train_with_ddp_losses(tmp_path, world):
    r = torchrun(world, [WORKER, "--out", tmp_path], timeout=400)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = torch.load(tmp_path / f"world{world}.pt", weights_only=False)
    for case in ("", "-micro2", "-dflash2", "-h8192"):
        ddp, fsdp = out[f"ddp{case}"], out[f"fsdp{case}"]
        assert (ddp["mode"], fsdp["mode"]) == ("ddp", "fsdp")
        assert len(fsdp["losses"]) == len(ddp["losses"]) == (20 if not case else 4)
        assert max(abs(a - b) for a, b in zip(ddp["losses"], fsdp["losses"])) <= 1e-5, case
        assert max(abs(a - b) for a, b in zip(ddp["grad_norms"], fsdp["grad_norms"])) <= 1e-5, case
        assert ddp["weights"].keys() == fsdp["weights"].keys()
        assert _max_abs(ddp["weights"], fsdp["weights"]) <= 1e-5, case
        # the optimizer state in torch's index-keyed format, whole tensors, equal
        assert fsdp["optimizer"]["param_groups"][0]["params"] == ddp["optimizer"]["param_groups"][0]["params"]
        for k, st in ddp["optimizer"]["state"].items():
            assert st["exp_avg"].shape == fsdp["optimizer"]["state"][k]["exp_avg"].shape
            torch.testing.assert_close(fsdp["optimizer"]["state"][k]["exp_avg"], st["exp_avg"], rtol=0, atol=1e-6)
    # the losses move (training happened), and a bf16 gradient reduction is seen in them: the comparison can fail
    base = out["fsdp"]["losses"]
    assert max(base) - min(base) > 0.1
    bf16 = out["fsdp-bf16"]["losses"]
    assert len(bf16) == 5 and 1e-4 < max(abs(a - b) for a, b in zip(bf16, base)) < 0.05
    # each FSDP rank holds its own shard
    assert len(set(torch.load(tmp_path / f"world{world}_fingerprints.pt"))) == world


def _launch(nproc: int, run_dir, *overrides) -> str:
    r = torchrun(nproc, JOB + [f"train.output_dir={run_dir}", "topology.target_ranks=0", "train.checkpoint_every=4",
                               "train.eval_prompts=0", "logging.debug.record_sample_ids=true", *overrides],
                 timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    return out


def test_ddp_checkpoints_resume_under_fsdp_on_other_rank_counts_and_back(tmp_path):
    """DDP on 2 ranks to step 4; FSDP2 on 3 ranks resumes it to step 8 (its in-training evaluation on the gathered
    weights); DDP on 2 ranks resumes that to 12. Beside it, the same step 4 resumed under DDP on 3 ranks: its losses,
    evaluation and step-8 checkpoint (weights and AdamW moments) are the FSDP2 run's."""
    run, ref = tmp_path / "run", tmp_path / "ref"
    _launch(2, run, "drafter.parallel=ddp", "train.max_steps=4")
    shutil.copytree(run, ref)
    evaluate = ["train.eval_every=8", "train.eval_prompts=2", "train.eval_max_new_tokens=16"]
    out = _launch(3, run, "drafter.parallel=fsdp", "train.max_steps=8", "train.resume=auto", *evaluate)
    assert "resuming from" in out and "step_00000004" in out and "FSDP2 over 3 drafter rank(s)" in out
    _launch(3, ref, "drafter.parallel=ddp", "train.max_steps=8", "train.resume=auto", *evaluate)
    resumed = [x for x in losses(run) if x[0] > 4]
    assert [s for s, _ in resumed] == [5, 6, 7, 8]
    assert max(abs(a - b) for (_, a), (_, b) in zip(resumed, [x for x in losses(ref) if x[0] > 4])) <= 1e-5
    (ev,), (ref_ev,) = ([x for x in metrics(d) if x["kind"] == "eval"] for d in (run, ref))
    assert ev["acceptance_lengths"] == ref_ev["acceptance_lengths"] and ev["n_prompts"] == 2
    w, o, _ = load_checkpoint(str(run / "checkpoints" / "step_00000008"))
    rw, ro, _ = load_checkpoint(str(ref / "checkpoints" / "step_00000008"))
    assert w.keys() == rw.keys() and _max_abs(w, rw) <= 1e-5
    assert o["param_groups"] == ro["param_groups"] and o["state"].keys() == ro["state"].keys()
    for k in ro["state"]:
        assert _max_abs(o["state"][k], ro["state"][k]) <= 1e-5, k

    out = _launch(2, run, "drafter.parallel=ddp", "train.max_steps=12", "train.resume=auto")
    assert "step_00000008" in out and "DDP (drafter.parallel=ddp)" in out
    acc = accounting(run)
    assert acc["run_launches"] == 3 and acc["run_samples_repeated"] == 0
    assert acc["run_samples_sent"] == acc["run_samples_trained"] + acc["run_samples_skipped"]
    by_k = {}
    for x in sample_log(run):
        assert x["k"] not in by_k, f"message {x['k']} trained twice"
        by_k[x["k"]] = len(x["ids"])
    cursor = json.load(open(run / "checkpoints" / "step_00000012" / "meta.json"))["cursor"]
    assert sorted(by_k) == list(range(cursor)) and cursor == 4 * 2 + 4 * 3 + 4 * 2
    assert acc["run_samples_trained"] == sum(by_k.values())
