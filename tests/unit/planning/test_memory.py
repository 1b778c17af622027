"""planning/memory.py: the plan of each role, its refusal in check_job_config before any model loads against the
device's limits (``planning/limits.py``, patched here), and the drafter's plan against the peak of a real CPU step."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
from helpers.launch_util import REPO
from helpers.standalone_drafter import compose_job_config

from dflash_dist.config import ConfigError
from dflash_dist.job import check_job_config
from dflash_dist.planning import limits as L
from dflash_dist.planning import memory as M


def checked(*overrides, world_size=3):
    """check_job_config (before the data: it only warns), then the check a job makes once its data is batched, here
    at the largest steps the batching allows (a job passes its data's own steps: check_memory_for_data)."""
    cfg = compose_job_config(list(overrides))
    c = check_job_config(cfg, world_size, "cpu")
    c["memory"] = M.check_memory(cfg, c["text_config"], c["hf_config"], c["drafter"], "cpu", len(c["layer_ids"]),
                                 world_size, c["attn_implementation"], steps=M.largest_steps(cfg))
    return c


@pytest.fixture
def machine(monkeypatch):
    """A CPU machine of 24 GiB available, no cgroup limit, no ulimit -v."""
    monkeypatch.setattr(L, "cpu_available", lambda: (24 * M.GiB, "available memory"))
    monkeypatch.setattr(L, "address_space_left", lambda: None)


@pytest.mark.parametrize("drafter", ["dflash2", "domino"])
def test_gpu_presets_on_the_cpu_default_are_refused_with_the_figure_and_the_knob(machine, drafter):
    with pytest.raises(ConfigError) as e:
        checked(f"drafter={drafter}")
    msg = str(e.value)
    assert "\n" not in msg and "1 target rank + 2 drafter ranks on this machine need" in msg, msg
    need = float(msg.split(" need ")[1].split(" GiB")[0])
    assert need > 24 and "available memory is 24.00 GiB" in msg
    assert "drafter dense masks" in msg and "drafter.num_anchors" in msg and "drafter.tuning.micro_batches" in msg
    assert "train.memory_check=warn or off" in msg


def test_the_default_job_fits_without_a_warning(machine, caplog):
    with caplog.at_level(logging.WARNING, logger="dflash_dist"):
        out = checked()["memory"]
    assert out["problems"] == [] and not [r for r in caplog.records if "memory plan" in r.getMessage()]
    d, t = out["plans"]["drafter"], out["plans"]["target"]
    assert d.shape[2] == 256 and 0.5 * M.GiB < d.total < 2 * M.GiB and t.total < 2 * M.GiB


def test_within_ten_percent_warns_and_the_setting_overrides(monkeypatch, caplog):
    monkeypatch.setattr(L, "address_space_left", lambda: None)
    base = checked()["memory"]["plans"]
    need = base["target"].total + 2 * base["drafter"].total
    monkeypatch.setattr(L, "cpu_available", lambda: (int(need / 0.95), "available memory"))
    with caplog.at_level(logging.WARNING, logger="dflash_dist"):
        assert checked()["memory"]["problems"] == []
    assert any("within 10% of available memory" in r.getMessage() for r in caplog.records)
    monkeypatch.setattr(L, "cpu_available", lambda: (need // 2, "available memory"))
    with pytest.raises(ConfigError, match="drafter ranks on this machine need"):
        checked()
    assert checked("train.memory_check=warn")["memory"]["problems"]
    assert checked("train.memory_check=off")["memory"]["problems"] == []


def test_a_process_limit_names_the_role_that_does_not_fit(monkeypatch):
    monkeypatch.setattr(L, "cpu_available", lambda: (1 << 50, "available memory"))
    monkeypatch.setattr(L, "address_space_left", lambda: (int(1.5 * M.GiB), "ulimit -v (4.00 GiB, ...)"))
    with pytest.raises(ConfigError, match=r"a drafter rank's process need [\d.]+ GiB but ulimit -v"):
        checked("drafter.num_anchors=256")
    with pytest.raises(ConfigError, match=r"a target rank's process need [\d.]+ GiB but ulimit -v.*target\.max_batch_tokens"):
        # a target whose positions reach 32,768 (longer samples are refused before the memory plan)
        checked("target=tiny_mistral", "target.hf_config.max_position_embeddings=32768",
                "target.max_batch_tokens=262144", "data.max_length=32768", "target.max_batch_samples=1")


def test_roles_and_the_colocated_sum():
    c = checked()
    cfg = compose_job_config([])
    args = (cfg, c["text_config"], c["hf_config"], c["drafter"])
    t = M.plan_rank(*args, "target", "cpu", 5)
    d = M.plan_rank(*args, "drafter", "cpu", 5)
    both = M.plan_rank(*args, "colocated", "cpu", 5)
    # one process, and the drafter half uses its target half's embedding and lm_head (no copy of its own)
    assert both.total == t.total + d.total - M.PROCESS_BASE["cpu"] - d.parts["embedding + lm_head"]
    assert "drafter: embedding + lm_head" not in both.parts
    assert "target: capture buffer" in both.parts and "drafter: AdamW state" in both.parts
    with pytest.raises(ValueError):
        M.plan_rank(*args, "both", "cpu", 5)
    # fp32 AdamW: two moments of 4 bytes per parameter, as many as the fp32 parameters take twice
    assert d.parts["AdamW state"] == 2 * d.parts["parameters"]
    # DDP keeps a bucket copy of the gradients with more than one drafter
    assert M.drafter_plan(cfg, c["text_config"], c["drafter"], "cpu", num_drafters=2).parts["gradients"] == \
        2 * d.parts["gradients"]
    # more anchor groups: smaller dense masks, the same context
    g4 = M.drafter_plan(compose_job_config(["drafter.tuning.micro_batches=4"]), c["text_config"], c["drafter"], "cpu")
    assert g4.parts["dense masks"] < d.parts["dense masks"]


def test_target_weights_follow_dtype_fp8_and_tensor_parallel():
    cfg = compose_job_config(["target=qwen3_8b_random", "train.memory_check=off"])  # no 8B target on this CPU
    c = check_job_config(cfg, None, "cpu")
    tc, hc = c["text_config"], c["hf_config"]
    n = M.target_param_count(hc)
    assert 8.0e9 < n < 8.4e9
    plan = lambda *ov: M.target_plan(compose_job_config(["target=qwen3_8b_random", *ov]), tc, hc, 5, "cuda")
    bf16, fp8 = plan().parts["weights"], plan("target.quantization=fp8").parts["weights"]
    assert bf16 == 2 * n and 0.5 * bf16 < fp8 < 0.6 * bf16
    assert plan("target.tensor_parallel=2").parts["weights"] == bf16 // 2


def test_largest_steps_follow_the_batching_rule():
    cfg = compose_job_config(["target.max_batch_tokens=1024", "target.max_batch_samples=4", "data.max_length=3000"])
    assert M.largest_steps(cfg) == [(1, 3008), (2, 512), (3, 384), (4, 256)]  # ctx_bucket 64


@pytest.mark.parametrize("overrides", [["drafter=tiny"], ["drafter=tiny_dflash2"], ["drafter=tiny_domino"],
                                       ["drafter=tiny_domino", "drafter.domino.gru_hidden_dim=256"]])
def test_the_drafter_plan_is_within_10_percent_of_a_measured_step(tmp_path, overrides):
    """The drafter's plan against the peak of building the trainer and running its largest planned sdpa step on
    CPU, in a fresh process (helpers/memory_probe.py). With glibc mapping every large tensor on its own
    (``MALLOC_MMAP_THRESHOLD_``), the resident peak is the live tensors' peak: the plan's tensors within 10%.
    Without it (as jobs run), the resident peak adds the heap's slack, which varies from one process to the next
    (20-90% of the step's activations; Domino's GRU step, many small tensors, reached 89%): the plan with its
    ``heap slack (CPU)`` part (60% of them) is not short of it by more than 25%."""
    def probe(k: int, env: dict) -> dict:
        r = subprocess.run([sys.executable, os.path.join(REPO, "tests", "helpers", "memory_probe.py"), "--out",
                            str(tmp_path / str(k)), *overrides], capture_output=True, text=True, timeout=300,
                           env=dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1", **env))
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(r.stdout.strip().splitlines()[-1])

    live = probe(0, {"MALLOC_MMAP_THRESHOLD_": "65536"})
    assert live["shape"][0] == 16 and live["measured"] > 100 << 20
    assert 0.9 <= live["planned"] / live["measured"] <= 1.1, live
    resident = probe(1, {})
    assert resident["measured"] <= 1.25 * (resident["planned"] + resident["slack"]), resident


def test_a_colocated_gpu_rank_peaks_at_the_larger_of_capture_and_step():
    """On a GPU the capture's passes and the drafter's step run in turn and the allocator hands one's memory to the
    other: the colocated plan of the 32K, 1,024-anchor job measured on one H100 (docs/benchmarks.md#colocated-job)
    leaves out the target's layer forward (3.6 GiB), which the drafter's step outweighs; on CPU both stay."""
    cfg = compose_job_config(["target=qwen3_8b_random", "drafter=dflash", "drafter.num_anchors=1024",
                              "data.max_length=32768", "target.max_batch_tokens=32768", "target.max_batch_samples=1",
                              "train.eval_prompts=0", "train.memory_check=off"])
    c = check_job_config(cfg, None, "cuda")
    args = (cfg, c["text_config"], c["hf_config"], c["drafter"])
    t = M.plan_rank(*args, "target", "cuda", 5, steps=[(1, 20736)])
    d = M.plan_rank(*args, "drafter", "cuda", 5, steps=[(1, 20736)])
    both = M.plan_rank(*args, "colocated", "cuda", 5, steps=[(1, 20736)])
    passes = t.parts["layer forward"]
    step = sum(d.parts[k] for k in M.STEP_PARTS if k in d.parts)
    assert 3 * M.GiB < passes < step
    assert both.total == t.total + d.total - M.PROCESS_BASE["cuda"] - d.parts["embedding + lm_head"] - passes
    assert "target: layer forward" not in both.parts and "target: capture buffer" in both.parts
    assert "drafter: layer activations" in both.parts
