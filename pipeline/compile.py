"""Compile the pipelines to KFP IR YAML, adding what the 2.17.0 SDK cannot express.

`typing.Literal` parameters: the KFP 2.17 UI renders parameters whose IR spec lists `literals` as
dropdowns (KEP-11385; `ParameterSpec.literals` exists in kfp-pipeline-spec 2.17), but the 2.17.0
SDK rejects `Literal[...]` annotations. Pipelines therefore declare `str` parameters plus a
`LITERALS = {param: choices}` table, and `compile_pipeline` writes the choices into the IR.

    python -m pipeline.compile --out dist/pipelines            # or: chunkgrpo pipeline compile
"""

import argparse
import sys
from pathlib import Path

import yaml

PIPELINES = ("train_and_evaluate", "nightly_benchmark")


def pipeline_func(name: str, pool: str = "h100", trainer: str = "torchrun"):
    """(pipeline function, literals) for a pipeline name and compile-time variant."""
    if name == "train_and_evaluate":
        from pipeline import train_and_evaluate as m

        return m.make_train_and_evaluate(pool=pool, trainer=trainer), m.LITERALS
    if name == "nightly_benchmark":
        from pipeline import nightly_benchmark as m

        return m.make_nightly_benchmark(pool=pool), m.LITERALS
    raise ValueError(f"unknown pipeline {name!r}; choose from {PIPELINES}")


def add_literals(package_path: str | Path, literals: dict[str, tuple]) -> None:
    """Write `literals` (the allowed values) into the root input parameters of a compiled pipeline."""
    path = Path(package_path)
    original = path.read_text()
    docs = list(yaml.safe_load_all(original))
    params = docs[0]["root"]["inputDefinitions"]["parameters"]
    for name, choices in literals.items():
        if name not in params:
            continue
        default = params[name].get("defaultValue")
        if default is not None and default not in choices:
            raise ValueError(f"default {default!r} of {name!r} is not one of {list(choices)}")
        params[name]["literals"] = list(choices)
    header = []  # keep the compiler's "# PIPELINE DEFINITION" comment block
    for line in original.splitlines():
        if not line.startswith("#"):
            break
        header.append(line)
    path.write_text("\n".join(header) + ("\n" if header else "") + yaml.safe_dump_all(docs, sort_keys=True))


def check_literal(name: str, value, literals: dict[str, tuple]) -> None:
    if name in literals and value not in literals[name]:
        raise ValueError(f"{name}={value!r} is not one of {list(literals[name])}")


def compile_pipeline(name: str, package_path: str | Path, *, pool: str = "h100", trainer: str = "torchrun") -> Path:
    from kfp import compiler

    func, literals = pipeline_func(name, pool, trainer)
    path = Path(package_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    compiler.Compiler().compile(func, str(path))
    add_literals(path, literals)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="dist/pipelines")
    ap.add_argument("--pool", default="h100")
    ap.add_argument("--trainer", default="torchrun")
    args = ap.parse_args(argv)
    for name in PIPELINES:
        print(compile_pipeline(name, Path(args.out) / f"{name}.yaml", pool=args.pool, trainer=args.trainer))
    return 0


if __name__ == "__main__":
    sys.exit(main())
