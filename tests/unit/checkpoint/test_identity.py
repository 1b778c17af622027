"""Reading a recorded identity (run.json, a checkpoint's meta.json) that someone else wrote: malformed records
are differences or refusals, never a crash; what the drafter's identity holds, and how a difference is named."""

import json

import pytest
from tests.unit.export.test_export import make_checkpoint

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
    from dflash_dist.targets.hf import load_hf_config
    bf16 = TargetConfig(hf_config={"builtin": "tiny"})
    fp8 = TargetConfig(hf_config={"builtin": "tiny"}, quantization="fp8")
    hf = load_hf_config(bf16)
    a, b = (ident.target_identity(SimpleNamespace(target=t), hf) for t in (bf16, fp8))
    assert a["hash"] != b["hash"] and b["label"] == "builtin tiny, quantized fp8 on load"
    assert a == ident.target_identity(SimpleNamespace(target=TargetConfig(hf_config={"builtin": "tiny"})), hf)
def _drafter_identity(**drafter):
    from dflash_dist.config import JobConfig
    cfg = JobConfig.from_dict({"target": {"hf_config": {"builtin": "tiny"}}, "drafter": drafter})
    return {"drafter": ident.drafter_identity(cfg, [1, 2], 3, 32)}


D2 = {"variant": "dflash2", "block_size": 8}


@pytest.mark.parametrize("key,was,now", [("selector_rank", 32, 64), ("selector_top_k", 8, 16),
                                         ("conv_kernel_size", 2, 3), ("conv_group_size", 16, 8),
                                         ("selector_gold", "exclude", "replace_last"),
                                         ("selector_loss_weight", 1.0, 0.5), ("final_logit_softcapping", None, 30.0),
                                         ("output_multiplier", 1.0, 2.0)])
def test_a_variant_setting_is_part_of_the_drafter_identity_and_named_with_both_values(key, was, now):
    """Every setting the variant declares (``identity_fields``: DFlash2's drafter.dflash2.*) changes the drafter's
    hash; the difference names the field and both values, and only that field."""
    run, job = _drafter_identity(**D2, dflash2={key: was}), _drafter_identity(**D2, dflash2={key: now})
    assert run["drafter"]["hash"] != job["drafter"]["hash"]
    (diff,) = ident.differences(run, job)
    named = diff.split("; the run has")[0]
    assert named == f"drafter: drafter.dflash2.{key} is {json.dumps(was)} in the run, {json.dumps(now)} in this job"
    assert ident.differences(run, _drafter_identity(**D2, dflash2={key: was})) == []


def test_the_conv_dtype_is_a_step_setting_not_part_of_the_identity():
    """drafter.dflash2.conv_dtype sets how the step computes (like drafter.tuning): a run resumes with either."""
    assert ident.differences(_drafter_identity(**D2, dflash2={"conv_dtype": "input"}),
                             _drafter_identity(**D2, dflash2={"conv_dtype": "compute"})) == []
    assert _drafter_identity(**D2, dflash2={"conv_dtype": "compute"}) == _drafter_identity(**D2)


def test_settings_the_variant_normalises_are_one_identity():
    assert ident.differences(_drafter_identity(**D2, dflash2={"final_logit_softcapping": 0}),
                             _drafter_identity(**D2)) == []


def test_a_changed_variant_is_named_alone_and_dflash_keeps_its_hash():
    (diff,) = ident.differences(_drafter_identity(block_size=8), _drafter_identity(**D2))
    assert diff.startswith('drafter: drafter.variant is "dflash" in the run, "dflash2" in this job; the run has')
    # the default drafter's hash is still that of its shape alone (runs from before keep theirs)
    shape = {"num_layers": 5, "block_size": 16, "intermediate_size": None, "layer_ids": [1, 2],
             "mask_token_id": 3, "hidden_size": 32}
    assert _drafter_identity()["drafter"]["hash"] == ident._sha(json.dumps(shape, sort_keys=True).encode())[:16]


def test_the_sliding_window_is_part_of_the_drafter_identity():
    full, w64, w32 = (_drafter_identity(**D2, **kw) for kw in ({}, {"sliding_window": 64}, {"sliding_window": 32}))
    (diff,) = ident.differences(w64, w32)
    assert diff.startswith("drafter: drafter.sliding_window is 64 in the run, 32 in this job; ")
    (diff,) = ident.differences(full, w64)
    assert "drafter.sliding_window is null in the run, 64 in this job" in diff
    assert _drafter_identity(**D2, layer_types=["full_attention"] * 5) == full


def test_a_setting_left_out_of_the_hash_at_its_default_is_named_with_its_default():
    (diff,) = ident.differences(_drafter_identity(loss={"labels": "target", "kind": "kl", "kl_top_k": 8}),
                                _drafter_identity())
    named = diff.split("; the run has")[0]
    assert named == ('drafter: drafter.loss.labels is "target" in the run, "data" in this job; drafter.loss.kind is '
                     '"kl" in the run, "ce" in this job; drafter.loss.kl_top_k is 8 in the run, null in this job')


def test_a_record_without_fields_falls_back_to_the_labels():
    """Identities written before fields were recorded: the difference names the part's labels and hashes."""
    old = {"drafter": {k: v for k, v in _drafter_identity(**D2)["drafter"].items() if k != "fields"}}
    old["drafter"]["hash"] = "0" * 16
    (diff,) = ident.differences(old, _drafter_identity(**D2))
    assert diff.startswith("drafter: the run has dflash2 drafter") and " is " not in diff.split("(see")[0]


def test_checkpoint_identity_fields_of_the_wrong_shape_are_refused(tmp_path):
    ckpt, _ = make_checkpoint(tmp_path)
    path = f"{ckpt}/meta.json"
    meta = json.load(open(path))
    meta["identity"] = {"drafter": {"hash": "a" * 16, "label": "x", "fields": [1]}}
    json.dump(meta, open(path, "w"))
    problem = checkpoint_problem(ckpt)
    assert problem is not None and "identity.drafter.fields" in problem


def test_fields_differ_exactly_when_the_hash_does():
    configs = [{}, {"block_size": 8}, {"sliding_window": 64}, {"loss": {"kind": "kl", "labels": "target"}},
               {"loss": {"kind": "kl", "labels": "target", "kl_top_k": 4}}, {"loss": {"kl_top_k": 4}},
               {"loss": {"weighting": "dpace"}}, {"loss": {"weighting": "dpace", "dpace_alpha": 0.3}},
               {"loss": {"dpace_alpha": 0.3}}, D2, dict(D2, dflash2={"selector_rank": 8}), {"variant": "domino"}]
    records = [_drafter_identity(**c)["drafter"] for c in configs]
    for a in records:
        for b in records:
            assert (a["hash"] == b["hash"]) == (a["fields"] == b["fields"]), (a["fields"], b["fields"])
