"""toy_ablation: python_func with the ablation library and the S3 upload stubbed: settings passed through,
the series root, outputs (JSON, Markdown table, PNG, flat metrics with the primary difference, its CI, the
seeds so far and the minimum detectable effect) and the results folder uploaded under the run."""

import json
from contextlib import contextmanager
from pathlib import Path

import pytest

from components.ablation.component import toy_ablation


def test_settings_outputs_metrics_and_upload(monkeypatch, artifact, tmp_path):
    import chunkgrpo.store.client as store
    import chunkgrpo.toy.ablation as ablation
    from chunkgrpo import tracking

    seen, uploads, logged = {}, [], {}

    def fake_run(cfg, series_root, new_seeds):
        seen["cfg"], seen["series"] = cfg, (series_root, new_seeds)
        out = Path(cfg.out)
        result = {
            "methods": {
                "base": {"overall": {"mean": 0.2}, "tasks": {"counting": {"mean": 0.1}}},
                "chunk_dynamics": {"overall": {"mean": 0.3}, "tasks": {"counting": {"mean": float("nan")}}},
            },
            "paired": [{"a": "chunk_dynamics", "b": "step_flow", "diff": {"mean": 0.05}}],
            "primary": {
                "diff": {"mean": 0.05, "ci95": 0.02, "p": 0.01},
                "mde_at_seeds": 0.04,
                "mde_at_seeds_assumed_sd": float("nan"),
            },
            "series": {
                "uri": "s3://bkt/nightly/ablation-series/k1",
                "seeds": [0, 1, 2, 3],
                "seeds_added": [2, 3],
            },
        }
        (out / "ablation.json").write_text(json.dumps(result))
        (out / "ablation.md").write_text("| comparison |\n")
        (out / "curves.png").write_bytes(b"\x89PNG")
        return result

    @contextmanager
    def fake_stage_run(name, parent_run_id=None, params=None, **kw):
        class Run:
            def log_metrics(self, m):
                logged.update(m)

            def log_artifact(self, p):
                logged.setdefault("_artifacts", []).append(Path(p).name)
        logged["_parent"] = parent_run_id
        yield Run()

    # the component sets the MLflow parent run for this process (as in its own pod): restore it afterwards
    monkeypatch.setenv("CHUNKGRPO_MLFLOW_PARENT_RUN_ID", "")
    monkeypatch.setattr(ablation, "run_series", fake_run)
    monkeypatch.setattr(tracking, "stage_run", fake_stage_run)
    monkeypatch.setattr(store.ArtifactStore, "__init__", lambda self, *a, **k: None)
    monkeypatch.setattr(
        store.ArtifactStore, "put_folder", lambda self, src, uri, meta=None: uploads.append((uri, meta))
    )
    model = tmp_path / "toy"
    model.mkdir()
    (model / "model_index.json").write_text("{}")  # resolve_model_source only checks the folder's shape
    results, table, curves, metrics = artifact("a.json"), artifact("a.md"), artifact("c.png"), artifact("m")
    toy_ablation.python_func(
        model=str(model),
        methods=["step_flow", "chunk_dynamics"],
        seeds=2,
        steps=4,
        artifact_root="s3://bkt/nightly",
        run_id="r7",
        parent_run_id="p1",
        results=results,
        table=table,
        curves=curves,
        metrics=metrics,
    )
    cfg = seen["cfg"]
    assert cfg.model == str(model) and cfg.methods == ["step_flow", "chunk_dynamics"]
    assert (cfg.seeds, cfg.steps, cfg.progress) == (2, 4, False)
    assert seen["series"] == (
        "s3://bkt/nightly/ablation-series",
        2,
    )  # default series root, 2 seeds added tonight
    assert json.loads(Path(results.path).read_text())["paired"][0]["a"] == "chunk_dynamics"
    assert Path(table.path).read_text().startswith("| comparison |") and Path(curves.path).read_bytes()
    # NaN summaries (a category nobody scored) are left out rather than logged
    assert metrics.metrics == {
        "ablation.base.overall": 0.2,
        "ablation.base.counting": 0.1,
        "ablation.chunk_dynamics.overall": 0.3,
        "ablation.paired.chunk_dynamics-step_flow": 0.05,
        "ablation.primary.diff": 0.05,
        "ablation.primary.ci95": 0.02,
        "ablation.primary.ci_low": pytest.approx(0.03),
        "ablation.primary.ci_high": 0.07,
        "ablation.primary.p": 0.01,
        "ablation.primary.mde": 0.04,
        "ablation.primary.seeds": 4.0,
    }
    assert logged["_parent"] == "p1" and "ablation.chunk_dynamics.counting" not in logged
    assert sorted(logged["_artifacts"]) == ["ablation.json", "ablation.md", "curves.png"]
    assert uploads == [("s3://bkt/nightly/r7/ablation", {"kind": "ablation", "model": str(model)})]
    assert results.metadata["output_uri"] == "s3://bkt/nightly/r7/ablation"
    assert (results.metadata["series_uri"], results.metadata["seeds"], results.metadata["seeds_added"]) == \
        ("s3://bkt/nightly/ablation-series/k1", 4, 2)
    import os

    assert os.environ["CHUNKGRPO_MLFLOW_PARENT_RUN_ID"] == "p1"  # set for the library's stage runs
