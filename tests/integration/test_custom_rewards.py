"""A user's own reward trains the toy model from the command line, and one that does not import stops the
real pipeline under kfp.local at its preflight: a module in a folder of its own on PYTHONPATH
(`module:attr`), and an entry point of an installed package (a dist-info on the path, as pip leaves it).
docs/rewards.md's toy example is run as written."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from chunkgrpo.toy.pretrained import PACKAGED

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "rewards.md"

# A user reward that writes one line per call (its process and batch size) to $USER_REWARD_LOG: the test
# sees which processes called it. `lightness` is the mean pixel value, so the tiny demo's brightness gate
# measures what it trains.
USER_REWARDS = textwrap.dedent('''
    """A user's rewards."""
    import json
    import os

    import numpy as np
    import torch


    def lightness(scale=1.0):
        """Mean pixel value, times scale."""
        log = os.environ["USER_REWARD_LOG"]

        def fn(images, prompts):
            px = np.stack([np.asarray(im, dtype=np.float32) / 255.0 for im in images])
            with open(log, "a") as f:
                f.write(json.dumps({"pid": os.getpid(), "n": len(images), "np": len(prompts)}) + "\\n")
            return torch.from_numpy(float(scale) * px.reshape(len(images), -1).mean(1))

        return fn
''')


def _doc_example() -> tuple[str, str, str]:
    """(file name, Python source, shell command) of docs/rewards.md's toy example."""
    text = DOC.read_text()
    section = text[text.index("### Try it on the toy model"):]
    section = section[:section.index("\n### ", 1)]
    source = re.search(r"```python\n(.+?)```", section, re.S).group(1)
    command = re.search(r"```bash\n(.+?)```", section, re.S).group(1)
    name = re.match(r"# (\S+\.py)\n", source).group(1)
    return name, source, command


def _user_env(*paths: Path, **extra: str) -> dict:
    """A shell whose `python` and `chunkgrpo` are this environment's, with `paths` importable."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join([*map(str, paths), str(ROOT)])
    return {**env, **extra}


def _recorded_rewards(out: Path) -> list[dict]:
    """The reward list the newest checkpoint of a run records."""
    newest = sorted((out / "checkpoints").glob("step-*"))[-1]
    return json.loads((newest / "trainer_state.json").read_text())["config"]["rewards"]


def test_the_docs_toy_example_trains_with_a_reward_from_the_users_file(tmp_path):
    name, source, command = _doc_example()
    assert "--config toy_cpu" in command and "PYTHONPATH=. chunkgrpo train" in command
    (tmp_path / name).write_text(source)
    # the command as written; only chunkgrpo itself is put on the path too (this checkout, not installed)
    script = "set -euo pipefail\n" + command.replace("PYTHONPATH=.", f"PYTHONPATH=.:{ROOT}")
    r = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=_user_env(), capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    steps = int(re.search(r"max_steps=(\d+)", command).group(1))
    assert re.search(rf"^trained {steps} optimizer steps \(chunk, chunks \[2, 3, 4\]\); reward ", r.stdout,
                     re.M), r.stdout[-2000:]
    out = tmp_path / re.search(r"output_dir=(\S+)", command).group(1)
    recorded = [{"name": "myrewards:darkness", "weight": 1.0, "options": {"scale": "2"}}]  # options: str
    assert _recorded_rewards(out) == recorded
    history = json.loads((out / "train_summary.json").read_text())["history"]
    assert len(history) == steps and all(0 < h["reward_mean"] <= 2 for h in history)  # 2 x (1 - mean pixel)


def test_an_entry_point_of_an_installed_package_trains_the_toy_model(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "inkpkg.py").write_text(USER_REWARDS)
    info = site / "inkpkg-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: inkpkg\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[chunkgrpo.rewards]\nink = inkpkg:lightness\n")
    log = tmp_path / "calls.jsonl"
    out = tmp_path / "run"
    r = subprocess.run(
        ["chunkgrpo", "train", "--config", "toy_cpu", f"model={PACKAGED}",
         f"prompts={PACKAGED / 'toy' / 'train_prompts.txt'}", f"output_dir={out}", "progress=false",
         "max_steps=1", "rewards=[{name: ink, options: {scale: 3}}]"],
        cwd=tmp_path, env=_user_env(site, USER_REWARD_LOG=str(log)), capture_output=True, text=True,
        timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "trained 1 optimizer steps" in r.stdout
    assert _recorded_rewards(out) == [{"name": "ink", "weight": 1.0, "options": {"scale": "3"}}]
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    # one call per rollout: toy_cpu samples 2 prompts x a group of 8
    assert len(calls) == 1 and calls[0]["n"] == calls[0]["np"] == 16, calls


@pytest.fixture
def user_reward_path(tmp_path, monkeypatch) -> Path:
    """`userrewards.py` in a folder of its own on the PYTHONPATH every kfp.local task (and its torchrun
    ranks) inherits; the calls' log beside it."""
    folder = tmp_path / "user"
    folder.mkdir()
    (folder / "userrewards.py").write_text(USER_REWARDS)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(folder), str(ROOT)]))
    monkeypatch.setenv("USER_REWARD_LOG", str(folder / "calls.jsonl"))
    return folder


# a kfp.local run that trains with a user's reward (both ranks scoring with it, reached through the
# `train_overrides` run parameter): tests/pipeline/test_image_faithful.py, in the runtime image's environment


def test_a_user_reward_that_does_not_import_stops_the_pipeline_at_preflight(services, tmp_path,
                                                                              user_reward_path):
    from pipeline.local_run import run_local
    from pipeline.task_log import TaskFailed

    params = {"model_name": "x", "train_overrides": ["rewards=[{name: userrewards:lightnes}]"]}
    with pytest.raises(TaskFailed) as e:
        run_local("train_and_evaluate", params, home=tmp_path / "home", services_env=services.env,
                  demo="tiny")
    f = e.value
    assert f.task == "preflight" and f.user_error, (f.task, f.reason)
    assert "module 'userrewards' has no attribute 'lightnes'" in f.reason, f.reason
    assert not (user_reward_path / "calls.jsonl").exists()
