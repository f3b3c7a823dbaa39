"""The scorer boundary (`chunkgrpo.scoring.worker` + `client`) with the main venv playing the reward venv:
a tiny random-weight CLIP / PickScore scored through a real worker process. Covers the protocol, the
staged worker files, crash restart, timeouts, clear errors, parent death, training rewards."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from chunkgrpo.errors import UserError
from chunkgrpo.scoring import client as WC
from chunkgrpo.scoring import scorers as S
from chunkgrpo.scoring import worker as W
from chunkgrpo.testing.clip import make_tiny_clip

pytestmark = pytest.mark.integration  # starts worker processes

PROMPTS = ["a photo of a cat", "a red dog", "the blue cat", "a cat"]
MAIN_VENV = sys.prefix  # the test interpreter's venv stands in for a reward venv


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory):
    return make_tiny_clip(tmp_path_factory.mktemp("tiny_clip"), seed=0)


@pytest.fixture(scope="module")
def images():
    rng = np.random.default_rng(1)
    return [
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))
        for h, w in [(48, 40), (64, 64), (30, 90), (33, 33)]
    ]


@pytest.fixture(scope="module")
def pick_worker(tiny_clip):
    s = S.get_scorer("pickscore", weights=str(tiny_clip), device="cpu", venv=MAIN_VENV, batch_size=3)
    yield s
    s.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); look at its state
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_frames_and_images_roundtrip(images):
    shapes, payload = W.pack_images(images)
    assert shapes == [[48, 40], [64, 64], [30, 90], [33, 33]]
    back = W.unpack_images(shapes, payload)
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(images, back))
    import io

    frame = W.encode_frame({"op": "score", "x": [1, float("nan")]}, b"\x00\x01")
    header, body = W.read_frame(io.BytesIO(frame))
    assert header["op"] == "score" and np.isnan(header["x"][1]) and body == b"\x00\x01"
    with pytest.raises(EOFError):
        W.read_frame(io.BytesIO(frame[:-1]))
    with pytest.raises(ValueError, match="trailing"):
        W.unpack_images(shapes[:1], payload)


def test_worker_scores_equal_in_process(pick_worker, tiny_clip, images):
    local = S.get_scorer("pickscore", weights=str(tiny_clip), device="cpu", venv="")
    a, b = pick_worker.score(images, PROMPTS), local.score(images, PROMPTS)
    assert a.shape == (4,) and a.dtype == torch.float32 and torch.isfinite(a).all()
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)  # same code, another process
    assert a.std() > 1e-3  # input-dependent
    single = torch.cat([pick_worker.score([im], [p]) for im, p in zip(images, PROMPTS)])
    torch.testing.assert_close(single, a, rtol=1e-5, atol=1e-5)  # batched == one at a time
    info = pick_worker.info
    assert info["runs"] == "worker" and info["venv"] == str(Path(MAIN_VENV).resolve())
    assert info["runtime"]["python"] == str(Path(MAIN_VENV).resolve() / "bin" / "python")
    assert info["runtime"]["model_class"] == "transformers.models.clip.modeling_clip.CLIPModel"
    assert info["runtime"]["pid"] == pick_worker.pid != os.getpid()
    assert "logit_scale" in info["scale"] and info["weights"] == str(tiny_clip)


def test_clip_worker_via_environment_variable(monkeypatch, tiny_clip, images):
    monkeypatch.setenv("CHUNKGRPO_VENV_CLIP", MAIN_VENV)
    with S.get_scorer("clip", weights=str(tiny_clip), device="cpu", multiplier=100) as s:
        assert isinstance(s, S.WorkerScorer)
        pid = s.pid
        out = s.score(images[:2], PROMPTS[:2])
    assert not _alive(pid)  # `with` stopped the worker
    ref = S.get_scorer("clip", weights=str(tiny_clip), device="cpu", multiplier=100, venv="").score(
        images[:2], PROMPTS[:2]
    )
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)


def test_staged_worker_imports_only_stdlib_numpy_pil():
    """Only the worker's own file is staged on the path, and importing it loads nothing but the standard
    library, numpy and PIL (torch and the package load lazily). (That chunkgrpo is absent from the reward
    venvs is checked in test_scorers_packages; here the main venv's editable install could still serve
    submodules.)"""
    probe = textwrap.dedent("""
        import sys, json
        before = set(sys.modules)  # what the interpreter and its site hooks loaded
        import chunkgrpo.scoring.worker as w
        top = {m.split('.')[0] for m in set(sys.modules) - before}
        extra = sorted(top - set(sys.stdlib_module_names) - {'numpy', 'PIL', 'chunkgrpo'})
        print(json.dumps({"extra": extra, "file": w.__file__}))
    """)
    res = subprocess.run(
        [sys.executable, "-c", probe],
        env=WC.worker_env(),
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[3],
    )  # from the repo root, like the CLI
    import json

    out = json.loads(res.stdout)
    assert out["extra"] == []
    assert Path(out["file"]).parent.parent.parent == WC.stage_modules()
    assert Path(out["file"]).read_bytes() == Path(W.__file__).read_bytes()


def test_crashed_worker_is_restarted_and_the_batch_retried(tiny_clip, images):
    s = S.get_scorer("clip", weights=str(tiny_clip), device="cpu", venv=MAIN_VENV, batch_size=2)
    try:
        before = s.score(images, PROMPTS)
        first = s.pid
        os.kill(first, signal.SIGKILL)  # e.g. the OOM killer
        after = s.score(images, PROMPTS)
        assert s.pid != first and s.restarted == 1 and s.info["worker_restarts"] == 1
        torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-6)
    finally:
        s.close()


def test_crash_without_restarts_is_a_clear_error(tiny_clip, images):
    s = S.get_scorer("clip", weights=str(tiny_clip), device="cpu", venv=MAIN_VENV, restarts=0)
    try:
        os.kill(s.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(WC.ScorerWorkerError) as exc:
            s.score(images, PROMPTS)
        assert time.monotonic() - t0 < 30  # no hang
        msg = str(exc.value)
        assert "'clip' worker" in msg and str(Path(MAIN_VENV).resolve() / "bin" / "python") in msg
        assert "killed by signal 9" in msg and "gave up after 1 attempts" in msg
    finally:
        s.close()


def test_timeout_stops_the_worker(tiny_clip):
    s = S.get_scorer(
        "clip", weights=str(tiny_clip), device="cpu", venv=MAIN_VENV, timeout=0.01, batch_size=64
    )
    pid = s.pid
    big = [Image.new("RGB", (512, 512), (i, 0, 0)) for i in range(64)]
    t0 = time.monotonic()
    with pytest.raises(WC.WorkerTimedOut, match=r"did not answer 'score' within 0.01s and was stopped"):
        s.score(big, ["a cat"] * 64)
    assert time.monotonic() - t0 < 30
    assert not _alive(pid)
    s.close()


def test_missing_venv_names_it(monkeypatch, tiny_clip, tmp_path):
    with pytest.raises(
        UserError,
        match=r"venv=/nonexistent/venv-hpsv3 does not exist; build the reward venvs with "
        r"`bash scripts/reward-envs.sh`",
    ):
        S.get_scorer("hpsv3", weights=str(tmp_path), venv="/nonexistent/venv-hpsv3")
    monkeypatch.setenv("CHUNKGRPO_VENV_HPSV2", str(tmp_path))  # a folder without bin/python
    with pytest.raises(UserError, match=r"CHUNKGRPO_VENV_HPSV2=.* has no bin/python"):
        S.get_scorer("hpsv2.1", weights=str(tmp_path))


def test_package_missing_in_venv_is_a_preflight_error(monkeypatch, tmp_path):
    """The runner's preflight (`require_package`) checks the package in the scorer's venv, not in this
    process."""
    monkeypatch.setenv("CHUNKGRPO_VENV_HPSV3", MAIN_VENV)  # the main venv has no hpsv3
    S._CHECKED.clear()
    with pytest.raises(
        UserError, match=r"scorer 'hpsv3': package `hpsv3` is not importable by .*/bin/python .*\[venv "
    ):
        S.require_package("hpsv3", "hpsv3", "hpsv3")


def test_worker_side_configuration_errors_are_user_errors(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    t0 = time.monotonic()
    with pytest.raises(UserError, match="clip: cannot load a transformers CLIP model"):
        S.get_scorer("clip", weights=str(tmp_path), device="cpu", venv=MAIN_VENV)
    assert time.monotonic() - t0 < 60


def _nan_clip(src: Path, dst: Path) -> Path:
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    state = load_file(dst / "model.safetensors")
    state["logit_scale"] = torch.tensor(float("nan"))
    save_file(state, dst / "model.safetensors")
    return dst


def test_non_finite_scores_are_an_error(tiny_clip, tmp_path, images):
    bad = _nan_clip(tiny_clip, tmp_path / "nan-clip")
    for venv in ("", MAIN_VENV):
        with S.get_scorer("pickscore", weights=str(bad), device="cpu", venv=venv) as s:
            with pytest.raises(
                S.ScorerError,
                match=r"pickscore returned non-finite scores for images \[0, 1\] "
                r"\(prompts \['a photo of a cat', 'a red dog'\]\)",
            ):
                s.score(images[:2], PROMPTS[:2])


def test_worker_exits_when_its_parent_dies(tiny_clip, tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        from chunkgrpo.scoring import scorers as S
        s = S.get_scorer("clip", weights={str(tiny_clip)!r}, device="cpu", venv={MAIN_VENV!r})
        print(s.pid, flush=True)
        time.sleep(600)
    """))
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(parent.stdout.readline())
        assert _alive(pid)
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 20
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(pid)
    finally:
        parent.kill()
        parent.wait()


def test_training_reward_runs_through_the_worker(tiny_clip, images):
    from chunkgrpo.scoring.rewards import compute_rewards, get_reward

    fn = get_reward("pickscore", {"weights": str(tiny_clip), "venv": MAIN_VENV})
    try:
        assert isinstance(fn.scorer, S.WorkerScorer)
        r = compute_rewards({"pickscore": fn}, images, PROMPTS)["pickscore"]
        ref = S.get_scorer("pickscore", weights=str(tiny_clip), device="cpu", venv="").score(images, PROMPTS)
        torch.testing.assert_close(r, ref, rtol=1e-5, atol=1e-4)
    finally:
        fn.close()
    assert not fn.scorer.worker.alive
