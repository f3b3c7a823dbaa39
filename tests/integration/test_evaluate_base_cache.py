"""chunkgrpo.eval.base_cache: base-model images shared between evaluations through the real local S3.
A second evaluation takes every base image from the cache, generates only the trained label, and ends
with the same metrics as the first; other sampling settings use another key; a broken cache never fails
an evaluation."""

import json
import logging
import uuid

import pytest

from chunkgrpo.eval import base_cache
from chunkgrpo.eval.config import EvalConfig
from chunkgrpo.eval.runner import run_evaluation

pytestmark = pytest.mark.integration


def _config(model, base, out, cache, *extra):
    return EvalConfig.load("eval_tiny", [f"model={model}", f"base_model={base}", "num_prompts=3",
                                         f"output_dir={out}", f"base_cache={cache}", "experiment=base-cache",
                                         *extra])


def test_second_evaluation_takes_the_base_images_from_the_cache(services_env, tiny_model_dir, trained_dir,
                                                                  tmp_path):
    from chunkgrpo.store.client import ArtifactStore

    store = ArtifactStore(services_env.store_config)
    store.ensure_bucket()
    cache = store.uri(f"tests/base-cache-{uuid.uuid4().hex[:6]}")
    first = run_evaluation(_config(trained_dir, tiny_model_dir, tmp_path / "a", cache))
    g1 = first["generation"]
    assert g1["base_from_cache"] == 0 and g1["base_to_cache"] == 3 and g1["images_generated"] == 6
    root = g1["base_cache"]
    key = json.loads(store.get_bytes(root + "/key.json"))
    assert key["sampling"]["num_steps"] == 6 and "trained_steps" not in key["sampling"]
    assert key["base_model"] == base_cache.model_digest(str(tiny_model_dir))

    second = run_evaluation(_config(trained_dir, tiny_model_dir, tmp_path / "b", cache))
    g2 = second["generation"]
    assert g2["base_cache"] == root
    assert g2["base_from_cache"] == 3 and g2["base_to_cache"] == 0
    assert g2["images_generated"] == 3  # the trained label only
    assert g2["transformer_calls"].get("base", 0) < g1["transformer_calls"]["base"]
    for i in ("000", "001", "002"):
        assert (tmp_path / "b/hpdv2/base" / f"{i}.png").read_bytes() == \
            (tmp_path / "a/hpdv2/base" / f"{i}.png").read_bytes()
    assert second["metrics"] == first["metrics"]  # the paired statistics see the same base images

    # other sampling settings are another key: nothing fetched
    other = run_evaluation(_config(trained_dir, tiny_model_dir, tmp_path / "c", cache, "sampling.num_steps=5",
                                   "sampling.trained_steps=3"))
    assert other["generation"]["base_cache"] != root and other["generation"]["base_from_cache"] == 0


def test_an_s3_outage_is_a_warning_and_the_evaluation_goes_on(services_env, tiny_model_dir, trained_dir,
                                                               tmp_path, caplog, monkeypatch):
    from chunkgrpo.errors import UserError
    from chunkgrpo.store.client import ArtifactStore

    def down(*args, **kwargs):
        raise ConnectionError("S3 down")

    monkeypatch.setattr(ArtifactStore, "list", down)
    monkeypatch.setattr(ArtifactStore, "put_file", down)
    cache = ArtifactStore(services_env.store_config).uri(f"tests/base-cache-{uuid.uuid4().hex[:6]}")
    with caplog.at_level(logging.WARNING, logger="chunkgrpo.eval.base_cache"):
        result = run_evaluation(_config(trained_dir, tiny_model_dir, tmp_path / "a", cache))
    g = result["generation"]
    assert g["base_from_cache"] == 0 and g["base_to_cache"] == 0 and g["images_generated"] == 6
    assert "hpdv2.brightness.delta" in result["metrics"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("unreadable" in w and "S3 down" in w for w in warnings)
    assert any("upload failed" in w and "S3 down" in w for w in warnings)
    with pytest.raises(UserError, match="base_cache"):  # a malformed prefix is a bad input, not an outage
        _config(trained_dir, tiny_model_dir, tmp_path / "b", "s3://Bad_Bucket/x")


def test_key_follows_what_a_base_image_depends_on(tiny_model_dir):
    digest = base_cache.model_digest(str(tiny_model_dir))
    sampling = EvalConfig.load("eval_tiny", ["model=x"]).sampling.to_dict()
    key = base_cache.cache_key(base_cache.cache_inputs(sampling, 42, "torch.float32", "cpu", digest))
    same = base_cache.cache_key(base_cache.cache_inputs({**sampling, "trained_steps": 1}, 42, "torch.float32",
                                                        "cpu", digest))
    assert same == key  # the trained steps only concern the trained label
    for changed in (base_cache.cache_inputs({**sampling, "num_steps": 7}, 42, "torch.float32", "cpu", digest),
                    base_cache.cache_inputs(sampling, 43, "torch.float32", "cpu", digest),
                    base_cache.cache_inputs(sampling, 42, "torch.bfloat16", "cpu", digest),
                    base_cache.cache_inputs(sampling, 42, "torch.float32", "cpu", "0" * 64)):
        assert base_cache.cache_key(changed) != key
    assert base_cache.model_digest("black-forest-labs/FLUX.1-dev") is None  # a hub id: not cached
    assert base_cache.open_cache("", str(tiny_model_dir), sampling, 42, "torch.float32", "cpu") is None
    assert base_cache.default_prefix("s3://chunkgrpo-checkpoints/pipeline-runs") == \
        "s3://chunkgrpo-checkpoints/eval-base-cache"


def test_a_local_folder_with_its_download_manifest_is_not_read_again(tmp_path):
    """A folder downloaded from the model cache carries MANIFEST.json: its digest is the manifest's (the S3
    copy's) as long as the listed files are there at their sizes; otherwise the files are hashed."""
    from chunkgrpo.store.manifest import MANIFEST_NAME, build_manifest

    model = tmp_path / "model"
    (model / "transformer").mkdir(parents=True)
    (model / "transformer" / "weights.bin").write_bytes(b"a" * 64)
    (model / "model_index.json").write_text("{}")
    manifest = build_manifest(model)
    (model / MANIFEST_NAME).write_bytes(manifest.to_json())
    assert base_cache.model_digest(str(model)) == manifest.content_sha256

    (model / "transformer" / "weights.bin").write_bytes(b"b" * 64)  # same size: the manifest is trusted
    assert base_cache.model_digest(str(model)) == manifest.content_sha256
    (model / "transformer" / "weights.bin").write_bytes(b"b" * 65)  # another size: hashed again
    hashed = build_manifest(model).content_sha256
    assert base_cache.model_digest(str(model)) == hashed != manifest.content_sha256
    (model / "transformer" / "weights.bin").write_bytes(b"a" * 64)
    (model / "extra.txt").write_text("x")                            # a file the manifest does not list
    hashed = build_manifest(model).content_sha256
    assert base_cache.model_digest(str(model)) == hashed != manifest.content_sha256
