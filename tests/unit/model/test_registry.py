"""model/registry: a ``module:Class`` names a class of its kind, checked before anything calls it; a file names a
part without importing anything."""

import os
import sys

import pytest
from test_spec import TARGET

from dflash_dist.config import ConfigError, DrafterConfig, DrafterLoss
from dflash_dist.model.objectives import OBJECTIVES, Objective
from dflash_dist.model.spec import resolve_drafter
from dflash_dist.model.variants import VARIANTS, DFlash


@pytest.fixture
def calls(monkeypatch):
    """os.abort / sys.exit replaced by recorders: the test asserts neither was called."""
    seen = []
    for mod, name in ((os, "abort"), (sys, "exit")):
        monkeypatch.setattr(mod, name, lambda *a, _n=name, **k: seen.append(_n))
    return seen


@pytest.mark.parametrize("name", ["os:getcwd", "os:abort", "sys:exit", "os:sep"])
def test_a_command_line_name_that_is_not_a_part_is_refused_uncalled(name, calls):
    with pytest.raises(ConfigError, match="drafter.variant=.*is not a drafter variant class"):
        resolve_drafter(DrafterConfig(num_layers=2, block_size=4, variant=name), TARGET, 3, "cpu")
    with pytest.raises(ConfigError, match="drafter.loss.objective=.*is not a objective class"):
        resolve_drafter(DrafterConfig(num_layers=2, block_size=4, loss=DrafterLoss(objective=name)), TARGET, 3, "cpu")
    assert calls == []


def test_bases_and_plugins():
    assert VARIANTS.base is DFlash and OBJECTIVES.base is Objective
    assert VARIANTS.get("helpers.toy_seams:ScaledDFlash").__name__ == "ScaledDFlash"   # a plugin still works
    assert VARIANTS.get_named_in_file("dflash") is DFlash


def test_a_file_never_imports_and_names_only_parts(calls):
    sys.modules.pop("json.tool", None)
    for name in ("json.tool:main", "sys:exit", "os:abort", 3, "nope"):
        with pytest.raises(ConfigError):
            VARIANTS.get_named_in_file(name)
    assert "json.tool" not in sys.modules and calls == []
    import helpers.toy_seams  # noqa: F401  (the program imported it itself)
    assert VARIANTS.get_named_in_file("helpers.toy_seams:ScaledDFlash").__name__ == "ScaledDFlash"
