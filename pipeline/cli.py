"""Compile, upload, run and schedule the Kubeflow pipelines.

    chunkgrpo pipeline compile --pool h100|h800|gpu|cpu [--trainer torchrun|trainjob|pytorchjob]
                               [--out dist/pipelines] [--target-kfp 2.15|2.16|2.17]
                               [--image-pull-secret NAME] [--model-pvc NAME]
    chunkgrpo pipeline upload   --host URL --pool P [--version NAME]     # new pipeline version(s)
    chunkgrpo pipeline run --local [-p key=value ...]
                               [--keep-services]  # kfp.local, local S3 + MLflow, toy-world model
    chunkgrpo pipeline run      --host URL [-p key=value ...]            # one run on a cluster
    chunkgrpo pipeline schedule --host URL [--cron '0 0 2 * * *']  # in KFP's cronScheduleTimezone (UTC)

`--host` defaults to $KFP_HOST; a bearer token is taken from $KFP_TOKEN if set. Parameters are
`-p name=value`, the value parsed as YAML (`-p max_iterations=10 -p train_overrides='["lr=1e-5"]'`).
Images: `--registry`/`--tag` (or $CHUNKGRPO_IMAGE_REGISTRY/$CHUNKGRPO_IMAGE_TAG) at compile time.

There is no default GPU pool: pass `--pool` (or set $CHUNKGRPO_GPU_POOL, e.g. to the overlay's pool),
so pods never wait Pending for a GPU type the cluster does not have. Runs and schedules use the
service account a KFP UI run uses (the server's default: pipeline-runner, or default-editor in a
profile namespace) unless `--service-account` names another; manifests/base/pipeline grants that
account the training verbs. `--target-kfp` compiles for an older KFP backend (oldest: 2.15).
"""

import argparse
import datetime as _dt
import os
import sys
import tempfile
from pathlib import Path

from pipeline.compile import KFP_TARGETS
from pipeline.demos import DEMOS

NAME = "pipeline"
HELP = "Kubeflow pipelines: compile | upload | run [--local] | schedule (nightly benchmark)"

PIPELINES = ("train_and_evaluate", "nightly_benchmark", "models_sync")
DISPLAY = {
    "train_and_evaluate": "chunkgrpo-train-and-evaluate",
    "nightly_benchmark": "chunkgrpo-nightly-benchmark",
    "models_sync": "chunkgrpo-models-sync",
}
DEFAULT_CRON = "0 0 2 * * *"  # 6 fields (seconds first, robfig/cron as used by KFP): 02:00:00 every day


# --------------------------------------------------------------------------------------- helpers


def parse_params(items: list[str] | None) -> dict:
    import yaml

    from chunkgrpo.errors import UserError

    out = {}
    for item in items or []:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise UserError(f"-p {item!r}: expected name=value")
        out[key.strip()] = yaml.safe_load(raw) if raw.strip() else ""
    return out


def validate_cron(expr: str) -> str:
    """A 6-field cron expression (sec min hour day-of-month month day-of-week) as KFP expects."""
    from chunkgrpo.errors import UserError

    fields = expr.split()
    if len(fields) == 5:
        raise UserError(f"cron {expr!r} has 5 fields; KFP's cron has 6 (seconds first): try '0 {expr}'")
    if len(fields) != 6:
        raise UserError(
            f"cron {expr!r} must have 6 fields: second minute hour day-of-month month day-of-week"
        )
    return " ".join(fields)


def _kfp_client(args):
    """kfp.Client for --host (tests replace this function)."""
    import kfp

    from chunkgrpo.errors import UserError

    host = args.host or os.environ.get("KFP_HOST", "")
    if not host:
        raise UserError("no KFP endpoint: pass --host URL or set KFP_HOST (e.g. http://localhost:8080 after "
                        "`kubectl -n kubeflow port-forward svc/ml-pipeline-ui 8080:80`)")
    import warnings

    from chunkgrpo.cli import one_line_error

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning)  # kfp's "only works with v2.0.0-beta.2+"
        try:
            return kfp.Client(host=host, namespace=args.namespace or None,
                              existing_token=os.environ.get("KFP_TOKEN") or None)
        except Exception as e:
            line = one_line_error(e)
            if line is None:
                raise
            raise UserError(f"cannot reach Kubeflow Pipelines at {host} ({line}); check --host / KFP_HOST "
                            "and the port-forward") from None


def _default_version() -> str:
    from chunkgrpo import __version__
    from chunkgrpo.registry.registration import git_sha

    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    return f"v{__version__}-{git_sha()[:12]}-{stamp}"


def _compile(args, name: str, out_dir: Path) -> Path:
    from pipeline.compile import compile_pipeline

    return compile_pipeline(name, out_dir / f"{name}.yaml", pool=_pool(args), trainer=args.trainer,
                            target_kfp=args.target_kfp)


def _pool(args) -> str:
    """--pool, else $CHUNKGRPO_GPU_POOL; no silent default (an H100 default sends H800 pods to Pending)."""
    from chunkgrpo.errors import UserError

    pool = args.pool or os.environ.get("CHUNKGRPO_GPU_POOL", "")
    if not pool:
        raise UserError("no GPU pool: pass --pool h100|h800|gpu|cpu (the one your overlay targets) or set "
                        "CHUNKGRPO_GPU_POOL")
    if pool not in ("h100", "h800", "gpu", "cpu"):
        raise UserError(
            f"pool {pool!r} (from --pool or CHUNKGRPO_GPU_POOL) is not one of h100, h800, gpu, cpu"
        )
    return pool


def _set_images(args) -> None:
    if getattr(args, "registry", None):
        os.environ["CHUNKGRPO_IMAGE_REGISTRY"] = args.registry
    if getattr(args, "tag", None):
        os.environ["CHUNKGRPO_IMAGE_TAG"] = args.tag
    if getattr(args, "image_pull_secret", None):
        os.environ["CHUNKGRPO_IMAGE_PULL_SECRETS"] = ",".join(args.image_pull_secret)
    if getattr(args, "model_pvc", None):
        os.environ["CHUNKGRPO_MODEL_PVC"] = args.model_pvc


def _pipeline_display(args, name: str) -> str:
    base = DISPLAY[name]
    return base + ("-multinode" if name == "train_and_evaluate" and args.trainer != "torchrun" else "")


def upload_version(
    client, package: Path, display: str, version: str, description: str = ""
) -> tuple[str, str]:
    """Create the pipeline (first time) or a new version of it; returns (pipeline_id, version_id)."""
    pipeline_id = client.get_pipeline_id(display)
    if pipeline_id is None:
        p = client.upload_pipeline(str(package), pipeline_name=display, description=description)
        pipeline_id = p.pipeline_id
    v = client.upload_pipeline_version(str(package), pipeline_version_name=version, pipeline_id=pipeline_id,
                                       description=description)
    return pipeline_id, v.pipeline_version_id


# -------------------------------------------------------------------------------------- commands


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)

    def common(p, which_default="all", remote=False):
        p.add_argument(
            "--pipeline",
            default=which_default,
            choices=[*PIPELINES, "all"] if which_default == "all" else list(PIPELINES),
            help=f"which pipeline (default {which_default})",
        )
        p.add_argument(
            "--pool",
            default=None,
            choices=["h100", "h800", "gpu", "cpu"],
            help="GPU pool of the GPU steps: node selector, toleration, accelerator (no default: the "
            "overlay's pool, or $CHUNKGRPO_GPU_POOL)",
        )
        p.add_argument(
            "--trainer",
            default="torchrun",
            choices=["torchrun", "trainjob", "pytorchjob"],
            help="torchrun inside the train step (single node) or a TrainJob/PyTorchJob launcher "
            "(multi-node)",
        )
        p.add_argument(
            "--registry",
            default=None,
            help="image registry (default $CHUNKGRPO_IMAGE_REGISTRY or ghcr.io/chunkgrpo)",
        )
        p.add_argument(
            "--tag", default=None, help="image tag (default $CHUNKGRPO_IMAGE_TAG or the package version)"
        )
        p.add_argument("--target-kfp", default=KFP_TARGETS[-1], choices=KFP_TARGETS,
                       help="oldest KFP backend the IR must load on (2.15: no UI dropdowns; 2.14 is not "
                            "supported: its API server rejects the platform spec's optional secrets)")
        p.add_argument("--image-pull-secret", action="append", default=[], metavar="SECRET",
                       help="Secret for a private registry, on every step and training pod (repeatable)")
        p.add_argument("--model-pvc", default=None, help="PVC with models, mounted at /models in every step")
        if remote:
            p.add_argument("--host", default="", help="KFP API endpoint (default $KFP_HOST)")
            p.add_argument("--namespace", default="", help="KFP namespace (multi-user installs)")

    p = sub.add_parser("compile", help="compile pipelines to IR YAML")
    common(p)
    p.add_argument("--out", default="dist/pipelines", help="output directory (default dist/pipelines)")

    p = sub.add_parser("upload", help="upload new pipeline versions")
    common(p, remote=True)
    p.add_argument("--version", default="", help="version name (default v<version>-<git sha>-<UTC time>)")

    p = sub.add_parser("run", help="run a pipeline once: locally (--local) or on a cluster")
    common(p, which_default="train_and_evaluate", remote=True)
    p.add_argument(
        "--local",
        action="store_true",
        help="run with kfp.local against local S3 + MLflow (toy-world model, pretrained once and cached)",
    )
    p.add_argument(
        "-p", "--param", action="append", default=[], metavar="NAME=VALUE", help="pipeline parameter"
    )
    p.add_argument("--home", default=".chunkgrpo", help="--local: state dir (services, models, kfp outputs)")
    p.add_argument(
        "--keep-services", action="store_true",
        help="--local: leave S3 + MLflow running afterwards, for the next run and for browsing MLflow "
             "(`chunkgrpo local down` stops them)"
    )
    p.add_argument(
        "--demo",
        choices=DEMOS,
        default="toy",
        help="--local: toy = the pretrained toy-world model that visibly learns (default); tiny = the "
        "random-weight tiny model, a seconds-long wiring check",
    )
    p.add_argument(
        "--pod-faithful",
        action="store_true",
        help="--local: run every task with its pod's compiled env in fresh folders for its volumes and "
        "fail a task that writes outside them or beyond their sizeLimits scaled to the local model",
    )
    p.add_argument(
        "--image-faithful",
        action="store_true",
        help="--local: --pod-faithful, and every task runs in the locally built environment of the image its "
        "pod uses (`bash scripts/image-env.sh runtime|eval|launcher`)",
    )
    p.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="--local: stream every task's output (default: one line per task; all of it in the log file)",
    )
    p.add_argument("--s3-port", type=int, default=8333, help="--local: S3 port (default 8333)")
    p.add_argument("--mlflow-port", type=int, default=5000, help="--local: MLflow port (default 5000)")
    p.add_argument("--experiment", default="chunkgrpo", help="KFP experiment (cluster runs)")
    p.add_argument("--run-name", default="", help="KFP run name (cluster runs)")
    p.add_argument("--service-account", default="",
                   help="service account of the run's pods (default: the server's, as for a UI run)")
    p.add_argument("--pipeline-root", default="", help="override the pipeline root (s3://...)")
    p.add_argument("--enable-caching", default=None, choices=["true", "false"],
                   help="override every task's caching setting (default: as compiled: profile and plan are "
                   "cached); also --local, whose cache is dropped when the code or a local input changes")

    p = sub.add_parser("schedule", help="create a recurring run (default: nightly benchmark at 02:00 UTC)")
    common(p, which_default="nightly_benchmark", remote=True)
    p.add_argument(
        "--cron",
        default=DEFAULT_CRON,
        help=f"6-field cron with seconds (default '{DEFAULT_CRON}'), in KFP's cronScheduleTimezone "
        "(pipeline-install-config; default UTC)",
    )
    p.add_argument("--name", default="", help="recurring run name (default <pipeline>-nightly)")
    p.add_argument("--experiment", default="chunkgrpo-nightly", help="KFP experiment")
    p.add_argument("--version", default="", help="pipeline version name to upload and pin")
    p.add_argument(
        "-p", "--param", action="append", default=[], metavar="NAME=VALUE", help="pipeline parameter"
    )
    p.add_argument("--max-concurrency", type=int, default=1)
    p.add_argument(
        "--catchup", action="store_true", help="run missed schedules after a pause (default: no catch-up)"
    )
    p.add_argument("--service-account", default="",
                   help="service account of the run's pods (default: the server's, as for a UI run)")
    p.add_argument(
        "--keep-existing",
        action="store_true",
        help="do not delete an existing recurring run of the same name",
    )


def run(args: argparse.Namespace) -> int:
    _set_images(args)
    return {"compile": _cmd_compile, "upload": _cmd_upload, "run": _cmd_run, "schedule": _cmd_schedule}[
        args.action
    ](args)


def _which(args) -> list[str]:
    return list(PIPELINES) if args.pipeline == "all" else [args.pipeline]


def _cmd_compile(args) -> int:
    from components.images import EVAL_IMAGE, LAUNCHER_IMAGE, RUNTIME_IMAGE

    for name in _which(args):
        print(f"{_compile(args, name, Path(args.out))}  ({_pipeline_display(args, name)})")
    print(f"images: {RUNTIME_IMAGE}, {EVAL_IMAGE}, {LAUNCHER_IMAGE}")
    return 0


def _cmd_upload(args) -> int:
    client = _kfp_client(args)
    version = args.version or _default_version()
    with tempfile.TemporaryDirectory() as tmp:
        for name in _which(args):
            pkg = _compile(args, name, Path(tmp))
            display = _pipeline_display(args, name)
            pid, vid = upload_version(client, pkg, display, version)
            print(f"{display}: pipeline {pid}, version {version!r} ({vid})")
    return 0


def _caching(args) -> bool | None:
    """--enable-caching: None = each task's compiled setting."""
    value = getattr(args, "enable_caching", None)
    return None if value is None else value == "true"


def _cmd_run(args) -> int:
    params = parse_params(args.param)
    if args.local:
        from pipeline.local_run import run_local
        from pipeline.summary import summary_lines
        from pipeline.task_log import TaskFailed

        try:
            r = run_local(args.pipeline, params, home=args.home, keep_services=args.keep_services,
                          s3_port=args.s3_port, mlflow_port=args.mlflow_port, verbose=args.verbose,
                          demo=args.demo, pod_faithful=getattr(args, "pod_faithful", False),
                          enable_caching=_caching(args),
                          image_faithful=getattr(args, "image_faithful", False))
        except TaskFailed as e:  # one line: task, reason, log path; 2 = bad input, 1 = internal failure
            print(f"chunkgrpo pipeline: error: {e}", file=sys.stderr)
            return 2 if e.user_error else 1
        print("\n" + "\n".join(summary_lines(r)))
        return 0
    client = _kfp_client(args)
    caching = _caching(args)
    with tempfile.TemporaryDirectory() as tmp:
        pkg = _compile(args, args.pipeline, Path(tmp))
        res = client.create_run_from_pipeline_package(
            str(pkg), arguments=params, run_name=args.run_name or None, experiment_name=args.experiment,
            pipeline_root=args.pipeline_root or None, enable_caching=caching,
            service_account=args.service_account or None)
    print(f"run {res.run_id} submitted ({args.pipeline}); follow it in the KFP UI")
    return 0


def _cmd_schedule(args) -> int:
    cron = validate_cron(args.cron)
    params = parse_params(args.param)
    client = _kfp_client(args)
    name = args.name or f"{_pipeline_display(args, args.pipeline)}-nightly"
    version = args.version or _default_version()
    with tempfile.TemporaryDirectory() as tmp:
        pkg = _compile(args, args.pipeline, Path(tmp))
        pid, vid = upload_version(client, pkg, _pipeline_display(args, args.pipeline), version)
    exp = client.create_experiment(args.experiment, namespace=args.namespace or None)
    if not args.keep_existing:
        listing = client.list_recurring_runs(experiment_id=exp.experiment_id, page_size=100)
        for rr in getattr(listing, "recurring_runs", None) or []:
            if rr.display_name == name:
                client.delete_recurring_run(rr.recurring_run_id)
                print(f"replaced recurring run {name!r} ({rr.recurring_run_id})")
    rr = client.create_recurring_run(
        experiment_id=exp.experiment_id, job_name=name, description=f"chunkgrpo {args.pipeline}, cron {cron}",
        cron_expression=cron, max_concurrency=args.max_concurrency, no_catchup=not args.catchup,
        params=params, pipeline_id=pid, version_id=vid, enabled=True, enable_caching=False,
        service_account=args.service_account or None)
    print(f"recurring run {name!r} ({rr.recurring_run_id}): {cron} [KFP's cronScheduleTimezone], "
          f"pipeline version {version!r}")
    return 0


if __name__ == "__main__":  # python -m pipeline.cli ...
    from chunkgrpo.cli import main

    sys.exit(main(["pipeline", *sys.argv[1:]]))
