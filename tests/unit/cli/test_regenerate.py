"""dflash-regenerate: prompt parsing, left-padded batching == one-by-one, and 2 ranks under torchrun writing one
line per usable prompt in the original order (identical to a single-process run)."""

import json

import pytest
import torch
from helpers.launch_util import torchrun

from dflash_dist.cli.regenerate import load_target_config, prepare_row
from dflash_dist.data.generation import regenerate_rows
from dflash_dist.targets.hf import TINY_DIR, build_target_model

TARGET = {"hf_config": {"model_type": "qwen3", "vocab_size": 2048, "hidden_size": 32, "intermediate_size": 64,
                        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
                        "max_position_embeddings": 256, "rope_theta": 10000.0},
          "tokenizer": TINY_DIR, "init_seed": 3, "dtype": "float32"}
WORDS = ["hello", "how are you", "tell me a joke about cats and dogs", "what is the time", "bye",
         "do you like music or books or long walks in the park", "ok", "what is AI?"]


def write_inputs(path):
    rows = []
    for i, w in enumerate(WORDS):
        msgs = [{"role": "user", "content": w}]
        if i % 3 == 1:
            msgs += [{"role": "assistant", "content": "earlier reply"}, {"role": "user", "content": w + " again"}]
        if i % 2 == 0:
            msgs.append({"role": "assistant", "content": "old reply to be replaced"})
        rows.append({"id": i, "messages": msgs})
    lines = [json.dumps(r) for r in rows]
    lines.insert(3, "{not json")
    lines.insert(5, json.dumps({"messages": [{"role": "assistant", "content": "nothing to answer"}]}))
    path.write_text("\n".join(lines) + "\n")
    return rows


def test_prepare_row_drops_only_the_final_assistant_turn():
    row = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                        {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]}
    _, msgs, original, _ = prepare_row(row)
    assert [m["content"] for m in msgs] == ["a", "b", "c"] and original == "d"
    assert prepare_row({"messages": [{"role": "user", "content": "a"}]})[2] is None
    assert prepare_row({"messages": [{"role": "system", "content": "s"}]})[3] == "no user turn to answer"
    assert prepare_row({"text": "x"})[0] is None
    share = prepare_row({"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]})
    assert share[1] == [{"role": "user", "content": "q"}] and share[2] == "a" and "messages" in share[0]
    assert load_target_config(None).hf_config == {"builtin": "tiny"}
    assert load_target_config("tiny", "some/model").name_or_path == "some/model"


def test_batched_left_padding_equals_one_by_one(tmp_path):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(TINY_DIR)
    model = build_target_model(_tcfg(), "cpu").to(torch.float64)
    items = [(i, {"messages": []}, [{"role": "user", "content": w}], None) for i, w in enumerate(WORDS)]
    kw = dict(max_new_tokens=6, temperature=0.0, top_p=1.0, eos_ids=[0, 2], on_empty="keep", seed=0)
    one, _ = regenerate_rows(model, tok, items, batch_size=1, **kw)
    many, counts = regenerate_rows(model, tok, items, batch_size=3, **kw)
    assert [i for i, _ in many] == list(range(len(WORDS)))
    assert [r["messages"][-1] for _, r in many] == [r["messages"][-1] for _, r in one]
    assert counts["generated"] == len(WORDS)
    s1, _ = regenerate_rows(model, tok, items, batch_size=3, **dict(kw, temperature=1.0, seed=5))
    s2, _ = regenerate_rows(model, tok, items, batch_size=3, **dict(kw, temperature=1.0, seed=5))
    assert s1 == s2  # seeded sampling is reproducible



def test_greedy_rows_are_byte_identical_at_any_batch_size_in_float32():
    """The packaged tiny target in float32 on CPU: the same replies at batch sizes 8, 3 and 1 (what lets a batch
    that ran out of device memory be split without changing the output)."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(TINY_DIR)
    model = build_target_model(load_target_config(None), "cpu")
    assert next(model.parameters()).dtype == torch.float32
    items = [(i, {"messages": []}, [{"role": "user", "content": w}], None) for i, w in enumerate(WORDS)]
    kw = dict(max_new_tokens=8, temperature=0.0, top_p=1.0, eos_ids=[0, 2], on_empty="keep", seed=0)
    runs = [regenerate_rows(model, tok, items, batch_size=b, **kw)[0] for b in (8, 3, 1)]
    dumps = [json.dumps(r) for r in runs]
    assert dumps[0] == dumps[1] == dumps[2]

def _tcfg():
    from dflash_dist.config import TargetConfig
    return TargetConfig(**TARGET)


@pytest.mark.slow
def test_two_ranks_under_torchrun(tmp_path):
    rows = write_inputs(tmp_path / "in.jsonl")
    (tmp_path / "target.json").write_text(json.dumps(TARGET))
    out = tmp_path / "out.jsonl"
    r = torchrun(2, ["-m", "dflash_dist.cli.regenerate", "--prompts", tmp_path / "in.jsonl", "--out", out,
                     "--target-config", tmp_path / "target.json", "--max-new-tokens", 5, "--batch-size", 1,
                     "--on-empty", "keep"], timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert [g["id"] for g in got] == [r["id"] for r in rows]           # one line per usable prompt, in order
    for g, src in zip(got, rows):
        want_prefix = src["messages"][:-1] if src["messages"][-1]["role"] == "assistant" else src["messages"]
        assert g["messages"][:-1] == want_prefix
        assert g["messages"][-1]["role"] == "assistant"
        assert g["messages"][-1]["content"] != "old reply to be replaced"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "out.jsonl", "target.json"]  # parts merged

    # the same as one process (greedy, batch 1: the same computation on every rank)
    from transformers import AutoTokenizer

    from dflash_dist.cli.regenerate import _read_rows
    items, bad = _read_rows(str(tmp_path / "in.jsonl"))
    assert bad == {"bad json": 1, "no user turn to answer": 1}
    model = build_target_model(_tcfg(), "cpu")
    ref, _ = regenerate_rows(model, AutoTokenizer.from_pretrained(TINY_DIR), items, max_new_tokens=5,
                             temperature=0.0, top_p=1.0, batch_size=1, eos_ids=[0, 2], on_empty="keep", seed=0)
    assert [row for _, row in ref] == got


def test_resume_after_a_crash_generates_only_the_missing_rows(tmp_path):
    """A crashed 2-rank run left one part file: two finished rows and a line cut short. The same command again
    (one process now) keeps those two rows as written, regenerates the cut one and the rest, and writes every
    usable row exactly once, in input order, equal to an uninterrupted run elsewhere."""
    import subprocess
    import sys

    rows = write_inputs(tmp_path / "in.jsonl")
    (tmp_path / "target.json").write_text(json.dumps(TARGET))
    args = ["--prompts", str(tmp_path / "in.jsonl"), "--target-config", str(tmp_path / "target.json"),
            "--max-new-tokens", "5", "--batch-size", "2", "--on-empty", "keep", "--device", "cpu"]
    ref_out = tmp_path / "ref" / "out.jsonl"
    r = subprocess.run([sys.executable, "-m", "dflash_dist.cli.regenerate", *args, "--out", str(ref_out)],
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    ref = [json.loads(line) for line in ref_out.read_text().splitlines()]

    out = tmp_path / "out.jsonl"
    kept = {1: {"id": rows[1]["id"], "messages": ref[1]["messages"][:-1] + [{"role": "assistant",
                                                                              "content": "FROM THE CRASHED RUN"}]},
            3: {"id": rows[3]["id"], "messages": ref[3]["messages"]}}
    part = tmp_path / "out.jsonl.part00001-of-00002"
    lines = [json.dumps({"index": i, "row": row}) for i, row in kept.items()] + [json.dumps({"counts": {"generated": 2}})]
    part.write_text("\n".join(lines) + "\n" + '{"index": 5, "row": {"id": 5, "mess')  # killed mid-line
    r = subprocess.run([sys.executable, "-m", "dflash_dist.cli.regenerate", *args, "--out", str(out)],
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming: 2 rows already written" in r.stderr
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert [g["id"] for g in got] == [g["id"] for g in ref]            # every usable row once, in order
    assert got[1]["messages"][-1]["content"] == "FROM THE CRASHED RUN"  # written rows are not generated again
    assert [g for i, g in enumerate(got) if i != 1] == [g for i, g in enumerate(ref) if i != 1]
    assert not list(tmp_path.glob("out.jsonl.part*"))                   # parts merged and removed


def test_part_writer_trims_a_partial_last_line(tmp_path):
    from dflash_dist.cli.regenerate import PartWriter, read_parts
    path = tmp_path / "o.jsonl.part00000-of-00001"
    path.write_text(json.dumps({"index": 0, "row": {"a": 1}}) + "\n" + '{"index": 1, "ro')
    w = PartWriter(str(path))
    w([(2, {"b": 2})], {"generated": 1})
    w.close()
    rows, counts = read_parts(str(tmp_path / "o.jsonl"))
    assert rows == {0: {"a": 1}, 2: {"b": 2}} and counts == {"generated": 1}


@pytest.mark.parametrize("case", ["same_file", "same_file_other_spelling", "directory", "negative_limit"])
def test_bad_out_or_limit_is_refused_before_generating(tmp_path, case):
    """--out equal to --prompts (however spelled), --out a directory and a negative --limit (rows[:-1] would drop the
    last row) are refused with exit 2 before any model loads; the prompts file is left as it was."""
    from dflash_dist.cli.regenerate import main
    write_inputs(tmp_path / "in.jsonl")
    before = (tmp_path / "in.jsonl").read_bytes()
    (tmp_path / "outdir").mkdir()
    out = {"same_file": tmp_path / "in.jsonl", "same_file_other_spelling": tmp_path / "outdir" / ".." / "in.jsonl",
           "directory": tmp_path / "outdir", "negative_limit": tmp_path / "out.jsonl"}[case]
    extra = ["--limit", "-1"] if case == "negative_limit" else []
    import dflash_dist.targets.hf as hf
    loads = []
    orig = hf.build_target_model
    hf.build_target_model = lambda *a, **k: loads.append(1) or orig(*a, **k)
    try:
        rc = main(["--prompts", str(tmp_path / "in.jsonl"), "--out", str(out), "--device", "cpu", *extra])
    finally:
        hf.build_target_model = orig
    assert rc == 2 and loads == []
    assert (tmp_path / "in.jsonl").read_bytes() == before
    assert not (tmp_path / "out.jsonl").exists() and not list(tmp_path.rglob("*.part*"))


def test_limit_zero_and_none_and_progress_line(tmp_path):
    from dflash_dist.cli.regenerate import check_paths, progress_line
    check_paths(str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"), 0)
    check_paths(str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"), None)
    assert progress_line(30, 120, 15.0) == "30/120 rows (25%), 2.00 rows/s, 15s elapsed, ETA 45s"
    assert progress_line(10, 1000, 100.0) == "10/1000 rows (1%), 0.10 rows/s, 1m40s elapsed, ETA 2h45m"
    assert progress_line(0, 5, 3.0).endswith("ETA ?")


def _oom_when(monkeypatch, too_big):
    """Make the target's generate raise CUDA's out-of-memory error for a batch where ``too_big(input_ids)``; returns
    the row count of every call."""
    import dflash_dist.targets.hf as hf
    calls = []
    build = hf.build_target_model

    def build_oom(*a, **k):
        model = build(*a, **k)
        generate = model.generate

        def gen(input_ids, **kw):
            calls.append(len(input_ids))
            if too_big(input_ids):
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
            return generate(input_ids=input_ids, **kw)
        model.generate = gen
        return model
    monkeypatch.setattr(hf, "build_target_model", build_oom)
    return calls


def _main(tmp_path, out, *extra):
    """dflash-regenerate in this process (one rank), the root logger's handlers restored after it."""
    import logging

    from dflash_dist.cli.regenerate import main
    (tmp_path / "target.json").write_text(json.dumps(TARGET))
    handlers, level = logging.root.handlers[:], logging.root.level
    try:
        return main(["--prompts", str(tmp_path / "in.jsonl"), "--out", str(out), "--target-config",
                     str(tmp_path / "target.json"), "--max-new-tokens", "5", "--on-empty", "keep", "--device", "cpu",
                     *extra])
    finally:
        logging.root.handlers[:] = handlers
        logging.root.setLevel(level)


def test_a_batch_out_of_device_memory_is_split_and_the_smaller_size_kept(tmp_path, monkeypatch, capsys):
    """A batch of 4 that runs out of device memory is generated as 2 x 2 and the process goes on at 2 (one retry,
    not one per batch), said once when it halves and again in the rank's summary; the output file is byte for byte
    the one of a run that did not run out (greedy rows do not depend on the batch they are in)."""
    for k in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    write_inputs(tmp_path / "in.jsonl")
    assert _main(tmp_path, tmp_path / "ref.jsonl", "--batch-size", "4") == 0
    capsys.readouterr()
    calls = _oom_when(monkeypatch, lambda ids: len(ids) > 2)
    assert _main(tmp_path, tmp_path / "out.jsonl", "--batch-size", "4") == 0
    err = capsys.readouterr().err
    assert (tmp_path / "out.jsonl").read_bytes() == (tmp_path / "ref.jsonl").read_bytes()
    assert calls == [4, 2, 2, 2, 2]                                     # 8 usable rows; the size 2 sticks
    retries = [line for line in err.splitlines() if "ran out of device memory; retrying" in line]
    assert len(retries) == 1 and retries[0].endswith(
        "rank 0: batch of 4 rows ran out of device memory; retrying as 2 x 2 (set --batch-size 2 to avoid the "
        "retries)")
    assert "batch size 4 ran out of device memory, the rest ran at 2 (set --batch-size 2 to avoid the retries)" in err
    assert "'oom_halvings': 1" in err                                  # the merged summary counts it
    assert "Traceback" not in err and not list(tmp_path.glob("out.jsonl.part*"))


def test_a_row_that_does_not_fit_alone_is_one_line_and_exit_1(tmp_path, monkeypatch, capsys):
    """The longest prompt runs out of device memory even alone: its batch halves down to that one row, then one
    error line names the row (index, token length), the device and the knobs; exit 1, no traceback; the rows
    finished before it stay in the part file for the rerun."""
    from transformers import AutoTokenizer

    from dflash_dist.cli.regenerate import _read_rows
    for k in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    write_inputs(tmp_path / "in.jsonl")
    tok = AutoTokenizer.from_pretrained(TINY_DIR)
    items, _ = _read_rows(str(tmp_path / "in.jsonl"))
    lengths = {i: len(tok(tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True),
                          add_special_tokens=False)["input_ids"]) for i, _, m, _ in items}
    longest = max(lengths, key=lambda i: (lengths[i], i))               # the last in length order
    assert sorted(lengths.values())[-2] < lengths[longest]
    calls = _oom_when(monkeypatch, lambda ids: ids.shape[1] == lengths[longest])
    rc = _main(tmp_path, tmp_path / "out.jsonl", "--batch-size", "4")
    err = capsys.readouterr().err
    assert rc == 1 and "Traceback" not in err
    assert calls == [4, 4, 2, 2, 1, 1]                    # 4 fit; 4 -> 2 + 2 (the second with it) -> 1 + 1 (it alone)
    errors = [line for line in err.splitlines() if line.startswith("dflash-regenerate:")]
    assert errors == [f"dflash-regenerate: error: usable row {longest} (0-based; {lengths[longest]} prompt tokens + "
                      "up to 5 new) does not fit the device memory alone (cpu): lower --max-new-tokens or run "
                      "fewer processes per device (finished rows are kept in the part files: the same command "
                      "resumes)"]
    from dflash_dist.cli.regenerate import read_parts
    rows, _ = read_parts(str(tmp_path / "out.jsonl"))
    assert len(rows) == 7 and longest not in rows and not (tmp_path / "out.jsonl").exists()


def test_shrinking_batches_halve_an_odd_batch_and_keep_the_size(caplog):
    from dflash_dist.data.shrinking_batches import ShrinkingBatches
    sizes = []

    def call(chunk):
        sizes.append(len(chunk))
        if len(chunk) > 3:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return [x * 10 for x in chunk]
    b = ShrinkingBatches(7, device="cpu", label="rank 2")
    with caplog.at_level("WARNING", logger="dflash_dist"):
        got = list(b.run(list(range(10)), call, str))
    assert [c for c, _ in got] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    assert [r for _, r in got] == [[0, 10], [20, 30], [40, 50], [60, 70], [80, 90]]
    assert sizes == [7, 4, 2, 2, 2, 2, 2] and b.size == 2 and b.halvings == 2
    assert [r.getMessage() for r in caplog.records] == [
        "rank 2: batch of 7 rows ran out of device memory; retrying as 4 + 3 (set --batch-size 4 to avoid the retries)",
        "rank 2: batch of 4 rows ran out of device memory; retrying as 2 x 2 (set --batch-size 2 to avoid the retries)"]
