"""Train with Chunk-GRPO / step-level GRPO (single process, or under torchrun for N ranks).

Examples:
  chunkgrpo train --config tiny_cpu model=DIR prompts=prompts.txt
  torchrun --standalone --nproc_per_node=8 -m chunkgrpo.train --config chunk_grpo_flux \\
      model=/models/FLUX.1-dev
  chunkgrpo train --config chunk_grpo_flux --help-config      # every option with its help
"""

NAME = "train"
HELP = "GRPO training (presets: chunk_grpo_flux, chunk_grpo_ws_flux, dance_grpo_flux, tiny_cpu)"


def add_arguments(p):
    from chunkgrpo.commands import add_config_arguments

    add_config_arguments(p, "lr=5e-6 sampling.eta=0.3")
    p.add_argument("--dry-run", action="store_true",
                   help="validate config, model dir, prompts and plan (no weights are loaded), print them "
                        "as JSON, then exit")


def run(args):
    import json

    from chunkgrpo.commands import load_stage_config
    from chunkgrpo.stages.train import dry_run, run_local
    from chunkgrpo.train.config import TrainConfig

    cfg = load_stage_config(TrainConfig, args)
    if cfg is None:
        return 0

    if args.dry_run:
        print(json.dumps(dry_run(cfg).to_dict()))
        return 0
    summary = run_local(cfg)
    if summary:
        h = summary["history"]
        print(
            f"trained {summary['optimizer_steps']} optimizer steps "
            f"({cfg.method}, chunks {summary['chunk_sizes']}); "
            f"reward {h[0]['reward_mean']:.4f} -> {h[-1]['reward_mean']:.4f}; "
            f"model -> {summary['final_model']}"
        )
