"""An evaluation stage's MLflow run, for registry tests: promotion trusts only such a run's metrics."""

from __future__ import annotations

from collections.abc import Mapping


def eval_run(metrics: Mapping[str, float], experiment: str = "registry-tests-eval") -> str:
    """The id of a FINISHED run tagged chunkgrpo.stage=evaluate (as `chunkgrpo evaluate` logs it) holding
    `metrics` as the evaluation names them (`hpdv2.hpsv3.trained`, `hpdv2.hpsv3.delta_ci_low`, ...)."""
    from chunkgrpo.tracking import stage_run

    with stage_run("evaluate", experiment=experiment) as run:
        run.log_metrics(dict(metrics))
    return run.run_id


def eval_run_for(registry_metrics: Mapping[str, float]) -> str:
    """`eval_run` from registry names (`eval.hpdv2.hpsv3` -> `hpdv2.hpsv3.trained`; names with a
    statistics suffix such as `.delta_ci_low` keep it)."""
    out = {}
    for k, v in registry_metrics.items():
        stem = k[len("eval."):] if k.startswith("eval.") else k
        out[stem if stem.rsplit(".", 1)[-1].startswith(("delta", "base", "win_rate", "n_pairs")) else
            stem + ".trained"] = v
    return eval_run(out)
