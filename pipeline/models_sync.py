"""One-time pipeline: fill the S3 model cache (base FLUX model, reward and scorer weights) from the hub.

The only chunkgrpo step that reaches a model hub: it needs egress to the hub from the pipeline
namespace and, for gated models such as FLUX.1-dev, a token in Secret `chunkgrpo-hf` (key HF_TOKEN).
Every other run reads the cache (`model=s3://chunkgrpo-data/models/black-forest-labs/FLUX.1-dev`).
The same from a workstation: `chunkgrpo models sync --defaults --download`.
"""

from kfp import dsl, kubernetes

from components import sync_models
from components.k8s import HF_SECRET, HF_SECRET_KEYS, configure, small

NAME = "chunkgrpo-models-sync"
LITERALS: dict = {}


def make_models_sync(pool: str = "cpu"):
    def models_sync(hub_ids: list = [], root: str = "", revision: str = ""):
        s = sync_models(hub_ids=hub_ids, root=root, revision=revision)
        configure(small(s, "8G"), display_name="sync models to S3", cache=False, retries=2)
        kubernetes.use_secret_as_env(
            s, secret_name=HF_SECRET, secret_key_to_env=HF_SECRET_KEYS, optional=True
        )
        # FLUX.1-dev (~34 GB) + Qwen2-VL-7B (~17 GB) + reward weights pass through the hub cache here
        kubernetes.empty_dir_mount(s, volume_name="hub-cache", mount_path="/cache", size_limit="200Gi")
        s.set_env_variable("HF_HOME", "/cache/huggingface")

    models_sync.__doc__ = """Download hub models once and store them in the S3 model cache.

    Args:
        hub_ids: Hub ids (org/name) as a JSON list; [] = FLUX.1-dev plus the default reward/scorer weights.
        root: s3:// prefix of the cache ('' = s3://chunkgrpo-data/models).
        revision: Hub revision for every model ('' = main).
    """
    return dsl.pipeline(
        name=NAME,
        description="One-time: cache FLUX.1-dev and the reward/scorer weights in S3 "
        "for the training and benchmark pipelines.",
    )(models_sync)


models_sync = make_models_sync()
