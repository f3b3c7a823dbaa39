"""The local MLflow server's sqlite database, started from a migrated empty copy.

A fresh `mlflow.db` makes `mlflow server` run MLflow's schema migrations before it answers (~1.4 s and
~1.1 CPU-s on 2 cores), every time a new `--home` is used. The first server started on a fresh database
leaves a copy of that database, still empty (the migrations, the Default experiment), in the cache:
`<cache root>/mlflow/empty-<mlflow version>.db` (`chunkgrpo.store.cache.cache_root`). It is taken with
sqlite's backup API while the server runs, so it is consistent, and written under a temporary name then
renamed, so a reader never sees half of it. The next fresh home starts from that copy. The copy is keyed
by the MLflow version, whose migrations decide the schema; a copy that is not a migrated MLflow database is
not used, and `mlflow server` checks the schema version at every start anyway. The cache only saves time:
a copy that cannot be read or written is one log line, and the server migrates as before.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sqlite3
import tempfile
from importlib import metadata
from pathlib import Path

log = logging.getLogger(__name__)


def template_path() -> Path | None:
    """Where the empty database of the installed MLflow version is kept (None without MLflow)."""
    from chunkgrpo.store.cache import cache_root

    try:
        version = metadata.version("mlflow")
    except metadata.PackageNotFoundError:
        return None
    return cache_root() / "mlflow" / f"empty-{version}.db"


def is_migrated(db: Path) -> bool:
    """`db` is an sqlite database MLflow has migrated (it records its schema version) and holds no run."""
    try:
        with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as con:
            (version,) = con.execute("SELECT version_num FROM alembic_version").fetchone()
            (runs,) = con.execute("SELECT count(*) FROM runs").fetchone()
    except (sqlite3.Error, TypeError, ValueError):
        return False
    return bool(version) and runs == 0


def seed(db: Path) -> bool:
    """Start the missing `db` from the empty copy of this MLflow version; True if it was copied."""
    template = template_path()
    if db.exists() or template is None or not template.is_file() or not is_migrated(template):
        return False
    db.parent.mkdir(parents=True, exist_ok=True)
    tmp = db.with_name(db.name + ".seeding")
    try:
        shutil.copyfile(template, tmp)
        os.replace(tmp, db)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        log.info("MLflow database not started from %s (%s); MLflow migrates it", template, e)
        return False
    return True


def keep_template(db: Path) -> None:
    """Keep a copy of `db` (just migrated by a server started on it, still empty) as this MLflow
    version's empty database, unless one is kept already."""
    template = template_path()
    if template is None or template.exists() or not is_migrated(db):
        return
    try:
        template.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=template.name + ".", dir=template.parent)
        os.close(fd)
        try:
            with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as src, \
                    contextlib.closing(sqlite3.connect(tmp)) as dst:
                src.backup(dst)
            os.replace(tmp, template)
        finally:
            Path(tmp).unlink(missing_ok=True)
    except (OSError, sqlite3.Error) as e:
        log.info("no empty MLflow database kept in %s (%s)", template.parent, e)
