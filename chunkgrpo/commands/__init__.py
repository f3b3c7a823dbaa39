"""CLI subcommands, discovered automatically by `chunkgrpo.cli` (one module per command), and the two
helpers every config-driven stage command (train, evaluate, capacity) shares."""

from __future__ import annotations

import argparse
import importlib
import logging

from chunkgrpo.config import _set_dotted, describe, load_yaml, owning_class, parse_override
from chunkgrpo.errors import UserError


def add_config_arguments(p: argparse.ArgumentParser, example: str) -> None:
    """The arguments every config-driven stage command takes: --config, --help-config, overrides."""
    p.add_argument("--config", help="preset name (chunkgrpo/presets) or YAML file")
    p.add_argument("--help-config", action="store_true", help="list every option with its default and help")
    p.add_argument("overrides", nargs="*", help=f"key=value overrides (e.g. {example})")


# The stage configs a preset can belong to: (module, class, what its presets are, the command taking them).
STAGE_CONFIGS = (
    ("chunkgrpo.train.config", "TrainConfig", "a training preset", "train"),
    ("chunkgrpo.eval.config", "EvalConfig", "an evaluation preset", "evaluate"),
)


def _preset_owner(cls, data: dict):
    """(the stage config class a preset's mapping belongs to, what it is, its command); `cls` first, so a
    mapping both accept stays with the command that was run. (cls, "", "") when no other one takes it."""
    entries = [(cls, "", "")]
    for module, name, kind, command in STAGE_CONFIGS:
        other = getattr(importlib.import_module(module), name)
        if other is not cls:
            entries.append((other, kind, command))
    owner = owning_class(data, [c for c, _, _ in entries])
    return next((e for e in entries if e[0] is owner), entries[0])


def load_stage_config(cls, args):
    """The stage config from --config + overrides; None after printing --help-config. Sets up logging.
    A preset of another stage (an evaluation preset given to train) is named with the command it is for."""
    data = load_yaml(args.config) if args.config else {}
    owner, kind, command = _preset_owner(cls, data)
    if args.help_config:
        if not args.config:
            print(describe(cls))
            return None
        for text in args.overrides:
            key, value = parse_override(text)
            _set_dotted(data, key, value)
        note = f" ({kind}: chunkgrpo {command} --config {args.config})" if kind else ""
        print(f"{owner.__name__} options, with the values of {args.config}{note}:")
        print(describe(owner, values=data))
        return None
    if kind:
        raise UserError(f"{args.config} is {kind} (use chunkgrpo {command} --config {args.config})")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return cls.load(data, args.overrides)
