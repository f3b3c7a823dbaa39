"""Plan the chunks (consecutive groups of trainable steps) from a dynamics profile.

Example: chunkgrpo plan --profile profile.json --chunks dynamics --out plan.json
Specs (`chunks`): dynamics[:max=5,last=0.5,min=2,rel=0.1] | uniform:N | sizes:2,3,4,7 | step | whole
"""

NAME = "plan"
HELP = "chunk boundaries from a profile (dynamics | uniform:N | sizes:… | step | whole)"


def add_arguments(p):
    p.add_argument("--profile", required=True, help="profile.json from `chunkgrpo profile`")
    p.add_argument("--chunks", "--strategy", dest="chunks", default="dynamics",
                   help="the chunk plan spec to plan (default: dynamics); --strategy is its former name")
    p.add_argument(
        "--out", required=True, help="output plan JSON (a PNG with the chunks is written next to it)"
    )
    p.add_argument("--trajectories", choices=["sde", "ode"], default=None,
                   help="profile curve to plan on (default: the profile's, sde = the training trajectories)")


def run(args):
    from chunkgrpo.stages.plan import plan as plan_stage

    p = plan_stage(args.profile, args.chunks, args.out, trajectories=args.trajectories)
    plan, out = p.data, p.path
    print(
        f"plan {plan['strategy']} on {plan['trajectories'].upper()} trajectories: sizes {plan['sizes']} over "
        f"{plan['trainable_steps']} trainable steps -> {out}"
    )
    print(f"  rationale: {plan['rationale']}")
