"""One-time: fill the S3 model cache from the hub (the `models_sync` pipeline). The step is
`chunkgrpo.stages.models.sync_models`."""

from kfp import dsl

from components.images import RUNTIME_IMAGE


@dsl.component(base_image=RUNTIME_IMAGE, install_kfp_package=False)
def sync_models(hub_ids: list, root: str, revision: str) -> list:
    """Download each hub model (HF_TOKEN from Secret chunkgrpo-hf for gated ones) and put it into S3.

    Args:
        hub_ids: hub ids (org/name) to cache; [] = the base model, the default reward/scorer weights and
            the default training prompts (the shipped PartiPrompts, uploaded if not there).
        root: s3:// prefix of the model cache ('' = $CHUNKGRPO_MODEL_ROOT or s3://chunkgrpo-data/models).
        revision: hub revision for every model ('' = main).

    Returns:
        The s3:// URIs, in the order of hub_ids (for [], the defaults' URIs, then the prompts URI).
    """
    from chunkgrpo.stages.task import stage_env

    stage_env("")
    from chunkgrpo.stages.models import default_sources, sync_prompts
    from chunkgrpo.stages.models import sync_models as sync

    if hub_ids:
        return sync(list(hub_ids), root=root, download=True, revision=revision)
    return [*sync(default_sources(), root=root, download=True, revision=revision), sync_prompts()]
