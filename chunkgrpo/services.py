"""Embedded local services: a SeaweedFS S3 server (`weed mini`) and an MLflow tracking server.

`chunkgrpo local up|down|status|env` drives this module. Everything lives under a state dir
(default `./.chunkgrpo/local`, or `$CHUNKGRPO_HOME`):

    state.json         PIDs (+ process start times, so a reused PID is never killed), ports, commands
    credentials.json   S3 access key + secret (mode 0600; the dir is 0700)
    s3.json            SeaweedFS identity config holding the same credentials (mode 0600)
    seaweedfs/         object data            mlflow/mlflow.db   tracking + registry (sqlite; a fresh
    logs/weed.log, logs/mlflow.log                                   one starts migrated: `mlflow_db`)

Both servers bind 127.0.0.1 only, with telemetry off (`-master.telemetry=false`,
`MLFLOW_DISABLE_TELEMETRY=true`) and the MLflow job runner off (`MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false`,
2 processes instead of 10). MLflow proxies artifacts to `s3://<mlflow_bucket>/` on the local S3,
so clients only need `MLFLOW_TRACKING_URI`.

Each server runs in its own process group; `down` signals exactly the recorded groups (SIGTERM, then
SIGKILL after `stop_timeout_s`) and waits until every process of the group is gone. A second `up`
reuses healthy services. A service whose process died is reported as `crashed` by `status` and
restarted (with a warning and its last log lines) by `up`.

Credentials: reused from `credentials.json` if present; otherwise taken from
`AWS_ACCESS_KEY_ID`/`AWS_SECRET_ACCESS_KEY` if both are set; otherwise generated with `secrets`.

Ports, process identity and liveness, signals and reaping: `chunkgrpo.processes`.

Size note: one class, because `up`, `status` and `down` share one locked state file and one stop
procedure (SIGTERM to the recorded group, SIGKILL after the timeout, identity checks); the process
mechanics already live in `chunkgrpo.processes`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from chunkgrpo import mlflow_db
from chunkgrpo.config import Config, option
from chunkgrpo.errors import UserError
from chunkgrpo.locks import FileLock
from chunkgrpo.processes import (
    CHILDREN,
    HOST,
    alive,
    any_alive,
    free_ports,
    http_ok,
    port_in_use,
    port_owner,
    reap,
    signal_group,
    start_time,
)
from chunkgrpo.seaweedfs import (
    WEED_PORT_FLAGS,
    WEED_START_ATTEMPTS,
    disable_maintenance,
    free_port_pair,
    remove_weed_sockets,
    taken_internal_port,
    weed_command,
)

log = logging.getLogger(__name__)

SERVICES = ("s3", "mlflow")


@dataclasses.dataclass
class LocalServicesConfig(Config):
    """Where and on which ports the local S3 + MLflow servers run."""

    home: str = option("", "state dir; default $CHUNKGRPO_HOME or ./.chunkgrpo/local")
    s3_port: int = option(
        8333, "S3 port of the SeaweedFS server on 127.0.0.1 (its internal ports are picked free)"
    )
    mlflow_port: int = option(5000, "MLflow tracking server port on 127.0.0.1")
    mlflow: bool = option(True, "also run the MLflow server (false: S3 only)")
    bucket: str = option("chunkgrpo", "artifact bucket created at start (CHUNKGRPO_S3_BUCKET)")
    mlflow_bucket: str = option("mlflow-artifacts", "bucket MLflow proxies run artifacts to")
    region: str = option("us-east-1", "region reported to S3 clients")
    start_timeout_s: float = option(90.0, "seconds to wait for a server to become healthy")
    stop_timeout_s: float = option(30.0, "seconds to wait after SIGTERM before SIGKILL")

    def __post_init__(self) -> None:
        self.home = (
            self.home or os.environ.get("CHUNKGRPO_HOME", "") or str(Path.cwd() / ".chunkgrpo" / "local")
        )
        for name in ("s3_port", "mlflow_port"):
            port = getattr(self, name)
            if not 1024 <= port <= 65535:
                raise UserError(f"local.{name}={port} must be between 1024 and 65535")
        if self.mlflow and self.s3_port == self.mlflow_port:
            raise UserError(f"local.s3_port and local.mlflow_port are both {self.s3_port}; pick two ports")
        if self.start_timeout_s <= 0 or self.stop_timeout_s <= 0:
            raise UserError("local.start_timeout_s and local.stop_timeout_s must be > 0")


@dataclasses.dataclass
class ServiceStatus:
    """One service as seen now: state is running | unhealthy | crashed | stopped."""

    name: str
    state: str
    pid: int | None = None
    url: str = ""
    log: str = ""
    detail: str = ""

    def line(self) -> str:
        pid = f" pid={self.pid}" if self.pid else ""
        url = f" {self.url}" if self.url else ""
        detail = f" ({self.detail})" if self.detail else ""
        return f"{self.name + ' ':7s}{self.state:10s}{pid}{url}{detail}"


# ------------------------------------------------------------------------------- small helpers


def _write_private(path: Path, text: str) -> None:
    """Write a file readable by the owner only (0600), atomically."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


def _tail(path: Path, n: int = 8) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join("    " + line[:300] for line in lines[-n:])


# ------------------------------------------------------------------------------------- services


class LocalServices:
    """Start, inspect and stop the local S3 (+ MLflow) servers recorded under `config.home`."""

    def __init__(self, config: LocalServicesConfig | None = None, command: str = "chunkgrpo local up"):
        self.config = config or LocalServicesConfig()
        self.command = command  # the command whose --s3-port / --mlflow-port a port collision names
        self.home = Path(self.config.home).resolve()

    # ------------------------------------------------------------------------------ files

    @property
    def state_file(self) -> Path:
        return self.home / "state.json"

    def _load_state(self) -> dict[str, Any]:
        try:
            return json.loads(self.state_file.read_text())
        except FileNotFoundError:
            return {"services": {}}
        except (OSError, json.JSONDecodeError) as e:
            raise UserError(
                f"{self.state_file} is unreadable ({e}); stop leftovers by hand and delete it"
            ) from None

    def _save_state(self, state: dict[str, Any]) -> None:
        if not state.get("services"):
            self.state_file.unlink(missing_ok=True)
            return
        _write_private(self.state_file, json.dumps(state, indent=1, sort_keys=True) + "\n")

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.home.mkdir(parents=True, exist_ok=True)
        os.chmod(self.home, 0o700)
        with FileLock(self.home / ".lock"):
            yield

    def credentials(self) -> tuple[str, str]:
        """(access_key, secret_key): stored, else from the environment, else generated; stored 0600."""
        path = self.home / "credentials.json"
        if path.exists():
            data = json.loads(path.read_text())
            return data["access_key"], data["secret_key"]
        ak, sk = os.environ.get("AWS_ACCESS_KEY_ID", ""), os.environ.get("AWS_SECRET_ACCESS_KEY", "")
        source = "environment"
        if not (ak and sk):
            ak, sk, source = f"chunkgrpo-{secrets.token_hex(4)}", secrets.token_hex(24), "generated"
        self.home.mkdir(parents=True, exist_ok=True)
        os.chmod(self.home, 0o700)
        _write_private(
            path, json.dumps({"access_key": ak, "secret_key": sk, "source": source}, indent=1) + "\n"
        )
        log.info("S3 credentials (%s) stored in %s (mode 0600)", source, path)
        return ak, sk

    # ----------------------------------------------------------------------------- status

    def _ports(self) -> tuple[int, int]:
        """(s3_port, mlflow_port) of the running services if recorded, else the configured ones."""
        svc = self._load_state().get("services", {})
        return (svc.get("s3", {}).get("port", self.config.s3_port),
                svc.get("mlflow", {}).get("port", self.config.mlflow_port))

    def _health(self, name: str, port: int) -> bool:
        if name == "s3":
            return http_ok(f"http://{HOST}:{port}/", want_200=False)
        return http_ok(f"http://{HOST}:{port}/health", want_200=True)

    def _status_of(self, name: str, rec: dict | None) -> ServiceStatus:
        if not rec:
            return ServiceStatus(name, "stopped")
        url = f"http://{HOST}:{rec['port']}"
        logf = rec.get("log", "")
        if not alive(rec.get("pid"), rec.get("create_time")):
            tail = _tail(Path(logf), 5)
            return ServiceStatus(name, "crashed", rec.get("pid"), url, logf,
                                 f"process gone; see {logf}" + (f"; last lines:\n{tail}" if tail else ""))
        if not self._health(name, rec["port"]):
            return ServiceStatus(name, "unhealthy", rec["pid"], url, logf, f"not answering; see {logf}")
        return ServiceStatus(name, "running", rec["pid"], url, logf)

    def status(self) -> dict[str, ServiceStatus]:
        """Per service: running | unhealthy | crashed | stopped."""
        svc = self._load_state().get("services", {})
        return {name: self._status_of(name, svc.get(name)) for name in SERVICES}

    # --------------------------------------------------------------------------------- up

    def up(self) -> dict[str, ServiceStatus]:
        """Start what is not running (reusing healthy services), wait for health, record PIDs."""
        c = self.config
        with self._locked():
            state = self._load_state()
            svc = state.setdefault("services", {})
            wanted = ["s3", "mlflow"] if c.mlflow else ["s3"]
            # every port that must be free is checked before anything starts: all or nothing
            states = {n: self._status_of(n, svc.get(n)).state for n in wanted}
            self._check_ports({("S3" if n == "s3" else "MLflow"): (c.s3_port if n == "s3" else c.mlflow_port)
                               for n in wanted if states[n] in ("stopped", "crashed")},
                              grace_s=5.0 if "crashed" in states.values() else 0.0)
            to_start: list[str] = []
            for name in wanted:
                rec = svc.get(name)
                st = self._status_of(name, rec)
                want_port = c.s3_port if name == "s3" else c.mlflow_port
                if st.state in ("running", "unhealthy") and rec["port"] != want_port:
                    raise UserError(
                        f"local {name} is already running on port {rec['port']} (pid {rec['pid']}), not "
                        f"{want_port}; run `chunkgrpo local down` first")
                if st.state == "running":
                    log.info("local %s already running (pid %s, %s); reusing it", name, st.pid, st.url)
                    continue
                if st.state == "unhealthy":
                    self._wait_healthy(name, rec)
                    continue
                if st.state == "crashed":
                    log.warning(
                        "local %s had crashed (pid %s); starting it again. %s", name, st.pid, st.detail
                    )
                    self._stop_record(name, rec)  # nothing to kill; clears what the dead process left
                    state.setdefault("crashes", []).append(
                        {"service": name, "pid": st.pid, "noticed": time.strftime("%Y-%m-%dT%H:%M:%S")})
                    svc.pop(name, None)
                    self._save_state(state)
                to_start.append(name)
            self._start_all(to_start, svc, state)
            return {name: self._status_of(name, svc.get(name)) for name in SERVICES}

    def _start_all(self, names: list[str], svc: dict, state: dict) -> None:
        """Start `names` and wait until each is healthy. MLflow is spawned first and its imports run while
        SeaweedFS starts and gets its buckets (it needs only S3's address, which is configured, to start):
        MLflow takes ~7.5 s to answer on 2 idle cores, SeaweedFS ~1 s. As before, a service that fails
        is stopped and the error raised (a healthy S3 stays up and recorded); an MLflow spawned early is
        stopped too when S3 fails or its start is interrupted."""
        early = "mlflow" in names and "s3" in names
        if early:
            svc["mlflow"] = self._start_mlflow(self.config.s3_port)
            self._save_state(state)  # PIDs are on disk before we wait, so `down` can always stop them
        if "s3" in names:
            try:
                self._start_healthy("s3", svc, state)
                self._ensure_buckets(svc["s3"]["port"])
            except BaseException:
                if early:
                    self._stop_record("mlflow", svc.pop("mlflow"))
                    self._save_state(state)
                raise
        if "mlflow" in names:
            self._start_healthy("mlflow", svc, state, spawned=early)

    def _start_healthy(self, name: str, svc: dict, state: dict, spawned: bool = False) -> None:
        """Start `name` (`spawned`: its process is already in `svc`) and wait until it is healthy; SeaweedFS
        again on other internal ports when one of them was taken before it bound it
        (`WEED_START_ATTEMPTS`). Any other failure stops what started and raises at once."""
        for attempt in range(1, WEED_START_ATTEMPTS + 1):
            if attempt > 1 or not spawned:
                svc[name] = self._start_s3() if name == "s3" else self._start_mlflow(svc["s3"]["port"])
                self._save_state(state)  # PIDs are on disk before we wait, so `down` can always stop them
            try:
                self._wait_healthy(name, svc[name])
                if svc[name].get("migrates"):  # its fresh database is migrated and still empty: keep a copy
                    mlflow_db.keep_template(self.home / "mlflow" / "mlflow.db")
                return
            except BaseException as e:
                rec = svc.pop(name)
                self._stop_record(name, rec)
                self._save_state(state)
                taken = taken_internal_port(rec) if isinstance(e, UserError) and name == "s3" else None
                if taken is None or attempt == WEED_START_ATTEMPTS:
                    raise
                log.warning("local s3: SeaweedFS found its internal port %d taken by another process; "
                            "starting it on other ports (%d of %d)", taken, attempt + 1, WEED_START_ATTEMPTS)

    def _check_ports(self, ports: dict[str, int], grace_s: float = 0.0) -> None:
        """UserError naming the port if one is taken (after up to grace_s for a dying process to let go)."""
        deadline = time.monotonic() + grace_s
        for what, port in ports.items():
            while port_in_use(port) and time.monotonic() < deadline:
                time.sleep(0.2)
            if port_in_use(port):
                raise UserError(
                    f"port {port} ({what}) on {HOST} is already in use by {port_owner(port)}; stop it or "
                    "choose another port "
                    f"({self.command} --{'mlflow' if 'MLflow' in what else 's3'}-port N)"
                )

    def _spawn(self, name: str, cmd: list[str], env: dict[str, str], port: int, **extra: Any) -> dict:
        logs = self.home / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        logf = logs / f"{'weed' if name == 's3' else 'mlflow'}.log"
        with open(logf, "ab") as out:
            out.write(f"\n---- {time.strftime('%Y-%m-%d %H:%M:%S')} starting: {' '.join(cmd)}\n".encode())
            out.flush()
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env, cwd=self.home, start_new_session=True)
        CHILDREN[proc.pid] = proc
        log.info("started local %s (pid %d) on %s:%d; log %s", name, proc.pid, HOST, port, logf)
        return {"pid": proc.pid, "pgid": proc.pid, "create_time": start_time(proc.pid), "port": port,
                "log": str(logf), "cmd": cmd, "started_at": time.time(), **extra}

    def _start_s3(self) -> dict:
        c = self.config
        admin, admin_grpc = free_port_pair()
        picked = [p for p in free_ports(len(WEED_PORT_FLAGS) + 3) if p not in (admin, admin_grpc, c.s3_port,
                                                                             c.mlflow_port)]
        internal = dict(zip(WEED_PORT_FLAGS, picked))
        internal.update({"admin.port": admin, "admin.port.grpc": admin_grpc})
        self._check_ports({"S3": c.s3_port})
        ak, sk = self.credentials()
        s3cfg = self.home / "s3.json"
        _write_private(s3cfg, json.dumps({"identities": [{
            "name": "chunkgrpo", "credentials": [{"accessKey": ak, "secretKey": sk}],
            "actions": ["Admin", "Read", "List", "Tagging", "Write"]}]}) + "\n")
        data = self.home / "seaweedfs"
        data.mkdir(parents=True, exist_ok=True)
        disable_maintenance(data)
        cmd = weed_command(data, s3cfg, c.s3_port, internal)
        env = dict(os.environ)  # weed's sockets go to its TMPDIR (Go: $TMPDIR, else /tmp)
        return self._spawn("s3", cmd, env, c.s3_port, internal_ports=internal,
                           tmpdir=env.get("TMPDIR") or "/tmp")

    def _start_mlflow(self, s3_port: int) -> dict:
        c = self.config
        self._check_ports({"MLflow": c.mlflow_port})
        ak, sk = self.credentials()
        db = self.home / "mlflow" / "mlflow.db"
        db.parent.mkdir(parents=True, exist_ok=True)
        migrates = not db.exists() and not mlflow_db.seed(db)  # a fresh home: the empty copy, if kept
        env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
        env.update({
            "MLFLOW_S3_ENDPOINT_URL": f"http://{HOST}:{s3_port}", "AWS_ACCESS_KEY_ID": ak,
            "AWS_SECRET_ACCESS_KEY": sk, "AWS_DEFAULT_REGION": c.region, "MLFLOW_DISABLE_TELEMETRY": "true",
            "DO_NOT_TRACK": "true", "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "PYTHONUNBUFFERED": "1"})
        cmd = [sys.executable, "-m", "mlflow", "server", "--host", HOST, "--port", str(c.mlflow_port),
               "--workers", "1", "--backend-store-uri", f"sqlite:///{db}",
               "--artifacts-destination", f"s3://{c.mlflow_bucket}/", "--serve-artifacts",
               "--allowed-hosts", f"{HOST}:*,localhost:*"]
        return self._spawn("mlflow", cmd, env, c.mlflow_port, migrates=migrates)

    def _wait_healthy(self, name: str, rec: dict) -> None:
        deadline = time.monotonic() + self.config.start_timeout_s
        t0 = time.monotonic()
        while time.monotonic() < deadline:
            if not alive(rec["pid"], rec.get("create_time")):
                child = CHILDREN.get(rec["pid"])
                code = f" with code {child.returncode}" if child is not None else ""
                raise UserError(f"local {name} exited{code} during startup; last lines of {rec['log']}:\n"
                                f"{_tail(Path(rec['log']), 12)}")
            if self._health(name, rec["port"]):
                log.info("local %s healthy after %.1fs", name, time.monotonic() - t0)
                return
            time.sleep(0.2)
        raise UserError(
            f"local {name} (pid {rec['pid']}) not healthy after {self.config.start_timeout_s:.0f}s; "
            f"see {rec['log']}:\n{_tail(Path(rec['log']), 12)}"
        )

    def _ensure_buckets(self, s3_port: int) -> None:
        from chunkgrpo.store.client import ArtifactStore

        store = ArtifactStore(self.store_config(port=s3_port))
        deadline = time.monotonic() + self.config.start_timeout_s
        while True:  # the S3 port answers a moment before the filer is ready for bucket creation
            try:
                for bucket in (self.config.bucket, self.config.mlflow_bucket):
                    store.ensure_bucket(bucket)
                return
            except UserError:
                raise
            except Exception as e:
                if time.monotonic() > deadline:
                    raise UserError(f"local S3 up but bucket creation keeps failing: {e}") from e
                time.sleep(0.5)

    # ------------------------------------------------------------------------------- down

    def down(self) -> list[ServiceStatus]:
        """Stop exactly the recorded processes, wait for them, clear the state. S3 and MLflow are stopped
        together: nothing talks to them any more, and each mostly waits for its process to exit (SeaweedFS
        ~2 s, MLflow ~1 s on 2 idle cores; one after the other they took 3.4 s of every
        `pipeline run --local`). A record that is not ours (`_stop_record`'s UserError) is kept in the
        state; the others are stopped and cleared first."""
        with self._locked():
            state = self._load_state()
            svc = state.get("services", {})
            out: list[ServiceStatus] = []
            errors = self._stop_together(svc, [n for n in reversed(SERVICES) if n in svc], out)
            if out:  # a refused record alone leaves the state file as it was
                self._save_state(state)
            if errors:
                raise errors[0]
            state.pop("crashes", None)
            self._save_state(state)
            return out

    def _stop_together(self, svc: dict, names: list[str], out: list[ServiceStatus]) -> list[BaseException]:
        """Stop the recorded `names` concurrently; each one stopped leaves `svc` and is added to `out`
        (in `names` order). Returns the errors (their records stay in `svc`)."""
        from concurrent.futures import ThreadPoolExecutor

        was = {n: self._status_of(n, svc[n]) for n in names}
        with ThreadPoolExecutor(max_workers=max(1, len(names))) as pool:
            futures = {n: pool.submit(self._stop_record, n, svc[n]) for n in names}
        errors = []
        for n in names:
            err = futures[n].exception()
            if err is not None:
                errors.append(err)
                continue
            rec = svc.pop(n)
            out.append(ServiceStatus(n, "stopped" if was[n].state != "crashed" else "crashed", rec.get("pid"),
                                     detail="was " + was[n].state))
        return errors

    def _stop_record(self, name: str, rec: dict) -> None:
        pid, pgid = rec.get("pid"), rec.get("pgid")
        if not alive(pid, rec.get("create_time")):
            reap(pid)
            remove_weed_sockets(rec)
            return
        why = _not_ours(rec)
        if why:
            raise UserError(f"{self.state_file} names pid {pid} for local {name}, but {why}; not "
                            "signalling it (stop that process yourself if it is the server, then remove "
                            f"{self.state_file})")
        try:
            import psutil

            procs = [psutil.Process(pid)]
            procs += procs[0].children(recursive=True)
        except Exception:
            psutil, procs = None, []
        log.info("stopping local %s (pid %d)", name, pid)
        signal_group(pgid, pid, signal.SIGTERM)
        deadline = time.monotonic() + self.config.stop_timeout_s
        while time.monotonic() < deadline and any_alive(procs, pid):
            time.sleep(0.1)
        if any_alive(procs, pid):
            log.warning(
                "local %s (pid %d) ignored SIGTERM for %.0fs; killing", name, pid, self.config.stop_timeout_s
            )
            signal_group(pgid, pid, signal.SIGKILL)
            for p in procs:
                with contextlib.suppress(Exception):
                    p.kill()
            end = time.monotonic() + 10
            while time.monotonic() < end and any_alive(procs, pid):
                time.sleep(0.1)
        reap(pid)
        remove_weed_sockets(rec)

    # -------------------------------------------------------------------------------- env

    def store_config(self, bucket: str | None = None, port: int | None = None):
        """A `StoreConfig` for the local S3 (credentials included)."""
        from chunkgrpo.store.client import StoreConfig

        ak, sk = self.credentials()
        return StoreConfig(
            endpoint=f"http://{HOST}:{port or self._ports()[0]}",
            bucket=bucket or self.config.bucket,
            region=self.config.region,
            access_key=ak,
            secret_key=sk,
            secure=False,
        )

    def env(self) -> dict[str, str]:
        """Env vars the pipeline stages need to use these services (includes the S3 secret)."""
        s3_port, mlflow_port = self._ports()
        ak, sk = self.credentials()
        out = {
            "CHUNKGRPO_S3_ENDPOINT": f"http://{HOST}:{s3_port}", "CHUNKGRPO_S3_BUCKET": self.config.bucket,
            "AWS_ACCESS_KEY_ID": ak, "AWS_SECRET_ACCESS_KEY": sk, "AWS_DEFAULT_REGION": self.config.region,
            "MLFLOW_S3_ENDPOINT_URL": f"http://{HOST}:{s3_port}",
        }
        if self.config.mlflow:
            out["MLFLOW_TRACKING_URI"] = f"http://{HOST}:{mlflow_port}"
        return out


def _not_ours(rec: dict) -> str:
    """Why the live process `rec` names is not one `local up` started ('' if it is): its start time and
    command line must be the recorded ones and its process group its own (servers run in a new session)."""
    pid, pgid = rec.get("pid"), rec.get("pgid")
    if not isinstance(pid, int) or pid <= 1 or (pgid is not None and pgid != pid):
        return f"the record is not one `local up` writes (pid {pid!r}, process group {pgid!r})"
    if rec.get("create_time") is None:
        return "the record has no start time to verify that process by"
    try:
        import psutil

        cmdline = psutil.Process(pid).cmdline()
    except Exception as e:
        return f"its command line cannot be read ({type(e).__name__})"
    if rec.get("cmd") and cmdline != rec["cmd"]:
        return f"it runs {' '.join(cmdline)[:120]!r}, not the recorded server command"
    return ""


_distinct_free_ports = free_ports  # the name `free_ports` is a flag of local_services below


@contextlib.contextmanager
def local_services(
    home: str | Path | None = None,
    *,
    s3_port: int | None = None,
    mlflow_port: int | None = None,
    mlflow: bool = True,
    free_ports: bool = True,
    **overrides: Any,
) -> Iterator[LocalServices]:
    """Run local services for the duration of a `with` block (tests, demos).

    With free_ports=True (default) unspecified ports are picked free, so a dev instance on the
    default ports is never disturbed. Only services started here are stopped on exit.
    """
    if free_ports:  # distinct ones: two separate free_port() calls may return the same port
        picked = iter([p for p in _distinct_free_ports(3) if p not in (s3_port, mlflow_port)])
        s3_port = s3_port or next(picked)
        mlflow_port = mlflow_port or next(picked)
    cfg = LocalServicesConfig(
        home=str(home or ""), s3_port=s3_port or 8333, mlflow_port=mlflow_port or 5000, mlflow=mlflow,
        **overrides)
    svc = LocalServices(cfg)
    before = {n: s.state for n, s in svc.status().items() if n in SERVICES}
    try:
        svc.up()
        yield svc
    finally:
        if any(state != "running" for state in before.values()):
            svc.down()
