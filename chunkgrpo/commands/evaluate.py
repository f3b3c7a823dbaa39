"""Evaluate a trained model (hybrid inference) against its base model on HPDv2 / GenEval / WISE.

Writes images, metrics.json and a self-contained report.html to output_dir; logs to MLflow when
MLFLOW_TRACKING_URI is set; uploads output_dir to output_uri (s3://) when given.

Examples:
  chunkgrpo evaluate --config eval_hpdv2 model=runs/r1/final scorer_weights.hpsv3=/models/HPSv3 \\
      scorer_options.hpsv3.processor=/models/Qwen2-VL-7B-Instruct \\
      scorer_weights.imagereward=/models/ImageReward
  chunkgrpo evaluate --config eval_tiny base_model=models/tiny-flux model=out/final output_dir=eval-tiny
  chunkgrpo evaluate --config eval_hpdv2 --help-config        # every option with its help
"""

NAME = "evaluate"
HELP = (
    "hybrid-inference evaluation: HPDv2 / GenEval / WISE, metrics.json + report.html "
    "(presets: eval_hpdv2, eval_toy, eval_tiny)"
)


def add_arguments(p):
    from chunkgrpo.commands import add_config_arguments

    add_config_arguments(p, "num_prompts=8 sampling.trained_steps=30")
    p.add_argument(
        "--json", action="store_true", help="print the full metrics dict as JSON instead of a summary"
    )


def run(args):
    import json

    from chunkgrpo.commands import load_stage_config
    from chunkgrpo.eval.config import EvalConfig
    from chunkgrpo.eval.runner import summary_lines
    from chunkgrpo.stages.evaluate import run as evaluate

    cfg = load_stage_config(EvalConfig, args)
    if cfg is None:
        return 0

    result = evaluate(cfg)
    if args.json:
        print(json.dumps(result, indent=1, default=str))
        return 0
    for line in summary_lines(result):
        print(line)
    print(f"metrics -> {result['output_dir']}/metrics.json; report -> {result['output_dir']}/report.html"
          + (f"; uploaded to {result['output_uri']}" if result.get("output_uri") else ""))
    return 0
