"""sync_models: python_func with model_cache.sync stubbed."""

from chunkgrpo import model_cache
from components.models.component import sync_models


def test_defaults_and_uris(monkeypatch):
    calls = []
    monkeypatch.setattr(model_cache, "sync", lambda hub_id, dest, download, revision: calls.append(
        (hub_id, dest, download, revision)) or (dest, True))
    import chunkgrpo.stages.models as stage

    monkeypatch.setattr(stage, "sync_prompts", lambda: stage.DEFAULT_TRAIN_PROMPTS)
    out = sync_models.python_func(hub_ids=[], root="s3://cache/m", revision="")
    assert [c[0] for c in calls] == [model_cache.BASE_MODEL, *model_cache.REWARD_MODELS.values()]
    assert out[-1] == stage.DEFAULT_TRAIN_PROMPTS  # the defaults include the training prompts
    assert out[0] == "s3://cache/m/black-forest-labs/FLUX.1-dev" and all(c[2] is True for c in calls)
