"""Build a tiny random-weight FLUX pipeline folder (real diffusers/transformers classes) offline."""

NAME = "tiny-model"
HELP = "write a tiny random-weight FLUX pipeline folder (for tests, demos, benchmarks)"


def add_arguments(p):
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--seed", type=int, default=0, help="weight-initialisation seed")
    p.add_argument("--size", default="tiny", choices=["tiny", "mid", "flux"], help="architecture size")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing tiny model in --out (any other non-empty folder is never touched)",
    )


def run(args):
    from chunkgrpo.testing.tiny import build_tiny_flux

    out = build_tiny_flux(args.out, seed=args.seed, size=args.size, overwrite=args.overwrite)
    print(f"tiny FLUX ({args.size}, seed {args.seed}) written to {out}")
