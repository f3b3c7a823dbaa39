"""The model cache in S3 (base FLUX model, reward and scorer weights) that pipeline runs read.

    chunkgrpo models sync black-forest-labs/FLUX.1-dev [--download] [--revision REV]
    chunkgrpo models sync /path/to/folder --to s3://chunkgrpo-data/models/THUDM/ImageReward
    chunkgrpo models sync --defaults [--download]      # the base model, every default reward/scorer weight
                                                       # and the default training prompts (PartiPrompts)
    chunkgrpo models sync --prompts hpdv2_train.txt    # your own training prompts -> s3://chunkgrpo-data/prompts/
    chunkgrpo models uri MizzenAI/HPSv3                 # where the pipeline looks for a hub model

A hub id is taken from the local hub cache (HF_HOME), or downloaded with `--download` (HF_TOKEN
from the environment for gated models such as FLUX.1-dev): run this once, on a machine with hub
access, against the cluster's S3 (CHUNKGRPO_S3_ENDPOINT + AWS_* keys). Re-running is a no-op for
folders that are already complete and identical. The default root is $CHUNKGRPO_MODEL_ROOT or
s3://chunkgrpo-data/models.
"""

from __future__ import annotations

import argparse
import logging

NAME = "models"
HELP = "fill the S3 model cache pipeline runs read (base model, reward/scorer weights)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    p = sub.add_parser("sync", help="upload a hub model or folder to the S3 model cache")
    p.add_argument("source", nargs="?", help="hub id (org/name) or local folder")
    p.add_argument("--to", default=None, help="destination s3:// URI (default <root>/<hub id>)")
    p.add_argument(
        "--defaults", action="store_true", help="the base model and every default reward/scorer weight"
    )
    p.add_argument("--download", action="store_true", help="download from the hub if not in the local cache")
    p.add_argument("--prompts", default=None, metavar="FILE",
                   help="a training prompt file (.txt/.jsonl/.tsv/.parquet) to upload to "
                        "s3://chunkgrpo-data/prompts/<name> (or --to); pass the printed URI as prompts=")
    p.add_argument("--revision", default=None, help="hub revision (branch, tag or commit)")
    p = sub.add_parser("uri", help="print the cache URI of a hub id")
    p.add_argument("hub_id")


def run(args: argparse.Namespace) -> int:
    from chunkgrpo import model_cache
    from chunkgrpo.errors import UserError
    from chunkgrpo.stages.models import default_sources, sync_models, sync_prompts

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.action == "uri":
        print(model_cache.model_uri(args.hub_id))
        return 0
    if args.prompts:
        if args.source or args.defaults:
            raise UserError("--prompts FILE takes no SOURCE or --defaults")
        sync_prompts(args.prompts, to=args.to)
        return 0
    if args.defaults:
        if args.source or args.to:
            raise UserError("--defaults takes no SOURCE or --to")
        sync_models(default_sources(), download=args.download, revision=args.revision)
        sync_prompts()
        return 0
    if args.source:
        sources = [args.source]
    else:
        raise UserError("give a hub id or folder to sync, or --defaults")
    if args.to and len(sources) != 1:
        raise UserError("--to needs exactly one SOURCE")
    sync_models(sources, to=args.to, download=args.download, revision=args.revision)
    return 0
