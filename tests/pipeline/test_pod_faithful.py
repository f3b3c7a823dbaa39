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
    from pipeline.local import run_local

    return run_local("train_and_evaluate", {**PARAMS, "model_name": f"pf-{uuid.uuid4().hex[:6]}"}, home=home,
                     services_env=services.env, demo="tiny", **kw)


def test_todays_tmp_layout_fails_the_pod_faithful_check(services, tmp_path, monkeypatch):
    """The layout before the /cache volume: GPU steps had no /cache volume and no cache/output env
    (HOME=/tmp from the image only). Compiling the pipeline that way and auditing it must fail the run,
    in one line naming /tmp and the bytes written there."""
    from components import k8s
    from pipeline.local import TaskFailed

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


def test_plain_local_run_maps_pod_volumes_to_shared_folders(tmp_path):
    from pipeline.pod_faithful import Layout, PodSpec

    lay = Layout(tmp_path, {"train": PodSpec({"TMPDIR": "/cache", "CHUNKGRPO_CACHE": "/cache/chunkgrpo",
                                              "HOME": "/tmp"}, {"/cache": 10})})
    seen = {}
    lay.run(lambda full_command, env_vars: seen.update(env_vars) or 0,
            ["x", "--function_to_execute", "train"], {"TMPDIR": "/cache"})
    assert seen["TMPDIR"] == str(tmp_path / "cache")
    assert seen["CHUNKGRPO_CACHE"] == str(tmp_path / "cache/chunkgrpo")
    assert seen["HOME"] == os.environ["HOME"]  # /tmp is no volume: a plain local run keeps the host's HOME
