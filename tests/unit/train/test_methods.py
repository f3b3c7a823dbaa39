"""One method interface: the trainer knows methods by a table; no method imports the trainer."""

import ast
from pathlib import Path

import chunkgrpo.train as train_pkg
from chunkgrpo.recipes import METHOD_NAMES
from chunkgrpo.train import branching, grpo
from chunkgrpo.train.methods import TABLE, get_method


def test_every_method_has_an_iteration_and_a_step_count():
    assert set(TABLE) == set(METHOD_NAMES)
    assert (
        get_method("chunk").iteration is grpo.iteration
        and get_method("granular").iteration is branching.iteration
    )


def test_methods_do_not_import_the_trainer():
    root = Path(train_pkg.__file__).parent
    for name in ("grpo.py", "branching.py", "context.py", "methods.py"):
        tree = ast.parse((root / name).read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | \
                   {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert "chunkgrpo.train.trainer" not in imported, name
