"""The startup report: the host-sync finder behind the drafter's "host syncs in one training step" line, and the
check of which flex_attention kernel family ran."""

import warnings

import pytest
import torch

from dflash_dist.roles.drafter_rank.startup_report import host_syncs, sync_warnings_recorded


def test_sync_warnings_are_recorded_with_their_location():
    with warnings.catch_warnings(record=True) as passed_on:
        warnings.simplefilter("always")
        with sync_warnings_recorded() as where:
            for _ in range(2):  # every sync, also a repeated one
                warnings.warn("called a synchronizing CUDA operation")  # what the sync debug mode raises
            warnings.warn("something else")                             # not a sync: shown as usual
    assert len(where) == 2 and where[0].startswith("test_startup_report.py:")
    assert [str(w.message) for w in passed_on] == ["something else"]


def test_sync_recording_keeps_other_warning_filters():
    """The compile guard turns flex's eager warning into an error with a filter; recording syncs must not undo it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="flex eager")
        with sync_warnings_recorded():
            with pytest.raises(UserWarning):
                warnings.warn("flex eager")


def test_host_syncs_on_cpu_runs_the_step_and_checks_nothing():
    out, syncs = host_syncs(lambda: torch.ones(2).sum(), "cpu")
    assert out.item() == 2.0 and syncs is None


def test_flash_backend_kernels_are_the_flex_path_it_asks_for():
    """With drafter.tuning.flex_kernel_options BACKEND=FLASH the step runs FlashAttention-4's CuTe kernels (named
    after their classes by the CuTe DSL): the check accepts them, and it refuses the Triton kernels (or none) when
    FLASH was asked for, and FLASH kernels when Triton was, naming what ran instead."""
    from types import SimpleNamespace

    from dflash_dist.roles.drafter_rank import startup_report as sr
    cuda = torch.autograd.DeviceType.CUDA

    def ev(name):
        return SimpleNamespace(name=name, device_type=cuda, input_shapes=[])

    flash = [ev("kernel_cutlass_kernel_flash_attncuteflash_fwd_sm90FlashAttentionForwardSm90_object_at__"
                "tensorptrbf16gmemalign16o_0"),
             ev("kernel_cutlass_kernel_flash_attncuteflash_bwd_preprocessFlashAttentionBackwardPreprocess_object_at_0"),
             ev("kernel_cutlass_kernel_flash_attncuteflash_bwd_sm90FlashAttentionBackwardSm90_object_at__tensor_1"),
             ev("triton_per_fused__to_copy_mul_sum_2")]
    triton = [ev("triton_tem_fused_flex_attention_0"), ev("triton_tem_fused_flex_attention_backward_1")]
    calls = {"flex_compiled": 2}

    def problems(events, family):
        kernels = sr._scan_events(events, 12, 44, cuda=True)["kernels"]
        fwd, bwd = sr.flex_kernels(kernels, family)
        return sr.flex_problems("flex", fwd, bwd, [], calls, 2, 12, 44, family, kernels)

    kernels = sr._scan_events(flash, 12, 44, cuda=True)["kernels"]
    fwd, bwd = sr.flex_kernels(kernels, "FLASH")
    assert list(fwd) == [flash[0].name] and sorted(bwd) == sorted([flash[1].name, flash[2].name])
    assert problems(flash, "FLASH") == []
    assert problems(triton, "TRITON") == []
    asked_flash = problems(triton, "FLASH")
    assert len(asked_flash) == 2 and "FlashAttention-4" in asked_flash[0]
    assert "triton_tem_fused_flex_attention_0" in asked_flash[0]        # what ran instead is named
    asked_triton = problems(flash, "TRITON")
    assert len(asked_triton) == 2 and "FlashAttentionForwardSm90" in asked_triton[0]
    assert len(problems([ev("ampere_sgemm_64x64_nn")], "FLASH")) == 2

    # the family follows the model's kernel options, as configure_compile stores them
    assert sr.flex_kernel_family(SimpleNamespace(flex_kernel_options={"BACKEND": "FLASH"})) == "FLASH"
    assert sr.flex_kernel_family(SimpleNamespace(module=SimpleNamespace(flex_kernel_options={"BACKEND": "FLASH"}))
                                 ) == "FLASH"
    for opts in (None, {}, {"fwd_USE_TMA": True}, {"BACKEND": "TRITON"}, {"BACKEND": "AUTO"}):
        assert sr.flex_kernel_family(SimpleNamespace(flex_kernel_options=opts)) == "TRITON"
