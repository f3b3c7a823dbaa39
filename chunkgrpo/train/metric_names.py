"""The MLflow names of the trainer's metrics: the internal keys (training history, `train_summary.json`,
the promotion gate) stay as the methods produce them; MLflow gets them under namespaces that group the run
page's charts: reward/, policy/ (the update), time/ (seconds), count/."""

from __future__ import annotations

from collections.abc import Mapping

# internal key -> MLflow name
TRAINING_METRIC_NAMES: dict[str, str] = {
    "reward_mean": "reward/mean",
    "reward_std": "reward/std",
    "loss": "policy/loss",
    "clip_frac": "policy/clip_fraction",
    "ratio_mean": "policy/ratio_mean",
    "ratio_min": "policy/ratio_min",
    "ratio_max": "policy/ratio_max",
    "kl_k3": "policy/kl_k3",
    "grad_norm": "policy/grad_norm",
    "adv_abs_mean": "policy/advantage_abs_mean",
    "kl_ref": "policy/kl_ref",
    "policy_on_s": "time/policy_on",
    "policy_off_s": "time/policy_off",
    "transformer_forward": "count/transformer_forward",
    "transformer_forward_with_grad": "count/transformer_forward_with_grad",
    "transformer_samples": "count/transformer_samples",
    "rollout_samples": "count/rollout_samples",
    "min_transformer_samples": "count/min_transformer_samples",
    "unshared_transformer_samples": "count/unshared_transformer_samples",
    "policy_on_samples": "count/policy_on_samples",
    "policy_off_samples": "count/policy_off_samples",
    "optimizer_step": "count/optimizer_step",
}
# keys the trainer already namespaces: one per reward model (reward/<name>), per timed phase (time/<phase>)
TRAINING_METRIC_PREFIXES = ("reward/", "time/")
UNMAPPED_PREFIX = "other/"


def training_metric_name(key: str) -> str:
    """The MLflow name of one internal training metric key; a key the table lacks goes under `other/`."""
    if key in TRAINING_METRIC_NAMES:
        return TRAINING_METRIC_NAMES[key]
    if key.startswith(TRAINING_METRIC_PREFIXES):
        return key
    return UNMAPPED_PREFIX + key


def training_metrics_for_mlflow(metrics: Mapping[str, float]) -> dict[str, float]:
    """One training iteration's metrics under their MLflow names."""
    return {training_metric_name(k): v for k, v in metrics.items()}
