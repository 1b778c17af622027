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
