"""Rewards and scorers a user names: an import path `module:attr` or an installed package's entry point.

A name that is not built in (`chunkgrpo.scoring.table`) is looked up, in this order, as

- an **import path** `"mypkg.rewards:ocr"` (it contains a colon): `attr` of module `mypkg.rewards`;
- an **entry point** of an installed package: group `chunkgrpo.rewards` for training rewards;
  evaluation scorers search `chunkgrpo.scorers` first, then `chunkgrpo.rewards` (a reward is a scorer too).

Either way the object found is a **factory** with the built-in rewards' contract:
`factory(**options) -> fn(images, prompts) -> float tensor (n,)`, where `images` is a list of n
`PIL.Image.Image` (RGB, 8 bits per channel: `np.asarray(im, np.float32) / 255` gives HxWx3 in [0, 1]) and
`prompts` a list of n `str` (the captions the images were generated for). Options arrive as keyword
arguments: strings from a training config (its `options` are `dict[str, str]`), values as YAML parses them
from `chunkgrpo reward-server --option`; a factory converts them (`float(scale)`).

`resolve` only imports the factory (config load and preflight call it: no model is loaded);
`build` calls it and wraps the reward so that every answer is checked: n finite values, else one line
naming the reward and where it came from.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
from collections.abc import Callable

from chunkgrpo.errors import UserError
from chunkgrpo.scoring.table import ALIASES, REWARDS, SCORER_NAMES

REWARD_GROUP = "chunkgrpo.rewards"
SCORER_GROUP = "chunkgrpo.scorers"
GROUPS = {"reward": (REWARD_GROUP,), "scorer": (SCORER_GROUP, REWARD_GROUP)}


@dataclasses.dataclass(frozen=True)
class Resolved:
    """A user-named factory: `source` says where it was found (`module:attr` or `entry point G:name`)."""

    name: str
    factory: Callable
    source: str

    @property
    def about(self) -> str:
        doc = (getattr(self.factory, "__doc__", None) or "").strip().splitlines()
        return doc[0] if doc else f"user reward {self.source}"


def is_builtin(name: str) -> bool:
    """A programmatic reward or a model scorer of the table (scorer names are case-insensitive)."""
    key = str(name).strip().lower()
    return name in REWARDS or key in SCORER_NAMES or key in ALIASES


def _entry_points(group: str) -> dict:
    from importlib.metadata import entry_points

    return {ep.name: ep for ep in entry_points(group=group)}


def _builtin_names() -> list[str]:
    return sorted(REWARDS) + list(SCORER_NAMES)


def _import(target: str, kind: str, name: str, source: str) -> Callable:
    module, _, attr = target.partition(":")
    if not module or not attr:
        raise UserError(f"{kind} {name!r}: {target!r} is not an import path module:attr")
    try:
        mod = importlib.import_module(module)
    except Exception as e:  # any failure of user code at import is reported, one line
        raise UserError(f"{kind} {name!r} ({source}): cannot import module {module!r} "
                        f"({type(e).__name__}: {_line(e)})") from None
    obj = mod
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise UserError(f"{kind} {name!r} ({source}): module {module!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise UserError(f"{kind} {name!r} ({source}): {target} is a {type(obj).__name__}, not a callable "
                        "factory(**options) -> fn(images, prompts)")
    return obj


def _line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def resolve(name: str, kind: str = "reward") -> Resolved:
    """The factory a non-built-in `name` means (imported, not called); UserError in one line naming the
    name, the module or the entry-point groups searched, and the built-in names (with a close match)."""
    groups = GROUPS[kind]
    if ":" in name:
        return Resolved(name, _import(name.strip(), kind, name, "import path"), name.strip())
    for group in groups:
        ep = _entry_points(group).get(name)
        if ep is not None:
            source = f"entry point {group}:{name} = {ep.value}"
            try:
                factory = ep.load()
            except Exception as e:  # the plugin's own import failure, reported in one line
                raise UserError(f"{kind} {name!r} ({source}): cannot load ({type(e).__name__}: {_line(e)})"
                                ) from None
            if not callable(factory):
                raise UserError(f"{kind} {name!r} ({source}): a {type(factory).__name__}, not a callable "
                                "factory(**options) -> fn(images, prompts)")
            return Resolved(name, factory, source)
    installed = sorted({n for g in groups for n in _entry_points(g)})
    candidates = _builtin_names() + installed
    close = difflib.get_close_matches(str(name).lower(), candidates, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise UserError(
        f"unknown {kind} {name!r}{hint}: not built in ({', '.join(_builtin_names())}), not an entry point "
        f"in {' or '.join(groups)} (installed: {', '.join(installed) or 'none'}), not an import path "
        "module:attr"
    )


def check_name(name: str, kind: str = "reward") -> None:
    """Config-time check: `name` is built in, or resolves to a factory (imports it, calls nothing)."""
    if not is_builtin(name):
        resolve(name, kind)


class CheckedReward:
    """A user reward whose every answer is checked: n finite float values for n images."""

    def __init__(self, resolved: Resolved, fn: Callable, kind: str) -> None:
        self.resolved, self.fn, self.kind = resolved, fn, kind

    def __call__(self, images, prompts):
        import torch

        images, prompts = list(images), list(prompts)
        where = f"{self.kind} {self.resolved.name!r} ({self.resolved.source})"
        answer = self.fn(images, prompts)  # the reward's own failure keeps its traceback
        try:
            out = torch.as_tensor(answer)
        except (TypeError, ValueError, RuntimeError) as e:
            raise UserError(f"{where}: returned a {type(answer).__name__}, not a float tensor (n,) "
                            f"({_line(e)})") from None
        if out.dim() != 1 or out.numel() != len(images):
            raise UserError(f"{where}: returned shape {tuple(out.shape)} for {len(images)} images "
                            f"(expected ({len(images)},))")
        out = out.float()
        bad = (~torch.isfinite(out)).nonzero().flatten().tolist()
        if bad:
            raise UserError(f"{where}: non-finite values for samples {bad[:8]} of {len(images)}")
        return out

    def close(self) -> None:
        close = getattr(self.fn, "close", None)
        if callable(close):
            close()


def build(name: str, options: dict | None = None, kind: str = "reward") -> CheckedReward:
    """The user reward `name` built with `options` and checked on every call."""
    resolved = resolve(name, kind)
    options = dict(options or {})
    try:
        fn = resolved.factory(**options)
    except UserError:
        raise
    except TypeError as e:
        raise UserError(f"{kind} {name!r} ({resolved.source}): bad options {options} ({_line(e)})") from None
    except Exception as e:  # a failing user factory is reported in one line
        raise UserError(f"{kind} {name!r} ({resolved.source}): factory failed "
                        f"({type(e).__name__}: {_line(e)})") from None
    if not callable(fn):
        raise UserError(f"{kind} {name!r} ({resolved.source}): the factory returned a {type(fn).__name__}, "
                        "not a callable fn(images, prompts) -> float tensor (n,)")
    return CheckedReward(resolved, fn, kind)
