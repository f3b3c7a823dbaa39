"""One-time: fill the S3 model cache from the hub (the `models_sync` pipeline)."""

from kfp import dsl

from components._shared import stage_env
from components.images import RUNTIME_IMAGE


@dsl.component(base_image=RUNTIME_IMAGE, install_kfp_package=False, additional_funcs=[stage_env])
def sync_models(hub_ids: list, root: str, revision: str) -> list:
    """Download each hub model (HF_TOKEN from Secret chunkgrpo-hf for gated ones) and put it into S3.

    Args:
        hub_ids: hub ids (org/name) to cache; [] = the base model and the default reward/scorer weights.
        root: s3:// prefix of the model cache ('' = $CHUNKGRPO_MODEL_ROOT or s3://chunkgrpo-data/models).
        revision: hub revision for every model ('' = main).

    Returns:
        The s3:// URIs, in the order of hub_ids.
    """
    stage_env("")
    from chunkgrpo import model_cache

    ids = list(hub_ids) or [model_cache.BASE_MODEL, *model_cache.REWARD_MODELS.values()]
    out = []
    for hub_id in ids:
        uri, uploaded = model_cache.sync(hub_id, model_cache.model_uri(hub_id, root or None), download=True,
                                         revision=revision or None)
        print(f"{hub_id} -> {uri}" + ("" if uploaded else " (already there)"), flush=True)
        out.append(uri)
    return out
