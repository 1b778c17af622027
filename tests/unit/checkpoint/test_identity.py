"""Reading a recorded identity (run.json, a checkpoint's meta.json) that someone else wrote: malformed records
are differences or refusals, never a crash."""

import json

from test_export import make_checkpoint

from dflash_dist.checkpoint import identity as ident
from dflash_dist.checkpoint.store import checkpoint_problem

NOW = {"data": {"hash": "a" * 16, "label": "builtin"}, "tokenizer": {"hash": "b" * 16, "label": "tiny"}}


def test_malformed_recorded_identity_is_a_difference():
    assert ident.differences(dict(NOW), NOW) == []
    diffs = ident.differences({"data": "not a record", "tokenizer": NOW["tokenizer"]}, NOW)
    assert len(diffs) == 1 and diffs[0].startswith("data: the run has an unreadable record")
    assert "cannot be checked" in ident.differences([1, 2], NOW)[0]


def test_run_json_that_is_not_an_object_reads_as_none(tmp_path):
    (tmp_path / ident.RUN_JSON).write_text(json.dumps([1, 2]))
    assert ident.read_run_json(str(tmp_path)) is None
    ident.write_run_json(str(tmp_path), NOW)
    assert ident.read_run_json(str(tmp_path))["identity"] == NOW


def test_checkpoint_identity_part_of_the_wrong_shape_is_refused(tmp_path):
    ckpt, _ = make_checkpoint(tmp_path)
    path = f"{ckpt}/meta.json"
    meta = json.load(open(path))
    meta["identity"] = {"data": ["x"]}
    json.dump(meta, open(path, "w"))
    problem = checkpoint_problem(ckpt)
    assert problem is not None and "meta.json" in problem and "identity.data" in problem
