"""Image preflight: in the image a later step runs in, every reward or scorer that step builds can import
its package, and the files it loads besides its weights are there; seconds, no model is loaded.

    problems = training_problems("chunk_grpo_flux", [], reward_weights, image="chunkgrpo-runtime")
    problems = evaluation_problems("eval_hpdv2", [], [], scorer_weights, lora=True, image="chunkgrpo-eval")

What is resolved, in THIS process's environment (the preflight task runs on the step's own image):

- a reward-package scorer (hpsv3, imagereward, hpsv2/hpsv2.1; pickscore/clip run on `transformers`):
  with a venv (`$CHUNKGRPO_VENV_<NAME>` or the `venv` option) the venv exists and its python finds the
  package (`importlib.util.find_spec` in one subprocess per venv: nothing is imported); without one, this
  environment finds it;
- the files such a scorer loads by name rather than from its weight URI: ImageReward's
  `bert-base-uncased` tokenizer in the Hugging Face cache (unless `imagereward.processor` is given),
  HPSv3's Qwen2-VL base model in the cache (unless `hpsv3.processor` is given or the local weights folder
  holds it), hpsv2's BPE vocabulary inside its package;
- a programmatic reward's module, a user's `module:attr` module or entry point;
- a LoRA model (`lora.enabled` of the training preset, or any registry version): `peft`;
- GenEval with the official detector (`geneval_detector: mmdet`): mmdet and mmcv in the evaluation process.

Each problem is one sentence naming the image, the reward or scorer, the package or file, and the fix.
Weight URIs themselves are `chunkgrpo.preflight`'s.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

from chunkgrpo.errors import UserError

RUNTIME = "chunkgrpo-runtime"
EVAL = "chunkgrpo-eval"
HPSV2_VOCAB = "src/open_clip/bpe_simple_vocab_16e6.txt.gz"
BERT, QWEN = "bert-base-uncased", "Qwen/Qwen2-VL-7B-Instruct"
_FIND = ("import importlib.util as u, json, sys\n"
         "out = {}\n"
         "for m in sys.argv[1:]:\n"
         "    try:\n"
         "        s = u.find_spec(m)\n"
         "    except Exception:\n"
         "        s = None\n"
         "    out[m] = None if s is None else list(s.submodule_search_locations or [])\n"
         "print(json.dumps(out))\n")


@dataclasses.dataclass(frozen=True)
class Need:
    """A package a reward or scorer (`who`, e.g. "reward hpsv3") imports: `module` (distribution `dist`),
    in `venv` (None: this environment); `origin` says where the venv came from."""

    who: str
    module: str
    dist: str
    venv: Path | None = None
    origin: str = ""
    var: str = ""  # the variable naming a venv for it ("" = it runs in the image's environment only)


def find_modules(modules: list[str], python: str | None = None, timeout: float = 60.0
                 ) -> dict[str, list[str] | None]:
    """{module: its package folders ([] for a plain module), or None when not found} as `python` (default
    this interpreter, in-process) resolves them; nothing is imported beyond parent packages."""
    if python is None:
        out = {}
        for m in modules:
            try:
                spec = importlib.util.find_spec(m)
            except (ImportError, ValueError):
                spec = None
            out[m] = None if spec is None else list(spec.submodule_search_locations or [])
        return out
    # -I: the worker's own view (no PYTHONPATH, no user site); the venv's .pth files still apply
    r = subprocess.run([python, "-I", "-c", _FIND, *modules], capture_output=True, text=True,
                       timeout=timeout, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    if r.returncode != 0:
        tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
        raise OSError(f"{python} failed ({tail[:200]})")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _venv(name: str, explicit: str | None) -> tuple[Path | None, str]:
    """(venv folder or None, where it was named); UserError for a named venv that is not one."""
    from chunkgrpo.scoring.client import venv_for, venv_var

    var = venv_var(name)
    path = venv_for(name, explicit)
    origin = f"venv={explicit}" if explicit is not None else f"${var}={os.environ.get(var, '')}"
    return path, origin


def _hub_file(repo_id: str, filename: str) -> bool:
    """Is `filename` of `repo_id`'s `main` snapshot in the Hugging Face hub cache (as the worker sees it)?"""
    from huggingface_hub import try_to_load_from_cache

    from chunkgrpo.scoring.hub_cache import hub_cache_dir

    return isinstance(try_to_load_from_cache(repo_id, filename, cache_dir=hub_cache_dir()), str)


def _where(need: Need) -> str:
    return f"its venv {need.origin}" if need.venv is not None else f"this environment ({sys.executable})"


def _package_fix(need: Need, image: str) -> str:
    name = image.removeprefix("chunkgrpo-")
    if need.venv is not None:
        return (f"rebuild that venv (`bash scripts/reward-envs.sh`; images/{name}/Dockerfile builds "
                "/opt/venv-*)")
    venv = f" or set ${need.var} to a venv that has it" if need.var else ""
    return f"add `{need.dist}` to images/{name}/requirements.lock (installed by scripts/image-env.sh){venv}"


def _scorer_needs(name: str, options: dict, weights: dict, who: str, image: str
                  ) -> tuple[list[Need], list[str], list[tuple[str, str]]]:
    """(packages, problems so far, files to check after the package resolves) of scorer `name`."""
    from chunkgrpo.scoring.backends import PACKAGES
    from chunkgrpo.scoring.client import venv_var
    from chunkgrpo.scoring.table import canonical_name

    canon = canonical_name(name)
    module, dist = PACKAGES[canon]
    explicit = options.get("venv")
    try:
        venv, origin = _venv(canon, None if explicit is None else str(explicit))
    except UserError as e:
        return [], [f"{image}: {who}: {e}"], []
    files: list[tuple[str, str]] = []
    processor = options.get("processor") or weights.get(f"{name}.processor") or weights.get(
        f"{canon}.processor")
    if canon == "imagereward" and not processor:
        files.append(("hub", BERT))
    if canon == "hpsv3" and not processor:
        w = str(options.get("weights") or weights.get(name) or weights.get(canon) or "")
        if not w.startswith("s3://") and not (w and (Path(w).expanduser() / "Qwen2-VL-7B-Instruct").is_dir()):
            files.append(("hub", QWEN))
    if canon.startswith("hpsv2"):
        files.append(("vocab", module))
    return [Need(who, module, dist, venv, origin, venv_var(canon))], [], files


def _resolve(needs: list[Need], files: dict[Need, list[tuple[str, str]]], image: str, param: str
             ) -> list[str]:
    """One problem per package not found and per file missing, resolving each venv in one subprocess;
    `param`: the run parameter that names the weights and processors (reward_weights | scorer_weights)."""
    problems: list[str] = []
    by_venv: dict[Path | None, list[Need]] = {}
    for n in needs:
        by_venv.setdefault(n.venv, []).append(n)
    for venv, group in by_venv.items():
        modules = sorted({n.module for n in group})
        try:
            found = find_modules(modules, None if venv is None else str(venv / "bin" / "python"))
        except (OSError, subprocess.TimeoutExpired, ValueError) as e:
            problems.append(f"{image}: {', '.join(n.who for n in group)}: the python of {_where(group[0])} "
                            f"does not run ({e}): rebuild it (`bash scripts/reward-envs.sh`)")
            continue
        for n in group:
            locations = found.get(n.module)
            if locations is None:
                dist = "" if n.dist == n.module else f" (`{n.dist}`)"
                problems.append(f"{image}: {n.who} needs the `{n.module}` package{dist}, which "
                                f"{_where(n)} cannot import: {_package_fix(n, image)}")
                continue
            for kind, what in files.get(n, []):
                if kind == "hub" and not _hub_file(what, "config.json" if what == QWEN else "vocab.txt"):
                    key = "imagereward.processor" if what == BERT else "hpsv3.processor"
                    problems.append(f"{image}: {n.who} loads `{what}` by name from the Hugging Face cache "
                                    f"({_hub_dir()}), which lacks it and is never downloaded at run time: "
                                    f"give its folder as `{key}` in {param} (`chunkgrpo models sync "
                                    "--defaults` fills the model cache)")
                if kind == "vocab" and not any((Path(p) / HPSV2_VOCAB).is_file() for p in locations):
                    problems.append(f"{image}: {n.who}: the `hpsv2` package in {_where(n)} lacks open_clip's "
                                    f"BPE vocabulary ({HPSV2_VOCAB}): rebuild it with "
                                    "`bash scripts/reward-envs.sh`, which copies it in")
    return problems


def _hub_dir() -> str:
    from chunkgrpo.scoring.hub_cache import hub_cache_dir

    return str(hub_cache_dir())


def _named(name: str, kind: str, who: str, image: str) -> list[str]:
    """A programmatic reward's or a user's `module:attr` module, or a user's entry point (none imported)."""
    from importlib.metadata import entry_points

    from chunkgrpo.scoring.custom import GROUPS
    from chunkgrpo.scoring.table import REWARDS, RewardEntry

    entry = REWARDS.get(name)
    if entry is not None and not isinstance(entry, RewardEntry):
        return []  # registered as a function in this process
    target = entry.target if entry is not None else name
    if ":" in target:
        module = target.partition(":")[0].strip()
        if find_modules([module])[module] is None:
            return [f"{image}: {who} needs the module `{module}`, which this environment ({sys.executable}) "
                    "cannot import: install its package in the image (or put it on the task's PYTHONPATH)"]
        return []
    if not any(ep.name == name for g in GROUPS[kind] for ep in entry_points(group=g)):
        return [f"{image}: {who} is not built in and no package installed in this environment "
                f"({sys.executable}) has an entry point {name!r} in group {' or '.join(GROUPS[kind])}: "
                "install the package that provides it in the image"]
    return []


def _check(items: list[tuple[str, dict, str]], weights: dict, kind: str, image: str,
           extra: list[Need] = ()) -> list[str]:
    """items: (name, options, who) of the rewards or scorers a step builds."""
    from chunkgrpo.scoring.custom import is_builtin
    from chunkgrpo.scoring.table import REWARDS

    problems: list[str] = []
    needs: list[Need] = list(extra)
    files: dict[Need, list[tuple[str, str]]] = {}
    for name, options, who in items:
        if name in REWARDS or not is_builtin(name):
            problems.extend(_named(name, kind, who, image))
            continue
        got, bad, want = _scorer_needs(name, options, weights, who, image)
        problems.extend(bad)
        for n in got:
            needs.append(n)
            files.setdefault(n, []).extend(want)
    return problems + _resolve(needs, files, image, f"{kind}_weights")


def training_problems(preset: str, overrides: list[str], weights: dict, *, served: set[str] = frozenset(),
                      image: str = RUNTIME) -> list[str]:
    """What stops the training image from building the preset's rewards (those in `served` are scored by
    a reward server and left out)."""
    from chunkgrpo.model_cache import _preset_with

    rewards = _preset_with(preset, list(overrides)).get("rewards") or [{"name": "brightness"}]
    items = []
    for r in rewards:
        r = r or {}
        name = str(r.get("name", "brightness"))
        if name in served or r.get("url"):
            continue
        items.append((name, dict(r.get("options") or {}), f"reward {name}"))
    return _check(items, dict(weights), "reward", image)


def is_lora(preset: str, overrides: list[str]) -> bool:
    """Does the training preset (+ overrides) train a LoRA adapter (`lora.enabled`, on by default)?"""
    from chunkgrpo.model_cache import _preset_with

    lora = _preset_with(preset, list(overrides)).get("lora") or {}
    return str(lora.get("enabled", True)).lower() not in ("false", "0", "no")


def evaluation_problems(eval_preset: str, benchmarks: list[str], overrides: list[str], weights: dict, *,
                        lora: bool, image: str = EVAL) -> list[str]:
    """What stops the evaluation image from building the HPDv2 scorers of `eval_preset` (+ benchmarks,
    overrides) and, with `lora`, from loading a LoRA adapter (peft)."""
    from chunkgrpo.model_cache import _preset_with

    more = [f"benchmarks={json.dumps(list(benchmarks))}"] if benchmarks else []
    data = _preset_with(eval_preset, [*overrides, *more])
    items = []
    if "hpdv2" in (data.get("benchmarks") or ["hpdv2"]):
        options = data.get("scorer_options") or {}
        items = [(str(s), dict(options.get(s) or {}), f"scorer {s}") for s in data.get("scorers") or []]
    scorer_weights = {**dict(weights), **(data.get("scorer_weights") or {})}
    extra = [Need("the trained model (a LoRA adapter)", "peft", "peft")] if lora else []
    return _geneval_problems(data, image) + _check(items, scorer_weights, "scorer", image, extra)


def _geneval_problems(data: dict, image: str) -> list[str]:
    """GenEval with the official detector (`geneval_detector: mmdet`) imports mmdet 2.x and mmcv's compiled
    ops in the evaluation process itself; they need torch 2.1, so an environment on today's torch lacks
    them (the eval image keeps them apart, in /opt/venv-geneval, which the evaluation does not run in)."""
    if "geneval" not in (data.get("benchmarks") or []) or data.get("generate_only"):
        return []
    if str(data.get("geneval_detector", "mmdet")) != "mmdet":
        return []
    missing = [m for m, where in find_modules(["mmdet", "mmcv"]).items() if where is None]
    if not missing:
        return []
    return [f"{image}: benchmark geneval's detector (geneval_detector=mmdet) imports {' and '.join(missing)} "
            f"in the evaluation process, which this environment ({sys.executable}) lacks: set "
            "geneval_detector=transformers with its weights (not comparable with published numbers), or "
            "generate_only=true and score the images with the official GenEval scripts"]


def require(problems: list[str], what: str) -> None:
    """UserError in one line listing `problems` of the `what` preflight."""
    if problems:
        raise UserError(f"{what}: {len(problems)} problem(s): " + "; ".join(problems))
