"""Run the embedded local services: a SeaweedFS S3 server and an MLflow tracking server.

    chunkgrpo local up        start (or reuse) both, wait for health, record PIDs
    chunkgrpo local status    running / unhealthy / crashed / stopped per service (exit 1 unless all fine)
    chunkgrpo local env       `export ...` lines for the other stages: eval "$(chunkgrpo local env)"
    chunkgrpo local down      stop exactly the recorded processes (also the servers a
                              `pipeline run --local --keep-services` left running)

State lives in $CHUNKGRPO_HOME (default ./.chunkgrpo/local). Everything binds 127.0.0.1.
"""

from __future__ import annotations

import argparse
import logging
import shlex
import sys

NAME = "local"
HELP = "start/stop/inspect the local S3 (SeaweedFS) and MLflow servers"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["up", "down", "status", "env"], help="what to do")
    parser.add_argument(
        "--home", default="", help="state dir (default $CHUNKGRPO_HOME or ./.chunkgrpo/local)"
    )
    parser.add_argument("--s3-port", type=int, default=8333, help="S3 port on 127.0.0.1 (default 8333)")
    parser.add_argument(
        "--mlflow-port", type=int, default=5000, help="MLflow port on 127.0.0.1 (default 5000)"
    )
    parser.add_argument("--no-mlflow", action="store_true", help="run only the S3 server")
    parser.add_argument("--timeout", type=float, default=90.0, help="seconds to wait for health (default 90)")


def run(args: argparse.Namespace) -> int:
    import math

    from chunkgrpo.errors import UserError
    from chunkgrpo.services import LocalServices, LocalServicesConfig

    if not (math.isfinite(args.timeout) and args.timeout > 0):  # NaN would never time out, nor report
        raise UserError(f"--timeout {args.timeout} must be a positive number of seconds")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cfg = LocalServicesConfig(home=args.home, s3_port=args.s3_port, mlflow_port=args.mlflow_port,
                              mlflow=not args.no_mlflow, start_timeout_s=args.timeout)
    svc = LocalServices(cfg)
    if args.action == "up":
        for st in svc.up().values():
            print(st.line())
        print(f"state: {svc.home}\nuse:   eval \"$(chunkgrpo local env{_home_flag(args)})\"")
        return 0
    if args.action == "down":
        stopped = svc.down()
        for st in stopped:
            print(st.line())
        if not stopped:
            print("nothing was running")
        return 0
    if args.action == "status":
        states = svc.status()
        for st in states.values():
            print(st.line())
        wanted = ["s3", "mlflow"] if cfg.mlflow else ["s3"]
        return 0 if all(states[n].state == "running" for n in wanted) else 1
    # env
    if svc.status()["s3"].state == "stopped":
        print("chunkgrpo local: services are not running (chunkgrpo local up)", file=sys.stderr)
    for k, v in svc.env().items():
        print(f"export {k}={shlex.quote(v)}")
    return 0


def _home_flag(args: argparse.Namespace) -> str:
    return f" --home {shlex.quote(args.home)}" if args.home else ""
