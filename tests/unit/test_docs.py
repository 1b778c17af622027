"""The user-facing docs: short README, links that resolve, no lab-notebook references."""

import glob
import os
import re

from helpers.launch_util import REPO

DOCS = [os.path.join(REPO, "README.md")] + sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))


def test_readme_stays_short():
    assert sum(1 for _ in open(os.path.join(REPO, "README.md"))) <= 160


def test_relative_links_resolve():
    broken = []
    for path in DOCS:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", open(path).read()):
            if "://" in target:
                continue
            if not os.path.exists(os.path.join(os.path.dirname(path), target)):
                broken.append(f"{os.path.relpath(path, REPO)}: {target}")
    assert broken == []


def test_no_lab_notebook_references():
    """Docs, code, configs and benchmarks speak to users: no device calls, sessions or issue numbers."""
    pattern = re.compile(r"call [0-9]+|session [0-9]+|issue \[")
    hits = []
    for root in ("README.md", "docs", "dflash_dist", "conf", "bench"):
        paths = [os.path.join(REPO, root)] if root.endswith(".md") else \
            glob.glob(os.path.join(REPO, root, "**", "*"), recursive=True)
        for path in paths:
            if os.path.isfile(path) and path.endswith((".md", ".py", ".sh", ".yaml", ".json", ".txt")):
                for i, line in enumerate(open(path, errors="replace"), 1):
                    if pattern.search(line):
                        hits.append(f"{os.path.relpath(path, REPO)}:{i}")
    assert hits == []


# a repository path as docs and code cite it: from the repository root, or package-relative (model/masks.py)
_ROOTS = ("dflash_dist", "tests", "bench", "docs", "conf", "launch", "docker", "scripts", ".ci")
# paths in other repositories that the docs cite by their own names
EXTERNAL_REFERENCES = {"model/dflash.py"}   # z-lab's repository (the older modeling file)
# the exported modeling_dflash.py is frozen byte for byte (every export carries it): its prose keeps the paths it had
FROZEN = {os.path.join("dflash_dist", "model", "variants", "dflash", "serving.py")}


def missing_references(repo: str) -> list:
    """'file:line: path' of every cited repository file (README, docs/ but the changelog's history, the package's
    and bench/'s sources, strings and comments included) that does not exist."""
    pkg_dirs = sorted(d for d in os.listdir(os.path.join(repo, "dflash_dist"))
                      if os.path.isdir(os.path.join(repo, "dflash_dist", d)) and not d.startswith("__"))
    ref = re.compile(r"(?<![\w/.-])((?:%s)/[\w/.-]*\w\.(?:py|md|yaml|sh|sbatch|toml))(?![\w/])"
                     % "|".join(map(re.escape, _ROOTS + tuple(pkg_dirs))))
    files = [os.path.join(repo, "README.md")] + [p for p in glob.glob(os.path.join(repo, "docs", "*.md"))
                                                 if not p.endswith("CHANGELOG.md")]
    for root in ("dflash_dist", "bench"):
        files += glob.glob(os.path.join(repo, root, "**", "*.py"), recursive=True)
    bad = []
    for path in files:
        rel = os.path.relpath(path, repo)
        if rel in FROZEN:
            continue
        for i, line in enumerate(open(path, errors="replace"), 1):
            for r in ref.findall(line):
                where = [os.path.join(repo, r), os.path.join(os.path.dirname(path), r)]
                if r.split("/")[0] in pkg_dirs:
                    where.append(os.path.join(repo, "dflash_dist", r))
                if r not in EXTERNAL_REFERENCES and not any(os.path.exists(w) for w in where):
                    bad.append(f"{rel}:{i}: {r}")
    return bad


def test_cited_repository_files_exist():
    """A path the docs or the code cite (``model/masks.py``, ``bench/flex_tune.py``, in prose and strings) names a
    file of the repository: a move or a removal updates its citations."""
    assert missing_references(REPO) == []


def test_reference_finder_finds_a_missing_file(tmp_path):
    (tmp_path / "dflash_dist" / "model").mkdir(parents=True)
    (tmp_path / "dflash_dist" / "model" / "a.py").write_text('"""See model/a.py and model/gone.py."""\n')
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("`bench/nothing.py`, `docs/x.md`\n")
    (tmp_path / "docs" / "x.md").write_text("`tests/unit/none.py`\n")
    assert sorted(missing_references(str(tmp_path))) == [
        "README.md:1: bench/nothing.py", "dflash_dist/model/a.py:1: model/gone.py", "docs/x.md:1: tests/unit/none.py"]
