"""``torch.compile`` wrappers that compile on their first call.

``torch.compile(fn)`` imports dynamo and inductor's ``compile_fx`` the moment it wraps ``fn`` (about 2 s of CPU
per process, torch 2.13). A wrapper made at module level would charge that to every process importing the
module, also to the ranks whose path never compiles anything (the sdpa drafter, a padded capture). ``lazy_compile``
makes the same ``torch.compile`` object on the first call instead; until then dynamo stays unimported.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

__all__ = ["LazyCompiled", "lazy_compile"]


class LazyCompiled:
    """``torch.compile(fn, **options)``, made on the first call (or ``compiled()``) and kept."""

    def __init__(self, fn: Callable, **options: Any):
        self.fn = fn
        self.options = options
        self._compiled: Optional[Callable] = None

    def compiled(self) -> Callable:
        if self._compiled is None:
            self._compiled = torch.compile(self.fn, **self.options)
        return self._compiled

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            # traced inside an enclosing compiled graph (drafter.tuning.compile_layers): that graph takes fn
            # itself, as dynamo does with a nested torch.compile'd function
            return self.fn(*args, **kwargs)
        return self.compiled()(*args, **kwargs)


def lazy_compile(fn: Callable, **options: Any) -> LazyCompiled:
    return LazyCompiled(fn, **options)
