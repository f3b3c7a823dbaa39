"""CLI subcommands, discovered automatically by `chunkgrpo.cli` (one module per command), and the two
helpers every config-driven stage command (train, evaluate, capacity) shares."""

from __future__ import annotations

import argparse
import logging

from chunkgrpo.config import describe


def add_config_arguments(p: argparse.ArgumentParser, example: str) -> None:
    """The arguments every config-driven stage command takes: --config, --help-config, overrides."""
    p.add_argument("--config", help="preset name (chunkgrpo/presets) or YAML file")
    p.add_argument("--help-config", action="store_true", help="list every option with its default and help")
    p.add_argument("overrides", nargs="*", help=f"key=value overrides (e.g. {example})")


def load_stage_config(cls, args):
    """The stage config from --config + overrides; None after printing --help-config. Sets up logging."""
    if args.help_config:
        print(describe(cls))
        return None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return cls.load(args.config, args.overrides)
