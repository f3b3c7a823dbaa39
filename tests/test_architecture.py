"""The layers of ``chunkgrpo/`` (docs/architecture.md, "Layers"), enforced on the import graph of the three
packages: the library ``chunkgrpo/``, the KFP components ``components/`` and the pipelines ``pipeline/``.

Every ``import``/``from … import`` of a project module counts, at module level and inside functions (a lazy
import is still a dependency; hiding a circle in a function does not remove it). Tests (``tests/`` folders,
``conftest.py``) are not part of the graph. The rules:

* the packages stack (:data:`PACKAGES`): the library imports neither components nor pipelines, the
  components do not import the pipelines;

* every module belongs to a layer (:data:`LAYERS`); a new module has to be placed before it can land;
* an import points to the same layer or a lower one, never up; ``__main__`` modules are entry points,
  nothing imports them, so they are exempt as importers;
* no circle among modules of the three packages (Tarjan's strongly connected components over one graph);
* production code never imports the synthetic fixtures (``chunkgrpo.testing``) or the toy world
  (``chunkgrpo.toy``): only the CLI commands, the toy world itself and tests do;
* nothing under ``chunkgrpo/`` imports kfp (the library runs without the pipeline SDK);
* a module of any of the three packages over :data:`MAX_LINES` lines says why in its docstring (a paragraph
  starting "Size note:"); no Python file of the repository (tests, benchmarks and scripts too) is over
  :data:`HARD_MAX_LINES` lines.

The checker is tested on synthetic packages too, so a broken checker cannot pass silently.
"""
from __future__ import annotations

import ast
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "chunkgrpo"
# Bottom to top: a package imports itself and the ones below it.
PACKAGES: tuple[str, ...] = (PACKAGE, "components", "pipeline")
MAX_LINES = 600
HARD_MAX_LINES = 650

# Bottom to top. A name is a top-level module or subpackage of chunkgrpo ("" is the package root).
LAYERS: list[tuple[str, ...]] = [
    # L0 foundation: no I/O beyond files, no models
    ("", "errors", "backoff", "tempdirs", "gpu", "checks", "threads", "startup", "shutdown", "progress",
     "inputs", "config", "locks", "schedules", "sde", "advantages", "recipes", "grids"),
    # L1 storage, tracking and the FLUX engine pieces
    ("store", "tracking", "prompts", "flux", "rollout", "objectives", "chunks", "dynamics"),
    # L2 synthetic models, tokenizers and scorers (tests and the wiring demo only)
    ("testing",),
    # L3 scorers and rewards, shared by training and evaluation
    ("scoring",),
    # L4 the two stages' engines (neither imports the other)
    ("train", "eval"),
    # L5 platform integration and the toy world
    ("k8s", "registry", "served_model", "served_model_entry", "promoter", "toy", "capacity", "model_cache",
     "services", "mlflow_db", "seaweedfs", "processes", "torchrun", "torchrun_local"),
    # L6 checks that span stages
    ("preflight", "preflight_image"),
    # L7 the pipeline's steps as plain functions (components and commands call them)
    ("stages",),
    # L8 the command line
    ("commands", "cli"),
]
# Units of one layer that must not import each other (the two stages share only what lies below them).
SEPARATE: list[set[str]] = [{"train", "eval"}]
# Who may import the fixtures and the toy world (besides themselves).
FIXTURE_USERS = {"testing": {"testing", "toy", "commands"}, "toy": {"toy", "commands", "stages"}}


@dataclass
class Graph:
    modules: dict[str, Path]
    edges: dict[str, set[str]] = field(default_factory=dict)
    external: dict[str, set[str]] = field(default_factory=dict)  # module -> top-level external packages


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _is_test(path: Path, root: Path) -> bool:
    rel = path.relative_to(root)
    return "tests" in rel.parts[:-1] or rel.name == "conftest.py" or rel.name.startswith("test_")


def build_graph(root: Path, packages: str | tuple[str, ...] = PACKAGES) -> Graph:
    """Parse every module of ``root/<package>`` (tests left out) for each of ``packages`` and collect its
    imports of modules of those packages: one graph."""
    packages = (packages,) if isinstance(packages, str) else tuple(packages)
    files = [p for package in packages for p in sorted((root / package).rglob("*.py"))]
    modules = {_module_name(p, root): p for p in files if not _is_test(p, root)}
    graph = Graph(modules)

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    for mod, path in modules.items():
        is_pkg = path.name == "__init__.py"
        targets: set[str] = set()
        external: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    stem = ".".join(base + ([node.module] if node.module else []))
                else:
                    stem = node.module or ""
                names = [stem] + [f"{stem}.{a.name}" for a in node.names]
            else:
                continue
            for name in names:
                if name.split(".")[0] in packages:
                    target = resolve(name)
                    if target and target != mod:
                        targets.add(target)
                elif name:
                    external.add(name.split(".")[0])
        graph.edges[mod] = targets
        graph.external[mod] = external
    return graph


def unit_of(module: str, package: str = PACKAGE) -> str:
    """``chunkgrpo.eval.runner`` -> ``eval``; ``chunkgrpo`` -> ``""``."""
    rest = module[len(package):].lstrip(".")
    return rest.split(".")[0]


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]
    sys.setrecursionlimit(max(10_000, sys.getrecursionlimit()))

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(found)


def _top(module: str) -> str:
    return module.split(".")[0]


def violations(graph: Graph, layers=LAYERS, package: str = PACKAGE, fixture_users=FIXTURE_USERS,
               separate=SEPARATE, packages: tuple[str, ...] = PACKAGES) -> list[str]:
    """Every broken rule, one line each (empty: the graph is layered). The layers apply to ``package``;
    the order of ``packages`` and the circles to the whole graph."""
    layer = {name: i for i, names in enumerate(layers) for name in names}
    level = {name: i for i, name in enumerate(packages)}
    out = []
    for mod in sorted(graph.modules):
        if _top(mod) == package and unit_of(mod, package) not in layer and not mod.endswith("__main__"):
            out.append(f"{mod}: not in any layer (add {unit_of(mod, package)!r} to LAYERS)")
    for mod, targets in sorted(graph.edges.items()):
        if _top(mod) == package and "kfp" in graph.external.get(mod, ()):
            out.append(f"{mod}: imports kfp")
        for target in sorted(targets):
            if level.get(_top(target), 0) > level.get(_top(mod), 0):
                out.append(f"{mod} -> {target}: {_top(mod)} imports {_top(target)}, which stands above it")
        if mod.rsplit(".", 1)[-1] == "__main__" or _top(mod) != package:
            continue
        src = unit_of(mod, package)
        for target in sorted(targets):
            if _top(target) != package:
                continue
            dst = unit_of(target, package)
            if src in layer and dst in layer and layer[dst] > layer[src]:
                out.append(f"{mod} -> {target}: upward (L{layer[src]} {src or package} imports "
                           f"L{layer[dst]} {dst})")
            if src != dst and any({src, dst} <= group for group in separate):
                out.append(f"{mod} -> {target}: {src} and {dst} must not import each other")
            if dst in fixture_users and src not in fixture_users[dst]:
                out.append(f"{mod} -> {target}: production code imports {package}.{dst}")
    for component in circles(graph.edges):
        out.append("circle: " + " -> ".join(component))
    return out


def oversized(graph: Graph, limit: int = MAX_LINES) -> list[str]:
    out = []
    for mod, path in sorted(graph.modules.items()):
        text = path.read_text(encoding="utf-8")
        lines = text.count("\n")
        doc = ast.get_docstring(ast.parse(text)) or ""
        if lines > limit and "Size note:" not in doc:
            out.append(f"{mod}: {lines} lines and no 'Size note:' in its docstring")
    return out


# --- the project ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def project() -> Graph:
    return build_graph(ROOT)


def test_layers_point_down_without_circles(project):
    assert violations(project) == []


def test_large_modules_state_why(project):
    assert oversized(project) == []


def python_files_over(root: Path, limit: int = HARD_MAX_LINES) -> list[str]:
    """Python files under `root` (hidden folders and installed environments left out) over `limit` lines."""
    out = []
    for folder, dirs, files in os.walk(root):
        skip = ("node_modules", "__pycache__")
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in skip)
        for name in sorted(f for f in files if f.endswith(".py")):
            path = Path(folder) / name
            lines = path.read_text(encoding="utf-8").count("\n")
            if lines > limit:
                out.append(f"{path.relative_to(root)}: {lines} lines")
    return out


def test_no_python_file_of_the_repository_is_over_the_hard_limit():
    assert python_files_over(ROOT) == []


def test_the_hard_limit_finds_a_long_test_file_and_skips_hidden_folders(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_long.py").write_text("x = 1\n" * 651)
    (tmp_path / "tests" / "test_ok.py").write_text("x = 1\n" * 650)
    (tmp_path / ".venv").mkdir()
    (tmp_path / ".venv" / "big.py").write_text("x = 1\n" * 5000)
    assert python_files_over(tmp_path) == ["tests/test_long.py: 651 lines"]


def test_the_graph_holds_the_three_packages_without_their_tests(project):
    tops = {_top(m) for m in project.modules}
    assert tops == set(PACKAGES)
    assert "pipeline.local_run" in project.modules and "components.train.component" in project.modules
    assert not [m for m in project.modules if ".tests" in m or m.endswith("conftest")]


def test_every_layer_name_exists(project):
    units = {unit_of(m) for m in project.modules if _top(m) == PACKAGE}
    stale = [name for names in LAYERS for name in names if name not in units]
    assert stale == [], f"LAYERS names modules that no longer exist: {stale}"


# --- the checker itself -----------------------------------------------------------------------------

def _package(tmp_path: Path, files: dict[str, str], packages: tuple[str, ...] = ("pkg",)) -> Graph:
    """Files by path under ``tmp_path/pkg`` (or, for several packages, under ``tmp_path``)."""
    for rel, text in files.items():
        p = tmp_path / (rel if len(packages) > 1 else f"pkg/{rel}")
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return build_graph(tmp_path, packages)


LAYERS_T = [("", "base"), ("mid",), ("top", "toy")]
USERS_T = {"toy": {"toy", "top"}}


def test_checker_finds_an_upward_lazy_import(tmp_path):
    g = _package(tmp_path, {"__init__.py": "", "base.py": "def f():\n    from pkg.mid import x\n",
                            "mid.py": "x = 1\n", "top.py": "from pkg import base\n", "toy.py": ""})
    found = violations(g, LAYERS_T, "pkg", USERS_T, packages=("pkg",))
    assert any("pkg.base -> pkg.mid: upward" in v for v in found), found


def test_checker_keeps_separate_siblings_apart(tmp_path):
    g = _package(tmp_path, {"__init__.py": "", "base.py": "", "mid.py": "", "top.py": "",
                            "toy.py": "def f():\n    from pkg import top\n"})
    assert violations(g, LAYERS_T, "pkg", {}, [{"top", "toy"}], ("pkg",)) == [
        "pkg.toy -> pkg.top: toy and top must not import each other"]
    assert violations(g, LAYERS_T, "pkg", {}, [], ("pkg",)) == []


def test_checker_finds_a_circle_within_a_layer(tmp_path):
    g = _package(tmp_path, {"__init__.py": "", "base.py": "", "mid/__init__.py": "",
                            "mid/a.py": "from . import b\n", "mid/b.py": "from pkg.mid.a import y\n",
                            "top.py": "", "toy.py": ""})
    assert violations(g, LAYERS_T, "pkg", USERS_T, [], ("pkg",)) == ["circle: pkg.mid.a -> pkg.mid.b"]


def test_checker_finds_fixture_use_kfp_and_unplaced_modules(tmp_path):
    g = _package(tmp_path, {"__init__.py": "", "base.py": "", "mid.py": "import kfp.dsl\n",
                            "top.py": "from pkg.toy import z\n", "toy.py": "z = 1\n", "extra.py": "",
                            "__main__.py": "from pkg.top import main\n"})
    found = violations(g, [("", "base"), ("mid", "toy"), ("top",)], "pkg", {"toy": {"toy"}}, [], ("pkg",))
    assert "pkg.mid: imports kfp" in found
    assert "pkg.top -> pkg.toy: production code imports pkg.toy" in found
    assert any(v.startswith("pkg.extra: not in any layer") for v in found)
    assert not any(v.startswith("pkg.__main__ ->") for v in found)  # entry points are exempt


def test_checker_requires_a_size_note(tmp_path):
    g = _package(tmp_path, {"__init__.py": "", "big.py": '"""Big."""\n' + "x = 1\n" * 20,
                            "noted.py": '"""Big.\n\nSize note: one table.\n"""\n' + "x = 1\n" * 20})
    assert oversized(g, limit=10) == ["pkg.big: 21 lines and no 'Size note:' in its docstring"]


PACKAGES_T = ("pkg", "comp", "pipe")


def test_checker_spans_the_packages_finds_a_circle_through_them_and_an_upward_package(tmp_path):
    g = _package(tmp_path, {
        "pkg/__init__.py": "", "pkg/base.py": "def f():\n    from comp import step\n",
        "comp/__init__.py": "", "comp/step.py": "from pkg import base\nimport kfp\n",
        "comp/tests/test_step.py": "from pipe import run\n", "comp/conftest.py": "import pipe.run\n",
        "pipe/__init__.py": "", "pipe/run.py": "from comp.step import x\nfrom pkg.base import f\n",
    }, PACKAGES_T)
    assert sorted(g.modules) == ["comp", "comp.step", "pipe", "pipe.run", "pkg", "pkg.base"]  # no tests
    assert g.edges["pipe.run"] == {"comp.step", "pkg.base"}
    found = violations(g, [("", "base")], "pkg", {}, [], PACKAGES_T)
    assert found == ["pkg.base -> comp: pkg imports comp, which stands above it",
                     "pkg.base -> comp.step: pkg imports comp, which stands above it",
                     "circle: comp.step -> pkg.base"], found  # kfp is allowed outside the library


def test_checker_size_rule_covers_every_package(tmp_path):
    noted = '"""Size note: one table."""\n' + "x = 1\n" * 20
    g = _package(tmp_path, {"pkg/__init__.py": "", "comp/__init__.py": "", "comp/big.py": "x = 1\n" * 20,
                            "pipe/__init__.py": "", "pipe/noted.py": noted,
                            "comp/tests/test_big.py": "x = 1\n" * 20}, PACKAGES_T)
    assert oversized(g, limit=10) == ["comp.big: 20 lines and no 'Size note:' in its docstring"]
