"""dflash-fetch-real without the network: the cut-short ShareGPT array read record by record, which rows become
training, holdout and benchmark prompts, the pinned sha256 refusing another file, and a rerun that finds every
file as recorded doing nothing."""

import gzip
import hashlib
import json
import os

import pytest

from dflash_dist.cli import fetch_real as F

SPECIALS = ("<|im_start|>", "<|im_end|>", "<filename>")


def turn(who, text):
    return {"from": who, "value": text}


def test_complete_records_stop_where_the_array_is_cut():
    text = '[\n  {"id": "a", "x": [1, 2]},\n  {"id": "b", "s": "},{"},\n  {"id": "c", "conversations": [{"from": "hu'
    assert [r["id"] for r in F.complete_records(text)] == ["a", "b"]
    assert [r["id"] for r in F.complete_records('[{"id": 1}, {"id": 2}]')] == [1, 2]
    assert list(F.complete_records("[]")) == []


def test_sharegpt_rows_keep_short_answered_distinct_usable_prompts_and_hold_out_every_20th():
    recs = [{"id": f"r{i}", "conversations": [turn("human", f"question {i}"), turn("gpt", f"answer {i}")]}
            for i in range(45)]
    recs += [
        {"id": "gpt-first", "conversations": [turn("gpt", "hi"), turn("human", "q")]},
        {"id": "long", "conversations": [turn("human", "x" * F.MAX_PROMPT_CHARS), turn("gpt", "a")]},
        {"id": "unanswered", "conversations": [turn("human", "only a question")]},
        {"id": "special", "conversations": [turn("human", "see <filename> here"), turn("gpt", "a")]},
        {"id": "special-answer", "conversations": [turn("human", "q?"), turn("gpt", "<|im_end|>")]},
        {"id": "surrogate", "conversations": [turn("human", "emoji \ud83d"), turn("gpt", "a")]},
        {"id": "blank", "conversations": [turn("human", "   "), turn("gpt", "a")]},
        {"id": "dup", "conversations": [turn("human", "question 3 "), turn("gpt", "another answer")]},
        {"id": "no-turns"}, "not an object",
    ]
    train, holdout, counts = F.sharegpt_rows(recs, SPECIALS)
    assert counts["records"] == len(recs) and counts["kept"] == 45
    assert counts["short_first_human_turn"] == 45 + 6  # all but gpt-first, long, no-turns, not an object
    assert [r["id"] for r in holdout] == ["r19", "r39"] and len(train) == 43
    prompts = lambda rows: {r["messages"][0]["content"] for r in rows}  # noqa: E731
    assert not prompts(train) & prompts(holdout)
    row = train[0]
    assert row == {"messages": [{"role": "user", "content": "question 0"},
                                {"role": "assistant", "content": "answer 0"}], "id": "r0"}


def test_benchmark_prompt_rows():
    he = gzip.compress((json.dumps({"task_id": "HumanEval/0", "prompt": "def f(x):\n    \"\"\"Double.\"\"\"\n"})
                        + "\n").encode())
    rows = F.humaneval_rows(he, SPECIALS)
    assert rows[0]["id"] == "HumanEval/0" and rows[0]["messages"][0]["role"] == "user"
    assert "def f(x):" in rows[0]["messages"][0]["content"] and len(rows[0]["messages"]) == 1
    mt = "\n".join(json.dumps({"question_id": q, "category": "writing", "turns": [t, "second turn"]})
                   for q, t in ((81, "Write a poem."), (82, "bad <|im_start|> one"))).encode()
    assert F.mtbench_rows(mt, SPECIALS) == [{"messages": [{"role": "user", "content": "Write a poem."}],
                                              "id": "mtbench/81", "category": "writing"}]


def fake_wheel(payload: bytes):
    """A pinned entry whose sha256 is that of ``payload``, and a download that writes ``download.served``."""
    wheel = F.Wheel("fake-pkg", "1.0", "fake_pkg-1.0-py3-none-any.whl", hashlib.sha256(payload).hexdigest(), "m")
    calls = []

    def download(w, cache_dir):
        calls.append(w.name)
        with open(os.path.join(cache_dir, w.filename), "wb") as f:
            f.write(download.served)
    download.served = payload
    return wheel, download, calls


def test_the_pinned_sha256_decides(tmp_path):
    wheel, download, calls = fake_wheel(b"the real wheel")
    path = F.fetch_wheel(wheel, str(tmp_path), download)
    assert open(path, "rb").read() == b"the real wheel" and calls == ["fake-pkg"]
    F.fetch_wheel(wheel, str(tmp_path), download)
    assert calls == ["fake-pkg"]                                   # cached: not downloaded again
    with open(path, "wb") as f:
        f.write(b"tampered")
    F.fetch_wheel(wheel, str(tmp_path), download)                  # another sha256: fetched again
    assert calls == ["fake-pkg"] * 2 and open(path, "rb").read() == b"the real wheel"
    os.unlink(path)
    download.served = b"a different file"
    with pytest.raises(F.FetchError, match="sha256"):
        F.fetch_wheel(wheel, str(tmp_path), download)


def recorded(out):
    """An OUT_DIR whose files are all as its manifest records (stand-ins for the model and the prompts)."""
    (out / F.MODEL_DIR).mkdir(parents=True)
    (out / F.MODEL_DIR / "config.json").write_text("{}")
    for name in F.PROMPT_FILES:
        (out / name).write_text('{"messages": []}\n')
    man = {"wheels": {k: w.sha256 for k, w in F.WHEELS.items()}, "dtype": "float32",
           "model": {"files": F.file_digests(str(out), [os.path.join(F.MODEL_DIR, "config.json")])},
           "prompts": {"files": F.file_digests(str(out), list(F.PROMPT_FILES))}}
    (out / F.MANIFEST).write_text(json.dumps(man))
    return man


def no_download(*a):
    raise AssertionError("downloaded although every file was there")


def test_a_rerun_with_every_file_as_recorded_does_nothing(tmp_path, capsys):
    out = tmp_path / "real"
    man = recorded(out)
    assert F.fetch(str(out), download=no_download) == man
    assert "up to date" in capsys.readouterr().out
    assert F.manifest_state(str(out), "float32") == {"model": True, "prompts": True}
    assert F.manifest_state(str(out), "bfloat16") == {"model": False, "prompts": False}   # another dtype asked
    (out / "mtbench.jsonl").write_text("changed\n")
    assert F.manifest_state(str(out), "float32") == {"model": True, "prompts": False}
    os.unlink(out / F.MODEL_DIR / "config.json")
    assert F.manifest_state(str(out), "float32") == {"model": False, "prompts": False}


def test_the_command_is_registered_with_its_extra():
    import re
    with open(os.path.join(os.path.dirname(__file__), "..", "..", "..", "pyproject.toml")) as f:
        proj = f.read()
    assert 'dflash-fetch-real = "dflash_dist.cli.fetch_real:main"' in proj
    assert re.search(r'^real = \["gguf>=[\d.]+"\]$', proj, re.M)
    core = proj[proj.index("dependencies = ["):proj.index("[project.optional-dependencies]")]
    assert "gguf" not in core


def test_two_commands_on_one_directory_take_turns(tmp_path):
    import fcntl
    import threading
    out = tmp_path / "real"
    man = recorded(out)
    done = []
    with open(out / ".fetch_real.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)                  # another command is writing
        t = threading.Thread(target=lambda: done.append(F.fetch(str(out), download=no_download)))
        t.start()
        t.join(1.0)
        assert done == []                                  # waits for it
    t.join(30)
    assert done == [man]


def test_without_gguf_the_command_names_the_extra(tmp_path, monkeypatch, capsys):
    import sys
    monkeypatch.setitem(sys.modules, "gguf", None)   # import gguf raises ImportError
    assert F.main([str(tmp_path / "real")]) == 1
    assert "pip install 'dflash_dist[real]'" in capsys.readouterr().err
