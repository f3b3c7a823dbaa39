"""The `reward_url` run parameter: compiled into both pipeline variants, passed to preflight and the train
step with the reward server's token; and the train step's overrides it produces."""

from __future__ import annotations

import pytest
import yaml

from chunkgrpo.errors import UserError
from chunkgrpo.stages.train import TrainRequest
from pipeline.compile import compile_pipeline

URL = "http://reward-server:8000"


def _req(**kw) -> TrainRequest:
    base = dict(model="m", prompts="p.txt", preset="chunk_grpo_flux", method="chunk", chunks="sizes:4",
                max_iterations=1, artifact_root="s3://b/runs", run_id="r1",
                reward_weights={"hpsv3": "s3://b/hpsv3", "hpsv3.processor": "s3://b/qwen"})
    return TrainRequest(**{**base, **kw})


def test_reward_url_serves_every_reward_and_drops_its_weight_overrides():
    plain = _req().train_args("p.txt")
    assert "rewards.0.options.weights=s3://b/hpsv3" in plain and not any(".url=" in a for a in plain)
    served = _req(reward_url=URL + "/").train_args("p.txt")
    assert f"rewards.0.url={URL}" in served
    assert not any(a.startswith("rewards.0.options.") for a in served)  # the server holds the weights
    from chunkgrpo.train.config import TrainConfig

    cfg = TrainConfig.load("chunk_grpo_flux", [a for a in served if a.startswith("rewards")])
    assert [(r.name, r.url, r.options) for r in cfg.rewards] == [("hpsv3", URL, {})]


def test_a_reward_with_its_own_url_keeps_it():
    own = "http://other:9000"
    args = _req(overrides=["rewards=[{name: hpsv3, url: " + own + "}, {name: brightness}]"],
                reward_url=URL).train_args("p.txt")
    assert "rewards.0.url=" + URL not in args and f"rewards.1.url={URL}" in args
    assert not any(a.startswith("rewards.0.options.") for a in args)


def test_preflight_checks_each_served_reward_once():
    from chunkgrpo.stages.train import reward_servers

    assert reward_servers("chunk_grpo_flux", [], "") == []
    assert reward_servers("chunk_grpo_flux", [], URL) == [("hpsv3", URL)]
    two = ["rewards=[{name: hpsv3, url: 'http://other:9000'}, {name: brightness}]"]
    assert reward_servers("chunk_grpo_flux", two, "") == [("hpsv3", "http://other:9000")]
    assert reward_servers("chunk_grpo_flux", two, URL) == [("hpsv3", "http://other:9000"),
                                                           ("brightness", URL)]


def test_a_bad_reward_url_is_one_line():
    with pytest.raises(UserError, match="reward url 'ftp://x' must look like http://host:port"):
        _req(reward_url="ftp://x").train_args("p.txt")


@pytest.mark.parametrize("trainer,step", [("torchrun", "train"), ("trainjob", "launch-trainjob")])
def test_pipeline_has_reward_url_for_preflight_and_train(tmp_path, trainer, step):
    spec, platform = yaml.safe_load_all(
        compile_pipeline("train_and_evaluate", tmp_path / "p.yaml", pool="h100", trainer=trainer).read_text())
    params = spec["root"]["inputDefinitions"]["parameters"]
    assert params["reward_url"]["parameterType"] == "STRING" and params["reward_url"]["defaultValue"] == ""
    assert "reward server" in params["reward_url"]["description"]
    tasks = {}
    for comp in [spec["root"], *spec["components"].values()]:
        tasks.update((comp.get("dag") or {}).get("tasks") or {})
    for name in ("preflight", step):
        got = tasks[name]["inputs"]["parameters"]["reward_url"]["componentInputParameter"]
        assert got.endswith("reward_url"), name
    ex = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    execs = ["exec-preflight"] + (["exec-train"] if trainer == "torchrun" else [])
    for e in execs:
        token = [s for s in ex[e]["secretAsEnv"] if s["secretName"] == "chunkgrpo-reward"]
        assert token and token[0]["optional"], e
        assert token[0]["keyToEnv"] == [{"secretKey": "CHUNKGRPO_REWARD_TOKEN",
                                         "envVar": "CHUNKGRPO_REWARD_TOKEN"}]


def test_preflight_checks_the_server_not_the_served_weights(monkeypatch, tmp_path):
    import chunkgrpo.preflight as pf
    from chunkgrpo.stages.preflight import preflight

    seen = []

    def require(spec):
        seen.append(spec)
        raise UserError("stop here")

    monkeypatch.setattr(pf, "require", require)
    kw = dict(model="m", prompts="p.txt", preset="chunk_grpo_flux", method="chunk", train_overrides=[],
              reward_weights={"hpsv3": "s3://b/hpsv3", "hpsv3.processor": "s3://b/qwen"}, scorer_weights={},
              eval_preset="eval_hpdv2", eval_benchmarks=["geneval"], eval_overrides=[],
              artifact_root="s3://b/runs", pool="cpu", capacity_out=tmp_path / "c.md")
    for url in ("", URL):
        with pytest.raises(UserError, match="stop here"):
            preflight(**kw, reward_url=url)
    local, served = seen
    assert local.reward_servers == [] and set(local.weights) == {"reward hpsv3", "reward hpsv3.processor"}
    assert served.reward_servers == [("hpsv3", URL)] and served.weights == {}


def test_training_job_pods_get_the_token_only_when_a_reward_is_served():
    from chunkgrpo.stages.launch import JobOptions, job_spec

    job = JobOptions(image="ghcr.io/chunkgrpo/chunkgrpo-runtime:0.1.0")
    plain = job_spec(_req(run_id="a" * 32), job, "team-a").secret_env
    served = job_spec(_req(run_id="a" * 32, reward_url=URL), job, "team-a").secret_env
    assert set(plain) == {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}
    assert served == {**plain, "CHUNKGRPO_REWARD_TOKEN": ("chunkgrpo-reward", "CHUNKGRPO_REWARD_TOKEN")}
    args = job_spec(_req(run_id="a" * 32, reward_url=URL), job, "team-a").train_args
    assert f"rewards.0.url={URL}" in args
