"""Training: the run's overrides (one list for both trainers), torchrun inside a pipeline task, and the
CLI's `chunkgrpo train` (a run in this process, or a dry run that checks the inputs and loads nothing)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from chunkgrpo.config import option
from chunkgrpo.stages.task import local_file, run_prefix


@dataclass(frozen=True)
class TrainRequest:
    """A pipeline run's training inputs, shared by the `train` (torchrun) and `launch_trainjob` steps."""

    model: str = option(help="base model: diffusers folder, s3:// folder artifact or cached hub id")
    prompts: str = option(help="training prompt file (local path or s3:// object)")
    preset: str = option(help="training preset or YAML path ('' = the method's own preset)")
    method: str = option(help="chunk | chunk+ws | dance | tempflow | granular")
    chunks: str = option(help="chunk plan spec (`sizes:...` from the plan step)")
    max_iterations: int = option(help="rollouts; 0 = the preset's length (< 0: the trainer rejects it)")
    overrides: list = option([], "extra training overrides (key=value)")
    artifact_root: str = option("", "s3:// prefix; outputs go to <root>/<run_id>/train")
    run_id: str = option("", "KFP run id")
    experiment: str = option("", "MLflow experiment")
    parent_run_id: str = option("", "MLflow parent run id ('' = none)")
    reward_weights: dict = option({}, "{reward: URI, '<reward>.processor': URI}")
    reward_url: str = option("", "a reward server (`chunkgrpo reward-server`) for every reward without a url "
                                 "of its own ('' = the rewards as configured)")

    @property
    def config(self) -> str:
        """The training preset (`preset`, or the method's own; an unknown method is a UserError)."""
        from chunkgrpo.recipes import preset_for

        return preset_for(self.method, self.preset)

    @property
    def prefix(self) -> str:
        return run_prefix(self.artifact_root, self.run_id, "train")

    def train_args(self, prompts_path: str, output_dir: str = "") -> list[str]:
        """The trainer's overrides: the run's own, the preset's rewards pointed at `reward_weights`, the
        inputs, the length, and where checkpoints (a retry resumes from them, as the same writer of
        their S3 prefix) and tracking go.
        `output_dir` for a run in the task; without one, progress=false (training pods log no progress).
        With `reward_url`, every reward without a url of its own is scored by that server, and a served
        reward gets no weight overrides (its server holds the weights)."""
        from chunkgrpo.model_cache import reward_weight_overrides

        overrides = list(self.overrides)
        served, url_overrides = served_rewards(self.config, overrides, self.reward_url)
        weights = [o for o in reward_weight_overrides(self.config, overrides, dict(self.reward_weights))
                   if int(o.split(".")[1]) not in served]
        return [
            *overrides,
            *url_overrides,
            *weights,
            f"model={self.model}",
            f"prompts={prompts_path}",
            f"method={self.method}",
            f"chunks={self.chunks}",
            *length_overrides(self.max_iterations),
            f"output_dir={output_dir}" if output_dir else "progress=false",
            f"checkpoint.s3_prefix={self.prefix}/checkpoints",
            f"checkpoint.writer_id=kfp-run-{self.run_id}",  # a retried pod of this run takes its lease back
            f"tracking.experiment={self.experiment}",
            f"tracking.parent_run_id={self.parent_run_id}",
            f"tracking.run_name=train-{self.run_id[:8]}",
        ]


def length_overrides(max_iterations: int) -> list[str]:
    """The training-length override of a run's `max_iterations` (none for 0: the preset's length)."""
    return [f"max_iterations={max_iterations}"] if max_iterations != 0 else []


def _rewards(preset: str, overrides: list[str]) -> list:
    from chunkgrpo.config import _set_dotted, load_yaml, parse_override

    data = load_yaml(preset)
    for text in overrides or []:
        key, value = parse_override(text)
        _set_dotted(data, key, value)
    return [r or {} for r in data.get("rewards") or []]


def reward_servers(preset: str, overrides: list[str], url: str) -> list[tuple[str, str]]:
    """(name, url) of every reward the run scores on a server: its own url, else `url` when set."""
    rewards = _rewards(preset, overrides) or [{"name": "brightness"}]
    return [(r.get("name", ""), r.get("url") or url) for r in rewards if r.get("url") or url]


def served_rewards(preset: str, overrides: list[str], url: str) -> tuple[set[int], list[str]]:
    """(indices of the rewards scored by a server, the overrides pointing those without a url at `url`)
    for the preset's rewards after `overrides`; `url` '' adds none."""
    rewards = _rewards(preset, overrides)
    if not url:
        return {i for i, r in enumerate(rewards) if r.get("url")}, []
    from chunkgrpo.scoring.remote import check_url

    url = check_url(url)
    if not rewards:  # the config's default reward, served
        return {0}, [f"rewards={json.dumps([{'name': 'brightness', 'url': url}])}"]
    out = [f"rewards.{i}.url={url}" for i, r in enumerate(rewards) if not r.get("url")]
    return set(range(len(rewards))), out


@dataclass(frozen=True)
class TrainedModel:
    """A trained model in S3: its pointer (`chunkgrpo.store.manifest.make_pointer`) and summary metrics."""

    pointer: dict
    metrics: dict

    @property
    def metadata(self) -> dict:
        """The pointer's scalar fields (artifact metadata)."""
        return {k: v for k, v in self.pointer.items() if isinstance(v, (str, int, float))}

    def write(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.pointer, indent=1))


def model_pointer(req: TrainRequest, uri: str, manifest_sha256: str, info: dict, summary: dict,
                  **extra) -> dict:
    """The pointer of a finished run's final model (`info`: its chunkgrpo_model.json)."""
    from chunkgrpo.store.manifest import make_pointer

    return make_pointer(uri, manifest_sha256, info["kind"], base_model=req.model, method=req.method,
                        chunk_sizes=summary["chunk_sizes"], optimizer_steps=summary["optimizer_steps"],
                        config_hash=summary["config_hash"], **extra)


def train(req: TrainRequest, nproc_per_node: int) -> TrainedModel:
    """Train on this node with torchrun (rendezvous store on 127.0.0.1 only), upload the final model and
    the summary to `<prefix>/final`, and return its pointer. The run's local output folder (checkpoints,
    the final model) is a scratch folder, removed once the model is uploaded (and on failure: the
    checkpoints a retry resumes from are in S3)."""
    import shlex

    from chunkgrpo.store.client import ArtifactStore
    from chunkgrpo.tempdirs import scratch
    from chunkgrpo.torchrun_local import command

    preset = req.config
    prefix = req.prefix
    with scratch("chunkgrpo-train-") as tmp:
        out = tmp / "out"
        # the trainer uploads the final model itself, before its last checkpoint's upload starts
        args = [*req.train_args(local_file(req.prompts, tmp), output_dir=str(out)),
                f"checkpoint.final_uri={prefix}/final"]
        # torchrun on one node, rendezvous store on 127.0.0.1 only (--standalone listens on every interface)
        cmd = command(nproc_per_node, "-m", "chunkgrpo.train", "--config", preset, *args)
        print("+ torchrun " + shlex.join(cmd[3:]), flush=True)
        from chunkgrpo.torchrun import run_torchrun

        run_torchrun(cmd)  # ranks' output streamed into the task log; a rank's user error becomes this one

        summary = json.loads((out / "train_summary.json").read_text())
        info = json.loads((out / "final" / "chunkgrpo_model.json").read_text())
        uri = f"{prefix}/final"
        store = ArtifactStore()
        from chunkgrpo.store.manifest import build_manifest

        manifest = store.read_manifest(uri)
        if manifest is None or manifest.content_sha256 != build_manifest(out / "final").content_sha256:
            manifest = store.put_folder(out / "final", uri, meta={"kind": "model", "run_id": req.run_id})
        store.put_file(out / "train_summary.json", f"{prefix}/train_summary.json")
    pointer = model_pointer(req, uri, manifest.sha256, info, summary,
                            mlflow_run_id=summary.get("mlflow_run_id") or "", kfp_run_id=req.run_id)
    hist = summary["history"]
    metrics = {"optimizer_steps": float(summary["optimizer_steps"]),
               "reward_mean.first": float(hist[0]["reward_mean"]),
               "reward_mean.last": float(hist[-1]["reward_mean"]), "loss.last": float(hist[-1]["loss"])}
    print(f"model -> {uri} (manifest sha256 {manifest.sha256[:12]}, {manifest.total_bytes / 1e6:.1f} MB)")
    return TrainedModel(pointer, metrics)


@dataclass(frozen=True)
class DryRun:
    """What a dry run checked: the model (its local folder; '' for s3://, fetched at setup), the number of
    prompts, the chunk sizes the run would train, and whether this machine can give the run its device
    (`device_problem`: the one-line reason a real run would stop at, '' when it would not)."""

    model: str
    prompts: int
    chunk_sizes: list
    device: str = ""
    device_problem: str = ""

    def to_dict(self) -> dict:
        return {"ok": True, "model": self.model, "prompts": self.prompts, "chunk_sizes": self.chunk_sizes,
                "device": self.device, "device_ok_here": not self.device_problem,
                **({"device_problem": self.device_problem} if self.device_problem else {})}


def dry_run(cfg) -> DryRun:
    """Check a TrainConfig's model folder, prompts, chunk plan and rewards without loading any weights
    (the checks `Trainer` makes before `setup`). A config for a GPU is checked on any machine: whether
    this one has a usable GPU is reported, not an error (the real run stops on it in one line)."""
    from chunkgrpo.gpu import problem
    from chunkgrpo.train.trainer import Trainer

    t = Trainer(cfg, check_device=False)
    return DryRun(t.model_path or cfg.model, len(t.prompts), [int(s) for s in t.plan.sizes], cfg.device,
                  problem(cfg.device) or "")


def run_local(cfg) -> dict:
    """Train a TrainConfig in this process (or as one rank under torchrun); the run's summary
    (empty on ranks other than 0)."""
    from chunkgrpo.train.trainer import run_training

    return run_training(cfg)
