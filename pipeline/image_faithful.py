"""Local tasks that run in the Python environment of the image their pod uses (`--image-faithful`).

Every compiled task names its container image (`chunkgrpo-runtime`, `chunkgrpo-eval`, `chunkgrpo-launcher`;
components/images.py). Each image's main environment is installed from its lock by one script,
`scripts/image-env.sh IMAGE PREFIX`, which its Dockerfile runs too; on a plain machine the prefix is
`<repo>/.image-envs/<image>` (or `$CHUNKGRPO_IMAGE_ENVS/<image>`). An image-faithful run is a pod-faithful
run (pipeline/pod_faithful.py: the compiled env, fresh volume folders, the write audit) whose tasks start
with that environment's interpreter instead of this one, with the image's own variables
(`CHUNKGRPO_VENV_*` for the reward venvs of the runtime and eval images, `VIRTUAL_ENV`, `PATH`).

The one local substitution: a CPU torch build of the image's torch version. A task that imports a package
its image does not have fails with one line naming the task, the image and the package:

    chunkgrpo image-faithful: error: task evaluate: image chunkgrpo-eval has no package 'peft' ...
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
IMAGES = ("runtime", "eval", "launcher")
ENVS_VAR = "CHUNKGRPO_IMAGE_ENVS"          # one environment per image (default <repo>/.image-envs)
REWARD_ENVS_VAR = "CHUNKGRPO_REWARD_ENVS"  # scripts/reward-envs.sh (default <repo>/.reward-envs)
STAMP = ".chunkgrpo-image-env"             # written by scripts/image-env.sh once the environment is complete
# the scorer venvs the runtime and eval images export (images/*/Dockerfile), relative to the reward-env root
REWARD_VENVS = {"CHUNKGRPO_VENV_HPSV2": "venv-hpsv2", "CHUNKGRPO_VENV_IMAGEREWARD": "venv-imagereward",
                "CHUNKGRPO_VENV_HPSV3": "venv-hpsv3"}
_IMAGE = re.compile(r"(?:^|/)chunkgrpo-(runtime|eval|launcher)(?:[:@]|$)")
_MISSING = re.compile(r"ModuleNotFoundError: No module named '([^'.]+)")


def image_name(ref: str) -> str:
    """`eval` for `ghcr.io/chunkgrpo/chunkgrpo-eval:0.1.0`; "" for an image that is none of ours."""
    m = _IMAGE.search(ref)
    return m.group(1) if m else ""


@dataclasses.dataclass(frozen=True)
class ImageEnv:
    """The local environment standing for one image: its name and the venv's prefix."""

    image: str
    prefix: Path

    @property
    def python(self) -> Path:
        return self.prefix / "bin" / "python"

    def variables(self, environ) -> dict[str, str]:
        """What the image's Dockerfile sets for the task: the venv on PATH, and for the runtime and eval
        images the reward venvs' paths (`CHUNKGRPO_VENV_*`)."""
        bin_dir = str(self.prefix / "bin")
        path = [p for p in environ.get("PATH", "").split(os.pathsep) if p and not _is_venv_bin(p)]
        out = {"VIRTUAL_ENV": str(self.prefix), "PATH": os.pathsep.join([bin_dir, *path])}
        if self.image in ("runtime", "eval"):
            root = Path(environ.get(REWARD_ENVS_VAR) or REPO / ".reward-envs")
            out.update({k: str(root / v) for k, v in REWARD_VENVS.items()})
        return out


def _is_venv_bin(p: str) -> bool:
    return (Path(p).parent / "pyvenv.cfg").exists()


def env_for(image: str, environ=os.environ) -> ImageEnv:
    root = Path(environ.get(ENVS_VAR) or REPO / ".image-envs")
    return ImageEnv(image, root / image)


def envs_for(images: dict[str, str], environ=os.environ) -> dict[str, ImageEnv]:
    """{task function: ImageEnv} for tasks whose image is one of ours (`images`: function -> image ref).
    Raises UserError, in one line, for an image whose environment is not built."""
    from chunkgrpo.errors import UserError

    out = {}
    for fn, ref in images.items():
        name = image_name(ref)
        if not name:
            continue
        env = env_for(name, environ)
        if not (env.python.exists() and (env.prefix / STAMP).exists()):
            raise UserError(f"--image-faithful: task {fn} runs on image chunkgrpo-{name}, whose environment "
                            f"{env.prefix} is not built: run `bash scripts/image-env.sh {name} {env.prefix}`")
        out[fn] = env
    return out


def command_in(env: ImageEnv, full_command: list[str], this_python: str) -> list[str]:
    """kfp.local's task command (started with this interpreter) started with the image env's instead."""
    return [part.replace(this_python, str(env.python)) for part in full_command]


def missing_package(lines: list[str]) -> str:
    """The top-level module a task's output says it could not import ("" if none)."""
    for line in reversed(lines):
        if m := _MISSING.search(line):
            return m.group(1)
    return ""


def missing_line(fn: str, env: ImageEnv, package: str) -> str:
    return (f"chunkgrpo image-faithful: error: task {fn}: image chunkgrpo-{env.image} has no package "
            f"'{package}' (its environment {env.prefix}, installed from "
            f"images/{env.image}/requirements.lock by scripts/image-env.sh)")
