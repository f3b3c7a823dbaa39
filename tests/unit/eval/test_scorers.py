"""Scorers: tiny random-weight CLIP / PickScore through the real transformers code path; import guards and
adapter glue for the evaluation-image-only packages (hpsv2, hpsv3, image-reward) with fake modules."""

from __future__ import annotations

import shutil
import sys
import types

import numpy as np
import pytest
import torch
from PIL import Image

from chunkgrpo.errors import UserError
from chunkgrpo.eval import scorers as S
from tests.cpu_kernels import tol

PROMPTS = ["a photo of a cat", "a red dog", "the blue cat"]


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory):
    return S.make_tiny_clip(tmp_path_factory.mktemp("tiny_clip"), seed=0)


@pytest.fixture(scope="module")
def images():
    rng = np.random.default_rng(0)
    # different sizes/aspect ratios exercise resize + centre crop
    return [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for h, w in [(48, 40), (64, 64), (30, 90)]]


@pytest.fixture(scope="module")
def pick(tiny_clip):
    return S.get_scorer("pickscore", weights=str(tiny_clip), device="cpu")


@pytest.fixture(scope="module")
def clip(tiny_clip):
    return S.get_scorer("clip", weights=str(tiny_clip), device="cpu", batch_size=2)


@pytest.mark.exactness
def test_pickscore_shape_dtype_finite_deterministic(pick, tiny_clip, images):
    s1 = pick.score(images, PROMPTS)
    assert s1.shape == (3,) and s1.dtype == torch.float32 and torch.isfinite(s1).all()
    assert torch.equal(s1, pick.score(images, PROMPTS))  # the same call again: bit-exact
    again = S.get_scorer("pickscore", weights=str(tiny_clip), device="cpu", batch_size=1)
    # batch-size invariant: batch 1 vs 3 runs other kernels, so fp32 tolerance
    torch.testing.assert_close(again.score(images, PROMPTS), s1, **tol(torch.float32))


def test_prompt_sensitivity(pick, clip, images):
    for scorer in (pick, clip):
        a = scorer.score(images, PROMPTS)
        b = scorer.score(images, ["a photo of a dog"] * 3)
        assert not torch.allclose(a, b)


@pytest.mark.exactness
def test_pickscore_is_logit_scale_times_clip_cosine(pick, clip, images):
    cos = clip.score(images, PROMPTS)
    assert cos.abs().max() <= 1.0 + 1e-5
    ls = float(pick.model.logit_scale.exp())
    assert ls == pytest.approx(100.0, rel=1e-3)
    # two scorer instances, values up to 100: fp32 with ~1000 ulp
    torch.testing.assert_close(pick.score(images, PROMPTS), ls * cos, **tol(torch.float32, ulps=1000))


@pytest.mark.exactness
def test_clip_multiplier_and_info(tiny_clip, clip, pick, images):
    c100 = S.get_scorer("clip", weights=str(tiny_clip), device="cpu", multiplier=100)
    torch.testing.assert_close(c100.score(images, PROMPTS), 100 * clip.score(images, PROMPTS),
                               **tol(torch.float32, ulps=1000))  # batch 3 vs 2 kernels, x100
    for scorer, name in ((clip, "clip"), (pick, "pickscore")):
        info = scorer.info
        assert info["name"] == name
        assert info["weights"] == str(tiny_clip)
        assert "center-crop" in info["preprocessing"] and "mean" in info["preprocessing"]
        assert "cosine" in info["scale"]
    assert "logit_scale" in pick.info["scale"] and pick.info["logit_scale_exp"] == pytest.approx(100.0, rel=1e-3)
    with pytest.raises(UserError, match="multiplier"):
        S.get_scorer("pickscore", weights=str(tiny_clip), multiplier=2.0)


@pytest.mark.exactness
def test_preprocess_matches_transformers_processor(tiny_clip, images):
    from transformers import CLIPImageProcessor

    ref = CLIPImageProcessor.from_pretrained(str(tiny_clip))(images=images, return_tensors="pt")["pixel_values"]
    ours = S.ClipPreprocess.from_dir(tiny_clip)(images)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-5)  # normalised pixels of order 1: ~100 ulp of fp32


def test_tensor_and_array_inputs(pick, images):
    arrays = [np.asarray(im) for im in images[:2]]
    t = torch.stack([torch.from_numpy(a.copy()).permute(2, 0, 1).float() / 255 for a in arrays[:1]] * 2)
    torch.testing.assert_close(pick.score(arrays, PROMPTS[:2]), pick.score(images[:2], PROMPTS[:2]))
    assert pick.score(t, PROMPTS[:2]).shape == (2,)
    assert pick.score([], []).shape == (0,)


def test_input_errors(pick, images):
    with pytest.raises(UserError, match="3 images but 2 prompts"):
        pick.score(images, PROMPTS[:2])
    with pytest.raises(UserError, match="list of strings"):
        pick.score(images[:1], "a cat")


def test_registry_errors(tmp_path):
    with pytest.raises(UserError, match="did you mean 'pickscore'"):
        S.get_scorer("pickscor", weights=str(tmp_path))
    with pytest.raises(UserError, match="hub id"):
        S.get_scorer("clip", weights="openai/clip-vit-large-patch14")
    with pytest.raises(UserError, match="no weights"):
        S.get_scorer("clip")
    with pytest.raises(UserError, match="unknown ScorerConfig option"):
        S.get_scorer("clip", weights=str(tmp_path), wieghts="x")
    with pytest.raises(UserError, match="cannot load a transformers CLIP"):
        S.get_scorer("clip", weights=str(tmp_path), device="cpu")
    assert S.canonical_name("HPSv2_1") == "hpsv2.1" and S.canonical_name("ImageReward") == "imagereward"


def test_s3_weights_through_fetch_hook_and_cache(tiny_clip, tmp_path, images):
    calls = []

    def fetch(uri, dest):
        calls.append(uri)
        shutil.copytree(tiny_clip, dest, dirs_exist_ok=True)

    kw = dict(weights="s3://models/scorers/tiny-clip", cache_dir=str(tmp_path), device="cpu", fetch=fetch)
    a = S.get_scorer("clip", **kw)
    b = S.get_scorer("clip", **kw)
    assert calls == ["s3://models/scorers/tiny-clip"]  # downloaded once, then served from the cache
    assert a.info["weights"] == "s3://models/scorers/tiny-clip"
    torch.testing.assert_close(a.score(images, PROMPTS), b.score(images, PROMPTS))
    with pytest.raises(UserError, match="unsupported weights URI"):
        S.resolve_weights("gs://x/y", what="clip")


# ---- evaluation-image-only packages -------------------------------------------------------------


@pytest.mark.parametrize("name,module", [("hpsv3", "hpsv3"), ("imagereward", "ImageReward"),
                                         ("hpsv2.1", "hpsv2"), ("hpsv2", "hpsv2")])
def test_import_guard_messages(monkeypatch, tmp_path, name, module):
    monkeypatch.setitem(sys.modules, module, None)  # makes `import module` raise ImportError
    with pytest.raises(UserError) as exc:
        S.get_scorer(name, weights=str(tmp_path))
    msg = str(exc.value)
    assert f"`{module}`" in msg and "images/eval" in msg and "pip install" in msg


def _fake_module(monkeypatch, name, **attrs):
    mod = types.ModuleType(name)
    for k, v in attrs.items():
        setattr(mod, k, v)
    monkeypatch.setitem(sys.modules, name, mod)
    return mod


def test_hpsv3_adapter_takes_mu_column(monkeypatch, tmp_path, images):
    seen = {}

    class FakeInferencer:
        def __init__(self, config_path=None, checkpoint_path=None, device="cuda"):
            seen.update(config_path=config_path, checkpoint_path=checkpoint_path, device=device)

        def reward(self, image_paths, prompts):  # images first, like hpsv3
            assert all(isinstance(im, Image.Image) for im in image_paths)
            return torch.tensor([[float(len(p)), 0.5] for p in prompts])

    mod = _fake_module(monkeypatch, "hpsv3", HPSv3RewardInferencer=FakeInferencer)
    mod.__file__ = str(tmp_path / "hpsv3" / "__init__.py")
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "HPSv3.safetensors").write_bytes(b"x")
    (tmp_path / "qwen").mkdir()
    scorer = S.get_scorer("hpsv3", weights=str(tmp_path / "w"), processor=str(tmp_path / "qwen"), device="cpu",
                          batch_size=2, cache_dir=str(tmp_path / "cache"))
    out = scorer.score(images, PROMPTS)
    assert out.tolist() == [float(len(p)) for p in PROMPTS]
    assert seen["checkpoint_path"].endswith("HPSv3.safetensors") and seen["device"] == "cpu"
    import yaml

    assert yaml.safe_load(open(seen["config_path"]))["model_name_or_path"] == str(tmp_path / "qwen")
    assert "mu" in scorer.info["scale"]
    with pytest.raises(UserError, match="HPSv3.safetensors"):
        S.get_scorer("hpsv3", weights=str(tmp_path / "qwen"))


def test_imagereward_adapter_pairs_prompts(monkeypatch, tmp_path, images):
    class FakeModel:
        def eval(self):
            return self

        def score(self, prompt, image):
            assert isinstance(prompt, str) and isinstance(image, Image.Image)
            return len(prompt) / 10

    loads = []

    def load(name, device="cuda", med_config=None):
        loads.append((name, device, med_config))
        return FakeModel()

    _fake_module(monkeypatch, "ImageReward", load=load)
    (tmp_path / "ImageReward.pt").write_bytes(b"x")
    (tmp_path / "med_config.json").write_text("{}")
    scorer = S.get_scorer("imagereward", weights=str(tmp_path), device="cpu")
    assert scorer.score(images, PROMPTS).tolist() == pytest.approx([len(p) / 10 for p in PROMPTS])
    assert loads[0][0].endswith("ImageReward.pt") and loads[0][2].endswith("med_config.json")
    assert "standardised" in scorer.info["scale"]


def test_imagereward_missing_med_config(monkeypatch, tmp_path):
    _fake_module(monkeypatch, "ImageReward", load=lambda *a, **k: None)
    (tmp_path / "ImageReward.pt").write_bytes(b"x")
    with pytest.raises(UserError, match="med_config.json"):
        S.get_scorer("imagereward", weights=str(tmp_path))


def test_hpsv2_adapter_cosine_diag(monkeypatch, tmp_path, images):
    """Glue around hpsv2's open_clip: checkpoint lookup, state-dict load, diag(img @ txt.T) per pair."""

    class FakeModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def forward(self, pixels, text):
            img = torch.nn.functional.normalize(pixels.flatten(1)[:, :4] + 1.0, dim=-1)
            txt = torch.nn.functional.normalize(text[:, :4].float() + 1.0, dim=-1)
            return {"image_features": img, "text_features": txt}

    def create_model_and_transforms(name, pretrained, **kw):
        assert name == "ViT-H-14" and pretrained is None
        return FakeModel(), None, lambda im: torch.from_numpy(np.asarray(im.resize((4, 4)), np.float32)).permute(2, 0, 1)

    def get_tokenizer(name):
        return lambda texts: torch.tensor([[len(t), 1, 2, 3] for t in texts])

    _fake_module(monkeypatch, "hpsv2")
    _fake_module(monkeypatch, "hpsv2.src")
    _fake_module(monkeypatch, "hpsv2.src.open_clip", create_model_and_transforms=create_model_and_transforms,
                 get_tokenizer=get_tokenizer)
    torch.save({"state_dict": {"w": torch.ones(1)}}, tmp_path / "HPS_v2.1_compressed.pt")
    scorer = S.get_scorer("hpsv2.1", weights=str(tmp_path), device="cpu", batch_size=2)
    out = scorer.score(images, PROMPTS)
    assert out.shape == (3,) and torch.isfinite(out).all() and (out.abs() <= 1 + 1e-6).all()
    assert float(scorer.model.w.detach()) == 1.0  # checkpoint was loaded
    assert "cosine" in scorer.info["scale"] and scorer.info["name"] == "hpsv2.1"
    with pytest.raises(UserError, match="HPS_v2_compressed.pt"):
        S.get_scorer("hpsv2", weights=str(tmp_path))


def test_bpe_builder_roundtrip(tiny_clip):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_clip), local_files_only=True)
    ids = tok("a photo of a cat")["input_ids"]
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id
    assert tok.convert_ids_to_tokens(ids[1:-1]) == ["a</w>", "photo</w>", "of</w>", "a</w>", "cat</w>"]
    assert tok.model_max_length == 77


def test_s3_weights_through_chunkgrpo_store(monkeypatch, tiny_clip, tmp_path):
    """Without a fetch hook, s3:// weights come from chunkgrpo.store.ArtifactStore (faked here): a raw prefix
    (no MANIFEST) is copied object by object; a single-object URI lands in the cache folder."""
    import chunkgrpo.store as store_mod

    objects = {f"scorers/tiny/{p.name}": p for p in tiny_clip.iterdir() if p.is_file()}
    objects["scorers/HPS_v2.1_compressed.pt"] = tiny_clip / "config.json"

    class FakeStore:
        def is_complete(self, uri):
            return False

        def list(self, prefix):
            _, key = store_mod.parse_s3_uri(prefix)
            return [store_mod.ObjectEntry(k, 1, None) for k in sorted(objects) if k.startswith(key)]

        def exists(self, uri):
            return store_mod.parse_s3_uri(uri)[1] in objects

        def get_file(self, uri, local_path):
            local_path.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(objects[store_mod.parse_s3_uri(uri)[1]], local_path)

    monkeypatch.setattr(store_mod, "ArtifactStore", FakeStore)
    scorer = S.get_scorer("clip", weights="s3://models/scorers/tiny", cache_dir=str(tmp_path), device="cpu")
    assert scorer.score([Image.new("RGB", (40, 40))], ["a cat"]).shape == (1,)
    one = S.resolve_weights("s3://models/scorers/HPS_v2.1_compressed.pt", what="hpsv2.1", cache_dir=str(tmp_path))
    assert (one / "HPS_v2.1_compressed.pt").is_file()
    with pytest.raises(UserError, match="nothing is stored under"):
        S.resolve_weights("s3://models/none", what="clip", cache_dir=str(tmp_path))
