"""bench/domino_term.py: Domino's term as trained against the checkpointed reference, same gradients."""

import json

from helpers.bench_scripts import load_bench


def test_the_term_and_its_reference_give_the_same_gradients(tmp_path):
    out = tmp_path / "dt.json"
    assert load_bench("domino_term").main(["--device", "cpu", "--shape", "tiny", "--rows", "150", "--emb", "8",
                                           "--chunk", "64", "--warmup", "0", "--repeats", "1",
                                           "--out", str(out)]) == 0
    got = json.loads(out.read_text())
    assert [r["path"] for r in got["results"]] == ["objective", "term", "reference"]
    assert all(r["ms"] > 0 for r in got["results"])
    assert max(got["grad_rel_diff"].values()) < 1e-4     # fp32 softmax both ways: a wrong term is off by O(1)
