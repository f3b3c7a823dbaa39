"""The core CLI end to end on a tiny FLUX built offline: tiny-model → reload → profile → plan."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


def _cli(*args, cwd=None):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "chunkgrpo", *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=300,
    )


def test_tiny_model_profile_plan_end_to_end(tmp_path):
    model = tmp_path / "tiny"
    r = _cli("tiny-model", "--out", model, "--seed", 3)
    assert r.returncode == 0, r.stderr
    # the folder is a real diffusers FLUX pipeline that loads offline
    code = (
        "import torch; from diffusers import FluxPipeline; "
        f"p = FluxPipeline.from_pretrained({str(model)!r}, dtype=torch.float32); "
        "im = p('a cat', height=64, width=64, num_inference_steps=2, guidance_scale=0.0, "
        "max_sequence_length=16).images[0]; "
        "print(type(p.transformer).__name__, im.size)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "FluxTransformer2DModel (64, 64)" in r.stdout

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat on a chair\na red car\nthree apples\n")
    out = tmp_path / "prof" / "profile.json"
    r = _cli("profile", "--model", model, "--prompts", prompts, "--steps", 8, "--seeds", 2, "--height", 64,
             "--width", 64, "--out", out, "sampling.max_sequence_length=16")
    assert r.returncode == 0, r.stderr
    prof = json.loads(out.read_text())
    assert len(prof["sigmas"]) == 9 and len(prof["l1rel"]) == 8 and prof["samples"] == 6
    assert all(v > 0 for v in prof["l1rel"])
    assert out.with_suffix(".png").exists()

    for strategy, expect in (
        ("sizes:2,2,3", [2, 2, 3]),
        ("uniform:3", [3, 3, 1]),
        ("step", [1] * 7),
        ("whole", [7]),
    ):
        plan_out = tmp_path / f"plan-{strategy.split(':')[0]}.json"
        r = _cli("plan", "--profile", out, "--chunks", strategy, "--out", plan_out)
        assert r.returncode == 0, r.stderr
        assert json.loads(plan_out.read_text())["sizes"] == expect
    r = _cli("plan", "--profile", out, "--chunks", "dynamics", "--out", tmp_path / "plan.json")
    assert r.returncode == 0, r.stderr
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert sum(plan["sizes"]) == 7 and plan["rationale"]


@pytest.mark.parametrize("args,needle", [
    (["plan", "--profile", "/no/such/profile.json", "--chunks", "step", "--out", "x.json"], "does not exist"),
    (["profile", "--model", "/no/such/model", "--prompts", "p.txt", "--out", "x.json"], "does not exist"),
])
def test_user_errors_are_one_line_without_traceback(tmp_path, args, needle):
    r = _cli(*args, cwd=tmp_path)
    assert r.returncode == 2
    assert needle in r.stderr and "Traceback" not in r.stderr
    assert len([ln for ln in r.stderr.splitlines() if ln.startswith("chunkgrpo")]) == 1


def test_bad_strategy_and_empty_prompt_file(tmp_path, tiny_model_dir):
    prof = tmp_path / "profile.json"
    prof.write_text(json.dumps({"sigmas": [1, 0.5, 0.2, 0], "l1rel": [0.3, 0.2, 0.1]}))
    r = _cli("plan", "--profile", prof, "--chunks", "sizes:1,1,1", "--out", tmp_path / "p.json")
    assert r.returncode == 2 and "sum to 3 but there are 2 trainable steps" in r.stderr
    assert not (tmp_path / "p.json").exists()  # nothing half-written
    empty = tmp_path / "empty.txt"
    empty.write_text("\n# only a comment\n")
    r = _cli("profile", "--model", tiny_model_dir, "--prompts", empty, "--out", tmp_path / "x.json")
    assert r.returncode == 2 and "contains no prompts" in r.stderr


@pytest.mark.parametrize("case", ["evaluate output_uri", "models sync --to"])
def test_upload_to_a_bucket_that_does_not_exist_is_refused_before_any_work(case, services_env, tiny_model_dir,
                                                                            tmp_path, capsys):
    """An upload to a missing bucket, against the real SeaweedFS (which would create it on the first PUT):
    exit 2, one line naming the bucket, nothing written locally, no bucket created, never 'uploaded'."""
    from chunkgrpo.cli import main
    from chunkgrpo.store.client import ArtifactStore

    bucket = "no-such-bucket-24"
    if case == "evaluate output_uri":
        argv = ["evaluate", "--config", "eval_tiny", f"base_model={tiny_model_dir}", "num_prompts=1",
                f"output_uri=s3://{bucket}/eval", f"output_dir={tmp_path / 'eval'}"]
    else:
        argv = ["models", "sync", str(tiny_model_dir), "--to", f"s3://{bucket}/models/tiny"]
    rc = main(argv)
    captured = capsys.readouterr()
    lines = [ln for ln in captured.err.splitlines() if ln.strip()]
    assert rc == 2 and "Traceback" not in captured.err and len(lines) == 1, captured.err
    assert f"bucket '{bucket}'" in lines[0] and "does not exist" in lines[0]
    assert "uploaded" not in captured.out + captured.err and " -> " not in captured.out
    assert not (tmp_path / "eval").exists()
    assert not ArtifactStore(services_env.store_config)._client.bucket_exists(bucket)
