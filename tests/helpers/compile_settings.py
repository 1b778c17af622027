"""The process-wide torch.compile settings dflash_dist changes, put back exactly after a test.

``DFlashDrafter.configure_compile`` (optimize_ddp, two inductor triton options) and
``compile_guard.install_guard`` (the recompile limit, fail-on-limit, suppress_errors) set module-level config of
``torch._dynamo`` / ``torch._inductor``. Tests restore them with the configs' own ``patch`` context managers,
never with ``monkeypatch.setattr``: pytest 9.2's undo deletes an attribute it did not find in the target's
``__dict__`` (a config module keeps its values elsewhere), which removes the key and breaks every later compile
("torch._inductor.config.triton.mix_order_reduction does not exist").
"""

import contextlib

DYNAMO_KEYS = ("optimize_ddp", "recompile_limit", "cache_size_limit", "fail_on_recompile_limit_hit",
               "fail_on_cache_limit_hit", "suppress_errors")
INDUCTOR_KEYS = ("triton.coalesce_tiling_analysis", "triton.mix_order_reduction")
# old names the newer ones alias (setting either sets both): patch only the first present of each pair
_ALIASES = (("recompile_limit", "cache_size_limit"), ("fail_on_recompile_limit_hit", "fail_on_cache_limit_hit"))


def _current(cfg, keys):
    present = [k for k in keys if hasattr(cfg, k)]
    for new, old in _ALIASES:
        if new in present and old in present:
            present.remove(old)
    return {k: getattr(cfg, k) for k in present}


@contextlib.contextmanager
def compile_settings_restored():
    """Inside: change any of DYNAMO_KEYS / INDUCTOR_KEYS freely; on exit each has its value from before."""
    import torch._dynamo.config as dc
    import torch._inductor.config as ic
    with dc.patch(_current(dc, DYNAMO_KEYS)), ic.patch(_current(ic, INDUCTOR_KEYS)):
        yield
