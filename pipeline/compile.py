"""Compile the pipelines to KFP IR YAML, adding what the 2.17.0 SDK cannot express.

`typing.Literal` parameters: the KFP 2.17 UI renders parameters whose IR spec lists `literals` as
dropdowns (KEP-11385; `ParameterSpec.literals` exists since kfp-pipeline-spec 2.16), but the 2.17.0
SDK rejects `Literal[...]` annotations. Pipelines therefore declare `str` parameters plus a
`LITERALS = {param: choices}` table, and `compile_pipeline` writes the choices into the IR -- only
for a KFP backend >= 2.16 (`--target-kfp`): an older API server rejects the unknown field, so for
2.15 the IR is compiled without them.

The oldest backend is **2.15**: kfp-kubernetes 2.17 writes `optional:` on every `secretAsEnv` /
`configMapAsEnv` (the MLflow and judge Secrets are optional), a field KFP 2.14's
`kubernetes_executor_config.proto` lacks (added in 2.15.0), and the 2.14 API server unmarshals the
platform spec strictly. Leaving the field out for 2.14 would turn the optional Secrets into required
ones (pods stuck in CreateContainerConfigError on an auth-less MLflow), so 2.14 is not a target.
tests/pipeline/test_kfp_versions.py parses the pipeline AND platform spec of every compiled variant
with the vendored protos of every supported backend (tests/fixtures/kfp/<version>/).

    python -m pipeline.compile --pool h100 --out dist/pipelines [--target-kfp 2.15]
        # or: chunkgrpo pipeline compile
"""

import argparse
import sys
from pathlib import Path

import yaml

PIPELINES = ("train_and_evaluate", "nightly_benchmark", "models_sync")
# KFP backends the IR is compiled for. `literals` (UI dropdowns) exist in kfp-pipeline-spec >= 2.16
# (rendered as dropdowns by the 2.17 frontend); older API servers reject the unknown field, so they are
# left out for --target-kfp 2.15. 2.14 lacks SecretAsEnv/ConfigMapAsEnv `optional` (see above).
KFP_TARGETS = ("2.15", "2.16", "2.17")
OLDEST_KFP = KFP_TARGETS[0]
LITERALS_SINCE = "2.16"


def _version(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split("."))


def pipeline_func(name: str, pool: str = "cpu", trainer: str = "torchrun"):
    """(pipeline function, literals) for a pipeline name and compile-time variant."""
    if name == "train_and_evaluate":
        from pipeline import train_and_evaluate as m

        return m.make_train_and_evaluate(pool=pool, trainer=trainer), m.LITERALS
    if name == "nightly_benchmark":
        from pipeline import nightly_benchmark as m

        return m.make_nightly_benchmark(pool=pool), m.LITERALS
    if name == "models_sync":
        from pipeline import models_sync as m

        return m.make_models_sync(pool=pool), m.LITERALS
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


def compile_pipeline(name: str, package_path: str | Path, *, pool: str = "cpu", trainer: str = "torchrun",
                     target_kfp: str = KFP_TARGETS[-1]) -> Path:
    """Compile `name` to IR YAML for a KFP backend >= `target_kfp` (dropdown literals only from 2.16)."""
    from kfp import compiler

    if target_kfp not in KFP_TARGETS:
        raise ValueError(
            f"target_kfp={target_kfp!r} must be one of {KFP_TARGETS} (KFP 2.14 and older reject the "
            "platform spec's `optional` secrets; upgrade the backend)"
        )
    func, literals = pipeline_func(name, pool, trainer)
    path = Path(package_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    compiler.Compiler().compile(func, str(path))
    if _version(target_kfp) >= _version(LITERALS_SINCE):
        add_literals(path, literals)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="dist/pipelines")
    ap.add_argument("--pool", required=True)
    ap.add_argument("--trainer", default="torchrun")
    ap.add_argument("--target-kfp", default=KFP_TARGETS[-1], choices=KFP_TARGETS)
    args = ap.parse_args(argv)
    for name in PIPELINES:
        print(compile_pipeline(name, Path(args.out) / f"{name}.yaml", pool=args.pool, trainer=args.trainer,
                               target_kfp=args.target_kfp))
    return 0


if __name__ == "__main__":
    sys.exit(main())
