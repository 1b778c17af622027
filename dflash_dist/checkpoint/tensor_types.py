"""The tensor types of a drafter's ``model.safetensors`` (a checkpoint's or an export's): every weight a
floating-point tensor. An integer tensor where a weight belongs (``int64``, ``bool``, ``uint8``) would be cast into
the float parameter by ``load_state_dict`` without a word, and an FP8 one read as its raw bytes: refused with the
tensor's name, before anything is built from it (resume, dflash-export, dflash-eval, dflash-doctor --export)."""

from __future__ import annotations

from dflash_dist.checkpoint.safe_io import fail, safetensors_header

FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")


def check_float_tensors(file: str, header: dict) -> None:
    """Every tensor of ``header`` ({name: (dtype, shape)}) of a floating-point type (F32, BF16, F16, F64)."""
    bad = sorted(k for k, (dtype, _) in header.items() if dtype not in FLOAT_DTYPES)
    if bad:
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise fail(file, f"tensor {bad[0]}", f"{header[bad[0]][0]} is not a floating-point type{more}: a drafter's "
                   f"weights are {', '.join(FLOAT_DTYPES)}")


def float_header(path: str) -> dict:
    """:func:`safe_io.safetensors_header` of a drafter's weights file, every tensor checked to be floating point."""
    header = safetensors_header(path)
    check_float_tensors(path, header)
    return header
