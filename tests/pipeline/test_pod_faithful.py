"""Pod-faithful local runs (pipeline/pod_faithful.py): the tiny demo under kfp.local with every task in
its pod's compiled env, fresh folders for its volumes and an audit of every write, against the real
local SeaweedFS + MLflow.

The claim: with the storage layout of components/k8s.py (/cache volume, TMPDIR and CHUNKGRPO_CACHE on
it) the demo passes the audit (README's main job runs pod-faithful: tests/pipeline/test_local_run.py
checks its audit, and that train and evaluate wrote to /cache within its limit); with the layout before
it (no /cache volume, HOME=/tmp, nothing else set: the model cache fell back to ~/.cache and the
components' outputs to /tmp) the same demo FAILS it, because the training outputs land in /tmp, whose
budget (the container layer, 10Gi scaled to the local model) they exceed.
"""

import os
import uuid

import pytest

pytestmark = pytest.mark.integration

PARAMS = {"max_iterations": 2, "profile_prompts": 2, "eval_num_prompts": 2}


def _run(services, home, **kw):
    from pipeline.local_run import run_local

    return run_local("train_and_evaluate", {**PARAMS, "model_name": f"pf-{uuid.uuid4().hex[:6]}"}, home=home,
                     services_env=services.env, demo="tiny", **kw)


def test_todays_tmp_layout_fails_the_pod_faithful_check(services, tmp_path, monkeypatch):
    """The layout before the /cache volume: GPU steps had no /cache volume and no cache/output env
    (HOME=/tmp from the image only). Compiling the pipeline that way and auditing it must fail the run,
    in one line naming /tmp and the bytes written there."""
    from components import k8s
    from pipeline.task_log import TaskFailed

    monkeypatch.setattr(k8s, "with_cache", lambda task, size: task)  # no /cache volume, no STEP_ENV
    with pytest.raises(TaskFailed) as e:
        _run(services, tmp_path / "legacy", pod_faithful=True)
    reason = e.value.reason
    assert "/tmp and $HOME" in reason and "bytes" in reason, reason
    assert e.value.task in {"train", "profile", "evaluate"}, e.value


def test_audit_flags_a_write_outside_the_volumes(tmp_path):
    """The audit hook in a real subprocess: a file written outside every allowed folder is reported with
    its path and size; one inside a volume is not."""
    import sys

    from pipeline.pod_faithful import Layout, PodSpec

    spec = PodSpec({"CHUNKGRPO_CACHE": "/cache/chunkgrpo"}, {"/cache": 2**30})
    limits = {"work": {"/cache": 2**30, "/tmp": 2**20}}
    lay = Layout(tmp_path / "pods", {"work": spec}, faithful=True, limits=limits)
    outside = tmp_path / "outside" / "big.bin"
    outside.parent.mkdir()
    code = ("import os; open(os.path.join(os.environ['CHUNKGRPO_CACHE'], 'x'), 'w').write('ok') "
            "if os.makedirs(os.environ['CHUNKGRPO_CACHE'], exist_ok=True) is None else None; "
            f"open({str(outside)!r}, 'wb').write(b'0' * 12345)")
    cmd = [sys.executable, "-c", code, "--function_to_execute", "work"]
    rc = lay.run(lambda **kw: pytest.fail("faithful mode must not use kfp's runner"), cmd, {})
    assert rc != 0
    assert len(lay.failures) == 1 and lay.failures[0] == (
        f"chunkgrpo pod-faithful: error: task work wrote {outside} (12345 bytes) outside its pod's volumes")
    cache = lay.root / "01-work" / "cache" / "chunkgrpo" / "x"
    assert cache.read_text() == "ok"  # CHUNKGRPO_CACHE was mapped into the task's /cache folder


def test_audit_sees_a_temporary_folder_deleted_before_the_task_ends(tmp_path):
    """A task that downloads into a TemporaryDirectory under /tmp and deletes it before it ends held those
    bytes in its container layer: the audit measures the folder just before the delete and fails the
    task on that peak, though /tmp is empty at the end. A hard link counts once, as on disk."""
    import sys

    from pipeline.pod_faithful import Layout, PodSpec

    lay = Layout(tmp_path / "pods", {"work": PodSpec({}, {})}, faithful=True,
                 limits={"work": {"/tmp": 2**20}})
    code = ("import os, tempfile\n"
            "with tempfile.TemporaryDirectory() as d:\n"
            "    open(os.path.join(d, 'model.bin'), 'wb').write(b'0' * (3 * 2**20))\n"
            "    os.link(os.path.join(d, 'model.bin'), os.path.join(d, 'linked.bin'))\n")  # no second copy
    rc = lay.run(lambda **kw: pytest.fail("faithful mode must not use kfp's runner"),
                 [sys.executable, "-c", code, "--function_to_execute", "work"], {})
    assert rc != 0 and len(lay.failures) == 1, lay.failures
    assert "task work wrote 3145728 bytes to /tmp and $HOME (the container layer) > 1048576 bytes" in \
        lay.failures[0] and "just before a delete, 0 at the end" in lay.failures[0]
    assert lay.report[-1]["used"]["/tmp"] == 0 and lay.report[-1]["peak"]["/tmp"] == 3 * 2**20
    small = Layout(tmp_path / "pods2", {"work": PodSpec({}, {})}, faithful=True,
                   limits={"work": {"/tmp": 4 * 2**20}})
    assert small.run(None, [sys.executable, "-c", code, "--function_to_execute", "work"], {}) == 0
    assert small.failures == []


def test_registers_container_layer_allows_for_the_code_it_packages():
    """A registered version carries the modules its served model imports (MLflow copies them into the model
    folder register builds under /tmp): about 0.2 MB at any model size, so register's scaled /tmp limit adds
    exactly that."""
    from pipeline.pod_faithful import (
        CONTAINER_LAYER,
        MIN_LIMIT,
        TMP,
        PodSpec,
        scaled_limits,
        served_code_bytes,
    )

    code = served_code_bytes()
    assert 64 * 2**10 < code < 8 * 2**20
    lim = scaled_limits({"register": PodSpec({}, {}), "check_gate": PodSpec({}, {})}, 1e-4)
    base = max(MIN_LIMIT, int(CONTAINER_LAYER * 1e-4))
    assert lim["register"][TMP] == base + code and lim["check_gate"][TMP] == base


def _env_pipeline():
    from kfp import dsl

    @dsl.component(base_image="python:3.11")
    def work():
        pass

    @dsl.pipeline(name="env-pipeline")
    def env_pipeline():
        task = work()
        for k, v in {"TMPDIR": "/cache", "CHUNKGRPO_CACHE": "/cache/chunkgrpo", "HOME": "/tmp",
                     "OTHER": "/opt/x"}.items():
            task.set_env_variable(k, v)

    return env_pipeline


def _compiled_env(func) -> dict:
    executors = func.pipeline_spec.deployment_spec["executors"]
    (label,) = list(executors.keys())
    return {e["name"]: e["value"] for e in executors[label]["container"]["env"]}


def test_plain_local_run_maps_pod_volumes_to_shared_folders(tmp_path):
    """A plain run writes the local folders into the compiled env kfp.local starts each task with."""
    from pipeline.pod_faithful import Layout, PodSpec, map_volumes

    func = _env_pipeline()
    lay = Layout(tmp_path, {"work": PodSpec(_compiled_env(func), {"/cache": 10})})
    assert map_volumes(func, lay) == 3
    env = _compiled_env(func)
    assert env["TMPDIR"] == str(tmp_path / "cache") and (tmp_path / "cache").is_dir()
    assert env["CHUNKGRPO_CACHE"] == str(tmp_path / "cache/chunkgrpo")
    assert env["HOME"] == os.environ["HOME"]  # /tmp is no volume: a plain local run keeps the host's HOME
    assert env["OTHER"] == "/opt/x"  # no volume's path: unchanged


def test_pod_faithful_tasks_go_through_the_layout_and_kfp_is_restored(tmp_path):
    from kfp.local import subprocess_task_handler as handler

    from pipeline.pod_faithful import Layout, tasks_as_pods

    original = handler.run_local_subprocess
    lay = Layout(tmp_path / "pods", {}, faithful=True)
    seen = []
    lay.run = lambda original, full_command, env_vars: seen.append(full_command) or 7
    with tasks_as_pods(lay):
        assert handler.run_local_subprocess(full_command=["x"], env_vars={}) == 7
    assert seen == [["x"]] and handler.run_local_subprocess is original
    assert (tmp_path / "pods" / "pod-faithful.json").exists()
