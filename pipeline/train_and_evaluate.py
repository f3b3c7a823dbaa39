"""The main pipeline: profile -> plan -> train -> evaluate -> register -> (gate) -> promote.

    from pipeline.train_and_evaluate import make_train_and_evaluate
    pipeline_func = make_train_and_evaluate(pool="h100", trainer="torchrun")   # or trainer="trainjob"

Compile-time choices (the IR differs, so they are not run parameters):
* `pool`: h100 | h800 | cpu - node selector, toleration, accelerator and /dev/shm of GPU steps.
* `trainer`: torchrun (single node, torchrun inside the train task) | trainjob (Kubeflow Trainer v2
  TrainJob over `num_nodes` nodes) | pytorchjob (Training Operator v1). A run-time If/Else between
  them would need `dsl.OneOf` to merge the model artifact, which kfp.local 2.17 cannot execute.

Caching and retries (set on every task; `enable_caching` at submission time overrides them):
  open_run     no cache, 3 retries  idempotent (finds its run by the kfp.run_id tag)
  profile      CACHE,    2 retries  deterministic in its inputs, expensive on FLUX.1-dev
  plan         CACHE,    2 retries  pure function of profile + strategy
  train        no cache, 1 retry    a cache hit would skip training; a retry resumes from S3 checkpoints
  launch       no cache, 2 retries  deterministic TrainJob name: a retry re-attaches
  evaluate     no cache, 1 retry
  register     no cache, 2 retries  dedupes by weights digest
  check_gate   no cache, 2 retries  reads registry state
  promote      no cache, 2 retries  idempotent, re-checks the gate
  close_run    no cache, 2 retries  exit handler
"""

from kfp import dsl

from components import check_gate, close_run, evaluate, launch_trainjob, open_run, plan, profile, promote, register, train
from components.images import RUNTIME_IMAGE
from components.k8s import POOLS, Pool, configure, on_pool, small

NAME = "chunkgrpo-train-and-evaluate"
METHODS = ("chunk", "chunk+ws", "dance", "tempflow", "granular")
DIRECTIONS = ("max", "min")
TRAINERS = ("torchrun", "trainjob", "pytorchjob")
JOB_KINDS = ("TrainJob", "PyTorchJob")
# Parameters rendered as dropdowns (KFP >= 2.17 UI): injected into the IR by pipeline.compile.
LITERALS = {"method": METHODS, "gate_direction": DIRECTIONS, "job_kind": JOB_KINDS}

_DOC_COMMON = """
    Args:
        model: Base model - a diffusers FLUX folder, an s3:// folder artifact or a hub id present in the image's HF cache.
        prompts: Training prompt file (.txt/.jsonl/.parquet), local to the image or an s3:// object.
        method: GRPO variant - chunk (Chunk-GRPO), chunk+ws (weighted chunk sampling), dance (step-level DanceGRPO), tempflow, granular.
        preset: Training preset (chunk_grpo_flux, chunk_grpo_ws_flux, dance_grpo_flux, tiny_cpu) or a YAML path in the image.
        max_steps: Optimizer steps to train.
        train_overrides: Extra training overrides as a JSON list of "key=value" strings, e.g. ["lr=5e-6", "sampling.eta=0.3"].
        chunk_strategy: Chunk planning strategy - dynamics[:max=5,last=0.5] | uniform:N | sizes:a,b,.. | step | whole.
        profile_prompts: Prompts used to profile the base model's dynamics (0 = all).
        profile_seeds: Initial-noise seeds per profiled prompt.
        device: Device for profiling - auto | cpu | cuda.
        eval_preset: Evaluation preset (eval_hpdv2, eval_tiny) or a YAML path in the image.
        eval_benchmarks: Benchmark suites as a JSON list (hpdv2, geneval, wise); [] = the preset's.
        eval_num_prompts: Evaluate only the first N prompts per benchmark (0 = the preset's setting).
        eval_overrides: Extra evaluation overrides as a JSON list of "key=value" strings.
        model_name: Registered model name in MLflow.
        gate_metric: Promotion gate metric (registry tag metric.<name>), e.g. eval.hpdv2.hpsv3.
        gate_direction: max = higher is better, min = lower is better.
        gate_margin: The candidate must beat the champion by more than this to be promoted. For a CI-bound gate
            metric (eval.<bench>.<metric>.delta_ci_low) the bound itself must exceed it: 0 = significantly
            better than the base model (docs/evaluation.md).
        experiment: MLflow experiment of the pipeline run.
        artifact_root: s3:// prefix for checkpoints, models and evaluation images (<root>/<run id>/<stage>).
"""


def _after_training(p: dict, pool: Pool, opened, planned, trained) -> None:
    """evaluate -> register -> check_gate -> If(gate) promote: shared by all trainer variants."""
    run_id = dsl.PIPELINE_JOB_ID_PLACEHOLDER
    ev = evaluate(model=trained.outputs["trained_model"], preset=p["eval_preset"], overrides=p["eval_overrides"],
                  benchmarks=p["eval_benchmarks"], num_prompts=p["eval_num_prompts"], base_model="",
                  registered_model="", alias="", artifact_root=p["artifact_root"], run_id=run_id, stage="evaluate",
                  experiment=p["experiment"], parent_run_id=opened.output)
    configure(on_pool(ev, pool, 1), display_name="evaluate", cache=False, retries=1)
    reg = register(model_name=p["model_name"], experiment=p["experiment"], run_id=run_id, parent_run_id=opened.output,
                   model=trained.outputs["trained_model"], eval_results=ev.outputs["results"],
                   plan_json=planned.outputs["plan_json"])
    configure(small(reg, "16G"), display_name="register", cache=False, retries=2)
    gate = check_gate(model_name=p["model_name"], version=reg.outputs["Output"], metric=p["gate_metric"],
                      direction=p["gate_direction"], margin=p["gate_margin"])
    configure(small(gate), display_name="promotion gate", cache=False, retries=2)
    with dsl.If(gate.output == True, name="gate-passed"):  # noqa: E712 - a KFP condition, not Python
        pr = promote(model_name=p["model_name"], version=reg.outputs["Output"], metric=p["gate_metric"],
                     direction=p["gate_direction"], margin=p["gate_margin"], who=dsl.PIPELINE_JOB_NAME_PLACEHOLDER,
                     why="passed the promotion gate in the train-and-evaluate pipeline")
        configure(small(pr), display_name="promote", cache=False, retries=2)


def _before_training(p: dict, pool: Pool):
    """open_run + profile -> plan; returns (opened, planned)."""
    opened = open_run(experiment=p["experiment"], run_name=dsl.PIPELINE_JOB_NAME_PLACEHOLDER,
                      kfp_run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER, pipeline=NAME)
    configure(small(opened), display_name="mlflow run", cache=False, retries=3, backoff="10s")
    prof = profile(model=p["model"], prompts=p["prompts"], preset=p["preset"], overrides=p["train_overrides"],
                   num_prompts=p["profile_prompts"], seeds=p["profile_seeds"], device=p["device"])
    configure(on_pool(prof, pool, 1), display_name="profile dynamics", cache=True, retries=2)
    planned = plan(profile_json=prof.outputs["profile_json"], strategy=p["chunk_strategy"])
    configure(small(planned), display_name="plan chunks", cache=True, retries=2)
    return opened, planned


def _exit_handler(experiment):
    closing = close_run(experiment=experiment, kfp_run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER)
    return configure(small(closing), display_name="close mlflow run", cache=False, retries=2, backoff="10s")


def make_train_and_evaluate(pool: str = "h100", trainer: str = "torchrun"):
    """The `train_and_evaluate` pipeline function for a GPU pool and a trainer variant."""
    if pool not in POOLS:
        raise ValueError(f"pool={pool!r} must be one of {sorted(POOLS)}")
    if trainer not in TRAINERS:
        raise ValueError(f"trainer={trainer!r} must be one of {TRAINERS}")
    gpu_pool = POOLS[pool]
    desc = (f"Chunk-GRPO fine-tuning of FLUX.1-dev: profile -> plan -> train ({trainer}, pool {pool}) -> "
            "evaluate -> register -> promote if it beats the champion.")

    if trainer == "torchrun":
        def train_and_evaluate(
            model: str = "black-forest-labs/FLUX.1-dev",
            prompts: str = "s3://chunkgrpo-data/prompts/hpdv2_train.txt",
            method: str = "chunk",
            preset: str = "chunk_grpo_flux",
            max_steps: int = 151,
            nproc_per_node: int = 8,
            train_overrides: list = [],  # noqa: B006 - KFP parameter default
            chunk_strategy: str = "dynamics",
            profile_prompts: int = 16,
            profile_seeds: int = 2,
            device: str = "auto",
            eval_preset: str = "eval_hpdv2",
            eval_benchmarks: list = [],  # noqa: B006
            eval_num_prompts: int = 0,
            eval_overrides: list = [],  # noqa: B006
            model_name: str = "chunkgrpo-flux",
            gate_metric: str = "eval.hpdv2.hpsv3",
            gate_direction: str = "max",
            gate_margin: float = 0.0,
            experiment: str = "chunkgrpo",
            artifact_root: str = "s3://chunkgrpo-checkpoints/pipeline-runs",
        ):
            p = dict(locals())
            with dsl.ExitHandler(_exit_handler(experiment), name="chunkgrpo"):
                opened, planned = _before_training(p, gpu_pool)
                tr = train(model=model, prompts=prompts, preset=preset, method=method,
                           chunks=planned.outputs["Output"], max_steps=max_steps, nproc_per_node=nproc_per_node,
                           overrides=train_overrides, artifact_root=artifact_root,
                           run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER, experiment=experiment, parent_run_id=opened.output)
                configure(on_pool(tr, gpu_pool, nproc_per_node), display_name="train (torchrun)", cache=False,
                          retries=1, backoff="120s")
                _after_training(p, gpu_pool, opened, planned, tr)

        train_and_evaluate.__doc__ = ("Train with Chunk-GRPO (torchrun inside the train step), evaluate, "
                                      "register, promote.\n" + _DOC_COMMON +
                                      "        nproc_per_node: torchrun processes = GPUs of the train step.\n")
        return dsl.pipeline(name=NAME, description=desc)(train_and_evaluate)
    else:
        default_kind = "TrainJob" if trainer == "trainjob" else "PyTorchJob"

        def train_and_evaluate(
            model: str = "black-forest-labs/FLUX.1-dev",
            prompts: str = "s3://chunkgrpo-data/prompts/hpdv2_train.txt",
            method: str = "chunk",
            preset: str = "chunk_grpo_flux",
            max_steps: int = 151,
            num_nodes: int = 2,
            nproc_per_node: int = 8,
            job_kind: str = default_kind,
            job_namespace: str = "",
            train_image: str = RUNTIME_IMAGE,
            timeout_hours: float = 48.0,
            train_overrides: list = [],  # noqa: B006
            chunk_strategy: str = "dynamics",
            profile_prompts: int = 16,
            profile_seeds: int = 2,
            device: str = "auto",
            eval_preset: str = "eval_hpdv2",
            eval_benchmarks: list = [],  # noqa: B006
            eval_num_prompts: int = 0,
            eval_overrides: list = [],  # noqa: B006
            model_name: str = "chunkgrpo-flux",
            gate_metric: str = "eval.hpdv2.hpsv3",
            gate_direction: str = "max",
            gate_margin: float = 0.0,
            experiment: str = "chunkgrpo",
            artifact_root: str = "s3://chunkgrpo-checkpoints/pipeline-runs",
        ):
            p = dict(locals())
            with dsl.ExitHandler(_exit_handler(experiment), name="chunkgrpo"):
                opened, planned = _before_training(p, gpu_pool)
                tr = launch_trainjob(
                    kind=job_kind, namespace=job_namespace, image=train_image, num_nodes=num_nodes,
                    nproc_per_node=nproc_per_node, gpus_per_node=nproc_per_node if gpu_pool.accelerator else 0,
                    node_selector=gpu_pool.node_selector, tolerations=list(gpu_pool.tolerations),
                    shm_size=gpu_pool.shm_size, model=model, prompts=prompts, preset=preset, method=method,
                    chunks=planned.outputs["Output"], max_steps=max_steps, overrides=train_overrides,
                    artifact_root=artifact_root, run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER, experiment=experiment,
                    parent_run_id=opened.output, timeout_hours=timeout_hours)
                configure(small(tr, "2G"), display_name=f"train ({default_kind} launcher)", cache=False, retries=2,
                          backoff="30s")
                _after_training(p, gpu_pool, opened, planned, tr)

        train_and_evaluate.__doc__ = (
            "Train with Chunk-GRPO on several nodes (Kubeflow Trainer TrainJob or PyTorchJob), evaluate, "
            "register, promote.\n" + _DOC_COMMON +
            "        num_nodes: Training nodes.\n"
            "        nproc_per_node: torchrun processes (= GPUs) per node.\n"
            "        job_kind: TrainJob (Kubeflow Trainer v2) or PyTorchJob (Training Operator v1).\n"
            "        job_namespace: Namespace of the training job ('' = the run's namespace).\n"
            "        train_image: Image of the training pods.\n"
            "        timeout_hours: Fail the step and delete the job after this many hours.\n")
        return dsl.pipeline(name=NAME + "-multinode", description=desc)(train_and_evaluate)


train_and_evaluate = make_train_and_evaluate()
