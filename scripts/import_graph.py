"""How rlpost's modules import each other, checked against the layers they must obey.

    python scripts/import_graph.py           # the package graph, layer by layer, and what breaks the rules
    python scripts/import_graph.py --modules # every module's rlpost imports
    python scripts/import_graph.py --check   # exit 1 when a rule is broken (tests/unit/test_layering.py)

A *node* is a subpackage of rlpost (``actors``, ``envs``, ``service``, ...) or a top-level module.
Every import statement counts: at module level, inside a function (an import delayed into a
function is still a dependency) and under ``if TYPE_CHECKING:`` (a type a module names is a
dependency of its reader: a loop there is a loop in what one must understand first). The rules:

1. a node imports only nodes of lower layers (:data:`LAYERS`, bottom first);
2. no two modules import each other, directly or around a loop, inside a package or across;
3. no module imports another module's private name (``from rlpost.x import _y``, ``x._y``).
"""

from __future__ import annotations

import argparse
import ast
import functools
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "rlpost"

# Bottom first. A node may import the nodes of the layers below its own, never its own layer's
# nor a higher one's. Each layer's line says what it holds.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("the job config (imports no other rlpost module)", ("rlpost", "config")),
    ("the Ray process helpers: liveness, placement, signals, starting Ray", ("runtime",)),
    ("pure parts: the math, the data types", ("algo", "data")),
    ("what a run records: metrics.jsonl, trackers, Ray metrics, the run directory", ("record",)),
    ("the pipes: buffer and weight-sync bus", ("transport",)),
    ("models: the LLM wrappers, LoRA", ("policies",)),
    ("what the loop is made of: losses, environments", ("objectives", "envs")),
    ("the collector, the offline tiny models", ("collect", "tiny")),
    ("the Ray roles", ("actors",)),
    ("the service: clients, supervisor, watchdog, mailbox, loop, run state, evaluation", ("service",)),
    ("the API server for many clients (the Tinker API over a fleet)", ("serve",)),
    ("operations: the CLI, Ray Jobs, doctor, monitoring, local clusters", ("ops",)),
    ("TorchRL's names over all of it", ("torchrl",)),
]  # fmt: skip


def layer_of() -> dict[str, int]:
    return {node: i for i, (_, nodes) in enumerate(LAYERS) for node in nodes}


@dataclass(frozen=True)
class Import:
    source: str  # importing module, e.g. rlpost.envs.chat
    target: str  # imported module, e.g. rlpost.envs.turns
    name: str | None  # the name taken from it (None for ``import rlpost.x``)
    where: str  # file:line


def modules() -> dict[str, Path]:
    """``rlpost.envs.chat`` -> its file, for every module of the package."""
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        name = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts).removesuffix(".__init__")
        found[name] = path
    return found


def node_of(module: str) -> str:
    """``rlpost.actors.inference`` -> ``actors``; ``rlpost.config`` -> ``config``; ``rlpost`` -> ``rlpost``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


@functools.cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def _absolute(module: str, path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    package = package[: len(package) - (node.level - 1)]
    return ".".join(package + ([node.module] if node.module else []))


@functools.cache
def imports() -> tuple[Import, ...]:
    """Every rlpost import of every rlpost module (``from a import b`` where ``a.b`` is a module
    imports that module)."""
    known = modules()
    found: list[Import] = []
    for module, path in known.items():
        tree = _tree(path)
        shown = path.relative_to(ROOT.parent)
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            where = f"{shown}:{node.lineno}"
            if isinstance(node, ast.ImportFrom):
                base = _absolute(module, path, node)
                if base != "rlpost" and not base.startswith("rlpost."):
                    continue
                for alias in node.names:
                    if f"{base}.{alias.name}" in known:
                        found.append(Import(module, f"{base}.{alias.name}", None, where))
                    else:
                        found.append(Import(module, base, alias.name, where))
            elif isinstance(node, ast.Import):
                found += [Import(module, a.name, None, where) for a in node.names if a.name.startswith("rlpost.")]
    return tuple(found)


def module_graph(found: tuple[Import, ...] | None = None) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = defaultdict(set)
    for imp in imports() if found is None else found:
        if imp.target != imp.source:
            graph[imp.source].add(imp.target)
    return graph


def package_graph(found: tuple[Import, ...] | None = None) -> dict[str, dict[str, list[str]]]:
    """node -> node it imports -> where (file:line)."""
    graph: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for imp in imports() if found is None else found:
        if node_of(imp.source) != node_of(imp.target):
            graph[node_of(imp.source)][node_of(imp.target)].append(imp.where)
    return graph


def cycles(graph) -> list[set[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[set[str]] = []
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    for v in list(graph):
        if v not in index:
            visit(v)
    return found


def private_imports(found: tuple[Import, ...] | None = None) -> list[str]:
    """``from rlpost.x import _y`` and ``x._y`` on an imported rlpost module, across modules."""
    found = imports() if found is None else found
    broken = [
        f"{imp.where}: {imp.name} from {imp.target}"
        for imp in found
        if imp.name and imp.name.startswith("_") and not imp.name.startswith("__") and imp.target != imp.source
    ]
    known = modules()
    for module, path in known.items():
        tree = _tree(path)
        bound = {}  # local name -> the rlpost module it names
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = _absolute(module, path, node)
                bound.update(
                    {a.asname or a.name: f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known}
                )
            elif isinstance(node, ast.Import):
                bound.update({a.asname: a.name for a in node.names if a.asname and a.name in known})
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in bound
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and bound[node.value.id] != module
            ):
                broken.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}: {node.attr} of {bound[node.value.id]}")
    return broken


def layer_violations(graph: dict[str, dict[str, list[str]]]) -> list[str]:
    """Imports of a node of the same or a higher layer, and nodes no layer names."""
    layers = layer_of()
    broken = [f"{node}: in no layer of LAYERS" for node in sorted(set(graph) | {t for d in graph.values() for t in d})
              if node not in layers]  # fmt: skip
    for source, targets in sorted(graph.items()):
        for target, where in sorted(targets.items()):
            if source in layers and target in layers and layers[target] >= layers[source]:
                broken.append(
                    f"{source} (layer {layers[source]}) imports {target} (layer {layers[target]}): {where[:3]}"
                )
    return broken


def problems() -> dict[str, list[str]]:
    found = imports()
    graph = package_graph(found)
    unplaced = sorted({node_of(m) for m in modules()} - set(layer_of()))
    return {
        "layers": layer_violations(graph) + [f"{node}: in no layer of LAYERS" for node in unplaced],
        "cycles": [" <-> ".join(sorted(c)) for c in cycles(module_graph(found))],
        "private": private_imports(found),
    }


def report(show_modules: bool = False) -> str:
    found = imports()
    graph = package_graph(found)
    lines = []
    placed = layer_of()
    for i, (what, nodes) in enumerate(LAYERS):
        lines.append(f"layer {i}: {what}")
        for node in nodes:
            deps = graph.get(node, {})
            shown = ", ".join(f"{d}({len(w)})" for d, w in sorted(deps.items(), key=lambda kv: placed.get(kv[0], 99)))
            lines.append(f"  {node:<18} -> {shown or '-'}")
    if show_modules:
        lines.append("")
        for module, targets in sorted(module_graph(found).items()):
            lines.append(f"{module} -> {', '.join(sorted(targets))}")
    for kind, broken in problems().items():
        lines.append("")
        lines.append(f"{kind}: {len(broken)} broken" if broken else f"{kind}: ok")
        lines += [f"  {b}" for b in broken]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modules", action="store_true", help="list every module's rlpost imports too")
    parser.add_argument("--check", action="store_true", help="exit 1 when a rule is broken")
    args = parser.parse_args(argv)
    print(report(show_modules=args.modules))
    return 1 if args.check and any(problems().values()) else 0


if __name__ == "__main__":
    sys.exit(main())
