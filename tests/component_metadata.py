"""The component-folder convention of kubeflow/pipelines-components (its README and metadata validator,
`scripts/validate_metadata/validate_metadata.py`), checked by the project's own code:

* `OWNERS` names at least one approver (`approvers:` followed by a `- name` line);
* `metadata.yaml` has exactly `name`, `stability`, `dependencies`, `lastVerified` in that order, plus
  optionally `tags` (strings), `ci` (only `skip_dependency_probe`) and `links` (a mapping);
* `stability` is experimental, alpha, beta or stable;
* `dependencies` has `kubeflow` (a list that includes `Pipelines`) and optionally `external_services`,
  each entry a `name` and a `version`: an optional `>=`, `<=` or `==` and a full semantic version;
* `lastVerified` is an RFC 3339 timestamp (`YYYY-MM-DDT00:00:00Z`) less than a year from today.

`problems(folder)` lists what a folder breaks ([] = it follows the convention)."""

from __future__ import annotations

import datetime as dt
import re
from pathlib import Path

import yaml

FIELDS = ("name", "stability", "dependencies", "lastVerified")
OPTIONAL = ("tags", "ci", "links")
STABILITY = ("experimental", "alpha", "beta", "stable")
NUM = r"(0|[1-9]\d*)"
SEMVER = re.compile(rf"(>=|<=|==)?{NUM}\.{NUM}\.{NUM}(-[0-9A-Za-z.-]+)?(\+[0-9A-Za-z.-]+)?")


def problems(folder: Path, today: dt.datetime | None = None) -> list[str]:
    out = _owners(folder / "OWNERS")
    try:
        meta = yaml.safe_load((folder / "metadata.yaml").read_text())
    except (OSError, yaml.YAMLError) as e:
        return [*out, f"metadata.yaml: {e}"]
    if not isinstance(meta, dict):
        return [*out, "metadata.yaml is not a mapping"]
    order = [k for k in meta if k not in OPTIONAL]
    if order != list(FIELDS):
        out.append(f"fields {order} are not {list(FIELDS)} (in that order; optional: {list(OPTIONAL)})")
    if not isinstance(meta.get("name"), str):
        out.append("name is not a string")
    if meta.get("stability") not in STABILITY:
        out.append(f"stability {meta.get('stability')!r} is not one of {STABILITY}")
    out += _dependencies(meta.get("dependencies"))
    out += _verified(meta.get("lastVerified"), today or dt.datetime.now(dt.timezone.utc))
    tags = meta.get("tags", [])
    if not (isinstance(tags, list) and all(isinstance(t, str) for t in tags)):
        out.append("tags is not a list of strings")
    if "ci" in meta and not (isinstance(meta["ci"], dict) and set(meta["ci"]) == {"skip_dependency_probe"}):
        out.append("ci may hold skip_dependency_probe only")
    if "links" in meta and not isinstance(meta["links"], dict):
        out.append("links is not a mapping")
    return out


def _owners(path: Path) -> list[str]:
    try:
        lines = [ln.rstrip() for ln in path.read_text().splitlines()]
    except OSError:
        return ["no OWNERS file"]
    for head, nxt in zip(lines, lines[1:]):
        if head.startswith("approvers:") and nxt.strip().startswith("- ") and nxt.strip()[2:].strip():
            return []
    return ["OWNERS names no approver under 'approvers:'"]


def _dependencies(deps) -> list[str]:
    if not isinstance(deps, dict) or set(deps) not in ({"kubeflow"}, {"kubeflow", "external_services"}):
        return ["dependencies must hold kubeflow (and optionally external_services)"]
    out = []
    for kind, entries in deps.items():
        if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
            out.append(f"dependencies.{kind} is not a list of name/version entries")
            continue
        for e in entries:
            if not {"name", "version"} <= set(e):
                out.append(f"dependencies.{kind}: {e} lacks a name or version")
            elif not SEMVER.fullmatch(str(e["version"])):
                out.append(f"dependencies.{kind}: {e['name']} version {e['version']!r} is not semantic")
    if isinstance(deps.get("kubeflow"), list) and not any(
            isinstance(e, dict) and e.get("name") == "Pipelines" for e in deps["kubeflow"]):
        out.append("dependencies.kubeflow does not name Pipelines")
    return out


def _verified(value, today: dt.datetime) -> list[str]:
    if not isinstance(value, dt.datetime) or value.tzinfo is None:
        return [f"lastVerified {value!r} is not a timestamp like 2026-01-01T00:00:00Z"]
    if abs((today - value).days) >= 365:
        return [f"lastVerified {value:%Y-%m-%d} is a year or more from today"]
    return []
