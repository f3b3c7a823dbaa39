"""Build the toy-world base model: a small FLUX (real diffusers classes) pretrained by flow matching on
synthetic compositional scenes, plus its prompt files (train prompts, held-out GenEval metadata) and a
samples grid. Cached by a content hash: a second call with the same settings returns at once.

    chunkgrpo toy-model --out models/toy                 # ~5 min on 2 quiet cores, then cached
    chunkgrpo toy-model --out models/toy steps=300       # any ToyModelConfig field as key=value
"""

NAME = "toy-model"
HELP = "build (or reuse) the pretrained toy-world FLUX model and its prompt files"


def add_arguments(p):
    p.add_argument(
        "--out", help="output folder (created; refused if it holds something that is not a toy model)"
    )
    p.add_argument(
        "--cache-dir",
        default=None,
        help="cache root (default $CHUNKGRPO_CACHE or ~/.cache/chunkgrpo); "
        "models live in <root>/toy-models/<hash>",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--help-config", action="store_true", help="list every option with its default and help")
    p.add_argument(
        "overrides", nargs="*", help="key=value overrides of the toy model config (e.g. steps=300 threads=1)"
    )


def run(args):
    import json
    import time

    from chunkgrpo.config import describe
    from chunkgrpo.errors import UserError
    from chunkgrpo.toy.model import ToyModelConfig, build_toy_model, model_key, read_meta

    if args.help_config:
        print(describe(ToyModelConfig))
        return 0
    if not args.out:
        raise UserError("toy-model needs --out DIR")
    cfg = ToyModelConfig.load(None, args.overrides)
    t0 = time.perf_counter()
    out = build_toy_model(args.out, cfg, cache_dir=args.cache_dir, progress=not args.no_progress)
    meta = read_meta(out)
    took = time.perf_counter() - t0
    pre = meta["pretraining"]
    print(f"toy model {model_key(cfg)} at {out} ({'built' if took > 5 else 'cached'}, {took:.1f} s)")
    loss = f"; loss {pre['loss_first']:.3f} → {pre['loss_last']:.3f}" if pre["steps"] else " (random init)"
    print(f"  pretraining: {pre['steps']} steps × {cfg.batch_size} scenes, {pre['wall_s']:.0f} s wall, "
          f"{pre['cpu_s']:.0f} s CPU, {pre['threads']} thread(s){loss}")
    if pre.get("heldout_error") is not None:
        print(f"  held-out one-step x0 error (pixel MSE): {pre['heldout_error']:.4f}")
    base = meta.get("base_accuracy")
    if base:
        tasks = ", ".join(f"{k} {v:.2f}" for k, v in base["tasks"].items())
        print(
            f"  base held-out GenEval accuracy: overall {base['overall']:.3f} "
            f"({tasks}; {base['n_images']} images; "
            f"partial credit {base.get('partial', float('nan')):.3f})"
        )
    files = meta["files"]
    print("  files: " + json.dumps({k: str(out / v) for k, v in files.items()}))
