"""DrafterTrainer pieces that run without a pipeline: the dry steps of precompile (CPU, sdpa backend)."""

import helpers.standalone_drafter as S
import torch
import torch.distributed as dist

from dflash_dist.roles.drafter_rank.shape_plan import plan_step_lengths, precompile_steps


def tiny_job(tmp_path):
    """(config, job, trainer) of the tiny default on CPU, inside a one-process group."""
    cfg = S.compose_job_config(S.job_overrides(True, None, None, 48, 40, 256, 4, 6, 2, str(tmp_path), []))
    job, _ = S.make_job(cfg, 2, torch.device("cpu"), str(tmp_path))
    return cfg, job, S.make_trainer(job)


def test_precompile_dry_steps_update_nothing(tmp_path):
    """precompile runs forward and backward of each planned shape it was given (the attention ran), and leaves
    the weights, the gradients, the optimizer and the step counters as they were."""
    cpu = torch.device("cpu")
    S.init_single_process_group(cpu)
    try:
        cfg, job, trainer = tiny_job(tmp_path)
        steps = list(plan_step_lengths(job.plan, job.sample_lengths, 0, job.total_messages, 1, 0))
        assert trainer.planned_steps == steps  # a list: make_guard and precompile_steps both read it
        assert trainer.precompile_plan == []   # sdpa: nothing to compile
        trainer.precompile_plan = precompile_steps(trainer.planned_steps + [[300]], cfg.drafter.tuning.ctx_bucket)
        sizes = [len(x) for x in trainer.precompile_plan]
        assert sizes[0] == len(steps[0]) > 1 and 1 in sizes and len(sizes) <= 4, trainer.precompile_plan
        before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        calls = dict(trainer.model.attention_calls)
        took = trainer.precompile()
        assert took > 0 and trainer.precompile_s == took
        ran = trainer.model.attention_calls["sdpa"] - calls.get("sdpa", 0)
        assert ran == cfg.drafter.num_layers * len(trainer.precompile_plan)
        after = trainer.model.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)
        assert all(p.grad is None for p in trainer.model.parameters())
        assert not trainer.opt.state
        assert (trainer.step, trainer.cursor) == (0, 0)
    finally:
        dist.destroy_process_group()


def test_precompile_makes_no_collective_under_ddp(tmp_path):
    """Two drafter ranks of one DDP group run 2 and 1 dry steps, then a training step each: no hang, no error,
    and the same weights on both after the step (its all-reduce paired up: the dry steps made none)."""
    import json

    from helpers.launch_util import torchrun
    r = torchrun(2, ["tests/helpers/precompile_ddp_worker.py", "--out", tmp_path], timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    reps = [json.load(open(tmp_path / f"rank{i}.json")) for i in range(2)]
    assert [x["dry_steps"] for x in reps] == [2, 1]
    assert reps[0]["checksum"] == reps[1]["checksum"]
    assert not any(x["grads_left"] for x in reps)


def test_the_drafters_last_collective_comes_before_the_wait_for_the_final_evaluation(monkeypatch):
    """The leader waits for the final evaluation up to the warm-up limit; the other drafters must not be left in a
    collective meanwhile (it runs under the short topology.timeout_s: a final evaluation longer than that killed a
    2-drafter job). The accounting all-reduce runs first, then the wait, then the report."""
    import dflash_dist.roles.drafter_rank.loop as L
    order = []
    run = object.__new__(L.DrafterRun)
    run.stopped, run.trainer, run.d, run.target_stats = False, type("T", (), {"save": lambda *a, **k: None})(), None, {}
    run.take_ends = lambda: order.append("ends")
    run.last_evaluations = lambda: order.append("wait for the final evaluation")
    run.report = lambda accounting: order.append(("report", accounting))
    monkeypatch.setattr(L, "account", lambda *a: order.append("all-reduce") or {"samples_trained": 1.0})
    run.finish()
    assert order == ["ends", "all-reduce", "wait for the final evaluation", ("report", {"samples_trained": 1.0})]


def test_the_runs_memory_line_holds_the_peak_against_the_plans_largest_step(tmp_path):
    """A GPU run ends with its peak memory next to the plan of the largest step its batching makes: the largest
    of the plans of each planned step (the arithmetic needs no GPU; the peak is set as a window would)."""
    import types

    from dflash_dist.planning.memory import plan_rank, plan_steps
    from dflash_dist.roles.drafter_rank.loop import DrafterRun
    from dflash_dist.targets.families import text_config
    from dflash_dist.telemetry.memory_peak import GiB, PeakMemory

    cpu = torch.device("cpu")
    S.init_single_process_group(cpu)
    try:
        cfg, job, trainer = tiny_job(tmp_path)
    finally:
        dist.destroy_process_group()
    gpu = torch.device("cuda", 0)
    memory = PeakMemory(gpu)
    memory.run_peak = 3 * GiB
    run = types.SimpleNamespace(job=job, trainer=trainer, memory=memory, d=types.SimpleNamespace(device=gpu),
                                topo=types.SimpleNamespace(colocated=False, num_drafters=1))
    line = DrafterRun.memory_line(run)
    steps = plan_steps(job.sample_lengths, job.plan, cfg.drafter.tuning.ctx_bucket)
    assert len(steps) > 1
    each = [plan_rank(cfg, text_config(job.hf_config), job.hf_config, job.drafter, "drafter", "cuda",
                      len(job.layer_ids), [st]) for st in steps]
    top = max(each, key=lambda p: p.total)
    planned = (top.total - top.parts["process"]) / GiB
    assert line.startswith("memory:     peak 3.00 GiB allocated over the run")
    assert f"planned {planned:.2f} GiB at its largest step (b={top.shape[0]}, S_pad={top.shape[1]})" in line
