"""The real reward packages (hpsv2, image-reward, hpsv3), each imported in its own venv built by
`scripts/reward-envs.sh`, scoring real PIL images through the scorer wrappers and the worker boundary.

Models: each package's own class built from its own config with random weights (reduced where the real
one does not fit a CPU test), saved in the layout its loader reads, loaded by its loading code
(`chunkgrpo.testing.tiny_scorers`). Nothing in the scoring path is patched. The tests fail if a package were
faked: they check that the package and the model's class come from the venv's site-packages.

Needs the venvs: `bash scripts/reward-envs.sh` (or CHUNKGRPO_VENV_HPSV2/IMAGEREWARD/HPSV3 pointing at
built ones). Without them these tests skip, except under CI=true, where a missing venv fails.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from chunkgrpo.errors import UserError
from chunkgrpo.scoring import client as WC
from chunkgrpo.scoring import scorers as S

pytestmark = [pytest.mark.reward_envs, pytest.mark.integration]

REPO = Path(__file__).resolve().parents[3]
SITE = "lib/python3.11/site-packages"
PROMPTS = [
    "a photo of a cat",
    "a red dog on a green chair",
    "the blue cat",
    "a photo of a cat",
    "a yellow car",
]


def reward_venv(name: str) -> Path:
    """The venv for `name`: $CHUNKGRPO_VENV_<NAME>, else
    <$CHUNKGRPO_REWARD_ENVS or .reward-envs>/venv-<name>."""
    var = WC.venv_var(name)
    root = Path(os.environ.get("CHUNKGRPO_REWARD_ENVS") or REPO / ".reward-envs")
    venv = Path(os.environ[var]) if os.environ.get(var) else root / f"venv-{name}"
    built = (venv / "bin" / "python").is_file() and (
        os.environ.get(var) or (venv / ".chunkgrpo-stamp").is_file()
    )
    if not built:
        msg = f"reward venv {venv} is not built: run `bash scripts/reward-envs.sh` (or set {var})"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    return venv.resolve()


def build_tiny(name: str, venv: Path, out: Path) -> dict:
    stdout = WC.run_module(venv, "chunkgrpo.testing.tiny_scorers", [name, str(out)], timeout=1800)
    return json.loads(stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def images():
    """Real images of several sizes and aspect ratios: smooth gradients with shapes, and noise."""
    rng = np.random.default_rng(0)
    out = []
    for i, (h, w) in enumerate([(48, 40), (64, 64), (30, 90), (300, 200), (512, 128)]):
        y, x = np.mgrid[0:h, 0:w]
        arr = np.stack([x * 255 // max(w - 1, 1), y * 255 // max(h - 1, 1), np.full_like(x, 40 * i)], -1)
        arr[h // 4 : h // 2, w // 4 : w // 2] = rng.integers(0, 255, 3)
        if i % 2:
            arr = (arr + rng.integers(-30, 30, arr.shape)).clip(0, 255)
        out.append(Image.fromarray(arr.astype(np.uint8)))
    return out


def _constraint(name: str) -> str:
    from tests.images.test_eval_locks import parse_spec

    return parse_spec(REPO / "images" / "eval" / "constraints-torch.txt")[name]


def assert_real(scorer: S.Scorer, venv: Path, package_dir: str, model_class: str) -> None:
    rt = scorer.info["runtime"]
    assert scorer.info["runs"] == "worker" and Path(rt["python"]) == venv / "bin" / "python"
    assert Path(rt["package_file"]).is_relative_to(venv / SITE / package_dir)
    assert rt["model_class"] == model_class
    assert Path(rt["model_class_file"]).is_relative_to(venv / SITE / package_dir)
    torch_version = _constraint("torch")  # the shared torch venv's, installed by version (any build)
    assert rt["pid"] == scorer.pid and rt["torch"].split("+")[0] == torch_version


def assert_batch_invariant(scorer: S.Scorer, images, prompts, tol: float) -> torch.Tensor:
    batched = scorer.score(images, prompts)
    single = torch.cat([scorer.score([im], [p]) for im, p in zip(images, prompts)])
    assert (
        batched.shape == (len(images),) and batched.dtype == torch.float32 and torch.isfinite(batched).all()
    )
    torch.testing.assert_close(single, batched, rtol=tol, atol=tol)
    assert float(batched.std()) > 10 * tol  # the random model still reacts to its input
    return batched


def test_chunkgrpo_is_not_installed_in_the_reward_venvs():
    for name in ("hpsv2", "imagereward", "hpsv3"):
        venv = reward_venv(name)
        res = subprocess.run(
            [str(venv / "bin" / "python"), "-c", "import chunkgrpo"],
            capture_output=True,
            text=True,
            cwd="/",
            env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
        )
        assert res.returncode != 0 and "No module named 'chunkgrpo'" in res.stderr
        assert (venv / SITE / "zz-shared-torch.pth").read_text().strip().endswith(f"venv-torch/{SITE}")


# ---- HPSv2.1 ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hpsv2(tmp_path_factory):
    venv = reward_venv("hpsv2")
    tiny = build_tiny("hpsv2", venv, tmp_path_factory.mktemp("tiny-hpsv2"))
    scorer = S.get_scorer(
        "hpsv2.1",
        weights=str(Path(tiny["weights"]).parent),
        model_config=tiny["model_config"],
        venv=str(venv),
        device="cpu",
        batch_size=4,
    )
    yield venv, tiny, scorer
    scorer.close()


def test_hpsv2_real_package_scores_images(hpsv2, images):
    venv, tiny, scorer = hpsv2
    assert_real(scorer, venv, "hpsv2", "hpsv2.src.open_clip.model.CLIP")
    assert tiny["model_class"] == "hpsv2.src.open_clip.model.CLIP"
    s = assert_batch_invariant(scorer, images, PROMPTS, 1e-5)
    assert (s.abs() <= 1 + 1e-6).all()  # a cosine, as hpsv2.score returns
    assert "cosine" in scorer.info["scale"] and scorer.info["name"] == "hpsv2.1"


def test_hpsv2_matches_the_packages_own_score_function(hpsv2, images, tmp_path):
    """`hpsv2.img_score.score(paths, prompt, cp=...)` - the package's scoring loop, with its checkpoint load,
    tokenizer, preprocessing and feature product - gives the wrapper's scores. Only its model cache is
    filled beforehand, where it would download the LAION ViT-H-14 weights."""
    venv, tiny, scorer = hpsv2
    paths = []
    for i, im in enumerate(images):
        paths.append(str(tmp_path / f"{i}.png"))
        im.save(paths[-1])
    script = textwrap.dedent(f"""
        import json, sys
        from hpsv2 import img_score
        from hpsv2.src import open_clip as oc
        oc.add_model_config({tiny["model_config"]!r})
        model, _, preprocess_val = oc.create_model_and_transforms(
            "tiny-hpsv2", None, precision="amp", device="cpu", jit=False, force_quick_gelu=False,
            force_custom_text=False, force_patch_dropout=False, force_image_size=None, pretrained_image=False,
            image_mean=None, image_std=None, light_augmentation=True, aug_cfg={{}}, output_dict=True,
            with_score_predictor=False, with_region_predictor=False)
        img_score.model_dict.update(model=model, preprocess_val=preprocess_val)
        out = img_score.score({paths!r}, "a red dog on a green chair", cp={tiny["weights"]!r},
                              hps_version="v2.1")
        print(json.dumps([float(x) for x in out]))
    """)
    res = subprocess.run([str(venv / "bin" / "python"), "-c", script], capture_output=True, text=True,
                         env=WC.worker_env(), timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    official = torch.tensor(json.loads(res.stdout.strip().splitlines()[-1]))
    ours = scorer.score([Image.open(p) for p in paths], ["a red dog on a green chair"] * len(paths))
    torch.testing.assert_close(ours, official.float(), rtol=1e-5, atol=1e-5)


def test_hpsv2_preprocessing_record_is_what_the_package_does(hpsv2):
    """The recorded preprocessing is the package's own `preprocess_val` (light_augmentation=True): the
    LONGEST side resized to 224 and the other padded with black, centred - no crop (a 300x200 landscape
    image keeps all its content in rows 37..186). torchvision, whose resize antialiasing moves these pixels,
    is the one the shared torch venv installs by version and is recorded with the scorer's runtime."""
    venv, tiny, scorer = hpsv2
    script = textwrap.dedent(f"""
        import json
        import numpy as np
        from PIL import Image
        from hpsv2.src import open_clip as oc
        oc.add_model_config({tiny["model_config"]!r})
        _, _, pre = oc.create_model_and_transforms(
            "tiny-hpsv2", None, precision="amp", device="cpu", jit=False, force_quick_gelu=False,
            force_custom_text=False, force_patch_dropout=False, force_image_size=None, pretrained_image=False,
            image_mean=None, image_std=None, light_augmentation=True, aug_cfg={{}}, output_dict=True,
            with_score_predictor=False, with_region_predictor=False)
        x = pre(Image.new("RGB", (300, 200), (255, 255, 255))).numpy()   # white, 3:2 landscape
        black = (0 - np.array(oc.OPENAI_DATASET_MEAN)) / np.array(oc.OPENAI_DATASET_STD)
        rows = [bool(np.allclose(x[:, r, :], black[:, None], atol=1e-5)) for r in range(x.shape[1])]
        print(json.dumps({{"shape": list(x.shape), "black_rows": [r for r, b in enumerate(rows) if b]}}))
    """)
    res = subprocess.run([str(venv / "bin" / "python"), "-c", script], capture_output=True, text=True,
                         env=WC.worker_env(), timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    # 300x200 -> 224x149 (longest side 224), padded by 37 rows above and 38 below
    assert out["shape"] == [3, 224, 224] and out["black_rows"] == list(range(37)) + list(range(186, 224))
    text = scorer.info["preprocessing"]
    assert "LONGEST side to 224" in text and "pad" in text and "crop" not in text.replace("no crop", "")
    # 0.28.0 here (PyPI's build), 0.28.0+cu126 in the images
    assert scorer.info["runtime"]["torchvision"].split("+")[0] == _constraint("torchvision")


def test_hpsv2_v20_name_and_checkpoint_file(hpsv2, images, tmp_path):
    venv, tiny, scorer = hpsv2
    with pytest.raises(UserError, match="HPS_v2_compressed.pt"):  # v2.0 looks for its own file name
        S.get_scorer("hpsv2", weights=str(Path(tiny["weights"]).parent), venv=str(venv))
    with S.get_scorer("hpsv2", weights=tiny["weights"], model_config=tiny["model_config"], venv=str(venv),
                      device="cpu") as v20:
        torch.testing.assert_close(v20.score(images[:2], PROMPTS[:2]), scorer.score(images[:2], PROMPTS[:2]))
        assert v20.info["name"] == "hpsv2"


def test_evaluate_stage_scores_hpsv2_through_its_venv(hpsv2, tiny_model_dir, tmp_path, monkeypatch):
    """The evaluate stage in the main venv (as in the eval image's /opt/venv): CHUNKGRPO_VENV_HPSV2 makes its
    preflight and its HPDv2 scoring run in the reward venv."""
    from chunkgrpo.eval.config import EvalConfig
    from chunkgrpo.eval.runner import run_evaluation

    venv, tiny, _ = hpsv2
    monkeypatch.setenv("CHUNKGRPO_VENV_HPSV2", str(venv))
    cfg = EvalConfig.load("eval_tiny", [f"base_model={tiny_model_dir}", "num_prompts=2",
                                        f"output_dir={tmp_path / 'eval'}", "scorer_device=cpu"])
    cfg = dataclasses.replace(cfg, scorers=["hpsv2.1"], scorer_weights={"hpsv2.1": tiny["weights"]},
                              scorer_options={"hpsv2.1": {"model_config": tiny["model_config"]}})
    result = run_evaluation(cfg)
    sc = result["benchmarks"]["hpdv2"]["results"]["base"]["scorers"]["hpsv2.1"]
    assert sc["n"] == 2 and np.isfinite(sc["mean"]) and abs(sc["mean"]) <= 1
    assert sc["info"]["runs"] == "worker" and sc["info"]["venv"] == str(venv)


class _Payload:
    """Unpickling this runs a shell command (what a malicious checkpoint would do)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_hpsv2_refuses_a_pickled_payload(hpsv2, tmp_path):
    venv, tiny, _ = hpsv2
    marker = tmp_path / "pwned"
    bad = tmp_path / "HPS_v2.1_compressed.pt"
    with open(bad, "wb") as f:
        pickle.dump({"state_dict": _Payload(marker)}, f)
    with pytest.raises(
        UserError, match=r"holds pickled objects other than tensors and is refused \(weights_only=True\)"
    ):
        S.get_scorer(
            "hpsv2.1", weights=str(bad), model_config=tiny["model_config"], venv=str(venv), device="cpu"
        )
    assert not marker.exists()


def test_hpsv2_missing_vocabulary_is_a_preflight_error(hpsv2, tmp_path):
    """The hpsv2 wheel without open_clip's BPE file (as pip installs it) fails at import with
    FileNotFoundError: preflight and loading both say what to do. A venv overlays the real package minus that
    file."""
    venv, tiny, _ = hpsv2
    broken = tmp_path / "venv-hpsv2-novocab"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(broken)], check=True)
    site = broken / SITE
    shutil.copytree(
        venv / SITE / "hpsv2", site / "hpsv2", ignore=shutil.ignore_patterns("bpe_simple_vocab_16e6.txt.gz")
    )
    (site / "zz-reward.pth").write_text(
        f"{venv / SITE}\n" + (venv / SITE / "zz-shared-torch.pth").read_text()
    )
    S._CHECKED.clear()
    with pytest.raises(
        UserError,
        match=r"hpsv2 wheel lacks open_clip's BPE vocabulary .*bpe_simple_vocab_16e6.txt.gz"
        r".*\[venv .*venv-hpsv2-novocab\]",
    ):
        S.check_scorer_package("hpsv2.1", str(broken))
    with pytest.raises(UserError, match="copy bpe_simple_vocab_16e6.txt.gz from the open-clip-torch package"):
        S.get_scorer("hpsv2.1", weights=tiny["weights"], model_config=tiny["model_config"], venv=str(broken))
    S.check_scorer_package("hpsv2.1", str(venv))  # the built venv passes


# ---- ImageReward --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def imagereward(tmp_path_factory):
    venv = reward_venv("imagereward")
    tiny = build_tiny("imagereward", venv, tmp_path_factory.mktemp("tiny-imagereward"))
    mp = pytest.MonkeyPatch()
    mp.setenv("HF_HOME", tiny["hf_home"])  # the worker inherits it: bert-base-uncased comes from this cache
    try:
        scorer = S.get_scorer("imagereward", weights=str(Path(tiny["weights"]).parent), venv=str(venv),
                              device="cpu", batch_size=5)
        yield venv, tiny, scorer
        scorer.close()
    finally:
        mp.undo()


def test_imagereward_real_package_scores_images(imagereward, images):
    venv, tiny, scorer = imagereward
    assert_real(scorer, venv, "ImageReward", "ImageReward.ImageReward.ImageReward")
    # two images share a prompt: that group goes through inference_rank, the third through score
    # (three images only: the package hard-codes a BLIP ViT-L, seconds per image on a CPU)
    s = assert_batch_invariant(
        scorer, images[:3], ["a photo of a cat", "a red dog", "a photo of a cat"], 1e-4
    )
    assert "standardised" in scorer.info["scale"] and s.abs().max() < 1e3
    # the worker builds the model empty and assigns the (float16) checkpoint cast to float32: it scores
    # as the package's own model holding the same weights
    ref = tiny["reference"]
    ours = scorer.score([Image.open(ref["image"])], [ref["prompt"]])
    torch.testing.assert_close(ours.double(), torch.tensor([ref["score"]], dtype=torch.float64),
                               rtol=1e-5, atol=1e-5)


def test_imagereward_without_bert_tokenizer_is_a_clear_error(imagereward, monkeypatch, tmp_path):
    venv, tiny, _ = imagereward
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty-hf-home"))
    S._CHECKED.clear()
    with pytest.raises(
        UserError,
        match=r"`bert-base-uncased` tokenizer \(vocab.txt\) is not in the Hugging Face "
        r"cache \(HF_HOME=.*empty-hf-home\).*\[venv .*venv-imagereward\]",
    ):
        S.check_scorer_package("imagereward", str(venv))
    with pytest.raises(UserError, match="bert-base-uncased"):
        S.get_scorer("imagereward", weights=str(Path(tiny["weights"]).parent), venv=str(venv), device="cpu")


def test_imagereward_tokenizer_from_the_model_cache_scores_with_an_empty_hf_home(imagereward, images,
                                                                                 monkeypatch, tmp_path):
    """In a pod HF_HOME is a fresh volume: the BERT tokenizer comes from the model cache as the scorer's
    `processor` and is installed into the HF cache under the name the package loads it by."""
    venv, tiny, scorer = imagereward
    snap = sorted((Path(tiny["hf_home"]) / "hub" / "models--bert-base-uncased" / "snapshots").iterdir())[0]
    folder = tmp_path / "bert-base-uncased"
    shutil.copytree(snap, folder)
    home = tmp_path / "fresh-hf-home"
    monkeypatch.setenv("HF_HOME", str(home))
    S._CHECKED.clear()
    with S.get_scorer("imagereward", weights=str(Path(tiny["weights"]).parent), processor=str(folder),
                      venv=str(venv), device="cpu", batch_size=5) as fresh:
        got = fresh.score(images[:1], ["a photo of a cat"])
    want = scorer.score(images[:1], ["a photo of a cat"])
    assert torch.allclose(got, want, rtol=1e-6, atol=0)
    assert (home / "hub" / "models--bert-base-uncased" / "refs" / "main").is_file()


# ---- HPSv3 --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hpsv3(tmp_path_factory):
    venv = reward_venv("hpsv3")
    tiny = build_tiny("hpsv3", venv, tmp_path_factory.mktemp("tiny-hpsv3"))
    scorer = S.get_scorer("hpsv3", weights=str(Path(tiny["weights"]).parent), processor=tiny["processor"],
                          venv=str(venv), device="cpu", batch_size=5)
    yield venv, tiny, scorer
    scorer.close()


def test_hpsv3_real_package_scores_images(hpsv3, images):
    venv, tiny, scorer = hpsv3
    assert_real(scorer, venv, "hpsv3", "hpsv3.model.qwen2vl_trainer.Qwen2VLRewardModelBT")
    assert_batch_invariant(scorer, images, PROMPTS, 1e-4)
    info = scorer.info
    assert "mu" in info["scale"] and info["base_model"] == tiny["processor"] and "float32" in info["backend"]


def test_grpo_trains_on_hpsv3_through_its_venv(hpsv3, tiny_model_dir, tmp_path):
    """The training stage uses the same boundary: one chunk-GRPO iteration with HPSv3 as the reward."""
    from chunkgrpo.train.config import TrainConfig
    from chunkgrpo.train.trainer import Trainer

    venv, tiny, _ = hpsv3
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat on a chair\na red car\n")
    cfg = TrainConfig.load("tiny_cpu", [
        f"model={tiny_model_dir}", f"prompts={prompts}", f"output_dir={tmp_path / 'run'}", "progress=false",
        "max_steps=1", "group_size=2", "grad_accum=1", "checkpoint.every=0",
        f"rewards=[{{name: hpsv3, weight: 1.0, options: {{weights: {Path(tiny['weights']).parent}, "
        f"processor: {tiny['processor']}, venv: {venv}}}}}]"])
    t = Trainer(cfg)
    try:
        t.setup()
        fn = t.reward_fns["hpsv3"]
        assert isinstance(fn.scorer, S.WorkerScorer) and fn.scorer.info["runtime"]["package"] == "hpsv3"
        m = t.iteration()
        assert np.isfinite(m["reward/hpsv3"]) and np.isfinite(m["loss"])
    finally:
        t.close()
        for fn in t.reward_fns.values():
            fn.close()


def test_imagereward_checkpoint_missing_weights_fails_naming_them(imagereward, tmp_path):
    """The package loads with strict=False: a checkpoint without its MLP head used to load and score
    (with the head at random init) without a word. Loaded strictly, it fails in one line naming the keys."""
    venv, tiny, _ = imagereward
    state = torch.load(tiny["weights"], map_location="cpu", weights_only=True)
    head = sorted(k for k in state if k.startswith("mlp."))
    assert head  # the real model has an MLP head
    folder = tmp_path / "no-head"
    folder.mkdir()
    torch.save(
        {k: v for k, v in state.items() if not k.startswith("mlp.")}, folder / Path(tiny["weights"]).name
    )
    shutil.copy(tiny["med_config"], folder / "med_config.json")
    with pytest.raises(UserError) as e:
        S.get_scorer("imagereward", weights=str(folder), venv=str(venv), device="cpu")
    msg = str(e.value)
    assert "\n" not in msg and f"lacks {len(head)} of the model's" in msg and head[0] in msg
    assert "no-head" in msg
