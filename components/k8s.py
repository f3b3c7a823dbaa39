"""Kubernetes settings for pipeline tasks (kfp-kubernetes): GPU pool placement, a memory-backed
`/dev/shm`, a `/cache` volume sized for the model (with the env that points every large path at it),
and credentials/endpoints as env from the Secret/ConfigMap that manifests/base/pipeline
creates in the pipeline namespace. All of this is compiled into the IR's platform spec; `kfp.local`
ignores it (with a warning) and the local run gets the same variables from the process env;
`chunkgrpo pipeline run --local` maps `/cache` to a local folder (pipeline/pod_faithful.py), and
`--pod-faithful` runs every task with exactly the env and volumes compiled here.
"""

from __future__ import annotations

import dataclasses

from kfp import kubernetes

from chunkgrpo.capacity.nodes import pool_requests

GPU = "nvidia.com/gpu"
GPU_TAINT = {"key": GPU, "operator": "Exists", "effect": "NoSchedule"}

# manifests/base/pipeline: Secret chunkgrpo-s3 and ConfigMap chunkgrpo-env (chunkgrpo.env).
S3_SECRET = "chunkgrpo-s3"
S3_SECRET_KEYS = {"AWS_ACCESS_KEY_ID": "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY": "AWS_SECRET_ACCESS_KEY"}
MLFLOW_SECRET = "chunkgrpo-mlflow"  # the pipeline user of MLflow's basic auth (optional: auth-less MLflow)
MLFLOW_SECRET_KEYS = {"MLFLOW_TRACKING_USERNAME": "MLFLOW_TRACKING_USERNAME",
                      "MLFLOW_TRACKING_PASSWORD": "MLFLOW_TRACKING_PASSWORD"}
JUDGE_SECRET = "chunkgrpo-judge"    # WISE judge API key (optional; preflight fails fast if WISE needs it)
JUDGE_SECRET_KEYS = {"OPENAI_API_KEY": "OPENAI_API_KEY"}
HF_SECRET = "chunkgrpo-hf"          # hub token for the one-time models_sync pipeline only
HF_SECRET_KEYS = {"HF_TOKEN": "HF_TOKEN"}
# Compile-time settings (read when the pipeline is built; `chunkgrpo pipeline compile` sets them):
PULL_SECRETS_ENV = "CHUNKGRPO_IMAGE_PULL_SECRETS"   # comma-separated Secret names for private registries
MODEL_PVC_ENV = "CHUNKGRPO_MODEL_PVC"               # PVC with models, mounted read-only at /models
ENV_CONFIG_MAP = "chunkgrpo-env"
ENV_CONFIG_KEYS = (
    "CHUNKGRPO_S3_ENDPOINT",
    "AWS_DEFAULT_REGION",
    "MLFLOW_TRACKING_URI",
    "MLFLOW_S3_ENDPOINT_URL",
    "MLFLOW_DISABLE_TELEMETRY",
    "PYTHONUNBUFFERED",
    "CHUNKGRPO_PROMOTER_URL",
)  # register/promote through the promoter service (server-side gate)


@dataclasses.dataclass(frozen=True)
class Pool:
    """Where GPU steps run: GFD product label, taint toleration, /dev/shm and host sizing per GPU."""

    name: str
    product: str = ""                      # nvidia.com/gpu.product ('' = no node selector)
    accelerator: str = GPU                 # resource name ('' = CPU only)
    tolerations: tuple = (GPU_TAINT,)
    shm_size: str = "64Gi"
    cpu_per_gpu: int = 12
    memory_per_gpu_gi: int = 120
    cache_size: str = "200Gi"              # /cache of profile/evaluate: model + trained model + scorers
    train_cache_size: str = "800Gi"        # /cache of the torchrun train step (= the runtime's, README)

    @property
    def node_selector(self) -> dict[str, str]:
        return {"nvidia.com/gpu.product": self.product} if self.product else {}


POOLS = {  # CPU per GPU: what fits the pool's node types (chunkgrpo.capacity.nodes, docs/node-types.md)
    "h100": Pool("h100", product="NVIDIA-H100-80GB-HBM3", cpu_per_gpu=pool_requests("h100").cpu_per_gpu),
    "h800": Pool("h800", product="NVIDIA-H800", cpu_per_gpu=pool_requests("h800").cpu_per_gpu),
    # any NVIDIA GPU node (no product selector): single-GPU-type clusters
    "gpu": Pool("gpu", cpu_per_gpu=pool_requests("gpu").cpu_per_gpu),
    "cpu": Pool("cpu", accelerator="", tolerations=(), shm_size="2Gi", cache_size="40Gi",
                train_cache_size="40Gi"),
}
POOL_ENV = "CHUNKGRPO_GPU_POOL"  # the overlay's pool (manifests set it in the training pods too)


def pull_secrets() -> list[str]:
    import os

    return [s.strip() for s in os.environ.get(PULL_SECRETS_ENV, "").split(",") if s.strip()]


def with_shm(task, size: str = "64Gi"):
    """Memory-backed emptyDir on /dev/shm (the default 64 MiB breaks NCCL and DataLoader workers)."""
    kubernetes.empty_dir_mount(
        task, volume_name="dshm", mount_path="/dev/shm", medium="Memory", size_limit=size
    )
    return task


# Where a GPU step's large files go: an emptyDir at /cache (node-local disk, sized per step, see
# manifests/README.md "Storage layout"). TMPDIR is the volume's root (it exists on an empty volume),
# so the components' tempfile.mkdtemp outputs (training output_dir with checkpoints and text
# embeddings, evaluation images) land there too; HOME=/tmp keeps only small dotfiles.
CACHE_MOUNT = "/cache"
STEP_ENV = {"HOME": "/tmp", "TMPDIR": CACHE_MOUNT, "CHUNKGRPO_CACHE": f"{CACHE_MOUNT}/chunkgrpo",
            "HF_HOME": f"{CACHE_MOUNT}/huggingface", "XDG_CACHE_HOME": f"{CACHE_MOUNT}/xdg",
            "TORCH_HOME": f"{CACHE_MOUNT}/torch", "TRITON_CACHE_DIR": f"{CACHE_MOUNT}/triton",
            "TORCHINDUCTOR_CACHE_DIR": f"{CACHE_MOUNT}/inductor"}


def with_cache(task, size: str):
    """The /cache volume (`size`; components/cache_volume.py) and STEP_ENV pointing every large path at it."""
    from components.cache_volume import mount_cache

    mount_cache(task, size, CACHE_MOUNT)
    for key, value in STEP_ENV.items():
        task.set_env_variable(key, value)
    return task


def on_pool(task, pool: Pool, gpus, *, gpus_static: int | None = None, cache_size: str = ""):
    """GPU request + node selector + toleration + /dev/shm + CPU/memory + /cache for a GPU step.

    `gpus` may be a pipeline parameter (the accelerator count is then resolved per run);
    `gpus_static` sizes CPU/memory requests at compile time (default: 8, a full HGX node);
    `cache_size`: the /cache volume ('' = the pool's `cache_size`).
    """
    if pool.accelerator:
        task.set_accelerator_type(pool.accelerator).set_accelerator_limit(gpus)
        n = gpus_static or (gpus if isinstance(gpus, int) else 8)
        task.set_cpu_request(str(pool.cpu_per_gpu * n)).set_memory_request(f"{pool.memory_per_gpu_gi * n}G")
        task.set_memory_limit(f"{pool.memory_per_gpu_gi * n + 64}G")
    else:
        task.set_cpu_request("2").set_memory_request("8G").set_memory_limit("16G")
    for key, value in pool.node_selector.items():
        kubernetes.add_node_selector(task, label_key=key, label_value=value)
    for t in pool.tolerations:
        kubernetes.add_toleration(task, key=t["key"], operator=t["operator"], effect=t["effect"])
    with_shm(task, pool.shm_size)
    with_cache(task, cache_size or pool.cache_size)
    return task


def small(task, memory: str = "4G"):
    """A CPU-only control step (register, promote, gate, launcher)."""
    return task.set_cpu_request("500m").set_memory_request(memory).set_memory_limit(memory)


def with_credentials(task):
    """S3 keys from Secret chunkgrpo-s3, MLflow basic auth from chunkgrpo-mlflow, endpoints from
    ConfigMap chunkgrpo-env; image pull secrets and the model PVC when compiled with them."""
    import os

    kubernetes.use_secret_as_env(task, secret_name=S3_SECRET, secret_key_to_env=S3_SECRET_KEYS)
    kubernetes.use_secret_as_env(
        task, secret_name=MLFLOW_SECRET, secret_key_to_env=MLFLOW_SECRET_KEYS, optional=True
    )
    kubernetes.use_config_map_as_env(task, config_map_name=ENV_CONFIG_MAP,
                                     config_map_key_to_env={k: k for k in ENV_CONFIG_KEYS})
    if pull_secrets():
        kubernetes.set_image_pull_secrets(task, pull_secrets())
    if os.environ.get(MODEL_PVC_ENV):
        kubernetes.mount_pvc(task, pvc_name=os.environ[MODEL_PVC_ENV], mount_path="/models")
    return task


def with_judge(task):
    """The WISE judge's API key (optional Secret: runs without WISE need none; preflight checks it)."""
    kubernetes.use_secret_as_env(
        task, secret_name=JUDGE_SECRET, secret_key_to_env=JUDGE_SECRET_KEYS, optional=True
    )
    return task


def configure(task, *, display_name: str, cache: bool, retries: int, backoff: str = "60s"):
    """Caching and retries are set explicitly on every task (see pipeline/README.md for why)."""
    task.set_display_name(display_name)
    task.set_caching_options(enable_caching=cache)
    if retries:
        task.set_retry(
            num_retries=retries, backoff_duration=backoff, backoff_factor=2.0, backoff_max_duration="3600s"
        )
    return with_credentials(task)
