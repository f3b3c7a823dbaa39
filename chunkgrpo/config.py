"""Typed, documented stage configs: one dataclass per stage, YAML presets, `key=value` overrides.

Every field carries a help string (`option(default, "help")`); `__post_init__` of each config
validates and raises `UserError` with an actionable message. Nested configs are addressed with
dotted keys (`rollout.eta=0.7`). The same dict form is what KFP components receive.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

from chunkgrpo.errors import UserError

T = TypeVar("T", bound="Config")

PRESET_DIR = Path(__file__).parent / "presets"


def option(default: Any = dataclasses.MISSING, help: str = "", *, factory: Any = None) -> Any:
    """A dataclass field with a help string (shown by `chunkgrpo <cmd> --help-config`)."""
    if not help:
        raise TypeError("every config field needs a help string")
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata={"help": help})
    if isinstance(default, (list, dict, set)):
        value = default
        return dataclasses.field(default_factory=lambda: type(value)(value), metadata={"help": help})
    return dataclasses.field(default=default, metadata={"help": help})


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Convert a YAML/CLI value to the field's declared type, or raise a clear UserError."""
    tp, optional = _unwrap_optional(tp)
    if value is None:
        if optional:
            return None
        raise UserError(f"{key}: null is not allowed (expected {getattr(tp, '__name__', tp)})")
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise UserError(f"{key}={value!r} is not one of {list(choices)}")
        return value
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise UserError(f"{key}: expected a mapping for {tp.__name__}, got {value!r}")
        return tp.from_dict(value, prefix=f"{key}.")
    if origin in (list, tuple):
        (inner, *_) = typing.get_args(tp) or (Any,)
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()] if value.strip() else []
        if not isinstance(value, (list, tuple)):
            value = [value]
        out = [_coerce(v, inner, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(out) if origin is tuple else out
    if origin is dict:
        if not isinstance(value, dict):
            raise UserError(f"{key}: expected a mapping, got {value!r}")
        _, vt = typing.get_args(tp) or (Any, Any)
        return {str(k): _coerce(v, vt, f"{key}.{k}") for k, v in value.items()}
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "yes", "1", "on", "false", "no", "0", "off"):
            return value.lower() in ("true", "yes", "1", "on")
        raise UserError(f"{key}={value!r} is not a boolean (use true/false)")
    if tp is int:
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise UserError(f"{key}={value!r} is not an integer")
        try:
            return int(value)
        except (TypeError, ValueError):
            raise UserError(f"{key}={value!r} is not an integer") from None
    if tp is float:
        if isinstance(value, bool):
            raise UserError(f"{key}={value!r} is not a number")
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise UserError(f"{key}={value!r} is not a number") from None
        if not math.isfinite(number):
            raise UserError(f"{key}={value} must be a finite number")
        return number
    if tp is str:
        return str(value)
    return value


def check_finite(cfg: Any, prefix: str = "") -> None:
    """UserError naming the first float field of a config dataclass (or float in a list field) that is
    NaN or ±inf — `inf < 0` is false, so range checks alone let them through."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        values = value if isinstance(value, (list, tuple)) else [value]
        for v in values:
            if isinstance(v, float) and not math.isfinite(v):
                raise UserError(f"{prefix}{f.name}={value!r} must be a finite number")


def parse_override(text: str) -> tuple[str, Any]:
    """`a.b=value` -> ("a.b", parsed YAML value)."""
    if "=" not in text:
        raise UserError(f"override {text!r} must look like key=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise UserError(f"override {text!r} has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key, value


def _set_dotted(d: dict, key: str, value: Any) -> None:
    """Set `a.b.c` in nested dicts; a numeric part indexes a list (`rewards.0.weight`)."""
    parts = key.split(".")
    node: Any = d
    for i, p in enumerate(parts):
        last = i == len(parts) - 1
        if isinstance(node, list):
            if not p.isdigit() or int(p) >= len(node):
                raise UserError(f"override {key}: {p!r} is not an index of a {len(node)}-item list")
            if last:
                node[int(p)] = value
                return
            if not isinstance(node[int(p)], (dict, list)):
                node[int(p)] = {}
            node = node[int(p)]
        elif isinstance(node, dict):
            if last:
                node[p] = value
                return
            if not isinstance(node.get(p), (dict, list)):
                node[p] = {}
            node = node[p]
        else:
            raise UserError(f"override {key}: {parts[i - 1]!r} is not a section")


@dataclasses.dataclass
class Config:
    """Base for stage configs. Subclasses are dataclasses whose fields all use `option()`."""

    @classmethod
    def from_dict(cls: type[T], data: dict | None, prefix: str = "") -> T:
        data = dict(data or {})
        hints = typing.get_type_hints(cls)
        names = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = [k for k in data if k not in names]
        if unknown:
            k = unknown[0]
            close = difflib.get_close_matches(k, sorted(names), n=1)
            hint = (
                f" (did you mean {prefix}{close[0]}?)" if close else f" (known: {', '.join(sorted(names))})"
            )
            raise UserError(f"unknown {cls.__name__} option {prefix}{k!r}{hint}")
        kwargs = {k: _coerce(v, hints[k], prefix + k) for k, v in data.items()}
        try:
            return cls(**kwargs)
        except TypeError as e:  # missing required fields
            raise UserError(f"{cls.__name__}: {e}") from None

    @classmethod
    def load(cls: type[T], source: str | Path | dict | None = None, overrides: list[str] | None = None) -> T:
        """Load from a preset name (`presets/<name>.yaml`), a YAML path, or a dict; apply overrides."""
        data: dict = {}
        if isinstance(source, dict):
            data = dict(source)
        elif source:
            data = load_yaml(source)
        for text in overrides or []:
            key, value = parse_override(text)
            _set_dotted(data, key, value)
        return cls.from_dict(data)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def replace(self: T, **changes: Any) -> T:
        return dataclasses.replace(self, **changes)


def resolve_preset(source: str | Path) -> Path:
    path = Path(source)
    if path.exists():
        return path
    candidate = PRESET_DIR / (str(source) if str(source).endswith(".yaml") else f"{source}.yaml")
    if candidate.exists():
        return candidate
    presets = sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))
    close = difflib.get_close_matches(Path(str(source)).stem, presets, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise UserError(
        f"config {str(source)!r} is neither a file nor a preset ({hint}presets: {', '.join(presets)})"
    )


def load_yaml(source: str | Path) -> dict:
    from chunkgrpo.inputs import read_text

    path = resolve_preset(source)
    try:
        data = yaml.safe_load(read_text(path, "config")) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1} column {mark.column + 1}" if mark else ""
        raise UserError(
            f"{path}: invalid YAML{where}: {getattr(e, 'problem', None) or type(e).__name__}"
        ) from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data


def describe(cls: type[Config], prefix: str = "", values: dict | None = None) -> str:
    """Human-readable list of options with defaults and help (for --help-config). `values` (a preset's
    mapping): each option shows the preset's value, and the default where the preset changes it."""
    lines = []
    hints = typing.get_type_hints(cls)
    values = values if isinstance(values, dict) else {}
    for f in dataclasses.fields(cls):
        tp, _ = _unwrap_optional(hints[f.name])
        if dataclasses.is_dataclass(tp):
            lines.append(describe(tp, prefix=f"{prefix}{f.name}.", values=values.get(f.name)))
            continue
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else "<required>")
        shown = f"{default!r}"
        if f.name in values and values[f.name] != default:
            shown = f"{values[f.name]!r}   (default: {default!r})"
        lines.append(f"  {prefix}{f.name} = {shown}\n      {f.metadata.get('help', '')}")
    return "\n".join(lines)


def owning_class(data: dict, classes: typing.Sequence[type[Config]]) -> type[Config] | None:
    """The first of `classes` that takes every top-level key of a config mapping as an option, or None."""
    for cls in classes:
        if set(data) <= {f.name for f in dataclasses.fields(cls) if f.init}:
            return cls
    return None
