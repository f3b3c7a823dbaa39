"""`mlflow models serve -m models:/NAME@champion` with MLflow's own environment handling: the registered
version carries the chunkgrpo code it imports, pip requirements that public indexes have (pinned to the
versions tested here, none of them chunkgrpo), and its base model as an s3:// URI, not a local path."""

from __future__ import annotations

import base64
import io
import json
import os
import subprocess
import sys
import time
import urllib.request
import uuid
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from chunkgrpo.processes import free_port
from chunkgrpo.registry.payload import MODEL_INFO, PAYLOAD
from chunkgrpo.registry.promotion import promote
from chunkgrpo.registry.registration import Registration, register_model
from tests.fixtures_services import stop_process_group
from tests.registry_helpers import eval_run_for

pytestmark = pytest.mark.integration
METRIC = "eval.hpdv2.hpsv3"
PROTOCOL = {"preset": "eval_hpdv2", "benchmarks": {"hpdv2": {"n_prompts": 400}}, "seed": 42,
            "sampling": {"num_steps": 3, "trained_steps": 2}, "scorers": ["hpsv3"]}
SERVE_START_S = 240


def _lora(tiny_model_dir, out: Path) -> Path:
    import torch
    from diffusers import FluxPipeline
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    pipe = FluxPipeline.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    targets = ["to_q", "to_k", "to_v", "to_out.0"]
    config = LoraConfig(r=4, lora_alpha=64, target_modules=targets, init_lora_weights=False)
    pipe.transformer.add_adapter(config)
    FluxPipeline.save_lora_weights(out, transformer_lora_layers=get_peft_model_state_dict(pipe.transformer))
    return out


@pytest.fixture
def champion(services_env, tmp_path, tiny_model_dir, monkeypatch):
    """A LoRA on the tiny FLUX registered with its base model as a LOCAL folder, promoted to champion."""
    monkeypatch.setenv("CHUNKGRPO_CACHE", str(tmp_path / "cache"))
    lora = _lora(tiny_model_dir, tmp_path / "lora")
    name = f"flux-serve-{uuid.uuid4().hex[:6]}"
    sampling = {"num_steps": 3, "trained_steps": 2, "height": 64, "width": 64, "guidance": 3.5,
                "max_sequence_length": 32}
    rv = register_model(Registration(name, str(tiny_model_dir), lora, kind="lora", metrics={METRIC: 0.2},
                                     eval_protocol=PROTOCOL, sampling=sampling,
                                     eval_run_id=eval_run_for({METRIC: 0.2}, lora)))
    assert promote(name, rv.version).action == "promoted"
    return name


def test_registered_version_ships_code_public_requirements_and_an_s3_base_model(champion, tmp_path):
    import mlflow

    folder = Path(mlflow.artifacts.download_artifacts(f"models:/{champion}@champion", dst_path=str(tmp_path)))
    info = json.loads((folder / PAYLOAD / MODEL_INFO).read_text())
    assert info["base_model"].startswith("s3://") and "/local/" in info["base_model"]
    assert (folder / "code" / "chunkgrpo" / "served_model.py").is_file()  # imported from the model itself
    reqs = [Requirement(line) for line in (folder / "requirements.txt").read_text().splitlines()
            if line.strip() and not line.startswith("#")]
    names = {r.name.lower() for r in reqs}
    assert "chunkgrpo" not in names and {"mlflow", "torch", "diffusers", "peft"} <= names
    for r in reqs:  # every pin is a release this environment runs (so the served model was tested with it)
        try:
            installed = version(r.name)
        except PackageNotFoundError:
            pytest.fail(f"requirement {r} is not installed here")
        assert r.specifier.contains(installed, prereleases=True), f"{r} vs installed {installed}"
        assert "+" not in str(r.specifier), r  # no local version label (only a vendor index has those)


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def _wait_ready(proc: subprocess.Popen, url: str, log: Path) -> None:
    deadline = time.monotonic() + SERVE_START_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"mlflow models serve exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url + "/ping", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    pytest.fail(f"mlflow models serve not ready in {SERVE_START_S}s:\n{log.read_text()[-3000:]}")


def test_mlflow_models_serve_answers_with_a_png(champion, tmp_path):
    from PIL import Image

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    # as in an activated environment: MLflow starts the scoring server as `uvicorn` from PATH
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    env = {**os.environ, "CHUNKGRPO_DEVICE": "cpu", "PATH": path}
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "mlflow", "models", "serve", "-m",
                                 f"models:/{champion}@champion", "--env-manager", "local", "-p", str(port),
                                 "-h", "127.0.0.1", "-w", "1"],
                                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        _wait_ready(proc, url, log)
        body = {"dataframe_split": {"columns": ["prompt", "seed"], "data": [["a red apple", 3]]}}
        rows = _post(url + "/invocations", body)["predictions"]
        assert [(r["prompt"], r["seed"]) for r in rows] == [("a red apple", 3)]
        image = Image.open(io.BytesIO(base64.b64decode(rows[0]["image"])))
        assert image.format == "PNG" and image.size == (64, 64)
        again = _post(url + "/invocations", {**body, "params": {"mode": "base"}})["predictions"]
        assert again[0]["image"] != rows[0]["image"]  # params reach predict(): the base model alone differs
    finally:
        stop_process_group(proc)


_IMPORTED = """
import json, sys
import mlflow, pandas as pd
from importlib.metadata import packages_distributions
model = mlflow.pyfunc.load_model(sys.argv[1])
model.predict(pd.DataFrame({"prompt": ["a red apple"], "seed": [3]}))
dists = packages_distributions()
top = {name.split(".")[0] for name in list(sys.modules)}
print(json.dumps(sorted({d for t in top for d in dists.get(t, [])})))
"""


def _deps(name: str, optional: bool = False) -> list[str]:
    """The distributions `name` requires (markers evaluated here), or with `optional` those of its extras."""
    from importlib.metadata import requires

    try:
        texts = requires(name) or []
    except PackageNotFoundError:
        return []
    out = []
    for text in texts:
        r = Requirement(text)
        is_extra = r.marker is not None and "extra" in str(r.marker)
        if is_extra if optional else (r.marker is None or r.marker.evaluate({"extra": ""})):
            out.append(r.name)
    return out


def _closure(names) -> set[str]:
    """`names` and every distribution they require, transitively."""
    from packaging.utils import canonicalize_name

    seen, todo = set(), [canonicalize_name(n) for n in names]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(canonicalize_name(d) for d in _deps(name))
    return seen


def test_the_requirements_cover_every_distribution_the_served_model_imports(champion, tmp_path):
    import mlflow
    from packaging.utils import canonicalize_name

    folder = Path(mlflow.artifacts.download_artifacts(f"models:/{champion}@champion", dst_path=str(tmp_path)))
    reqs = {Requirement(line).name for line in (folder / "requirements.txt").read_text().splitlines()
            if line.strip() and not line.startswith("#")}
    env = {**os.environ, "CHUNKGRPO_DEVICE": "cpu"}
    # the scoring server loads the model folder `mlflow models serve` downloaded (so does this process)
    out = subprocess.run([sys.executable, "-c", _IMPORTED, str(folder)], env=env,
                         capture_output=True, text=True, timeout=600, check=True).stdout
    imported = {canonicalize_name(d) for d in json.loads(out.strip().splitlines()[-1])} - {"chunkgrpo"}
    assert {"torch", "diffusers", "peft"} <= imported  # the check saw the model load and generate
    # MLflow's loader imports its artifact repositories' clients (boto3, google-cloud-storage) when they are
    # installed, and runs without them: those are its extras, not the served model's requirements
    optional = _closure(_deps("mlflow", optional=True) + _deps("mlflow-skinny", optional=True))
    missing = imported - _closure(reqs) - optional
    assert not missing, f"imported by the served model but not in requirements.txt: {sorted(missing)}"
