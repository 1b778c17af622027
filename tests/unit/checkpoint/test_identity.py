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


def test_drafter_identity_records_a_loss_weighting_other_than_the_default(tmp_path):
    from types import SimpleNamespace

    from dflash_dist.config import DrafterConfig

    def drafter(**loss):
        return ident.drafter_identity(SimpleNamespace(drafter=DrafterConfig(loss=loss)), [1, 2], 7, 32)

    dc = DrafterConfig()  # the default: the hash of the shape alone, as runs from before record it
    shape = {"num_layers": dc.num_layers, "block_size": dc.block_size, "intermediate_size": dc.intermediate_size,
             "layer_ids": [1, 2], "mask_token_id": 7, "hidden_size": 32}
    assert drafter()["hash"] == ident._sha(json.dumps(shape, sort_keys=True).encode())[:16]
    assert drafter(weighting="decay", dpace_alpha=0.3) == drafter()
    dpace = drafter(weighting="dpace")
    assert dpace["hash"] != drafter()["hash"] and "D-PACE" in dpace["label"]
    assert drafter(weighting="dpace", dpace_alpha=0.3)["hash"] != dpace["hash"]
    diff = ident.differences({"drafter": drafter()}, {"drafter": dpace})
    assert len(diff) == 1 and "loss.weighting" in diff[0] and "D-PACE" in diff[0]


def test_checkpoint_with_an_unknown_loss_weighting_is_refused(tmp_path):
    ckpt, _ = make_checkpoint(tmp_path)
    path = f"{ckpt}/meta.json"
    meta = json.load(open(path))
    meta["drafter"] = {"variant": "dflash", "loss": {"objective": "decayed_ce", "weighting": "uniform"}}
    json.dump(meta, open(path, "w"))
    problem = checkpoint_problem(ckpt)
    assert problem is not None and "drafter.loss.weighting" in problem
    meta["drafter"]["loss"].update(weighting="dpace", dpace_alpha=2.0)
    json.dump(meta, open(path, "w"))
    assert "drafter.loss.dpace_alpha" in (checkpoint_problem(ckpt) or "")


def test_target_identity_tells_an_fp8_target_from_its_bf16_source():
    from types import SimpleNamespace

    from dflash_dist.config import TargetConfig
    from dflash_dist.model.hf import load_hf_config
    bf16 = TargetConfig(hf_config={"builtin": "tiny"})
    fp8 = TargetConfig(hf_config={"builtin": "tiny"}, quantization="fp8")
    hf = load_hf_config(bf16)
    a, b = (ident.target_identity(SimpleNamespace(target=t), hf) for t in (bf16, fp8))
    assert a["hash"] != b["hash"] and b["label"] == "builtin tiny, quantized fp8 on load"
    assert a == ident.target_identity(SimpleNamespace(target=TargetConfig(hf_config={"builtin": "tiny"})), hf)
