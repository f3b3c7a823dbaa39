"""The registry's decision rules, as pure functions over plain data: no MLflow, no I/O.

**The gate.** A candidate replaces the champion only if it beats it on the gate metric by more than
`margin` (`gate_decision`); ties do not pass. The metric and its direction belong to the registered
model (tags `gate.metric` / `gate.direction`, else the metric's known direction, `known_direction`);
a caller may only assert them (`resolve`), or name the confidence bound of the same metric's paired
trained − base delta (`<metric>.delta_ci_low` for max, `.delta_ci_high` for min, `CI_BOUNDS`): a stricter
gate in the same direction, where `margin` is an absolute threshold on the bound. A version is judged by
the gate recorded at its registration (`snapshot_gate`), which a caller may only make stricter (`narrow`).

**What is compared.** Only values its evaluation run logged exactly once and finite
(`check_eval_run`, `trusted_value`), under the same eval protocol (`eval_protocol`, `protocol_hash`,
`check_same_protocol`). A registering caller's numbers must agree with that run (`check_agrees`) and
never supply the tags promotion trusts (`untrusted`).

The MLflow side (reading the tags and runs these rules take, writing the decisions) is
`chunkgrpo.registry.promotion` and `chunkgrpo.registry.registration`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import sys
from collections.abc import Mapping
from typing import Any, Literal

from chunkgrpo.config import Config, option
from chunkgrpo.errors import UserError
from chunkgrpo.tracking import flatten

METRIC_TAG = "metric."
GATE_METRIC_TAG, GATE_DIRECTION_TAG = "gate.metric", "gate.direction"     # registered-model tags
GATE_MARGIN_TAG = "gate.margin"
PROTOCOL_TAG, PROTOCOL_HASH_TAG = "eval.protocol", "eval.protocol.sha256"  # version tags
EVAL_RUN_TAG = "eval.run_id"               # version tag: the evaluation stage's run (the trusted metrics)
GATE_SNAPSHOT_TAG = "gate.at_registration"  # version tag: the model's gate when the version was created
TREE_TAG = "model.tree_sha256"             # version tag: digest of every file of the MLflow model (code too)
WEIGHTS_TAG = "weights.sha256"            # version tag: the registered weights' digest (store.manifest)
KEY_TAG = "registration.key"               # version tag: the idempotency key of the request that created it
STATUS_TAG = "promotion.status"            # version tag: champion / previous / rejected / rolled_back
RECORD_TAG = "promotion.record"            # version tag: who, when, why and the gate's values, one JSON value
# In the version's run: every metric, the eval protocol, the chunk plan, the request's tags and the
# descriptive fields the version's tags leave out (`details_artifact`).
DETAILS_ARTIFACT = "registration/details.json"
PROMOTER_TAG = "promoter"                  # registered-model tag: the identity that owns promotion
EVAL_EXPERIMENT_TAG = "gate.eval_experiment_id"  # registered-model tag: where trusted evaluations run
LOCK_SUFFIX = ".promotion-lock"            # registered model created/deleted as the promotion mutex
MAX_NAME_LEN = 200                         # MLflow's name column is 256 wide; the lock adds 15
MAX_TAG = 5000                             # MLflow's tag value limit
MAX_WHY = 1000                             # characters of a reason (`why`): an audit entry fits one tag
LOG_TAG = "promotion.log"                  # registered-model tag of older registries: one JSON list
LOG_PREFIX = "promotion.log."              # registered-model tags: one per audit entry, never rewritten
REJECTED_TAG = "promotion.rejected_count"  # registered-model tag: rejected promotions (not in the log)
# Aliases only the gate moves: no request may name them for a new version (`check_alias`).
PROTECTED_ALIASES = ("champion", "previous")
PROTECTED_TAG = "gate.protected_aliases"   # registered-model tag: more aliases a promotion moved (JSON list)
# the version tags only the registry computes (never copied from a caller's tags)
TRUSTED_TAGS = (EVAL_RUN_TAG, GATE_SNAPSHOT_TAG, TREE_TAG, METRIC_TAG, WEIGHTS_TAG, "registration.",
                "promotion.", "gate.")
# Direction of metrics whose meaning is fixed (last dotted component, after stripping the
# .trained/.base/.delta/CI suffixes); anything else needs a gate.direction tag on the model.
KNOWN_DIRECTIONS = {name: "max" for name in (
    "hpsv3", "hpsv2", "hpsv2.1", "imagereward", "pickscore", "clip", "geneval", "overall", "wise", "wiscore",
    "brightness", "contrast", "color", "reward_mean")}
DEFAULT_GATE_METRIC = "eval.hpdv2.hpsv3"
CI_BOUNDS = {".delta_ci_low": "max", ".delta_ci_high": "min"}


# ---------------------------------------------------------------------------------------- config


@dataclasses.dataclass
class GateConfig(Config):
    """When a candidate may replace the champion."""

    metric: str = option("", "metric compared; '' = the registered model's gate.metric tag (default "
                             "eval.hpdv2.hpsv3, mean HPSv3 on the HPDv2 test set), or that metric's CI bound "
                             "(<metric>.delta_ci_low, see gate_decision)")
    direction: str = option(
        "",
        "'' = the registered model's (gate.direction tag, else the known direction of "
        "the metric); 'max'/'min' only to assert it: a different one is refused",
    )
    margin: float = option(
        0.0,
        "the candidate must beat the champion by MORE than this (absolute units); for a "
        "CI-bound metric (*.delta_ci_low) the bound itself must exceed it (see gate_decision)",
    )

    def __post_init__(self) -> None:
        if self.direction not in ("", "max", "min"):
            raise UserError(f"gate.direction={self.direction!r} must be 'max' or 'min' (or empty)")
        if self.margin < 0:
            raise UserError(f"gate.margin={self.margin} must be >= 0 (it is an improvement threshold)")


@dataclasses.dataclass
class RegistryConfig(Config):
    """Registered model name, aliases and promotion gate."""

    model_name: str = option("chunkgrpo-flux", "registered model name")
    experiment: str = option("chunkgrpo", "MLflow experiment for the registration run")
    champion_alias: str = option("champion", "alias of the serving model")
    previous_alias: str = option(
        "previous", "alias of the champion before the last promotion (rollback target)"
    )
    challenger_alias: str = option("challenger", "alias given to each newly registered version")
    gate: GateConfig = option(factory=GateConfig, help="promotion gate")

    def __post_init__(self) -> None:
        aliases = [self.champion_alias, self.previous_alias, self.challenger_alias]
        if len(set(aliases)) != 3 or not all(aliases):
            raise UserError(f"registry aliases must be three distinct non-empty names, got {aliases}")
        if not self.model_name.strip():
            raise UserError("registry.model_name must not be empty")


@dataclasses.dataclass
class GateResult:
    passed: bool
    reason: str
    improvement: float | None = None
    values: dict = dataclasses.field(default_factory=dict)  # the trusted candidate/champion values compared


@dataclasses.dataclass
class PromotionResult:
    action: Literal["promoted", "forced", "rejected", "noop", "rolled_back"]
    name: str
    version: str
    previous: str | None
    reason: str

    def line(self) -> str:
        prev = f" (previous: v{self.previous})" if self.previous else ""
        return f"{self.name} v{self.version}: {self.action}{prev} — {self.reason}"


# ------------------------------------------------------------------------------------ the gate


def known_direction(metric: str) -> str | None:
    """'max'/'min' for a metric whose meaning fixes its direction (e.g. ...hpsv3.trained), else None."""
    parts = metric.split(".")
    while parts and parts[-1] in (
        "trained",
        "base",
        "delta",
        "mean",
        "delta_ci_low",
        "delta_ci_high",
        "ci_low",
        "ci_high",
    ):
        parts = parts[:-1]
    for n in (2, 1):
        key = ".".join(parts[-n:]) if len(parts) >= n else None
        if key in KNOWN_DIRECTIONS:
            return KNOWN_DIRECTIONS[key]
    return None


def gate_decision(candidate: float | None, champion: float | None, gate: GateConfig) -> GateResult:
    """Does `candidate` beat `champion` on the gate? Ties (improvement == margin) do not pass.

    `gate` is normally resolved from the registered model (`resolve_gate`); an empty direction here
    means the metric's known one (a CI bound: the direction in `CI_BOUNDS`). No champion -> pass. A
    missing candidate/champion value -> UserError (cannot compare; use force).

    CI-bound gates: when the metric is the lower bound of the 95% CI of trained − base
    (`eval.hpdv2.hpsv3.delta_ci_low`, direction max; `.delta_ci_high` with direction min for lower-is-better
    metrics), `margin` is an absolute threshold on the bound: the candidate passes only if its bound exceeds
    `margin` (margin 0 = significantly better than the base model), even when there is no champion, and, if
    the champion has the bound recorded, also exceeds the champion's bound.
    """
    if not gate.metric:
        raise UserError(
            "gate_decision needs a resolved gate: a metric (resolve_gate gives the registered model's)"
        )
    bound = next((suffix for suffix in CI_BOUNDS if gate.metric.endswith(suffix)), None)
    if gate.direction not in ("max", "min"):
        direction = CI_BOUNDS[bound] if bound else known_direction(gate.metric)
        if direction is None:
            raise UserError(f"the direction of {gate.metric!r} is unknown: record it on the registered model "
                            "(set_gate / promote --set-gate METRIC:max|min)")
        gate = dataclasses.replace(gate, direction=direction)
    if bound is not None:
        return _ci_gate(candidate, champion, gate, bound)
    if champion is None:
        return GateResult(True, "no current champion")
    if candidate is None:
        raise UserError(
            f"candidate has no value for {gate.metric!r}; register it with its metrics or use --force"
        )
    improvement = candidate - champion if gate.direction == "max" else champion - candidate
    better = "higher" if gate.direction == "max" else "lower"
    verdict = (f"{gate.metric}: candidate {candidate:.6g} vs champion {champion:.6g} "
               f"({better} is better, improvement {improvement:+.6g}, margin {gate.margin:g})")
    return GateResult(improvement > gate.margin, verdict, improvement)


def _ci_gate(candidate: float | None, champion: float | None, gate: GateConfig, bound: str) -> GateResult:
    if gate.direction != CI_BOUNDS[bound]:
        raise UserError(
            f"gate.metric={gate.metric!r} is a CI {'lower' if bound.endswith('low') else 'upper'} bound: "
            f"use direction={CI_BOUNDS[bound]} (got {gate.direction})"
        )
    if candidate is None:
        raise UserError(
            f"candidate has no value for {gate.metric!r}; register it with its metrics or use --force"
        )
    sign = 1.0 if gate.direction == "max" else -1.0
    # the bound must clear the margin (vs the base model) and the champion's bound
    threshold = sign * gate.margin if champion is None else (
        max(gate.margin, champion) if sign > 0 else min(-gate.margin, champion))
    improvement = sign * (candidate - threshold)
    vs = f"margin {sign * gate.margin:+g}" + (
        "" if champion is None else f" and champion's bound {champion:+.6g}"
    )
    verdict = (f"{gate.metric}: candidate's CI bound of trained − base {candidate:+.6g} must be "
               f"{'above' if sign > 0 else 'below'} {vs}")
    return GateResult(improvement > 0, verdict, improvement)


def asserted_direction(gate: GateConfig, direction: str, metric: str, name: str) -> str:
    """`direction` (the registered model's), after checking a caller's asserted one agrees."""
    if gate.direction and gate.direction != direction:
        raise UserError(
            f"{metric} of {name!r} is {'higher' if direction == 'max' else 'lower'}-is-better "
            f"({direction}, from the registered model); a gate with direction {gate.direction!r} is "
            "refused"
        )
    return direction


def resolve(name: str, gate: GateConfig | None, tag_metric: str | None,
            tag_direction: str | None) -> GateConfig:
    """The gate as the registered model `name` defines it (its tags `gate.metric`/`gate.direction`). The
    caller may name the metric/direction only to assert them: a metric other than the model's gate
    metric (or its CI bound in its direction), or a direction other than the one recorded (or known)
    for the metric, is a UserError, whatever the caller wanted."""
    gate = gate or GateConfig()
    metric = gate.metric or tag_metric or DEFAULT_GATE_METRIC
    if tag_metric and metric != tag_metric:
        # the one other choice: the CI bound of the model's own metric, in its own direction (stricter)
        bound = tag_metric + next((s for s, d in CI_BOUNDS.items() if d == tag_direction), "")
        if metric != bound or bound == tag_metric:
            raise UserError(
                f"{name!r} is gated on {tag_metric} (tag {GATE_METRIC_TAG}, set at registration); "
                f"comparing on {metric} is refused (allowed: {tag_metric} or its CI bound "
                f"{bound}; change it with `chunkgrpo promote --model {name} --set-gate`)"
            )
        return GateConfig(metric=metric, direction=asserted_direction(gate, tag_direction, metric, name),
                          margin=gate.margin)
    direction = (
        tag_direction if (tag_direction and metric == (tag_metric or metric)) else known_direction(metric)
    )
    if direction is None:
        raise UserError(f"the direction of {metric!r} is unknown: record it on {name!r} once with "
                        f"`chunkgrpo promote --model {name} --set-gate {metric}:max` (or :min)")
    return GateConfig(metric=metric, direction=asserted_direction(gate, direction, metric, name),
                      margin=gate.margin)


def direction_of(name: str, metric: str, tag_metric: str | None, tag_direction: str | None,
                 asserted: str = "") -> str:
    """Direction ('max'/'min') of `metric` for registered model `name`: the model's gate.direction when
    the metric (CI suffix stripped) is its gate metric, else the metric's known direction. `asserted` is
    only checked against that (a different one is a UserError); it decides only where nothing records one."""
    base = next((metric[: -len(s)] for s in CI_BOUNDS if metric.endswith(s)), metric)
    direction = (
        tag_direction if (tag_metric and tag_direction and base == tag_metric) else known_direction(metric)
    )
    if direction is None:
        if asserted in ("max", "min"):
            return asserted
        raise UserError(f"the direction of {metric!r} is unknown for {name!r}: record it once with "
                        f"`chunkgrpo promote --model {name} --set-gate {base}:max` (or :min)")
    return asserted_direction(GateConfig(direction=asserted), direction, metric, name)


def snapshot_gate(text: str | None) -> GateConfig | None:
    """The gate recorded in a version's `gate.at_registration` tag; None when it records none usable."""
    try:
        snap = json.loads(text or "null")
    except json.JSONDecodeError:
        snap = None
    if isinstance(snap, dict) and snap.get("metric") and snap.get("direction") in ("max", "min"):
        return GateConfig(metric=snap["metric"], direction=snap["direction"],
                          margin=float(snap.get("margin") or 0))
    return None


def narrow(name: str, version: str, base: GateConfig, requested: GateConfig | None) -> GateConfig:
    """The gate version `version` is judged by, from the one recorded at its registration (`base`). A
    caller may only make it stricter: assert the same metric (or name that metric's CI bound, in its
    direction) and raise the margin; anything else is a UserError."""
    req = requested or GateConfig()
    metric, direction = base.metric, base.direction
    if req.metric and req.metric != base.metric:
        bound = base.metric + next((s for s, d in CI_BOUNDS.items() if d == base.direction), "")
        if req.metric != bound:
            raise UserError(
                f"v{version} of {name!r} is gated on {base.metric} (recorded at its registration); "
                f"comparing on {req.metric} is refused (allowed: {base.metric} or its CI bound {bound}; "
                "the promoter changes the gate of future versions with `promote --set-gate`)"
            )
        metric = bound
    direction = asserted_direction(req, direction, metric, name)
    return GateConfig(metric=metric, direction=direction, margin=max(base.margin, req.margin))


def initial_gate(metric: str | None, direction: str | None) -> tuple[str, str]:
    """The gate recorded on a new registered model: `metric` (default DEFAULT_GATE_METRIC) and its
    direction (given, else known; UserError when neither)."""
    metric = metric or DEFAULT_GATE_METRIC
    direction = direction or known_direction(metric)
    if direction is None:
        raise UserError(f"gate metric {metric!r} has no known direction: pass gate_direction=max|min")
    return metric, direction


def check_gate_change(metric: str, direction: str, margin: float, why: str) -> None:
    """A gate the promoter may record: a metric, a direction its meaning allows, a margin >= 0, a reason."""
    if direction not in ("max", "min") or not metric.strip():
        raise UserError(f"set_gate needs a metric and direction max|min, got {metric!r}:{direction!r}")
    if not math.isfinite(margin) or margin < 0:
        raise UserError(f"gate margin {margin!r} must be a finite number >= 0")
    if not why.strip():
        raise UserError("changing the gate changes how every future promotion is judged: "
                        "give a reason (--why)")
    known = known_direction(metric)
    if known and known != direction:
        raise UserError(f"{metric} is {'higher' if known == 'max' else 'lower'}-is-better by definition; "
                        f"direction {direction!r} is refused")


# ------------------------------------------------------------------------- what is compared


def check_same_protocol(name: str, candidate: str, champion: str, a: str | None, b: str | None) -> None:
    """UserError unless both versions' eval protocol digests (`a`, `b`) are recorded and equal."""
    if not a or not b:
        raise UserError(f"cannot compare v{candidate} with v{champion} of {name!r}: "
                        f"{'v' + candidate if not a else 'v' + champion} records no eval protocol "
                        f"({PROTOCOL_HASH_TAG}); re-evaluate it, or promote with --force")
    if a != b:
        raise UserError(f"v{candidate} and v{champion} of {name!r} were evaluated under different protocols "
                        f"({a} vs {b}: preset, prompts, seeds or sampling differ, see tag {PROTOCOL_TAG}); "
                        "re-evaluate both the same way, or promote with --force")


def check_eval_run(run_id: str, stage: str | None, status: str) -> None:
    """An evaluation stage's own run (tag chunkgrpo.stage=evaluate), FINISHED; UserError otherwise."""
    if stage != "evaluate":
        raise UserError(f"run {run_id} is not an evaluation run "
                        f"(tag chunkgrpo.stage={stage!r}, expected 'evaluate')")
    if status != "FINISHED":
        raise UserError(f"evaluation run {run_id} is {status}, not FINISHED: its metrics are not final")


def registry_metrics(run_metrics: Mapping[str, float]) -> dict[str, float]:
    """An evaluation run's metrics under registry names (`<bench>.<m>.trained` -> `eval.<bench>.<m>`,
    everything else `eval.<key>`), as `metrics_from_eval` maps a metrics.json."""
    return {"eval." + (k[: -len(".trained")] if k.endswith(".trained") else k): v
            for k, v in run_metrics.items()}


def run_metric_key(metric: str, keys) -> str | None:
    """The evaluation run's key holding registry metric `metric` (`eval.x.y` -> `x.y.trained` or `x.y`)."""
    stem = metric[len("eval."):] if metric.startswith("eval.") else metric
    return next((k for k in (stem + ".trained", stem) if k in keys), None)


def trusted_value(run_id: str, version: str, key: str, history: list[float]) -> float:
    """The gate value of a version: the one value its evaluation run logged for `key` (a re-logged metric
    means the run was altered), finite; UserError otherwise."""
    if len(history) != 1:
        raise UserError(f"evaluation run {run_id} of v{version} logged {key} {len(history)} times: "
                        "an evaluation logs each result once, so it was altered; re-evaluate")
    value = history[0]
    if not finite(value):
        raise UserError(f"evaluation run {run_id} of v{version}: {key} = {value} is not finite")
    return value


def check_run_finite(eval_run_id: str, run_metrics: Mapping[str, float]) -> None:
    """UserError when the evaluation run logged a non-finite value (its numbers are not registered)."""
    bad = sorted(k for k, v in run_metrics.items() if not finite(v))
    if bad:
        raise UserError(f"evaluation run {eval_run_id} logged non-finite values ({', '.join(bad[:3])}): "
                        "not registered")


def check_agrees(flat: Mapping[str, float], run_metrics: Mapping[str, float], eval_run_id: str) -> None:
    """A registering caller's numbers must equal the evaluation run's wherever both name a value."""
    for k, v in flat.items():
        if k in run_metrics and not math.isclose(v, run_metrics[k], rel_tol=1e-9, abs_tol=1e-12):
            raise UserError(
                f"metrics: {k} = {v!r} differs from evaluation run {eval_run_id}'s {run_metrics[k]!r}"
            )


def untrusted(tags: Mapping[str, str]) -> dict[str, str]:
    """A caller's version tags without those only the registry computes (`TRUSTED_TAGS`)."""
    return {k: v for k, v in tags.items() if not k.startswith(TRUSTED_TAGS)}


# --------------------------------------------------------------------------- values and names


def number(v: Any) -> float | None:
    """A finite float, or None (missing, non-numeric, NaN or ±inf never enter a comparison)."""
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def finite(v: float) -> bool:
    """Finite and not MLflow's stand-in for ±inf (its SQL store saves inf as ±sys.float_info.max)."""
    return math.isfinite(v) and abs(v) < sys.float_info.max


def tag_text(v: Any) -> str:
    """A tag value: strings as they are, anything else as canonical JSON; cut to MAX_TAG characters."""
    s = v if isinstance(v, str) else json.dumps(v, sort_keys=True, default=str)
    return s if len(s) <= MAX_TAG else s[: MAX_TAG - 3] + "..."


def flat_metrics(metrics: Mapping[str, Any] | None, what: str = "metrics") -> dict[str, float]:
    """Flattened metrics; a non-numeric, NaN or infinite value is a UserError naming it (never dropped)."""
    if metrics is not None and not isinstance(metrics, Mapping):
        raise UserError(f"{what} must be a JSON object of metric name -> number, "
                        f"got {type(metrics).__name__}")
    out = {}
    for k, v in flatten(metrics or {}).items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(float(v)):
            raise UserError(f"{what}: {k} = {v!r} is not a finite number")
        out[k] = float(v)
    return out


def check_name(name: str) -> None:
    """A registered model name MLflow stores faithfully (and leaves room for the promotion lock)."""
    if (
        not isinstance(name, str)
        or not name.strip()
        or name != name.strip()
        or any(c in name for c in "/:\0")
    ):
        raise UserError(f"{name!r} is not a valid registered model name (non-empty, no '/', ':' or NUL, "
                        "no leading/trailing spaces)")
    if len(name) > MAX_NAME_LEN:
        raise UserError(
            f"registered model name {name[:40]!r}... is {len(name)} characters; at most {MAX_NAME_LEN}"
        )
    if name.endswith(LOCK_SUFFIX):
        raise UserError(
            f"registered model name {name!r} ends with {LOCK_SUFFIX!r}, reserved for promotion locks"
        )


def config_hash(cfg: Mapping[str, Any] | Config) -> str:
    """Short stable digest of a config (canonical JSON, secrets excluded by Config.to_dict)."""
    d = cfg.to_dict() if isinstance(cfg, Config) else dict(cfg)
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


def eval_protocol(result: Mapping[str, Any], preset: str = "") -> dict:
    """What an evaluation's numbers depend on besides the model: preset, benchmarks with their prompt
    counts, seeds, sampling (steps, trained steps, resolution, guidance, schedule), scorers, GenEval
    samples, WISE variant and judge. Two versions are compared only if this is identical."""
    cfg = dict(result.get("config") or {})
    benches = {
        b: {
            k: v
            for k, v in (e or {}).items()
            if k
            in (
                "n_prompts",
                "samples_per_prompt",
                "variant",
                "official_prompts",
                "prompts_file",
                "metadata_file",
            )
        }
        for b, e in sorted((result.get("benchmarks") or {}).items())
    }
    judge = (cfg.get("wise_judge") or {}).get("model") if "wise" in benches else None
    return {
        "preset": preset or cfg.get("preset", ""),
        "benchmarks": benches,
        "seed": result.get("seed", cfg.get("seed")),
        "sampling": dict(result.get("sampling") or {}),
        "scorers": sorted(cfg.get("scorers") or []) if "hpdv2" in benches else [],
        **({"geneval_samples": cfg.get("geneval_samples")} if "geneval" in benches else {}),
        **({"wise_variant": cfg.get("wise_variant"), "wise_judge": judge} if "wise" in benches else {}),
    }


def metrics_from_eval(result: Mapping[str, Any], preset: str = "") -> tuple[dict, dict, dict]:
    """(metrics, protocol, sampling) to register from an evaluation's metrics.json: every
    `<bench>.<metric>.trained` as `eval.<bench>.<metric>` (the `.base`/`.delta` and other values
    keep their full name under `eval.`), the eval protocol, and the hybrid sampling settings."""
    flat = dict(result.get("metrics") or {})
    metrics = {"eval": {(k[: -len(".trained")] if k.endswith(".trained") else k): v for k, v in flat.items()}}
    return metrics, eval_protocol(result, preset), dict(result.get("sampling") or {})


def protocol_hash(protocol: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(protocol, sort_keys=True, default=str).encode()).hexdigest()[:16]


def log_entry(entry: dict, at_ns: int, token: str) -> tuple[str, str]:
    """(tag key, value) of one audit entry: a key of its own (time in ns + a random token, so entries sort
    by time and two writers never share one), never rewritten; free text cut so the entry fits a tag."""
    entry = {k: (v[:MAX_WHY] if isinstance(v, str) else v) for k, v in entry.items()}
    return f"{LOG_PREFIX}{at_ns:020d}-{token}", tag_text(entry)


def log_entries(tags: Mapping[str, str]) -> list[dict]:
    """The audit log of a registered model from its tags, oldest first: an older registry's `promotion.log`
    list, then every `promotion.log.<time>-<token>` entry."""
    out: list = []
    try:
        legacy = json.loads(tags.get(LOG_TAG) or "[]")
        out.extend(legacy if isinstance(legacy, list) else [])
    except json.JSONDecodeError:
        pass
    for k in sorted(k for k in tags if k.startswith(LOG_PREFIX)):
        try:
            out.append(json.loads(tags[k]))
        except json.JSONDecodeError:
            out.append({"action": "unreadable", "tag": k, "text": tags[k][:200]})
    return out


def check_alias(alias: str) -> None:
    """An alias a new version may get: a plain name (letters, digits, '-', '_'), not one of the aliases
    only the gate moves (PROTECTED_ALIASES), not MLflow's reserved `latest` / `vN`; UserError otherwise."""
    if not isinstance(alias, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", alias):
        raise UserError(f"alias {str(alias)[:80]!r} is not a plain name (letters, digits, '-', '_'; 1-64)")
    if alias.lower() in PROTECTED_ALIASES:
        raise UserError(f"alias {alias!r} is moved only by the promotion gate (chunkgrpo promote); "
                        "a new version may not take it")
    if alias.lower() == "latest" or re.fullmatch(r"[vV]\d+", alias):
        raise UserError(f"alias {alias!r} is reserved by MLflow")


def check_weights_bound(run_id: str, scored: str | None, registered: str | None, version: str = "") -> None:
    """An evaluation counts for a version only if it scored the version's weights: the run's tag
    chunkgrpo.weights_sha256 (`scored`) must equal the version's weights digest (`registered`)."""
    what = f"v{version}" if version else "the registered weights"
    if not scored:
        raise UserError(f"evaluation run {run_id} records no weights digest (tag chunkgrpo.weights_sha256): "
                        f"nothing binds its numbers to {what}; evaluate with `chunkgrpo evaluate`")
    if not registered:
        raise UserError(f"{what} records no weights digest (tag {WEIGHTS_TAG}); re-register it")
    if scored != registered:
        raise UserError(f"evaluation run {run_id} scored other weights ({scored[:12]}...) than {what} "
                        f"({registered[:12]}...): its numbers are not {what}'s")


def details_artifact(artifact_path: str) -> str:
    """Where a version's details lie in its run, for the model logged at `artifact_path` of that run:
    DETAILS_ARTIFACT for `model`, `registration/details-<artifact_path>.json` for a shared run's others."""
    return DETAILS_ARTIFACT if artifact_path == "model" else DETAILS_ARTIFACT.replace(
        ".json", f"-{artifact_path}.json")


def check_why(why: str) -> None:
    if len(why) > MAX_WHY:
        raise UserError(f"why is {len(why)} characters; at most {MAX_WHY}")
