"""kfp.local's task cache in `pipeline run --local`: the compiled caching settings (profile and plan)
apply, a later run with the same inputs takes their outputs from the cache, and the cache folder's
fingerprint changes with the files behind path parameters and with the code."""

import io
import os
import time

import pytest


def _touch_later(path):
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))


def test_fingerprint_follows_the_files_behind_paths_and_the_code(tmp_path):
    from pipeline.kfp_tasks import cache_fingerprint

    code = tmp_path / "code"
    code.mkdir()
    (code / "mod.py").write_text("x = 1\n")
    model = tmp_path / "model"
    (model / "transformer").mkdir(parents=True)
    (model / "transformer" / "config.json").write_text("{}")
    meta = tmp_path / "heldout.jsonl"
    meta.write_text("{}\n")
    params = {"model": str(model), "eval_overrides": [f"geneval_metadata={meta}"], "max_iterations": 5}
    first = cache_fingerprint(params, code=[code])

    assert cache_fingerprint(dict(params), code=[code]) == first
    assert cache_fingerprint({**params, "max_iterations": 6}, code=[code]) == first  # kfp's key has it
    _touch_later(model / "transformer" / "config.json")                               # a rebuilt model
    second = cache_fingerprint(params, code=[code])
    assert second != first
    (model / "transformer" / "weights.bin").write_bytes(b"0")                          # a new file
    third = cache_fingerprint(params, code=[code])
    assert third != second
    meta.write_text('{"tag": "counting"}\n')                                           # an override's file
    fourth = cache_fingerprint(params, code=[code])
    assert fourth != third
    (code / "mod.py").write_text("x = 22\n")                                           # edited code
    assert cache_fingerprint(params, code=[code]) != fourth
    # the default code roots are the two packages a task imports
    assert cache_fingerprint(params) != cache_fingerprint(params, code=[code])


def test_cached_outputs_are_read_from_kfps_cache_entry(tmp_path):
    from kfp import dsl
    from kfp.local.cache import LocalCache

    from pipeline.kfp_tasks import cached_outputs

    uri = tmp_path / "profile_json"
    uri.write_text("{}")
    art = dsl.Artifact(name="profile_json", uri=str(uri), metadata={"steps": 10})
    cache = LocalCache(str(tmp_path / "cache"))
    key = "ab" * 32
    cache.put(key, {"profile_json": art, "Output": "sizes:2,3,4"})

    out = cached_outputs(tmp_path / "cache", {"profile": key[:12], "plan": "ffffffffffff"})
    assert out == {"profile": {"artifacts": {"profile_json": {"uri": str(uri), "metadata": {"steps": 10}}},
                               "parameters": {"Output": "sizes:2,3,4"}, "cached": True}}


def test_caching_switch_sets_every_task_or_keeps_the_compiled_settings():
    from pipeline.compile import pipeline_func
    from pipeline.kfp_tasks import pipeline_tasks, set_caching

    def settings(func):
        return {n: t.caching_options.enable_cache for n, t in pipeline_tasks(func).items()}

    func, _ = pipeline_func("train_and_evaluate", pool="cpu", trainer="torchrun")
    compiled = settings(func)
    assert set_caching(func, None) == 0 and settings(func) == compiled
    assert compiled["profile"] and compiled["plan"] and not compiled["train"] and not compiled["evaluate"]
    assert set_caching(func, False) == len(compiled) and not any(settings(func).values())
    assert set_caching(func, True) == len(compiled) and all(settings(func).values())


def test_console_shows_a_cache_hit_as_one_line():
    from pipeline.task_log import ConsoleLog

    log, console = io.StringIO(), io.StringIO()
    out = ConsoleLog(log, console)
    out.write("15:00:00.000 - INFO - Task profile cache hit (key=0123456789ab); skipping execution.\n")
    assert out.cached == {"profile": "0123456789ab"} and out.took == {"profile": 0.0}
    assert console.getvalue() == "  profile: cached (an earlier run's outputs, same inputs)\n"


# the integration test (a second pipeline run in the same home) is in test_local_branching.py: it reruns
# one of that file's runs instead of making two more


@pytest.mark.integration
def test_a_local_model_goes_to_s3_once_per_content(services_env, tiny_model_dir):
    """`--pod-faithful` uploads the local model for its pods: the same files twice are one upload under one
    name (the name once held the manifest's creation time: every run uploaded it again)."""
    from chunkgrpo.store.client import ArtifactStore
    from pipeline.demos import model_to_s3

    first = model_to_s3(tiny_model_dir, services_env.env)
    created = ArtifactStore().read_manifest(first).created
    time.sleep(1.1)  # the manifest's creation time has a resolution of one second
    assert model_to_s3(tiny_model_dir, services_env.env) == first
    assert ArtifactStore().read_manifest(first).created == created  # not uploaded again
