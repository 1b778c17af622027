"""Target replicas (target.tensor_parallel) and node-local routing under torchrun on CPU (gloo)."""

import json
import os
import re

import pytest
from helpers.launch_util import torchrun
from test_train_e2e import accounting, train_records

FEATURE_TOL = 1e-4  # fp32, hidden size 128: the sharded sums reorder the reductions (measured ~5e-6)


@pytest.mark.parametrize("random_init", [False, True, "moe"])
def test_replica_features_equal_one_rank(tmp_path, random_init):
    """A replica of 2 ranks captures the same features as the whole target on one rank (fp32, within FEATURE_TOL),
    both ranks of the replica hold the same features, and each holds about half the parameter bytes."""
    out = tmp_path / "rep"
    flag = {False: [], True: ["--random"], "moe": ["--moe"]}[random_init]
    r = torchrun(2, ["tests/helpers/tp_features_worker.py", "--out", str(out)] + flag, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    reps = [json.load(open(f"{out}.rank{i}.json")) for i in range(2)]
    assert reps[0]["max_abs_diff"] < FEATURE_TOL, reps[0]
    assert reps[0]["max_abs_ref"] > 0.1  # features of a real magnitude were compared
    assert all(x["ranks_agree"] for x in reps)
    for x in reps:  # no rank holds the whole model: replicated norms only beside the halves
        assert x["local_bytes"] < 0.55 * x["full_bytes"], x
    print(f"features k=2 vs k=1 ({random_init}): max abs diff {reps[0]['max_abs_diff']:.2e} (max |feature| "
          f"{reps[0]['max_abs_ref']:.2f}); rank bytes {reps[0]['local_bytes']} of {reps[0]['full_bytes']}")


@pytest.mark.parametrize("fp8", ["quantize", "fine_grained", "compressed"])
def test_fp8_replica_features_equal_one_rank(tmp_path, fp8):
    """An FP8 target (target.quantization=fp8, or a pre-quantized checkpoint) on a replica of 2 captures the features
    the same FP8 target captures on one rank (within FEATURE_TOL; FP8 itself moves them ~1e4 times further): every
    projection is an FP8 linear holding its shard, the rowwise ones (o_proj, down_proj) summing their partial
    outputs over the replica, their scales those of the whole rows."""
    out = tmp_path / "rep"
    r = torchrun(2, ["tests/helpers/tp_features_worker.py", "--out", str(out), "--fp8", fp8], timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    reps = [json.load(open(f"{out}.rank{i}.json")) for i in range(2)]
    assert reps[0]["max_abs_diff"] < FEATURE_TOL, reps[0]
    assert reps[0]["max_abs_diff_vs_unquantized"] > 100 * FEATURE_TOL, reps[0]  # the FP8 weights ran
    assert all(x["ranks_agree"] and x["fp8_linears"] == 56 and x["rowwise_shards"] == 16 for x in reps), reps
    print(f"FP8 ({fp8}) features k=2 vs k=1: max abs diff {reps[0]['max_abs_diff']:.2e}; FP8 vs unquantized "
          f"{reps[0]['max_abs_diff_vs_unquantized']:.2e}")


def _jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


JOB = ["-m", "dflash_dist.train", "logging.log_every=1", "logging.progress_bar=false", "logging.wandb.mode=disabled",
       "train.eval_prompts=0", "logging.debug.record_sample_ids=true", "logging.debug.trace_target=true"]
LOSS_RTOL = 1e-3  # the replica's features differ from one rank's by ~1e-6 relative (FEATURE_TOL above)


def test_replica_of_two_trains_like_one_target_rank(tmp_path):
    """3 ranks (1 drafter + one replica of 2) against 1 + 1 on the same plan: exit 0, closed sample accounting, the
    same loss at every step within LOSS_RTOL; only the replica's first rank sent (target trace, sample log)."""
    steps = 8
    one, rep = tmp_path / "k1", tmp_path / "k2"
    r1 = torchrun(2, JOB + [f"train.output_dir={one}", f"train.max_steps={steps}"], timeout=300)
    assert r1.returncode == 0, (r1.stdout + r1.stderr)[-4000:]
    r2 = torchrun(3, JOB + [f"train.output_dir={rep}", f"train.max_steps={steps}", "topology.target_ranks=2",
                            "target.tensor_parallel=2"], timeout=300)
    out = r2.stdout + r2.stderr
    assert r2.returncode == 0, out[-4000:]
    assert "replica 0 ranks [1, 2], tensor-parallel: this rank holds" in out
    assert "replica 0 rank 2:" in out and "(features sent by rank 1)" in out
    a, b = train_records(one), train_records(rep)
    assert [x["step"] for x in a] == [x["step"] for x in b] == list(range(1, steps + 1))
    for x, y in zip(a, b):
        assert abs(x["loss"] - y["loss"]) <= LOSS_RTOL * abs(x["loss"]), (x["step"], x["loss"], y["loss"])
    print("losses k=1:", [round(x["loss"], 5) for x in a], "\nlosses k=2:", [round(y["loss"], 5) for y in b],
          "\nmax relative difference:", max(abs(x["loss"] - y["loss"]) / abs(x["loss"]) for x, y in zip(a, b)))
    acc = accounting(rep)
    assert acc["samples_sent"] == acc["samples_received"] + acc["samples_dropped_after_stop"]
    assert acc["samples_received"] == (acc["samples_trained"] + acc["samples_skipped_nonfinite"]
                                       + acc["samples_skipped_shape"])
    assert acc["samples_trained"] == accounting(one)["samples_trained"] > 0
    assert not os.path.exists(rep / "target_trace" / "rank2.jsonl")  # the follower sends nothing
    assert {x["from"] for x in _jsonl(rep / "sample_log" / "rank0.jsonl")} == {1}


def test_killed_replica_rank_ends_the_job_by_name(tmp_path):
    """kill -9 of the rank of a replica that sends nothing (rank 2 of replica [1, 2]): the job ends within 60 s,
    naming it, without a checkpoint."""
    from test_failures import ARGS, _wait_for_step, kill9_and_wait
    p = torchrun(3, ARGS + [f"train.output_dir={tmp_path}", "topology.target_ranks=2", "target.tensor_parallel=2"],
                 popen=True)
    _wait_for_step(tmp_path, 3, p)
    out, took = kill9_and_wait(p, 2)
    assert p.returncode != 0 and took < 60
    assert "rank 2 (target" in out and "died" in out, out[-3000:]
    assert not os.path.exists(tmp_path / "checkpoints")
    print(f"job ended {took:.1f} s after the kill")


def test_resume_a_replica_run_with_one_rank_per_target(tmp_path):
    """SIGTERM a 1 drafter + replica-of-2 run (one checkpoint), resume it as 1 + 1 (k=1): every message and every
    sample of the plan is trained exactly once across the two runs."""
    import glob
    import time

    from test_train_e2e import sample_log, sigterm_workers_when
    common = JOB + [f"train.output_dir={tmp_path}", "data.source=synthetic:40:200", "train.epochs=1",
                    "target.max_batch_samples=8", "logging.debug.trace_target=false"]
    p = torchrun(3, common + ["topology.target_ranks=2", "target.tensor_parallel=2"], popen=True)
    out1 = sigterm_workers_when(p, lambda: any(r["step"] >= 4 for r in train_records(tmp_path)), tmp_path,
                                "first run did not reach step 4")
    assert p.returncode == 0, out1[-4000:]
    ckpts = sorted(glob.glob(str(tmp_path / "checkpoints" / "step_*")))
    assert len(ckpts) == 1
    meta = json.load(open(os.path.join(ckpts[0], "meta.json")))
    assert meta["tensor_parallel"] == 2 and 0 < meta["cursor"] < meta["total_messages"]
    time.sleep(0.5)
    r = torchrun(2, common + ["topology.target_ranks=1", "train.resume=auto"], timeout=300)
    out2 = r.stdout + r.stderr
    assert r.returncode == 0, out2[-4000:]
    assert "resuming from" in out2
    log = sample_log(tmp_path)
    assert sorted(x["k"] for x in log) == list(range(meta["total_messages"]))
    assert sorted(i for x in log for i in x["ids"]) == list(range(200))


def test_two_agents_as_two_nodes_keep_every_message_on_its_node(tmp_path):
    """Two torchrun agents as two nodes of 2 ranks, each node 1 target + 1 drafter (node-local by default): from
    the job's own records (targets' per-message trace, drafters' sample log) no message crossed nodes, both nodes'
    drafters trained, and after every step the two drafters' weights are equal (their data-parallel steps in
    lockstep)."""
    from helpers.launch_util import free_port
    from test_launch import _report, _wait_all
    out = tmp_path / "run"
    rdzv = f"127.0.0.1:{free_port()}"
    args = JOB + [f"train.output_dir={out}", "train.max_steps=6", "topology.target_ranks=2"]
    procs = [torchrun(2, args, nnodes=2, node_rank=i, rdzv=rdzv, popen=True) for i in range(2)]
    results = _wait_all(procs, 400)
    assert all(rc == 0 for rc, _ in results), _report(results, ["node 0", "node 1"])
    text = results[0][1] + results[1][1]
    assert "node-local: every message stays on its node" in text
    assert "node 0: drafter ranks [0]; replica 0 ranks [1] (sends from 1) -> drafter ranks [0]" in text
    assert "node 1: drafter ranks [2]; replica 1 ranks [3] (sends from 3) -> drafter ranks [2]" in text
    sent = _jsonl(out / "target_trace" / "rank1.jsonl") + _jsonl(out / "target_trace" / "rank3.jsonl")
    got = {d: _jsonl(out / "sample_log" / f"rank{d}.jsonl") for d in (0, 2)}
    assert len(sent) == 12 and all(x["from_node"] == x["to_node"] for x in sent)
    assert all(x["from_node"] == x["to_node"] for v in got.values() for x in v)
    assert {x["to_node"] for x in sent} == {0, 1}
    steps = {d: {x["step"]: x["weights_fp"] for x in v} for d, v in got.items()}
    assert sorted(steps[0]) == sorted(steps[2]) == list(range(6))
    assert all(steps[0][s] == steps[2][s] for s in steps[0]), steps
    assert len({steps[0][s] for s in steps[0]}) == 6  # the weights did change every step


def test_auto_split_measures_a_replica(tmp_path):
    """topology.target_ranks=auto with target.tensor_parallel=2: the last 2 ranks measure the supply as one replica,
    the splits are whole replicas, and the job runs the chosen one."""
    r = torchrun(3, JOB + [f"train.output_dir={tmp_path}", "train.max_steps=3", "topology.target_ranks=auto",
                           "target.tensor_parallel=2", "topology.plan_target_batches=2",
                           "topology.plan_drafter_steps=2"], timeout=400)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "measuring target supply on this rank (replica [1, 2] of target.tensor_parallel=2)" in out
    plan = json.load(open(tmp_path / "plan.json"))
    assert plan["measured"] and plan["supply"]["tensor_parallel"] == 2 and plan["target_ranks"] == 2
    assert plan["supply"]["replica_samples_per_s"] == 2 * plan["supply"]["samples_per_s"]
    assert [row["targets"] for row in plan["rows"]] == [2]
    assert train_records(tmp_path)[-1]["step"] == 3


def test_loss_on_target_of_a_replica_sigterm_drops_the_untrained_and_resumes(tmp_path):
    """A replica of 2 serving its vocabulary slices to one drafter (4 anchor groups, the last local), the default
    in-training evaluation on, SIGTERM mid-run: both ranks of the replica drop the requests of messages that will
    not be trained, each served exactly the trained steps' three groups, every rank exits 0 after one checkpoint,
    the accounting closes; the resumed job trains to the end of the epoch."""
    from test_train_e2e import check_accounting, sigterm_workers_when
    args = ["-m", "dflash_dist.train", f"train.output_dir={tmp_path}", "data.source=synthetic:40:400",
            "train.epochs=1", "topology.target_ranks=2", "target.tensor_parallel=2",
            "drafter.tuning.loss_on_target=true", "drafter.tuning.micro_batches=4",
            "drafter.tuning.local_loss_groups=1", "target.max_batch_samples=8", "logging.log_every=2",
            "logging.progress_bar=false", "logging.wandb.mode=disabled"]
    p = torchrun(3, args, popen=True)
    out = sigterm_workers_when(p, lambda: any(r["step"] >= 6 for r in train_records(tmp_path)), tmp_path,
                               "did not reach step 6")
    assert p.returncode == 0, out[-4000:]
    assert "stopped on request" in out
    served = [int(x.split(" head requests served")[0].rsplit(" ", 1)[1])
              for x in out.splitlines() if " head requests served" in x]
    last = train_records(tmp_path)[-1]["step"]
    assert len(served) == 2 and served == [3 * last] * 2, (served, last)  # feeder and follower, nothing more
    check_accounting(accounting(tmp_path))
    r = torchrun(3, args + ["train.resume=auto"], timeout=300)  # to the end of the epoch
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "resuming from" in out and train_records(tmp_path)[-1]["step"] > last
    check_accounting(accounting(tmp_path))


def test_an_objective_without_slice_math_is_served_whole_by_the_feeder(tmp_path):
    """loss_on_target on a replica with an objective that has no vocabulary-slice math (registered from outside
    the package): the feeder serves every request with the whole lm_head, its follower none, and the job trains."""
    from helpers.launch_util import REPO
    steps = 3
    r = torchrun(3, JOB + [f"train.output_dir={tmp_path}", f"train.max_steps={steps}",
                           "drafter.tuning.loss_on_target=true", "logging.debug.trace_target=false",
                           "drafter.loss.objective=helpers.toy_seams:WholeHeadCE", "topology.target_ranks=2",
                           "target.tensor_parallel=2"], timeout=300,
                 env={"PYTHONPATH": REPO + os.pathsep + os.path.join(REPO, "tests")})
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    lines = [x for x in out.splitlines() if "lm_head and loss of the drafters' steps run here" in x]
    assert len(lines) == 1 and "[rank 1 " in lines[0], lines
    assert "the whole lm_head on the replica's feeder (toy_whole_head has no vocabulary-slice math)" in lines[0]
    assert f"{steps} head requests served" in out and not re.search(r"replica 0 rank 2: .*head requests", out)
    assert train_records(tmp_path)[-1]["step"] == steps


def test_replica_evaluates_in_training_like_dflash_eval_on_one_rank(tmp_path):
    """1 drafter + one replica of 2 with the default presets (in-training evaluation on: 16 held-out prompts, 128 new
    tokens), evaluating and saving every 4 of 12 steps: exit 0; the first evaluation ran in slices between messages
    and the last one after the stream, both ranks of the replica running their verify forwards; for both,
    dflash-eval of that step's checkpoint with a whole target on one process, on the same prompts, gives the same
    acceptance lengths prompt by prompt (so the same tau), and so does dflash-eval under torchrun on a replica of 2
    (its output equal to the replica's own greedy decoding). fp32 on CPU: the replica's logits differ from one rank's
    by ~1e-6 relative (its sharded sums), far from the margin of any greedy choice here, so every token and
    acceptance length agrees exactly; a proposal or verify step that differs shows up as a different length."""
    from dflash_dist.cli.eval import main as eval_main
    run, steps = tmp_path / "rep", 12
    r = torchrun(3, ["-m", "dflash_dist.train", "logging.progress_bar=false", "logging.wandb.mode=disabled",
                     f"train.output_dir={run}", f"train.max_steps={steps}", "train.eval_every=4",
                     "train.checkpoint_every=4", "train.keep_checkpoints=3", f"data.cache_dir={run / 'data_cache'}",
                     "topology.target_ranks=2", "target.tensor_parallel=2"], timeout=500)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "in-training evaluation: between two messages, verify steps for as long as the stream's work since the " \
           "last, with every rank of replica [1, 2]" in out
    evals = [x for x in _jsonl(run / "metrics.jsonl") if x.get("kind") == "eval"]
    assert evals[0]["step"] == 4 and evals[-1]["step"] == steps
    assert f"replica rank 2: ran the verify forwards of {len(evals)} evaluation(s) with its feeder" in out
    assert evals[0]["eval_slices"] > 0  # between messages, during the stream
    (holdout,) = [str(p) for p in (run / "data_cache").glob("holdout-*.jsonl")]
    for ev in (evals[0], evals[-1]):
        assert ev["n_prompts"] == 16 and ev["max_new_tokens"] == 128
        ck, res = run / "checkpoints" / f"step_{ev['step']:08d}", tmp_path / f"e{ev['step']}.json"
        assert eval_main(["--checkpoint", str(ck), "--prompts", holdout, "--num-prompts", "16", "--max-new-tokens",
                          "128", "--no-lossless-check", "--out", str(res)]) == 0
        e = json.load(open(res))
        assert [p["acceptance_lengths"] for p in e["per_prompt"]] == ev["acceptance_lengths"], ev["step"]
        assert e["tau"] == pytest.approx(ev["tau"], abs=1e-12)
        assert e["tau_pooled"] == pytest.approx(ev["tau_pooled"], abs=1e-12)
        assert sum(a > 1 for p in ev["acceptance_lengths"] for a in p) > 0  # some proposals were accepted
        print(f"step {ev['step']} ({ev['eval_slices']} slices): in-training tau on the replica {ev['tau']:.4f} "
              f"(pooled {ev['tau_pooled']:.4f}), dflash-eval on one rank {e['tau']:.4f} (pooled {e['tau_pooled']:.4f})")
    # dflash-eval itself on a replica of 2 (torchrun): the same lengths, the target's greedy output reproduced
    res2 = tmp_path / "e_tp2.json"
    r = torchrun(2, ["-m", "dflash_dist.cli.eval", "--checkpoint", str(ck), "--prompts", holdout, "--num-prompts",
                     "16", "--max-new-tokens", "128", "--out", str(res2)], timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert "target replica of 2 ranks: every rank verifies, rank 0 drafts" in r.stdout + r.stderr
    tp = json.load(open(res2))
    assert tp["tensor_parallel"] == 2 and e["tensor_parallel"] == 1
    assert [p["acceptance_lengths"] for p in tp["per_prompt"]] == [p["acceptance_lengths"] for p in e["per_prompt"]]
    assert tp["tau"] == pytest.approx(e["tau"], abs=1e-12) and tp["lossless_fraction"] == 1.0
    print(f"dflash-eval on a replica of 2: tau {tp['tau']:.4f}, lossless {tp['lossless_fraction']}")
    # rank 0 failing after the others are done (its result cannot be written) ends the run, not a hang
    r = torchrun(2, ["-m", "dflash_dist.cli.eval", "--checkpoint", str(ck), "--prompts", holdout, "--num-prompts",
                     "2", "--max-new-tokens", "8", "--no-lossless-check", "--out", str(res2 / "x.json")], timeout=180)
    assert r.returncode != 0 and ("NotADirectoryError" in r.stderr or "FileExistsError" in r.stderr), r.stderr[-3000:]


@pytest.mark.parametrize("weighting", ["decay", "dpace"])
def test_loss_on_target_of_a_replica_equals_one_target_rank(tmp_path, weighting):
    """drafter.tuning.loss_on_target with a replica of 2: each of its ranks serves every head request for its half
    of the vocabulary (its slice of the lm_head), the drafter combines the two replies, and the loss of every step
    equals that of the same job on a one-rank target to 1e-5 (relative; the replica's features differ from one
    rank's by ~1e-6 relative). D-PACE: its weights come from the combined CE, before the step's weight sum."""
    steps = 4
    common = JOB + [f"train.max_steps={steps}", "drafter.tuning.loss_on_target=true",
                    "drafter.tuning.micro_batches=2", "logging.debug.trace_target=false",
                    f"drafter.loss.weighting={weighting}"]
    one, rep = tmp_path / "k1", tmp_path / "k2"
    r1 = torchrun(2, common + [f"train.output_dir={one}"], timeout=300)
    assert r1.returncode == 0, (r1.stdout + r1.stderr)[-4000:]
    r2 = torchrun(3, common + [f"train.output_dir={rep}", "topology.target_ranks=2", "target.tensor_parallel=2"],
                  timeout=300)
    out = r2.stdout + r2.stderr
    assert r2.returncode == 0, out[-4000:]
    lines = [x for x in out.splitlines() if "lm_head and loss of the drafters' steps run here" in x]
    assert len(lines) == 2 and all("each rank of replica [1, 2] serves its slice" in x for x in lines), lines
    assert any("vocabulary rows [0, " in x for x in lines), lines
    assert f"{2 * steps} head requests served" in out, out[-3000:]  # 1 drafter, 2 groups per step: the feeder
    assert re.search(rf"replica 0 rank 2: .*; {2 * steps} head requests served", out), out[-3000:]  # and its peer
    a, b = train_records(one), train_records(rep)
    assert [x["step"] for x in a] == [x["step"] for x in b] == list(range(1, steps + 1))
    diffs = [abs(x["loss"] - y["loss"]) / abs(x["loss"]) for x, y in zip(a, b)]
    assert max(diffs) <= 1e-5, diffs
    print("loss on the target, k=1:", [x["loss"] for x in a], "\nk=2:", [y["loss"] for y in b],
          "\nmax relative difference:", max(diffs))


def test_the_targets_own_labels_on_a_replica_equal_one_target_rank(tmp_path):
    """drafter.loss.labels=target (kind=kl, top-8) on a replica of 2: every rank runs the whole model and the
    lm_head (its output gathered by transformers' plan), the feeder sends the top-8; the loss of every step equals
    that of a one-rank target's job to 1e-5 (relative), with the loss on the drafter and with it on the target
    (each rank of the replica serving the KL for its slice of the vocabulary)."""
    steps = 4
    common = JOB + [f"train.max_steps={steps}", "drafter.loss.labels=target", "drafter.loss.kind=kl",
                    "drafter.loss.kl_top_k=8", "logging.debug.trace_target=false", "drafter.tuning.micro_batches=2"]
    replica = ["topology.target_ranks=2", "target.tensor_parallel=2"]
    runs = {"one": (2, []), "replica": (3, replica),
            "replica_loss_on_target": (3, replica + ["drafter.tuning.loss_on_target=true"])}
    losses = {}
    for name, (n, extra) in runs.items():
        r = torchrun(n, common + extra + [f"train.output_dir={tmp_path / name}"], timeout=300)
        out = r.stdout + r.stderr
        assert r.returncode == 0, out[-4000:]
        if name == "replica_loss_on_target":
            assert out.count("each rank of replica [1, 2] serves its slice") == 2, out[-3000:]
            assert out.count(f"{2 * steps} head requests served") == 2, out[-3000:]
        rec = train_records(tmp_path / name)
        assert [x["step"] for x in rec] == list(range(1, steps + 1))
        losses[name] = [x["loss"] for x in rec]
    for name in ("replica", "replica_loss_on_target"):
        diffs = [abs(a - b) / abs(a) for a, b in zip(losses["one"], losses[name])]
        assert max(diffs) <= 1e-5, (name, diffs)
    print(losses)
