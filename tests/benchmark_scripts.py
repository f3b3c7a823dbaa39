"""Load a script of `benchmarks/` (a folder of scripts, not a package) as a module, for its tests."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load(name: str):
    """benchmarks/<name>.py as the module `<name>_benchmark`."""
    spec = importlib.util.spec_from_file_location(f"{name}_benchmark", ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
