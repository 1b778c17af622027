import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("WANDB_MODE", "offline")

from helpers.compile_settings import compile_settings_restored  # noqa: E402  (tests/ on sys.path above)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny matmuls: one intra-op thread is 10-50x faster than two fighting over a busy 2-core CPU."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def _compile_settings():
    """configure_compile and install_guard set dynamo/inductor config process-wide: each test leaves it as found
    (the configs' own patch(), tests/helpers/compile_settings.py)."""
    with compile_settings_restored():
        yield
