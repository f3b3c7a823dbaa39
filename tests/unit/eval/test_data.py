"""Benchmark prompt data ships inside the package: checksums match the provenance note, licences are
there, and the lookup order is explicit path → $CHUNKGRPO_DATA_DIR → package data (nothing else)."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest

from chunkgrpo.errors import UserError
from chunkgrpo.eval import DATA_DIR_ENV, PACKAGE_DATA_DIR, data_dirs, data_file

SHIPPED = {
    "hpdv2/hpdv2_test_prompts_400.txt": "hpdv2/LICENSE",
    "geneval/evaluation_metadata.jsonl": "geneval/LICENSE",
    "geneval/object_names.txt": "geneval/LICENSE",
    "partiprompts/PartiPrompts.tsv": "partiprompts/LICENSE",
}


def _sha256(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def test_package_data_matches_its_provenance_note():
    readme = (PACKAGE_DATA_DIR / "README.md").read_text()
    for rel, licence in SHIPPED.items():
        row = next((ln for ln in readme.splitlines() if ln.startswith(f"| `{rel}`")), None)
        assert row is not None, f"{rel} has no provenance row in chunkgrpo/data/README.md"
        digest = re.search(r"`([0-9a-f]{64})`", row).group(1)
        assert _sha256(PACKAGE_DATA_DIR / rel) == digest, f"{rel} differs from the upstream file"
        assert "@" in row and re.search(r"Apache-2\.0|MIT", row)  # source repo@commit and licence named
        assert (PACKAGE_DATA_DIR / licence).stat().st_size > 500
    assert "Apache License" in (PACKAGE_DATA_DIR / "hpdv2/LICENSE").read_text()
    assert "MIT License" in (PACKAGE_DATA_DIR / "geneval/LICENSE").read_text()


def test_lookup_order_explicit_then_env_then_package(tmp_path, monkeypatch):
    rel = "hpdv2/hpdv2_test_prompts_400.txt"
    monkeypatch.delenv(DATA_DIR_ENV, raising=False)
    assert data_dirs() == [PACKAGE_DATA_DIR]  # no workspace or repo-relative folders
    assert data_file(rel) == PACKAGE_DATA_DIR / rel
    # $CHUNKGRPO_DATA_DIR wins over the package copy ...
    (tmp_path / "hpdv2").mkdir()
    (tmp_path / rel).write_text("mine\n")
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path))
    assert data_file(rel) == tmp_path / rel
    # ... but only for files it has: the rest still comes from the package
    assert data_file("geneval/object_names.txt") == PACKAGE_DATA_DIR / "geneval/object_names.txt"
    # an explicit path wins over both and must exist
    own = tmp_path / "own.txt"
    own.write_text("x\n")
    assert data_file(rel, own) == own
    with pytest.raises(UserError, match="nope.txt"):
        data_file(rel, tmp_path / "nope.txt", what="HPDv2 test prompts")
    with pytest.raises(UserError, match=rf"not found .*\${DATA_DIR_ENV}"):
        data_file("hpdv2/missing.txt")


def test_loaders_use_the_package_data_from_anywhere(tmp_path, monkeypatch):
    """What a user's clone (or an image) sees: no env var, an unrelated working directory."""
    from chunkgrpo.eval import geneval, hpdv2

    monkeypatch.delenv(DATA_DIR_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    assert len(hpdv2.load_prompts()) == 400 and hpdv2.is_official()
    assert len(geneval.load_metadata()) == 553 and len(geneval.load_object_names()) == 80


def test_wise_prompts_are_not_shipped_and_the_error_says_where_to_get_them(monkeypatch):
    from chunkgrpo.eval import wise

    monkeypatch.delenv(wise.WISE_DIR_ENV, raising=False)
    assert not list(PACKAGE_DATA_DIR.rglob("*.json"))  # no WISE files in the package
    with pytest.raises(UserError, match=r"github.com/PKU-YuanGroup/WISE"):
        wise.load_prompts()


@pytest.mark.integration
def test_explicit_s3_uri_is_downloaded_and_used(services_env, tmp_path, monkeypatch):
    from chunkgrpo.eval import hpdv2
    from chunkgrpo.store.client import ArtifactStore

    monkeypatch.setenv("CHUNKGRPO_CACHE", str(tmp_path / "cache"))
    store = ArtifactStore(services_env.store_config)
    store.ensure_bucket()
    uri = store.uri("data-test/my_prompts.txt")
    store.put_bytes(b"a red cube\na blue sphere\n", uri)
    assert hpdv2.load_prompts(uri) == ["a red cube", "a blue sphere"]
    store.put_bytes(b"a green cone\n", uri)  # a changed object is fetched again
    assert hpdv2.load_prompts(uri) == ["a green cone"]
    with pytest.raises(UserError, match="does not exist"):
        hpdv2.load_prompts(store.uri("data-test/missing.txt"))


@pytest.mark.integration
def test_wise_prompts_from_an_s3_folder_or_file(services_env, tmp_path, monkeypatch):
    import json

    from chunkgrpo.eval import wise
    from chunkgrpo.store.client import ArtifactStore

    monkeypatch.setenv("CHUNKGRPO_CACHE", str(tmp_path / "cache"))
    store = ArtifactStore(services_env.store_config)
    store.ensure_bucket()
    item = [{"prompt_id": 901, "Prompt": "Rusty iron nail.", "Explanation": "oxidation"}]
    store.put_bytes(json.dumps(item).encode(), store.uri("wise-test/natural_science_rewrite.json"))
    folder = store.uri("wise-test")
    got = wise.load_prompts(folder, allow_partial=True)
    assert [(p.prompt_id, p.category) for p in got] == [(901, "chemistry")]
    assert [p.prompt_id for p in wise.load_prompts(folder + "/natural_science_rewrite.json")] == [901]
    with pytest.raises(UserError, match="lacks"):
        wise.load_prompts(folder)  # two of the three files missing
    with pytest.raises(UserError, match="holds none of"):
        wise.load_prompts(store.uri("wise-empty"))
