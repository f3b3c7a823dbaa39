"""The empty MLflow database a fresh local home starts from (`chunkgrpo/mlflow_db.py`), on sqlite files
laid out as MLflow's migrations leave them (the real server's use of it: tests/integration/
test_local_services.py)."""

from __future__ import annotations

import sqlite3
from importlib import metadata

import pytest

from chunkgrpo import mlflow_db


def _db(path, *, version="dc11669786a5", runs=0):
    with sqlite3.connect(path) as con:
        con.execute("CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL)")
        con.execute("INSERT INTO alembic_version VALUES (?)", (version,))
        con.execute("CREATE TABLE runs (run_uuid VARCHAR(32))")
        con.executemany("INSERT INTO runs VALUES (?)", [(f"r{i}",) for i in range(runs)])
    con.close()
    return path


def _dump(path) -> list[str]:
    con = sqlite3.connect(path)
    try:
        return list(con.iterdump())
    finally:
        con.close()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CHUNKGRPO_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_the_copy_is_keyed_by_the_installed_mlflow_version(cache):
    assert mlflow_db.template_path() == cache / "mlflow" / f"empty-{metadata.version('mlflow')}.db"


def test_only_a_migrated_database_without_runs_counts(tmp_path):
    assert mlflow_db.is_migrated(_db(tmp_path / "a.db"))
    assert not mlflow_db.is_migrated(_db(tmp_path / "b.db", runs=1))
    assert not mlflow_db.is_migrated(_db(tmp_path / "c.db", version=""))
    (tmp_path / "d.db").write_bytes(b"not a database")
    assert not mlflow_db.is_migrated(tmp_path / "d.db")
    assert not mlflow_db.is_migrated(tmp_path / "missing.db")


def test_a_fresh_database_is_kept_once_and_seeds_the_next_fresh_home(tmp_path, cache):
    first = _db(tmp_path / "a.db")
    assert not mlflow_db.seed(tmp_path / "home-b" / "mlflow.db")  # nothing kept yet
    assert not (tmp_path / "home-b").exists()
    mlflow_db.keep_template(first)
    template = mlflow_db.template_path()
    assert _dump(template) == _dump(first) and mlflow_db.is_migrated(template)
    assert [p.name for p in template.parent.iterdir()] == [template.name]  # no temporary file left

    target = tmp_path / "home-b" / "mlflow.db"
    assert mlflow_db.seed(target) and target.read_bytes() == template.read_bytes()
    assert not list(target.parent.glob("*.seeding"))
    # an existing database is never replaced, and a kept copy is not overwritten
    _db(tmp_path / "other.db", version="ffff")
    before = target.read_bytes()
    assert not mlflow_db.seed(target) and target.read_bytes() == before
    mlflow_db.keep_template(tmp_path / "other.db")
    assert _dump(template) == _dump(first)


def test_a_used_or_broken_database_is_never_kept_or_seeded(tmp_path, cache):
    mlflow_db.keep_template(_db(tmp_path / "used.db", runs=2))
    assert not mlflow_db.template_path().exists()
    template = mlflow_db.template_path()
    template.parent.mkdir(parents=True)
    template.write_bytes(b"half a copy")
    assert not mlflow_db.seed(tmp_path / "home" / "mlflow.db")
    assert not (tmp_path / "home" / "mlflow.db").exists()
