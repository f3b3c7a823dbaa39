"""The `pipeline` package's modules import each other without a circle (each one can be read, and
imported, after the ones it names), and none is longer than MAX_LINES."""

import ast
from pathlib import Path

PIPELINE = Path(__file__).resolve().parents[2] / "pipeline"
MAX_LINES = 600


def _imports(path: Path) -> set[str]:
    """The `pipeline.X` modules `path` imports anywhere (top level or inside a function)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module.startswith("pipeline."):
                found.add(node.module.split(".")[1])
            elif node.module == "pipeline":
                found.update(a.name for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("pipeline."))
    return found


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import circle of `graph` (module -> modules it imports), or []."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(m: str, path: list[str]) -> list[str]:
        state[m] = 1
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return path[path.index(n):] + [n] if n in path else [m, n]
            if n in graph and not state.get(n):
                found = visit(n, [*path, n])
                if found:
                    return found
        state[m] = 2
        return []

    for m in sorted(graph):
        if not state.get(m):
            found = visit(m, [m])
            if found:
                return found
    return []


def test_the_cycle_finder_finds_a_circle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []


def test_no_import_circle_among_the_pipeline_modules():
    graph = {p.stem: _imports(p) - {p.stem} for p in PIPELINE.glob("*.py") if p.stem != "__init__"}
    assert "local_run" in graph and {"demos", "kfp_tasks", "task_log", "summary"} <= graph["local_run"]
    assert _cycle(graph) == [], " -> ".join(_cycle(graph))


def test_no_pipeline_module_is_longer_than_the_limit():
    long = {p.name: n for p in PIPELINE.glob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}
