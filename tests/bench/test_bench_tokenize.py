"""bench/experiments/tokenize_workers.py runs end to end at toy sizes and writes the table it promises."""

import json
import os
import subprocess
import sys

from helpers.launch_util import REPO


def test_tokenize_workers_bench_writes_its_table(tmp_path):
    out = tmp_path / "tok.json"
    script = os.path.join(REPO, "bench", "experiments", "tokenize_workers.py")
    p = subprocess.run([sys.executable, script, "--rows", "40",
                        "--workers", "2", "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=REPO))
    assert p.returncode == 0, p.stdout + p.stderr
    res = json.loads(out.read_text())
    assert res["rows"] == [40] and res["workers"] == [0, 2]
    assert set(res["seconds"]) == {"40x0", "40x2"} and all(v > 0 for v in res["seconds"].values())
    assert "2" in res["crossover_rows"] and "2 workers" in p.stdout.splitlines()[-1]
