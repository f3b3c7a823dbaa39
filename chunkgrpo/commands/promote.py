"""Champion/challenger promotion of a registered model version (MLflow aliases).

    chunkgrpo promote --model NAME --version V [--margin X] [--force] [--why TEXT]
    chunkgrpo promote --model NAME --rollback [--why TEXT]
    chunkgrpo promote --model NAME --set-gate METRIC:max|min --why TEXT      # registry admin action

`champion` moves to V only if V beats the current champion on the registered model's gate: the
metric and its direction are tags of the registered model (`gate.metric`, `gate.direction`, written
at its first registration or by `--set-gate`), never a flag of this command, so no invocation can
crown a worse model; values come from the versions' `metric.<name>` tags and must have been
measured under the same eval protocol. `--metric` may only repeat the model's gate metric. The old
champion becomes `previous`. Who/why/metrics are written as tags. Re-running is idempotent.
`--force` (skip the gate) and `--rollback` (champion back to `previous`) are reserved to the
promoter identity, need `--why`, and are recorded with who/why/previous champion: `--history` shows
the audit log. With $CHUNKGRPO_PROMOTER_URL set, a gated promotion is asked of the promoter service
(`chunkgrpo.promoter`), which alone holds the rights to move `champion`. Exit 0
also when the gate rejects (the decision is printed), unless `--strict`.
"""

from __future__ import annotations

import argparse
import json
import logging

NAME = "promote"
HELP = "promote a registered model version to champion (gated), roll back, or set the model's gate"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="registered model name")
    g = parser.add_mutually_exclusive_group(required=True)
    g.add_argument("--version", help="model version to promote")
    g.add_argument("--rollback", action="store_true", help="move champion back to the previous version")
    g.add_argument("--set-gate", metavar="METRIC:max|min",
                   help="promoter identity only: record the gate metric and direction of FUTURE versions "
                        "(--margin sets its margin; audited, needs --why)")
    g.add_argument("--history", action="store_true",
                   help="print the audit log: gate changes, promotions, forced promotions, rollbacks")
    parser.add_argument(
        "--metric",
        default=None,
        help="assert the gate metric (must equal the model's gate.metric tag; default: that tag)",
    )
    parser.add_argument("--margin", type=float, default=None, help="required improvement (default 0)")
    parser.add_argument("--force", action="store_true",
                        help="promoter identity only, with --why: skip the gate "
                             "(recorded: who, why, previous)")
    parser.add_argument("--why", default="", help="reason, stored as a tag")
    parser.add_argument(
        "--who", default=None, help="actor recorded in tags (default: $CHUNKGRPO_USER or login)"
    )
    parser.add_argument("--strict", action="store_true", help="exit 1 when the gate rejects the version")


def run(args: argparse.Namespace) -> int:
    from chunkgrpo.errors import UserError
    from chunkgrpo.registry.promotion import rollback, set_gate

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    if args.set_gate:
        metric, sep, direction = args.set_gate.rpartition(":")
        if not sep or not metric or direction not in ("max", "min"):
            raise UserError(f"--set-gate {args.set_gate!r}: expected METRIC:max or METRIC:min")
        if not args.why:
            raise UserError("--set-gate changes how every future promotion is judged: say why with --why")
        set_gate(args.model, metric, direction, margin=args.margin or 0.0, who=args.who, why=args.why)
        print(f"{args.model}: gate = {metric} ({'higher' if direction == 'max' else 'lower'} is better, "
              f"margin {args.margin or 0.0:g}) for versions registered from now on")
        return 0
    if args.history:
        from chunkgrpo.registry.promotion import promotion_history

        for e in promotion_history(args.model):
            shown = ("at", "action", "version", "by", "identity", "why")
            extra = {k: v for k, v in e.items() if k not in shown}
            print(f"{e.get('at', '?')}  {e.get('action', '?'):9s} v{e.get('version', '-')}"
                  f"  by {e.get('by', '?')}"
                  f"{' (' + e['identity'] + ')' if e.get('identity') else ''}"
                  f"{'  why: ' + e['why'] if e.get('why') else ''}  {json.dumps(extra, sort_keys=True)}")
        return 0
    if args.rollback:
        if args.force or args.metric or args.margin is not None:
            raise UserError("--rollback takes no gate options or --force")
        print(rollback(args.model, who=args.who, why=args.why).line())
        return 0
    from chunkgrpo.stages.promote import promote

    res = promote(args.model, args.version, args.metric, args.margin, who=args.who, why=args.why,
                  force=args.force)
    print(res.line())
    return 1 if (args.strict and res.action == "rejected") else 0
