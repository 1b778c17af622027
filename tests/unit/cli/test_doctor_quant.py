"""dflash-doctor --compare-quantization: per-layer cosine of an FP8 target's features against bf16."""

from helpers.fp8_checkpoints import write_fp8_checkpoint

from dflash_dist.cli import doctor


def _row(overrides, reference=None):
    doc = doctor.Doctor()
    doctor.check_config(doc, overrides)
    assert doc.rows[-1]["status"] == doctor.PASS, doc.rows
    doctor.check_quantization(doc, reference, n_samples=2, length=64)
    return doc.rows[-1]


def test_on_load_quantization_is_compared_with_the_unquantized_target():
    row = _row(["target.quantization=fp8", "train.device=cpu"])
    assert row["check"] == "FP8 vs bf16 features" and row["status"] == doctor.PASS, row
    cos = row["data"]["cosines"]
    assert len(cos) == len(row["data"]["layer_ids"]) and all(0.99 <= c["mean"] < 1.0 for c in cos)
    assert "quantized on load" in row["detail"] and "the same target unquantized" in row["detail"]


def test_prequantized_checkpoint_against_its_dequantized_weights_and_a_bf16_reference(tmp_path):
    from dflash_dist.targets.hf import TINY_DIR
    path = write_fp8_checkpoint(str(tmp_path / "ct"), "compressed")
    row = _row([f"target.name_or_path={path}", "train.device=cpu"])
    assert row["status"] == doctor.PASS and "dequantized" in row["detail"], row
    assert all(c["mean"] < 1.0 for c in row["data"]["cosines"])  # the FP8 GEMM really ran
    row = _row([f"target.name_or_path={path}", "train.device=cpu"], reference=TINY_DIR)
    assert row["status"] == doctor.PASS and TINY_DIR in row["detail"], row


def test_a_bf16_target_has_nothing_to_compare():
    row = _row(["train.device=cpu"])
    assert row["status"] == doctor.NA and "not FP8" in row["detail"]
