"""toy_ablation under kfp.local (SubprocessRunner) against local SeaweedFS + MLflow, on a toy model with a
few pretraining steps, for real: two nights of two methods × one seed × two optimizer steps (two evaluation
points) give a results folder with both nights' seeds, the base and both methods, and the paired
chunk − step difference; the second night reuses the first night's runs from the series in S3 (keyed by
seed) instead of recomputing them. (The nightly pipeline's own run, two seeds in one night, is
tests/pipeline/test_local_run.py's.)"""

import json

import pytest
from kfp import dsl

from components.ablation.component import toy_ablation

pytestmark = pytest.mark.integration

SERIES = "s3://chunkgrpo/ablation-series-test"


@pytest.fixture(scope="module")
def toy_model(tmp_path_factory):
    from chunkgrpo.toy.model import ToyModelConfig, build_toy_model

    cfg = ToyModelConfig(steps=20, batch_size=8, pool=256, warmup=5, eval_per_category=0, sample_steps=4)
    return build_toy_model(tmp_path_factory.mktemp("toy") / "model", cfg,
                           cache_dir=tmp_path_factory.mktemp("toy-cache"), progress=False)


def test_two_nights_accumulate_seeds_in_one_series(local_runner, toy_model):
    @dsl.pipeline(name="ablation-nightly")
    def night(model: str, run_id: str):
        toy_ablation(
            model=model,
            methods=["step_flow", "chunk_dynamics"],
            seeds=1,
            steps=2,
            artifact_root="s3://chunkgrpo/ablation-nightly",
            run_id=run_id,
            parent_run_id="",
            series_root=SERIES,
            plan="sizes:2,3,4",
            eval_per_category=1,
            eval_samples=1,
            eval_points=2,
        )

    from chunkgrpo.store.client import ArtifactStore

    store = ArtifactStore(local_runner.store_config)
    nights = []
    for run_id in ("night-1", "night-2"):
        night(model=str(toy_model), run_id=run_id)
        nights.append(json.loads(store.get_bytes(f"s3://chunkgrpo/ablation-nightly/{run_id}/ablation/ablation.json")))
    first, second = nights
    assert (
        first["series"]["seeds"] == [0] and first["series"]["runs_computed"] == 3
    )  # base + the primary pair
    key = second["series"]["key"]
    assert key == first["series"]["key"]  # same engine, model and configuration: the same series
    assert second["series"]["seeds"] == [0, 1] and second["series"]["seeds_added"] == [1]
    assert (
        second["series"]["runs_computed"] == 3 and second["series"]["runs_reused"] == 3
    )  # night 1's runs reused
    assert second["primary"]["seeds"] == [0, 1] and all(
        e["seeds"] == [0, 1] for e in second["methods"].values()
    )
    # the first night's seed is byte-for-byte the same result in the second night's table
    assert second["methods"]["chunk_dynamics"]["overall"]["values"][0] == \
        first["methods"]["chunk_dynamics"]["overall"]["values"][0]
    assert set(second["methods"]) == {"base", "step_flow", "chunk_dynamics"}
    assert second["paired"][0]["a"] == "chunk_dynamics" and second["paired"][0]["seeds"] == [0, 1]
    manifest = store.read_manifest("s3://chunkgrpo/ablation-nightly/night-2/ablation")
    assert manifest is not None and {"ablation.json", "ablation.md"} <= set(manifest.files)
    # the series in S3: one file per method and seed
    keys = sorted(e.key.split(f"{key}/", 1)[1] for e in store.list(f"{SERIES}/{key}/runs/"))
    assert keys == [
        f"runs/{m}/seed-{s}.json" for m in ("base", "chunk_dynamics", "step_flow") for s in (0, 1)
    ]
    md = store.get_bytes("s3://chunkgrpo/ablation-nightly/night-2/ablation/ablation.md").decode()
    assert (
        "Nightly series" in md
        and "2 seeds so far (1 added tonight)" in md
        and "minimum detectable effect" in md
    )
