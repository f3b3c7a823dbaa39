"""Session-scoped real local services (SeaweedFS S3 + MLflow) for integration tests.

    def test_x(services):            # started once per session on free ports in a tmp dir
        store = ArtifactStore(services.store_config)
        services.env                 # CHUNKGRPO_S3_ENDPOINT, AWS_*, MLFLOW_TRACKING_URI, ...

    def test_y(services_env):        # the same, with services.env applied to os.environ for the test

Servers are stopped at the end of the session, also when tests fail (context manager + atexit), on a
pytest-timeout and when the session gets SIGTERM (this plugin's `pytest_configure` turns it into
KeyboardInterrupt, so every fixture's teardown runs). Under pytest-xdist (README's test command runs two
workers) the SIGTERM reaches the controller only; it passes it on to its workers and waits for them to
unwind their fixtures before it stops itself (xdist would otherwise kill them after a few seconds, with their
servers still running).

A test that runs a whole `chunkgrpo pipeline run --local` command (which starts its own servers):

    with services_stopped_after(home / ".chunkgrpo" / "local", s3, mlflow) as svc:
        r = run_command(f"chunkgrpo pipeline run --local --s3-port {s3} --mlflow-port {mlflow} "
                        "--keep-services",
                        cwd=..., env=..., timeout=3600)
        ...                          # the servers stay up for the test; stopped on leaving the block

`run_command` runs the command in its own process group and, on a timeout or any interruption, stops
the whole group (SIGTERM, which the pipeline command handles like Ctrl-C, then SIGKILL); the servers
run in their own sessions and are stopped by `services_stopped_after` from the state file they recorded.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import signal
import subprocess
from pathlib import Path

import pytest

STOP_GRACE_S = 60.0  # a terminated pipeline command stops its tasks (10 s) and its servers (MLflow ~ seconds)
# an xdist worker told to stop: its running test's command (STOP_GRACE_S) and then its session's servers
WORKER_STOP_S = 2 * STOP_GRACE_S
_config = None  # this session's pytest config
_terminated = False  # this session got SIGTERM


def _stop_workers(timeout_s: float = WORKER_STOP_S) -> None:
    """SIGTERM to each xdist worker (the controller's child processes), then wait until they have exited:
    each unwinds its fixtures as below. Those still alive after `timeout_s` are killed."""
    import psutil

    workers = psutil.Process().children()
    for w in workers:
        with contextlib.suppress(psutil.Error):
            w.send_signal(signal.SIGTERM)
    _, alive = psutil.wait_procs(workers, timeout=timeout_s)
    for w in alive:
        with contextlib.suppress(psutil.Error):
            w.kill()


def _sigterm_as_interrupt(signum, frame):
    """SIGTERM to the test session (a CI job's timeout, `kill`) unwinds it like Ctrl-C, so every fixture's
    teardown runs and stops the servers it started; the xdist controller first has its workers do so.

    A second SIGTERM ends a plain session or the controller at once. An xdist worker ignores it while it
    unwinds: a signal to the whole process group reaches it twice (directly, then from its controller), and
    the controller kills it after `WORKER_STOP_S` anyway."""
    global _terminated
    worker = hasattr(_config, "workerinput")
    if _terminated and worker:
        return
    if not worker:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _terminated = True
    if _config is not None and _config.pluginmanager.getplugin("dsession") is not None:
        _stop_workers()  # this process is pytest-xdist's controller: its workers run the tests
    raise KeyboardInterrupt(f"signal {signum}")


USER_THREADS = os.environ.get("CHUNKGRPO_THREADS")  # set by whoever ran pytest (None: pytest_configure sets)


def pytest_configure(config):
    """Session-wide (tests/ and components/ both load this plugin): the thread and collector policies of
    the entry points (`chunkgrpo.threads`, `chunkgrpo.startup`) and SIGTERM."""
    from chunkgrpo import startup, threads

    startup.fewer_full_collections()

    global _config
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
    if workers > 1 and USER_THREADS is None:
        # xdist's workers share the cores as torchrun's ranks share a node's: two 2-thread workers on 2 cores
        # oversubscribed them (a torch-heavy third of the suite: 72-74 s with 2 threads each, 57-67 s with 1)
        os.environ[threads.ENV_THREADS] = str(max(1, threads.available_cores() // workers))
    threads.configure()  # torch threads capped at the available cores ($CHUNKGRPO_THREADS to choose)
    _config = config
    signal.signal(signal.SIGTERM, _sigterm_as_interrupt)


def pytest_unconfigure(config):
    """An xdist worker stopped by SIGTERM exits once its fixtures are torn down, instead of waiting for its
    controller (which is waiting for it, `_stop_workers`)."""
    if _terminated and hasattr(config, "workerinput"):
        import sys

        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


@dataclasses.dataclass
class Services:
    home: Path
    env: dict[str, str]
    store_config: object  # chunkgrpo.store.client.StoreConfig
    local: object         # chunkgrpo.services.LocalServices

    @property
    def tracking_uri(self) -> str:
        return self.env["MLFLOW_TRACKING_URI"]


def _need_weed() -> None:
    from chunkgrpo.errors import UserError
    from chunkgrpo.seaweedfs import weed_binary

    try:
        weed_binary()
    except UserError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def services(tmp_path_factory):
    """Real weed mini + mlflow server on free 127.0.0.1 ports, for the whole session."""
    _need_weed()
    from chunkgrpo.services import local_services

    home = tmp_path_factory.mktemp("chunkgrpo-services")
    with local_services(home) as svc:
        atexit.register(svc.down)  # belt and braces if the session is interrupted hard
        yield Services(home=home, env=svc.env(), store_config=svc.store_config(), local=svc)
        atexit.unregister(svc.down)


@pytest.fixture
def services_env(services, monkeypatch):
    """`services`, with its env vars set in os.environ for the duration of one test."""
    for key, value in services.env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    return services


@contextlib.contextmanager
def services_stopped_after(home: str | Path, s3_port: int, mlflow_port: int):
    """The `LocalServices` a pipeline command records under `home` (its `<home>/local`), stopped when the
    block is left in any way (also by an exception, a pytest-timeout or KeyboardInterrupt) and at exit."""
    from chunkgrpo.services import LocalServices, LocalServicesConfig

    svc = LocalServices(LocalServicesConfig(home=str(home), s3_port=s3_port, mlflow_port=mlflow_port))
    atexit.register(svc.down)
    try:
        yield svc
    finally:
        svc.down()
        atexit.unregister(svc.down)


def kill_service(svc, name: str) -> None:
    """A crash of one of `svc`'s local services: SIGKILL its whole process group, wait until its port is
    free."""
    import time

    from chunkgrpo.processes import port_in_use

    st = svc.status()[name]
    os.killpg(st.pid, signal.SIGKILL)
    port = int(st.url.rsplit(":", 1)[1])
    deadline = time.monotonic() + 30
    while port_in_use(port) and time.monotonic() < deadline:
        time.sleep(0.2)


def stop_process_group(proc: subprocess.Popen, grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM to `proc`'s process group (its own: started with start_new_session), SIGKILL after
    `grace_s`."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        try:
            proc.communicate(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue
        except ValueError:  # streams already closed by an interrupted communicate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=wait_s)
            if proc.returncode is not None:
                return


def run_command(command: str, *, cwd: str | Path, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """`bash -c command` like `subprocess.run(..., capture_output=True, text=True, timeout=...)`, but in its
    own process group that is stopped (`stop_process_group`) on a timeout or any interruption, so no
    task, torchrun worker or pipeline command outlives the test. Raises subprocess.TimeoutExpired."""
    proc = subprocess.Popen(["bash", "-c", command], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        stop_process_group(proc)
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
