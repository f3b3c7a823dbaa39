"""Reading files the user names (prompts, profiles, presets, plans, metrics): every way such a file
can be wrong — missing, a directory, unreadable, binary, not UTF-8 — becomes one `UserError` that
names the file and what was expected, never a traceback."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from chunkgrpo.errors import UserError


def read_text(path: str | Path, what: str = "file") -> str:
    """The file's text (UTF-8, a BOM is dropped); `what` names the file's role in the error."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"{what} {path} does not exist")
    if path.is_dir():
        raise UserError(f"{what} {path} is a directory, expected a file")
    check_regular(path, what)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise UserError(f"{what} {path} cannot be read: {e.strerror or e}") from None
    nul = data.find(b"\x00", 0, 8192)
    if nul >= 0:
        raise UserError(f"{what} {path} is a binary file (NUL byte at offset {nul}), expected text")
    nul = data.find(b"\x00")
    if nul >= 0:  # past the first 8 KiB: text with a NUL inside, never a valid prompt/profile/preset
        line = data.count(b"\n", 0, nul) + 1
        raise UserError(f"{what} {path} contains a NUL byte at offset {nul} (line {line}); expected text")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise UserError(
            f"{what} {path} is not UTF-8 text (bad byte 0x{data[e.start]:02x} at offset {e.start})"
        ) from None


def check_regular(path: str | Path, what: str = "file") -> None:
    """An existing input must be a regular file: reading a FIFO, socket or device would block or never end."""
    path = Path(path)
    if path.exists() and not path.is_dir() and not path.is_file():
        raise UserError(f"{what} {path} is not a regular file (a FIFO, socket or device); expected a file")


def check_output_file(path: str | Path, what: str = "output") -> Path:
    """An output file path that can be written atomically (tmp + rename): not a directory, and not an
    existing FIFO, socket or device — a rename would replace the device node, a write would block."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{what} {path} is a directory; give a file name")
    if path.exists() and not path.is_file():
        raise UserError(f"{what} {path} exists and is not a regular file (a FIFO, socket or device); "
                        "refusing to replace it")
    parent = next((p for p in path.absolute().parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise UserError(f"{what} {path}: {parent} is a file, not a directory")
    return path


def read_json(path: str | Path, what: str = "JSON file") -> Any:
    """Parsed JSON from a user file (errors as for `read_text`, plus the JSON error's line/column)."""
    text = read_text(path, what)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(
            f"{what} {path} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})"
        ) from None
