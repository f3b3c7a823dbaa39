"""`chunkgrpo reward-server` as a real process on 127.0.0.1, for the integration tests of served rewards."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "test-token-4b1f"


class Server:
    """A reward server process serving `scorer`, ready (GET /readyz 200) when the constructor returns.
    `folder` is its working directory and is on its PYTHONPATH (user reward modules go there); `port` 0
    picks a free one (a fixed port lets a test restart a server where its clients look for it)."""

    def __init__(self, folder: Path, scorer: str, *extra: str, token: str | None = TOKEN, port: int = 0,
                 ready_s: float = 120.0) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(folder)])}
        env.pop("CHUNKGRPO_REWARD_TOKEN", None)
        if token:
            env["CHUNKGRPO_REWARD_TOKEN"] = token
        self.log_path = folder / f"server-{scorer.replace(':', '_')}.log"
        self.log = open(self.log_path, "a")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "chunkgrpo", "reward-server", "--scorer", scorer, "--port", str(port),
             *extra],
            env=env, stdout=subprocess.PIPE, stderr=self.log, text=True, cwd=folder)
        line = self.proc.stdout.readline()
        if not line.startswith("listening on http://127.0.0.1:"):
            self.stop()
            raise AssertionError(f"reward server did not start: {line!r}")
        self.url = line.split()[-1]
        deadline = time.monotonic() + ready_s
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.url}/readyz", timeout=5) as r:
                    if r.status == 200:
                        return
            except urllib.error.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise AssertionError("reward server not ready")

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def metrics(self) -> str:
        return urllib.request.urlopen(f"{self.url}/metrics", timeout=5).read().decode()

    def kill(self) -> None:
        """A crash: SIGKILL, nothing flushed or closed by the server."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()
        self.log.close()
