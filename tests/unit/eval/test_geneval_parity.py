"""GenEval parity with the official `evaluation/evaluate_images.py` on the cases where a plain
re-implementation differs: tied scores (`np.argsort(scores)[::-1]` keeps the LATER of equal scores),
float32 thresholds, float32 `relative_position` near its margin, the 16-object cap with ties, and
`re.match` file discovery. Each case states the official verdict explicitly."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from chunkgrpo.eval import geneval as G

D = G.Detection
F32_03 = float(np.float32(0.3))  # 0.30000001192092896: what mmdet's float32 score 0.3 is as a Python float
F32_09 = float(np.float32(0.9))


def colour_by_x(mapping):
    def fn(image, dets, cls):
        return [mapping[d.box[0]] for d in dets]
    return fn


def score(raw, md, color_fn=None):
    return G.score_detections(raw, md, Image.new("RGB", (640, 640)), color_fn)


# ---- ties ------------------------------------------------------------------------------------------


def test_tie_keeps_the_later_detection_colour():
    """'a photo of a red car': a red car and a blue car, both 0.8, red listed first.
    Official: argsort([0.8, 0.8])[::-1] = [1, 0] -> the BLUE car is checked -> WRONG."""
    md = {
        "tag": "colors",
        "prompt": "a photo of a red car",
        "include": [{"class": "car", "count": 1, "color": "red"}],
    }
    raw = {"car": [D((0, 0, 50, 50), 0.8), D((100, 0, 150, 50), 0.8)]}
    rec = score(raw, md, colour_by_x({0: "red", 100: "blue"}))
    assert rec["correct"] is False
    assert rec["reason"] == "expected red car>=1, found 0 red; and 1 blue"
    assert json.loads(rec["details"])["car"][0][:4] == [100.0, 0.0, 150.0, 50.0]
    # with the blue car first the official checks the red one -> correct
    raw = {"car": [D((100, 0, 150, 50), 0.8), D((0, 0, 50, 50), 0.8)]}
    assert score(raw, md, colour_by_x({0: "red", 100: "blue"}))["correct"] is True


def test_tie_keeps_the_later_detection_position():
    """'a photo of a dog right of a teddy bear': two dogs at 0.9, the first right of the bear, the second
    left. Official: the later dog is the one checked -> it is left of the bear -> WRONG."""
    md = {
        "tag": "position",
        "prompt": "a photo of a dog right of a teddy bear",
        "include": [
            {"class": "teddy bear", "count": 1},
            {"class": "dog", "count": 1, "position": ["right of", 0]},
        ],
    }
    bear = D((200, 200, 260, 260), 0.95)
    raw = {"teddy bear": [bear], "dog": [D((400, 200, 460, 260), 0.9), D((0, 200, 60, 260), 0.9)]}
    rec = score(raw, md)
    assert rec["correct"] is False and rec["reason"] == "expected dog right of target, found left of target"
    # the same boxes with distinct scores: the more confident (right) dog wins -> correct
    raw["dog"] = [D((400, 200, 460, 260), 0.91), D((0, 200, 60, 260), 0.9)]
    assert score(raw, md)["correct"] is True


def test_ties_at_the_16_object_cap():
    """17 cups all at 0.5 (a 'counting' image would not see them; single_object does).
    Official numpy introsort on 17 equal floats gives argsort = [0, 14, 13, ..., 9, 15, 8, 6, ..., 1, 7, 16],
    reversed: [16, 7, 1, 2, 3, 4, 5, 6, 8, 15, 9, 10, 11, 12, 13, 14, 0]; the cap keeps the first 16,
    so the FIRST cup (index 0) is the one dropped and cup 16 is the most confident."""
    cups = [D((float(10 * i), 0.0, float(10 * i + 8), 8.0), 0.5) for i in range(17)]
    kept = G.filter_detections({"cup": cups}, "single_object")["cup"]
    official = [16, 7, 1, 2, 3, 4, 5, 6, 8, 15, 9, 10, 11, 12, 13, 14]
    assert [int(d.box[0]) // 10 for d in kept] == official
    assert G.official_order([0.5] * 17).tolist() == official + [0]
    # 'a photo of two cups' (count 2, no colour): which two are first does not change the verdict...
    md = {"tag": "two_object", "prompt": "p", "include": [{"class": "cup", "count": 2}]}
    assert score({"cup": cups}, md)["correct"] is True
    # ...but a colour clause does: the official classifies cups 16 and 7
    md = {
        "tag": "color_attr",
        "prompt": "two red cups",
        "include": [{"class": "cup", "count": 2, "color": "red"}],
    }
    colours = {float(10 * i): ("red" if i in (16, 7) else "blue") for i in range(17)}
    assert score({"cup": cups}, md, colour_by_x(colours))["correct"] is True
    colours = {float(10 * i): ("red" if i in (0, 1) else "blue") for i in range(17)}
    assert score({"cup": cups}, md, colour_by_x(colours))["correct"] is False


def test_up_to_16_ties_are_reverse_stable():
    """For up to 16 detections numpy's argsort is an insertion sort (stable), so reversed = later first."""
    rng = np.random.default_rng(0)
    for n in range(1, 17):
        for _ in range(20):
            s = rng.choice(np.array([0.4, 0.6, 0.8], np.float32), n)
            expected = np.argsort(s, kind="stable")[::-1]
            assert G.official_order(s).tolist() == expected.tolist()


def _numpy_classic_argsort(arrays: list[list[float]]) -> list[list[int]] | None:
    """np.argsort run with numpy's SIMD sort kernels disabled (its classic introsort, as numpy < 1.25 ran
    it for the official evaluator). None when this numpy cannot switch them off."""
    try:
        from numpy._core import _multiarray_umath as mu
    except ImportError:  # pragma: no cover - numpy 1.x
        from numpy.core import _multiarray_umath as mu
    dispatch = [f for f in getattr(mu, "__cpu_dispatch__", []) if mu.__cpu_features__.get(f)]
    code = ("import json,sys,numpy as np\n"
            "a=json.load(sys.stdin)\n"
            "print(json.dumps([np.argsort(np.asarray(x,dtype=np.float32)).tolist() for x in a]))\n")
    env = {**os.environ, "NPY_DISABLE_CPU_FEATURES": " ".join(dispatch)}
    proc = subprocess.run(
        [sys.executable, "-c", code],
        input=json.dumps(arrays),
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    if proc.returncode != 0:
        return None
    return json.loads(proc.stdout)


def test_classic_argsort_equals_numpy_introsort_on_ties():
    """The emulation is checked against numpy itself with its SIMD sorts switched off (the algorithm the
    official environment ran), on tie-heavy score arrays of 1-120 detections."""
    rng = np.random.default_rng(7)
    arrays = []
    for n in list(range(1, 121)) * 3:
        kind = n % 4
        if kind == 0:
            a = rng.choice([0.31, 0.5, 0.8, 0.95], n)
        elif kind == 1:
            a = rng.random(n)
        elif kind == 2:
            a = np.round(rng.random(n), 1)
        else:
            a = np.sort(rng.choice([0.1, 0.2, 0.3], n))[::-1]
        arrays.append(np.asarray(a, np.float32).tolist())
    expected = _numpy_classic_argsort(arrays)
    if expected is None:
        pytest.skip("this numpy cannot disable its SIMD sort kernels (NPY_DISABLE_CPU_FEATURES)")
    mismatches = [i for i, (a, e) in enumerate(zip(arrays, expected)) if G.classic_argsort(a).tolist() != e]
    assert mismatches == []


# ---- float32 --------------------------------------------------------------------------------------


@pytest.mark.parametrize("s,kept", [
    (F32_03, False),                      # exactly float32(0.3): official drops it (0.3f > 0.3f is false)
    (0.3000000001, False),                # rounds to float32(0.3) -> dropped; a float64 compare would keep it
    (float(np.nextafter(np.float32(0.3), np.float32(1))), True),  # the next float32 above 0.3
    (0.3, False),
])
def test_threshold_is_compared_in_float32(s, kept):
    md = {"tag": "single_object", "prompt": "a photo of a cat", "include": [{"class": "cat", "count": 1}]}
    assert score({"cat": [D((0, 0, 10, 10), s)]}, md)["correct"] is kept


@pytest.mark.parametrize("s", [F32_09, 0.9000000001])
def test_counting_threshold_is_compared_in_float32(s):
    """'a photo of two clocks': scores 0.95 and a second score that is float32(0.9) once stored as mmdet's
    float32 (0.9000000001 > 0.9 in float64, but rounds to 0.9f) -> dropped (0.9f > 0.9f is false)
    -> official: only one clock -> WRONG."""
    md = {"tag": "counting", "prompt": "a photo of two clocks", "include": [{"class": "clock", "count": 2}],
          "exclude": [{"class": "clock", "count": 3}]}
    rec = score({"clock": [D((0, 0, 10, 10), 0.95), D((20, 0, 30, 10), s)]}, md)
    assert rec["correct"] is False and rec["reason"] == "expected clock>=2, found 1"


def test_relative_position_margin_in_float32():
    """A dog box whose float64 direction is 0.50000000x (-> 'right of') but whose float32 direction is exactly
    0.5 (not > 0.5). Official (float32): no horizontal relation -> 'a dog right of a teddy bear' is WRONG."""
    dog = (288.6412048339844, 297.0646667480469, 436.6412048339844, 363.0646667480469)
    bear = (234.5, 215.0, 365.5, 385.0)
    assert G.relative_position(dog, bear) == set()
    # the float64 computation says 'right of' (what the project did before)
    boxes = np.array([dog, bear], dtype=np.float64).reshape(2, 2, 2)
    ca, cb = boxes.mean(axis=-2)
    da, db = np.abs(np.diff(boxes, axis=-2))[..., 0, :]
    off = ca - cb
    dx64 = (max(abs(off[0]) - 0.1 * (da[0] + db[0]), 0) * np.sign(off[0])) / np.linalg.norm(off)
    assert dx64 > 0.5
    md = {
        "tag": "position",
        "prompt": "a photo of a dog right of a teddy bear",
        "include": [
            {"class": "teddy bear", "count": 1},
            {"class": "dog", "count": 1, "position": ["right of", 0]},
        ],
    }
    rec = score({"teddy bear": [D(bear, 0.9)], "dog": [D(dog, 0.9)]}, md)
    assert rec["correct"] is False and rec["reason"] == "expected dog right of target, found  target"


# ---- file discovery -------------------------------------------------------------------------------


def test_file_discovery_is_re_match(tmp_path):
    """The official scores every file whose name *starts with* digits + '.png' (re.match): 00009.png.bak
    counts; names not starting so (grid.png, x00001.png, 00001.jpg, 00002.PNG, 00003png) do not."""
    md = {"tag": "single_object", "prompt": "a photo of a cat", "include": [{"class": "cat", "count": 1}]}
    G.write_layout([md], tmp_path)
    samples = tmp_path / "00000" / "samples"
    names = [
        "00000.png",
        "00009.png.bak",
        "7.png~",
        "grid.png",
        "x00001.png",
        "00001.jpg",
        "00002.PNG",
        "00003png",
    ]
    for n in names:
        Image.new("RGB", (8, 8)).save(samples / n, format="PNG")
    found = sorted(p.name for p, _ in G.iter_samples(tmp_path))
    assert found == ["00000.png", "00009.png.bak", "7.png~"]
    assert G.unusual_sample_names(tmp_path) == ["00000/samples/00009.png.bak", "00000/samples/7.png~"]
    assert "re.match" in G.FILE_DISCOVERY
