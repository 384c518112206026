"""rlpost's modules obey their layers: each package imports only the layers below its own, no two
modules import each other (around a loop or directly, inside a package or across), and no module
takes another's private names. The rules and the layers are in ``scripts/import_graph.py``, which
prints the whole graph (``python scripts/import_graph.py``)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "import_graph.py"
_spec = importlib.util.spec_from_file_location("import_graph", SCRIPT)
import_graph = sys.modules.setdefault("import_graph", importlib.util.module_from_spec(_spec))  # dataclasses look it up
_spec.loader.exec_module(import_graph)


@pytest.fixture(scope="module")
def problems():
    return import_graph.problems()


def test_every_package_imports_only_the_layers_below_its_own(problems):
    assert not problems["layers"], "\n".join(problems["layers"])


def test_no_import_cycle_between_modules(problems):
    assert not problems["cycles"], "\n".join(problems["cycles"])


def test_no_module_imports_another_modules_private_names(problems):
    assert not problems["private"], "\n".join(problems["private"])


def test_every_package_and_top_level_module_has_a_layer():
    nodes = {import_graph.node_of(m) for m in import_graph.modules()}
    assert nodes <= set(import_graph.layer_of()), nodes - set(import_graph.layer_of())
    assert import_graph.layer_of()["algo"] < import_graph.layer_of()["policies"] < import_graph.layer_of()["actors"]


def test_the_graph_counts_imports_inside_functions_and_under_type_checking():
    found = import_graph.imports()
    lazy = [i for i in found if i.source == "rlpost.envs.tasks" and i.target == "rlpost.config"]
    assert {"ConfigError"} < {i.name for i in lazy}, "tasks imports ConfigError inside its functions"
    # DataConfig & co. are imported under TYPE_CHECKING only: a loop through them is a loop too
    assert {"DataConfig", "ToolsConfig"} < {i.name for i in lazy}


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_graph.cycles(graph) == [{"a", "b", "c"}]


def test_a_layer_violation_names_both_layers(monkeypatch):
    monkeypatch.setattr(import_graph, "LAYERS", [("low", ("algo",)), ("high", ("actors",))])
    graph = {"algo": {"actors": ["rlpost/algo/x.py:3"]}, "actors": {"algo": ["rlpost/actors/y.py:1"]}}
    assert import_graph.layer_violations(graph) == ["algo (layer 0) imports actors (layer 1): ['rlpost/algo/x.py:3']"]
    graph["actors"]["newpkg"] = ["rlpost/actors/y.py:2"]
    assert "newpkg: in no layer of LAYERS" in import_graph.layer_violations(graph)
