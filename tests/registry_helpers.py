"""An evaluation stage's MLflow run, for registry tests: promotion trusts only such a run's metrics, and
only for the weights it names (tag chunkgrpo.weights_sha256, as `chunkgrpo evaluate` records it)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path


def eval_run(metrics: Mapping[str, float], experiment: str = "registry-tests-eval",
             weights: str | Path | None = None) -> str:
    """The id of a FINISHED run tagged chunkgrpo.stage=evaluate (as `chunkgrpo evaluate` logs it) holding
    `metrics` as the evaluation names them (`hpdv2.hpsv3.trained`, `hpdv2.hpsv3.delta_ci_low`, ...) and,
    given the `weights` folder it scored, their digest (`store.manifest.weights_sha256`)."""
    from chunkgrpo.store.manifest import WEIGHTS_TAG, weights_sha256
    from chunkgrpo.tracking import stage_run

    tags = {WEIGHTS_TAG: weights_sha256(weights)} if weights is not None else {}
    with stage_run("evaluate", experiment=experiment, tags=tags) as run:
        run.log_metrics(dict(metrics))
    return run.run_id


def eval_run_for(registry_metrics: Mapping[str, float], weights: str | Path | None = None) -> str:
    """`eval_run` from registry names (`eval.hpdv2.hpsv3` -> `hpdv2.hpsv3.trained`; names with a
    statistics suffix such as `.delta_ci_low` keep it)."""
    out = {}
    for k, v in registry_metrics.items():
        stem = k[len("eval."):] if k.startswith("eval.") else k
        out[stem if stem.rsplit(".", 1)[-1].startswith(("delta", "base", "win_rate", "n_pairs")) else
            stem + ".trained"] = v
    return eval_run(out, weights=weights)
