"""pipeline/warm.py: kfp.local tasks forked from a server that imported torch and mlflow once, with the
process a fresh interpreter would give them (environment, folder, exit code, atexit, threads), and a
server of their own when their environment changes what the imports build."""

import contextlib
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from kfp import dsl

from pipeline import warm

pytestmark = pytest.mark.integration


@dsl.component(install_kfp_package=False)
def probe(marker: str) -> str:
    """What the task's process is: pid, parent, folder, torch loaded before the task imported it, an env
    value; it also leaves an atexit handler and a non-daemon thread that write files after it returns."""
    import atexit
    import json
    import os
    import sys
    import threading
    import time

    loaded = "torch" in sys.modules
    import torch

    def later():
        time.sleep(0.5)
        open(marker + ".thread", "w").write("thread")

    threading.Thread(target=later).start()
    atexit.register(lambda: open(marker + ".atexit", "w").write("atexit"))
    print("probe says hello")
    return json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "cwd": os.getcwd(), "torch_loaded": loaded,
                       "capability": torch.backends.cpu.get_cpu_capability(),
                       "value": os.environ.get("CHUNKGRPO_WARM_TEST", ""),
                       "kfp_runtime": os.environ.get("_KFP_RUNTIME", "")})


@dsl.component(install_kfp_package=False)
def fails(code: int) -> str:
    import sys

    if code:
        sys.exit(code)
    raise ValueError("the task's own error")


def _stopping(lau: warm.Launcher):
    servers = [s.proc for s in lau.servers]
    lau.close()
    assert all(p.poll() is not None for p in servers)  # close() stops every server


@pytest.fixture(scope="module")
def launcher(tmp_path_factory):
    """One launcher for the tests that only read it (each server's imports cost seconds)."""
    lau = warm.Launcher(log=tmp_path_factory.mktemp("warm") / "warm-servers.log")
    yield lau
    _stopping(lau)


@pytest.fixture
def own_launcher(tmp_path):
    lau = warm.Launcher(log=tmp_path / "warm-servers.log")
    yield lau
    _stopping(lau)


def _server(lau: warm.Launcher, pid: int):
    return next(s for s in lau.servers if s.info and s.info["pid"] == pid)


def _run(component, launcher, tmp_path, env_vars=None, **kwargs):
    """kfp.local with its subprocess runner replaced by the launcher, as `run_local` does."""
    from kfp import local
    from kfp.local import subprocess_task_handler as handler

    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(tmp_path / "root"),
               raise_on_error=False)
    original = handler.run_local_subprocess
    commands = []

    extra = env_vars or {}

    def run(full_command, env_vars=None):
        commands.append(full_command)
        return launcher.run(full_command, {**(env_vars or {}), **extra}, cold=original)

    handler.run_local_subprocess = run
    try:
        return component(**kwargs), commands
    finally:
        handler.run_local_subprocess = original


def test_a_task_runs_forked_from_the_server_like_a_fresh_interpreter(launcher, tmp_path, capsys):
    import json

    marker = str(tmp_path / "m")
    before = dict(launcher.runs)
    task, commands = _run(probe, launcher, tmp_path, {"CHUNKGRPO_WARM_TEST": "per-task"}, marker=marker)
    out = json.loads(task.output)
    assert launcher.runs == {"warm": before["warm"] + 1, "cold": before["cold"]}
    server = _server(launcher, out["ppid"])  # a child of one of the launcher's servers
    assert out["pid"] == launcher.last_pid != os.getpid()
    assert out["torch_loaded"]  # imported by the server, not by the task
    assert out["value"] == "per-task" and out["kfp_runtime"] == "true" and out["cwd"] == os.getcwd()
    # the interpreter's exit: non-daemon threads joined, then atexit handlers
    assert open(marker + ".thread").read() == "thread" and open(marker + ".atexit").read() == "atexit"
    assert "probe says hello" in capsys.readouterr().out  # streamed like kfp.local's own runner
    assert "def probe(" in warm.executor_task(commands[0])[0]

    # a second task reuses the server: no second import
    task2, _ = _run(probe, launcher, tmp_path, marker=marker + "2")
    servers = len(launcher.servers)
    assert json.loads(task2.output)["ppid"] == server.info["pid"] and len(launcher.servers) == servers


def test_a_killed_server_costs_its_next_task_nothing_but_time(own_launcher, tmp_path, capsys):
    """The task runs cold (kfp.local's runner), with its result, and the message says why."""
    import json
    import signal

    first, _ = _run(probe, own_launcher, tmp_path, marker=str(tmp_path / "a"))
    (server,) = own_launcher.servers
    os.kill(server.info["pid"], signal.SIGKILL)
    server.proc.wait(timeout=60)
    second, _ = _run(probe, own_launcher, tmp_path, {"CHUNKGRPO_WARM_TEST": "after"},
                     marker=str(tmp_path / "b"))
    out = json.loads(second.output)
    assert out["value"] == "after" and not out["torch_loaded"]  # a fresh interpreter ran it
    assert own_launcher.runs == {"warm": 1, "cold": 1} and server not in own_launcher.servers
    assert "the server is gone" in capsys.readouterr().out


def test_exit_codes_and_tracebacks_are_the_interpreters(launcher, tmp_path, capsys):
    before = launcher.runs["warm"]
    task, _ = _run(fails, launcher, tmp_path, code=0)
    out = capsys.readouterr().out
    assert "Traceback (most recent call last)" in out and "ValueError: the task's own error" in out
    assert launcher.runs["warm"] == before + 1
    from kfp import local

    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(tmp_path / "r2"),
               raise_on_error=False)
    cmd = None

    def grab(full_command, env_vars=None):
        nonlocal cmd
        cmd = full_command
        return 0

    from kfp.local import subprocess_task_handler as handler

    original, handler.run_local_subprocess = handler.run_local_subprocess, grab
    try:
        fails(code=3)  # only to get the command kfp.local would run
    finally:
        handler.run_local_subprocess = original
    assert launcher.run(cmd) == 3  # sys.exit(3) in the task is exit code 3, as from `python -m`


def test_a_task_whose_environment_changes_the_imports_gets_its_own_server(launcher, tmp_path):
    """ATEN_CPU_CAPABILITY is read when torch loads: a task that sets it must not get the first server's
    torch (its kernels were chosen for the machine's best instruction set)."""
    import json

    import torch

    if torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        pytest.skip("this CPU's best capability is already DEFAULT: nothing to tell apart")
    before = dict(launcher.runs)
    first, _ = _run(probe, launcher, tmp_path, marker=str(tmp_path / "a"))
    assert json.loads(first.output)["capability"] != "DEFAULT"
    second, _ = _run(probe, launcher, tmp_path, {"ATEN_CPU_CAPABILITY": "default"},
                     marker=str(tmp_path / "b"))
    out = json.loads(second.output)
    assert out["capability"] == "DEFAULT"
    assert out["ppid"] != json.loads(first.output)["ppid"]  # another server: its own torch
    assert _server(launcher, out["ppid"]).info["by_prefix"]["ATEN_CPU_CAPABILITY"] == "default"
    assert launcher.runs == {"warm": before["warm"] + 2, "cold": before["cold"]}


def test_match_names_the_first_variable_that_differs():
    info = {"import_env": {"HOME": "/root", "TMPDIR": None, "PYTEST_CURRENT_TEST": "a (call)",
                           "_KFP_RUNTIME": "true"},
            "prefixes": ["OMP_", "ATEN_", "TQDM_"], "by_prefix": {"OMP_WAIT_POLICY": "PASSIVE"}}
    env = {"HOME": "/root", "PYTEST_CURRENT_TEST": "b (call)", "OMP_WAIT_POLICY": "PASSIVE", "OTHER": "x"}
    assert warm.match(info, env) == ""  # pytest's marker is ignored, _KFP_RUNTIME is the command's
    assert warm.match(info, {**env, "TMPDIR": "/cache"}) == "TMPDIR"
    assert warm.match(info, {**env, "OMP_WAIT_POLICY": "ACTIVE"}) == "OMP_WAIT_POLICY"
    assert warm.match(info, {**env, "ATEN_CPU_CAPABILITY": "avx2"}) == "ATEN_CPU_CAPABILITY"
    assert warm.match(info, {**env, "TQDM_MININTERVAL": "5"}) == "TQDM_MININTERVAL"
    assert "numpy" in warm.match({**info, "unknown_iterators": ["numpy"]}, env)


def test_the_recording_sees_single_reads_and_whole_environment_iterations(monkeypatch):
    """warm's recording of what imports read, on this process's os.environ (no preload)."""
    monkeypatch.setenv("WARM_A", "1")
    monkeypatch.setenv("WARM_D", "4")
    seen, iterated = {}, set()
    real = os.environ
    os.environ = warm._Recording(real, seen, iterated)
    try:
        os.environ.get("WARM_A")
        assert "WARM_B" not in os.environ
        os.getenv("WARM_C")
        exec("import os\nsnapshot = {k: v for k, v in os.environ.items() if k.startswith('WARM_')}",
             {"__name__": "some.iterating.module"})
        exec("import os\ndef f():\n    return dict(os.environ), os.environ.copy(), {**os.environ}\nf()",
             {"__name__": "some.copying.module"})
        os.environ.get("WARM_E")  # a single read after the copies is one again
    finally:
        os.environ = real
    # WARM_D only came by in items() and the copies
    assert seen == {"WARM_A": "1", "WARM_B": None, "WARM_C": None, "WARM_E": None}
    assert iterated == {"some.iterating.module", "some.copying.module"}


def test_other_commands_run_cold():
    assert warm.executor_task(["python", "-c", "print(1)"]) is None
    pip = ["sh", "-c", "python3 -m pip install kfp", "sh", "-ec", "python3 -m kfp.dsl.executor_main"]
    assert warm.executor_task(pip) is None
    calls = []
    lau = warm.Launcher()
    cold = lambda full_command, env_vars: calls.append(full_command) or 7  # noqa: E731
    assert lau.run(["python", "-c", "x"], cold=cold) == 7
    assert calls == [["python", "-c", "x"]] and lau.runs == {"warm": 0, "cold": 1} and not lau.servers


def test_servers_stop_when_the_launching_process_dies(tmp_path):
    code = textwrap.dedent("""
        import os, sys
        from pipeline import warm
        lau = warm.Launcher()
        s = lau._start(dict(os.environ))
        assert s.ready(), s.failed
        print(s.proc.pid, flush=True)
        os._exit(0)  # no atexit, no close(): only the hung-up socket tells the server
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                       cwd=os.getcwd())
    assert r.returncode == 0, r.stderr
    import psutil

    pid = int(r.stdout.split()[0])
    end = time.monotonic() + 60
    while time.monotonic() < end:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        time.sleep(0.2)
    raise AssertionError(f"warm server {pid} still running after its launcher died")


# ---- the kept server (`--keep-services`): started once, used by the launchers of later runs ------------
def _gone(pid: int, within_s: float = 60.0) -> bool:
    import psutil

    end = time.monotonic() + within_s
    while time.monotonic() < end:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


@pytest.fixture
def kept(tmp_path):
    """A kept server recorded in a local services folder, as `run_local(keep_services=True)` starts it;
    `down` stops it (and whatever is left of it at the end)."""
    from chunkgrpo.local_processes import CHILDREN
    from chunkgrpo.local_services import LocalServices, LocalServicesConfig

    home = tmp_path / "local"
    home.mkdir(mode=0o700)
    # a SIGTERM ignored for 300 s would only then be followed by SIGKILL: `down` returning sooner shows the
    # processes ended on SIGTERM
    svc = LocalServices(LocalServicesConfig(home=str(home), stop_timeout_s=300))
    rec = warm.start_kept(home, "tasks", dict(os.environ), tmp_path / "kept.log")
    svc.adopt("tasks", rec)
    try:
        yield svc, rec, CHILDREN.get(rec["pid"])
    finally:
        svc.down()


def _hanging_task(lau_sock, marker: Path):
    """Send a kept server's handler a task whose component module, on import, writes its pid and sleeps
    (the executor never gets further): the launcher's side of the wire, by hand."""
    source = f"import os, time\nopen({str(marker)!r}, 'w').write(str(os.getpid()))\ntime.sleep(600)\n"
    r, w = os.pipe()
    try:
        warm._send(lau_sock, {"env": dict(os.environ), "cwd": os.getcwd(), "source": source,
                              "args": ["--function_to_execute", "f"]}, fds=[w])
    finally:
        os.close(w)
    reply, _ = warm._recv(lau_sock)
    os.set_blocking(r, False)
    out = b""
    end = time.monotonic() + 120
    while not marker.exists() and time.monotonic() < end:
        time.sleep(0.1)
        with contextlib.suppress(BlockingIOError):
            out += os.read(r, 65536)
    os.close(r)
    assert marker.exists(), out.decode(errors="replace")[-2000:]
    return reply["pid"], int(marker.read_text())


def test_a_kept_server_serves_the_launchers_of_later_runs_and_stops_with_the_services(kept, tmp_path):
    import json

    svc, rec, proc = kept
    assert svc.status()["tasks"].state == "running"
    handlers = []
    for i in range(2):  # two launchers, as two runs would have: each its own handler, no import of its own
        lau = warm.Launcher(log=tmp_path / f"l{i}.log")
        server = lau.attach(rec["socket"], dict(os.environ) if i == 0 else None, proc)
        assert server is not None and server.ready(), server and server.failed
        assert oct(os.stat(rec["socket"]).st_mode & 0o777) == "0o600"  # only its user may run code through it
        task, _ = _run(probe, lau, tmp_path, {"CHUNKGRPO_WARM_TEST": f"run {i}"},
                       marker=str(tmp_path / f"m{i}"))
        out = json.loads(task.output)
        assert lau.runs == {"warm": 1, "cold": 0} and len(lau.servers) == 1
        assert out["torch_loaded"] and out["value"] == f"run {i}"
        assert out["ppid"] == server.info["pid"] != rec["pid"]  # a handler forked from the kept server
        handlers.append(server.info["pid"])
        lau.close()  # the run ends: it hangs up; the server stays
    assert handlers[0] != handlers[1] and svc.status()["tasks"].state == "running"
    (stopped,) = [s for s in svc.down() if s.name == "tasks"]
    assert stopped.state == "stopped" and _gone(rec["pid"], 1) and not Path(rec["socket"]).exists()
    assert "tasks" not in svc.status()


def test_a_live_kept_server_is_never_replaced_by_another_runs_adopt(kept, tmp_path):
    """Two runs in one home starting a kept server under the same name: the second is refused (and stops
    its own), the first keeps serving; a dead server's record is replaced."""
    import signal

    svc, rec, proc = kept
    other = warm.start_kept(svc.home, "tasks", dict(os.environ), None)
    assert other["socket"] != rec["socket"]  # a new path each time: nobody removes a live server's socket
    try:
        assert svc.adopt("tasks", other) is False
        assert svc.record("tasks")["pid"] == rec["pid"] and svc.status()["tasks"].state == "running"
        conn = warm._Kept(rec["socket"], proc=proc)
        assert conn.ready(), conn.failed  # still reachable
        conn.close()
        os.kill(rec["pid"], signal.SIGKILL)
        proc.wait(timeout=60)
        assert svc.adopt("tasks", other) is True and svc.record("tasks")["pid"] == other["pid"]
        assert not Path(rec["socket"]).exists()  # the dead server's socket went with its record
    finally:
        svc.down()
        with contextlib.suppress(ProcessLookupError):  # never adopted if the test failed before that
            os.killpg(other["pid"], signal.SIGKILL)
        from chunkgrpo.local_processes import reap

        reap(other["pid"])
    assert _gone(other["pid"], 30)


@pytest.mark.parametrize("how", ["launcher-hangs-up", "local-down"])
def test_a_kept_servers_running_task_stops_with_its_launcher_or_the_server(kept, tmp_path, how):
    """The task is not the launcher's descendant: a launcher killed mid-task (its connection closes) or
    `chunkgrpo local down` must still stop it."""
    svc, rec, proc = kept
    conn = warm._Kept(rec["socket"], proc=proc)  # connects once the server has bound its socket
    assert conn.ready(), conn.failed  # the info, once the imports are done
    sock = conn.sock
    pid, task_pid = _hanging_task(sock, tmp_path / "pid")
    assert pid == task_pid and not _gone(task_pid, 0.5)
    if how == "launcher-hangs-up":
        sock.close()
        assert _gone(task_pid, 30), "the task outlived its launcher's connection"
        assert svc.status()["tasks"].state == "running"  # the server itself goes on
    else:
        t0 = time.monotonic()
        svc.down()
        assert time.monotonic() - t0 < svc.config.stop_timeout_s  # the handler stopped its task on SIGTERM
        assert _gone(task_pid, 1) and _gone(rec["pid"], 1)
        sock.close()


def test_kept_servers_are_used_while_current_else_stopped_and_replaced(tmp_path, monkeypatch, capsys):
    """pipeline/local.py `_kept_servers`: one per task environment of the run; used while current; stopped
    once stale (another interpreter, a source file changed) and, with --keep-services, replaced."""
    from chunkgrpo.local_services import LocalServices, LocalServicesConfig
    from pipeline import local

    home = tmp_path / "local"
    svc = LocalServices(LocalServicesConfig(home=str(home)))
    envs = [dict(os.environ), {**os.environ, "HF_HOME": str(tmp_path / "volume")}]  # the imports read it
    names = [f"{local.KEPT}-1", f"{local.KEPT}-2"]
    try:
        local._kept_servers(warm.Launcher(), home, envs, keep=True)
        first = {n: svc.record(n)["pid"] for n in names}
        lau = warm.Launcher()
        local._kept_servers(lau, home, envs, keep=True)  # a later run: nothing new
        assert "tasks fork from the kept task server(s) tasks-1" in capsys.readouterr().out
        assert {n: svc.record(n)["pid"] for n in names} == first and len(lau.servers) == 2
        for env in envs:  # each environment has its server, neither is a launcher's own child
            assert lau.server_for(env) is not None and len(lau.servers) == 2
        assert sorted(s.info["pid"] for s in lau.servers) != sorted(first.values())  # handlers
        lau.close()

        source = tmp_path / "mod.py"
        source.write_text("x = 1\n")
        st = os.stat(source)
        info = {"executable": sys.executable, "sources": {str(source): [st.st_mtime_ns, st.st_size]}}
        assert warm.stale(info) == ""
        source.write_text("x = 22\n")
        assert warm.stale(info) == f"{source} changed"
        other = {**info, "executable": "/other/python"}
        assert warm.stale(other) == f"it runs /other/python, not {sys.executable}"
        monkeypatch.setattr(warm, "stale", lambda info: f"{source} changed")
        local._kept_servers(warm.Launcher(), home, envs, keep=True)
        out = capsys.readouterr().out
        assert out.count(f"is not used ({source} changed); stopping it") == 2
        second = {n: svc.record(n)["pid"] for n in names}
        assert not set(second.values()) & set(first.values()) and all(_gone(p, 30) for p in first.values())
        local._kept_servers(warm.Launcher(), home, envs[:1], keep=False)
        assert capsys.readouterr().out.count("stopping it") == 2
        assert all(svc.record(n) is None for n in names) and all(_gone(p, 30) for p in second.values())
    finally:
        svc.down()
