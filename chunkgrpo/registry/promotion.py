"""Champion/challenger promotion on MLflow 3 aliases (stages are deprecated), and rollback.

`champion` moves only if the candidate beats the current champion on the gate metric by more than
`margin` (`chunkgrpo.registry.gate.gate_decision`). The values come only from each version's
**evaluation run** (tag `eval.run_id`, `client.trusted_metric`): never from a `metric.*` tag or a file
a registering user wrote. **The direction (and the metric) belong to the registered model**, not to
the caller: tags `rules.metric` / `rules.direction` are written when the model is first registered (or
by an explicit, logged `set_gate`), otherwise the direction of a known metric is used; a caller that
asks for another direction or metric is refused, so no flag can crown a worse model. The one metric
a caller may pick besides the model's is the confidence bound of that same metric's paired
trained − base delta (see `gate.gate_decision`). Metrics measured under different **eval protocols**
(tag `eval.protocol.sha256`) are never compared, and an evaluation run counts only for the weights it
scored (its tag chunkgrpo.weights_sha256 equals the version's `weights.sha256`). The old champion gets
`previous`. Every decision is written on the version (tags gate.decision, gate.reason, promotion.status
and one JSON `promotion.record`: who, why, the gate's values, time); promotions,
forced promotions, rollbacks and gate changes are appended to the registered model's audit log (one tag
per entry, `promotion.log.<time>-<token>`, never rewritten), rejections are counted apart
(`promotion.rejected_count`). Promoting the current champion again is a no-op; `force=True` skips the
gate and is recorded. `rollback` moves `champion` back to `previous`.

**Integrity.** A version is judged by the gate recorded at its registration (`rules.at_registration`);
`set_gate`, `set_eval_experiment`, `force` and `rollback` are the promoter identity's (tag `promoter` of
the registered model, = the MLflow user that created it) and need a reason. Promotions hold
`promotion_lock` (an atomically created registered model, held as a lease) and re-read `champion` after
moving it. On a basic-auth MLflow only the promoter identity may move aliases, so pipeline users go
through `chunkgrpo.promoter`. The trust boundary: docs/promotion.md.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from chunkgrpo.errors import UserError
from chunkgrpo.registry import gate as rules
from chunkgrpo.registry.client import (
    actor,
    aliases,
    connect,
    current_identity,
    get_version,
    model_tags,
    now,
    registered_model,
    require_promoter,
    set_version_tags,
    trusted_metric,
)
from chunkgrpo.registry.gate import GateConfig, GateResult, PromotionResult, RegistryConfig

log = logging.getLogger(__name__)


# --------------------------------------------------------------------- the registered model's gate


def model_gate(client, name: str) -> tuple[str | None, str | None]:
    """(rules.metric, rules.direction) recorded on the registered model (None where absent)."""
    tags = model_tags(client, name)
    return tags.get(rules.GATE_METRIC_TAG) or None, tags.get(rules.GATE_DIRECTION_TAG) or None


def resolve_gate(client, name: str, gate: GateConfig | None = None) -> GateConfig:
    """The gate as the registered model defines it (`gate.resolve` over its tags)."""
    return rules.resolve(name, gate, *model_gate(client, name))


def metric_direction(client, name: str, metric: str, asserted: str = "") -> str:
    """Direction ('max'/'min') of `metric` (a registry metric name, e.g. eval.hpdv2.hpsv3 or its CI
    bound) for registered model `name` (`gate.direction_of` over the model's gate tags)."""
    return rules.direction_of(name, metric, *model_gate(client, name), asserted=asserted)


def append_log(client, name: str, entry: dict) -> None:
    """Append `entry` to the registered model's audit log: a tag of its own (`gate.log_entry`), so the log
    is append-only: no request rewrites or trims an earlier entry."""
    client.set_registered_model_tag(name, *rules.log_entry(entry, time.time_ns(), uuid.uuid4().hex[:8]))


def count_rejection(client, name: str) -> None:
    """Count a rejected promotion on the registered model (tag promotion.rejected_count; the rejection
    itself is on the version's tags): rejections, which any pipeline user can cause at will, never enter
    the audit log, so they cannot crowd out what it records. Called under the promotion lock."""
    n = rules.number(model_tags(client, name).get(rules.REJECTED_TAG)) or 0
    client.set_registered_model_tag(name, rules.REJECTED_TAG, str(int(n) + 1))


def set_gate(name: str, metric: str, direction: str, *, margin: float = 0.0, who: str | None = None,
             why: str = "", client=None, _registration: bool = False) -> None:
    """Record (or change) the gate metric, direction and margin of a registered model: an explicit,
    audited action of the promoter identity with a reason (`why`), never a side effect of promoting.
    It is not retroactive: a version keeps the gate recorded when it was registered (tag
    `rules.at_registration`) for its comparison with the champion."""
    client = client or connect()
    rules.check_gate_change(metric, direction, margin, why)
    if not _registration:
        require_promoter(client, name, "changing the gate")
    old = model_gate(client, name)
    client.set_registered_model_tag(name, rules.GATE_METRIC_TAG, metric)
    client.set_registered_model_tag(name, rules.GATE_DIRECTION_TAG, direction)
    client.set_registered_model_tag(name, rules.GATE_MARGIN_TAG, repr(float(margin)))
    append_log(
        client,
        name,
        {
            "action": "set_gate",
            "metric": metric,
            "direction": direction,
            "margin": margin,
            "was": list(old),
            "by": actor(who),
            "identity": current_identity(),
            "at": now(),
            "why": why,
        },
    )


def init_gate(client, name: str, metric: str | None, direction: str | None) -> None:
    """At registration: record the gate on a model that has none; a different request is only logged."""
    tag_metric, tag_direction = model_gate(client, name)
    if tag_metric:
        if (metric and metric != tag_metric) or (direction and direction != tag_direction):
            log.warning(
                "%s is gated on %s (%s) since its first registration; the requested %s (%s) is ignored",
                name,
                tag_metric,
                tag_direction,
                metric,
                direction,
            )
        return
    metric, direction = rules.initial_gate(metric, direction)
    set_gate(name, metric, direction, who="registration", why="first registration", client=client,
             _registration=True)


def gate_snapshot(client, name: str) -> dict:
    """The model's gate now (recorded on each new version as `rules.at_registration`)."""
    metric, direction = model_gate(client, name)
    margin = rules.number(model_tags(client, name).get(rules.GATE_MARGIN_TAG)) or 0.0
    return {"metric": metric, "direction": direction, "margin": margin}


def version_gate(client, name: str, mv) -> GateConfig:
    """The gate a version is judged by: the one recorded when it was registered (a later set_gate
    does not apply to it), else the model's current gate."""
    return rules.snapshot_gate((mv.tags or {}).get(rules.GATE_SNAPSHOT_TAG)) or resolve_gate(client, name)


def effective_gate(client, name: str, mv, requested: GateConfig | None = None) -> GateConfig:
    """The gate `mv` is judged by: the one recorded at its registration (`version_gate`), which a caller
    may only make stricter (`gate.narrow`)."""
    return rules.narrow(name, mv.version, version_gate(client, name, mv), requested)


# ------------------------------------------------------------------------------------ the lock


LEASE_S = 30.0  # a promotion lock whose holder stopped renewing it for this long is reclaimed
_INCARNATION = uuid.uuid4().hex[:12]  # this process, as opposed to an earlier one with the same pid


def _process_start(pid: int) -> str:
    """When process `pid` started (Linux /proc ticks since boot; '' where unknown, '-' when no such
    process): with the pid it names one process, never a later one that reuses the pid."""
    if not Path("/proc/self/stat").exists():
        return ""  # no /proc here: only the lease tells
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except FileNotFoundError:
        return "-"
    except (OSError, IndexError):
        return ""


def lock_holder() -> str:
    """This process as a promotion-lock holder: host, pid, process start, incarnation."""
    pid = os.getpid()
    return f"{socket.gethostname()}:{pid}:{_process_start(pid)}:{_INCARNATION}"


def holder_gone(tags: dict, now_s: float | None = None) -> str:
    """Why the holder of a promotion lock (its tags) is gone ('' while it may still hold it): its lease
    expired (it stopped renewing: killed, hung, or on a lost machine), or it ran on this host and its
    process no longer exists (killed: reclaimed at once, by the next caller or a restarted promoter)."""
    now_s = time.time() if now_s is None else now_s
    expires = rules.number(tags.get("lock.expires"))
    if expires is None:  # a lock of the earlier format: only its age tells
        at = rules.number(tags.get("lock.at")) or now_s
        return f"held {now_s - at:.0f} s without a lease" if now_s - at > LEASE_S else ""
    if now_s > expires:
        return f"lease expired {now_s - expires:.0f} s ago"
    host, _, rest = str(tags.get("lock.holder", "")).partition(":")
    pid, _, rest = rest.partition(":")
    start, _, incarnation = rest.partition(":")
    if host == socket.gethostname() and pid.isdigit():
        if int(pid) == os.getpid():
            return "" if incarnation == _INCARNATION else "held by an earlier process with this pid"
        now_start = _process_start(int(pid))
        if now_start == "-" or (start and now_start and now_start != start):
            return f"its process {pid} on this host is gone"
    return ""


@contextlib.contextmanager
def promotion_lock(client, name: str, timeout_s: float = 120.0, lease_s: float = LEASE_S) -> Iterator[None]:
    """Mutual exclusion of promoters of `name`, whatever machine they run on: the lock is the
    registered model `<name>.promotion-lock`, whose creation MLflow performs atomically (a second
    create fails with RESOURCE_ALREADY_EXISTS). It is a lease: its tags name the holder (host, pid,
    process start) and an expiry the holder renews every lease_s/3 while it holds it. A lock whose holder
    is gone (`holder_gone`: lease expired, or its process on this host no longer exists) is reclaimed;
    waiting longer than `timeout_s` for a live holder is a UserError."""
    from mlflow.exceptions import MlflowException

    lock, token = name + rules.LOCK_SUFFIX, uuid.uuid4().hex
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            client.create_registered_model(lock, tags={
                "lock.token": token, "lock.at": repr(time.time()),
                "lock.expires": repr(time.time() + lease_s),
                "lock.holder": lock_holder(), "lock.by": actor(None), "chunkgrpo.lock_for": name},
                description=f"promotion lock of {name} (transient)")
            break
        except MlflowException as e:
            if getattr(e, "error_code", "") == "RESOURCE_DOES_NOT_EXIST":
                # MLflow's create found the name taken, then looked the holder up to word its error, and
                # the holder had released it in between: nothing was created; try again at once
                continue
            if getattr(e, "error_code", "") != "RESOURCE_ALREADY_EXISTS":
                raise UserError(f"cannot take the promotion lock of {name!r}: "
                                f"{str(e.message).splitlines()[0]}") from None
        try:
            held = dict(client.get_registered_model(lock).tags or {})
        except MlflowException:
            continue  # released in between: try again at once
        gone = holder_gone(held)
        if gone:
            log.warning("reclaiming the promotion lock of %s from %s (%s)", name,
                        held.get("lock.holder"), gone)
            with contextlib.suppress(MlflowException):
                # only the lock that was read: one re-created meanwhile by another caller is left alone
                if (client.get_registered_model(lock).tags or {}).get("lock.token") == held.get("lock.token"):
                    client.delete_registered_model(lock)
            continue
        if time.monotonic() > deadline:
            raise UserError(f"another promotion of {name!r} holds {lock!r} "
                            f"(holder {held.get('lock.holder')}) for more than {timeout_s:.0f} s; "
                            "nothing was changed")
        time.sleep(0.1 + 0.2 * (uuid.uuid4().int % 100) / 100)
    stop = threading.Event()

    def renew() -> None:
        while not stop.wait(lease_s / 3):
            with contextlib.suppress(Exception):
                client.set_registered_model_tag(lock, "lock.expires", repr(time.time() + lease_s))

    heartbeat = threading.Thread(target=renew, name=f"lease-{name}", daemon=True)
    heartbeat.start()
    try:
        yield
    finally:
        stop.set()
        heartbeat.join(5)
        with contextlib.suppress(MlflowException):
            if (client.get_registered_model(lock).tags or {}).get("lock.token") == token:
                client.delete_registered_model(lock)


def reclaim_locks(client) -> list[str]:
    """Delete every promotion lock whose holder is gone (`holder_gone`): what a promoter does when it
    starts, so a lock its killed predecessor held never blocks the next promotion. Returns their names."""
    from mlflow.exceptions import MlflowException

    gone = []
    try:
        locks = client.search_registered_models(f"name LIKE '%{rules.LOCK_SUFFIX}'")
    except MlflowException as e:
        log.warning("cannot list promotion locks: %s", str(e.message).splitlines()[0])
        return gone
    for rm in locks:
        why = holder_gone(dict(rm.tags or {}))
        if why:
            log.warning("reclaiming %s from %s (%s)", rm.name, (rm.tags or {}).get("lock.holder"), why)
            with contextlib.suppress(MlflowException):
                client.delete_registered_model(rm.name)
                gone.append(rm.name)
    return gone


def protected_aliases(client, name: str) -> set[str]:
    """The aliases only the gate moves on `name`: gate.PROTECTED_ALIASES and those a promotion of it
    moved under other names (RegistryConfig.champion_alias/previous_alias; tag gate.protected_aliases)."""
    try:
        extra = json.loads(model_tags(client, name).get(rules.PROTECTED_TAG) or "[]")
    except json.JSONDecodeError:
        extra = []
    return set(rules.PROTECTED_ALIASES) | {str(a) for a in extra if isinstance(a, str)}


def _protect(client, name: str, cfg: RegistryConfig) -> None:
    """Record the champion/previous aliases of `cfg` as protected on `name` (before moving them)."""
    have = protected_aliases(client, name)
    want = {cfg.champion_alias, cfg.previous_alias}
    if not want <= have:
        extra = sorted((have | want) - set(rules.PROTECTED_ALIASES))
        client.set_registered_model_tag(name, rules.PROTECTED_TAG, json.dumps(extra))


# ------------------------------------------------------------------------------------ promotion


def readable_decision(decision: str, reason: str) -> dict[str, str]:
    """The gate's decision on a version as plain tags the registry's version page shows as they are:
    `gate.decision` (promoted / forced / rejected) and `gate.reason` (the metric, both values, the
    improvement and the margin, in words). The values themselves are in the version's promotion record."""
    return {"gate.decision": decision, "gate.reason": reason}


def record_tags(client, name: str, version: str, status: str, **fields) -> dict[str, str]:
    """Tags `promotion.status` and `promotion.record` of a version: the record (who, identity, when, why,
    the gate's metric, direction, margin and values, previous champion; later, who replaced or rolled it
    back) is one JSON value, `fields` merged over the one the version holds. Called under the lock."""
    try:
        record = json.loads((get_version(client, name, version).tags or {}).get(rules.RECORD_TAG) or "{}")
    except json.JSONDecodeError:
        record = {}
    record = {**(record if isinstance(record, dict) else {}), **fields}
    return {rules.STATUS_TAG: status, rules.RECORD_TAG: json.dumps(record, sort_keys=True, default=str)}


def _decide(client, name: str, version: str, champion: str | None, eff: GateConfig) -> GateResult:
    """The gate decision on trusted values (kept in `.values`); UserError when it cannot be made."""
    candidate = trusted_metric(client, name, version, eff.metric)
    reference = None
    if champion:
        reference = trusted_metric(client, name, champion, eff.metric)
        a, b = (
            (get_version(client, name, v).tags or {}).get(rules.PROTOCOL_HASH_TAG)
            for v in (version, champion)
        )
        rules.check_same_protocol(name, version, champion, a, b)
    result = rules.gate_decision(candidate, reference, eff)
    result.values = {"candidate": candidate, "champion": reference}
    return result


def gate_check(name: str, version: str | int, gate: GateConfig | None = None, *, client=None,
               champion_alias: str = "champion") -> GateResult:
    """Read-only: would `promote` move the champion to `version`? Never raises for a comparison that
    cannot be made (no evaluation run, other protocol, version already champion): `passed` is False
    and `reason` says why. The gate is the one recorded at the version's registration."""
    client = client or connect()
    version = str(version)
    mv = get_version(client, name, version)
    eff = effective_gate(client, name, mv, gate)
    champion = aliases(client, name).get(champion_alias)
    if champion == version:
        return GateResult(False, f"v{version} already is the {champion_alias}")
    try:
        return _decide(client, name, version, champion, eff)
    except UserError as e:
        return GateResult(False, str(e))


def promote(name: str, version: str | int, gate: GateConfig | None = None, *, force: bool = False,
            who: str | None = None, why: str = "", config: RegistryConfig | None = None,
            client=None) -> PromotionResult:
    """Give `version` the champion alias if it passes the gate (or `force`); old champion -> previous.

    The decision and the alias moves happen under `promotion_lock`, against the champion read inside
    it, and the champion is re-read after it is set (compare-and-set): concurrent promoters end with
    the best version as champion. Gate values are the versions' evaluation runs' (`trusted_metric`).
    `force` is reserved to the promoter identity, needs a reason, and is recorded (who, why, previous
    champion) on the version and in the model's audit log (`promotion_history`).
    Idempotent: promoting the current champion again changes nothing; re-running a rejected
    promotion rejects again without touching aliases.
    """
    cfg = config or RegistryConfig(model_name=name)
    client = client or connect()
    version = str(version)
    rules.check_why(why)
    if force:
        if not why.strip():
            raise UserError("--force crowns a version without the gate: give the reason with --why")
        require_promoter(client, name, "--force")
    mv = get_version(client, name, version)
    requested = gate if gate is not None else cfg.gate
    with promotion_lock(client, name):
        _protect(client, name, cfg)
        current = aliases(client, name)
        champ = current.get(cfg.champion_alias)
        user, at = actor(who), now()
        if champ == version:
            return PromotionResult("noop", name, version, current.get(cfg.previous_alias),
                                   f"already {cfg.champion_alias}")
        try:
            eff = effective_gate(client, name, mv, requested)
            decision = _decide(client, name, version, champ, eff)
        except UserError as e:
            if not force:
                raise
            eff = GateConfig(metric=requested.metric or "", margin=requested.margin)
            decision = GateResult(False, f"not comparable ({e})")
        gate_desc = {"metric": eff.metric, "direction": eff.direction, "margin": eff.margin,
                     "champion_version": champ, **decision.values}
        if not decision.passed and not force:
            set_version_tags(client, name, version, {
                **readable_decision("rejected", decision.reason),
                **record_tags(client, name, version, "rejected", reason=decision.reason, by=user, at=at,
                              gate=gate_desc, why=why)})
            count_rejection(client, name)
            log.info("%s v%s rejected: %s", name, version, decision.reason)
            return PromotionResult("rejected", name, version, champ, decision.reason)

        action = "promoted" if decision.passed else "forced"
        identity = current_identity()
        reason = decision.reason if decision.passed else (
            f"forced by {user}{f' ({identity})' if identity else ''}: {why} (gate: {decision.reason})")
        # previous first, then champion: a crash in between leaves a state that a re-run completes.
        if champ:
            client.set_registered_model_alias(name, cfg.previous_alias, champ)
            set_version_tags(client, name, champ, record_tags(client, name, champ, cfg.previous_alias,
                                                              replaced_by=version, replaced_at=at))
        client.set_registered_model_alias(name, cfg.champion_alias, version)
        after = aliases(client, name).get(cfg.champion_alias)  # compare-and-set: re-read what was set
        if after != version:
            raise UserError(
                f"{name!r}: {cfg.champion_alias} is v{after} right after setting it to v{version} "
                "(moved by something outside the promotion lock); re-run promote"
            )
        set_version_tags(client, name, version, {
            **readable_decision(action, reason),
            **record_tags(client, name, version, cfg.champion_alias, reason=reason, by=user,
                          identity=identity, at=at, forced=action == "forced", force_requested=force,
                          gate=gate_desc, previous_version=champ or "", why=why)})
        append_log(client, name, {"action": action, "version": version, "previous": champ, "by": user,
                                  "identity": identity, "at": at, "reason": reason, "why": why})
    log.info("%s v%s -> %s (%s)", name, version, cfg.champion_alias, reason)
    return PromotionResult(action, name, version, champ, reason)


def rollback(name: str, *, who: str | None = None, why: str = "", config: RegistryConfig | None = None,
             client=None) -> PromotionResult:
    """Move champion back to the `previous` version (promoter identity only, with a reason); the
    rolled-back version is tagged, `previous` cleared, and the log records who, why and from what."""
    cfg = config or RegistryConfig(model_name=name)
    client = client or connect()
    rules.check_why(why)
    if not why.strip():
        raise UserError("--rollback replaces the champion without the gate: give the reason with --why")
    require_promoter(client, name, "--rollback")
    with promotion_lock(client, name):
        _protect(client, name, cfg)
        current = aliases(client, name)
        prev, champ = current.get(cfg.previous_alias), current.get(cfg.champion_alias)
        if not prev:
            raise UserError(
                f"{name!r} has no {cfg.previous_alias!r} alias: nothing to roll back to "
                f"(choose a version explicitly: chunkgrpo promote --model {name} --version N --force)"
            )
        user, at, identity = actor(who), now(), current_identity()
        client.set_registered_model_alias(name, cfg.champion_alias, prev)
        client.delete_registered_model_alias(name, cfg.previous_alias)
        reason = f"rollback from v{champ} by {user}{f' ({identity})' if identity else ''}: {why}"
        if champ:
            set_version_tags(client, name, champ, record_tags(client, name, champ, "rolled_back",
                                                              rolled_back_by=user, rolled_back_at=at,
                                                              rollback_why=why))
        set_version_tags(client, name, prev, record_tags(
            client, name, prev, cfg.champion_alias, reason=reason, by=user, identity=identity, at=at,
            previous_version=champ or ""))
        append_log(client, name, {"action": "rollback", "version": prev, "previous": champ, "by": user,
                                  "identity": identity, "at": at, "why": why})
    log.info("%s: %s v%s -> v%s", name, cfg.champion_alias, champ, prev)
    return PromotionResult("rolled_back", name, prev, champ, reason)


def promotion_history(name: str, *, client=None) -> list[dict]:
    """The registered model's audit log (`gate.log_entries`): gate changes, promotions, forced
    promotions and rollbacks with who, identity, why, previous champion and time (newest last)."""
    client = client or connect()
    return rules.log_entries(dict(registered_model(client, name).tags or {}))


def set_eval_experiment(name: str, experiment_id: str, *, who: str | None = None, why: str = "",
                        client=None) -> None:
    """The stronger mode of the gate: trust only evaluation runs in experiment `experiment_id` (tag
    gate.eval_experiment_id), one only the evaluator identity may write to, so a pipeline user's own
    evaluation runs (whatever they log) are refused at registration and promotion. Promoter identity
    only, with a reason, audited; '' turns it off."""
    client = client or connect()
    rules.check_why(why)
    if not why.strip():
        raise UserError("trusting another evaluation experiment changes which numbers count: give a reason")
    require_promoter(client, name, "changing the trusted evaluation experiment")
    if experiment_id:
        client.get_experiment(experiment_id)  # exists (MlflowException otherwise)
        client.set_registered_model_tag(name, rules.EVAL_EXPERIMENT_TAG, str(experiment_id))
    else:
        client.delete_registered_model_tag(name, rules.EVAL_EXPERIMENT_TAG)
    append_log(client, name, {"action": "set_eval_experiment", "experiment_id": str(experiment_id),
                              "by": actor(who), "identity": current_identity(), "at": now(), "why": why})
