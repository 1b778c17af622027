"""checkpoint/tensor_types: an integer tensor where a drafter's float weight belongs is refused by resume,
dflash-export, dflash-eval and dflash-doctor --export, naming the tensor (load_state_dict would cast it silently)."""

import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from tests.unit.export.test_export import make_checkpoint
from test_hostile import eval_argv, no_network, refresh_size, refused  # noqa: F401  (no_network: autouse fixture)

from dflash_dist.export.write import export_checkpoint
from dflash_dist.export.load import CheckpointInputError, load_export
from dflash_dist.checkpoint.safe_io import CheckpointError
from dflash_dist.checkpoint.store import checkpoint_problem, find_latest, load_checkpoint
from dflash_dist.checkpoint.tensor_types import check_float_tensors
from dflash_dist.cli.doctor import Doctor, check_export
from dflash_dist.cli.eval import main as eval_main
from dflash_dist.cli.export import main as export_main

KEY = "fc.weight"


def retype(path: str, dtype: torch.dtype) -> None:
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    tensors[KEY] = tensors[KEY].round().to(dtype)
    save_file(tensors, file, metadata={"format": "pt"})


@pytest.mark.parametrize("dtype, name", [(torch.int64, "I64"), (torch.int32, "I32"), (torch.uint8, "U8"),
                                         (torch.bool, "BOOL")])
def test_integer_weights_in_a_checkpoint_are_refused(tmp_path, capsys, dtype, name):
    ckpt, _ = make_checkpoint(tmp_path)
    retype(ckpt, dtype)
    refresh_size(ckpt, "model.safetensors")
    problem = checkpoint_problem(ckpt)   # what train.resume=auto asks: the checkpoint is skipped with this reason
    assert problem is not None and f"tensor {KEY}: {name} is not a floating-point type" in problem, problem
    assert find_latest(str(tmp_path / "run")) is None
    with pytest.raises(CheckpointError, match=f"tensor {KEY}"):
        load_checkpoint(ckpt)
    refused(capsys, export_main, [ckpt, str(tmp_path / "x")], "model.safetensors", f"tensor {KEY}")
    refused(capsys, eval_main, eval_argv(tmp_path, ckpt), "model.safetensors", f"tensor {KEY}")


def test_integer_weights_in_an_export_are_refused(tmp_path, capsys):
    ckpt, _ = make_checkpoint(tmp_path)
    out = export_checkpoint(ckpt, str(tmp_path / "e"), dtype="float32")
    retype(out, torch.int64)
    with pytest.raises(CheckpointInputError, match=f"tensor {KEY}: I64"):
        load_export(out)
    refused(capsys, eval_main, eval_argv(tmp_path, export=out), "model.safetensors", f"tensor {KEY}")
    doc = Doctor()
    check_export(doc, out)
    assert doc.rows[-1]["status"] == "FAIL" and f"tensor {KEY}: I64" in doc.checkpoint_error


def test_float_types_pass():
    check_float_tensors("f", {"a": ("F32", (2,)), "b": ("BF16", (2,)), "c": ("F16", ()), "d": ("F64", (1,))})
    with pytest.raises(CheckpointError, match=r"tensor a: F8_E4M3 is not a floating-point type \(and 1 more\)"):
        check_float_tensors("f", {"a": ("F8_E4M3", (2,)), "b": ("I8", (2,)), "c": ("F32", (1,))})
