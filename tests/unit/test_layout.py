"""The package's shape: no import cycle, the two roles never import each other, presets hold no defaults."""

import ast
import dataclasses
import glob
import os
import re

import yaml
from helpers.launch_util import REPO

from dflash_dist import config as C

PKG = os.path.join(REPO, "dflash_dist")


def import_graph() -> dict[str, set[str]]:
    """Module -> the dflash_dist modules it imports (anywhere in the file, function-level imports included)."""
    graph = {}
    for path in glob.glob(os.path.join(PKG, "**", "*.py"), recursive=True):
        mod = "dflash_dist." + os.path.relpath(path, PKG)[:-3].replace(os.sep, ".")
        mod = mod.removesuffix(".__init__")
        deps = set()
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("dflash_dist"):
                for a in node.names:
                    full = f"{node.module}.{a.name}"
                    is_mod = os.path.exists(os.path.join(REPO, *full.split(".")) + ".py")
                    deps.add(full if is_mod else node.module)
            elif isinstance(node, ast.ImportFrom) and node.level > 0:
                deps.add(f"<relative import in {mod}>")
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.startswith("dflash_dist")}
        graph[mod] = deps - {mod}
    return graph


def find_cycle(graph: dict[str, set[str]]):
    state = {}

    def visit(u, path):
        state[u] = 1
        for v in sorted(graph.get(u, ())):
            if state.get(v) == 1:
                return path[path.index(v):] + [v]
            if v not in state:
                c = visit(v, path + [v])
                if c:
                    return c
        state[u] = 2
        return None

    for u in sorted(graph):
        if u not in state:
            c = visit(u, [u])
            if c:
                return c
    return None


def test_no_import_cycle_and_absolute_imports():
    g = import_graph()
    assert not [d for deps in g.values() for d in deps if d.startswith("<relative")]
    assert find_cycle(g) is None, " -> ".join(find_cycle(g))


def test_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def _room(mod: str) -> str:
    """A module's room: the package folder it sits in under dflash_dist (roles/<role> for a role's modules)."""
    parts = mod.split(".")[1:]
    return "/".join(parts[:2]) if parts[:1] == ["roles"] else (parts[0] if parts else "")


def test_roles_never_import_each_other():
    g = import_graph()
    roles = {"roles/target_rank", "roles/drafter_rank"}
    crossing = [(u, v) for u, deps in g.items() for v in deps if {_room(u), _room(v)} == roles]
    assert crossing == []
    # what sits below the roles never reaches up into them
    below = ("dflash_dist.model", "dflash_dist.targets", "dflash_dist.comm", "dflash_dist.data",
             "dflash_dist.telemetry")
    upward = [(u, v) for u, deps in g.items() if u.startswith(below) for v in deps
              if v.startswith(("dflash_dist.roles", "dflash_dist.cli"))]
    assert upward == []
    # the roles read the split's plan record from their job; of planning/ they use only the memory arithmetic
    planning = [(u, v) for u, deps in g.items() if u.startswith("dflash_dist.roles") for v in deps
                if v.startswith("dflash_dist.planning") and v != "dflash_dist.planning.memory"]
    assert planning == []


def test_the_target_has_its_own_room():
    """targets/ (the frozen target's loading: HF construction, its files' checks, families, FP8, fast path) sits
    below the drafter's modelling (model/), which reads only its families: nothing in targets/ imports model/,
    planning/, the job or the roles."""
    g = import_graph()
    assert {m for m in g if m.startswith("dflash_dist.targets.")} >= {
        "dflash_dist.targets.hf", "dflash_dist.targets.fast_path", "dflash_dist.targets.target_files",
        "dflash_dist.targets.families", "dflash_dist.targets.quant"}
    up = ("dflash_dist.model", "dflash_dist.planning", "dflash_dist.roles", "dflash_dist.cli", "dflash_dist.eval",
          "dflash_dist.export", "dflash_dist.job", "dflash_dist.role_jobs", "dflash_dist.train")
    reaching = [(u, v) for u, deps in g.items() if u.startswith("dflash_dist.targets") for v in deps
                if v.startswith(up)]
    assert reaching == []
    drafter_side = [(u, v) for u, deps in g.items() if u.startswith("dflash_dist.model") for v in deps
                    if v.startswith("dflash_dist.targets") and not v.startswith("dflash_dist.targets.families")]
    assert drafter_side == []
    assert not [m for m in g if m.startswith("dflash_dist.model.") and m.split(".")[2] in
                ("hf", "fast_path", "target_files", "families", "quant")]


def test_no_room_is_named_like_build_output():
    """No package folder (of Python modules) is named as common tools' build output: a gitignore's ``target/``
    matches at any depth, so a new file there would not show in git status. The roles' rooms sit together under
    roles/. (The presets' Hydra group conf/target is a user-facing name, not a package folder.)"""
    folders = {os.path.relpath(os.path.dirname(p), PKG) for p in glob.glob(os.path.join(PKG, "**", "*.py"),
                                                                           recursive=True)}
    build_like = {"target", "build", "dist", "out", "output", "bin", "obj"}
    assert not [f for f in folders if set(f.rstrip(os.sep).split(os.sep)) & build_like], folders
    assert {"roles/target_rank", "roles/drafter_rank"} <= {f.rstrip(os.sep) for f in folders}
    assert not os.path.exists(os.path.join(PKG, "target")) and not os.path.exists(os.path.join(PKG, "drafter"))


def test_presets_hold_no_defaults():
    """Every default lives in config/: a preset in conf/<group>/ starts from `base` and sets only what differs."""
    for path in sorted(glob.glob(os.path.join(REPO, "conf", "*", "*.yaml"))):
        group = os.path.basename(os.path.dirname(path))
        preset = yaml.safe_load(open(path)) or {}
        assert preset.get("defaults") == ["base", "_self_"], path
        base = C.group_defaults(C.GROUPS[group])
        for key, value in preset.items():
            if key == "defaults":
                continue
            assert key in base, f"{path}: unknown key {key}"
            if isinstance(value, dict) and isinstance(base[key], dict) and base[key]:
                same = {k for k, v in value.items() if base[key].get(k, object()) == v}
                assert not same, f"{path}: {key}.{sorted(same)} repeat the defaults of config/"
            else:
                assert value != base[key], f"{path}: {key}={value!r} repeats the default of config/"


def test_every_config_field_is_documented():
    import sys
    for cls in [C.TargetConfig, C.TargetTuning, C.DrafterConfig, C.DrafterTuning, C.DrafterLoss, C.DrafterDomino,
                C.DrafterDFlash2, C.DataConfig, C.TopologyConfig, C.TopologyTuning, C.TrainConfig, C.TrainTuning,
                C.LoggingConfig, C.LoggingDebug, C.WandbConfig]:
        src = open(sys.modules[cls.__module__].__file__).read()
        tree = ast.parse(src)
        node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
        body = node.body
        for i, stmt in enumerate(body):
            if isinstance(stmt, ast.AnnAssign):
                doc = body[i + 1] if i + 1 < len(body) else None
                assert isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant), \
                    f"{cls.__name__}.{stmt.target.id} has no docstring"
        assert {f.name for f in dataclasses.fields(cls)}


def test_module_and_function_sizes():
    """No module over ~500 lines; functions over 100 lines are listed here by name, each a known exception."""
    allowed_long: set = set()
    allowed_big: set = set()
    big, long_fns = [], []
    for path in glob.glob(os.path.join(PKG, "**", "*.py"), recursive=True):
        src = open(path).read()
        if src.count("\n") > 560 and os.path.relpath(path, REPO) not in allowed_big:
            big.append(os.path.relpath(path, REPO))
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.ClassDef):
                for f in node.body:
                    if isinstance(f, ast.FunctionDef) and f.end_lineno - f.lineno > 100:
                        long_fns.append(f"{node.name}.{f.name}")
            elif isinstance(node, ast.FunctionDef) and node.end_lineno - node.lineno > 100 \
                    and node.col_offset == 0:
                long_fns.append(node.name)
    assert big == []
    assert set(long_fns) <= allowed_long, sorted(set(long_fns) - allowed_long)


def test_roles_read_only_their_view_of_the_job():
    """A role loop gets its frozen view of the job (role_jobs): every ``job.<field>`` its modules read is a field
    of that view, so a role's inputs stay listed in one place."""
    import re
    from dataclasses import fields

    from dflash_dist.role_jobs import DrafterJob, RoleJob, TargetJob
    outside = []
    for pattern, cls in (("roles/target_rank/*.py", TargetJob), ("roles/drafter_rank/*.py", DrafterJob),
                         ("eval/in_training.py", RoleJob), ("eval/follower.py", RoleJob)):
        names = {f.name for f in fields(cls)}
        for path in glob.glob(os.path.join(PKG, pattern)):
            used = set(re.findall(r"\bjob\.([a-z_]+)", open(path).read()))
            outside += [f"{os.path.relpath(path, REPO)}: job.{n}" for n in sorted(used - names)]
    assert outside == []
    assert {f.name for f in fields(TargetJob)} - {f.name for f in fields(RoleJob)} == {"dataset_path"}


def _calls(name: str) -> list[str]:
    """'file:line' of every call of a function or method named ``name`` in the package."""
    out = []
    for path in glob.glob(os.path.join(PKG, "**", "*.py"), recursive=True):
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Call):
                f = node.func
                called = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
                if called == name:
                    out.append(f"{os.path.relpath(path, REPO)}:{node.lineno}")
    return sorted(out)


def test_drafter_settings_derived_in_one_place():
    """The drafter's shape is derived from the target in one place (model/spec.resolve_drafter), and the job
    resolves it once (job.build_job); everything else reads the resolved description (a saved one is read with
    DrafterModelConfig(**...), which does not count)."""
    assert [c.rsplit(":", 1)[0] for c in _calls("from_target")] == ["dflash_dist/model/spec.py"]
    assert [c.rsplit(":", 1)[0] for c in _calls("resolve_drafter")] == ["dflash_dist/job.py"]
    # "None means on with flex" and the loss knobs are resolved there too, read nowhere else
    knobs = ("compile_loss", "compile_layers", "compile_dynamic", "loss_chunk_rows", "loss_gamma")
    readers = []
    for path in glob.glob(os.path.join(PKG, "**", "*.py"), recursive=True):
        rel = os.path.relpath(path, REPO)
        if rel.startswith("dflash_dist/config/") or rel == "dflash_dist/model/spec.py":
            continue
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Attribute) and node.attr in knobs and \
                    isinstance(node.value, ast.Attribute) and node.value.attr == "tuning":
                readers.append(f"{rel}:{node.lineno} .tuning.{node.attr}")
    assert readers == []


def test_communication_computes_no_loss():
    """comm/ moves tensors: the loss math (model/loss.py, model/objectives/) is the objective object's, handed in."""
    g = import_graph()
    reaching = [(u, v) for u, deps in g.items() if u.startswith("dflash_dist.comm") for v in deps
                if v.startswith(("dflash_dist.model.loss", "dflash_dist.model.objectives"))]
    assert reaching == []


def test_one_constructor_builds_a_message():
    """A ``Message`` is made by ``Message.build`` only (the target's capture, the receiver, the drafter's
    measurement), never by calling the dataclass directly in the package."""
    assert _calls("Message") == []
    builders = {c.rsplit(":", 1)[0] for c in _calls("build")}
    assert {"dflash_dist/comm/transport.py", "dflash_dist/roles/target_rank/loop.py",
            "dflash_dist/planning/measure.py"} <= builders


def test_call_finder_finds_calls():
    assert _calls("resolve_drafter") and not _calls("no_function_is_named_like_this")


def test_job_module_builds_the_job_only():
    """job.py builds the job: data preparation (data/prepare.py), run resolution and resume (checkpoint/resume.py)
    and the target's lookups (targets/hf.py) live beside what they are about."""
    with open(os.path.join(PKG, "job.py")) as f:
        n = len(f.read().splitlines())
    assert n <= 320, f"dflash_dist/job.py has {n} lines"


def test_test_files_live_in_their_folders():
    """Every test-side Python file is under tests/unit, tests/integration, tests/bench or tests/helpers (only
    conftest.py at the top)."""
    top = sorted(os.path.basename(p) for p in glob.glob(os.path.join(REPO, "tests", "*.py")))
    assert top == ["conftest.py"], top
    allowed = {"unit", "integration", "bench", "helpers"}
    for p in glob.glob(os.path.join(REPO, "tests", "**", "*.py"), recursive=True):
        rel = os.path.relpath(p, os.path.join(REPO, "tests"))
        assert rel == "conftest.py" or rel.split(os.sep)[0] in allowed, rel


def test_tests_do_not_reach_into_bench():
    """Only the bench scripts' own tests (tests/bench) import bench/: the harness the other tests train with is
    tests/helpers/standalone_drafter.py, which bench/_standalone.py imports in turn."""
    import re
    reaching = []
    for folder in ("unit", "integration", "helpers"):
        for p in glob.glob(os.path.join(REPO, "tests", folder, "**", "*.py"), recursive=True):
            src = open(p).read()
            if re.search(r"sys\.path\.\w+\([^\n]*bench|^\s*import _standalone|^\s*import _common", src, re.M):
                reaching.append(os.path.relpath(p, REPO))
    assert reaching == []


# a measured figure: a time, a rate, a speed-up or a percentage faster/slower
FIGURE = re.compile(r"\d[\d.,]*\s?(?:ms|µs)\b|\d[\d.,]*K?\s?(?:tok|tokens|samples)/s\b|\d[\d.,]*\s?(?:TFLOP/s|GB/s)"
                    r"|\d[\d.]*x (?:faster|slower|the)\b|\d+(?:\.\d+)?% (?:faster|slower)\b")


def _prose(src: str) -> list:
    """(line, text) of every docstring paragraph and every block of consecutive comment lines of a module."""
    import io
    import tokenize
    out = []
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            out += [(node.lineno, para) for para in re.split(r"\n\s*\n", node.value.value)]
    block, start, last = [], 0, -2
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            if tok.start[0] != last + 1 and block:
                out.append((start, " ".join(block)))
                block = []
            start = start if block else tok.start[0]
            block.append(tok.string)
            last = tok.start[0]
    return out + ([(start, " ".join(block))] if block else [])


def test_measured_figures_in_the_code_link_their_result():
    """A benchmark figure in a docstring or comment of the package sits in a paragraph that links where it was
    measured (docs/benchmarks.md#<anchor>, an anchor that exists), so the code never quotes a number the
    benchmarks do not hold."""
    bench = open(os.path.join(REPO, "docs", "benchmarks.md")).read()
    anchors = set(re.findall(r'<a id="([^"]+)"></a>', bench))
    loose, dangling = [], []
    for path in glob.glob(os.path.join(PKG, "**", "*.py"), recursive=True):
        for line, text in _prose(open(path).read()):
            links = re.findall(r"docs/benchmarks\.md#([\w-]+)", text)
            if FIGURE.search(text) and not links:
                loose.append(f"{os.path.relpath(path, REPO)}:{line}: {FIGURE.findall(text)}")
            dangling += [f"{os.path.relpath(path, REPO)}:{line}: #{a}" for a in links if a not in anchors]
    assert loose == [] and dangling == []


def test_figure_finder_finds_figures():
    assert FIGURE.search("took 33.8 ms") and FIGURE.search("1.18x the local loss") and FIGURE.search("41.0K tok/s")
    assert not FIGURE.search("at most 10% of the data") and not FIGURE.search("sleeping 10 us")
    assert _prose('"""Doc.\n\nSecond 5 ms."""\n# a\n# b\nx = 1\n\ny = 2  # c\n') == [
        (1, "Doc."), (1, "Second 5 ms."), (4, "# a # b"), (8, "# c")]


def _code_words(src: str) -> list:
    """(line, text) of a module's identifiers and of its string literals that are not docstrings (comments and
    docstrings are prose: they may name an example)."""
    import io
    import tokenize
    docstrings = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                docstrings.add(body[0].lineno)
        if isinstance(node, (ast.Module, ast.ClassDef)):      # attribute docstrings: a string after an assignment
            for a, b in zip(node.body, node.body[1:]):
                if isinstance(a, (ast.Assign, ast.AnnAssign)) and isinstance(b, ast.Expr) \
                        and isinstance(b.value, ast.Constant) and isinstance(b.value.value, str):
                    docstrings.add(b.lineno)
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.NAME or (tok.type == tokenize.STRING and tok.start[0] not in docstrings):
            out.append((tok.start[0], tok.string))
    return out


# the drafter variants other than the base, with the package files besides their folder that may name them:
# the registry (model/variants/__init__.py) and their config sections (config/drafter.py, re-exported by config/)
VARIANT_FOLDERS = ("dflash2", "domino")
MAY_NAME_VARIANTS = ("dflash_dist/model/variants/__init__.py", "dflash_dist/config/drafter.py",
                     "dflash_dist/config/__init__.py")


def test_a_variant_lives_in_its_folder():
    """A drafter variant is its folder (model/variants/<name>/), its config section and one registration line:
    no other package file names it in code (an identifier or a string; prose may), so the export, the
    validators, the tools and the loops only ask the variant's hooks."""
    names = re.compile("|".join(VARIANT_FOLDERS), re.I)
    found = []
    for path in glob.glob(os.path.join(PKG, "**", "*.py"), recursive=True):
        rel = os.path.relpath(path, REPO)
        if rel in MAY_NAME_VARIANTS:
            continue
        own = rel.split("/")[3] if rel.startswith("dflash_dist/model/variants/") and rel.count("/") > 3 else None
        for line, text in _code_words(open(path).read()):
            hits = {m.lower() for m in names.findall(text)} - {own}
            if hits:
                found.append(f"{rel}:{line}: {text[:60]}")
    assert found == []
    assert sorted(os.path.basename(os.path.dirname(p)) for p in
                  glob.glob(os.path.join(PKG, "model", "variants", "*", "variant.py"))) == ["dflash", *VARIANT_FOLDERS]


def test_variant_finder_finds_names():
    assert [t for _, t in _code_words('"""DFlash2 doc."""\nx = Domino.y  # dflash2\ns = "drafter.dflash2"\n')
            if re.search("dflash2|domino", t, re.I)] == ["Domino", '"drafter.dflash2"']


def test_the_served_format_has_its_own_room():
    """export/ (writing, loading and checking the served format) reads checkpoints; checkpoint/ (the run's own
    state: store, resume, claim, identity, meta) never reaches the served format, and only the readers of an export
    (the tools in cli/ and evaluation) and export/ itself import it: the training loops never do."""
    g = import_graph()
    reaching = [(u, v) for u, deps in g.items() for v in deps if v.startswith("dflash_dist.export")
                and not u.startswith(("dflash_dist.export", "dflash_dist.cli", "dflash_dist.eval"))]
    assert reaching == []
    assert {m.rsplit(".", 1)[-1] for m in g if m.startswith("dflash_dist.export.")} == \
        {"write", "load", "validate", "serving"}
    assert not [m for m in g if m.startswith("dflash_dist.checkpoint.") and
                m.rsplit(".", 1)[-1] in ("export", "export_load", "serving", "modeling_dflash")]
