"""Scorers: tiny random-weight CLIP / PickScore through the real transformers code path; import guards of the
reward-package scorers, checkpoint loading, config validation. The reward packages themselves run in
test_scorers_packages.py (in their venvs) and the worker boundary in test_worker.py."""

from __future__ import annotations

import os
import pickle
import shutil
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from chunkgrpo.errors import UserError
from chunkgrpo.scoring import backends as B
from chunkgrpo.scoring import scorers as S
from chunkgrpo.scoring.table import canonical_name
from chunkgrpo.scoring.weights import resolve_weights
from chunkgrpo.testing.clip import make_tiny_clip
from tests.cpu_kernels import tol

PROMPTS = ["a photo of a cat", "a red dog", "the blue cat"]


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory):
    return make_tiny_clip(tmp_path_factory.mktemp("tiny_clip"), seed=0)


@pytest.fixture(scope="module")
def images():
    rng = np.random.default_rng(0)
    # different sizes/aspect ratios exercise resize + centre crop
    return [
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))
        for h, w in [(48, 40), (64, 64), (30, 90)]
    ]


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
    assert "logit_scale" in pick.info["scale"] and pick.info["logit_scale_exp"] == pytest.approx(
        100.0, rel=1e-3
    )
    with pytest.raises(UserError, match="multiplier"):
        S.get_scorer("pickscore", weights=str(tiny_clip), multiplier=2.0)


@pytest.mark.exactness
def test_preprocess_matches_transformers_processor(tiny_clip, images):
    from transformers import CLIPImageProcessor

    ref = CLIPImageProcessor.from_pretrained(str(tiny_clip))(images=images, return_tensors="pt")[
        "pixel_values"
    ]
    ours = B.ClipPreprocess.from_dir(tiny_clip)(images)
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
    assert canonical_name("HPSv2_1") == "hpsv2.1" and canonical_name("ImageReward") == "imagereward"


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
        resolve_weights("gs://x/y", what="clip")


# ---- reward-package scorers without their venv
# (the real packages run in tests/unit/scoring/test_scorers_packages.py)


@pytest.mark.parametrize("name,module", [("hpsv3", "hpsv3"), ("imagereward", "ImageReward"),
                                         ("hpsv2.1", "hpsv2"), ("hpsv2", "hpsv2")])
def test_import_guard_messages(monkeypatch, tmp_path, name, module):
    from chunkgrpo.scoring import client as WC

    monkeypatch.delenv(WC.venv_var(name), raising=False)  # in-process: the package must import here
    monkeypatch.setitem(sys.modules, module, None)  # makes `import module` raise ImportError
    with pytest.raises(UserError) as exc:
        S.get_scorer(name, weights=str(tmp_path))
    msg = str(exc.value)
    assert f"`{module}`" in msg and "images/eval" in msg and "pip install" in msg
    assert WC.venv_var(name) in msg and "scripts/reward-envs.sh" in msg


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):  # unpickling runs a shell command
        return (os.system, (f"touch {self.marker}",))


def test_checkpoint_loads_refuse_pickled_code(tmp_path):
    """Every checkpoint the scorers read with torch.load goes through weights_only=True."""
    marker = tmp_path / "pwned"
    with open(tmp_path / "bad.pt", "wb") as f:
        pickle.dump({"state_dict": _Payload(marker)}, f)
    with pytest.raises(
        B.SpecError, match=r"is refused \(weights_only=True\).*Re-save it as a plain state_dict"
    ):
        B.safe_torch_load(tmp_path / "bad.pt", "hpsv2.1: checkpoint")
    assert not marker.exists()
    torch.save({"state_dict": {"w": torch.ones(2)}}, tmp_path / "good.pt")
    assert torch.equal(B.safe_torch_load(tmp_path / "good.pt", "x")["state_dict"]["w"], torch.ones(2))


def test_scorer_config_validation(tmp_path):
    with pytest.raises(UserError, match="model_config=.* only applies to hpsv2"):
        S.get_scorer("clip", weights=str(tmp_path), model_config="x.json")
    with pytest.raises(UserError, match="timeout=0.0"):
        S.get_scorer("clip", weights=str(tmp_path), timeout=0)
    with pytest.raises(UserError, match="restarts=-1"):
        S.get_scorer("clip", weights=str(tmp_path), restarts=-1)


def test_in_process_backend_scorer_matches_clip_scorer(tiny_clip, images):
    """InProcessScorer (the in-process path of the package scorers) runs the worker's backend code."""
    spec = S.scorer_spec(S.ScorerConfig(name="pickscore", weights=str(tiny_clip), device="cpu"))
    s = S.InProcessScorer("pickscore", spec, batch_size=2)
    ref = S.get_scorer("pickscore", weights=str(tiny_clip), device="cpu", venv="")
    torch.testing.assert_close(s.score(images, PROMPTS), ref.score(images, PROMPTS), rtol=1e-6, atol=1e-6)
    assert s.info["runs"] == "in-process" and s.info["runtime"]["model_class"].endswith("CLIPModel")


def test_bpe_builder_roundtrip(tiny_clip):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_clip), local_files_only=True)
    ids = tok("a photo of a cat")["input_ids"]
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id
    assert tok.convert_ids_to_tokens(ids[1:-1]) == ["a</w>", "photo</w>", "of</w>", "a</w>", "cat</w>"]
    assert tok.model_max_length == 77


def test_s3_weights_through_chunkgrpo_store(monkeypatch, tiny_clip, tmp_path):
    """Without a fetch hook, s3:// weights come from chunkgrpo.store.client.ArtifactStore (faked here): a raw
    prefix (no MANIFEST) is copied object by object; a single-object URI lands in the cache folder."""
    import chunkgrpo.store.client as store_mod
    from chunkgrpo.store import parse_s3_uri

    objects = {f"scorers/tiny/{p.name}": p for p in tiny_clip.iterdir() if p.is_file()}
    objects["scorers/HPS_v2.1_compressed.pt"] = tiny_clip / "config.json"

    class FakeStore:
        def is_complete(self, uri):
            return False

        def list(self, prefix):
            _, key = parse_s3_uri(prefix)
            return [store_mod.ObjectEntry(k, 1, None) for k in sorted(objects) if k.startswith(key)]

        def exists(self, uri):
            return parse_s3_uri(uri)[1] in objects

        def stat(self, uri):
            key = store_mod.parse_s3_uri(uri)[1]
            return {"size": objects[key].stat().st_size, "etag": None} if key in objects else None

        def get_file(self, uri, local_path):
            local_path.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(objects[parse_s3_uri(uri)[1]], local_path)

    monkeypatch.setattr(store_mod, "ArtifactStore", FakeStore)
    scorer = S.get_scorer("clip", weights="s3://models/scorers/tiny", cache_dir=str(tmp_path), device="cpu")
    assert scorer.score([Image.new("RGB", (40, 40))], ["a cat"]).shape == (1,)
    one = resolve_weights(
        "s3://models/scorers/HPS_v2.1_compressed.pt", what="hpsv2.1", cache_dir=str(tmp_path)
    )
    assert (one / "HPS_v2.1_compressed.pt").is_file()
    with pytest.raises(UserError, match="nothing is stored under"):
        resolve_weights("s3://models/none", what="clip", cache_dir=str(tmp_path))


def test_s3_weights_notice_a_changed_remote(monkeypatch, tmp_path):
    """s3:// weights go through the store's cache: an unchanged prefix / object is reused, a changed one
    (another listing, another size or etag) is downloaded again instead of served stale."""
    import chunkgrpo.store.client as store_mod

    objects = {"w/a.bin": b"v1", "one.pt": b"v1"}
    gets = []

    class FakeStore:
        def is_complete(self, uri):
            return False

        def list(self, prefix):
            _, key = store_mod.parse_s3_uri(prefix)
            return [store_mod.ObjectEntry(k, len(v), None) for k, v in sorted(objects.items())
                    if k.startswith(key)]

        def exists(self, uri):
            return store_mod.parse_s3_uri(uri)[1] in objects

        def stat(self, uri):
            key = store_mod.parse_s3_uri(uri)[1]
            return {"size": len(objects[key]), "etag": objects[key].hex()} if key in objects else None

        def get_file(self, uri, local_path):
            gets.append(uri)
            local_path.parent.mkdir(parents=True, exist_ok=True)
            local_path.write_bytes(objects[store_mod.parse_s3_uri(uri)[1]])

    monkeypatch.setattr(store_mod, "ArtifactStore", FakeStore)
    monkeypatch.setenv("CHUNKGRPO_CACHE", str(tmp_path))
    for uri, rel in (("s3://models/w", "a.bin"), ("s3://models/one.pt", "one.pt")):
        first = resolve_weights(uri, what="clip")
        assert first.is_relative_to(tmp_path / "weights") and (first / rel).read_bytes() == b"v1"
        n = len(gets)
        assert resolve_weights(uri, what="clip") == first and len(gets) == n  # unchanged: reused
        objects["w/a.bin" if rel == "a.bin" else "one.pt"] = b"v2!"
        second = resolve_weights(uri, what="clip")
        assert len(gets) == n + 1 and (second / rel).read_bytes() == b"v2!"


def test_scorer_weights_follow_the_store_cache_when_only_chunkgrpo_cache_is_set(tmp_path, monkeypatch):
    """Pods set CHUNKGRPO_CACHE to their /cache volume and HOME=/tmp: scorer weights (HPSv3 ~15 GiB) must
    go to that volume, not to ~/.cache. Setting CHUNKGRPO_CACHE moves them (one cache: the store's)."""
    from chunkgrpo.store import cache as store

    def fetch(uri, dest):
        (dest / "w.bin").write_bytes(b"w")

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("CHUNKGRPO_CACHE", str(tmp_path / "volume"))
    assert store.cache_root() == tmp_path / "volume"
    assert resolve_weights("s3://m/w", what="clip", fetch=fetch).parent.parent == tmp_path / "volume"
    monkeypatch.setenv("CHUNKGRPO_CACHE", str(tmp_path / "explicit"))
    assert store.cache_root() == tmp_path / "explicit"
    assert resolve_weights("s3://m/w", what="clip", fetch=fetch).parent.parent == tmp_path / "explicit"
