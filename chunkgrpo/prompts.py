"""Prompt files: `.txt` (one prompt per line, blank lines and `#` comments skipped), `.jsonl` (a
`prompt` or `text` field per line), `.tsv` (a `Prompt` column, e.g. PartiPrompts), `.parquet` (a
`prompt`/`text` column)."""

from __future__ import annotations

import csv
import io
import json
import logging
from pathlib import Path

from chunkgrpo.errors import UserError
from chunkgrpo.inputs import read_text

log = logging.getLogger(__name__)
_FIELDS = ("prompt", "text", "Prompt", "caption")


def _pick(row: dict, where: str) -> str:
    if not isinstance(row, dict):
        raise UserError(f"{where}: expected a JSON object with a prompt field, got {type(row).__name__}")
    for f in _FIELDS:
        if f in row and isinstance(row[f], str):
            return row[f]
    present = [f for f in _FIELDS if f in row]
    if present:  # a null or non-string prompt is refused, never trained on as 'None' or a number
        x = row[present[0]]
        what = "null" if x is None else f"{type(x).__name__} {str(x)[:40]!r}"
        raise UserError(f"{where}: field {present[0]!r} is {what}, expected a string prompt")
    raise UserError(f"{where}: no prompt field (looked for {', '.join(_FIELDS)}; got {sorted(row)[:6]})")


def _string_cells(cells: list, where: str) -> list[str]:
    """A column's cells as prompts: a null, number or bytes cell is refused naming its row (never
    trained on as 'None' or a repr)."""
    for i, x in enumerate(cells):
        if not isinstance(x, str):
            what = "null" if x is None else f"{type(x).__name__} {str(x)[:40]!r}"
            raise UserError(f"{where}: row {i} is {what}, expected a string prompt")
    return cells


def _fetch(uri: str) -> Path:
    """Download an s3:// prompt file into the cache (re-downloaded when its size/etag changes)."""
    from chunkgrpo.store import parse_s3_uri
    from chunkgrpo.store.cache import cached_file

    if not parse_s3_uri(uri)[1].strip("/") or uri.endswith("/"):
        raise UserError(f"prompts={uri} names a bucket or folder, not a prompt file "
                        "(s3://bucket/path/prompts.txt)")
    return cached_file(uri, "prompts", "prompt file")


def load_prompts(path: str | Path, limit: int = 0) -> list[str]:
    """Prompts from a local file or an s3:// object; raises a clear error for a missing/empty file or
    an empty prompt line."""
    path = _fetch(str(path)) if str(path).startswith("s3://") else Path(path)
    if not path.exists():
        raise UserError(f"prompt file {path} does not exist")
    if path.is_dir():
        raise UserError(f"prompt file {path} is a directory, expected a .txt/.jsonl/.tsv/.parquet file")
    from chunkgrpo.inputs import check_regular

    check_regular(path, "prompt file")
    suffix = path.suffix.lower()
    prompts: list[str] = []
    blank = 0  # blank lines are skipped in every text format (and said so), never an empty prompt
    if suffix == ".jsonl":
        for i, line in enumerate(read_text(path, "prompt file").splitlines(), 1):
            if not line.strip():
                blank += 1
                continue
            try:
                prompts.append(_pick(json.loads(line), f"{path}:{i}"))
            except json.JSONDecodeError as e:
                raise UserError(f"{path}:{i}: invalid JSON ({e.msg})") from None
    elif suffix == ".tsv":
        text = read_text(path, "prompt file")
        blank = sum(1 for ln in text.splitlines()[1:] if not ln.strip())
        fh = io.StringIO(text, newline="")
        reader = csv.DictReader(fh, delimiter="\t")
        for row in reader:
            if not any(v.strip() for v in row.values() if isinstance(v, str)):
                continue  # a whitespace-only line between rows, like an empty one
            prompts.append(_pick(row, f"{path}:{reader.line_num}"))
    elif suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except (OSError, ValueError) as e:  # pyarrow.ArrowInvalid is a ValueError
            raise UserError(
                f"prompt file {path} is not a readable parquet file ({str(e).splitlines()[0][:200]})"
            ) from None
        col = next((c for c in _FIELDS if c in table.column_names), None)
        if col is None:
            raise UserError(
                f"{path}: no prompt column (looked for {', '.join(_FIELDS)}; got {table.column_names})"
            )
        prompts = _string_cells(table.column(col).to_pylist(), f"{path}: column {col!r}")
    else:
        lines = read_text(path, "prompt file").splitlines()
        prompts = [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
        blank = sum(1 for ln in lines if not ln.strip())
    prompts = [p.strip() for p in prompts]
    nul = [i for i, p in enumerate(prompts) if "\x00" in p]
    if nul:
        raise UserError(f"{path}: prompt at entry {nul[0]} contains a NUL character")
    empty = [i for i, p in enumerate(prompts) if not p]
    if empty:
        raise UserError(f"{path}: empty prompt at entry {empty[0]}")
    if not prompts:
        raise UserError(f"prompt file {path} contains no prompts")
    if blank:
        log.info("%s: %d prompts (%d blank lines skipped)", path, len(prompts), blank)
    return prompts[:limit] if limit else prompts
