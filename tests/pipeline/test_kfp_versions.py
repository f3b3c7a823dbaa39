"""KFP version truth: every package `chunkgrpo pipeline compile` can write parses -- pipeline spec AND
platform spec, executor by executor -- with the protos of every KFP backend it claims to load on
(tests/kfp_protos.py, vendored in tests/fixtures/kfp/<version>/), and 2.14 is shown to reject it."""

import itertools

import pytest

from pipeline.compile import KFP_TARGETS, LITERALS_SINCE, OLDEST_KFP, compile_pipeline
from tests.kfp_protos import FIXTURES, parse_pipeline_spec, parse_platform_spec
from tests.pipeline.compiled import COMPILE_OPTIONS, compiled

# The proto release each supported backend line is checked against (its .0: the oldest of the line).
BACKEND_PROTOS = {"2.15": "2.15.0", "2.16": "2.16.0", "2.17": "2.17.0"}
UNSUPPORTED = "2.14.6"  # the newest 2.14 patch release: still no SecretAsEnv/ConfigMapAsEnv `optional`
# Every variant the CLI compiles: the three pipelines, and train_and_evaluate with each trainer.
VARIANTS = [("train_and_evaluate", "torchrun"), ("train_and_evaluate", "trainjob"),
            ("train_and_evaluate", "pytorchjob"), ("nightly_benchmark", "torchrun"),
            ("models_sync", "torchrun")]


def _v(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split("."))


def _compile(name, trainer, target):
    return compiled(name, pool="h800", trainer=trainer, target_kfp=target)


def test_every_target_has_vendored_protos():
    assert tuple(BACKEND_PROTOS) == KFP_TARGETS and OLDEST_KFP == "2.15"
    for version in [*BACKEND_PROTOS.values(), UNSUPPORTED]:
        assert (FIXTURES / version / f"kfp-{version}.desc").is_file(), version
        assert (FIXTURES / version / "PROVENANCE.md").is_file(), version


@pytest.mark.parametrize("name,trainer", VARIANTS)
@pytest.mark.parametrize("target", KFP_TARGETS)
def test_compiled_package_parses_on_every_backend_it_targets(monkeypatch, name, trainer, target):
    for k, v in COMPILE_OPTIONS.items():
        monkeypatch.setenv(k, v)
    spec, platform = _compile(name, trainer, target)
    executors = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    assert executors and all(e.get("secretAsEnv") for e in executors.values())
    assert target in BACKEND_PROTOS, f"--target-kfp {target} has no vendored protos to prove it loads there"
    for backend, protos in BACKEND_PROTOS.items():
        if _v(backend) < _v(target):
            continue
        parse_pipeline_spec(spec, protos)
        assert parse_platform_spec(platform, protos) == {}, (name, trainer, target, backend)


def test_literals_only_for_backends_that_know_them(monkeypatch):
    from google.protobuf import json_format

    for k, v in COMPILE_OPTIONS.items():  # the package the backend test parses (compiled once)
        monkeypatch.setenv(k, v)
    spec, _ = _compile("train_and_evaluate", "torchrun", "2.17")
    assert any("literals" in p for p in spec["root"]["inputDefinitions"]["parameters"].values())
    older = [b for b in BACKEND_PROTOS if _v(b) < _v(LITERALS_SINCE)]
    assert older == ["2.15"]
    with pytest.raises(json_format.ParseError, match="literals"):
        parse_pipeline_spec(spec, BACKEND_PROTOS["2.15"])


def test_kfp_2_14_rejects_the_platform_spec_so_it_is_not_a_target(tmp_path):
    """The reason 2.14 was dropped, kept as a test: the 2.14 protos fail on every executor (each one
    carries an optional Secret), on the `optional` field, while the pipeline spec alone would parse."""
    spec, platform = _compile("train_and_evaluate", "torchrun", OLDEST_KFP)
    parse_pipeline_spec(spec, UNSUPPORTED)  # the old test only looked at this half
    errors = parse_platform_spec(platform, UNSUPPORTED)
    executors = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    assert set(errors) == set(executors) and len(errors) >= 10
    assert all("optional" in e for e in errors.values()), errors
    with pytest.raises(ValueError, match="2.14"):
        compile_pipeline("train_and_evaluate", tmp_path / "x.yaml", pool="h800", target_kfp="2.14")


def test_cli_offers_only_supported_targets():
    import argparse

    from pipeline import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    for action, flag in itertools.product(("compile", "upload"), ("2.14", "2.13")):
        with pytest.raises(SystemExit) as e:
            parser.parse_args([action, "--pool", "h800", "--target-kfp", flag])
        assert e.value.code == 2
    assert parser.parse_args(["compile", "--pool", "h800", "--target-kfp", "2.15"]).target_kfp == "2.15"
