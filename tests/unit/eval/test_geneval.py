"""GenEval: the official scoring rules over synthetic detections (every tag, counting exactness, colour,
position and its margin, include/exclude), layout, aggregation, and the detector / colour backends on
tiny random-weight models."""

from __future__ import annotations

import json
import sys
from collections import Counter

import numpy as np
import pytest
from PIL import Image

from chunkgrpo.errors import UserError
from chunkgrpo.eval import geneval as G
from chunkgrpo.eval import geneval_models as GM

D = G.Detection


def box(x, y, w=10, h=10, score=0.95, mask=None):
    return D((x, y, x + w, y + h), score, mask)


def stub_colors(mapping):
    """colour classifier stub: the colour is looked up by the detection's x1."""
    calls = []

    def fn(image, dets, cls):
        calls.append((cls, len(dets)))
        return [mapping[d.box[0]] for d in dets]

    fn.calls = calls
    return fn


def run(raw, md, color_fn=None, rules=None):
    return G.score_detections(raw, md, Image.new("RGB", (200, 200)), color_fn, rules)


# ---- metadata --------------------------------------------------------------------------------------

def test_load_official_metadata_and_names():
    md = G.load_metadata()
    assert len(md) == 553
    assert Counter(m["tag"] for m in md) == {"single_object": 80, "two_object": 99, "counting": 80,
                                             "colors": 94, "position": 100, "color_attr": 100}
    names = G.load_object_names()
    assert len(names) == 80 and names[0] == "person" and "tv remote" in names
    assert all(c["class"] in names for m in md for c in m["include"] + m.get("exclude", []))
    jobs = G.generation_plan(md, "/out")
    assert len(jobs) == 2212 and str(jobs[5].path) == "/out/00001/samples/00001.png"


def test_metadata_validation(tmp_path):
    bad = tmp_path / "m.jsonl"
    bad.write_text(json.dumps({"tag": "colors", "prompt": "p", "include": [{"class": "cat", "count": 1,
                                                                           "color": "teal"}]}) + "\n")
    with pytest.raises(UserError, match="teal"):
        G.load_metadata(bad)
    bad.write_text(json.dumps({"tag": "position", "prompt": "p", "include": [
        {"class": "cat", "count": 1, "position": ["left of", 0]}]}) + "\n")
    with pytest.raises(UserError, match="earlier include"):
        G.load_metadata(bad)
    with pytest.raises(UserError, match="does not exist"):
        G.load_metadata(tmp_path / "nope.jsonl")


# ---- thresholds, ordering, caps ---------------------------------------------------------------------


def test_filter_threshold_strict_sorted_and_capped():
    raw = {"cat": [box(0, 0, score=s) for s in (0.3, 0.31, 0.9, 0.5)], "dog": [box(0, 0, score=0.2)]}
    out = G.filter_detections(raw, "single_object")
    assert [d.score for d in out["cat"]] == [0.9, 0.5, 0.31]  # > 0.3 (strict), most confident first
    assert "dog" not in out
    assert "cat" not in G.filter_detections(raw, "counting")  # 0.9 is not > 0.9
    many = {"cup": [box(i * 12, 0, score=0.5 + i / 100) for i in range(20)]}
    assert len(G.filter_detections(many, "single_object")["cup"]) == 16
    # NMS only when max_overlap < 1
    dup = {"cup": [box(0, 0, score=0.9), box(1, 1, score=0.8)]}
    assert len(G.filter_detections(dup, "single_object")["cup"]) == 2
    assert len(G.filter_detections(dup, "single_object", G.GenEvalRules(max_overlap=0.5))["cup"]) == 1


def test_single_and_two_object():
    single = {
        "tag": "single_object",
        "prompt": "a photo of a bench",
        "include": [{"class": "bench", "count": 1}],
    }
    assert run({"bench": [box(0, 0)]}, single)["correct"]
    r = run({"bench": [box(0, 0, score=0.25)], "cat": [box(0, 0)]}, single)
    assert not r["correct"] and r["reason"] == "expected bench>=1, found 0"
    two = {"tag": "two_object", "prompt": "a bench and a ball",
           "include": [{"class": "bench", "count": 1}, {"class": "sports ball", "count": 1}]}
    assert run({"bench": [box(0, 0)], "sports ball": [box(50, 50, score=0.4)]}, two)["correct"]
    r = run({"bench": [box(0, 0)]}, two)
    assert not r["correct"] and "sports ball>=1" in r["reason"]
    # extra objects do not matter without an exclude clause
    assert run({"bench": [box(0, 0), box(20, 0)], "sports ball": [box(50, 50)], "dog": [box(9, 9)]}, two)[
        "correct"
    ]


@pytest.mark.parametrize("n_found,expected", [(1, False), (2, True), (3, False), (4, False)])
def test_counting_is_exact(n_found, expected):
    md = {"tag": "counting", "prompt": "a photo of two clocks", "include": [{"class": "clock", "count": 2}],
          "exclude": [{"class": "clock", "count": 3}]}
    raw = {"clock": [box(i * 20, 0, score=0.95) for i in range(n_found)]}
    r = run(raw, md)
    assert r["correct"] is expected
    if n_found > 2:
        assert f"expected clock<3, found {n_found}" in r["reason"]


def test_counting_uses_the_0_9_threshold():
    md = {"tag": "counting", "prompt": "two clocks", "include": [{"class": "clock", "count": 2}],
          "exclude": [{"class": "clock", "count": 3}]}
    # third clock at 0.85 is ignored for counting -> exactly two -> correct
    raw = {"clock": [box(0, 0, score=0.95), box(20, 0, score=0.92), box(40, 0, score=0.85)]}
    assert run(raw, md)["correct"]
    # only one clock above 0.9 -> wrong, although two are above 0.3
    raw = {"clock": [box(0, 0, score=0.95), box(20, 0, score=0.89)]}
    assert not run(raw, md)["correct"]
    # the same detections pass a non-counting clause at 0.3
    assert run(raw, {**md, "tag": "two_object", "exclude": []})["correct"]


def test_exclude_is_or_and_include_is_and():
    md = {
        "tag": "counting",
        "prompt": "p",
        "include": [{"class": "cat", "count": 1}, {"class": "dog", "count": 1}],
        "exclude": [{"class": "cat", "count": 2}, {"class": "bird", "count": 1}],
    }
    ok = {"cat": [box(0, 0)], "dog": [box(30, 0)]}
    assert run(ok, md)["correct"]
    assert not run({**ok, "bird": [box(60, 0)]}, md)["correct"]  # any exclude clause failing fails the image
    assert not run({"cat": [box(0, 0)]}, md)["correct"]  # every include clause must hold


# ---- colour -----------------------------------------------------------------------------------------


def test_colors_match_and_mismatch():
    md = {"tag": "colors", "prompt": "a blue fire hydrant", "include": [{"class": "fire hydrant", "count": 1,
                                                                         "color": "blue"}]}
    raw = {"fire hydrant": [box(0, 0, score=0.9), box(50, 0, score=0.8)]}
    fn = stub_colors({0: "blue", 50: "red"})
    assert run(raw, md, fn)["correct"]
    assert fn.calls == [("fire hydrant", 1)]  # only the `count` most confident objects are classified
    fn = stub_colors({0: "red", 50: "blue"})  # the most confident one is red -> wrong even if another is blue
    r = run(raw, md, fn)
    assert not r["correct"] and r["reason"] == "expected blue fire hydrant>=1, found 0 blue; and 1 red"
    with pytest.raises(UserError, match="colour classifier"):
        run(raw, md, None)


def test_color_attr_two_classes():
    md = {"tag": "color_attr", "prompt": "a purple wine glass and a black apple",
          "include": [{"class": "wine glass", "count": 1, "color": "purple"},
                      {"class": "apple", "count": 1, "color": "black"}]}
    raw = {"wine glass": [box(0, 0)], "apple": [box(50, 0)]}
    assert run(raw, md, stub_colors({0: "purple", 50: "black"}))["correct"]
    r = run(raw, md, stub_colors({0: "purple", 50: "red"}))
    assert not r["correct"] and "expected black apple>=1" in r["reason"]
    # swapped attributes are wrong
    assert not run(raw, md, stub_colors({0: "black", 50: "purple"}))["correct"]


# ---- position ---------------------------------------------------------------------------------------


def test_relative_position_margin():
    a = (0, 0, 10, 10)
    # centres 1.5 apart, margin 0.1*(10+10)=2 -> revised 0 -> no relation
    assert G.relative_position((1.5, 0, 11.5, 10), a) == set()
    # 3 apart: revised 1, direction 1/3 < 0.5 -> still no relation
    assert G.relative_position((3, 0, 13, 10), a) == set()
    # 5 apart: revised 3, direction 0.6 -> right of
    assert G.relative_position((5, 0, 15, 10), a) == {"right of"}
    assert G.relative_position((-5, 0, 5, 10), a) == {"left of"}
    # image y grows downwards
    assert G.relative_position((0, 30, 10, 40), a) == {"below"}
    assert G.relative_position((0, -30, 10, -20), a) == {"above"}
    # diagonal far away: both relations
    assert G.relative_position((50, 50, 60, 60), a) == {"right of", "below"}
    # the margin is proportional to both boxes: big boxes need a bigger offset
    assert G.relative_position((5, 0, 105, 10), (0, 0, 100, 10)) == set()
    # a zero margin makes small offsets count
    assert G.relative_position((3, 0, 13, 10), a, margin=0.0) == {"right of"}


def test_position_rules():
    md = {
        "tag": "position",
        "prompt": "a photo of a dog right of a teddy bear",
        "include": [
            {"class": "teddy bear", "count": 1},
            {"class": "dog", "count": 1, "position": ["right of", 0]},
        ],
    }
    bear = {"teddy bear": [box(0, 50, 40, 40)]}
    assert run({**bear, "dog": [box(100, 50, 40, 40)]}, md)["correct"]
    r = run({**bear, "dog": [box(-100, 50, 40, 40)]}, md)
    assert not r["correct"] and r["reason"] == "expected dog right of target, found left of target"
    # inside the margin: no relation at all
    r = run({**bear, "dog": [box(5, 50, 40, 40)]}, md)
    assert not r["correct"] and "found  target" in r["reason"]
    # no teddy bear -> the target group is missing
    r = run({"dog": [box(100, 50, 40, 40)]}, md)
    assert not r["correct"] and "no target for dog to be right of" in r["reason"]
    # only the most confident dog is checked; a second dog on the wrong side does not matter
    raw = {**bear, "dog": [box(100, 50, 40, 40, score=0.9), box(-100, 50, 40, 40, score=0.8)]}
    assert run(raw, md)["correct"]


def test_position_target_failing_colour_is_not_a_target():
    md = {"tag": "position", "prompt": "p",
          "include": [{"class": "cat", "count": 1, "color": "red"}, {"class": "dog", "count": 1,
                                                                     "position": ["below", 0]}]}
    raw = {"cat": [box(0, 0)], "dog": [box(0, 100)]}
    assert run(raw, md, stub_colors({0: "red"}))["correct"]
    r = run(raw, md, stub_colors({0: "blue"}))
    assert not r["correct"] and "no target for dog" in r["reason"]


def test_record_format():
    md = {"tag": "single_object", "prompt": "a photo of a cow", "include": [{"class": "cow", "count": 1}]}
    rec = run({"cow": [box(1, 2, score=0.5)]}, md)
    assert set(rec) >= {"tag", "prompt", "correct", "reason", "metadata", "details"}
    assert json.loads(rec["metadata"]) == md
    assert json.loads(rec["details"]) == {"cow": [[1.0, 2.0, 11.0, 12.0, 0.5]]}


# ---- colour crops -----------------------------------------------------------------------------------


def test_color_crops_mask_on_grey_cropped_to_box():
    img = Image.new("RGB", (20, 10), (255, 0, 0))
    mask = np.zeros((10, 20), bool)
    mask[2:5, 3:6] = True
    (crop,) = GM.color_crops(img, [D((2.0, 1.0, 8.0, 6.0), 0.9, mask)])
    assert crop.size == (6, 5)
    a = np.asarray(crop)
    assert tuple(a[2, 2]) == (255, 0, 0)  # inside the mask: the image
    assert tuple(a[0, 0]) == (153, 153, 153)  # outside: #999 grey
    (full,) = GM.color_crops(img, [D((0, 0, 20, 10), 0.9, None)], crop=False)
    assert full.size == (20, 10)
    with pytest.raises(ValueError, match="mask shape"):
        GM.color_crops(img, [D((0, 0, 1, 1), 0.9, np.zeros((3, 3), bool))])


# ---- layout + aggregation ---------------------------------------------------------------------------


METAS = [
    {"tag": "single_object", "prompt": "a photo of a cat", "include": [{"class": "cat", "count": 1}]},
    {"tag": "single_object", "prompt": "a photo of a dog", "include": [{"class": "dog", "count": 1}]},
    {"tag": "counting", "prompt": "two cats", "include": [{"class": "cat", "count": 2}],
     "exclude": [{"class": "cat", "count": 3}]},
]


class DictDetector:
    name = "dict"
    comparable_to_official = False

    def __init__(self, table):
        self.table = table

    def detect(self, image):
        return self.table.get(str(image), {})


def test_layout_plan_and_discovery(tmp_path):
    jobs = G.generation_plan(METAS, tmp_path, n_samples=4, base_seed=7)
    assert len(jobs) == 12
    assert jobs[0].path == tmp_path / "00000" / "samples" / "00000.png"
    assert jobs[5].index == 1 and jobs[5].sample == 1 and jobs[5].seed == 8
    assert {j.seed for j in jobs if j.sample == 2} == {9}  # same seed per sample index across prompts
    G.write_layout(METAS, tmp_path)
    assert json.loads((tmp_path / "00002" / "metadata.jsonl").read_text()) == METAS[2]
    for j in jobs:
        Image.new("RGB", (8, 8)).save(j.path)
    (tmp_path / "00000" / "samples" / "00009.jpg").write_bytes(b"")  # ignored (PNG only)
    (tmp_path / "00000" / "samples" / "grid.png").write_bytes(b"")  # ignored (not digits)
    (tmp_path / "notes").mkdir()  # ignored (not a digit folder)
    found = list(G.iter_samples(tmp_path))
    assert len(found) == 12 and found[4][1] == METAS[1]
    with pytest.raises(UserError, match="n_samples"):
        G.generation_plan(METAS, tmp_path, n_samples=0)


def test_evaluate_folder_and_summary(tmp_path):
    G.write_layout(METAS, tmp_path)
    table = {}
    for j in G.generation_plan(METAS, tmp_path, n_samples=4):
        Image.new("RGB", (8, 8)).save(j.path)
        if j.index == 0:  # cat: 3/4 correct
            table[str(j.path)] = {"cat": [box(0, 0)]} if j.sample < 3 else {}
        elif j.index == 1:  # dog: 0/4 correct
            table[str(j.path)] = {"cat": [box(0, 0)]}
        else:  # two cats: 1/4 correct
            table[str(j.path)] = {"cat": [box(0, 0), box(20, 0)] + ([box(40, 0)] if j.sample else [])}
    det = DictDetector(table)
    records = G.evaluate_folder(tmp_path, det)
    assert len(records) == 12 and all(r["filename"] for r in records)
    s = G.summarize(records, det)
    assert s["tasks"]["single_object"] == {"correct": 3, "total": 8, "score": 3 / 8}
    assert s["tasks"]["counting"]["score"] == 1 / 4
    assert s["overall"] == pytest.approx((3 / 8 + 1 / 4) / 2)  # mean over tasks, not over images (4/12)
    assert s["correct_images"] == pytest.approx(4 / 12)
    assert s["correct_prompts"] == pytest.approx(2 / 3)
    assert s["n_prompts"] == 3 and s["complete"] is False
    assert s["comparable_to_official"] is False and s["detector"]["name"] == "dict"


def test_summary_all_tasks_comparable_flag():
    recs = [{"tag": t, "correct": i % 2 == 0, "metadata": f"{t}{i}"} for t in G.TAGS for i in range(4)]
    official = {"name": "mmdet", "comparable_to_official": True}
    s = G.summarize(recs, official)
    assert s["complete"] and s["overall"] == pytest.approx(0.5) and s["comparable_to_official"]
    assert not G.summarize(recs, official, G.GenEvalRules(threshold=0.4))["comparable_to_official"]
    assert list(s["tasks"]) == list(G.TAGS)


def test_rules_validation():
    with pytest.raises(UserError, match="counting_threshold"):
        G.GenEvalRules(counting_threshold=1.5)
    with pytest.raises(UserError, match="max_objects"):
        G.GenEvalRules.from_dict({"max_objects": 0})
    assert G.GenEvalRules().is_official


def test_mask_to_box_like_mmdet():
    m = np.zeros((10, 20), bool)
    m[2:5, 3:7] = True
    assert GM.mask_to_box(m) == (3.0, 2.0, 7.0, 5.0)
    assert GM.mask_to_box(np.zeros((4, 4), bool)) == (0.0, 0.0, 0.0, 0.0)


# ---- backends on tiny random models -------------------------------------------------------------------


def test_mmdet_import_guard(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "mmdet", None)
    with pytest.raises(UserError, match="images/eval"):
        GM.MMDetDetector(tmp_path)


@pytest.fixture(scope="module")
def tiny_mask2former(tmp_path_factory):
    from tests.unit.eval.tiny_mask2former import make_tiny_mask2former

    names = [f"class{i}" for i in range(80)]
    return make_tiny_mask2former(tmp_path_factory.mktemp("m2f"), names, num_queries=10), names


def test_transformers_mask2former_detector(tiny_mask2former):
    d, names = tiny_mask2former
    det = GM.TransformersMask2FormerDetector(d, class_names=names, device="cpu", max_per_image=20)
    assert isinstance(det, G.Detector) and det.comparable_to_official is False
    img = Image.fromarray(np.random.default_rng(0).integers(0, 255, (80, 100, 3), dtype=np.uint8))
    out = det.detect(img)
    dets = [x for v in out.values() for x in v]
    assert 0 < len(dets) <= 20 and set(out) <= set(names)
    for x in dets:
        assert x.mask.shape == (80, 100) and x.mask.dtype == bool
        assert 0 <= x.score <= 1 and 0 <= x.box[0] <= x.box[2] <= 100 and 0 <= x.box[1] <= x.box[3] <= 80
    md = {"tag": "single_object", "prompt": "p", "include": [{"class": names[0], "count": 1}]}
    rec = G.score_image(img, md, det)
    assert isinstance(rec["correct"], bool)
    assert G.summarize([rec], det)["comparable_to_official"] is False
    with pytest.raises(UserError, match="80 labels but 10 class names"):
        GM.TransformersMask2FormerDetector(d, class_names=names[:10], device="cpu")


def test_clip_color_classifier_tiny(tmp_path):
    from chunkgrpo.testing.clip import make_tiny_clip

    make_tiny_clip(tmp_path / "clip")
    clf = GM.ClipColorClassifier(tmp_path / "clip", device="cpu")
    img = Image.fromarray(np.random.default_rng(1).integers(0, 255, (40, 60, 3), dtype=np.uint8))
    mask = np.zeros((40, 60), bool)
    mask[5:20, 5:30] = True
    dets = [D((5, 5, 30, 20), 0.9, mask), D((0, 0, 60, 40), 0.8, None)]
    colors = clf(img, dets, "cat")
    assert len(colors) == 2 and set(colors) <= set(G.COLORS)
    assert clf(img, dets, "cat") == colors  # deterministic, head cached
    assert tuple(clf.head("cat").shape)[1] == 10 and "cat" in clf._heads
    md = {"tag": "colors", "prompt": "p", "include": [{"class": "cat", "count": 1, "color": colors[0]}]}
    assert G.evaluate_detections({"cat": dets}, md, img, clf)[0]
