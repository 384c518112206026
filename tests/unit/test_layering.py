"""How rlpost's packages depend on each other: no import cycle between them.

Every import counts, at module level or inside a function (a lazy import is still a dependency),
except the ones under ``if TYPE_CHECKING:`` (annotations only). A node is a subpackage of rlpost
(``actors``, ``policies``, ...) or a top-level module (``config``, ``clients``, ...).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2] / "rlpost"

# cycles that exist and are to be removed; a new one fails the test, and so does one of these gone
# (then delete it here)
KNOWN_CYCLES: list[set[str]] = []


def node_of(module: str) -> str:
    """``rlpost.actors.inference`` -> ``actors``; ``rlpost.config`` -> ``config``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _type_checking_blocks(tree: ast.AST) -> set[int]:
    """ids of the nodes under ``if TYPE_CHECKING:``."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            for child in node.body:
                inside.update(id(n) for n in ast.walk(child))
    return inside


def dependencies() -> dict[str, dict[str, list[str]]]:
    """node -> node it imports -> where (file:line)."""
    graph: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for path in sorted(ROOT.rglob("*.py")):
        module = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts).removesuffix(".__init__")
        source = node_of(module)
        tree = ast.parse(path.read_text())
        skip = _type_checking_blocks(tree)
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("rlpost."):
                targets = [node.module]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names if alias.name.startswith("rlpost.")]
            else:
                continue
            for target in targets:
                if node_of(target) != source:
                    graph[source][node_of(target)].append(f"{path.relative_to(ROOT.parent)}:{node.lineno}")
    return graph


def cycles(graph: dict[str, dict[str, list[str]]]) -> list[set[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, {}):
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


def test_no_import_cycle_between_rlposts_packages():
    graph = dependencies()
    found = cycles(graph)
    details = {
        frozenset(c): [f"{a} -> {b}: {graph[a][b][:3]}" for a in sorted(c) for b in sorted(c) if b in graph.get(a, {})]
        for c in found
    }
    new = [details[frozenset(c)] for c in found if c not in KNOWN_CYCLES]
    assert not new, f"import cycles between rlpost's packages: {new}"
    gone = [c for c in KNOWN_CYCLES if c not in found]
    assert not gone, f"these cycles are gone: delete them from KNOWN_CYCLES: {gone}"


def test_policies_never_reach_the_actors_nor_the_bottom_layers_the_service():
    graph = dependencies()
    assert "actors" not in graph["policies"], graph["policies"]["actors"]
    for low in ("data", "transport", "algo"):  # the bottom layers
        assert not {"actors", "collect", "controller", "supervisor"} & set(graph[low]), (low, dict(graph[low]))


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b": ["x"]}, "b": {"c": ["y"]}, "c": {"a": ["z"]}, "d": {"a": ["w"]}}
    assert cycles(graph) == [{"a", "b", "c"}]
