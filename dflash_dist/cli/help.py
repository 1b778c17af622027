"""``dflash-train --help``: the launcher's options, the config groups with their presets, and every key with its
default and the first line of its docstring in ``dflash_dist/config/`` (the one place each key is documented)."""

from __future__ import annotations

import ast
import dataclasses
import json
import os

from dflash_dist import config as C

USAGE = """\
usage: dflash-train [--nproc-per-node N] [--cfg job] [--help] [key=value | group=option ...]

Starts the ranks of one training job on this machine (torch's elastic launcher, a standalone rendezvous):
the last topology.target_ranks ranks run the frozen target, the others train the drafter; with
topology.target_ranks=0 (and in a job of one process: one GPU) every rank does both, capture then step.

options:
  --nproc-per-node N  processes to start (default: one per visible GPU; 3 on a machine without one)
  --cfg job           print the resolved config after the checks training runs first; start nothing
  --help              this text

Ctrl-C or SIGTERM: the ranks finish the current step, write a checkpoint and stop; the command to continue is
printed (exit 130 / 143). A second Ctrl-C stops at once, without a checkpoint. Wrong settings exit 2.
Several nodes or SLURM: launch/multinode.sh, launch/slurm.sbatch (torchrun -m dflash_dist.train)."""


def field_docs() -> dict[str, dict[str, str]]:
    """Class name -> field name -> the first line of the field's docstring, read from the config modules' source
    (a dataclass keeps no field docstrings at run time)."""
    import glob
    body = []
    for path in sorted(glob.glob(os.path.join(os.path.dirname(C.__file__), "*.py"))):
        with open(path) as f:
            body += ast.parse(f.read()).body
    docs: dict[str, dict[str, str]] = {}
    for node in body:
        if not isinstance(node, ast.ClassDef):
            continue
        fields = docs.setdefault(node.name, {})
        for stmt, nxt in zip(node.body, node.body[1:]):
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and isinstance(nxt, ast.Expr) \
                    and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
                fields[stmt.target.id] = nxt.value.value.strip().splitlines()[0].strip()
    return docs


def group_options(conf_dir: str) -> dict[str, tuple[list[str], str]]:
    """Group -> (its presets in conf/<group>/, the default job's choice). ``base`` (each group's dataclass
    defaults, registered by config.register_config_groups) is what every preset starts from, not a choice."""
    import yaml
    with open(os.path.join(conf_dir, "config.yaml")) as f:
        defaults = yaml.safe_load(f).get("defaults", [])
    chosen = {k: v for d in defaults if isinstance(d, dict) for k, v in d.items() if k in C.GROUPS}
    out = {}
    for group in C.GROUPS:
        d = os.path.join(conf_dir, group)
        names = sorted(n[:-5] for n in os.listdir(d) if n.endswith(".yaml")) if os.path.isdir(d) else []
        out[group] = ([n for n in names if n != "base"], chosen.get(group, ""))
    return out


def _show(value) -> str:
    text = json.dumps(value, default=str) if isinstance(value, (dict, list)) else \
        "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
    return text if len(text) <= 28 else text[:25] + "..."


def key_lines(cls, prefix: str, values: dict, docs: dict) -> list[tuple[str, str, str]]:
    """(key, value in the default job, first docstring line) of every field of ``cls``, sub-groups expanded."""
    rows = []
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else \
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        value = values.get(f.name, default) if isinstance(values, dict) else default
        if dataclasses.is_dataclass(default):
            rows += key_lines(type(default), f"{prefix}{f.name}.", value if isinstance(value, dict) else {}, docs)
        else:
            rows.append((f"{prefix}{f.name}", _show(value), docs.get(cls.__name__, {}).get(f.name, "")))
    return rows


def render_help(conf_dir: str, default_job: dict) -> str:
    """The whole ``--help`` text; ``default_job``: the composed config of the default job (values shown)."""
    docs = field_docs()
    lines = [USAGE, "", "config groups (group=option; * the default job's):"]
    for group, (names, chosen) in group_options(conf_dir).items():
        lines.append(f"  {group + ':':<10} " + ", ".join(n + ("*" if n == chosen else "") for n in names))
    lines += ["", "keys (key=value; the default job's value, then what it does; every key in full: "
                  "dflash_dist/config/):"]
    for group, cls in C.GROUPS.items():
        lines.append("")
        for key, value, doc in key_lines(cls, f"{group}.", default_job.get(group) or {}, docs):
            lines.append(f"  {key} = {value}" + (f"\n      {doc}" if doc else ""))
    return "\n".join(lines)
