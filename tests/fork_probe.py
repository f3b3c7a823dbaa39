"""A torchrun worker module for tests/integration/test_torchrun_fork.py: records what a worker process sees
(`python -m tests.fork_probe OUT_DIR [EXIT_CODE_OF_RANK_1]`), in `OUT_DIR/rank<RANK>.json`, and leaves two
files that only the interpreter's exit writes (a non-daemon thread's and an atexit handler's)."""

import atexit
import json
import os
import sys
import threading
import time
from pathlib import Path

PRELOADED = sorted(m for m in ("diffusers.pipelines.flux.pipeline_flux", "chunkgrpo.train.trainer", "peft")
                   if m in sys.modules)  # imported before this module ran: the launcher's preload


def _late(path: Path) -> None:
    time.sleep(0.5)
    path.write_text("thread")


def main() -> int:
    out, rank = Path(sys.argv[1]), int(os.environ["RANK"])
    exit_code = int(sys.argv[2]) if len(sys.argv) > 2 and rank == 1 else 0
    ppid = os.getppid()
    record = {
        "name": __name__, "argv": sys.argv, "rank": rank, "world": int(os.environ["WORLD_SIZE"]),
        "local_world": int(os.environ["LOCAL_WORLD_SIZE"]), "omp": os.environ.get("OMP_NUM_THREADS"),
        "preloaded": PRELOADED, "own_session": os.getsid(0) == os.getpid(),
        "text_unbuffered": sys.stdout.line_buffering or sys.stdout.write_through,  # `-u` or line buffering
        "launcher_cmdline": Path(f"/proc/{ppid}/cmdline").read_bytes().split(b"\0")[:4],
    }
    record["launcher_cmdline"] = [a.decode() for a in record["launcher_cmdline"]]
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    print(f"fork_probe rank {rank}: line", flush=False)  # no flush: -u / line buffering must deliver it
    threading.Thread(target=_late, args=(out / f"thread{rank}",)).start()  # non-daemon: joined at exit
    atexit.register(lambda: (out / f"atexit{rank}").write_text("atexit"))
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
