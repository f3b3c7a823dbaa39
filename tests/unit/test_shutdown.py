"""chunkgrpo.shutdown: the exit handler collects once (cyclic garbage is still finalized), then freezes
what is left, after the handlers registered later have run."""

import subprocess
import sys

PROGRAM = r"""
import atexit, gc, sys
from pathlib import Path

out = Path(sys.argv[1])
# registered before fast_exit, so it runs after fast_exit's handler: what did that handler leave?
atexit.register(lambda: (out / "frozen").write_text(str(gc.get_freeze_count())))

from chunkgrpo import shutdown

assert shutdown.fast_exit() is True and shutdown.fast_exit() is False  # once per process

class InACycle:  # garbage only a collection finds; its finalizer stands for a buffered file's flush
    def __init__(self):
        self.me = self

    def __del__(self):
        (out / "finalized").write_text("yes")

gc.disable()  # no automatic collection may find it first: only an exit-time collection can
InACycle()
atexit.register(lambda: (out / "later").write_text(str(gc.get_freeze_count())))  # e.g. mlflow's flush
"""


def test_exit_handler_finalizes_cyclic_garbage_then_freezes_after_later_handlers(tmp_path):
    r = subprocess.run([sys.executable, "-c", PROGRAM, str(tmp_path)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "later").read_text() == "0"        # a later-registered handler ran first, unfrozen
    assert (tmp_path / "finalized").read_text() == "yes"  # the cycle's finalizer ran (collect, then freeze)
    assert int((tmp_path / "frozen").read_text()) > 1000  # then the survivors were frozen
