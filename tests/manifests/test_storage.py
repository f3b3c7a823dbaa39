"""Storage that fits the model: every large path of a training pod (rendered ClusterTrainingRuntime and
PyTorchJob template, every overlay) and of a KFP GPU step (compiled IR) lies on a disk-backed volume
sized for it — never on /tmp or $HOME — and the GPU pools' volume holds FLUX.1-dev full fine-tuning.

The layout before (HOME=/tmp, no CHUNKGRPO_CACHE, launcher output_dir=/tmp/train, 10Gi /tmp) fails
`test_training_pods_put_large_paths_on_a_sized_volume` and `test_launcher_output_dir_is_on_the_cache_volume`.
"""

import posixpath

import pytest

from tests.manifests.render import COMPOSED, VARIANTS, all_pods, quantity, render

GiB = 2**30
# FLUX.1-dev (diffusers layout, bf16) and the chunk_grpo_flux recipe (full FT, fp32 master weights, AdamW);
# manifests/README.md "Storage layout" derives every figure.
TRANSFORMER_PARAMS = 11.90e9
MODEL = 23.8e9 + 9.52e9 + 0.25e9 + 0.17e9            # transformer + T5-XXL + CLIP-L + VAE
REWARD = 8.29e9 * 2 * 2                               # HPSv3 + the Qwen2-VL-7B base it loads, bf16
EMBEDS = 8 * 2 * 151 * 512 * 4096 * 4                 # 8 ranks × 2 prompts × 151 rollouts × T5 fp32 512×4096
FINAL = TRANSFORMER_PARAMS * 4                        # fp32 full transformer
CHECKPOINT = TRANSFORMER_PARAMS * 4 * 3               # fp32 weights + AdamW exp_avg + exp_avg_sq
KEEP = 3                                              # chunk_grpo_flux checkpoint.keep (no S3 mirror)
FLUX_FULL_FT_WORST = MODEL + REWARD + EMBEDS + FINAL + (KEEP + 1) * CHECKPOINT  # + 1 being staged
LARGE_ENV = ("CHUNKGRPO_CACHE", "HF_HOME", "XDG_CACHE_HOME", "TORCH_HOME", "TRITON_CACHE_DIR",
             "TORCHINDUCTOR_CACHE_DIR")
GPU_VARIANTS = {"prod-h800", "prod-h100", COMPOSED}


def _under(path: str, mount: str) -> bool:
    path, mount = posixpath.normpath(path), posixpath.normpath(mount)
    return path == mount or path.startswith(mount.rstrip("/") + "/")


def _volume_of(path: str, container: dict, spec: dict) -> tuple[str, dict]:
    """(mountPath, volume) of the mount holding `path` (longest mount path wins)."""
    mounts = sorted(container.get("volumeMounts", []), key=lambda m: -len(m["mountPath"]))
    m = next((m for m in mounts if _under(path, m["mountPath"])), None)
    assert m is not None, f"{path} is on no volume (the read-only root filesystem)"
    vol = next(v for v in spec["volumes"] if v["name"] == m["name"])
    return m["mountPath"], vol


def _training_pods(variant):
    for where, template in all_pods(render(variant)):
        spec = template["spec"]
        c = spec["containers"][0]
        if c["name"] in {"node", "pytorch"}:
            yield where, spec, c


def test_flux_budget_arithmetic():
    """The figures the sizes rest on: one full-FT checkpoint of FLUX.1-dev's transformer is ~133 GiB,
    the worst case of a node (keep=3 without S3 mirror) ~658 GiB."""
    assert 132 * GiB < CHECKPOINT < 134 * GiB
    assert 600 * GiB < FLUX_FULL_FT_WORST < 660 * GiB


@pytest.mark.parametrize("variant", VARIANTS)
def test_training_pods_put_large_paths_on_a_sized_volume(variant):
    pods = list(_training_pods(variant))
    assert pods, variant
    for where, spec, c in pods:
        env = {e["name"]: e.get("value") for e in c["env"]}
        home = env.get("HOME", "/tmp")
        mounts = set()
        for key in LARGE_ENV:
            assert env.get(key), f"{where}: {key} is not set (it would default under $HOME={home})"
            assert not _under(env[key], "/tmp") and not _under(env[key], home), f"{where}: {key}={env[key]}"
            mount, vol = _volume_of(env[key], c, spec)
            assert "emptyDir" in vol or "ephemeral" in vol or "persistentVolumeClaim" in vol, (where, vol)
            assert (vol.get("emptyDir") or {}).get("medium") != "Memory", f"{where}: {key} on a memory volume"
            mounts.add(mount)
        assert len(mounts) == 1, f"{where}: large paths on several volumes {mounts}"
        mount, vol = _volume_of(env["CHUNKGRPO_CACHE"], c, spec)
        size = quantity(vol["emptyDir"]["sizeLimit"]) if "emptyDir" in vol else float("inf")
        if variant in GPU_VARIANTS:  # the FLUX.1-dev pools
            need = FLUX_FULL_FT_WORST
            assert size >= need, f"{where}: {mount} {size / GiB:.0f}Gi < {need / GiB:.0f}Gi"
        disk = sum(quantity(v["emptyDir"]["sizeLimit"]) for v in spec["volumes"]
                   if "emptyDir" in v and v["emptyDir"].get("medium") != "Memory")
        res = c["resources"]
        assert quantity(res["limits"]["ephemeral-storage"]) >= disk, f"{where}: ephemeral limit < emptyDirs"
        if variant in GPU_VARIANTS:  # the scheduler reserves the disk the volumes may fill
            assert quantity(res["requests"]["ephemeral-storage"]) >= disk, where


def test_launcher_output_dir_is_on_the_cache_volume():
    """The launcher pins `output_dir` (checkpoints, text-embedding cache, final model) in the TrainJob /
    PyTorchJob args: it must be on the runtime's sized volume, not /tmp."""
    from chunkgrpo.k8s.jobspec import JobSpec

    out = JobSpec(name="j", image="i").output_dir
    for where, spec, c in _training_pods("prod-h100"):
        mount, vol = _volume_of(out, c, spec)
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert mount == _volume_of(env["CHUNKGRPO_CACHE"], c, spec)[0], (where, out)
        assert not _under(out, "/tmp"), (where, out)


@pytest.mark.parametrize("trainer", ["torchrun", "trainjob"])
def test_kfp_gpu_steps_have_a_sized_cache_volume(trainer):
    """Compiled IR (pool h100): the GPU steps mount a /cache emptyDir and point TMPDIR (the components'
    output folders), the model cache and every ~/.cache user at it; the torchrun train step's volume
    holds FLUX.1-dev full fine-tuning."""
    from google.protobuf import json_format

    from pipeline.compile import pipeline_func
    from pipeline.pod_faithful import pod_specs

    func, _ = pipeline_func("train_and_evaluate", pool="h100", trainer=trainer)
    specs = pod_specs(func)
    gpu = {"profile", "evaluate"} | ({"train"} if trainer == "torchrun" else set())
    for fn in gpu:
        s = specs[fn]
        assert set(s.volumes) == {"/cache"}, (fn, s.volumes)
        for key in (*LARGE_ENV, "TMPDIR"):
            assert _under(s.env[key], "/cache"), (fn, key, s.env.get(key))
        assert s.env["HOME"] == "/tmp"
    if trainer == "torchrun":
        assert specs["train"].volumes["/cache"] >= FLUX_FULL_FT_WORST
    assert specs["evaluate"].volumes["/cache"] >= MODEL + FINAL + REWARD
    # the memory-backed /dev/shm is not counted as disk
    platform = json_format.MessageToDict(func.platform_spec)["platforms"]["kubernetes"]
    platform = platform["deploymentSpec"]["executors"]
    assert any(m.get("medium") == "Memory" for ex in platform.values() for m in ex.get("emptyDirMounts", []))
