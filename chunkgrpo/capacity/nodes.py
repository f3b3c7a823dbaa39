"""The common 8-GPU node types and what a training pod may request on them (docs/node-types.md).

A pod is only scheduled where its requests fit the node's *allocatable* resources: capacity minus what the
kubelet reserves for the system (`kube-reserved`/`system-reserved`) and the hard-eviction threshold. This
module holds the published sizes of the node types the GPU pools target, the reservation formula used to
estimate allocatable CPU and memory, and the pool requests derived from them; the manifests
(components/gpu-h100, components/gpu-h800) and the compiled pipeline's train step carry these numbers, and
tests/manifests checks them against this table.

Reservation (GKE's published formula; EKS's AMIs use the same CPU formula, and their memory formula
255 MiB + 11 MiB × max pods is smaller on these nodes):

* CPU: 6 % of the first core, 1 % of the second, 0.5 % of cores 3-4, 0.25 % of every core above 4;
* memory: 25 % of the first 4 GiB, 20 % of the next 4, 10 % of the next 8, 6 % of the next 112, 2 % of
  everything above 128 GiB; plus the 100 MiB hard-eviction threshold.

On top of that a GPU node runs daemonsets (CNI, kube-proxy, the GPU operator's device plugin, GFD and DCGM
exporter, node exporter, the network operator): :data:`DAEMONSET_CPU` and :data:`DAEMONSET_MEMORY` are the
allowance kept free for them.
"""

from __future__ import annotations

import dataclasses
import math

GiB = 2**30
DAEMONSET_CPU = 2.0          # cores kept free for the node's daemonsets
DAEMONSET_MEMORY = 16 * GiB  # bytes kept free for the node's daemonsets
EVICTION_MEMORY = 100 * 2**20

# What the training pod would like per GPU (rollout workers, reward worker, VAE decode, data loading); the
# request is this, capped to what the smallest node type of the pool can give.
WANT_CPU_PER_GPU = 12
WANT_MEMORY_PER_GPU = 120 * GiB
MEMORY_LIMIT = 1200 * GiB    # the pod's memory limit (the /dev/shm tmpfs counts against it)
SCRATCH_REQUEST = 20 * GiB   # ephemeral storage besides /cache: /tmp (10Gi), logs, the writable layer
SCRATCH_LIMIT = 40 * GiB


@dataclasses.dataclass(frozen=True)
class NodeType:
    name: str            # the provider's name of the size
    provider: str
    gpus: int
    gpu: str             # GPU model
    gpu_product: str     # nvidia.com/gpu.product (GPU Feature Discovery)
    vcpu: int
    memory_gib: int
    local_nvme: str      # local NVMe as published (not the boot disk the kubelet may live on)

    @property
    def memory(self) -> int:
        return self.memory_gib * GiB

    @property
    def allocatable_cpu(self) -> float:
        return self.vcpu - reserved_cpu(self.vcpu)

    @property
    def allocatable_memory(self) -> int:
        return self.memory - reserved_memory(self.memory) - EVICTION_MEMORY


def reserved_cpu(cores: float) -> float:
    """Cores the kubelet reserves on a node with `cores` (GKE's formula)."""
    tiers = [(1, 0.06), (1, 0.01), (2, 0.005), (math.inf, 0.0025)]
    left, total = cores, 0.0
    for size, rate in tiers:
        part = min(left, size)
        total += part * rate
        left -= part
        if left <= 0:
            break
    return total


def reserved_memory(nbytes: int) -> int:
    """Bytes the kubelet reserves on a node with `nbytes` of memory (GKE's formula, without eviction)."""
    tiers = [(4 * GiB, 0.25), (4 * GiB, 0.20), (8 * GiB, 0.10), (112 * GiB, 0.06), (math.inf, 0.02)]
    left, total = float(nbytes), 0.0
    for size, rate in tiers:
        part = min(left, size)
        total += part * rate
        left -= part
        if left <= 0:
            break
    return int(total)


# Published sizes (the providers' instance/VM size pages; the H800 node is a typical HGX H800 server with
# two 48-core Xeon Platinum 8468, 2 TiB of memory and four 3.84 TB NVMe drives).
NODE_TYPES: dict[str, NodeType] = {n.name: n for n in (
    NodeType("p5.48xlarge", "AWS", 8, "H100 80GB", "NVIDIA-H100-80GB-HBM3", 192, 2048, "8 x 3.84 TB"),
    NodeType("p4d.24xlarge", "AWS", 8, "A100 40GB", "NVIDIA-A100-SXM4-40GB", 96, 1152, "8 x 1 TB"),
    NodeType("Standard_ND96isr_H100_v5", "Azure", 8, "H100 80GB", "NVIDIA-H100-80GB-HBM3", 96, 1900,
             "8 x 3.5 TB (+ 1000 GiB temp disk)"),
    NodeType("a3-highgpu-8g", "GCP", 8, "H100 80GB", "NVIDIA-H100-80GB-HBM3", 208, 1872, "16 x 375 GiB"),
    NodeType("HGX H800 server", "bare metal", 8, "H800 80GB", "NVIDIA-H800", 192, 2048, "4 x 3.84 TB"),
)}

# The node types each GPU pool (manifests/overlays/prod-<pool>, the pipeline's --pool) must fit.
POOL_NODE_TYPES: dict[str, tuple[str, ...]] = {
    "h100": ("p5.48xlarge", "Standard_ND96isr_H100_v5", "a3-highgpu-8g"),
    "h800": ("HGX H800 server",),
    "gpu": tuple(NODE_TYPES),  # any 8-GPU node
}


@dataclasses.dataclass(frozen=True)
class PodRequests:
    """CPU (cores) and memory/ephemeral storage (bytes) of one training pod of a pool."""

    cpu: int
    cpu_limit: int
    memory: int
    memory_limit: int
    ephemeral: int = SCRATCH_REQUEST
    ephemeral_limit: int = SCRATCH_LIMIT

    @property
    def cpu_per_gpu(self) -> int:
        return self.cpu // 8

    @property
    def memory_per_gpu_gib(self) -> int:
        return self.memory // 8 // GiB


def free_cpu(node: NodeType) -> float:
    """Cores a pod may request on `node`: allocatable minus the daemonset allowance."""
    return node.allocatable_cpu - DAEMONSET_CPU


def free_memory(node: NodeType) -> int:
    return node.allocatable_memory - DAEMONSET_MEMORY


def pool_requests(pool: str, gpus: int = 8) -> PodRequests:
    """The requests of one `gpus`-GPU training pod of `pool`: what the recipe wants per GPU, capped to the
    smallest node type of the pool (allocatable after the kubelet reservation, minus the daemonset
    allowance), in whole cores and whole GiB per GPU."""
    nodes = [NODE_TYPES[n] for n in POOL_NODE_TYPES[pool]]
    cpu_per_gpu = min(WANT_CPU_PER_GPU, min(math.floor(free_cpu(n) / gpus) for n in nodes))
    mem_per_gpu = min(WANT_MEMORY_PER_GPU, min(free_memory(n) // gpus // GiB * GiB for n in nodes))
    cpu_limit = min(math.floor(n.allocatable_cpu) for n in nodes)
    memory_limit = min(MEMORY_LIMIT, min(n.allocatable_memory // GiB * GiB for n in nodes))
    return PodRequests(cpu=cpu_per_gpu * gpus, cpu_limit=cpu_limit, memory=mem_per_gpu * gpus,
                       memory_limit=memory_limit)


def markdown_table() -> str:
    """docs/node-types.md's table, from :data:`NODE_TYPES`."""
    rows = ["| node type | provider | GPUs | vCPU | memory (GiB) | local NVMe | allocatable CPU | "
            "allocatable memory (GiB) | pools |",
            "|---|---|---|---|---|---|---|---|---|"]
    for n in NODE_TYPES.values():
        pools = ", ".join(p for p, names in POOL_NODE_TYPES.items() if n.name in names and p != "gpu")
        rows.append(f"| {n.name} | {n.provider} | 8 × {n.gpu} | {n.vcpu} | {n.memory_gib} | {n.local_nvme} | "
                    f"{n.allocatable_cpu:.2f} | {n.allocatable_memory / GiB:.1f} | {pools or '-'} |")
    return "\n".join(rows)
