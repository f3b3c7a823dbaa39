"""One torch in every image: the runtime image's main venv and the reward venvs' shared venv-torch (built by
the runtime and eval images alike) install the same torch version, by version and not from a lock, from the
same CUDA wheel index build arg, on a CUDA base image of the same CUDA version. So a driver the runtime image
runs on also runs the reward workers (CUDA 12.6 by default: drivers >= 525.60.13), and the CUDA 13 build-arg
set switches every image at once."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.images.test_eval_locks import HEAVY, parse_lock, parse_spec

REPO = Path(__file__).resolve().parents[2]
IMAGES = REPO / "images"
SCRIPTS = REPO / "scripts"
TORCH_IMAGES = ("runtime", "eval")


def _var(path: Path, name: str) -> str:
    (value,) = re.findall(rf"^{name}=(\S+)", path.read_text(), re.M)
    return value


def _instructions(dockerfile: Path) -> list[str]:
    """The Dockerfile's instructions, continuation lines joined."""
    return re.sub(r"\\\n\s*", " ", dockerfile.read_text()).splitlines()


def _final_stage_args(dockerfile: Path) -> dict[str, str]:
    """ARG defaults as the final stage sees them: a global ARG's default, overridden by the stage's own."""
    def args(part: list[str]) -> dict[str, str | None]:
        return dict(m.groups() for line in part if (m := re.match(r"ARG (\w+)(?:=(\S+))?", line)))

    lines = _instructions(dockerfile)
    froms = [i for i, line in enumerate(lines) if line.startswith("FROM ")]
    glob, final = args(lines[: froms[0]]), args(lines[froms[-1]:])
    return {**glob, **{k: v if v is not None else glob.get(k, "") for k, v in final.items()}}


def test_every_torch_is_the_runtime_images_version():
    """image-env.sh (runtime main venv), reward-envs.sh (venv-torch) and the constraint every lock on the
    shared torch was resolved against name one torch; torchvision is torch's own release (0.(minor+15))."""
    runtime = _var(SCRIPTS / "image-env.sh", "TORCH_VERSION")
    reward, vision = _var(SCRIPTS / "reward-envs.sh", "TORCH_VERSION"), _var(SCRIPTS / "reward-envs.sh",
                                                                              "TORCHVISION_VERSION")
    constraints = parse_spec(IMAGES / "eval" / "constraints-torch.txt")
    assert runtime == reward == constraints["torch"] == _var(SCRIPTS / "lock-image-envs.sh", "RUNTIME_TORCH")
    assert vision == constraints["torchvision"]
    major, minor = (int(x) for x in runtime.split(".")[:2])
    assert major == 2 and vision.split(".")[:2] == ["0", str(minor + 15)], (runtime, vision)


def test_no_lock_pins_torch_or_its_cuda_build():
    """torch, torchvision, triton, nvidia-* and cuda-* come from the wheel index TORCH_INDEX_URL names (or the
    CPU build on a plain machine): a lock pinning one would fix the CUDA build whatever the build arg says."""
    locks = sorted(IMAGES.glob("*/*.lock"))
    assert {p.name for p in locks} >= {"requirements.lock", "requirements-torch.lock",
                                       "requirements-hpsv2.lock", "requirements-imagereward.lock",
                                       "requirements-hpsv3.lock"}
    pinned = {p.relative_to(IMAGES).as_posix(): sorted(n for n in parse_lock(p) if HEAVY.match(n))
              for p in locks}
    assert not {k: v for k, v in pinned.items() if v}, pinned


@pytest.mark.parametrize("image", TORCH_IMAGES)
def test_torch_images_install_torch_from_one_index_on_a_matching_cuda_base(image):
    """Both torch images default to the runtime's base image and wheel index (CUDA 12.6) and hand
    TORCH_INDEX_URL to every script that installs torch: reward-envs.sh, and image-env.sh, which installs
    the runtime's torch and runs reward-envs.sh again (a venv-torch stamped for another index would be
    rebuilt)."""
    dockerfile = IMAGES / image / "Dockerfile"
    runtime = _final_stage_args(IMAGES / "runtime" / "Dockerfile")
    args = _final_stage_args(dockerfile)
    for name in ("CUDA_IMAGE", "TORCH_INDEX_URL"):
        assert args[name] == runtime[name], name
    tag = args["CUDA_IMAGE"].split("@")[0].split(":")[1]
    assert args["TORCH_INDEX_URL"].endswith("/cu" + "".join(tag.split(".")[:2])), args
    assert tag.startswith("12.6.")  # the default build: the widest driver support (>= 525.60.13)
    installs = [line for line in _instructions(dockerfile)
                if line.startswith("RUN ") and re.search(r"reward-envs\.sh|image-env\.sh", line)]
    assert len(installs) == 2, installs
    for line in installs:
        assert 'TORCH_INDEX_URL="${TORCH_INDEX_URL}"' in line, line


def test_the_cuda13_build_args_apply_to_both_torch_images():
    """images/runtime/cuda13.build-args names only ARGs both torch images' final stages declare."""
    option = dict(line.split("=", 1)
                  for line in (IMAGES / "runtime" / "cuda13.build-args").read_text().splitlines()
                  if line and not line.startswith("#"))
    assert option["TORCH_INDEX_URL"].endswith("/cu130") and ":13.0." in option["CUDA_IMAGE"]
    for image in TORCH_IMAGES:
        assert set(option) <= set(_final_stage_args(IMAGES / image / "Dockerfile")), image


def _stamp(index_url: str | None, lock: Path) -> str:
    """What reward-envs.sh stamps a venv built from LOCK with, under TORCH_INDEX_URL=index_url."""
    script = SCRIPTS / "reward-envs.sh"
    cut = (f"source <(grep -E '^(RECIPE|TORCH_VERSION|TORCHVISION_VERSION)=' {script}); "
           f"source <(sed -n '/^stamp_of() {{/,/^}}/p' {script}); stamp_of {lock}")
    env = {"PATH": "/usr/bin:/bin"} | ({"TORCH_INDEX_URL": index_url} if index_url is not None else {})
    r = subprocess.run(["bash", "-c", cut], capture_output=True, text=True, timeout=30, env=env, check=True)
    return r.stdout.strip()


def test_a_venv_is_rebuilt_when_the_torch_build_changes(tmp_path):
    """The up-to-date stamp holds the torch build: another index (cu126 -> cu130, or the plain machine's
    default) or another lock gives another stamp, so a stamped venv from before is rebuilt."""
    lock = tmp_path / "requirements-x.lock"
    lock.write_text("numpy==2.4.6\n")
    stamps = {_stamp(url, lock) for url in (None, "https://download.pytorch.org/whl/cu126",
                                            "https://download.pytorch.org/whl/cu130")}
    assert len(stamps) == 3
    assert all(re.fullmatch(r"[0-9a-f]{16}-recipe\d+-torch[0-9a-f]{8}", s) for s in stamps), stamps
    assert _stamp(None, lock) == _stamp(None, lock)
    lock.write_text("numpy==2.4.7\n")
    assert _stamp(None, lock) not in stamps
