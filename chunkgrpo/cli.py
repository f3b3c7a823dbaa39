"""`chunkgrpo` command line. Each subcommand is a module in `chunkgrpo/commands/` defining
`NAME`, `HELP`, `add_arguments(parser)` and `run(args) -> int | None`. Modules import heavy
dependencies (torch, mlflow, kfp) inside `run`, so `chunkgrpo --help` stays fast.

User errors (`UserError`, missing files) print one line and exit 2; no traceback.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import os
import pkgutil
import sys

from chunkgrpo import __version__, shutdown, startup, threads
from chunkgrpo.errors import Terminated, UserError, print_user_error


def _command_modules():
    """Built-in commands, then plugin commands registered under the `chunkgrpo.commands` entry-point
    group (e.g. `chunkgrpo pipeline` lives in the top-level `pipeline` package, so that nothing in
    `chunkgrpo/` imports kfp)."""
    from importlib.metadata import entry_points

    import chunkgrpo.commands as pkg

    for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        mod = importlib.import_module(f"chunkgrpo.commands.{info.name}")
        if hasattr(mod, "NAME") and hasattr(mod, "run"):
            yield mod
    for ep in sorted(entry_points(group="chunkgrpo.commands"), key=lambda e: e.name):
        try:
            mod = ep.load()
        except ImportError as e:  # the plugin's extra is not installed
            print(f"chunkgrpo: command {ep.name!r} unavailable ({e})", file=sys.stderr)
            continue
        if hasattr(mod, "NAME") and hasattr(mod, "run"):
            yield mod


DESCRIPTION = """\
Fine-tune flow-matching text-to-image models (FLUX.1-dev) with Chunk-GRPO and its peers: profile the
sampler's dynamics, plan the chunks, train, evaluate, register and promote the result, locally or as
Kubeflow pipelines."""

EPILOG = """\
examples:
  chunkgrpo tiny-model --out models/tiny-flux
  chunkgrpo train --config tiny_cpu model=models/tiny-flux prompts=prompts.txt output_dir=out
  chunkgrpo evaluate --config eval_tiny model=out/final output_dir=eval-tiny
  chunkgrpo pipeline run --local             # both pipelines' steps on this machine
  chunkgrpo COMMAND --help                   # a command's options and examples"""


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions and epilogs as written: their paragraphs, line breaks and indented example blocks."""


def _all_parsers(parser: argparse.ArgumentParser):
    """The parser and every sub(-sub)command parser below it."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):
                yield from _all_parsers(child)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="chunkgrpo", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"chunkgrpo {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for mod in _command_modules():
        p = sub.add_parser(mod.NAME, help=mod.HELP, description=(mod.__doc__ or mod.HELP).strip())
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    for p in _all_parsers(parser):  # also the subcommands' own subparsers (models sync, pipeline run)
        p.formatter_class = HelpFormatter
    return parser


def main(argv: list[str] | None = None) -> int:
    threads.set_env_policy()  # before the parser imports command plugins (one may load torch)
    try:
        startup.fewer_full_collections()  # ~1 CPU-s less to import torch, diffusers, transformers and mlflow
    except ValueError as e:
        print_user_error(f"chunkgrpo: error: {e}")
        return 2
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault(
        "TRANSFORMERS_VERBOSITY", "error"
    )  # e.g. the harmless "requires torchvision" notice
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    try:  # the thread policy (chunkgrpo.threads) before any command loads torch
        threads.configure()
    except ValueError as e:
        print_user_error(f"chunkgrpo {args.command}: error: {e}")
        return 2
    shutdown.fast_exit()  # ≈ 1 s less at exit once torch, diffusers and mlflow are loaded
    try:
        rc = args._run(args)
    except UserError as e:
        print_user_error(f"chunkgrpo {args.command}: error: {e}")  # once per torchrun job, not per rank
        return 2
    except FileNotFoundError as e:
        print_user_error(f"chunkgrpo {args.command}: error: file not found: {e.filename or e}")
        return 2
    except KeyboardInterrupt:
        print(f"chunkgrpo {args.command}: interrupted", file=sys.stderr)
        return 130
    except Terminated as e:
        print(
            f"chunkgrpo {args.command}: {e}; stopped (the last complete checkpoint is intact)",
            file=sys.stderr,
        )
        return 128 + e.signum
    except Exception as e:
        line = one_line_error(e)
        if line is None:
            raise
        print_user_error(f"chunkgrpo {args.command}: error: {line}")
        return 2
    return int(rc or 0)


# Failures that are not bugs: bad files, unreachable servers, corrupt artifacts, a diverged run.
# Matched by class name so that the CLI imports none of the modules defining them.
_ONE_LINE = {
    "chunkgrpo.store.StoreError": "",  # S3 still failing after retries; ChecksumMismatchError is a subclass
    "chunkgrpo.train.context.NonFiniteLossError": "",
    "chunkgrpo.train.checkpoint_format.CorruptCheckpointError": "corrupt checkpoint: ",
    "chunkgrpo.train.checkpoint_format.MirrorBacklogError": "",
    "chunkgrpo.train.checkpoint_format.CheckpointWriteError": "",
    "mlflow.exceptions.MlflowException": "MLflow: ",
    "requests.exceptions.ConnectionError": "cannot connect: ",
    "requests.exceptions.Timeout": "timed out: ",
    "urllib3.exceptions.HTTPError": "cannot connect: ",
    "builtins.ConnectionError": "cannot connect: ",
    "builtins.TimeoutError": "timed out: ",
    "kfp_server_api.exceptions.ApiException": "Kubeflow Pipelines API: ",
}


_FS_ERRNOS = {errno.ENOSPC, errno.EROFS, errno.EDQUOT, errno.EEXIST, errno.ENAMETOOLONG, errno.EFBIG,
              errno.ELOOP, errno.ENOTEMPTY, errno.EXDEV, errno.EACCES, errno.EPERM, errno.ENOTDIR,
              errno.EISDIR, errno.EMLINK}


def one_line_error(e: BaseException) -> str | None:
    """The one-line message for a known kind of failure, or None (a bug: keep the traceback)."""
    if isinstance(e, (IsADirectoryError, NotADirectoryError, PermissionError)):
        return f"{e.strerror or e}: {e.filename}" if e.filename else str(e)
    if isinstance(e, OSError) and e.errno in _FS_ERRNOS:  # a full, read-only or odd output location
        return f"{e.strerror or os.strerror(e.errno)}: {e.filename}" if e.filename else f"{e.strerror or e}"
    if isinstance(e, UnicodeDecodeError):
        return f"input is not UTF-8 text (bad byte at offset {e.start})"
    for cls in type(e).__mro__:
        prefix = _ONE_LINE.get(f"{cls.__module__}.{cls.__qualname__}")
        if prefix is not None:
            text = " ".join(str(e).split()) or type(e).__name__
            return prefix + (text if len(text) <= 400 else text[:397] + "...")
    return None


if __name__ == "__main__":
    sys.exit(main())
