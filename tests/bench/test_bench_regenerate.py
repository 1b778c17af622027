"""bench/regenerate.py on CPU at toy sizes: the harness runs the real regenerate_rows and writes its table."""

import json
import os
import subprocess
import sys

from helpers.launch_util import REPO


def test_regenerate_bench_tiny(tmp_path):
    out = tmp_path / "regen.json"
    r = subprocess.run([sys.executable, os.path.join(REPO, "bench", "regenerate.py"), "--tiny", "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    d = json.loads(out.read_text())
    assert [row["batch"] for row in d["rows"]] == [2, 8]
    for row in d["rows"]:
        assert row["rows_out"] == 8 and row["new_tokens"] > 0 and row["tokens_per_s"] > 0
    assert d["rows"][0]["new_tokens"] == d["rows"][1]["new_tokens"]  # greedy: the same work at every batch size
    assert "| batch |" in r.stdout
