"""Pods that fit real nodes: the training pods of the GPU pools (rendered ClusterTrainingRuntime and
PyTorchJob template) and the compiled pipeline's GPU steps request no more CPU and memory than the pool's
documented node types (docs/node-types.md, `chunkgrpo.capacity.nodes`) leave allocatable after the kubelet
reservation and the daemonset allowance, and the large /cache volume is one the scheduler accounts for.

Before: 96 CPU on the h100 pool (an Azure ND96isr H100 v5 has 96 vCPU, 95.69 allocatable), an 820Gi
ephemeral-storage request and an unrequested 800Gi emptyDir in the KFP train step."""

from __future__ import annotations

import pytest

from chunkgrpo.capacity import nodes
from tests.manifests.render import COMPOSED, REPO, all_pods, quantity, render

POOL_OF = {"prod-h100": "h100", "prod-h800": "h800", COMPOSED: "h100"}
GiB = 2**30


def _training_containers(variant):
    for where, template in all_pods(render(variant)):
        spec = template["spec"]
        c = spec["containers"][0]
        if c["name"] in {"node", "pytorch"}:
            yield where, spec, c


def test_reservation_formula_matches_the_published_examples():
    """The tiers: a 4-core node reserves 80 millicores (6 % + 1 % + 2 × 0.5 %), a 96-vCPU node 0.31 cores;
    16 GiB of memory reserves 2.6 GiB (1 + 0.8 + 0.8), 256 GiB adds 6 % of 112 and 2 % of 128 GiB."""
    assert nodes.reserved_cpu(4) == pytest.approx(0.08)
    assert nodes.reserved_cpu(96) == pytest.approx(0.31)
    assert nodes.reserved_memory(16 * GiB) == pytest.approx(2.6 * GiB, rel=1e-6)
    assert nodes.reserved_memory(256 * GiB) == pytest.approx((1 + 0.8 + 0.8 + 6.72 + 2.56) * GiB, rel=1e-6)
    azure = nodes.NODE_TYPES["Standard_ND96isr_H100_v5"]
    assert 95 < azure.allocatable_cpu < 96  # a 96-CPU request cannot fit


@pytest.mark.parametrize("pool", ["h100", "h800", "gpu"])
def test_pool_requests_fit_every_node_type_of_the_pool(pool):
    r = nodes.pool_requests(pool)
    for name in nodes.POOL_NODE_TYPES[pool]:
        n = nodes.NODE_TYPES[name]
        assert r.cpu <= nodes.free_cpu(n) and r.memory <= nodes.free_memory(n), (pool, name, r)
        assert r.cpu_limit <= n.allocatable_cpu and r.memory_limit <= n.allocatable_memory, (pool, name)
    assert r.cpu % 8 == 0 and r.cpu_per_gpu >= 8  # whole cores per rank, enough for its workers


@pytest.mark.parametrize("variant", sorted(POOL_OF))
def test_rendered_training_pods_fit_their_node_types(variant):
    pool = POOL_OF[variant]
    want = nodes.pool_requests(pool)
    pods = list(_training_containers(variant))
    assert pods, variant
    for where, spec, c in pods:
        req, lim = c["resources"]["requests"], c["resources"]["limits"]
        assert quantity(req["cpu"]) == want.cpu and quantity(lim["cpu"]) == want.cpu_limit, where
        assert quantity(req["memory"]) == want.memory and quantity(lim["memory"]) == want.memory_limit, where
        for name in nodes.POOL_NODE_TYPES[pool]:
            n = nodes.NODE_TYPES[name]
            assert quantity(req["cpu"]) <= nodes.free_cpu(n), (where, name)
            assert quantity(req["memory"]) <= nodes.free_memory(n), (where, name)
        cache = next(v for v in spec["volumes"] if v["name"] == "cache")
        if variant == COMPOSED:  # components/cache-emptydir: the node's disk, requested as ephemeral storage
            assert quantity(cache["emptyDir"]["sizeLimit"]) == 800 * GiB
            assert quantity(req["ephemeral-storage"]) >= 810 * GiB, where
        else:  # default: a generic ephemeral volume, and only scratch space as ephemeral storage
            claim = cache["ephemeral"]["volumeClaimTemplate"]["spec"]
            assert quantity(claim["resources"]["requests"]["storage"]) == 800 * GiB, where
            assert claim["accessModes"] == ["ReadWriteOnce"]
            assert quantity(req["ephemeral-storage"]) == want.ephemeral, where
            assert quantity(lim["ephemeral-storage"]) == want.ephemeral_limit, where


@pytest.mark.parametrize("pool", ["h100", "h800"])
def test_compiled_gpu_steps_fit_their_node_types_and_use_a_claimed_cache(monkeypatch, pool):
    from tests.pipeline.compiled import compiled

    monkeypatch.delenv("CHUNKGRPO_CACHE_VOLUME", raising=False)
    monkeypatch.setenv("CHUNKGRPO_CACHE_STORAGE_CLASS", "local-nvme")
    spec, platform = compiled("train_and_evaluate", pool=pool)
    res = spec["deploymentSpec"]["executors"]["exec-train"]["container"]["resources"]
    for name in nodes.POOL_NODE_TYPES[pool]:
        n = nodes.NODE_TYPES[name]
        assert quantity(res["resourceCpuRequest"]) <= nodes.free_cpu(n), (pool, name)
        assert quantity(res["resourceMemoryRequest"]) <= nodes.free_memory(n), (pool, name)
    assert quantity(res["resourceCpuRequest"]) == nodes.pool_requests(pool).cpu
    ex = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    for step in ("exec-train", "exec-profile", "exec-evaluate"):
        assert not any(m["mountPath"] == "/cache" for m in ex[step].get("emptyDirMounts", [])), step
        (vol,) = [v for v in ex[step]["genericEphemeralVolume"] if v["mountPath"] == "/cache"]
        assert vol["storageClassName"] == "local-nvme" and vol["accessModes"] == ["ReadWriteOnce"], step
    assert next(v for v in ex["exec-train"]["genericEphemeralVolume"])["size"] == "800Gi"


def test_the_emptydir_cache_stays_a_compile_option(tmp_path, monkeypatch):
    from pipeline.compile import compile_pipeline
    from tests.pipeline.compiled import compiled

    monkeypatch.setenv("CHUNKGRPO_CACHE_VOLUME", "emptyDir")
    _, platform = compiled("train_and_evaluate", pool="h800")
    train = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]["exec-train"]
    assert {"mountPath": "/cache", "sizeLimit": "800Gi", "volumeName": "cache"} in train["emptyDirMounts"]
    assert not train.get("genericEphemeralVolume")
    monkeypatch.setenv("CHUNKGRPO_CACHE_VOLUME", "hostPath")
    from chunkgrpo.errors import UserError

    with pytest.raises(UserError, match="CHUNKGRPO_CACHE_VOLUME='hostPath'"):
        compile_pipeline("train_and_evaluate", tmp_path / "q.yaml", pool="h800")


def test_docs_table_is_the_code_table():
    text = (REPO / "docs" / "node-types.md").read_text()
    assert nodes.markdown_table() in text
    for pool in ("h100", "h800"):
        r = nodes.pool_requests(pool)
        assert f"| {pool} | {r.cpu} |" in text, pool
