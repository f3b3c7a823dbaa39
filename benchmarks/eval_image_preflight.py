"""How soon an image-faithful run fails when the evaluation image lacks a package the evaluation needs:
the tiny demo of train_and_evaluate with every task in its image's environment, the eval environment
installed from the eval lock without `peft` (as tests/pipeline/test_image_faithful.py does).

    .venv/bin/python benchmarks/eval_image_preflight.py --envs "$(mktemp -d)"

Prints one JSON line: the seconds to install the eval environment (0 when `--envs` already holds it), the
seconds from the run's start to its failure, the failed task and its reason, the tasks that started, and
the load average. Needs `bash scripts/image-env.sh runtime eval` and the SeaweedFS binary (local services).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PARAMS = {"max_iterations": 2, "profile_prompts": 2, "eval_num_prompts": 2}


def lock_without(package: str, lock: Path, out: Path) -> None:
    """`lock` without `package`'s entry (its `==` line and the indented hash lines under it)."""
    kept, skip = [], False
    for line in lock.read_text().splitlines():
        if line.startswith(f"{package}=="):
            skip = True
            continue
        if skip and line.startswith("    "):
            continue
        skip = False
        kept.append(line)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(kept) + "\n")


def main() -> int:
    from pipeline import image_faithful as IF

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--envs", required=True, help="folder for the image environments (eval built here once)")
    args = ap.parse_args()
    envs = Path(args.envs).resolve()
    envs.mkdir(parents=True, exist_ok=True)
    runtime = IF.env_for("runtime")
    if not (envs / "runtime").exists():
        (envs / "runtime").symlink_to(runtime.prefix)
    install_s = 0.0
    if not (envs / "eval" / IF.STAMP).exists():
        locks = envs / "locks"
        lock_without("peft", REPO / "images" / "eval" / "requirements.lock",
                     locks / "eval" / "requirements.lock")
        t0 = time.perf_counter()
        subprocess.run(["bash", str(REPO / "scripts" / "image-env.sh"), "eval", str(envs / "eval")],
                       env={**os.environ, "CHUNKGRPO_IMAGE_LOCKS": str(locks)}, check=True,
                       capture_output=True)
        install_s = time.perf_counter() - t0
    from chunkgrpo.services import local_services
    from pipeline.local_run import run_local
    from pipeline.task_log import TaskFailed

    os.environ[IF.ENVS_VAR] = str(envs)
    with tempfile.TemporaryDirectory(prefix="eval-image-preflight-") as tmp:
        with local_services(Path(tmp) / "svc") as svc:
            t0 = time.perf_counter()
            failed = None
            try:
                run_local("train_and_evaluate", {**PARAMS, "model_name": f"bench-{uuid.uuid4().hex[:6]}"},
                          home=Path(tmp) / "home", services_env=svc.env(), demo="tiny", image_faithful=True)
            except TaskFailed as e:
                failed = e
            run_s = time.perf_counter() - t0
        log = re.sub(r"\x1b\[[0-9;]*m", "", failed.log_path.read_text()) if failed else ""
        started = re.findall(r"Executing task '([^']+)'", log)
    print(json.dumps({"install_eval_env_s": round(install_s, 1), "run_to_failure_s": round(run_s, 1),
                      "failed_task": failed.task if failed else None,
                      "reason": failed.reason[:200] if failed else None, "tasks_started": started,
                      "load_average": [round(x, 1) for x in os.getloadavg()]}))
    return 0 if failed else 1


if __name__ == "__main__":
    raise SystemExit(main())
