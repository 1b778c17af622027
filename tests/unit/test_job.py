"""dflash_dist.job without torchrun: run directories, resume decisions, max_steps totals, data errors, target paths."""

from __future__ import annotations

import json
import os
import random
import shutil

import pytest
from helpers.fake_run import fake_run

from dflash_dist import job as jobmod
from dflash_dist.checkpoint import identity as ident
from dflash_dist.config import ConfigError, JobConfig
from dflash_dist.data.conversations import REGENERATED_JSONL, DataError
from dflash_dist.targets.hf import TINY_DIR, check_target_paths


def cfg(**train):
    d = {"target": {"hf_config": {"builtin": "tiny"}}, "train": dict(train)}
    return JobConfig.from_dict(d)


def identity(source="builtin", tok=TINY_DIR, **train):
    c = cfg(**train)
    c.data.source = source
    out = ident.data_identity(c, tok, 2048)
    out["target"] = {"hash": "t" * 16, "label": "tiny"}
    out["drafter"] = {"hash": "d" * 16, "label": "2 layers"}
    return out


def test_identity_is_content_not_paths(tmp_path):
    """The same data and tokenizer files at other paths are the same run; one changed byte is another."""
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    shutil.copy(REGENERATED_JSONL, a)
    shutil.copy(REGENERATED_JSONL, b)
    tok2 = tmp_path / "tok"
    shutil.copytree(TINY_DIR, tok2)
    assert ident.differences(identity(str(a)), identity(str(b), tok=str(tok2))) == []
    assert identity(str(a))["tokenizer"]["hash"] == identity(str(a), tok=str(tok2))["tokenizer"]["hash"]
    assert identity(str(a))["data"]["hash"] == identity(str(b))["data"]["hash"]
    with open(b, "a") as f:
        f.write('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n')
    diffs = ident.differences(identity(str(a)), identity(str(b)))
    assert len(diffs) == 1 and diffs[0].startswith("data:") and "data.source" in diffs[0]
    assert ident.differences(identity(str(a)), identity(str(a))) == []
    assert "older dflash_dist" in ident.differences(None, identity())[0]


def test_new_run_dirs_are_distinct(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first = jobmod.resolve_run(cfg(), identity())["run_dir"]
    os.makedirs(first)
    second = jobmod.resolve_run(cfg(), identity())["run_dir"]
    assert first.startswith(os.path.join("outputs", "run-")) and second != first


def test_a_directory_holding_a_run_is_refused_for_a_new_run(tmp_path):
    run = tmp_path / "run"
    fake_run(run, identity())
    with pytest.raises(ConfigError) as e:
        jobmod.resolve_run(cfg(output_dir=str(run)), identity())
    msg = str(e.value)
    assert str(run) in msg and "already holds a run" in msg and "train.resume=auto" in msg


def test_resume_of_another_dataset_is_refused_naming_what_differs(tmp_path):
    run = tmp_path / "run"
    fake_run(run, identity())
    other = tmp_path / "mine.jsonl"
    shutil.copy(REGENERATED_JSONL, other)
    with pytest.raises(ConfigError) as e:
        jobmod.resolve_run(cfg(output_dir=str(run), resume="auto"), identity(str(other)))
    msg = str(e.value)
    assert str(run) in msg and "data:" in msg and "mine.jsonl" in msg
    assert "train.output_dir" in msg and "train.resume=none" in msg
    assert "tokenizer:" not in msg  # the same tokenizer files: not named as a difference


def test_resume_of_a_matching_run(tmp_path, monkeypatch):
    run = tmp_path / "run"
    ck = fake_run(run, identity())
    assert jobmod.resolve_run(cfg(output_dir=str(run), resume="auto"), identity()) == \
        {"run_dir": str(run), "resume_from": ck}
    # without train.output_dir: the newest run under outputs/ of the same data, target and drafter
    monkeypatch.chdir(tmp_path)
    os.makedirs("outputs")
    shutil.copytree(run, "outputs/run-20260101-000000")
    got = jobmod.resolve_run(cfg(resume="auto"), identity())
    assert got["run_dir"] == os.path.join("outputs", "run-20260101-000000")
    # an explicit checkpoint path: its own run directory
    got = jobmod.resolve_run(cfg(resume=ck), identity())
    assert got == {"run_dir": str(run), "resume_from": ck}


def _job(c, lengths, resumed=None):
    epoch = jobmod.plan_for(lengths, c, 1)
    j = jobmod.Job(cfg=c, dist=None, run_dir="x", hf_config=None, layer_ids=[1], mask_token_id=0, tokenizer_path="",
                   dataset_path="", holdout_path="", plan=jobmod.plan_for(lengths, c, c.train.epochs),
                   total_messages=0, start_cursor=0, start_step=0, resume_from=None, sample_lengths=lengths,
                   epoch_messages=len(epoch), epochs_messages=len(jobmod.plan_for(lengths, c, c.train.epochs)))
    if resumed:
        j.resume_from, j.resumed_meta = "ck", resumed
        j.start_step, j.start_cursor = resumed["step"], resumed["cursor"]
    return j, epoch


def test_max_steps_trains_exactly_that_many_steps_repeating_the_data():
    c = cfg(max_steps=30, epochs=3)
    c.target.max_batch_samples = 16
    j, epoch = _job(c, [20] * 180, None)
    assert 3 * len(epoch) < 60  # the 3 epochs would stop it first
    jobmod.fix_total(j, num_drafters=2)
    assert j.total_messages == 60 and len(j.plan) >= 60
    assert j.plan[:len(epoch)] == epoch  # more epochs of the same plan, the same order
    # mixed lengths under a token budget: each epoch packs to its own number of messages (here 58, then fewer)
    c2 = cfg(max_steps=-1, epochs=3)
    c2.target.max_batch_samples, c2.target.max_batch_tokens, c2.data.sort_window_batches = 16, 1024, 1
    r = random.Random(0)
    lengths = [r.randint(16, 400) for _ in range(180)]
    j2, epoch2 = _job(c2, lengths)
    jobmod.fix_total(j2, num_drafters=2)
    assert j2.total_messages == len(jobmod.plan_for(lengths, c2, 3)) == len(j2.plan) != 3 * len(epoch2)
    c3 = cfg(max_steps=100, epochs=3)
    c3.target.max_batch_samples, c3.target.max_batch_tokens, c3.data.sort_window_batches = 16, 1024, 1
    j3, _ = _job(c3, lengths)
    jobmod.fix_total(j3, num_drafters=2)
    assert j3.total_messages == 200 and len(j3.plan) >= 200


def test_resume_with_a_larger_max_steps_extends_and_a_finished_run_has_nothing_left(caplog):
    c = cfg(max_steps=30)
    meta = {"step": 30, "cursor": 60, "total_messages": 60, "job_config": {"train": {"max_steps": 30, "epochs": 3}}}
    j, _ = _job(c, [20] * 180, meta)
    assert "nothing left to train" in jobmod._nothing_left(j) and "train.max_steps" in jobmod._nothing_left(j)
    c = cfg(max_steps=50)
    j, _ = _job(c, [20] * 180, meta)
    assert jobmod._nothing_left(j) is None
    with caplog.at_level("INFO", logger="dflash_dist"):
        jobmod.fix_total(j, num_drafters=2)
    assert j.total_messages == 60 + 20 * 2
    assert "extends from 60 to 100 messages" in caplog.text
    # an unchanged config continues the checkpoint's own total (a resume with another split replays the plan)
    meta2 = dict(meta, step=10, cursor=20)
    j, _ = _job(cfg(max_steps=30), [20] * 180, meta2)
    jobmod.fix_total(j, num_drafters=1)
    assert j.total_messages == 60


def test_target_paths_that_do_not_exist_are_named():
    for p in ("/models/does-not-exist", "./nope", "~/nope", "a/b/c"):
        c = cfg()
        c.target.name_or_path = p
        with pytest.raises(ConfigError, match="no such directory"):
            check_target_paths(c)
    c = cfg()
    c.target.name_or_path = "Qwen/Qwen3-8B"  # a hub id: left to transformers
    check_target_paths(c)


def _prepare(tmp_path, rows, holdout=16):
    src = tmp_path / "data.jsonl"
    src.write_text("".join(rows))
    c = cfg()
    c.data.source, c.data.holdout, c.data.num_workers = str(src), holdout, 0
    return jobmod.prepare_data(c, 0, None, str(tmp_path / "cache"), TINY_DIR, 2048, "k")


def test_empty_or_all_bad_data_is_one_message_naming_the_file(tmp_path):
    with pytest.raises(DataError) as e:
        _prepare(tmp_path, [])
    assert "data.jsonl" in str(e.value) and "no usable conversation in 0 row" in str(e.value)
    with pytest.raises(DataError) as e:
        _prepare(tmp_path, ["not json\n", '{"messages": []}\n', '{"text": "x"}\n'])
    msg = str(e.value)
    assert "no usable conversation in 3 row" in msg and "holdout" not in msg
    assert "malformed_json: 1" in msg and "empty_messages: 1" in msg and "missing_messages: 1" in msg


def test_small_files_train_with_a_holdout_scaled_to_the_data(tmp_path, caplog):
    with open(REGENERATED_JSONL) as f:
        rows = [next(f) for _ in range(50)]
    with caplog.at_level("INFO", logger="dflash_dist"):
        ds_path, ho_path = _prepare(tmp_path, rows, holdout=64)
    assert sum(1 for _ in open(ho_path)) == 5  # 10% of 50, not data.holdout=64
    assert "5 held out" in caplog.text
    from dflash_dist.data.tokenize import TokenizedDataset
    assert len(TokenizedDataset.load(ds_path)) == 45


def test_dflash_eval_finds_the_same_held_out_conversations(tmp_path):
    """dflash-eval rebuilds the held-out prompts from the run's data section: the same scaled split."""
    from dflash_dist.config import DataConfig
    from dflash_dist.eval.prompts import holdout_conversations
    with open(REGENERATED_JSONL) as f:
        rows = [next(f) for _ in range(50)]
    _, ho_path = _prepare(tmp_path, rows, holdout=64)
    written = [json.loads(x)["messages"] for x in open(ho_path)]
    again = holdout_conversations(DataConfig(source=str(tmp_path / "data.jsonl"), holdout=64))
    assert [c["messages"] for c in again] == written and len(written) == 5


def test_a_changed_tokenizer_file_is_a_new_data_cache(tmp_path, caplog):
    """The data cache is named by content: the same tokenizer files elsewhere reuse it; one edited file (here
    the chat template, which changes the loss masks) names another cache, tokenized anew with the new files."""
    from dflash_dist.data.tokenize import TokenizedDataset, cache_key
    with open(REGENERATED_JSONL) as f:
        (tmp_path / "data.jsonl").write_text("".join(next(f) for _ in range(30)))
    c = cfg()
    c.data.source, c.data.holdout, c.data.num_workers = str(tmp_path / "data.jsonl"), 3, 0
    tok = tmp_path / "tok"
    shutil.copytree(TINY_DIR, tok)

    def prepare(tok_dir):
        i = ident.data_identity(c, str(tok_dir), 2048)
        key = cache_key(i["data"]["hash"], i["tokenizer"]["hash"])
        caplog.clear()
        with caplog.at_level("INFO", logger="dflash_dist"):
            ds_path, _ = jobmod.prepare_data(c, 0, None, str(tmp_path / "cache"), str(tok_dir), 2048, key)
        return key, TokenizedDataset.load(ds_path), "tokenized in" in caplog.text

    key, ds, built = prepare(TINY_DIR)
    assert built
    assert prepare(tok)[0] == key and not prepare(tok)[2]  # the same files at another path: the cache is read
    conf = json.loads((tok / "tokenizer_config.json").read_text())
    conf["chat_template"] = conf["chat_template"].replace("'<|im_end|>' + '\\n'", "'<|im_end|>' + '\\n\\n'")
    assert conf["chat_template"] != json.loads((tok / "tokenizer_config.json").read_text())["chat_template"]
    (tok / "tokenizer_config.json").write_text(json.dumps(conf))
    key2, ds2, built2 = prepare(tok)
    assert key2 != key and built2
    assert ds2.num_tokens != ds.num_tokens  # tokenized with the edited template, not read from the old cache
    files = [("train", "pt"), ("holdout", "jsonl"), ("info", "json")]
    assert sorted(os.listdir(tmp_path / "cache")) == sorted(f"{kind}-{k}.{ext}" for k in (key, key2)
                                                            for kind, ext in files)


def test_a_cache_hit_reports_what_the_build_did_and_applies_the_bad_row_limit(tmp_path, caplog):
    """Read from the cache, the data step logs the same counts and bad-row summary as when it tokenized, and
    data.max_bad_fraction (not part of the cache key) still refuses data with too many bad rows."""
    with open(REGENERATED_JSONL) as f:
        rows = [next(f) for _ in range(50)] + ["not json\n"]
    c = cfg()
    src = tmp_path / "data.jsonl"
    src.write_text("".join(rows))
    c.data.source, c.data.num_workers, c.data.max_bad_fraction = str(src), 0, 0.5
    for attempt in ("build", "hit"):
        caplog.clear()
        with caplog.at_level("INFO", logger="dflash_dist"):
            jobmod.prepare_data(c, 0, None, str(tmp_path / "cache"), TINY_DIR, 2048, "k")
        assert "50 conversations, 5 held out" in caplog.text, attempt
        assert "malformed_json: 1" in caplog.text, attempt
        assert ("tokenized earlier" in caplog.text) == (attempt == "hit")
    c.data.max_bad_fraction = 0.01
    with pytest.raises(DataError, match="more than data.max_bad_fraction=0.01"):
        jobmod.prepare_data(c, 0, None, str(tmp_path / "cache"), TINY_DIR, 2048, "k")


def test_max_length_beyond_the_targets_positions_is_refused_before_any_model_loads(monkeypatch, caplog):
    """data.max_length against a tiny target's max_position_embeddings: refused in check_job_config (one line),
    allowed where its RoPE scaling reaches it, and the log says so."""
    import logging

    from helpers.standalone_drafter import compose_job_config

    from dflash_dist.targets import hf

    def no_model(*a, **k):
        raise AssertionError("a model was built")
    monkeypatch.setattr(hf, "build_target_model", no_model)
    base = ["target=tiny_mistral", "target.hf_config.max_position_embeddings=256", "data.max_length=300"]
    with pytest.raises(ConfigError) as e:
        jobmod.check_job_config(compose_job_config(base), 3, "cpu")
    assert "\n" not in str(e.value) and str(e.value).startswith(
        "data.max_length=300 is beyond the target's positions: max_position_embeddings 256")
    scaled = base + ["++target.hf_config.rope_parameters={rope_type: linear, rope_theta: 1000000.0, factor: 2.0}"]
    with caplog.at_level(logging.INFO, logger="dflash_dist"):
        jobmod.check_job_config(compose_job_config(scaled), 3, "cpu")
    assert "allowed by its linear RoPE scaling, factor 2 x 256 = 512 positions" in caplog.text
