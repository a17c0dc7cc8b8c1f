"""The package's shape: imports that go one way, one program per pass (no single-device fork), short loop
functions, the log-prob pass in its own module. Read from the source with ``ast``, so these cost no JAX."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "lspo_jax"
# The modules a training step runs through: where a reader follows the method, so functions stay short.
LOOP_MODULES = ("train", "learner", "run", "prompts", "reweight", "distributed", "evaluation")


def import_graph(package: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports, at the top or inside a function (a deferred import is still a
    dependency: it only hides a cycle until the call)."""
    name = package.name
    modules = {path.stem for path in package.glob("*.py")}
    graph = {}
    for path in package.glob("*.py"):
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == name:
                parts = node.module.split(".")
                deps |= {a.name for a in node.names if a.name in modules} if len(parts) == 1 else {parts[1]}
            elif isinstance(node, ast.Import):
                deps |= {a.name.split(".")[1] for a in node.names if a.name.startswith(f"{name}.")}
        graph[path.stem] = deps - {path.stem}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                found.append(sorted([v, *component]))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_deferred_cycle(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "a.py").write_text("from pkg import b\n")
    (package / "b.py").write_text("def f():\n    from pkg.c import g\n")
    (package / "c.py").write_text("import pkg.a\n")
    (package / "d.py").write_text("from pkg import a\n")
    assert cycles(import_graph(package)) == [["a", "b", "c"]]


def test_the_package_imports_one_way():
    graph = import_graph(PACKAGE)
    assert {"model", "sharding", "train_config", "learner"} <= set(graph)  # the graph really read the package
    assert cycles(graph) == []


def functions(module: str):
    tree = ast.parse((PACKAGE / f"{module}.py").read_text())
    return [node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)]


@pytest.mark.parametrize("module", LOOP_MODULES)
def test_loop_functions_fit_on_a_screen(module):
    long = {f.name: f.end_lineno - f.lineno + 1 for f in functions(module) if f.end_lineno - f.lineno + 1 > 60}
    assert not long, f"{module}.py: functions over 60 lines: {long}"


def test_one_program_per_pass_whatever_the_device_count():
    """No module forks a single-device path from the mesh path: one device is a 1 x 1 x 1 mesh, and the only
    test of a missing mesh is the default that supplies that one (``sharding.mesh_or_local``)."""
    forks = {
        path.name: text.count("mesh is None") + text.count("mesh is not None")
        for path in PACKAGE.glob("*.py")
        if "mesh is None" in (text := path.read_text()) or "mesh is not None" in text
    }
    assert forks == {"sharding.py": 1}


def test_the_log_prob_pass_lives_in_its_own_module():
    assert not [f.name for f in functions("optim") if "logprob" in f.name]
    assert {"sequence_logprobs", "grouped_logprobs", "logprobs_and_entropy"} <= {f.name for f in functions("logprobs")}
