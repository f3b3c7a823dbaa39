"""chunkgrpo.preflight_image: in the image a step runs in, each reward/scorer's package (in its venv or
in-process), the files it loads by name, and peft for a LoRA model; one sentence per missing thing."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from chunkgrpo import preflight_image as P
from chunkgrpo.scoring.client import VENV_VARS

VARS = sorted(set(VENV_VARS.values()))


@pytest.fixture(autouse=True)
def _no_reward_venvs(monkeypatch, tmp_path):
    for var in VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty hub cache unless a test fills it
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)


def _venv_without_packages(tmp_path: Path) -> Path:
    """A folder with bin/python: this interpreter (whose environment has no reward package)."""
    venv = tmp_path / "venv-empty"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    return venv


def test_a_venv_without_the_package_is_named_with_its_variable_image_and_fix(tmp_path, monkeypatch):
    venv = _venv_without_packages(tmp_path)
    monkeypatch.setenv("CHUNKGRPO_VENV_HPSV3", str(venv))
    problems = P.training_problems("tiny_cpu", ["rewards=[{name: hpsv3}, {name: brightness}]"],
                                   {"hpsv3.processor": "s3://b/Qwen"})
    assert problems == [
        f"chunkgrpo-runtime: reward hpsv3 needs the `hpsv3` package, which its venv "
        f"$CHUNKGRPO_VENV_HPSV3={venv} cannot import: rebuild that venv (`bash scripts/reward-envs.sh`; "
        "images/runtime/Dockerfile builds /opt/venv-*)"]


def test_a_venv_that_does_not_exist_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("CHUNKGRPO_VENV_IMAGEREWARD", str(tmp_path / "nowhere"))
    [p] = P.evaluation_problems("eval_hpdv2", [], ["scorers=[imagereward]"], {}, lora=False)
    assert p.startswith("chunkgrpo-eval: scorer imagereward: scorer 'imagereward': "
                        f"CHUNKGRPO_VENV_IMAGEREWARD={tmp_path / 'nowhere'} does not exist"), p


def test_in_process_the_missing_package_names_its_distribution_and_the_image_lock():
    [p] = P.evaluation_problems("eval_hpdv2", [], ["scorers=[image_reward]"],
                                {"imagereward.processor": "s3://b/bert"}, lora=False)
    assert p == (f"chunkgrpo-eval: scorer image_reward needs the `ImageReward` package (`image-reward`), "
                 f"which this environment ({sys.executable}) cannot import: add `image-reward` to "
                 "images/eval/requirements.lock (installed by scripts/image-env.sh) or set "
                 "$CHUNKGRPO_VENV_IMAGEREWARD to a venv that has it")


def test_a_lora_model_needs_peft_in_the_eval_image(monkeypatch):
    assert P.evaluation_problems("eval_tiny", [], [], {}, lora=True) == []  # peft is here
    monkeypatch.setitem(sys.modules, "peft", None)  # find_spec answers None: as if not installed
    problems = P.evaluation_problems("eval_tiny", [], [], {}, lora=True)
    assert problems == [
        f"chunkgrpo-eval: the trained model (a LoRA adapter) needs the `peft` package, which this "
        f"environment ({sys.executable}) cannot import: add `peft` to images/eval/requirements.lock "
        "(installed by scripts/image-env.sh)"]
    assert P.evaluation_problems("eval_tiny", [], [], {}, lora=False) == []


def test_geneval_with_the_official_detector_needs_mmdet_where_the_evaluation_runs(tmp_path, monkeypatch):
    """geneval_detector=mmdet imports mmdet and mmcv in the evaluation process: without them the eval
    preflight names both and the ways out; other detectors, generate_only, or both packages present pass."""
    geneval = ["benchmarks=[geneval]", "scorers=[]"]
    [p] = P.evaluation_problems("eval_tiny", [], [*geneval, "geneval_detector=mmdet"], {}, lora=False)
    assert p.startswith("chunkgrpo-eval: benchmark geneval's detector (geneval_detector=mmdet) imports mmdet "
                        "and mmcv in the evaluation process"), p
    assert "geneval_detector=transformers" in p and "generate_only=true" in p
    assert P.evaluation_problems("eval_tiny", [], [*geneval, "geneval_detector=transformers"], {},
                                 lora=False) == []
    assert P.evaluation_problems("eval_tiny", [], [*geneval, "geneval_detector=mmdet", "generate_only=true"],
                                 {}, lora=False) == []
    for pkg in ("mmdet", "mmcv"):  # the official stack importable here: nothing to report
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert P.evaluation_problems("eval_tiny", [], [*geneval, "geneval_detector=mmdet"], {}, lora=False) == []


def test_lora_follows_the_training_preset():
    assert P.is_lora("tiny_cpu", []) and P.is_lora("chunk_grpo_flux", ["lora.enabled=true"])
    assert not P.is_lora("tiny_cpu", ["lora.enabled=false"])
    assert not P.is_lora("chunk_grpo_flux", [])  # the paper's recipe fine-tunes the whole transformer


def test_files_loaded_by_name_are_checked_in_the_hub_cache_unless_a_processor_is_given(tmp_path, monkeypatch):
    from chunkgrpo.scoring.hub_cache import install_snapshot

    venv = _venv_without_packages(tmp_path)
    monkeypatch.setattr(P, "find_modules", lambda modules, python=None: dict.fromkeys(modules, []))
    monkeypatch.setenv("CHUNKGRPO_VENV_IMAGEREWARD", str(venv))
    problems = P.evaluation_problems("eval_hpdv2", [], [], {"hpsv3": "s3://b/HPSv3"}, lora=False)
    hub = tmp_path / "hf" / "hub"
    assert problems == [
        f"chunkgrpo-eval: scorer imagereward loads `bert-base-uncased` by name from the Hugging Face cache "
        f"({hub}), which lacks it and is never downloaded at run time: give its folder as "
        "`imagereward.processor` in scorer_weights (`chunkgrpo models sync --defaults` fills the model "
        "cache)"]
    tok = tmp_path / "bert"
    tok.mkdir()
    (tok / "vocab.txt").write_text("[PAD]\n")
    install_snapshot("bert-base-uncased", tok)
    assert P.evaluation_problems("eval_hpdv2", [], [], {"hpsv3": "s3://b/HPSv3"}, lora=False) == []
    # local HPSv3 weights without the Qwen2-VL base beside them: the base is loaded by hub name
    [p] = P.evaluation_problems("eval_hpdv2", [], [], {"hpsv3": str(tmp_path)}, lora=False)
    assert "scorer hpsv3 loads `Qwen/Qwen2-VL-7B-Instruct` by name" in p and "`hpsv3.processor`" in p
    assert P.evaluation_problems("eval_hpdv2", [], [], {"hpsv3": str(tmp_path),
                                                       "hpsv3.processor": "s3://b/q"}, lora=False) == []


def test_user_rewards_are_resolved_without_importing(tmp_path, monkeypatch):
    (tmp_path / "myrw_ok.py").write_text("raise SystemExit('imported')\n")  # found, never run
    monkeypatch.syspath_prepend(str(tmp_path))
    assert P.training_problems("tiny_cpu", ["rewards=[{name: 'myrw_ok:fn'}]"], {}) == []
    problems = P.training_problems("tiny_cpu", ["rewards=[{name: 'no_such_mod_x:fn'}, {name: nosuchep}]"],
                                   {})
    assert problems == [
        f"chunkgrpo-runtime: reward no_such_mod_x:fn needs the module `no_such_mod_x`, which this "
        f"environment ({sys.executable}) cannot import: install its package in the image (or put it on the "
        "task's PYTHONPATH)",
        f"chunkgrpo-runtime: reward nosuchep is not built in and no package installed in this environment "
        f"({sys.executable}) has an entry point 'nosuchep' in group chunkgrpo.rewards: install the package "
        "that provides it in the image"]


def test_served_rewards_are_left_to_their_server(tmp_path, monkeypatch):
    monkeypatch.setenv("CHUNKGRPO_VENV_HPSV3", str(tmp_path / "nowhere"))
    overrides = ["rewards=[{name: hpsv3, url: 'http://r:8000'}]"]
    assert P.training_problems("tiny_cpu", overrides, {}) == []
    assert P.training_problems("tiny_cpu", ["rewards=[{name: hpsv3}]"], {}, served={"hpsv3"}) == []


def test_the_stage_names_every_problem_in_one_line(tmp_path, monkeypatch):
    from chunkgrpo.errors import UserError
    from chunkgrpo.stages.preflight import eval_image_preflight

    monkeypatch.setitem(sys.modules, "peft", None)
    monkeypatch.setenv("CHUNKGRPO_VENV_HPSV3", str(_venv_without_packages(tmp_path)))
    kw = dict(eval_preset="eval_hpdv2", eval_benchmarks=[], eval_overrides=["scorers=[hpsv3]"],
              scorer_weights={"hpsv3.processor": "s3://b/q"})
    with pytest.raises(UserError) as e:
        eval_image_preflight(**kw, preset="tiny_cpu")  # LoRA
    msg = str(e.value)
    assert msg.startswith("eval-image preflight: 2 problem(s): ") and "\n" not in msg
    assert "`peft`" in msg and "`hpsv3`" in msg
    with pytest.raises(UserError, match="`peft`"):  # a registry version (no training preset): peft too
        eval_image_preflight(**kw)
    for full in (dict(preset="tiny_cpu", train_overrides=["lora.enabled=false"]), dict(method="chunk")):
        with pytest.raises(UserError, match="1 problem") as e:  # a full fine-tune needs no peft
            eval_image_preflight(**kw, **full)
        assert "peft" not in str(e.value)


@pytest.mark.reward_envs
def test_the_real_reward_venvs_pass_in_seconds(monkeypatch):
    """The venvs of scripts/reward-envs.sh have every package and hpsv2's vocabulary: no problem, and the
    whole check (one subprocess per venv, nothing imported) takes seconds."""
    from tests.unit.scoring.test_scorers_packages import reward_venv

    for name in ("hpsv2", "imagereward", "hpsv3"):
        monkeypatch.setenv(VENV_VARS[name], str(reward_venv(name)))
    weights = {"imagereward.processor": "s3://b/bert", "hpsv3.processor": "s3://b/q"}
    t0 = time.perf_counter()
    problems = P.evaluation_problems("eval_hpdv2", [], ["scorers=[hpsv3, imagereward, hpsv2.1, hpsv2, clip]"],
                                     weights, lora=True)
    took = time.perf_counter() - t0
    assert problems == [] and took < 10, (problems, took)
    assert P.training_problems("tiny_cpu", ["rewards=[{name: hpsv3}, {name: imagereward}]"], weights) == []
