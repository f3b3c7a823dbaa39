"""chunkgrpo.model_cache.sync from a hub repo: a diffusers pipeline repo contributes only what the pipeline
loads (model_index.json and the folders of the components it names), never the repo's single-file
copies (FLUX.1-dev's flux1-dev.safetensors and ae.safetensors, 24 GB nothing loads); any other repo
(reward weights, a reward's base model) is synced whole. The hub is a local hub cache (offline)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from chunkgrpo import model_cache

INDEX = {"_class_name": "FluxPipeline", "_diffusers_version": "0.30.0",
         "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
         "text_encoder": ["transformers", "CLIPTextModel"], "tokenizer": ["transformers", "CLIPTokenizer"],
         "transformer": ["diffusers", "FluxTransformer2DModel"], "vae": ["diffusers", "AutoencoderKL"],
         "image_encoder": [None, None]}
PIPELINE_FILES = ["model_index.json", "scheduler/scheduler_config.json", "text_encoder/config.json",
                  "text_encoder/model.safetensors", "tokenizer/vocab.json", "transformer/config.json",
                  "transformer/diffusion_pytorch_model-00001-of-00002.safetensors",
                  "transformer/diffusion_pytorch_model-00002-of-00002.safetensors", "vae/config.json",
                  "vae/diffusion_pytorch_model.safetensors"]
UNLOADED = ["flux1-dev.safetensors", "ae.safetensors", "README.md", "dev_grid.jpg", "LICENSE.md"]


def _hub_repo(hub: Path, repo: str, files: dict[str, bytes]) -> None:
    org, name = repo.split("/")
    root = hub / f"models--{org}--{name}"
    snap = root / "snapshots" / ("0" * 40)
    for rel, data in files.items():
        (snap / rel).parent.mkdir(parents=True, exist_ok=True)
        (snap / rel).write_bytes(data)
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text("0" * 40)


class FakeStore:
    def __init__(self):
        self.uploaded: dict[str, list[str]] = {}

    def require_bucket(self, uri):
        pass

    def read_manifest(self, uri):
        return None

    def list(self, prefix):
        return []

    def put_folder(self, local, dest, meta=None):
        files = (p for p in Path(local).rglob("*") if p.is_file())
        self.uploaded[dest] = sorted(p.relative_to(local).as_posix() for p in files)


@pytest.fixture
def hub(tmp_path, monkeypatch):
    import huggingface_hub.constants

    hub = tmp_path / "hub"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return hub


def test_a_pipeline_repo_syncs_only_the_folders_the_pipeline_loads(hub, monkeypatch):
    import huggingface_hub

    files = {rel: b"x" for rel in PIPELINE_FILES + UNLOADED}
    files["model_index.json"] = json.dumps(INDEX).encode()
    _hub_repo(hub, "acme/flux-like", files)
    asked = []
    real = huggingface_hub.snapshot_download
    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        lambda *a, **kw: asked.append(kw.get("allow_patterns")) or real(*a, **kw))
    store = FakeStore()
    uri, uploaded = model_cache.sync("acme/flux-like", "s3://models/acme/flux-like", store=store)
    assert uploaded and uri == "s3://models/acme/flux-like"
    assert store.uploaded[uri] == sorted(PIPELINE_FILES)  # no single-file copy, README or image
    assert asked == [["model_index.json", "scheduler/*", "text_encoder/*", "tokenizer/*", "transformer/*",
                      "vae/*"]]  # a download fetches only these too


def test_any_other_repo_syncs_whole(hub):
    files = {"HPSv3.safetensors": b"w", "config.json": b"{}", "README.md": b"r"}
    _hub_repo(hub, "acme/reward", files)
    assert model_cache.pipeline_patterns("acme/reward", download=False, revision=None) is None
    store = FakeStore()
    model_cache.sync("acme/reward", "s3://models/acme/reward", store=store)
    assert store.uploaded["s3://models/acme/reward"] == sorted(files)


def test_a_local_folder_syncs_as_given(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "model_index.json").write_text(json.dumps(INDEX))
    (folder / "flux1-dev.safetensors").write_bytes(b"x")
    store = FakeStore()
    model_cache.sync(str(folder), "s3://models/local/m", store=store)
    assert store.uploaded["s3://models/local/m"] == ["flux1-dev.safetensors", "model_index.json"]


def test_the_bert_tokenizer_repo_syncs_only_the_tokenizer_files(hub):
    """ImageReward loads only bert-base-uncased's tokenizer; the repo's weights in five formats stay out."""
    repo = model_cache.REWARD_MODELS["imagereward.processor"]
    tokenizer = {"vocab.txt": b"[PAD]\n", "tokenizer_config.json": b"{}", "tokenizer.json": b"{}",
                 "config.json": b"{}"}
    _hub_repo(hub, repo, {**tokenizer, "model.safetensors": b"w", "pytorch_model.bin": b"w",
                          "tf_model.h5": b"w", "flax_model.msgpack": b"w", "rust_model.ot": b"w"})
    store = FakeStore()
    uri, _ = model_cache.sync(repo, f"s3://models/{repo}", store=store)
    assert store.uploaded[uri] == sorted(tokenizer)
