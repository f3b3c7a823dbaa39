"""Champion/challenger promotion of a registered model version (MLflow aliases).

    chunkgrpo promote --model NAME --version V [--metric M --direction max|min --margin X] [--force] [--why TEXT]
    chunkgrpo promote --model NAME --rollback [--why TEXT]

`champion` moves to V only if V beats the current champion on the gate (default: eval.hpdv2.hpsv3,
higher is better, margin 0; values come from the versions' `metric.<name>` tags); the old champion
becomes `previous`. Who/why/metrics are written as tags. Re-running is idempotent. `--force` skips the
gate and is recorded. `--rollback` moves champion back to `previous`. Exit 0 also when the gate
rejects (the decision is printed), unless `--strict`.
"""

from __future__ import annotations

import argparse
import logging

NAME = "promote"
HELP = "promote a registered model version to champion (gated), or roll back"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="registered model name")
    g = parser.add_mutually_exclusive_group(required=True)
    g.add_argument("--version", help="model version to promote")
    g.add_argument("--rollback", action="store_true", help="move champion back to the previous version")
    parser.add_argument("--metric", default=None, help="gate metric (default eval.hpdv2.hpsv3)")
    parser.add_argument("--direction", choices=["max", "min"], default=None, help="max: higher is better")
    parser.add_argument("--margin", type=float, default=None, help="required improvement (default 0)")
    parser.add_argument("--force", action="store_true", help="skip the gate (recorded as a tag)")
    parser.add_argument("--why", default="", help="reason, stored as a tag")
    parser.add_argument("--who", default=None, help="actor recorded in tags (default: $CHUNKGRPO_USER or login)")
    parser.add_argument("--strict", action="store_true", help="exit 1 when the gate rejects the version")


def run(args: argparse.Namespace) -> int:
    from chunkgrpo.registry import GateConfig, promote, rollback

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    if args.rollback:
        if args.force or args.metric or args.direction or args.margin is not None:
            from chunkgrpo.errors import UserError

            raise UserError("--rollback takes no gate options or --force")
        print(rollback(args.model, who=args.who, why=args.why).line())
        return 0
    gate = GateConfig.from_dict({k: v for k, v in {"metric": args.metric, "direction": args.direction,
                                                    "margin": args.margin}.items() if v is not None})
    res = promote(args.model, args.version, gate, force=args.force, who=args.who, why=args.why)
    print(res.line())
    return 1 if (args.strict and res.action == "rejected") else 0
