"""model/lazy_compile: torch.compile wrappers that cost nothing until their first call."""

import subprocess
import sys

import torch

from dflash_dist.model.lazy_compile import LazyCompiled, lazy_compile


def test_importing_the_compiled_modules_loads_no_compiler():
    """The modules holding compiled kernels import neither dynamo nor inductor's compile_fx (a module-level
    torch.compile would load both in every process, ~2 s of CPU)."""
    code = ("import sys\n"
            "import dflash_dist.model.drafter, dflash_dist.model.masks, dflash_dist.model.loss\n"
            "import dflash_dist.roles.target_rank.capture, dflash_dist.roles.drafter_rank.compile_guard\n"
            "print(sorted(m for m in ('torch._dynamo', 'torch._inductor.compile_fx') if m in sys.modules))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "[]", r.stdout


def test_compiles_once_on_first_call_and_computes_fn():
    calls = []

    def f(x):
        calls.append(1)
        return x * 2 + 1

    lazy = lazy_compile(f, fullgraph=True)
    assert isinstance(lazy, LazyCompiled) and lazy._compiled is None
    x = torch.arange(6.0)
    assert torch.equal(lazy(x), x * 2 + 1)
    first = lazy.compiled()
    assert lazy.compiled() is first and hasattr(first, "_torchdynamo_orig_callable")
    assert torch.equal(lazy(x + 1), (x + 1) * 2 + 1)


def test_inside_an_enclosing_compile_it_is_traced_as_fn():
    """Called from a fullgraph-compiled function (drafter.tuning.compile_layers), the enclosing graph takes fn:
    no graph break, the same values."""
    inner = lazy_compile(lambda x: torch.sin(x) * 3, fullgraph=True)
    outer = torch.compile(lambda x: inner(x) + 1, fullgraph=True)
    x = torch.linspace(0, 1, 8)
    torch.testing.assert_close(outer(x), torch.sin(x) * 3 + 1)
    assert inner._compiled is None  # never compiled on its own: the outer graph holds it
