"""What a user reads from the CLI: help keeps its paragraphs and example blocks, the top-level description
is whole, --help-config shows the preset's own config class and values, a misspelt preset or reward gets a
"did you mean", a preset of the other stage names the command it is for, and a bad `chunks` spec fails in
preflight."""

import pytest

from chunkgrpo.cli import main
from chunkgrpo.errors import UserError


def _help(capsys, argv):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0
    return capsys.readouterr().out


def test_top_level_description_is_whole_sentences(capsys):
    out = _help(capsys, ["--help"])
    assert "Fine-tune flow-matching text-to-image models" in out
    assert "Kubeflow pipelines." in out  # the description's last sentence, not a cut first line
    assert "defining\n" not in out and "commands/" not in out  # no developer docstring fragment
    assert "\n  chunkgrpo train --config tiny_cpu model=models/tiny-flux" in out  # an example block


def test_command_help_keeps_line_breaks_and_examples(capsys):
    out = _help(capsys, ["train", "--help"])
    # each example line stays on its own line, indented as written (not reflowed into one paragraph)
    assert "\nExamples:\n  chunkgrpo train --config tiny_cpu model=DIR prompts=prompts.txt\n" in out
    out = _help(capsys, ["local", "--help"])
    assert "\n    chunkgrpo local up " in out and "\n    chunkgrpo local down " in out


def test_subcommand_parsers_keep_line_breaks_too(capsys):
    from chunkgrpo.cli import HelpFormatter, _all_parsers, build_parser

    out = _help(capsys, ["models", "--help"])
    assert "\n    chunkgrpo models sync black-forest-labs/FLUX.1-dev [--download]" in out
    parsers = list(_all_parsers(build_parser()))
    assert any(p.prog == "chunkgrpo pipeline run" for p in parsers)  # sub-subcommands are reached
    assert all(p.formatter_class is HelpFormatter for p in parsers)


def test_help_config_honours_the_preset(capsys):
    assert main(["train", "--config", "tiny_cpu", "--help-config", "lr=0.5"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("TrainConfig options, with the values of tiny_cpu:")
    assert "  lr = 0.5   (default: 1e-05)" in out  # the override over the preset over the default
    assert "  sampling.num_steps = 8   (default: 17)" in out  # a nested field takes the preset's value


def test_help_config_of_a_preset_of_the_other_stage_shows_its_class(capsys):
    assert main(["train", "--config", "eval_toy", "--help-config"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("EvalConfig options, with the values of eval_toy (an evaluation preset: "
                          "chunkgrpo evaluate --config eval_toy):")
    assert "  scorer_device = " in out and "  lr = " not in out


def test_help_config_without_a_preset_lists_the_defaults(capsys):
    assert main(["evaluate", "--help-config"]) == 0
    out = capsys.readouterr().out
    assert "  num_prompts = " in out and "   (default: " not in out


@pytest.mark.parametrize("argv, line", [
    (["train", "--config", "eval_toy"],
     "chunkgrpo train: error: eval_toy is an evaluation preset (use chunkgrpo evaluate --config eval_toy)"),
    (["evaluate", "--config", "tiny_cpu"],
     "chunkgrpo evaluate: error: tiny_cpu is a training preset (use chunkgrpo train --config tiny_cpu)"),
])
def test_a_preset_of_the_other_stage_names_its_command(capsys, argv, line):
    assert main(argv) == 2
    assert capsys.readouterr().err.strip() == line


def test_misspelt_preset_gets_did_you_mean(capsys):
    assert main(["train", "--config", "tiny_cpuu", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "'tiny_cpuu' is neither a file nor a preset (did you mean 'tiny_cpu'?" in err


@pytest.mark.parametrize("argv, hint", [
    (["train", "--config", "tiny_cpu", "--dry-run", "rewards.0.name=contrst"],
     "unknown reward 'contrst' (did you mean 'contrast'?)"),
    (["evaluate", "--config", "eval_tiny", "scorers=[imagerewrd]"],
     "unknown scorer 'imagerewrd' (did you mean 'imagereward'?)"),
])
def test_misspelt_reward_or_scorer_gets_did_you_mean(capsys, argv, hint):
    assert main(argv) == 2
    assert hint in capsys.readouterr().err


def _preflight(chunks):
    from chunkgrpo.stages.preflight import preflight

    return preflight(model="", prompts="", preset="", method="chunk", train_overrides=[], reward_weights={},
                     scorer_weights={}, eval_preset="eval_tiny", eval_benchmarks=[], eval_overrides=[],
                     artifact_root="", pool="", capacity_out="unused.md", chunks=chunks)


@pytest.mark.parametrize("chunks, why", [("uniform:x", "unknown chunk strategy"),
                                         ("sizes:2,0,3", "chunk sizes must be >= 1"),
                                         ("dynamics:maxx=3", "dynamics option")])
def test_preflight_rejects_a_bad_chunks_spec(chunks, why):
    with pytest.raises(UserError, match=f"^preflight: chunks={chunks!r}: .*{why}"):
        _preflight(chunks)


def test_preflight_accepts_a_good_chunks_spec_and_goes_on(monkeypatch):
    from chunkgrpo import preflight as checks

    reached = []
    monkeypatch.setattr(checks, "require", lambda spec: reached.append(spec) or (_ for _ in ()).throw(
        UserError("stop after the chunks check")))
    with pytest.raises(UserError, match="stop after the chunks check"):
        _preflight("dynamics:max=5,last=0.5")
    assert reached  # the chunks check passed and the other checks ran


def test_pipeline_preflight_receives_the_chunks_parameter(tmp_path):
    import yaml

    from pipeline.compile import compile_pipeline

    spec, _ = yaml.safe_load_all(compile_pipeline("train_and_evaluate", tmp_path / "p.yaml").read_text())
    tasks = {}
    for comp in [spec["root"], *spec["components"].values()]:
        tasks.update((comp.get("dag") or {}).get("tasks") or {})
    params = [t["inputs"]["parameters"] for name, t in tasks.items() if name.startswith("preflight")]
    assert params and all(p["chunks"]["componentInputParameter"].endswith("chunks") for p in params)
