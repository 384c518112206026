"""List TorchRL's LLM tests and keep rlpost's inventory of them (tests/compat/torchrl_inventory.yaml).

Reads the test files of ``test/llm`` in a git checkout of https://github.com/pytorch/rl at a
commit (default ae9719f, the one the inventory was built against) with ``git show``, parses each
with ``ast`` and lists every test function as ``file::Class::test_name`` (or ``file::test_name``;
``file`` is relative to ``test/llm``). A test function counts once however it is parametrized;
``cases`` is the product of the lengths of its ``pytest.mark.parametrize`` value lists (its own and
its classes'), or null where a list is not a literal.

The inventory keeps every existing entry's status and fields; a test that is new at this commit
is added as ``missing``, and one that is gone is dropped and named on stdout. Only this script
needs the mirror: the inventory's unit test (tests/unit/test_torchrl_inventory.py) reads the
YAML alone.

    python scripts/torchrl_tests.py                          # update the inventory
    python scripts/torchrl_tests.py /path/to/rl --commit main
    python scripts/torchrl_tests.py --list                   # print the tests, write nothing
    python scripts/torchrl_tests.py --report                 # the counts and missing tests, for the docs
"""

from __future__ import annotations

import argparse
import ast
import math
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
INVENTORY = REPO / "tests" / "compat" / "torchrl_inventory.yaml"
DEFAULT_MIRROR = Path("/work/.mirror/pytorch+rl/repo")
DEFAULT_COMMIT = "ae9719f"
PUBLIC_REPOSITORY = "https://github.com/pytorch/rl"
# the files of test/llm that the inventory covers, in the order it lists them
FILES = (
    "test_data.py",
    "test_conversions.py",
    "test_llm_envs.py",
    "test_wrapper.py",
    "test_llm_objectives.py",
    "test_llm_collectors.py",
    "test_llm_transforms.py",
    "test_llm_updaters.py",
    "test_vllm.py",
    "test_vllm_plugin.py",
    "libs/test_mlgym.py",
    "test_sglang.py",
    "test_sglang_updaters.py",
)
# the order of an entry's fields in the YAML file
FIELDS = ("cases", "inherited_from", "status", "rlpost", "why", "needs", "note")


def git_show(mirror: Path, commit: str, path: str) -> str:
    return subprocess.run(
        ["git", "-C", str(mirror), "show", f"{commit}:{path}"], check=True, capture_output=True, text=True
    ).stdout


def resolve_commit(mirror: Path, commit: str) -> str:
    out = subprocess.run(["git", "-C", str(mirror), "rev-parse", commit], check=True, capture_output=True, text=True)
    return out.stdout.strip()


def _literal_lists(body: list[ast.stmt]) -> dict[str, int]:
    """``NAME = [...]`` / ``(...)`` assignments of a module or class body: their lengths."""
    sizes = {}
    for node in body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.List | ast.Tuple):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    sizes[target.id] = len(node.value.elts)
    return sizes


def _parametrize_size(decorator: ast.expr, lists: dict[str, int]) -> int | None:
    """1 for a decorator that is not ``pytest.mark.parametrize``; None when its values are not literal."""
    if not (isinstance(decorator, ast.Call) and ast.unparse(decorator.func).endswith("mark.parametrize")):
        return 1
    values = decorator.args[1] if len(decorator.args) > 1 else None
    values = next((k.value for k in decorator.keywords if k.arg == "argvalues"), values)
    ids = next((k.value for k in decorator.keywords if k.arg == "ids"), None)
    if isinstance(values, ast.List | ast.Tuple):
        return len(values.elts)
    if isinstance(values, ast.Name) and values.id in lists:
        return lists[values.id]
    if isinstance(ids, ast.List | ast.Tuple):  # values from elsewhere, one id per case
        return len(ids.elts)
    return None


def _cases(decorators: list[ast.expr], lists: dict[str, int]) -> int | None:
    sizes = [_parametrize_size(d, lists) for d in decorators]
    return None if None in sizes else math.prod(sizes)


def list_tests(source: str, file: str) -> dict[str, dict]:
    """Every test of one file, ``file::Class::test_name`` -> ``{"cases": n}`` (and ``inherited_from``).

    A test class collects the test methods of the module's classes it derives from, as pytest
    does: each subclass runs them again (with its own fixtures), so each is listed under it.
    """
    tree = ast.parse(source)
    module_lists = _literal_lists(tree.body)
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    tests: dict[str, dict] = {}

    def methods(cls: ast.ClassDef) -> dict[str, tuple[ast.FunctionDef, ast.ClassDef]]:
        found = {}
        for base in cls.bases:  # bases first, so the class's own definitions override theirs
            if isinstance(base, ast.Name) and base.id in classes:
                found.update(methods(classes[base.id]))
        for node in cls.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test"):
                found[node.name] = (node, cls)
        return found

    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test"):
            tests[f"{file}::{node.name}"] = {"cases": _cases(node.decorator_list, module_lists)}
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            for name, (func, owner) in methods(node).items():
                lists = module_lists | _literal_lists(owner.body)
                entry = {"cases": _cases(node.decorator_list + func.decorator_list, lists)}
                if owner is not node:
                    entry["inherited_from"] = owner.name
                tests[f"{file}::{node.name}::{name}"] = entry
    return tests


def list_all(mirror: Path, commit: str) -> dict[str, dict]:
    tests: dict[str, dict] = {}
    for file in FILES:
        tests.update(list_tests(git_show(mirror, commit, f"test/llm/{file}"), file))
    return tests


def load_inventory(path: Path) -> dict:
    if not path.exists():
        return {"tests": {}}
    return yaml.safe_load(path.read_text()) or {"tests": {}}


def merge(inventory: dict, tests: dict[str, dict], commit: str) -> tuple[dict, list[str], list[str]]:
    """The inventory for ``tests``: old entries keep their fields, new ones are ``missing``."""
    old = inventory.get("tests") or {}
    merged = {}
    for test_id, listed in tests.items():
        entry = dict(old.get(test_id) or {"status": "missing"})
        entry.pop("inherited_from", None)
        entry.update(listed)
        merged[test_id] = {k: entry[k] for k in FIELDS if k in entry} | {
            k: v for k, v in entry.items() if k not in FIELDS
        }
    added = [t for t in tests if t not in old]
    dropped = [t for t in old if t not in tests]
    header = {"repository": PUBLIC_REPOSITORY, "commit": commit, "folder": "test/llm"}
    return header | {"tests": merged}, added, dropped


HEADER = """\
# TorchRL's LLM tests (test/llm at the commit below) and how rlpost ports each one.
# Written by scripts/torchrl_tests.py, which keeps every entry's fields when re-run; edit the
# statuses by hand. Checked by tests/unit/test_torchrl_inventory.py; explained in
# docs/torchrl-tests.md.
#   ported          rlpost: the rlpost test(s) that exercise the same behaviour
#   deviation       rlpost differs on purpose; why: one line, rlpost: the test asserting rlpost's behaviour
#   not_applicable  why: (SGLang, TorchRL internals or mocks, GPU-only); out of the pass figure
#   missing         not ported yet; needs: what a port needs
# note: optional, on any entry (what the port substitutes or leaves out)
# cases: the parametrized cases of the TorchRL test (null where its parameter lists are not literals)
"""


def dump(inventory: dict) -> str:
    return HEADER + yaml.safe_dump(inventory, sort_keys=False, width=120, allow_unicode=True)


REPORT_START, REPORT_END = "<!-- counts: scripts/torchrl_tests.py --report -->", "<!-- /counts -->"


def report(inventory: dict) -> str:
    """The counts per TorchRL file and the missing tests, as the markdown docs/torchrl-tests.md
    holds between its ``REPORT_START`` and ``REPORT_END`` lines (a unit test compares them)."""
    statuses = ("ported", "deviation", "not_applicable", "missing")
    per_file: dict[str, dict[str, int]] = {file: dict.fromkeys(statuses, 0) for file in FILES}
    for test_id, entry in inventory["tests"].items():
        per_file[test_id.split("::")[0]][entry["status"]] += 1

    def figure(row: dict[str, int]) -> str:
        passing = row["ported"] + row["deviation"]
        counted = passing + row["missing"]
        return f"{100 * passing / counted:.1f}%" if counted else "n/a"

    lines = [
        "| TorchRL file | tests | ported | deviation | not_applicable | missing | pass |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    total = dict.fromkeys(statuses, 0)
    for file, row in per_file.items():
        lines.append(
            f"| `{file}` | {sum(row.values())} | " + " | ".join(str(row[s]) for s in statuses) + f" | {figure(row)} |"
        )
        for status in statuses:
            total[status] += row[status]
    lines.append(
        f"| **all** | {sum(total.values())} | " + " | ".join(str(total[s]) for s in statuses) + f" | {figure(total)} |"
    )
    missing = [
        (test_id, entry.get("needs", ""))
        for test_id, entry in inventory["tests"].items()
        if entry["status"] == "missing"
    ]
    lines += ["", f"Missing ({len(missing)}):", ""]
    lines += [f"- `{test_id}`" + (f": {needs}" if needs else "") for test_id, needs in missing]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mirror", nargs="?", type=Path, default=DEFAULT_MIRROR, help="a git checkout of pytorch/rl")
    parser.add_argument("--commit", default=DEFAULT_COMMIT, help="the commit to read (default %(default)s)")
    parser.add_argument("--inventory", type=Path, default=INVENTORY, help="the YAML file to update")
    parser.add_argument("--list", action="store_true", help="print the tests and their cases; write nothing")
    parser.add_argument(
        "--report",
        action="store_true",
        help="print the inventory's counts and missing tests (markdown); no mirror needed",
    )
    args = parser.parse_args(argv)

    if args.report:
        print(report(load_inventory(args.inventory)), end="")
        return 0

    tests = list_all(args.mirror, args.commit)
    if args.list:
        for test_id, listed in tests.items():
            cases = listed["cases"] if listed["cases"] is not None else "?"
            inherited = f"  (from {listed['inherited_from']})" if "inherited_from" in listed else ""
            print(f"{test_id}  [{cases}]{inherited}")
        print(f"{len(tests)} test functions")
        return 0
    inventory, added, dropped = merge(load_inventory(args.inventory), tests, resolve_commit(args.mirror, args.commit))
    args.inventory.write_text(dump(inventory))
    if len(added) < len(tests):  # on a first run every test is new: no list
        for test_id in added:
            print(f"new (missing): {test_id}")
    for test_id in dropped:
        print(f"gone (dropped): {test_id}")
    print(f"{len(tests)} test functions ({len(added)} new, {len(dropped)} gone) -> {args.inventory}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
