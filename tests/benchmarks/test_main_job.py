"""benchmarks/main_job.py: it reads the breakdown `pipeline run --local` prints (summary.stage_lines and the
held-out accuracies of summary_lines), and bad arguments exit 2 naming the value."""

import pytest

from tests import benchmark_scripts


@pytest.fixture(scope="module")
def main_job():
    return benchmark_scripts.load("main_job")


def test_the_breakdown_the_command_prints_is_read_back(main_job):
    from pipeline.summary import stage_lines

    stages = {"services": 8.4, "model": 0.3, "pipeline": 79.8, "task preflight": 9.8, "task open-run": 0.5,
              "task check-gate": 0.6, "total": 89.7}
    text = "\n".join([*stage_lines(stages),
                      "    metrics        geneval.colors.base=0.2812, geneval.overall.base=0.1606, "
                      "geneval.overall.trained=0.316"])
    got = main_job.breakdown(text)
    assert got == {**stages, "geneval.overall.base": 0.1606, "geneval.overall.trained": 0.316}


@pytest.mark.parametrize("args, word", [(["--modes", "hot"], "'hot'"), (["--runs", "0"], "--runs 0")])
def test_bad_arguments_exit_2_naming_the_value(main_job, capsys, args, word):
    with pytest.raises(SystemExit) as e:
        main_job.main(args)
    assert e.value.code == 2 and word in capsys.readouterr().err
