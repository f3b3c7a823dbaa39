"""Registry + promotion + tracking against the real MLflow server (session `services` fixture)."""

from __future__ import annotations

import json
import uuid

import pytest

from chunkgrpo.cli import main
from chunkgrpo.errors import UserError
from chunkgrpo.registry.client import version_details
from chunkgrpo.registry.gate import GateConfig
from chunkgrpo.registry.load import load_registered_model
from chunkgrpo.registry.payload import MODEL_INFO
from chunkgrpo.registry.promotion import promote, promotion_history, rollback
from chunkgrpo.registry.registration import Registration, register_model
from chunkgrpo.store.client import ArtifactStore
from tests.registry_helpers import eval_run, eval_run_for

pytestmark = pytest.mark.integration
METRIC = "eval.hpdv2.hpsv3"
PROTOCOL = {"preset": "eval_hpdv2", "benchmarks": {"hpdv2": {"n_prompts": 400}}, "seed": 42,
            "sampling": {"num_steps": 50, "trained_steps": 30}, "scorers": ["hpsv3"]}


def _client():
    from mlflow import MlflowClient

    return MlflowClient()


def _aliases(name: str) -> dict[str, str]:
    return {k: str(v) for k, v in _client().get_registered_model(name).aliases.items()}


def _tags(name: str, version: str) -> dict[str, str]:
    return _client().get_model_version(name, version).tags


def _fake_lora(root, seed: int):
    root.mkdir(parents=True)
    (root / "pytorch_lora_weights.safetensors").write_bytes(bytes([seed % 256]) * 4096)
    (root / "adapter_config.json").write_text(json.dumps({"r": 4, "seed": seed}))
    return root


def _register(name, tmp_path, seed: int, score: float, run_id=None, **kw):
    weights = _fake_lora(tmp_path / f"lora-{seed}", seed)
    run = eval_run_for({METRIC: score, "eval.clip": 0.2}, weights)  # promotion trusts only the evaluation run
    req = Registration(name, "tiny-flux", weights, kind="lora",
                       metrics={"eval": {"hpdv2": {"hpsv3": score}}, "eval.clip": 0.2}, git="abc123",
                       cfg_hash="cfg0001", plan={"boundaries": [0, 4, 8, 16], "seed": seed},
                       **{"eval_protocol": PROTOCOL, "eval_run_id": run, **kw})
    return register_model(req, run_id=run_id)


def test_register_promote_gate_rollback(services_env, tmp_path):
    name = f"flux-{uuid.uuid4().hex[:6]}"
    store = ArtifactStore(services_env.store_config)
    ckpt = store.uri(f"ckpts/{name}/step-100")
    store.put_folder(_fake_lora(tmp_path / "ckpt", 1), ckpt)

    v1 = _register(name, tmp_path, 1, 0.30, checkpoint_uri=ckpt)
    t = _tags(name, v1.version)
    assert t["kind"] == "lora" and t["base_model"] == "tiny-flux" and float(t[f"metric.{METRIC}"]) == 0.30
    # the rest is in the version's details (registration/details.json of its run)
    d = version_details(_client(), _client().get_model_version(name, v1.version))
    assert d["git_sha"] == "abc123" and d["config_hash"] == "cfg0001" and d["checkpoint_uri"] == ckpt
    assert d["metrics"]["eval.clip"] == 0.2 and d["chunk_plan"]["boundaries"] == [0, 4, 8, 16]
    assert _aliases(name) == {"challenger": v1.version}
    # re-registering the same content is idempotent (a retried pipeline step)
    assert _register(name, tmp_path / "again", 1, 0.30, checkpoint_uri=ckpt).version == v1.version

    # loadable: the registered folder is the adapter + chunkgrpo_registration.json, checksums verified
    m = load_registered_model(f"models:/{name}/{v1.version}", tmp_path / "dl")
    assert m.kind == "lora" and m.base_model == "tiny-flux" and m.info["checkpoint_uri"] == ckpt
    assert (m.weights_dir / "pytorch_lora_weights.safetensors").read_bytes() == bytes([1]) * 4096
    assert m.info["manifest_sha256"] == store.read_manifest(ckpt).sha256

    # no champion yet -> gate passes
    r = promote(name, v1.version, who="tester", why="first")
    assert r.action == "promoted" and _aliases(name)["champion"] == v1.version
    # better -> champion, old one -> previous
    v2 = _register(name, tmp_path, 2, 0.35)
    r = promote(name, v2.version, who="tester")
    assert r.action == "promoted" and r.previous == v1.version
    assert _aliases(name) == {"champion": v2.version, "previous": v1.version, "challenger": v2.version}
    t2 = _tags(name, v2.version)
    rec = json.loads(t2["promotion.record"])
    assert rec["by"] == "tester" and t2["promotion.status"] == "champion" and rec["forced"] is False
    assert rec["gate"]["champion"] == 0.30 and rec["gate"]["candidate"] == 0.35
    assert (rec["gate"]["metric"], rec["gate"]["champion_version"]) == (METRIC, v1.version)
    # the decision as plain tags, readable on the version page
    assert t2["gate.decision"] == "promoted" and t2["gate.reason"] == rec["reason"]
    assert "candidate 0.35 vs champion 0.3" in t2["gate.reason"]
    assert len(t2) <= 12, sorted(t2)  # a promoted champion: the short set, the rest in details/record
    t1 = _tags(name, v1.version)
    assert t1["promotion.status"] == "previous"
    assert json.loads(t1["promotion.record"])["replaced_by"] == v2.version
    # idempotent re-run
    assert promote(name, v2.version).action == "noop"
    assert _aliases(name)["champion"] == v2.version

    # worse -> rejected, no alias change (also when re-run)
    v3 = _register(name, tmp_path, 3, 0.33)
    before = _aliases(name)
    for _ in range(2):
        r = promote(name, v3.version, who="tester")
        assert r.action == "rejected" and _aliases(name) == before
    t3 = _tags(name, v3.version)
    assert t3["promotion.status"] == "rejected" and t3["gate.decision"] == "rejected"
    rec = json.loads(t3["promotion.record"])
    assert rec["gate"]["candidate"] == 0.33 and rec["gate"]["champion"] == 0.35
    assert rec["gate"]["champion_version"] == v2.version and t3["gate.reason"] == rec["reason"] != ""
    # better but within the margin -> rejected
    v4 = _register(name, tmp_path, 4, 0.36)
    assert promote(name, v4.version, GateConfig(margin=0.05)).action == "rejected"
    assert _aliases(name)["champion"] == v2.version
    # the caller cannot flip the direction or switch the metric (a worse v3 was crowned this way)
    with pytest.raises(UserError, match="higher-is-better"):
        promote(name, v3.version, GateConfig(direction="min"))
    with pytest.raises(UserError, match="gated on eval.hpdv2.hpsv3"):
        promote(name, v3.version, GateConfig(metric="eval.clip"))
    # the only other metric allowed is the CI bound of the model's own metric, in its own direction
    # (tests/integration/registry/test_gate_ci.py promotes on it): another metric's bound or the wrong bound
    # is not
    for other in ("eval.clip.delta_ci_low", f"{METRIC}.delta_ci_high"):
        with pytest.raises(UserError, match="gated on eval.hpdv2.hpsv3"):
            promote(name, v3.version, GateConfig(metric=other))
    assert _aliases(name)["champion"] == v2.version
    # another eval protocol (fewer prompts) is never compared, however good the number
    v5 = _register(
        name, tmp_path, 5, 0.99, eval_protocol={**PROTOCOL, "benchmarks": {"hpdv2": {"n_prompts": 16}}}
    )
    with pytest.raises(UserError, match="different protocols"):
        promote(name, v5.version)
    from chunkgrpo.registry.promotion import gate_check

    check = gate_check(name, v5.version)
    assert not check.passed and "different protocols" in check.reason
    assert gate_check(name, v4.version).passed is True and gate_check(name, v3.version).passed is False

    # --force is applied and recorded
    r = promote(name, v3.version, force=True, who="oncall", why="hotfix")
    assert r.action == "forced"
    assert _aliases(name)["champion"] == v3.version and _aliases(name)["previous"] == v2.version
    t3 = _tags(name, v3.version)
    rec = json.loads(t3["promotion.record"])
    assert rec["forced"] is True and rec["by"] == "oncall" and rec["why"] == "hotfix"
    assert t3["gate.decision"] == "forced" and t3["gate.reason"].startswith("forced by oncall")

    # rollback restores the previous champion
    r = rollback(name, who="oncall", why="bad samples")
    assert r.action == "rolled_back" and r.version == v2.version
    assert _aliases(name)["champion"] == v2.version and "previous" not in _aliases(name)
    t3 = _tags(name, v3.version)
    assert t3["promotion.status"] == "rolled_back"
    assert json.loads(t3["promotion.record"])["rollback_why"] == "bad samples"
    with pytest.raises(UserError, match="nothing to roll back"):
        rollback(name, why="again")
    log = promotion_history(name)  # one tag per entry; rejections are counted, not logged
    assert [e["action"] for e in log] == ["set_gate", "promoted", "promoted", "forced", "rollback"]
    assert _client().get_registered_model(name).tags["promotion.rejected_count"] == "3"
    assert log[0]["metric"] == METRIC and log[0]["direction"] == "max"
    with pytest.raises(UserError, match="no version"):
        promote(name, "999")


def test_cli_register_promote_and_external_weights(services_env, tmp_path, capsys):
    name = f"flux-cli-{uuid.uuid4().hex[:6]}"
    store = ArtifactStore(services_env.store_config)
    # a "full" model whose weights stay in S3: only a pointer goes into MLflow
    full = tmp_path / "full"
    (full / "transformer").mkdir(parents=True)
    (full / "transformer" / "diffusion_pytorch_model.safetensors").write_bytes(b"w" * 10000)
    (full / "transformer" / "config.json").write_text("{}")
    ckpt = store.uri(f"ckpts/{name}/step-5")
    store.put_folder(full, ckpt)
    (tmp_path / "metrics.json").write_text(json.dumps({  # an evaluation's metrics.json names its run
        "format": "chunkgrpo.eval-metrics/v1", "metrics": {"hpdv2.hpsv3.trained": 0.4},
        "mlflow_run_id": eval_run({"hpdv2.hpsv3.trained": 0.4}, weights=full)}))
    (tmp_path / "plan.json").write_text(json.dumps({"boundaries": [0, 10, 28]}))
    downloads = []
    monkey = pytest.MonkeyPatch()  # registering a full model by reference downloads none of it
    monkey.setattr(ArtifactStore, "get_folder", lambda self, uri, dst, *a, **k: downloads.append(uri))
    assert (
        main(
            [
                "register",
                "--model-dir",
                ckpt,
                "--name",
                name,
                "--base-model",
                "tiny-flux",
                "--kind",
                "full",
                "--metrics",
                str(tmp_path / "metrics.json"),
                "--plan",
                str(tmp_path / "plan.json"),
                "--external-weights",
            ]
        )
        == 0
    )
    monkey.undo()
    assert f"{name} version 1" in capsys.readouterr().out and downloads == []
    m = load_registered_model(f"models:/{name}/1", tmp_path / "dl")
    assert m.info["weights"] == "external" and m.kind == "full"
    assert not (m.path / "transformer").exists()
    assert (
        m.weights_dir / "transformer" / "diffusion_pytorch_model.safetensors"
    ).read_bytes() == b"w" * 10000

    assert main(["promote", "--model", name, "--version", "1", "--why", "first"]) == 0
    assert "promoted" in capsys.readouterr().out
    assert _aliases(name)["champion"] == "1"
    assert main(["promote", "--model", name, "--rollback", "--why", "x"]) == 2  # no previous: one-line error
    assert "nothing to roll back" in capsys.readouterr().err
    # there is no --direction: the direction is the registered model's
    with pytest.raises(SystemExit) as exc:
        main(["promote", "--model", name, "--version", "1", "--direction", "min"])
    assert exc.value.code == 2
    assert main(["promote", "--model", name, "--set-gate", f"{METRIC}:min", "--why", "x"]) == 2
    assert "higher-is-better by definition" in capsys.readouterr().err
    assert (
        main(["register", "--model-dir", str(tmp_path / "missing"), "--name", name, "--base-model", "x"]) == 2
    )


def test_register_refuses_incomplete_checkpoint(services_env, tmp_path):
    store = ArtifactStore(services_env.store_config)
    store.put_file(
        _fake_lora(tmp_path / "l", 9) / "adapter_config.json", "ckpts/incomplete/step-1/adapter_config.json"
    )
    with pytest.raises(UserError, match="not a complete folder"):
        register_model(Registration("flux-x", "b", None, kind="full",
                                    checkpoint_uri=store.uri("ckpts/incomplete/step-1")))


def test_tracking_parent_and_stage_runs(services_env, tmp_path):
    from chunkgrpo.tracking import stage_run, start_pipeline_run

    exp = f"exp-{uuid.uuid4().hex[:6]}"
    (tmp_path / "report.html").write_text("<html></html>")
    with start_pipeline_run(
        exp, "pipeline-1", tags={"git_sha": "abc"}, params={"train": {"lr": 1e-4}}
    ) as run:
        assert run.enabled
        with run.stage("train", params={"steps": 10}) as st:
            st.log_metrics({"loss": 0.5, "reward": {"mean": 0.1}}, step=3)
        with stage_run("evaluate", parent_run_id=run.run_id) as ev:   # as a separate KFP step would
            ev.log_artifact(tmp_path / "report.html", "report")
    c = _client()
    parent = c.get_run(run.run_id)
    assert parent.data.params == {"train.lr": "0.0001"} and parent.info.status == "FINISHED"
    children = c.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{run.run_id}'")
    assert sorted(r.info.run_name for r in children) == ["evaluate", "train"]
    train = next(r for r in children if r.info.run_name == "train")
    assert train.data.metrics == {"loss": 0.5, "reward.mean": 0.1} and train.data.params == {"steps": "10"}
    ev_run = next(r for r in children if r.info.run_name == "evaluate")
    assert [a.path for a in c.list_artifacts(ev_run.info.run_id, "report")] == ["report/report.html"]
    with pytest.raises(RuntimeError):
        with start_pipeline_run(exp, "failing") as failing:
            raise RuntimeError("boom")
    assert c.get_run(failing.run_id).info.status == "FAILED"


def test_registered_lora_loads_into_a_diffusers_pipeline(services_env, tmp_path, tiny_model_dir):
    """End to end: a real LoRA on the tiny FLUX model -> registry -> FluxPipeline with the adapter."""
    import torch
    from diffusers import FluxPipeline
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    from chunkgrpo.registry.load import load_pipeline

    pipe = FluxPipeline.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    pipe.transformer.add_adapter(LoraConfig(r=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"],
                                            init_lora_weights=False))
    lora = tmp_path / "lora"
    FluxPipeline.save_lora_weights(lora, transformer_lora_layers=get_peft_model_state_dict(pipe.transformer))
    name = f"flux-lora-{uuid.uuid4().hex[:6]}"
    sampling = {"num_steps": 2, "trained_steps": 1, "height": 64, "width": 64, "guidance": 3.5,
                "max_sequence_length": 32}
    rv = register_model(Registration(name, str(tiny_model_dir), lora, kind="lora", metrics={METRIC: 0.1},
                                     eval_protocol=PROTOCOL, sampling=sampling,
                                     eval_run_id=eval_run_for({METRIC: 0.1}, lora)))
    promote(name, rv.version)
    loaded = load_pipeline(f"models:/{name}@champion")
    assert (load_registered_model(f"models:/{name}@champion", tmp_path / "m").path / MODEL_INFO).exists()
    want = get_peft_model_state_dict(pipe.transformer)
    (adapter,) = loaded.transformer.peft_config  # diffusers names it default_0
    got = get_peft_model_state_dict(loaded.transformer, adapter_name=adapter)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    img = loaded("a cat", height=64, width=64, num_inference_steps=2, guidance_scale=0.0,
                 max_sequence_length=32).images[0]
    assert img.size == (64, 64)


def test_register_into_a_pipeline_stage_run(services_env, tmp_path):
    from chunkgrpo.tracking import start_pipeline_run

    name = f"flux-stage-{uuid.uuid4().hex[:6]}"
    with start_pipeline_run(f"exp-{uuid.uuid4().hex[:6]}", "pipeline") as run:
        with run.stage("register") as st:
            a = _register(name, tmp_path, 11, 0.2, run_id=st.run_id)
            b = _register(name, tmp_path, 12, 0.3, run_id=st.run_id)
    assert (a.run_id, b.run_id) == (st.run_id, st.run_id) and a.source != b.source
    assert load_registered_model(a.uri, tmp_path / "a").info["plan"]["seed"] == 11
    assert load_registered_model(b.uri, tmp_path / "b").info["plan"]["seed"] == 12


def test_trainer_output_with_its_model_json_registers_and_loads(services_env, tmp_path):
    """A trainer `final/` folder carries its own chunkgrpo_model.json; registering must keep it intact
    and loading must verify every file (regression: the registry used to overwrite it)."""
    name = f"flux-{uuid.uuid4().hex[:6]}"
    final = _fake_lora(tmp_path / "final", 7)
    trainer_meta = {"kind": "lora", "base_model": "tiny-flux", "method": "chunk", "chunk_sizes": [2, 2, 3]}
    (final / "chunkgrpo_model.json").write_text(json.dumps(trainer_meta))
    v = register_model(Registration(name, "tiny-flux", final, kind="lora", metrics={METRIC: 0.1}))
    m = load_registered_model(f"models:/{name}/{v.version}", tmp_path / "dl")
    assert json.loads((m.path / "chunkgrpo_model.json").read_text()) == trainer_meta
    assert (m.path / MODEL_INFO).exists() and MODEL_INFO != "chunkgrpo_model.json"


def test_registered_version_is_an_mlflow_pyfunc(services_env, tmp_path, tiny_model_dir):
    """mlflow.pyfunc.load_model("models:/<name>@champion") works: base FLUX + the registered adapter,
    hybrid inference with the registered sampling, one PNG per prompt, seeded and deterministic."""
    import mlflow
    import numpy as np
    import pandas as pd
    import torch
    from diffusers import FluxPipeline
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    from chunkgrpo.served_model import decode_image

    pipe = FluxPipeline.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    pipe.transformer.add_adapter(
        LoraConfig(
            r=4, lora_alpha=64, target_modules=["to_q", "to_k", "to_v", "to_out.0"], init_lora_weights=False
        )
    )
    lora = tmp_path / "lora"
    FluxPipeline.save_lora_weights(lora, transformer_lora_layers=get_peft_model_state_dict(pipe.transformer))
    name = f"flux-pyfunc-{uuid.uuid4().hex[:6]}"
    sampling = {"num_steps": 3, "trained_steps": 2, "height": 64, "width": 64, "guidance": 3.5,
                "max_sequence_length": 32}
    rv = register_model(Registration(name, str(tiny_model_dir), lora, kind="lora", metrics={METRIC: 0.2},
                                     eval_protocol=PROTOCOL, sampling=sampling,
                                     eval_run_id=eval_run_for({METRIC: 0.2}, lora)))
    assert promote(name, rv.version).action == "promoted"
    model = mlflow.pyfunc.load_model(f"models:/{name}@champion")
    assert (
        model.metadata.flavors["python_function"]["loader_module"] == "mlflow.pyfunc.loaders.code_model"
    )  # no pickle
    df = pd.DataFrame({"prompt": ["a red apple", "a blue car"], "seed": [3, 4]})
    out = model.predict(df)
    assert list(out.columns) == ["prompt", "seed", "image"] and list(out["seed"]) == [3, 4]
    a = np.asarray(decode_image(out["image"][0]))
    assert a.shape == (64, 64, 3)
    again = model.predict(df)
    assert np.array_equal(a, np.asarray(decode_image(again["image"][0])))  # same seed, same image
    base = model.predict(df, params={"mode": "base"})
    assert not np.array_equal(a, np.asarray(decode_image(base["image"][0])))  # the adapter is applied
    with pytest.raises(Exception, match="mode"):
        model.predict(df, params={"mode": "sideways"})
