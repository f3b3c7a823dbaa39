"""Predict a training run's resources before any GPU time: per-rank GPU memory (setup, rollout and policy
phases), host memory per pod and bytes per volume, from the model architecture on the meta device, the
recipe and the pool's training runtime; exit 2 with one line naming what does not fit."""

NAME = "capacity"
HELP = "predict per-rank GPU memory, host memory and disk of a training config on a GPU pool"


def add_arguments(p):
    from chunkgrpo.commands import add_config_arguments

    add_config_arguments(p, "lora.enabled=true policy_batch=8")
    p.add_argument("--pool", required=True,
                   help="GPU pool: h800, h100 (manifests/overlays/prod-<pool>; in a pod: the live runtime)")
    p.add_argument("--runtime", default="", help="YAML with the ClusterTrainingRuntime chunkgrpo-torch "
                   "(a rendered overlay or `kubectl get ... -o yaml`) instead of the repository's overlay")
    p.add_argument("--nodes", type=int, default=1, help="pods (nodes) of the pool")
    p.add_argument(
        "--output-dir", default="", help="the trainer's output_dir in the pod ('' = the launcher's)"
    )
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--no-check", action="store_true", help="exit 0 even when something does not fit")


def run(args):
    import json

    from chunkgrpo.capacity.plan import capacity_plan, render_table
    from chunkgrpo.capacity.pool import load_pool
    from chunkgrpo.commands import load_stage_config
    from chunkgrpo.errors import UserError
    from chunkgrpo.train.config import TrainConfig

    cfg = load_stage_config(TrainConfig, args)
    if cfg is None:
        return 0
    if args.nodes < 1:
        raise UserError(f"--nodes must be >= 1, got {args.nodes}")
    plan = capacity_plan(
        cfg,
        load_pool(args.pool, args.runtime),
        nodes=args.nodes,
        output_dir=args.output_dir,
        preset=args.config or "",
    )
    print(json.dumps(plan.to_dict(), indent=1) if args.json else render_table(plan))
    problems = plan.problems()
    if problems and not args.no_check:
        raise UserError(f"capacity: {len(problems)} resource(s) do not fit: " + "; ".join(problems))
    return 0
