"""The nightly regression check: tonight's score of a registry version vs the score it was registered with
(the version's evaluation run, `registry.client.registered_metric`), in the registered model's direction."""

from __future__ import annotations

import os
from pathlib import Path


def check_regression(*, results: dict, model_name: str, alias: str, metric: str, direction: str,
                     tolerance: float, fail_on_regression: bool, parent_run_id: str,
                     summary_out: str | Path) -> bool:
    """True when `metric` dropped by more than `tolerance` (the summary, Markdown, is written to
    `summary_out` first). `results`: the evaluation's metrics.json. With MLflow, the direction is the
    registered model's (`direction` may only assert it), and the parent run and version get tags."""
    m = results["metrics"]
    today, base = m.get(f"{metric}.trained", m.get(metric)), m.get(f"{metric}.base")
    reference, version, client = None, None, None
    if os.environ.get("MLFLOW_TRACKING_URI"):
        from mlflow import MlflowClient

        from chunkgrpo.registry.client import registered_metric
        from chunkgrpo.registry.promotion import metric_direction

        client = MlflowClient()
        mv = client.get_model_version_by_alias(model_name, alias)
        version = mv.version
        reference = registered_metric(client, mv, f"eval.{metric}")  # its evaluation run's, else its details'

        direction = metric_direction(client, model_name, f"eval.{metric}", direction)  # never a flag's
    else:
        from chunkgrpo.registry.gate import known_direction

        direction = direction or known_direction(f"eval.{metric}") or "max"
    if today is None:
        raise ValueError(f"metric {metric}.trained not in tonight's results (have {sorted(m)[:20]})")
    sign = 1.0 if direction == "max" else -1.0
    drop = None if reference is None else sign * (reference - today)
    regressed = drop is not None and drop > tolerance
    lines = [f"# Nightly benchmark: {model_name}@{alias} (v{version})", "",
             f"| | {metric} |", "|---|---|", f"| tonight | {today:.6g} |",
             f"| at registration | {reference if reference is None else f'{reference:.6g}'} |",
             f"| base model tonight | {base if base is None else f'{base:.6g}'} |", "",
             ("**REGRESSION**" if regressed else "no regression") +
             (f": drop {drop:+.6g} vs tolerance {tolerance:g} ({direction} is better)" if drop is not None
              else ": no registered reference value")]
    if base is not None and sign * (today - base) <= 0:
        lines.append(f"\nnote: the {alias} does not beat the base model on {metric} tonight")
    if metric.endswith((".delta_ci_low", ".delta_ci_high")) and sign * today <= 0:
        lines.append(
            f"\nnote: tonight the {alias} is not significantly better than the base model ({metric})"
        )
    Path(summary_out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if parent_run_id and client is not None:
        client.set_tag(parent_run_id, "chunkgrpo.regression", str(regressed).lower())
        client.set_tag(parent_run_id, "chunkgrpo.regression.metric", metric)
        client.log_metric(parent_run_id, f"nightly.{metric}", float(today))
        if version:
            client.set_model_version_tag(
                model_name, version, "nightly.last_regression", str(regressed).lower()
            )
    if regressed and fail_on_regression:
        raise RuntimeError(f"{model_name}@{alias} regressed on {metric}: {today:.6g} vs {reference:.6g}")
    return regressed
