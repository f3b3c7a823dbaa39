"""kfp's task setters without `inspect.stack()` (a pytest plugin, loaded by tests/conftest.py and
components/conftest.py).

Every `.set_cpu_request()`, `.set_accelerator_type()`, ... on a pipeline task calls
`PipelineTask._ensure_container_spec_exists`, which takes `inspect.stack()` only to name its caller in an
error message. `inspect.stack()` reads a source line for every frame and scans `sys.modules` for each, so
its cost grows with the stack depth and the modules loaded: in a test process (pytest's frames, torch,
diffusers, mlflow) compiling one pipeline spent most of its time there. The replacement names the caller
from its frame, raises the same error for the same tasks and touches nothing else. It is applied when kfp
is imported (an import hook), so a test session that never compiles a pipeline never imports kfp for it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

MODULE = "kfp.dsl.pipeline_task"


def _ensure_container_spec_exists(self) -> None:
    """Ensures that the task has a container spec (kfp's check, naming the caller from its frame)."""
    if self.container_spec is None:
        caller_method_name = sys._getframe(1).f_code.co_name
        raise ValueError(f"{caller_method_name} can only be used on single-step components, not pipelines "
                         f"used as components, or special components like importers.")


def patch(module) -> None:
    module.PipelineTask._ensure_container_spec_exists = _ensure_container_spec_exists


class _Loader(importlib.abc.Loader):
    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


def pytest_configure(config):
    if MODULE in sys.modules:
        patch(sys.modules[MODULE])
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
