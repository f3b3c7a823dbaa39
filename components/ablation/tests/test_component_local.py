"""toy_ablation under kfp.local (SubprocessRunner) against local SeaweedFS + MLflow, on a toy model with a
few pretraining steps: two methods × two seeds × two optimizer steps (two evaluation points), for real."""

import json

import pytest
from kfp import dsl

from components.ablation.component import toy_ablation

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def toy_model(tmp_path_factory):
    from chunkgrpo.toy.model import ToyModelConfig, build_toy_model

    cfg = ToyModelConfig(steps=20, batch_size=8, pool=256, warmup=5, eval_per_category=2, eval_samples=1,
                         sample_steps=4)
    return build_toy_model(tmp_path_factory.mktemp("toy") / "model", cfg,
                           cache_dir=tmp_path_factory.mktemp("toy-cache"), progress=False)


def test_ablation_runs_locally(local_runner, toy_model):
    @dsl.pipeline(name="ablation-local")
    def p(model: str):
        toy_ablation(model=model, methods=["step_flow", "chunk_dynamics"], seeds=2, steps=2,
                     artifact_root="s3://chunkgrpo/ablation-local", run_id="local", parent_run_id="",
                     plan="sizes:2,3,4", eval_per_category=1, eval_samples=1)

    p(model=str(toy_model))
    from chunkgrpo.store.client import ArtifactStore

    store = ArtifactStore(local_runner.store_config)
    manifest = store.read_manifest("s3://chunkgrpo/ablation-local/local/ablation")
    assert manifest is not None and {"ablation.json", "ablation.md"} <= set(manifest.files)
    result = json.loads(store.get_bytes("s3://chunkgrpo/ablation-local/local/ablation/ablation.json"))
    assert set(result["methods"]) == {"base", "step_flow", "chunk_dynamics"}
    assert all(e["seeds"] == [0, 1] for e in result["methods"].values())
    assert result["paired"][0]["a"] == "chunk_dynamics" and result["paired"][0]["seeds"] == [0, 1]
