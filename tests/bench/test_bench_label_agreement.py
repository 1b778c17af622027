"""bench/label_agreement.py: the target's argmax against the data's labels on the supervised tokens; the tiny
target's own regenerated replies agree everywhere, the corpus as written does not."""

import os

import pytest
import torch

from helpers.bench_scripts import load_bench
from helpers.launch_util import REPO

TINY = os.path.join(REPO, "dflash_dist", "assets", "tiny")


def load():
    return load_bench("label_agreement")


def test_a_position_counts_where_the_token_it_predicts_carries_a_loss():
    ids = torch.tensor([5, 1, 2, 3, 4])
    mask = torch.tensor([0, 0, 1, 1, 0])              # tokens 2 and 3 carry a loss: predicted at positions 1, 2
    logits = torch.zeros(5, 8)
    logits[0, 1] = logits[1, 2] = logits[2, 7] = logits[3, 4] = 1.0  # right, right, wrong, right (unsupervised)
    assert load().row_agreement(logits, ids, mask) == (1, 2)


def test_summary_pools_tokens_and_averages_rows():
    s = load().summarize([(9, 10), (1, 2), (0, 0)])
    assert s["rows"] == 2 and s["tokens"] == 12
    assert s["pooled"] == pytest.approx(10 / 12)
    assert s["row_mean"] == pytest.approx(0.7)
    assert s["row_mean_stderr"] == pytest.approx(0.2)


def test_own_replies_agree_everywhere_and_the_original_corpus_does_not():
    from transformers import AutoModelForCausalLM, AutoTokenizer
    mod = load()
    tok = AutoTokenizer.from_pretrained(TINY)
    model = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32).eval()
    own = mod.measure(model, tok, "builtin", 16, 512, "cpu")
    original = mod.measure(model, tok, "builtin_original", 16, 512, "cpu")
    assert own["rows"] == original["rows"] == 16
    assert own["pooled"] == 1.0
    assert original["pooled"] < 0.95
