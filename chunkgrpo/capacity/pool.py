"""The pool side of the capacity plan: one training pod of a GPU pool as the training runtime defines it
(GPUs and their memory, memory and ephemeral-storage limits, volumes and their size limits, env), read from
a runtime YAML, the repository's rendered prod overlay, or the live ClusterTrainingRuntime.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from chunkgrpo.errors import UserError
from chunkgrpo.k8s.launcher import read_runtime

# Total memory of the GPU products named by the pools' node selectors (nvidia.com/gpu.product, GPU
# Feature Discovery). 81559 MiB is what nvidia-smi reports for the 80 GB HBM3 SXM parts (H100 and H800).
GPU_MEMORY = {"NVIDIA-H800": 81559 * 2**20, "NVIDIA-H100-80GB-HBM3": 81559 * 2**20}


@dataclasses.dataclass
class Volume:
    name: str
    mount: str
    size_limit: int | None  # bytes; None = no limit
    medium: str = ""        # "Memory" = tmpfs (counts against the memory limit)


@dataclasses.dataclass
class Pool:
    """One training pod of a GPU pool, as the training runtime defines it."""

    name: str
    gpu_product: str
    gpu_memory: int
    gpus_per_node: int
    memory_limit: int | None
    ephemeral_limit: int | None
    volumes: list[Volume]
    env: dict[str, str]
    source: str

    def volume_for(self, path: str) -> Volume | None:
        best = None
        for v in self.volumes:
            m = v.mount.rstrip("/") or "/"
            if (path == m or path.startswith(m + "/")) and (best is None or len(m) > len(best.mount)):
                best = v
        return best


def _quantity(value, what: str = "quantity", source: str = "") -> int | None:
    """A Kubernetes quantity ('80Gi', '8') as an int; a malformed, negative or non-finite one is a
    UserError naming the field (a negative limit would make every plan 'fit' or never fit)."""
    if value in (None, ""):
        return None
    from kubernetes.utils import parse_quantity

    try:
        q = parse_quantity(str(value))
    except (ValueError, ArithmeticError):
        raise UserError(f"{source or 'runtime'}: {what}={value!r} is not a Kubernetes quantity") from None
    if not q.is_finite() or q < 0:
        raise UserError(f"{source or 'runtime'}: {what}={value!r} must be a non-negative quantity")
    return int(q)


def pool_from_runtime(runtime: dict, name: str = "", source: str = "") -> Pool:
    """The Pool of a ClusterTrainingRuntime object (a dict): the first replicated job's pod, its first
    container's limits, env and volume mounts, the GPU product of its node selector."""
    try:
        pod = runtime["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
        c = pod["containers"][0]
    except (KeyError, IndexError, TypeError):
        raise UserError(f"{source or 'runtime'}: not a ClusterTrainingRuntime with a pod template") from None
    limits = (c.get("resources") or {}).get("limits") or {}
    gpus = int(_quantity(limits.get("nvidia.com/gpu"), "limits.nvidia.com/gpu", source) or 0)
    product = (pod.get("nodeSelector") or {}).get("nvidia.com/gpu.product", "")
    if gpus and product not in GPU_MEMORY:
        raise UserError(f"{source or 'runtime'}: GPU product {product!r} has no known memory size "
                        f"(known: {', '.join(sorted(GPU_MEMORY))})")
    env = {e["name"]: str(e.get("value", "")) for e in c.get("env") or [] if "value" in e}
    specs = {v["name"]: v for v in pod.get("volumes") or []}
    vols = []
    for m in c.get("volumeMounts") or []:
        spec = specs.get(m["name"], {})
        ed = spec.get("emptyDir")
        size = (_quantity(ed.get("sizeLimit"), f"volume {m['name']} sizeLimit", source)
                if ed is not None else None)
        eph = (spec.get("ephemeral") or {}).get("volumeClaimTemplate", {}).get("spec", {})
        pvc = _quantity((eph.get("resources") or {}).get("requests", {}).get("storage"),
                        f"volume {m['name']} storage request", source) if eph else None
        vols.append(Volume(m["name"], m["mountPath"], size if ed is not None else pvc,
                           (ed or {}).get("medium", "") if ed is not None else ("pvc" if eph else "other")))
    return Pool(
        name=name or product or "cpu",
        gpu_product=product,
        gpu_memory=GPU_MEMORY.get(product, 0),
        gpus_per_node=gpus,
        memory_limit=_quantity(limits.get("memory"), "limits.memory", source),
        ephemeral_limit=_quantity(limits.get("ephemeral-storage"), "limits.ephemeral-storage", source),
        volumes=vols,
        env=env,
        source=source,
    )


def _runtime_doc(docs: list[dict], where: str) -> dict:
    for d in docs:
        if (
            d
            and d.get("kind") == "ClusterTrainingRuntime"
            and d.get("metadata", {}).get("name") == "chunkgrpo-torch"
        ):
            return d
    raise UserError(f"{where} has no ClusterTrainingRuntime chunkgrpo-torch")


def manifests_dir() -> Path | None:
    """The repository's manifests/ next to the package (a source checkout), else None (an installed image)."""
    d = Path(__file__).resolve().parents[2] / "manifests"
    return d if (d / "overlays").is_dir() else None


def load_pool(pool: str, runtime: str = "") -> Pool:
    """Pool `pool` (h800, h100, ...): from `runtime` (a YAML file: a rendered overlay or
    `kubectl get clustertrainingruntime chunkgrpo-torch -o yaml`), else the repository's overlay
    manifests/overlays/prod-<pool> rendered with `kubectl kustomize`, else (in a pod, no manifests) the
    live ClusterTrainingRuntime read through the Kubernetes API."""
    import yaml

    if runtime:
        p = Path(runtime)
        if not p.is_file():
            raise UserError(
                f"--runtime {runtime} does not exist (a YAML file with the ClusterTrainingRuntime)"
            )
        return pool_from_runtime(
            _runtime_doc(list(yaml.safe_load_all(p.read_text())), runtime), pool, runtime
        )
    root = manifests_dir()
    if root is not None:
        overlay = root / "overlays" / f"prod-{pool}"
        if not overlay.is_dir():
            known = sorted(d.name.removeprefix("prod-") for d in (root / "overlays").glob("prod-*"))
            raise UserError(f"--pool {pool}: no overlay {overlay} (pools: {', '.join(known)})")
        return pool_from_runtime(
            _runtime_doc(_kustomize(overlay), str(overlay)), pool, f"{overlay} (rendered)"
        )
    try:
        from kubernetes import client, config

        config.load_incluster_config()
        doc = read_runtime(client.CustomObjectsApi())
    except Exception as e:
        raise UserError(
            f"--pool {pool}: no manifests/ here and the cluster's ClusterTrainingRuntime chunkgrpo-torch "
            f"is not readable ({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}); "
            "pass --runtime FILE"
        ) from None
    return pool_from_runtime(doc, pool, "cluster: ClusterTrainingRuntime chunkgrpo-torch")


def _kustomize(overlay: Path) -> list[dict]:
    import shutil
    import subprocess
    import sys

    import yaml

    venv = Path(sys.executable).parent / "kubectl"
    kubectl = str(venv) if venv.exists() else shutil.which("kubectl")
    if not kubectl:
        raise UserError(f"rendering {overlay} needs kubectl (kustomize); or pass --runtime FILE")
    out = subprocess.run([kubectl, "kustomize", str(overlay)], capture_output=True, text=True, timeout=120)
    if out.returncode:
        raise UserError(f"kubectl kustomize {overlay} failed: {out.stderr.strip().splitlines()[-1][:200]}")
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def local_pool(gpu_memory: int = 0, memory: int | None = None) -> Pool:
    """This machine as a pool (for CPU runs and tests): no volumes, nothing limited unless given."""
    return Pool("local", "", gpu_memory, 0, memory, None, [], dict(os.environ), "this machine")
