"""The package's shape: one folder per layer, imports that go one way and only down the layers, a step that never
names an optional method, one program per pass (no single-device fork), short loop functions, the log-prob pass in
its own module. Read from the source with ``ast``, so these cost no JAX."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "lspo_jax"
# The modules a training step runs through: where a reader follows the method, so functions stay short.
LOOP_MODULES = (
    "rl/train", "rl/learner", "rl/prompts", "rl/rounds", "rl/distributed", "job/run", "job/build", "job/evaluation",
    "methods/l2rr/prompts", "methods/first_mistake/strategy",
)  # fmt: skip
# The layers, bottom up: the package's root (config, options) < models < rollout < rl < methods < job, with tasks
# beside (anything above the root may read it; it reads only the root). A layer never imports these:
NEVER = {
    "root": {"models", "tasks", "rollout", "rl", "methods", "job"},
    "models": {"tasks", "rollout", "rl", "methods", "job"},
    "tasks": {"models", "rollout", "rl", "methods", "job"},
    "rollout": {"tasks", "rl", "methods", "job"},
    "rl": {"methods", "job"},
    "methods": {"job"},
    "job": set(),
}
METHOD_NAMES = re.compile(r"l2rr|first_mistake|first-mistake", re.IGNORECASE)


def module_name(path: Path, package: Path) -> str:
    """``rl/train.py`` -> ``rl.train``; a folder's ``__init__.py`` is the folder's name (the root's is ``""``)."""
    parts = path.relative_to(package).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports, at the top or inside a function (a deferred import is still a
    dependency: it only hides a cycle until the call). ``from pkg.a import b`` is module ``a.b`` when that is a
    module, else ``a``; an import of a name that is no module of the package (an old path) is kept as it is, so
    ``unresolved`` finds it."""
    modules = {module_name(path, package) for path in package.rglob("*.py")}
    graph = {}
    for path in package.rglob("*.py"):
        graph[module_name(path, package)] = package_imports(path, package.name, modules) - {module_name(path, package)}
    return graph


def package_imports(path: Path, name: str, modules: set[str]) -> set[str]:
    """The modules of package ``name`` (``modules``, relative names) that the file ``path`` imports."""
    deps = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == name:
            parent = ".".join(node.module.split(".")[1:])
            for alias in node.names:
                child = f"{parent}.{alias.name}".lstrip(".")
                deps.add(child if child in modules else parent)
        elif isinstance(node, ast.Import):
            deps |= {a.name.partition(".")[2] for a in node.names if a.name.startswith(f"{name}.")}
    return deps - {""}


def layer(module: str) -> str:
    """The layer a module belongs to: its top folder, or ``root`` for a module beside the folders."""
    first, dot, _ = module.partition(".")
    return first if first and (dot or (PACKAGE / first).is_dir()) else "root"


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


def test_the_cycle_finder_finds_a_deferred_cycle_across_folders(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg.sub import b\n")
    (package / "sub" / "b.py").write_text("def f():\n    from pkg.sub.c import g\n")
    (package / "sub" / "c.py").write_text("import pkg.a\n")
    (package / "d.py").write_text("from pkg import a\n")
    graph = import_graph(package)
    assert graph["a"] == {"sub.b"} and graph["d"] == {"a"}
    assert cycles(graph) == [["a", "sub.b", "sub.c"]]


def test_the_package_imports_one_way():
    graph = import_graph(PACKAGE)
    assert {"models.model", "models.sharding", "train_config", "rl.learner", "job.run"} <= set(graph)  # read it all
    assert cycles(graph) == []


def test_every_import_inside_the_package_names_a_module_where_it_is():
    """The old top-level paths are for users; the package itself imports every module where it lives."""
    graph = import_graph(PACKAGE)
    unresolved = {m: sorted(d for d in deps if d not in graph) for m, deps in graph.items()}
    assert {m: deps for m, deps in unresolved.items() if deps} == {}


def test_the_repository_uses_the_package_where_it_lives_and_the_tests_import_the_tools():
    """``tests``, ``tools`` and ``benchmarks`` import each module of ``lspo_jax`` where it lives (the deprecated paths
    are for users' code, and only ``test_paths.py`` uses them, to test them), and the tests import the tools as
    modules, never by a file's path."""
    repo = PACKAGE.parent
    modules = {module_name(path, PACKAGE) for path in PACKAGE.rglob("*.py")}
    tests = [p for p in sorted(repo.glob("tests/**/*.py")) if p.name != "test_paths.py"]
    scripts = sorted([*repo.glob("tools/*.py"), *repo.glob("benchmarks/*.py"), *tests])
    assert (
        len(tests) > 30
        and len(scripts) > 45
        and (repo / "tools" / "__init__.py").exists()
        and (repo / "benchmarks" / "__init__.py").exists()
    )
    stale = {str(p.relative_to(repo)): sorted(package_imports(p, PACKAGE.name, modules) - modules) for p in scripts}
    assert {path: old for path, old in stale.items() if old} == {}
    by_path = re.compile(r"spec_from_file_location|syspath_prepend|sys\.path\.(insert|append)")
    assert [p.name for p in tests if by_path.search(p.read_text()) and p.name != Path(__file__).name] == []


def dotted_path_is_real(dotted: str, top: set[str]) -> bool:
    """``.a.b.c`` after ``lspo_jax``: ``a`` one of ``top``; then, while the path is a folder, each part a module or
    folder in it or a name its ``__init__`` names (the rest, inside a module, is not followed)."""
    first, *rest = dotted.lstrip(".").split(".")
    if first not in top:
        return False
    path = PACKAGE / first
    for part in rest:
        if not path.is_dir():
            return True
        if not ((path / f"{part}.py").exists() or (path / part).is_dir() or part in (path / "__init__.py").read_text()):
            return False
        path = path / part
    return True


def test_every_dotted_name_in_the_repository_text_is_a_real_path():
    """Code in strings, docs and config comments name modules by the same paths: after ``lspo_jax.`` a module or
    folder of the package or a name its ``__init__`` defines, wherever it is written. A deprecated path appears only
    in the deprecation table and on a line that says it is deprecated."""
    repo = PACKAGE.parent
    init = ast.parse((PACKAGE / "__init__.py").read_text())
    top = {p.stem for p in PACKAGE.glob("*.py")} | {p.name for p in PACKAGE.iterdir() if p.is_dir()}
    top |= {n.id for n in ast.walk(init) if isinstance(n, ast.Name)}
    top |= {n.name for n in init.body if isinstance(n, ast.FunctionDef | ast.ClassDef)}
    public = [n.value for n in init.body if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "PUBLIC"]
    top |= {key.value for table in public for key in table.keys}  # the Python API, imported at first use
    kinds = ("*.py", "*.md", "*.toml", "*.yaml", "*.sh", "*.cfg")
    files = [p for kind in kinds for p in repo.rglob(kind) if ".venv" not in p.parts]
    table = {PACKAGE / "__init__.py", repo / "tests" / "test_paths.py"}  # the deprecation table and its test
    files = [p for p in files if not {"runs", "results", ".git"} & set(p.relative_to(repo).parts) and p not in table]
    found = {
        f"{p.relative_to(repo)}: {m.group(0)}"
        for p in files
        for line in p.read_text(errors="replace").splitlines()
        for m in re.finditer(r"\blspo_jax((?:\.\w+)+)|\bfrom lspo_jax import (\w+)", line)
        if not dotted_path_is_real(m.group(1) or f".{m.group(2)}", top) and "deprecat" not in line.lower()
    }
    files_named = {
        f"{p.relative_to(repo)}: {m.group(0)}"
        for p in files
        for m in re.finditer(r"\blspo_jax/([\w/]+\.py)\b", p.read_text(errors="replace"))
        if not (PACKAGE / m.group(1)).exists()
    }
    assert len(files) > 80 and sorted(found) == [] and sorted(files_named) == []


def test_imports_run_down_the_layers():
    graph = import_graph(PACKAGE)
    assert {layer(m) for m in graph} == set(NEVER)  # every module sits in a known layer
    against = sorted(f"{m} -> {d}" for m, deps in graph.items() for d in deps if layer(d) in NEVER[layer(m)])
    assert against == []


def test_a_method_never_imports_another():
    graph = import_graph(PACKAGE)
    method = lambda m: m.split(".")[1] if m.startswith("methods.") and m.count(".") >= 1 else None
    crossing = sorted(f"{m} -> {d}" for m, deps in graph.items() for d in deps if method(m) and method(d)
                      and method(m) != method(d))  # fmt: skip
    assert crossing == []


def test_the_step_never_names_a_method():
    """The step's layer holds the interfaces a method plugs into (a token-advantages strategy, a hook around the
    update) and no method: a new one is its folder, its config section and a line in the run's builder."""
    named = {
        str(path.relative_to(PACKAGE)): METHOD_NAMES.findall(path.read_text())
        for path in (PACKAGE / "rl").rglob("*.py")
    }
    assert {path: names for path, names in named.items() if names} == {}


def functions(module: str):
    tree = ast.parse((PACKAGE / f"{module}.py").read_text())
    return [node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)]


@pytest.mark.parametrize("module", LOOP_MODULES)
def test_loop_functions_fit_on_a_screen(module):
    long = {f.name: f.end_lineno - f.lineno + 1 for f in functions(module) if f.end_lineno - f.lineno + 1 > 60}
    assert not long, f"{module}.py: functions over 60 lines: {long}"


def too_long(root: Path, file_limit: int | None, function_limit: int) -> list[str]:
    """``PATH: N lines`` for each module over ``file_limit`` and ``PATH:FUNCTION: N lines`` for each function over
    ``function_limit`` under ``root``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        source = path.read_text()
        name = path.relative_to(root.parent)
        if file_limit is not None and len(source.splitlines()) > file_limit:
            found.append(f"{name}: {len(source.splitlines())} lines")
        defs = [f for f in ast.walk(ast.parse(source)) if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)]
        lengths = [(f"{name}:{f.name}", f.end_lineno - f.lineno + 1) for f in defs]  # a list: methods share names
        found += [f"{where}: {n} lines" for where, n in lengths if n > function_limit]
    return found


def test_rooms_stay_small():
    """A new capability gets a module of its own: no package module over 600 lines, no function over 60; the tests',
    tools' and benchmarks' functions (tables of cases, argument parsers) up to 80."""
    assert too_long(PACKAGE, 600, 60) == []
    assert [line for d in ("tests", "tools", "benchmarks") for line in too_long(PACKAGE.parent / d, None, 80)] == []


def test_the_size_check_counts_lines(tmp_path):
    (tmp_path / "pkg").mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(60))  # a def line and 60 body lines: 61 lines
    (tmp_path / "pkg" / "m.py").write_text(f"def long():\n{body}\n\n\ndef short():\n    pass\n")
    assert too_long(tmp_path / "pkg", 600, 60) == ["pkg/m.py:long: 61 lines"]
    # 61 + 2 blank lines + 2 of short(): 65 lines in the file.
    assert too_long(tmp_path / "pkg", 64, 61) == ["pkg/m.py: 65 lines"]


def test_one_program_per_pass_whatever_the_device_count():
    """No module forks a single-device path from the mesh path: one device is a 1 x 1 x 1 mesh, and the only
    test of a missing mesh is the default that supplies that one (``sharding.mesh_or_local``)."""
    forks = {
        str(path.relative_to(PACKAGE)): text.count("mesh is None") + text.count("mesh is not None")
        for path in PACKAGE.rglob("*.py")
        if "mesh is None" in (text := path.read_text()) or "mesh is not None" in text
    }
    assert forks == {"models/sharding.py": 1}


def test_the_log_prob_pass_lives_in_its_own_module():
    assert not [f.name for f in functions("rl/optim") if "logprob" in f.name]
    in_logprobs = {f.name for f in functions("rl/logprobs")}
    assert {"sequence_logprobs", "grouped_logprobs", "logprobs_and_entropy"} <= in_logprobs
    # The per-token log-prob math too: the losses read it from there, never the reverse.
    per_token = {"token_logprobs", "token_entropy", "chunked_token_logprobs", "split_rows", "merge_rows"}
    assert per_token <= in_logprobs and not per_token & {f.name for f in functions("rl/losses")}
    assert "rl.losses" not in import_graph(PACKAGE)["rl.logprobs"]


def test_the_slowest_files_are_in_the_slow_lane():
    """conftest's ``SLOW_FILES_FIRST`` (the order the suite runs them in) and the ``slow`` marker name the same files:
    the inner loop (``-m "not slow"``) leaves out every file the suite puts first, and the vLLM and multi-process
    files carry their own lane too."""
    from conftest import SLOW_FILES_FIRST

    tests = PACKAGE.parent / "tests"
    marks = {path.name: path.read_text() for path in tests.glob("test_*.py")}
    assert [name for name in SLOW_FILES_FIRST if "pytest.mark.slow" not in marks[name]] == []
    for lane in ("vllm", "multiprocess"):
        assert [name for name, text in marks.items() if lane in name and f"pytest.mark.{lane}" not in text] == []
