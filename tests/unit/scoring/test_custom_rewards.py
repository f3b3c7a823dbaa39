"""Rewards and scorers a user names: an import path module:attr or an installed package's entry point."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from PIL import Image

from chunkgrpo.cli import main
from chunkgrpo.errors import UserError
from chunkgrpo.scoring.custom import resolve
from chunkgrpo.scoring.rewards import get_reward
from chunkgrpo.train.config import TrainConfig

ROOT = Path(__file__).resolve().parents[3]

# A user's reward module: records what it was given, so the test can check the image/prompt format.
USER_REWARDS = textwrap.dedent('''
    """Test rewards."""
    import json, os

    import numpy as np
    import torch

    def darkness(scale=1.0):
        """1 - mean pixel value, times scale."""
        log = os.environ.get("USER_REWARD_LOG")

        def fn(images, prompts):
            px = np.stack([np.asarray(im, dtype=np.float32) / 255.0 for im in images])
            if log:
                with open(log, "a") as f:
                    f.write(json.dumps({"n": len(images), "mode": images[0].mode,
                                        "size": images[0].size, "shape": list(px.shape),
                                        "prompts": [type(p).__name__ for p in prompts],
                                        "np": len(prompts)}) + "\\n")
            return torch.from_numpy(float(scale) * (1.0 - px.reshape(len(images), -1).mean(1)))
        return fn

    def wrong_shape():
        return lambda images, prompts: torch.zeros(len(images) + 1)

    def with_nan():
        return lambda images, prompts: torch.full((len(images),), float("nan"))

    def not_a_fn():
        return 42

    RECEIVED = []

    def recorded(**options):
        RECEIVED.append(options)
        return lambda images, prompts: torch.zeros(len(images))

    def broken(**_):
        raise RuntimeError("model file missing")

    NOT_CALLABLE = 3
''')


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "myrewards.py").write_text(USER_REWARDS)
    (tmp_path / "badimport.py").write_text("import no_such_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for mod in ("myrewards", "badimport"):
        sys.modules.pop(mod, None)
    return tmp_path


@pytest.fixture
def installed_package(tmp_path, monkeypatch):
    """A package installed the way pip leaves it: module + dist-info with entry_points.txt on sys.path."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "inkpkg.py").write_text(USER_REWARDS)
    info = site / "inkpkg-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: inkpkg\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[chunkgrpo.rewards]\ninkwell = inkpkg:darkness\n\n[chunkgrpo.scorers]\ninkscore = inkpkg:darkness\n"
    )
    monkeypatch.syspath_prepend(str(site))
    sys.modules.pop("inkpkg", None)
    return site


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("data") / "prompts.txt"
    p.write_text("a cat on a chair\na red car\n")
    return p


def _images(n=3):
    return [Image.new("RGB", (8, 8), (10 * i, 20 * i, 30 * i)) for i in range(n)]


def test_import_path_reward_is_built_and_checked(user_module):
    fn = get_reward("myrewards:darkness", {"scale": "2"})
    out = fn(_images(), ["a", "b", "c"])
    assert out.dtype == torch.float32 and out.shape == (3,)
    expected = torch.tensor([2 * (1 - (10 * i + 20 * i + 30 * i) / 3 / 255) for i in range(3)])
    assert torch.allclose(out, expected, atol=1e-6)


def test_options_reach_the_factory_as_docs_say(user_module):
    """Training passes a config's options as strings; `reward-server --option` as YAML parses them."""
    from chunkgrpo.config import parse_override

    rewards = 'rewards=[{name: "myrewards:recorded", options: {scale: 2, flag: true}}]'
    cfg = TrainConfig.load("tiny_cpu", [rewards])
    spec = cfg.rewards[0]
    get_reward(spec.name, spec.options)
    served = dict(parse_override(t) for t in ("scale=2", "flag=true"))
    get_reward("myrewards:recorded", served)
    import myrewards

    assert myrewards.RECEIVED == [{"scale": "2", "flag": "True"}, {"scale": 2, "flag": True}]


def test_user_reward_trains_the_tiny_demo_in_process(user_module, tiny_model_dir, prompts_file, tmp_path,
                                                     monkeypatch):
    from chunkgrpo.train.trainer import run_training

    log = tmp_path / "calls.jsonl"
    monkeypatch.setenv("USER_REWARD_LOG", str(log))
    cfg = TrainConfig.load("tiny_cpu", [
        f"model={tiny_model_dir}", f"prompts={prompts_file}", f"output_dir={tmp_path / 'run'}",
        "progress=false", "max_steps=2", "checkpoint.every=0",
        'rewards=[{name: "myrewards:darkness", weight: 1.0, options: {scale: 3}}]',
    ])
    summary = run_training(cfg)
    assert summary["optimizer_steps"] == 2
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert calls, "the user reward was never called"
    h, w = cfg.sampling.height, cfg.sampling.width
    # the documented format: n RGB PIL images of the sampled size, n str prompts
    assert all(c["mode"] == "RGB" and c["size"] == [w, h] and c["shape"] == [c["n"], h, w, 3] for c in calls)
    assert all(c["np"] == c["n"] and set(c["prompts"]) == {"str"} for c in calls)
    assert all(0 < r["reward_mean"] <= 3 for r in summary["history"])


def test_user_reward_through_the_cli(user_module, tiny_model_dir, prompts_file, tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(user_module)]),
           "USER_REWARD_LOG": str(tmp_path / "calls.jsonl")}
    r = subprocess.run(
        [sys.executable, "-m", "chunkgrpo", "train", "--config", "tiny_cpu", f"model={tiny_model_dir}",
         f"prompts={prompts_file}", f"output_dir={tmp_path / 'run'}", "progress=false", "max_steps=1",
         "checkpoint.every=0", 'rewards=[{name: "myrewards:darkness", options: {scale: 2}}]'],
        env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "trained 1 optimizer steps" in r.stdout
    assert (tmp_path / "calls.jsonl").read_text().strip()


def test_entry_point_reward_and_scorer(installed_package):
    assert resolve("inkwell").source == "entry point chunkgrpo.rewards:inkwell = inkpkg:darkness"
    out = get_reward("inkwell", {"scale": 1})(_images(2), ["x", "y"])
    assert out.shape == (2,) and out[0] == pytest.approx(1.0)
    TrainConfig.load("tiny_cpu", ["rewards=[{name: inkwell}]"])  # validates at config load
    # evaluation: chunkgrpo.scorers first, then chunkgrpo.rewards; both are scorers
    from chunkgrpo.eval.config import EvalConfig
    from chunkgrpo.eval.scorer_setup import build_scorers, check_scorers

    cfg = EvalConfig(model="m", scorers=["inkscore", "inkwell", "brightness"])
    check_scorers(cfg)
    scorers = build_scorers(cfg)
    assert (scorers["inkscore"].info["backend"]
            == "user scorer entry point chunkgrpo.scorers:inkscore = inkpkg:darkness")
    assert scorers["inkscore"].info["scale"] == "1 - mean pixel value, times scale."
    assert scorers["inkwell"].score(_images(2), ["x", "y"]).shape == (2,)
    with pytest.raises(UserError, match=r"unknown scorer 'inkscor' \(did you mean 'inkscore'\?\).*chunkgrpo"
                                        r"\.scorers or chunkgrpo\.rewards \(installed: inkscore, inkwell\)"):
        EvalConfig(model="m", scorers=["inkscor"])


BAD_CONFIG = [
    ("brightnes", r"unknown reward 'brightnes' \(did you mean 'brightness'\?\): not built in \(brightness, "
                  r".*hpsv3.*\), not an entry point in chunkgrpo\.rewards \(installed: none\), not an import "
                  r"path module:attr"),
    ("nomodule_xyz:fn", r"reward 'nomodule_xyz:fn' \(import path\): cannot import module 'nomodule_xyz' "
                        r"\(ModuleNotFoundError"),
    ("badimport:fn", r"cannot import module 'badimport' \(ModuleNotFoundError: No module named "
                     r"'no_such_dependency_xyz'\)"),
    ("myrewards:nope", r"module 'myrewards' has no attribute 'nope'"),
    ("myrewards:NOT_CALLABLE", r"myrewards:NOT_CALLABLE is a int, not a callable factory"),
]


@pytest.mark.parametrize("name,match", BAD_CONFIG)
def test_bad_reward_is_one_line_at_config_load(user_module, tiny_model_dir, prompts_file, tmp_path, capsys,
                                               name, match):
    out = tmp_path / "run"
    rc = main(["train", "--config", "tiny_cpu", "--dry-run", f"model={tiny_model_dir}",
               f"prompts={prompts_file}", f"output_dir={out}", f'rewards=[{{name: "{name}"}}]'])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("chunkgrpo train: error: ")
    assert re.search(match, err), err
    assert not out.exists()


@pytest.mark.parametrize("name,match", [
    ("myrewards:wrong_shape", r"reward 'myrewards:wrong_shape' \(myrewards:wrong_shape\): returned shape "
                              r"\(4,\) for 3 images \(expected \(3,\)\)"),
    ("myrewards:with_nan", r"non-finite values for samples \[0, 1, 2\] of 3"),
    ("myrewards:not_a_fn", r"the factory returned a int, not a callable"),
    ("myrewards:broken", r"factory failed \(RuntimeError: model file missing\)"),
])
def test_bad_factory_or_answer_is_one_line(user_module, name, match):
    with pytest.raises(UserError, match=match) as e:
        get_reward(name)(_images(), ["a", "b", "c"])
    assert "\n" not in str(e.value)


def test_bad_answer_stops_training_in_one_line(user_module, tiny_model_dir, prompts_file, tmp_path, capsys):
    rc = main(["train", "--config", "tiny_cpu", f"model={tiny_model_dir}", f"prompts={prompts_file}",
               f"output_dir={tmp_path / 'run'}", "progress=false", "max_steps=1",
               'rewards=[{name: "myrewards:wrong_shape"}]'])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert err[-1] == ("chunkgrpo train: error: reward 'myrewards:wrong_shape' (myrewards:wrong_shape): "
                       "returned shape (9,) for 8 images (expected (8,))"), err
    assert not (tmp_path / "run" / "final").exists()
