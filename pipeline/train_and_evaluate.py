"""The main pipeline: profile -> plan -> train -> evaluate -> register -> (gate) -> promote.

    from pipeline.train_and_evaluate import make_train_and_evaluate
    pipeline_func = make_train_and_evaluate(pool="h100", trainer="torchrun")   # or trainer="trainjob"

Each variant is a pipeline function written out with its parameters (names, types, defaults and their help
in the Args, which the KFP UI shows); the steps before and after training are shared helpers.

Compile-time choices (the IR differs, so they are not run parameters):
* `pool`: h100 | h800 | gpu (any GPU node) | cpu - node selector, toleration, accelerator and /dev/shm of
  GPU steps. There is deliberately no GPU default: `chunkgrpo pipeline compile` needs `--pool` (or
  $CHUNKGRPO_GPU_POOL), so an H800 cluster never gets pods pinned to H100 nodes.
* `trainer`: torchrun (single node, torchrun inside the train task) | trainjob (Kubeflow Trainer v2
  TrainJob over `num_nodes` nodes) | pytorchjob (Training Operator v1). A run-time If/Else between
  them would need `dsl.OneOf` to merge the model artifact, which kfp.local 2.17 cannot execute.

Caching and retries (set on every task; `enable_caching` at submission time overrides them):
  preflight    no cache, 0 retries  seconds: model, prompts, weights, S3, MLflow, judge key, the training
                                    rewards in the runtime image; one line on failure
  eval_preflight no cache, 0 retries  seconds, on the eval image: its scorers' packages and files, peft
  open_run     no cache, 3 retries  idempotent (finds its run by the kfp.run_id tag)
  profile      CACHE,    2 retries  deterministic in its inputs, expensive on FLUX.1-dev
  plan         CACHE,    2 retries  pure function of profile + chunks
  train        no cache, 1 retry    a cache hit would skip training; a retry resumes from S3 checkpoints
  launch       no cache, 2 retries  deterministic TrainJob name: a retry re-attaches
  evaluate     no cache, 1 retry
  register     no cache, 2 retries  dedupes by weights digest
  check_gate   no cache, 2 retries  reads registry state
  promote      no cache, 2 retries  idempotent, re-checks the gate
  close_run    no cache, 2 retries  exit handler; multi-node: also deletes the run's still-active jobs

Nothing is downloaded from a hub during a run: `model`, `reward_weights` and `scorer_weights` point
at the S3 model cache that `chunkgrpo models sync` (or the `models_sync` pipeline) fills once.
"""

from kfp import dsl

from chunkgrpo.model_cache import BASE_MODEL, default_weights, model_uri
from chunkgrpo.recipes import METHOD_NAMES
from chunkgrpo.scoring.service import TOKEN_ENV
from chunkgrpo.stages.models import DEFAULT_TRAIN_PROMPTS
from components import (
    check_gate,
    close_run,
    eval_preflight,
    evaluate,
    launch_trainjob,
    open_run,
    plan,
    preflight,
    profile,
    promote,
    register,
    train,
)
from components.images import RUNTIME_IMAGE
from components.k8s import POOLS, Pool, configure, on_pool, pull_secrets, small, with_judge

# The reward server's bearer token (manifests/components/reward-server); optional: a run without
# `reward_url` needs none, and preflight names the server when it refuses a missing token.
REWARD_SECRET = "chunkgrpo-reward"

NAME = "chunkgrpo-train-and-evaluate"
DEFAULT_MODEL = model_uri(BASE_MODEL)                      # s3://chunkgrpo-data/models/black-forest-labs/FLUX.1-dev
DEFAULT_SCORER_WEIGHTS = default_weights()  # hpsv3 (+ Qwen2-VL processor), imagereward (+ BERT tokenizer)
DEFAULT_REWARD_WEIGHTS = {k: v for k, v in DEFAULT_SCORER_WEIGHTS.items() if k.startswith("hpsv3")}
DIRECTIONS = ("max", "min")
TRAINERS = ("torchrun", "trainjob", "pytorchjob")
JOB_KINDS = ("TrainJob", "PyTorchJob")
# Parameters rendered as dropdowns (KFP >= 2.17 UI): injected into the IR by pipeline.compile.
LITERALS = {"method": METHOD_NAMES, "gate_direction": DIRECTIONS, "job_kind": JOB_KINDS}


def with_reward_token(task):
    """$CHUNKGRPO_REWARD_TOKEN from the optional Secret chunkgrpo-reward, for the steps calling the server."""
    from kfp import kubernetes

    kubernetes.use_secret_as_env(task, secret_name=REWARD_SECRET, secret_key_to_env={TOKEN_ENV: TOKEN_ENV},
                                 optional=True)
    return task


def _after_training(p: dict, pool: Pool, opened, planned, trained) -> None:
    """evaluate -> register -> check_gate -> If(gate) promote: shared by all trainer variants."""
    run_id = dsl.PIPELINE_JOB_ID_PLACEHOLDER
    ev = evaluate(model=trained.outputs["trained_model"], preset=p["eval_preset"],
                  overrides=p["eval_overrides"], benchmarks=p["eval_benchmarks"],
                  num_prompts=p["eval_num_prompts"], base_model="", registered_model="", alias="",
                  artifact_root=p["artifact_root"], run_id=run_id, stage="evaluate",
                  experiment=p["experiment"], parent_run_id=opened.output, scorer_weights=p["scorer_weights"])
    with_judge(configure(on_pool(ev, pool, 1), display_name="evaluate", cache=False, retries=1))
    reg = register(model_name=p["model_name"], experiment=p["experiment"], run_id=run_id,
                   parent_run_id=opened.output, model=trained.outputs["trained_model"],
                   eval_results=ev.outputs["results"], plan_json=planned.outputs["plan_json"],
                   gate_metric=p["gate_metric"], gate_direction=p["gate_direction"],
                   eval_preset=p["eval_preset"])
    configure(small(reg, "16G"), display_name="register", cache=False, retries=2)
    gate = check_gate(model_name=p["model_name"], version=reg.outputs["Output"], metric=p["gate_metric"],
                      margin=p["gate_margin"])
    configure(small(gate), display_name="promotion gate", cache=False, retries=2)
    with dsl.If(gate.output == True, name="gate-passed"):  # noqa: E712 - a KFP condition, not Python
        pr = promote(model_name=p["model_name"], version=reg.outputs["Output"], metric=p["gate_metric"],
                     margin=p["gate_margin"], who=dsl.PIPELINE_JOB_NAME_PLACEHOLDER,
                     why="passed the promotion gate in the train-and-evaluate pipeline")
        configure(small(pr), display_name="promote", cache=False, retries=2)


def _before_training(p: dict, pool: Pool):
    """preflight and eval_preflight, then open_run + profile -> plan; returns (opened, planned)."""
    pre = preflight(model=p["model"], prompts=p["prompts"], preset=p["preset"],
                    train_overrides=p["train_overrides"], reward_weights=p["reward_weights"],
                    scorer_weights=p["scorer_weights"],
                    eval_preset=p["eval_preset"], eval_benchmarks=p["eval_benchmarks"],
                    eval_overrides=p["eval_overrides"], artifact_root=p["artifact_root"], method=p["method"],
                    pool=pool.name, reward_url=p["reward_url"], chunks=p["chunks"],
                    nodes=p.get("num_nodes", 1), max_iterations=p["max_iterations"])
    with_reward_token(with_judge(configure(small(pre, "4G"), display_name="preflight", cache=False,
                                           retries=0)))
    # the evaluation image builds the scorers and loads the trained model: known before training starts
    ev_pre = eval_preflight(eval_preset=p["eval_preset"], eval_benchmarks=p["eval_benchmarks"],
                            eval_overrides=p["eval_overrides"], scorer_weights=p["scorer_weights"],
                            preset=p["preset"], method=p["method"], train_overrides=p["train_overrides"])
    configure(small(ev_pre, "2G"), display_name="preflight (eval image)", cache=False, retries=0)
    opened = open_run(experiment=p["experiment"], run_name=dsl.PIPELINE_JOB_NAME_PLACEHOLDER,
                      kfp_run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER, pipeline=NAME)
    configure(small(opened), display_name="mlflow run", cache=False, retries=3, backoff="10s")
    opened.after(pre, ev_pre)
    prof = profile(model=p["model"], prompts=p["prompts"], preset=p["preset"], overrides=p["train_overrides"],
                   num_prompts=p["profile_prompts"], seeds=p["profile_seeds"], device=p["device"],
                   method=p["method"])
    configure(on_pool(prof, pool, 1), display_name="profile dynamics", cache=True, retries=2)
    prof.after(pre, ev_pre)
    planned = plan(profile_json=prof.outputs["profile_json"], chunks=p["chunks"])
    configure(small(planned), display_name="plan chunks", cache=True, retries=2)
    return opened, planned


def _exit_handler(experiment, cleanup_jobs: bool = False, job_namespace=""):
    closing = close_run(experiment=experiment, kfp_run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER,
                        cleanup_jobs=cleanup_jobs, job_namespace=job_namespace)
    name = "clean up jobs, close mlflow run" if cleanup_jobs else "close mlflow run"
    return configure(small(closing), display_name=name, cache=False, retries=2, backoff="10s")


def make_train_and_evaluate(pool: str = "cpu", trainer: str = "torchrun"):
    """The `train_and_evaluate` pipeline function for a GPU pool and a trainer variant."""
    if pool not in POOLS:
        raise ValueError(f"pool={pool!r} must be one of {sorted(POOLS)}")
    if trainer not in TRAINERS:
        raise ValueError(f"trainer={trainer!r} must be one of {TRAINERS}")
    gpu_pool = POOLS[pool]
    desc = (f"Chunk-GRPO fine-tuning of FLUX.1-dev: profile -> plan -> train ({trainer}, pool {pool}) -> "
            "evaluate -> register -> promote if it beats the champion.")
    if trainer == "torchrun":
        return dsl.pipeline(name=NAME, description=desc)(_torchrun_pipeline(gpu_pool))
    default_kind = "TrainJob" if trainer == "trainjob" else "PyTorchJob"
    fn = _multinode_pipeline(gpu_pool, default_kind)
    return dsl.pipeline(name=NAME + "-multinode", description=desc)(fn)


def _torchrun_pipeline(gpu_pool: Pool):
    """The single-node variant: torchrun inside the train task on `gpu_pool`."""

    def train_and_evaluate(
        model: str = DEFAULT_MODEL,
        prompts: str = DEFAULT_TRAIN_PROMPTS,
        method: str = "chunk",
        preset: str = "",
        max_iterations: int = 0,
        nproc_per_node: int = 8,
        reward_weights: dict = DEFAULT_REWARD_WEIGHTS,
        scorer_weights: dict = DEFAULT_SCORER_WEIGHTS,
        train_overrides: list = [],
        reward_url: str = "",
        chunks: str = "dynamics",
        profile_prompts: int = 16,
        profile_seeds: int = 2,
        device: str = "auto",
        eval_preset: str = "eval_hpdv2",
        eval_benchmarks: list = [],
        eval_num_prompts: int = 0,
        eval_overrides: list = [],
        model_name: str = "chunkgrpo-flux",
        gate_metric: str = "eval.hpdv2.hpsv3",
        gate_direction: str = "max",
        gate_margin: float = 0.0,
        experiment: str = "chunkgrpo",
        artifact_root: str = "s3://chunkgrpo-checkpoints/pipeline-runs",
    ):
        """Train with Chunk-GRPO (torchrun inside the train step), evaluate, register, promote.

        Args:
            model: Base model - an s3:// folder artifact of the model cache (`chunkgrpo models sync`), a
                folder in the image or on the model PVC (/models/...), or a hub id present in the image's HF
                cache; never downloaded during a run.
            prompts: Training prompt file (.txt/.jsonl/.tsv/.parquet), local to the image or an s3://
                object; the default is the PartiPrompts set `chunkgrpo models sync --defaults` uploads.
            method: GRPO variant - chunk (Chunk-GRPO), chunk+ws (weighted chunk sampling), dance (step-level
                DanceGRPO), tempflow, granular.
            preset: Training preset or a YAML path in the image; '' = the method's own published recipe
                (chunk_grpo_flux, chunk_grpo_ws_flux, step_grpo_flux = the paper's step-level baseline,
                tempflow_grpo_flux, granular_grpo_flux). Others: dance_grpo_flux (DanceGRPO's own), tiny_cpu,
                tempflow_grpo_tiny_cpu, granular_grpo_tiny_cpu.
            max_iterations: Training length in ROLLOUTS (iterations, the papers' "training steps"); each
                rollout makes the method's optimizer steps (2 for the chunk presets: 151 rollouts = 302
                optimizer steps). 0 = the preset's length.
            nproc_per_node: torchrun processes = GPUs of the train step.
            reward_weights: Weights of the training rewards as a JSON object {reward: URI,
                "<reward>.processor": URI}, e.g. {"hpsv3": "s3://.../MizzenAI/HPSv3", "hpsv3.processor":
                "s3://.../Qwen/Qwen2-VL-7B-Instruct"}; rewards the preset does not use are ignored.
            scorer_weights: Weights of the evaluation scorers as a JSON object {scorer: URI,
                "<scorer>.processor": URI} (hpsv3, imagereward, hpsv2.1, pickscore, clip).
            train_overrides: Extra training overrides as a JSON list of "key=value" strings, e.g. ["lr=5e-6",
                "sampling.eta=0.3"].
            reward_url: A reward server (`chunkgrpo reward-server`, manifests/components/reward-server) that
                scores every training reward without a url of its own, e.g. http://reward-server:8000; '' =
                the rewards as configured. Preflight checks it before any GPU time; its token is the
                Secret chunkgrpo-reward's CHUNKGRPO_REWARD_TOKEN.
            chunks: Chunk plan - dynamics[:max=5,last=0.5] | uniform:N | sizes:a,b,.. | step | whole.
            profile_prompts: Prompts used to profile the base model's dynamics (0 = all).
            profile_seeds: Initial-noise seeds per profiled prompt.
            device: Device for profiling - auto | cpu | cuda.
            eval_preset: Evaluation preset (eval_hpdv2, eval_toy, eval_tiny) or a YAML path in the image.
            eval_benchmarks: Benchmark suites as a JSON list (hpdv2, geneval, wise); [] = the preset's.
            eval_num_prompts: Evaluate only the first N prompts per benchmark (0 = the preset's setting).
            eval_overrides: Extra evaluation overrides as a JSON list of "key=value" strings.
            model_name: Registered model name in MLflow.
            gate_metric: Promotion gate metric (registry tag metric.<name>), e.g. eval.hpdv2.hpsv3; must be
                the registered model's gate.metric once it exists, or its CI bound
                (eval.<bench>.<metric>.delta_ci_low).
            gate_direction: Direction of gate_metric for a NEW registered model only (max = higher is better);
                an existing model keeps the direction it was registered with.
            gate_margin: The candidate must beat the champion by more than this to be promoted. For a CI-bound
                gate metric (eval.<bench>.<metric>.delta_ci_low) the bound itself must exceed it: 0 =
                significantly better than the base model (docs/evaluation.md).
            experiment: MLflow experiment of the pipeline run.
            artifact_root: s3:// prefix for checkpoints, models and evaluation images (<root>/<run
                id>/<stage>).
        """
        p = dict(locals())  # the run parameters by name, for the steps shared with the multi-node variant
        with dsl.ExitHandler(_exit_handler(experiment), name="chunkgrpo"):
            opened, planned = _before_training(p, gpu_pool)
            tr = train(model=model, prompts=prompts, preset=preset, method=method,
                       chunks=planned.outputs["Output"], max_iterations=max_iterations,
                       nproc_per_node=nproc_per_node, overrides=train_overrides, artifact_root=artifact_root,
                       run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER, experiment=experiment,
                       parent_run_id=opened.output, reward_weights=reward_weights, reward_url=reward_url)
            on_pool(tr, gpu_pool, nproc_per_node, cache_size=gpu_pool.train_cache_size)
            with_reward_token(configure(tr, display_name="train (torchrun)", cache=False, retries=1,
                                        backoff="120s"))
            _after_training(p, gpu_pool, opened, planned, tr)

    return train_and_evaluate


def _multinode_pipeline(gpu_pool: Pool, default_kind: str):
    """The multi-node variant: a launcher step runs a TrainJob / PyTorchJob (`default_kind`)."""

    def train_and_evaluate(
        model: str = DEFAULT_MODEL,
        prompts: str = DEFAULT_TRAIN_PROMPTS,
        method: str = "chunk",
        preset: str = "",
        max_iterations: int = 0,
        num_nodes: int = 2,
        nproc_per_node: int = 8,
        job_kind: str = default_kind,
        job_namespace: str = "",
        train_image: str = RUNTIME_IMAGE,
        timeout_hours: float = 48.0,
        queue_name: str = "",
        reward_weights: dict = DEFAULT_REWARD_WEIGHTS,
        scorer_weights: dict = DEFAULT_SCORER_WEIGHTS,
        train_overrides: list = [],
        reward_url: str = "",
        chunks: str = "dynamics",
        profile_prompts: int = 16,
        profile_seeds: int = 2,
        device: str = "auto",
        eval_preset: str = "eval_hpdv2",
        eval_benchmarks: list = [],
        eval_num_prompts: int = 0,
        eval_overrides: list = [],
        model_name: str = "chunkgrpo-flux",
        gate_metric: str = "eval.hpdv2.hpsv3",
        gate_direction: str = "max",
        gate_margin: float = 0.0,
        experiment: str = "chunkgrpo",
        artifact_root: str = "s3://chunkgrpo-checkpoints/pipeline-runs",
    ):
        """Train with Chunk-GRPO on several nodes (Kubeflow Trainer TrainJob or PyTorchJob), evaluate,
        register, promote.

        Args:
            model: Base model - an s3:// folder artifact of the model cache (`chunkgrpo models sync`), a
                folder in the image or on the model PVC (/models/...), or a hub id present in the image's HF
                cache; never downloaded during a run.
            prompts: Training prompt file (.txt/.jsonl/.tsv/.parquet), local to the image or an s3://
                object; the default is the PartiPrompts set `chunkgrpo models sync --defaults` uploads.
            method: GRPO variant - chunk (Chunk-GRPO), chunk+ws (weighted chunk sampling), dance (step-level
                DanceGRPO), tempflow, granular.
            preset: Training preset or a YAML path in the image; '' = the method's own published recipe
                (chunk_grpo_flux, chunk_grpo_ws_flux, step_grpo_flux = the paper's step-level baseline,
                tempflow_grpo_flux, granular_grpo_flux). Others: dance_grpo_flux (DanceGRPO's own), tiny_cpu,
                tempflow_grpo_tiny_cpu, granular_grpo_tiny_cpu.
            max_iterations: Training length in ROLLOUTS (iterations, the papers' "training steps"); each
                rollout makes the method's optimizer steps (2 for the chunk presets: 151 rollouts = 302
                optimizer steps). 0 = the preset's length.
            num_nodes: Training nodes.
            nproc_per_node: torchrun processes (= GPUs) per node.
            job_kind: TrainJob (Kubeflow Trainer v2) or PyTorchJob (Training Operator v1).
            job_namespace: Namespace of the training job ('' = the run's namespace).
            train_image: Image of the training pods.
            timeout_hours: Fail the step and delete the job after this many hours.
            queue_name: Kueue LocalQueue of the training job ('' = no Kueue): created suspended, admitted by
                Kueue.
            reward_weights: Weights of the training rewards as a JSON object {reward: URI,
                "<reward>.processor": URI}, e.g. {"hpsv3": "s3://.../MizzenAI/HPSv3", "hpsv3.processor":
                "s3://.../Qwen/Qwen2-VL-7B-Instruct"}; rewards the preset does not use are ignored.
            scorer_weights: Weights of the evaluation scorers as a JSON object {scorer: URI,
                "<scorer>.processor": URI} (hpsv3, imagereward, hpsv2.1, pickscore, clip).
            train_overrides: Extra training overrides as a JSON list of "key=value" strings, e.g. ["lr=5e-6",
                "sampling.eta=0.3"].
            reward_url: A reward server (`chunkgrpo reward-server`, manifests/components/reward-server) that
                scores every training reward without a url of its own, e.g. http://reward-server:8000; '' =
                the rewards as configured. Preflight checks it before any GPU time; its token is the
                Secret chunkgrpo-reward's CHUNKGRPO_REWARD_TOKEN.
            chunks: Chunk plan - dynamics[:max=5,last=0.5] | uniform:N | sizes:a,b,.. | step | whole.
            profile_prompts: Prompts used to profile the base model's dynamics (0 = all).
            profile_seeds: Initial-noise seeds per profiled prompt.
            device: Device for profiling - auto | cpu | cuda.
            eval_preset: Evaluation preset (eval_hpdv2, eval_toy, eval_tiny) or a YAML path in the image.
            eval_benchmarks: Benchmark suites as a JSON list (hpdv2, geneval, wise); [] = the preset's.
            eval_num_prompts: Evaluate only the first N prompts per benchmark (0 = the preset's setting).
            eval_overrides: Extra evaluation overrides as a JSON list of "key=value" strings.
            model_name: Registered model name in MLflow.
            gate_metric: Promotion gate metric (registry tag metric.<name>), e.g. eval.hpdv2.hpsv3; must be
                the registered model's gate.metric once it exists, or its CI bound
                (eval.<bench>.<metric>.delta_ci_low).
            gate_direction: Direction of gate_metric for a NEW registered model only (max = higher is better);
                an existing model keeps the direction it was registered with.
            gate_margin: The candidate must beat the champion by more than this to be promoted. For a CI-bound
                gate metric (eval.<bench>.<metric>.delta_ci_low) the bound itself must exceed it: 0 =
                significantly better than the base model (docs/evaluation.md).
            experiment: MLflow experiment of the pipeline run.
            artifact_root: s3:// prefix for checkpoints, models and evaluation images (<root>/<run
                id>/<stage>).
        """
        p = dict(locals())  # the run parameters by name, for the steps shared with the torchrun variant
        closing = _exit_handler(experiment, cleanup_jobs=True, job_namespace=job_namespace)
        with dsl.ExitHandler(closing, name="chunkgrpo"):
            opened, planned = _before_training(p, gpu_pool)
            # GPUs, RDMA devices, CPU/memory and /dev/shm are the runtime's (the overlay's pool):
            # gpus_per_node=0 and shm_size='' keep them; the pod placement is the runtime's too.
            tr = launch_trainjob(
                kind=job_kind, namespace=job_namespace, image=train_image, num_nodes=num_nodes,
                nproc_per_node=nproc_per_node, gpus_per_node=0, node_selector={}, tolerations=[], shm_size="",
                model=model, prompts=prompts, preset=preset, method=method, chunks=planned.outputs["Output"],
                max_iterations=max_iterations, overrides=train_overrides, artifact_root=artifact_root,
                run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER, experiment=experiment, parent_run_id=opened.output,
                timeout_hours=timeout_hours, queue_name=queue_name, image_pull_secrets=pull_secrets(),
                reward_weights=reward_weights, reward_url=reward_url)
            configure(small(tr, "2G"), display_name=f"train ({default_kind} launcher)", cache=False,
                      retries=2, backoff="30s")
            _after_training(p, gpu_pool, opened, planned, tr)

    return train_and_evaluate


train_and_evaluate = make_train_and_evaluate()  # the CPU variant (kfp.local); clusters compile with --pool
