"""Image-faithful local runs (pipeline/image_faithful.py): every task in the locally built environment of
the image its pod uses (scripts/image-env.sh), on top of the pod-faithful env, volumes and audit.

The integration tests need the image environments (`bash scripts/image-env.sh runtime|eval`) and the reward
venvs; without them they skip, except under CI=true, where a missing one fails.
"""

from __future__ import annotations

import collections
import json
import os
import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from pipeline import image_faithful as IF

REPO = Path(__file__).resolve().parents[2]


def test_image_name_of_our_images_only():
    assert IF.image_name("ghcr.io/chunkgrpo/chunkgrpo-eval:0.1.0") == "eval"
    assert IF.image_name("registry.local:5000/x/chunkgrpo-runtime@sha256:" + "0" * 64) == "runtime"
    assert IF.image_name("chunkgrpo-launcher:dev") == "launcher"
    assert IF.image_name("python:3.11") == ""
    assert IF.image_name("ghcr.io/chunkgrpo/chunkgrpo-evaluator:1") == ""


def test_an_unbuilt_image_env_fails_in_one_line_naming_task_image_and_command(tmp_path):
    from chunkgrpo.errors import UserError

    environ = {IF.ENVS_VAR: str(tmp_path)}
    with pytest.raises(UserError) as e:
        IF.envs_for({"evaluate": "ghcr.io/chunkgrpo/chunkgrpo-eval:0.1.0"}, environ)
    prefix = tmp_path / "eval"
    assert str(e.value) == (
        f"--image-faithful: task evaluate runs on image chunkgrpo-eval, whose environment {prefix} "
        f"is not built: run `bash scripts/image-env.sh eval {prefix}`")
    assert IF.envs_for({"gate": "python:3.11"}, environ) == {}  # not one of ours: this interpreter


def test_image_variables_put_its_venv_first_and_point_at_the_reward_venvs(tmp_path):
    other = tmp_path / "other-venv"
    (other / "bin").mkdir(parents=True)
    (other / "pyvenv.cfg").write_text("home = /usr/bin\n")
    env = IF.ImageEnv("runtime", tmp_path / "runtime")
    v = env.variables({"PATH": f"{other / 'bin'}:/usr/bin", IF.REWARD_ENVS_VAR: str(tmp_path / "rewards")})
    assert v["PATH"] == f"{tmp_path / 'runtime' / 'bin'}:/usr/bin"  # no other venv's torchrun or python
    assert v["VIRTUAL_ENV"] == str(tmp_path / "runtime")
    assert v["CHUNKGRPO_VENV_HPSV3"] == str(tmp_path / "rewards" / "venv-hpsv3")
    assert set(IF.REWARD_VENVS) <= set(v)
    assert not set(IF.REWARD_VENVS) & set(IF.ImageEnv("launcher", tmp_path).variables({"PATH": "/bin"}))


def test_missing_package_reads_the_last_import_error():
    lines = ["Traceback (most recent call last):\n", "  File x\n",
             "ModuleNotFoundError: No module named 'peft'\n"]
    assert IF.missing_package(lines) == "peft"
    assert IF.missing_package(["ModuleNotFoundError: No module named 'google.protobuf'"]) == "google"
    assert IF.missing_package(["ValueError: bad"]) == ""


def _fake_env(tmp_path: Path, image: str) -> IF.ImageEnv:
    """An environment whose interpreter is this one under another path (enough to see which one ran)."""
    prefix = tmp_path / image
    (prefix / "bin").mkdir(parents=True)
    (prefix / "bin" / "python").symlink_to(sys.executable)
    return IF.ImageEnv(image, prefix)


def test_a_task_starts_with_its_image_interpreter_and_a_missing_package_is_one_line(tmp_path):
    """Layout.run (kfp.local's task process) with the image env's interpreter: a task that runs uses it;
    a task that imports a package its image lacks fails with one line naming task, image and package."""
    from pipeline.pod_faithful import Layout, PodSpec

    env = _fake_env(tmp_path, "eval")
    spec = PodSpec({}, {"/cache": 2**30}, "ghcr.io/chunkgrpo/chunkgrpo-eval:0.1.0")
    lay = Layout(tmp_path / "pods", {"evaluate": spec}, faithful=True,
                 limits={"evaluate": {"/cache": 2**30, "/tmp": 2**30}}, images={"evaluate": env})
    out = tmp_path / "which.txt"
    ok = [sys.executable, "-c", f"import sys; open({str(out)!r}, 'w').write(sys.executable)",
          "--function_to_execute", "evaluate"]
    lay.allow = (str(out),)
    assert lay.run(lambda **kw: pytest.fail("kfp's runner"), ok, {}) == 0
    assert out.read_text() == str(env.python)
    assert lay.ran_in == {"evaluate": f"chunkgrpo-eval: {env.python}"}
    bad = [sys.executable, "-c", "import surely_not_installed_pkg", "--function_to_execute", "evaluate"]
    assert lay.run(lambda **kw: pytest.fail("kfp's runner"), bad, {}) != 0
    assert lay.failures == [
        f"chunkgrpo image-faithful: error: task evaluate: image chunkgrpo-eval has no package "
        f"'surely_not_installed_pkg' (its environment {env.prefix}, installed from "
        "images/eval/requirements.lock by scripts/image-env.sh)"]


# ---- real runs --------------------------------------------------------------------------------------

PARAMS = {"max_iterations": 2, "profile_prompts": 2, "eval_num_prompts": 2}


def _built(image: str) -> IF.ImageEnv:
    env = IF.env_for(image)
    if not (env.python.exists() and (env.prefix / IF.STAMP).exists()):
        msg = f"image env {env.prefix} is not built: run `bash scripts/image-env.sh {image}`"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    return env


@pytest.mark.integration
@pytest.mark.reward_envs
@pytest.mark.timeout(2400)  # builds tiny HPSv3 weights, then the whole demo
def test_tiny_demo_runs_image_faithfully_and_trains_on_hpsv3_in_the_runtime_image(services, tmp_path,
                                                                                    monkeypatch):
    """The tiny demo with TempFlow-GRPO, every task in its image's environment: training (runtime image)
    scores the real hpsv3 package with tiny weights fetched from S3 as on the cluster (`reward_weights`),
    in the venv the image's CHUNKGRPO_VENV_HPSV3 names, beside a user's own reward from a module on the
    tasks' PYTHONPATH (as an image built FROM the runtime image with the user's package would hold it),
    which reaches the train step through `train_overrides` and is scored by both torchrun ranks;
    evaluation runs in the eval image's environment. The method switch reaches profile, plan and train
    (test_local_branching.py runs Granular-GRPO)."""
    from pipeline.demos import model_to_s3
    from pipeline.local_run import run_local
    from tests.unit.scoring.test_scorers_packages import build_tiny, reward_venv

    runtime, ev = _built("runtime"), _built("eval")
    tiny = build_tiny("hpsv3", reward_venv("hpsv3"), tmp_path / "tiny-hpsv3")
    for k, v in services.env.items():
        monkeypatch.setenv(k, v)
    user = tmp_path / "user"
    user.mkdir()
    (user / "myrewards_if.py").write_text(
        "import os\n\nimport numpy as np\nimport torch\n\n\ndef darkness(scale: float = 1.0):\n"
        "    def fn(images, prompts):\n"
        "        print(f'myrewards_if.darkness: pid {os.getpid()} scored {len(images)} of {len(prompts)}',"
        " flush=True)\n"
        "        px = np.stack([np.asarray(im, dtype=np.float32) / 255.0 for im in images])\n"
        "        return torch.from_numpy(float(scale) * (1.0 - px.reshape(len(images), -1).mean(1)))\n"
        "    return fn\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(user), os.environ.get("PYTHONPATH")])))
    weights = {"hpsv3": model_to_s3(Path(tiny["weights"]).parent, services.env),
               "hpsv3.processor": model_to_s3(Path(tiny["processor"]), services.env)}
    r = run_local("train_and_evaluate", {**PARAMS, "model_name": f"if-{uuid.uuid4().hex[:6]}",
                                         "method": "tempflow", "preset": "tempflow_grpo_tiny_cpu",
                                         "train_overrides": ["rewards=[{name: hpsv3, weight: 1.0}, "
                                                             "{name: 'myrewards_if:darkness', weight: 0.5}]"],
                                         "reward_weights": weights},
                  home=tmp_path / "home", services_env=services.env, demo="tiny", image_faithful=True)
    assert r.images["train"] == f"chunkgrpo-runtime: {runtime.python}"
    assert r.images["evaluate"] == f"chunkgrpo-eval: {ev.python}"
    assert all(v.startswith(("chunkgrpo-runtime", "chunkgrpo-eval")) for v in r.images.values())
    log = r.log_path.read_text()
    assert "downloaded s3://chunkgrpo/models/local/tiny-hpsv3-" in log and "trained 2 optimizer steps" in log
    from mlflow import MlflowClient

    client = MlflowClient(services.env["MLFLOW_TRACKING_URI"])
    parent = client.get_run(r.mlflow_run_id)
    children = client.search_runs([parent.info.experiment_id],
                                  filter_string=f"tags.mlflow.parentRunId = '{r.mlflow_run_id}'")
    train = [c for c in children if "reward/hpsv3" in c.data.metrics]
    assert train, [sorted(c.data.metrics) for c in children]  # the training run scored HPSv3
    user_metrics = [k for k in train[0].data.metrics if "darkness" in k]
    assert user_metrics, sorted(train[0].data.metrics)  # ... and the user's reward, in the runtime image
    # both torchrun ranks scored with it, each the images it sampled (the task's log holds every rank's
    # output): tempflow_grpo_tiny_cpu branches each of the 7 trainable steps of 8 into its group of 4, so
    # each rank scores 7 batches of 4 per rollout, 2 rollouts
    calls = re.findall(r"myrewards_if\.darkness: pid (\d+) scored (\d+) of (\d+)", log)
    per_rank = collections.Counter(pid for pid, _, _ in calls)
    assert len(per_rank) == 2 and set(per_rank.values()) == {2 * 7}, calls
    assert all(n == n_prompts == "4" for _, n, n_prompts in calls), calls
    # TempFlow-GRPO through every step: the profile holds both trajectory kinds, the plan says which it used,
    # the trained model is tempflow's (one optimizer step per rollout)
    t = r.tasks
    prof = json.loads(Path(t["profile"]["artifacts"]["profile_json"]["uri"]).read_text())
    assert {"l1rel_sde", "l1rel_ode"} <= set(prof) and prof["trajectories"] == "sde"
    assert t["plan"]["artifacts"]["plan_json"]["metadata"]["trajectories"] == "sde"
    from chunkgrpo.store.manifest import read_pointer

    pointer = read_pointer(Path(t["train"]["artifacts"]["trained_model"]["uri"]).read_text())
    assert pointer["method"] == "tempflow" and pointer["optimizer_steps"] == 2


@pytest.mark.integration
@pytest.mark.reward_envs
@pytest.mark.timeout(1200)
def test_eval_image_without_peft_fails_the_run_at_its_preflight_naming_peft(services, tmp_path):
    """The eval image's environment without peft (a hard-linked copy of the built one, `pip uninstall
    peft` in it; the installed eval env is untouched): the image-faithful run fails at the eval-image
    preflight (its task runs in the eval image's environment), in one line naming the task, the image and
    peft, before any profiling or training starts."""
    from pipeline.local_run import run_local
    from pipeline.task_log import TaskFailed

    runtime, ev = _built("runtime"), _built("eval")
    envs = tmp_path / "envs"
    envs.mkdir()
    (envs / "runtime").symlink_to(runtime.prefix)
    # hard links where the two folders share a file system (seconds for ~1 GB), else a plain copy
    copy = subprocess.run(["cp", "-al", str(ev.prefix), str(envs / "eval")], capture_output=True)
    if copy.returncode != 0:
        shutil.rmtree(envs / "eval", ignore_errors=True)
        shutil.copytree(ev.prefix, envs / "eval", symlinks=True)
    r = subprocess.run([str(envs / "eval" / "bin" / "python"), "-m", "pip", "uninstall", "-y", "-q", "peft"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (ev.prefix / "lib" / "python3.11" / "site-packages" / "peft").is_dir()  # the original keeps it
    os.environ[IF.ENVS_VAR] = str(envs)
    try:
        with pytest.raises(TaskFailed) as e:
            run_local("train_and_evaluate", {**PARAMS, "model_name": f"ifp-{uuid.uuid4().hex[:6]}"},
                      home=tmp_path / "home", services_env=services.env, demo="tiny", image_faithful=True)
    finally:
        del os.environ[IF.ENVS_VAR]
        shutil.rmtree(envs / "eval", ignore_errors=True)
    assert e.value.task == "eval-preflight" and e.value.user_error, e.value
    reason = e.value.reason
    assert reason.startswith("eval-image preflight: 1 problem(s): chunkgrpo-eval: the trained model "
                             "(a LoRA adapter) needs the `peft` package"), reason
    assert f"({envs / 'eval' / 'bin' / 'python'})" in reason and "images/eval/requirements.lock" in reason
    log = re.sub(r"\x1b\[[0-9;]*m", "", e.value.log_path.read_text())  # kfp.local colours task names
    started = re.findall(r"Executing task '([^']+)'", log)
    assert "eval-preflight" in started and not {"profile", "train", "evaluate"} & set(started), started
