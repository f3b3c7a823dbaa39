"""A failed pipeline task is reported as one line (task, reason, full log) with exit 2 for user errors and
1 for internal failures; under torchrun the reason is printed once, by rank 0."""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from chunkgrpo import errors
from pipeline.task_log import TaskFailed, task_failure

LOG = Path("/tmp/x.log")


def _section(task: str, body: str, status: str = "FAILURE") -> str:
    """What kfp.local writes for one task (ANSI colours included), body lines indented like its task
    output."""
    lines = "\n".join("    " + ln for ln in body.strip("\n").splitlines())
    return (
        f"11:00:00.000 - INFO - Executing task \x1b[96m'{task}'\x1b[0m\n"
        "11:00:00.001 - INFO - Streamed logs:\n\n"
        f"{lines}\n\n11:00:05.000 - ERROR - Task \x1b[96m'{task}'\x1b[0m finished with status "
        f"\x1b[91m{status}\x1b[0m\n"
    )


OK_TASK = _section("open-run", "opened run abc", status="SUCCESS")
TRACEBACK = """Traceback (most recent call last):
  File "/x/executor_main.py", line 109, in <module>
    executor_main()
  File "/x/component.py", line 12, in evaluate
    raise UserError(f"...")
"""


def test_user_error_of_a_component_is_the_reason():
    log = OK_TASK + _section(
        "evaluate", TRACEBACK + "chunkgrpo.errors.UserError: HPDv2 test prompts '/p.txt' does not exist"
    )
    f = task_failure(log, "train_and_evaluate", LOG)
    assert (f.task, f.user_error) == ("evaluate", True)
    assert f.reason == "HPDv2 test prompts '/p.txt' does not exist"
    assert str(f) == (
        "task 'evaluate' of train_and_evaluate failed: HPDv2 test prompts '/p.txt' does not exist "
        f"(full log: {LOG})"
    )
    assert "\n" not in str(f)


def test_rank_error_wins_over_torchruns_traceback():
    body = (
        "chunkgrpo train: error: max_steps=0 must be >= 1\n"
        + TRACEBACK.replace("raise UserError", "raise ChildFailedError")
        + "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
        "=====\nchunkgrpo.train FAILED\n"
        + TRACEBACK
        + "RuntimeError: torchrun exited with status 1 (see the rank logs above)"
    )
    f = task_failure(OK_TASK + _section("train", body) + _section("close-run", "closed", "SUCCESS"), "p", LOG)
    assert (f.task, f.reason, f.user_error) == ("train", "max_steps=0 must be >= 1", True)


def test_internal_failure_reports_the_last_exception_line():
    body = "loading...\n" + TRACEBACK + "KeyError: 'chunk_sizes'"
    f = task_failure(OK_TASK + _section("register", body), "p", LOG)
    assert (f.task, f.reason, f.user_error) == ("register", "KeyError: 'chunk_sizes'", False)
    # the first failed task is the cause; the exit handler failing afterwards is not
    later = _section("close-run", TRACEBACK + "ConnectionError: refused")
    assert task_failure(OK_TASK + _section("register", body) + later, "p", LOG).task == "register"
    # no traceback at all: still one line, naming the task
    f = task_failure(_section("plan", "Killed"), "p", LOG)
    assert (f.task, f.user_error) == ("plan", False) and f.reason


def test_cli_maps_user_errors_to_2_and_internal_failures_to_1(monkeypatch, capsys):
    import pipeline.cli as cli
    import pipeline.local_run as local_run

    for user_error, rc in ((True, 2), (False, 1)):
        def fail(*a, user_error=user_error, **kw):
            raise TaskFailed("train_and_evaluate", "evaluate", "the reason", user_error, LOG)

        monkeypatch.setattr(local_run, "run_local", fail)
        args = argparse.Namespace(
            action="run",
            local=True,
            param=[],
            pipeline="train_and_evaluate",
            home="h",
            keep_services=False,
            s3_port=1,
            mlflow_port=2,
            verbose=False,
            registry=None,
            tag=None,
            demo="tiny",
        )
        assert cli.run(args) == rc
        err = capsys.readouterr().err
        assert err.splitlines() == [
            f"chunkgrpo pipeline: error: task 'evaluate' of train_and_evaluate failed: "
            f"the reason (full log: {LOG})"
        ]


def test_other_ranks_wait_then_report_with_their_rank(monkeypatch):
    monkeypatch.setattr(errors, "OTHER_RANK_REPORT_DELAY_S", 0.01)
    out = io.StringIO()
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    errors.print_user_error("chunkgrpo train: error: x", out)
    for k, v in {"LOCAL_RANK": "1", "RANK": "5", "WORLD_SIZE": "8"}.items():
        monkeypatch.setenv(k, v)
    errors.print_user_error("chunkgrpo train: error: y", out)  # only this rank failed: still reported
    assert out.getvalue().splitlines() == ["chunkgrpo train: error: x", "chunkgrpo train: error: y [rank 5]"]


# ---- real processes -----------------------------------------------------------------------------


def _env():
    return {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}


@pytest.mark.integration
def test_torchrun_user_error_is_printed_once_by_rank_0(tiny_model_dir, tmp_path):
    from chunkgrpo.processes import free_port

    prompts = tmp_path / "p.txt"
    prompts.write_text("a cat\na dog\n")
    torchrun = str(Path(sys.executable).parent / "torchrun")
    r = subprocess.run(
        [
            torchrun,
            "--nproc_per_node=2",
            f"--log-dir={tmp_path / 'torchrun'}",  # else torchrun leaves a torchelastic_* folder in $TMPDIR
            "--master_addr=127.0.0.1",
            f"--master_port={free_port()}",
            "-m",
            "chunkgrpo.train",
            "--config",
            "tiny_cpu",
            f"model={tiny_model_dir}",
            f"prompts={prompts}",
            f"output_dir={tmp_path / 'out'}",
            "max_iterations=-1",
        ],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=600,
    )
    assert r.returncode != 0
    mine = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.startswith("chunkgrpo train: error:")]
    assert len(mine) == 1 and "max_iterations" in mine[0] and "-1" in mine[0] and "[rank" not in mine[0], (
        r.stderr[-3000:]
    )
    assert not (tmp_path / "out" / "final").exists()


@pytest.mark.integration
def test_torchrun_failure_in_a_task_becomes_the_tasks_user_error(tiny_model_dir, tmp_path):
    from chunkgrpo.errors import UserError
    from chunkgrpo.processes import free_port
    from chunkgrpo.torchrun import run_torchrun

    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--log-dir={tmp_path / 'torchrun'}",  # else torchrun leaves a torchelastic_* folder in $TMPDIR
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        "-m",
        "chunkgrpo.train",
        "--config",
        "tiny_cpu",
        f"model={tiny_model_dir}",
        f"prompts={tmp_path / 'missing.txt'}",
        f"output_dir={tmp_path / 'out'}",
    ]
    out = io.StringIO()
    with pytest.raises(UserError, match="missing.txt"):
        run_torchrun(cmd, env=_env(), out=out)
    assert "ChildFailedError" in out.getvalue()  # torchrun's own report stays in the log


@pytest.mark.integration
def test_pipeline_run_with_a_bad_parameter_is_one_line_exit_2(tmp_path):
    """The CLI end to end with its own services: `max_iterations=-1` fails the preflight (the training config
    as the train step would load it), in one line, before anything is profiled or trained. (A user error
    inside torchrun, printed by rank 0 only: the two tests above.)"""
    from chunkgrpo.processes import free_ports

    s3, mlflow = free_ports(2)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "chunkgrpo",
            "pipeline",
            "run",
            "--local",
            "--home",
            str(tmp_path / "h"),
            "--s3-port",
            str(s3),
            "--mlflow-port",
            str(mlflow),
            "--demo",
            "tiny",
            "-p",
            "max_iterations=-1",
        ],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=tmp_path,
        timeout=900,
    )
    assert r.returncode == 2, (r.stdout[-3000:], r.stderr[-3000:])
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("chunkgrpo")]
    assert len(lines) == 1, r.stderr
    assert (
        "task 'preflight'" in lines[0]
        and "max_iterations must be >= 0" in lines[0]
        and "max_iterations=-1" in lines[0]
    ), lines
    log = Path(tmp_path / lines[0].rsplit("full log: ", 1)[1].rstrip(")"))
    assert "max_iterations=-1" in log.read_text()  # the details are kept in the log
    assert "  preflight: failure" in r.stdout  # one progress line per task; no later task started
    assert "  profile:" not in r.stdout and "  train:" not in r.stdout, r.stdout


@pytest.mark.integration
def test_missing_prompts_file_fails_the_preflight(services, tmp_path):
    from pipeline.local_run import run_local

    with pytest.raises(TaskFailed) as e:
        run_local("train_and_evaluate", {"prompts": str(tmp_path / "no-such-prompts.txt"), "model_name": "x"},
                  home=tmp_path, services_env=services.env, demo="tiny")
    f = e.value
    # the preflight (first task, seconds, before any GPU) names it; no later task starts
    assert (
        f.task == "preflight"
        and f.user_error
        and "no-such-prompts.txt" in f.reason
        and "does not exist" in f.reason
    )
    assert f.log_path.exists() and f.log_path.parent == tmp_path / "logs"


def test_bad_parameter_names_and_types_fail_before_anything_starts(tmp_path):
    from chunkgrpo.errors import UserError
    from pipeline.local_run import run_local

    for params, match in (({"max_stepz": 3}, "unknown pipeline parameter 'max_stepz'"),
                          ({"max_iterations": "abc"}, r"-p max_iterations='abc': expected integer, got str"),
                          ({"max_iterations": True}, "expected integer, got bool"),
                          ({"gate_margin": "x"}, "expected float"),
                          ({"method": "ppo"}, r"-p method='ppo' is not one of \['chunk'")):
        with pytest.raises(UserError, match=match):
            run_local("train_and_evaluate", params, home=tmp_path / "h", s3_port=1, mlflow_port=1)
    assert not (tmp_path / "h").exists()  # no services, no model, no folders
