"""bench/dflash2_conv.py --tiny: every formulation of the DFlash2 conv timed compiled, and equal in fp32."""

import json
import os
import subprocess
import sys

from helpers.launch_util import REPO


def test_conv_bench_times_every_form_and_they_agree(tmp_path):
    out = tmp_path / "conv.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=REPO)
    r = subprocess.run([sys.executable, os.path.join(REPO, "bench", "dflash2_conv.py"), "--tiny", "--out", str(out)],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    rows = {x["form"]: x for x in json.load(open(out))["rows"]}
    assert set(rows) == {"reduce", "matmul", "blockpad"}
    for row in rows.values():
        assert row["ms_fwd_bwd"] > 0 and row["max_abs_diff_vs_reduce_fp32"] < 1e-4
