"""Profile the temporal dynamics (relative L1 per step, Eq. 15) of a base model's SDE (training) and ODE
trajectories; `--trajectories` picks the one the planner reads (default sde).

Example: chunkgrpo profile --model DIR --prompts prompts.txt --steps 16 --seeds 2 --out profile.json
"""

NAME = "profile"
HELP = "relative-L1 dynamics profile per sampling step (JSON + PNG plot)"


def add_arguments(p):
    p.add_argument("--config", help="YAML config (ProfileConfig) or preset name")
    p.add_argument("--model", help="model folder, s3:// URI or cached hub id")
    p.add_argument("--prompts", help="prompt file (.txt/.jsonl/.tsv/.parquet)")
    p.add_argument("--steps", type=int, help="sampling steps N")
    p.add_argument("--seeds", type=int, help="noise seeds per prompt")
    p.add_argument("--num-prompts", type=int, help="use the first K prompts (0 = all)")
    p.add_argument("--height", type=int, help="image height (default 720; 64 suits the tiny model)")
    p.add_argument("--width", type=int, help="image width")
    p.add_argument("--out", help="output JSON path")
    p.add_argument(
        "--trajectories",
        choices=["sde", "ode"],
        help="profile the planner reads (default sde: the sampling section's η and rule); both are recorded",
    )
    p.add_argument("overrides", nargs="*", help="key=value config overrides (e.g. sampling.schedule=dynamic)")


def run(args):
    from chunkgrpo.dynamics import ProfileConfig
    from chunkgrpo.stages.profile import profile

    ov = list(args.overrides)
    for flag, key in (("model", "model"), ("prompts", "prompts"), ("steps", "sampling.num_steps"),
                      ("seeds", "seeds"), ("num_prompts", "num_prompts"), ("height", "sampling.height"),
                      ("width", "sampling.width"), ("out", "out"), ("trajectories", "trajectories")):
        val = getattr(args, flag)
        if val is not None:
            ov.append(f"{key}={val}")
    cfg = ProfileConfig.load(args.config, ov)
    p = profile(cfg)
    prof, out = p.data, p.path
    vals = ", ".join(f"{v:.4f}" for v in prof["l1rel"])
    print(f"profile of {prof['samples']} trajectories x {prof['num_steps']} steps -> {out}\n"
          f"  l1rel ({prof['trajectories']}): [{vals}]")
