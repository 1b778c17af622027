"""Tests of dflash_dist.data.sources: ShareGPT and messages rows from JSONL, JSON, parquet, arrow and save_to_disk
sources with bad rows located; bounded memory when streaming; chat_template_kwargs through training, evaluation
and regeneration."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tracemalloc

import pytest
import torch

from dflash_dist.data import sources, tokenize
from dflash_dist.data.conversations import ASSETS_TINY, BadDataStats, DataError

MSG_ROW = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}
SHAREGPT_ROW = {"id": "a1", "conversations": [{"from": "system", "value": "Be brief."},
                                              {"from": "human", "value": "What is 2+2?"},
                                              {"from": "gpt", "value": "4."}]}
SHAREGPT_BAD_ROLE = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "robot", "value": "Beep."}]}
SHAREGPT_NO_VALUE = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt"}]}
EXPECTED_SHAREGPT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
                     {"role": "assistant", "content": "4."}]


def test_normalize_sharegpt_rows():
    assert sources.normalize_row(SHAREGPT_ROW) == {"id": "a1", "messages": EXPECTED_SHAREGPT}
    assert sources.normalize_row(MSG_ROW) is MSG_ROW
    assert sources.normalize_row({"conversations": [{"from": "Human", "value": "x"}]})["messages"][0]["role"] == "user"


def test_jsonl_mixes_messages_and_sharegpt_rows_and_locates_bad_ones(tmp_path):
    p = tmp_path / "mixed.jsonl"
    lines = [json.dumps(MSG_ROW), json.dumps(SHAREGPT_ROW), "{not json", json.dumps(SHAREGPT_BAD_ROLE), "",
             json.dumps(SHAREGPT_NO_VALUE)]
    p.write_text("\n".join(lines) + "\n")
    stats = BadDataStats()
    convs = sources.read_conversations(str(p), stats)
    assert [c["messages"] for c in convs] == [MSG_ROW["messages"], EXPECTED_SHAREGPT]
    assert [c["source"] for c in convs] == [f"{p}:1", f"{p}:2"]
    assert stats.total == 5 and stats.counts == {"malformed_json": 1, "unknown_role": 1, "missing_content": 1}
    assert stats.examples["unknown_role"][0].startswith(f"{p}:4")
    assert stats.examples["missing_content"][0].startswith(f"{p}:6")


def _rows():
    return [MSG_ROW, SHAREGPT_ROW, MSG_ROW]


def test_parquet_json_arrow_and_save_to_disk_sources(tmp_path):
    import datasets

    # one schema per file (Arrow needs it): a messages file with a bad row, a ShareGPT file
    msgs = [MSG_ROW, {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "  "}]},
            MSG_ROW]
    share = [SHAREGPT_ROW, SHAREGPT_BAD_ROLE]
    dm, ds = datasets.Dataset.from_list(msgs), datasets.Dataset.from_list(share)
    dm.to_parquet(str(tmp_path / "m.parquet"))
    ds.to_parquet(str(tmp_path / "s.parquet"))
    (tmp_path / "s.json").write_text(json.dumps(share))  # a top-level JSON array
    dm.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": ds, "test": dm}).save_to_disk(str(tmp_path / "saved_dict"))
    arrow_dir = tmp_path / "arrow"
    arrow_dir.mkdir()
    for f in (tmp_path / "saved").iterdir():
        if f.suffix == ".arrow":
            (arrow_dir / "part.arrow").write_bytes(f.read_bytes())

    def read(path):
        stats = BadDataStats()
        return sources.read_conversations(str(path), stats), stats

    convs, stats = read(tmp_path / "m.parquet")
    assert [c["messages"] for c in convs] == [MSG_ROW["messages"]] * 2
    assert stats.total == 3 and stats.counts == {"empty_content": 1}
    assert stats.examples["empty_content"][0].startswith(f"{tmp_path / 'm.parquet'}:row 2")
    for src in (tmp_path / "s.parquet", tmp_path / "s.json"):
        convs, stats = read(src)
        assert [c["messages"] for c in convs] == [EXPECTED_SHAREGPT], src
        assert stats.counts == {"unknown_role": 1} and f"{src}:row 2" in stats.examples["unknown_role"][0]
    convs, stats = read(tmp_path / "saved")
    assert len(convs) == 2 and stats.total == 3 and convs[1]["source"] == f"{tmp_path / 'saved'}:row 3"
    convs, stats = read(tmp_path / "saved_dict")  # a DatasetDict: its train split
    assert [c["messages"] for c in convs] == [EXPECTED_SHAREGPT]
    assert convs[0]["source"] == f"{tmp_path / 'saved_dict'}[train]:row 1"
    convs, stats = read(arrow_dir)  # a directory of .arrow files
    assert len(convs) == 2 and stats.total == 3
    with pytest.raises(DataError, match="no such file"):
        read(tmp_path / "missing.parquet")
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(DataError, match="cannot read"):
        read(tmp_path / "broken.parquet")


def _write_big_jsonl(path, n_rows: int, reply_chars: int) -> int:
    reply = ("lorem ipsum dolor sit amet " * (reply_chars // 27 + 1))[:reply_chars]
    with open(path, "w") as f:
        for i in range(n_rows):
            if i % 2:
                row = {"conversations": [{"from": "human", "value": f"question {i}"}, {"from": "gpt", "value": reply}]}
            else:
                row = {"messages": [{"role": "user", "content": f"question {i}"},
                                    {"role": "assistant", "content": reply}]}
            f.write(json.dumps(row) + "\n")
    return os.path.getsize(path)


def test_jsonl_streams_in_bounded_memory(tmp_path):
    """Iterating a 24 MB JSONL file holds one row at a time: the Python heap's peak stays under 1 MB."""
    p = tmp_path / "big.jsonl"
    size = _write_big_jsonl(p, 12_000, 2_000)
    stats = BadDataStats()
    tracemalloc.start()
    try:
        n = 0
        for conv in sources.iter_conversations(str(p), stats):
            n += len(conv["messages"])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert n == 24_000 and stats.total == 12_000 and stats.bad_rows == 0
    assert size > 20e6
    assert peak < 1e6, f"peak {peak / 1e6:.2f} MB while streaming a {size / 1e6:.1f} MB file"


PARQUET_RSS = r"""
import os, resource, sys
from dflash_dist.data import sources
from dflash_dist.data.conversations import BadDataStats
import datasets, pyarrow  # imported before the baseline
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
stats = BadDataStats()
n = sum(1 for _ in sources.iter_conversations(sys.argv[1], stats))
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(n, stats.total, (peak - base) * 1024)
"""


def test_parquet_streams_in_bounded_memory(tmp_path):
    """A parquet file of ~120 MB of text (uncompressed) is read in record batches: RSS grows far less than that."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "big.parquet"
    schema = pa.schema([("messages", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())])))])
    text_bytes = 0
    with pq.ParquetWriter(str(path), schema) as w:
        for _ in range(15):
            rows = []
            for _ in range(2_000):
                reply = f"{len(rows)} " + "lorem ipsum dolor sit amet " * 148
                text_bytes += len(reply)
                rows.append({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": reply}]})
            w.write_table(pa.Table.from_pylist(rows, schema=schema), row_group_size=500)
    env = dict(os.environ, PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", PARQUET_RSS, str(path)], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    n, total, grew = out.stdout.split()[-3:]
    assert int(n) == int(total) == 30_000
    assert text_bytes >= 120e6
    assert int(grew) < text_bytes / 3, f"RSS grew {int(grew) / 1e6:.0f} MB reading {text_bytes / 1e6:.0f} MB of text"


def test_tokenize_stream_equals_build_tokenized_dataset(tmp_path, monkeypatch):
    rows = [MSG_ROW, SHAREGPT_ROW, {"messages": [{"role": "user", "content": "x"}]}] * 5
    p = tmp_path / "d.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    s1, s2 = BadDataStats(), BadDataStats()
    ref = tokenize.build_tokenized_dataset(sources.read_conversations(str(p), s1), ASSETS_TINY, 64, "truncate", 0, s1)
    got = sources.tokenize_stream(sources.iter_conversations(str(p), s2), ASSETS_TINY, 64, "truncate", 0, s2, window=4)
    assert torch.equal(ref.tokens, got.tokens) and torch.equal(ref.loss_mask, got.loss_mask)
    assert torch.equal(ref.offsets, got.offsets) and torch.equal(ref.conv_ids, got.conv_ids)
    assert s1.counts == s2.counts and s1.total == s2.total == 15 and len(got) == 10


# ----------------------------------------------------------------------------------------------- template kwargs

# A Qwen3-style template written for this test: with enable_thinking=false an empty <think> block closes the
# generation prompt and opens the last reply; otherwise neither has one (the model would think on its own).
QWEN3_STYLE = (
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if loop.last and enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{{- m.content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}"
)


@pytest.fixture(scope="module")
def qwen3_tok_dir(tmp_path_factory):
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("qwen3_style_tok")
    t = AutoTokenizer.from_pretrained(ASSETS_TINY)
    t.chat_template = QWEN3_STYLE
    t.save_pretrained(str(d))
    return str(d)


def test_chat_template_kwargs_change_tokens_and_mask_alike_in_training_and_evaluation(qwen3_tok_dir):
    from transformers import AutoTokenizer

    from dflash_dist.eval.prompts import encode_prompts

    tok = AutoTokenizer.from_pretrained(qwen3_tok_dir)
    conv = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there."}]}
    built = {}
    for kw in (None, {"enable_thinking": False}):
        stats = BadDataStats()
        ds = tokenize.build_tokenized_dataset([conv], qwen3_tok_dir, 256, "truncate", 0, stats,
                                              chat_template_kwargs=kw)
        assert len(ds) == 1 and ds.meta["chat_template_kwargs"] == (kw or {})
        built[bool(kw)] = ds[0]
    on, off = built[False], built[True]
    think = tok("<think>\n\n</think>\n\n", add_special_tokens=False)["input_ids"]
    assert len(off.input_ids) == len(on.input_ids) + len(think)   # the tokens change ...
    sup = {k: tok.decode(s.input_ids[s.loss_mask].tolist()) for k, s in built.items()}
    assert sup[False] == sup[True] == "Hello there.<|im_end|>"
    assert "<think>" in tok.decode(off.input_ids[~off.loss_mask].tolist())  # ... the think block is context
    assert "<think>" not in tok.decode(on.input_ids.tolist())
    assert int(off.loss_mask.nonzero()[0]) == int(on.loss_mask.nonzero()[0]) + len(think)
    # evaluation renders the prompt with the same kwargs: each training sample starts with exactly that prompt,
    # and its supervised tokens start right after it
    for k, kw in ((False, None), (True, {"enable_thinking": False})):
        prompt = encode_prompts(tok, [conv], kw)[0]
        sample = built[k].input_ids.tolist()
        assert sample[:len(prompt)] == prompt
        assert int(built[k].loss_mask.nonzero()[0]) == len(prompt)
    assert encode_prompts(tok, [conv], None) != encode_prompts(tok, [conv], {"enable_thinking": False})


def test_chat_template_kwargs_in_the_job_config_reach_the_dataset_and_key(qwen3_tok_dir, tmp_path):
    from dflash_dist.checkpoint.identity import data_identity
    from dflash_dist.config import DataConfig, JobConfig

    tgt = {"hf_config": {"builtin": "tiny"}}
    off = JobConfig.from_dict({"target": tgt, "data": {"chat_template_kwargs": {"enable_thinking": False}}})
    on = JobConfig.from_dict({"target": tgt})
    assert off.data.chat_template_kwargs == {"enable_thinking": False} and on.data.chat_template_kwargs == {}
    assert off.to_dict()["data"]["chat_template_kwargs"] == {"enable_thinking": False}  # checkpoint job_config
    # the run's data identity (and so the data cache's key, data.tokenize.cache_key) tells them apart
    assert data_identity(off, qwen3_tok_dir, 2048)["data"] != data_identity(on, qwen3_tok_dir, 2048)["data"]
    with pytest.raises(Exception, match="chat_template_kwargs"):
        DataConfig(chat_template_kwargs=["enable_thinking"])
    from helpers.launch_util import REPO

    from dflash_dist.config import compose_config
    cfg = compose_config(["data.chat_template_kwargs={enable_thinking:false}"], os.path.join(REPO, "conf"))
    assert JobConfig.from_omegaconf(cfg).data.chat_template_kwargs == {"enable_thinking": False}  # the CLI override


def test_parse_template_kwargs_reads_json_or_a_recorded_run(tmp_path):
    assert sources.parse_template_kwargs(None) is None
    assert sources.parse_template_kwargs('{"enable_thinking": false}') == {"enable_thinking": False}
    meta = tmp_path / "meta.json"
    meta.write_text(json.dumps({"job_config": {"data": {"chat_template_kwargs": {"enable_thinking": False}}}}))
    assert sources.parse_template_kwargs(str(meta)) == {"enable_thinking": False}
    side = tmp_path / "dflash_dist_meta.json"
    side.write_text(json.dumps({"chat_template_kwargs": {"x": 1}, "data": {"chat_template_kwargs": {}}}))
    assert sources.parse_template_kwargs(str(side)) == {"x": 1}
    with pytest.raises(DataError):
        sources.parse_template_kwargs("[1, 2]")


def test_regeneration_renders_with_the_same_kwargs(qwen3_tok_dir):
    """dflash-regenerate's prompt ids are encode_prompts' ids under the same kwargs (a fake model records them)."""
    from transformers import AutoTokenizer

    from dflash_dist.data.generation import regenerate_rows
    from dflash_dist.eval.prompts import encode_prompts

    tok = AutoTokenizer.from_pretrained(qwen3_tok_dir)
    msgs = [{"role": "user", "content": "Hi"}]
    seen = []

    class Fake(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def generate(self, input_ids, attention_mask, **kw):
            seen.append(input_ids[0][attention_mask[0].bool()].tolist())
            eos = kw["eos_token_id"][0]
            return torch.cat([input_ids, torch.tensor([[tok.convert_tokens_to_ids("a"), eos]])], dim=1)

    for kw in (None, {"enable_thinking": False}):
        regenerate_rows(Fake(), tok, [(0, {"messages": msgs}, msgs, None)], max_new_tokens=4, temperature=0.0,
                        top_p=1.0, batch_size=1, eos_ids=[tok.eos_token_id or 0], on_empty="keep", seed=0,
                        chat_template_kwargs=kw)
        assert seen[-1] == encode_prompts(tok, [{"messages": msgs}], kw)[0]
    assert seen[0] != seen[1]


def test_prepare_conversations_streams_the_same_split_and_samples(tmp_path):
    from dflash_dist.data.batching import holdout_size, split_holdout

    rows = [MSG_ROW, SHAREGPT_ROW, {"messages": [{"role": "user", "content": "x"}]}, SHAREGPT_BAD_ROLE] * 6
    rows = [dict(r, n=i) for i, r in enumerate(rows)]
    p = tmp_path / "d.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows) + "{bad\n")
    s1, s2 = BadDataStats(), BadDataStats()
    convs = sources.read_conversations(str(p), s1)
    tr, ho = split_holdout(len(convs), holdout_size(len(convs), 3), 7)  # data.holdout=3, at most 10% of 12
    ref = tokenize.build_tokenized_dataset([convs[i] for i in tr], ASSETS_TINY, 64, "truncate", 0, s1)
    ds, held = sources.prepare_conversations(str(p), 3, 7, ASSETS_TINY, 64, "truncate", 0, s2, window=5)
    assert held == [convs[i] for i in ho]
    assert torch.equal(ds.tokens, ref.tokens) and torch.equal(ds.offsets, ref.offsets)
    assert torch.equal(ds.conv_ids, ref.conv_ids) and torch.equal(ds.loss_mask, ref.loss_mask)
    assert (s1.total, s1.counts) == (s2.total, s2.counts) and s2.total == 25
