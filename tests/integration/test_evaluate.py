"""The evaluate stage end to end on the tiny FLUX: base vs a trained LoRA adapter (hybrid inference),
metrics.json, the HTML report, resume, GenEval/WISE plumbing with stand-in detector/judge, the CLI,
and MLflow + S3 against the real local services."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from chunkgrpo.eval.config import EvalConfig
from chunkgrpo.eval.runner import run_evaluation

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory):
    from chunkgrpo.testing.clip import make_tiny_clip

    return make_tiny_clip(tmp_path_factory.mktemp("clip") / "tiny-clip")


def test_evaluate_base_vs_trained_8_prompts(tiny_model_dir, trained_dir, tiny_clip, tmp_path):
    out = tmp_path / "eval"
    cfg = EvalConfig.load(
        "eval_tiny",
        [
            f"model={trained_dir}",
            f"output_dir={out}",
            "scorers=[brightness, contrast, clip]",
            f"scorer_weights.clip={tiny_clip}",
        ],
    )
    assert cfg.num_prompts == 8 and cfg.sampling.num_steps == 6 and cfg.sampling.trained_steps == 4
    assert cfg.base_model == ""  # taken from the adapter's chunkgrpo_model.json
    result = run_evaluation(cfg)

    # metrics.json = the returned dict
    saved = json.loads((out / "metrics.json").read_text())
    assert saved["metrics"] == pytest.approx(result["metrics"])
    assert result["labels"] == ["trained", "base"]
    assert result["base_model"] == str(tiny_model_dir)
    assert result["models"]["trained"]["kind"] == "lora"
    assert result["generation"]["n_transformers"] == 1
    assert result["generation"]["images_generated"] == 16
    # per batch of 4: 4 trained steps (hybrid) + 2 base steps (hybrid) + 6 base steps (base model)
    assert result["generation"]["transformer_calls"] == {"trained": 2 * 4, "base": 2 * (2 + 6)}
    h = result["benchmarks"]["hpdv2"]
    assert h["n_prompts"] == 8 and h["official_prompts"] is True
    assert h["comparable_to_official"] is False and any("8 of 400" in n for n in h["comparable_notes"])
    for lb in ("trained", "base"):
        sc = h["results"][lb]["scorers"]
        assert set(sc) == {"brightness", "contrast", "clip"}
        for s in sc.values():
            assert s["n"] == 8 and np.isfinite(s["mean"]) and "scale" in s["info"]
        assert "preprocessing" in sc["clip"]["info"]
    for key in ("hpdv2.brightness.trained", "hpdv2.brightness.base", "hpdv2.brightness.delta",
                "hpdv2.clip.trained", "hpdv2.contrast.delta"):
        assert key in result["metrics"]

    # images: same seeds, different weights in the first K steps -> different images
    files = sorted((out / "hpdv2" / "trained").glob("*.png"))
    assert [f.name for f in files] == [f"{i:03d}.png" for i in range(8)]
    a = np.asarray(Image.open(out / "hpdv2" / "trained" / "000.png"), dtype=int)
    b = np.asarray(Image.open(out / "hpdv2" / "base" / "000.png"), dtype=int)
    assert np.abs(a - b).max() > 0
    rows = [json.loads(x) for x in (out / "hpdv2" / "scores.jsonl").read_text().splitlines()]
    assert len(rows) == 8 and set(rows[0]["trained"]) == {"brightness", "contrast", "clip"}

    # report: one self-contained file, base and trained side by side
    html = (out / "report.html").read_text()
    assert "<th>base</th><th>trained</th>" in html
    assert html.count("data:image/jpeg;base64,") == 16
    assert "trained − base" in html and "Not comparable" in html
    assert "src='hpdv2/" not in html  # no external image references
    assert (out / "grids" / "hpdv2_trained.png").exists() and (out / "grids" / "hpdv2_base.png").exists()

    # resume: a second run reuses every image and reproduces the metrics
    again = run_evaluation(cfg)
    assert again["generation"]["images_generated"] == 0 and again["generation"]["images_reused"] == 16
    assert again["metrics"] == pytest.approx(result["metrics"])
    # ... and only images whose prompt changed are regenerated
    from chunkgrpo.eval.hpdv2 import load_prompts

    prompts = load_prompts()[:8]
    custom = tmp_path / "prompts.txt"
    custom.write_text("\n".join(["a red apple on a table", *prompts[1:]]) + "\n")
    third = run_evaluation(cfg.replace(hpdv2_prompts=str(custom)))
    assert third["generation"]["images_generated"] == 2 and third["generation"]["images_reused"] == 14
    assert third["benchmarks"]["hpdv2"]["official_prompts"] is False


class _FakeDetector:
    name = "fake"
    comparable_to_official = False

    def detect(self, image):
        from chunkgrpo.eval.geneval import Detection

        return {"bench": [Detection((0.0, 0.0, 16.0, 16.0), 0.95, None)]}


def test_geneval_and_wise_layout_and_scoring(tiny_model_dir, trained_dir, tmp_path):
    from chunkgrpo.eval import wise

    md = tmp_path / "geneval.jsonl"
    md.write_text("\n".join(json.dumps(x) for x in [
        {"tag": "single_object", "include": [{"class": "bench", "count": 1}], "prompt": "a photo of a bench"},
        {"tag": "two_object", "include": [{"class": "bench", "count": 1}, {"class": "dog", "count": 1}],
         "prompt": "a photo of a bench and a dog"},
    ]) + "\n")
    wdir = tmp_path / "wise"
    wdir.mkdir()
    (wdir / "cultural_common_sense_rewrite.json").write_text(
        json.dumps(
            [
                {
                    "prompt_id": 1,
                    "Prompt": "Mooncakes.",
                    "Explanation": "Mid-Autumn food",
                    "Subcategory": "Festival",
                }
            ]
        )
    )
    (wdir / "natural_science_rewrite.json").write_text(
        json.dumps(
            [
                {
                    "prompt_id": 901,
                    "Prompt": "Rusty iron nail.",
                    "Explanation": "oxidation",
                    "Subcategory": "Chemistry",
                }
            ]
        )
    )

    class FakeJudge(wise.JudgeClient):
        def complete(self, messages):
            assert messages[1]["content"][1]["image_url"]["url"].startswith("data:image/png;base64,")
            return "Consistency: 2\nRealism: 1\nAesthetic Quality: 0"

    out = tmp_path / "eval"
    cfg = EvalConfig.load(
        "eval_tiny",
        [
            f"model={trained_dir}",
            f"output_dir={out}",
            "benchmarks=[geneval, wise]",
            f"geneval_metadata={md}",
            "geneval_samples=2",
            f"wise_prompts={wdir}",
            "geneval_detector=transformers",
        ],
    )
    result = run_evaluation(cfg, detector=_FakeDetector(), judge=FakeJudge(wise.JudgeConfig(base_url="http://x/v1")))
    # official GenEval layout per model
    for lb in ("trained", "base"):
        root = out / "geneval" / lb
        assert (
            json.loads((root / "00001" / "metadata.jsonl").read_text())["prompt"]
            == "a photo of a bench and a dog"
        )
        assert sorted(p.name for p in (root / "00000" / "samples").iterdir()) == ["00000.png", "00001.png"]
        assert (root / "results.jsonl").exists()
        assert sorted(p.name for p in (out / "wise" / lb).glob("*.png")) == ["1.png", "901.png"]
    g = result["benchmarks"]["geneval"]["results"]["trained"]
    assert g["tasks"]["single_object"]["score"] == 1.0 and g["tasks"]["two_object"]["score"] == 0.0
    assert g["overall"] == 0.5 and g["n_images"] == 4
    w = result["benchmarks"]["wise"]["results"]["base"]
    assert w["n_scored"] == 2 and w["categories"]["culture"]["wiscore"] == pytest.approx(0.8)
    assert result["metrics"]["geneval.overall.delta"] == 0.0
    assert "wise.overall.trained" in result["metrics"]
    assert result["benchmarks"]["geneval"]["comparable_to_official"] is False
    html = (out / "report.html").read_text()
    assert "GenEval" in html and "WISE" in html and "✓" in html and "✗" in html and "WiScore" in html
    # the WISE image of prompt 1 and of prompt 901 use seeds 42+1 and 42+901 -> different noise
    assert not np.array_equal(np.asarray(Image.open(out / "wise" / "base" / "1.png")),
                              np.asarray(Image.open(out / "wise" / "base" / "901.png")))


def test_cli_evaluate(tiny_model_dir, trained_dir, tmp_path):
    out = tmp_path / "cli"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("MLFLOW_TRACKING_URI", None)
    proc = subprocess.run(
        [sys.executable, "-m", "chunkgrpo", "evaluate", "--config", "eval_tiny", f"model={trained_dir}",
         f"output_dir={out}", "num_prompts=2", "compare_base=false"],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "hpdv2 [trained] n=2" in proc.stdout and "report.html" in proc.stdout
    data = json.loads((out / "metrics.json").read_text())
    assert data["labels"] == ["trained"] and (out / "report.html").exists()
    bad = subprocess.run([sys.executable, "-m", "chunkgrpo", "evaluate", "--config", "eval_tiny",
                          f"base_model={tiny_model_dir}", "benchmarks=[hpdv3]"],
                         capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert bad.returncode == 2 and "hpdv3" in bad.stderr and "Traceback" not in bad.stderr


def test_mlflow_and_s3(services_env, tiny_model_dir, trained_dir, tmp_path):
    """Model read from S3 (folder artifact), results uploaded to S3, metrics + report in MLflow."""
    from mlflow.tracking import MlflowClient

    from chunkgrpo.store.client import ArtifactStore

    store = ArtifactStore(services_env.store_config)
    store.ensure_bucket()
    model_uri = store.uri("tests/eval/model")
    store.put_folder(trained_dir, model_uri)
    out_uri = store.uri("tests/eval/result")
    cfg = EvalConfig.load("eval_tiny", [f"model={model_uri}", f"base_model={tiny_model_dir}", "num_prompts=2",
                                        f"output_dir={tmp_path / 'eval'}", f"output_uri={out_uri}",
                                        f"cache_dir={tmp_path / 'cache'}", "experiment=eval-test"])
    result = run_evaluation(cfg)
    assert result["mlflow_run_id"] and result["output_uri"] == out_uri
    assert store.is_complete(out_uri)
    assert store.exists(out_uri + "/report.html") and store.exists(out_uri + "/hpdv2/trained/001.png")
    client = MlflowClient(services_env.tracking_uri)
    run = client.get_run(result["mlflow_run_id"])
    assert run.data.tags["chunkgrpo.stage"] == "evaluate"
    assert run.data.metrics["hpdv2.brightness.trained"] == pytest.approx(
        result["metrics"]["hpdv2.brightness.trained"]
    )
    assert "hpdv2.brightness.delta" in run.data.metrics
    arts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"metrics.json", "report.html", "grids", "images"} <= arts
    images = [a.path for a in client.list_artifacts(run.info.run_id, "images") if a.path.endswith(".png")]
    keys = sorted(p.split("/")[1].split("+")[0] for p in images)  # MLflow's file name: key+step+0+...
    assert keys == ["grids.hpdv2_base", "grids.hpdv2_trained"]
    with open(client.download_artifacts(run.info.run_id, "grids/captions.json", str(tmp_path))) as f:
        table = json.load(f)
    rows = [dict(zip(table["columns"], r, strict=True)) for r in table["data"]]
    assert {r["grid"] for r in rows} == {"grids/hpdv2_base.png", "grids/hpdv2_trained.png"}
    assert all(r["prompt"] for r in rows)


def test_config_validation(tiny_model_dir, tmp_path):
    from chunkgrpo.errors import UserError

    with pytest.raises(UserError, match="benchmarks"):
        EvalConfig(base_model="x", benchmarks=["hpdv3"])
    with pytest.raises(UserError, match="did you mean 'imagereward'"):
        EvalConfig(base_model="x", scorers=["imagerewrd"])
    with pytest.raises(UserError, match="output_uri"):
        EvalConfig(base_model="x", output_uri="/tmp/x")
    with pytest.raises(UserError, match="trained_steps"):
        EvalConfig.from_dict({"base_model": "x", "sampling": {"num_steps": 10, "trained_steps": 20}})
    with pytest.raises(UserError, match="base_model"):
        EvalConfig.load("eval_tiny")
    with pytest.raises(UserError, match="needs weights"):
        from chunkgrpo.eval.scorer_setup import build_scorers

        build_scorers(EvalConfig(base_model=str(tiny_model_dir), scorers=["pickscore"]))
    with pytest.raises(UserError, match="needs weights"):  # preflight: fails before any image is generated
        run_evaluation(
            EvalConfig(base_model=str(tiny_model_dir), scorers=["pickscore"], output_dir=str(tmp_path))
        )
    assert not (tmp_path / "hpdv2").exists()
    cfg = EvalConfig.load(
        "eval_hpdv2", ["model=m", "scorer_options.hpsv3.processor=/q", "wise_judge.workers=2"]
    )
    s = cfg.sampling
    assert (s.num_steps, s.trained_steps, s.height, s.guidance, s.schedule) == (50, 30, 1024, 3.5, "dynamic")
    assert cfg.scorers == ["hpsv3", "imagereward"] and cfg.num_prompts == 0
    assert cfg.scorer_options == {"hpsv3": {"processor": "/q"}} and cfg.wise_judge.workers == 2
