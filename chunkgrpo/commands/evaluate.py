"""Evaluate a trained model (hybrid inference) against its base model on HPDv2 / GenEval / WISE.

Writes images, metrics.json and a self-contained report.html to output_dir; logs to MLflow when
MLFLOW_TRACKING_URI is set; uploads output_dir to output_uri (s3://) when given.

Examples:
  chunkgrpo evaluate --config eval_hpdv2 model=runs/r1/final scorer_weights.hpsv3=/models/HPSv3 \\
      scorer_options.hpsv3.processor=/models/Qwen2-VL-7B-Instruct scorer_weights.imagereward=/models/ImageReward
  chunkgrpo evaluate --config eval_tiny base_model=models/tiny-flux model=out/final output_dir=eval-tiny
  chunkgrpo evaluate --config eval_hpdv2 --help-config        # every option with its help
"""

NAME = "evaluate"
HELP = "hybrid-inference evaluation: HPDv2 / GenEval / WISE, metrics.json + report.html (presets: eval_hpdv2, eval_tiny)"


def add_arguments(p):
    p.add_argument("--config", help="preset name (chunkgrpo/presets) or YAML file")
    p.add_argument("--help-config", action="store_true", help="list every option with its default and help")
    p.add_argument("--json", action="store_true", help="print the full metrics dict as JSON instead of a summary")
    p.add_argument("overrides", nargs="*", help="key=value overrides (e.g. num_prompts=8 trained_steps=30)")


def run(args):
    import json
    import logging

    from chunkgrpo.config import describe
    from chunkgrpo.eval.runner import EvalConfig

    if args.help_config:
        print(describe(EvalConfig))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = EvalConfig.load(args.config, args.overrides)
    from chunkgrpo.eval.runner import run_evaluation, summary_lines

    result = run_evaluation(cfg)
    if args.json:
        print(json.dumps(result, indent=1, default=str))
        return 0
    for line in summary_lines(result):
        print(line)
    print(f"metrics -> {result['output_dir']}/metrics.json; report -> {result['output_dir']}/report.html"
          + (f"; uploaded to {result['output_uri']}" if result.get("output_uri") else ""))
    return 0
