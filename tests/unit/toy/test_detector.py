"""The exact toy detector + the project's own GenEval rules on rendered scenes."""

import numpy as np
import pytest

from chunkgrpo.eval.geneval import Detector, relative_position, score_detections
from chunkgrpo.toy.detector import (
    ToyColorClassifier,
    ToyDetector,
    graded_credit,
    partial_credit,
    score,
    shape_similarity,
)
from chunkgrpo.toy.world import COLORS, RELATIONS, SHAPES, TAGS, Scene, ToyObject, World, metadata


@pytest.fixture(scope="module")
def scenes():
    w = World(0)
    return w.sample(180, "train", seed=11) + w.sample(120, "heldout", seed=12)


def test_is_a_geneval_detector():
    assert isinstance(ToyDetector(), Detector)


def test_detector_recovers_the_ground_truth_exactly(scenes):
    det, cf = ToyDetector(), ToyColorClassifier()
    assert {s.metadata["tag"] for s in scenes} == set(TAGS)
    for s in scenes:
        img = s.image()
        found = det.detect(img)
        got = []
        for cls, dets in found.items():
            colors = cf(img, dets, cls)
            for d, c in zip(dets, colors):
                assert d.score == 1.0
                got.append((cls, c, tuple(int(v) for v in d.box), d.mask.sum()))
        want = [(o.shape, o.color, o.box, o.mask(s.size).sum()) for o in s.objects]
        assert sorted(got) == sorted(want), s.prompt


def test_true_caption_scores_one(scenes):
    for s in scenes:
        r = score(s.render(), s.metadata)
        assert r["correct"], (s.prompt, r["reason"])
        assert partial_credit(s.render(), s.metadata) == 1.0
        assert graded_credit(s.render(), s.metadata) == 1.0


def _changed(md):
    """Captions with exactly one attribute changed (a shape, a colour, the count or the relation)."""
    tag, inc = md["tag"], md["include"]
    out = []
    if tag == "single_object":
        out = [metadata(tag, shape=s) for s in SHAPES if s != inc[0]["class"]]
    elif tag == "two_object":
        a, b = inc[0]["class"], inc[1]["class"]
        out = [metadata(tag, shapes=(a, s)) for s in SHAPES if s not in (a, b)]
    elif tag == "counting":
        n, s = inc[0]["count"], inc[0]["class"]
        out = [metadata(tag, shape=s, count=m) for m in range(1, 5) if m != n]
        out += [metadata(tag, shape=t, count=n) for t in SHAPES if t != s]
    elif tag == "colors":
        out = [metadata(tag, color=c, shape=inc[0]["class"]) for c in COLORS if c != inc[0]["color"]]
    elif tag == "position":
        target, subject, rel = inc[0]["class"], inc[1]["class"], inc[1]["position"][0]
        out = [metadata(tag, shapes=(subject, target), relation=r) for r in RELATIONS if r != rel]
    elif tag == "color_attr":
        (c1, s1), (c2, s2) = [(c["color"], c["class"]) for c in inc]
        out = [metadata(tag, pairs=((c, s1), (c2, s2))) for c in COLORS if c not in (c1, c2)]
        # swapped colours: the same objects and colours, bound the other way round
        if c1 != c2:
            out.append(metadata(tag, pairs=((c2, s1), (c1, s2))))
    assert out
    return out


def test_one_attribute_changed_scores_zero(scenes):
    det, cf = ToyDetector(), ToyColorClassifier()
    n = 0
    for s in scenes[::2]:
        img = s.image()
        raw = det.detect(img)
        for md in _changed(s.metadata):
            r = score_detections(raw, md, img, cf)
            assert not r["correct"], (s.prompt, md["prompt"])
            n += 1
        assert partial_credit(img, md) < 1.0
    assert n > 500


def _pair_scene(dx, dy, rel):
    """An 8×8-px square at (2, 2) and an 8×8-px circle offset by (dx, dy) px: the caption says the circle
    is `rel`."""
    sq = ToyObject("square", "red", (2, 2, 10, 10))
    ci = ToyObject("circle", "blue", (2 + dx, 2 + dy, 10 + dx, 10 + dy))
    md = metadata("position", shapes=("circle", "square"), relation=rel)
    return Scene(md["prompt"], md, [sq, ci])


@pytest.mark.parametrize("rel,axis", [("right of", 0), ("below", 1)])
def test_position_at_the_margin_follows_the_rule(rel, axis):
    # GenEval shrinks the centre offset by 0.1 × (8 + 8) = 1.6 px per axis, then needs the shrunk offset's
    # direction > 0.5 along the relation's axis. Diagonal placements on the cell grid straddle that
    # boundary: 10 px off-axis, 8 px along the axis gives exactly 0.5 (not `rel`), 10 px gives 0.59 (`rel`).
    for off in range(10, 22, 2):  # off-axis ≥ 10 px: the boxes never touch
        truths = []
        for along in range(0, 22, 2):
            dx, dy = (along, off) if axis == 0 else (off, along)
            s = _pair_scene(dx, dy, rel)
            ci, sq = s.objects[1], s.objects[0]
            truth = rel in relative_position(ci.box, sq.box, 0.1)
            assert score(s.render(), s.metadata)["correct"] == truth, (dx, dy)
            truths.append(truth)
        assert truths == sorted(truths)  # one threshold along the axis
        if off == 10:
            assert truths[4] is False and truths[5] is True  # the boundary case: 8 px vs 10 px


def test_position_needs_the_target_and_the_subject():
    s = _pair_scene(12, 0, "right of")
    only_square = Scene(s.prompt, s.metadata, [s.objects[0]])
    r = score(only_square.render(), s.metadata)
    assert not r["correct"] and "expected circle>=1" in r["reason"]


def test_slivers_and_specks_are_not_objects():
    img = np.full((32, 32, 3), 255, np.uint8)
    img[5, 2:30] = (220, 20, 30)  # a 1-px line: no interior
    img[20:22, 20:22] = (20, 60, 230)  # a 2×2 speck
    img[10:18, 10:18] = (20, 150, 40)  # a real square
    found = ToyDetector().detect(img)
    assert list(found) == ["square"] and len(found["square"]) == 1


def test_colour_tolerance_and_unknown_colours():
    s = World(0).scene(metadata("colors", color="blue", shape="square"), np.random.default_rng(0))
    img = s.render().astype(int)
    noisy = np.clip(img + np.random.default_rng(1).integers(-25, 26, img.shape), 0, 255).astype(np.uint8)
    assert score(noisy, s.metadata)["correct"]
    grey = img.copy()
    grey[s.objects[0].mask()] = (128, 128, 128)  # not a palette colour
    assert ToyDetector().detect(grey.astype(np.uint8)) == {}


def test_counting_partial_credit_is_graded():
    w = World(0)
    md3 = metadata("counting", shape="square", count=3)
    rng = np.random.default_rng(0)
    credits = []
    for n in (1, 2, 3, 4):
        s = w.scene(metadata("counting", shape="square", count=n), rng)
        credits.append(partial_credit(s.render(), md3))
    assert credits[2] == 1.0
    assert credits[1] > credits[0] and credits[1] < 1 and credits[3] < 1


def test_partial_credit_counts_satisfied_clauses():
    w = World(0)
    rng = np.random.default_rng(0)
    s = w.scene(metadata("color_attr", pairs=(("red", "circle"), ("blue", "square"))), rng)
    half = metadata("color_attr", pairs=(("red", "circle"), ("green", "square")))
    none = metadata("color_attr", pairs=(("green", "circle"), ("pink", "square")))
    assert partial_credit(s.render(), half) == pytest.approx(0.5)
    assert partial_credit(s.render(), none) == 0.0


def test_shape_similarity_is_one_on_the_template_and_highest_for_the_own_shape():
    w = World(0)
    rng = np.random.default_rng(3)
    for shape in SHAPES:
        obj = w.scene(metadata("single_object", shape=shape), rng).objects[0]
        sims = {t: shape_similarity(obj.mask(), t) for t in SHAPES}
        assert sims[shape] == 1.0
        assert max(v for t, v in sims.items() if t != shape) < 0.8, sims
    assert shape_similarity(np.zeros((32, 32), bool), "circle") == 0.0


def test_graded_credit_grows_as_the_image_approaches_the_caption():
    """1.0 iff correct; a wrong colour halves a clause; a blob that is more like the asked shape earns more;
    counting grades the number found."""
    w = World(0)
    rng = np.random.default_rng(0)
    s = w.scene(metadata("color_attr", pairs=(("red", "circle"), ("blue", "square"))), rng)
    img = s.render()
    assert graded_credit(img, s.metadata) == 1.0
    one_colour = graded_credit(img, metadata("color_attr", pairs=(("red", "circle"), ("green", "square"))))
    no_colour = graded_credit(img, metadata("color_attr", pairs=(("green", "circle"), ("pink", "square"))))
    assert one_colour == pytest.approx(0.75) and no_colour == pytest.approx(0.5)
    # a circle eroded pixel by pixel: the credit for "a red circle" falls monotonically
    md = metadata("colors", color="red", shape="circle")
    scene = w.scene(md, rng)
    obj = scene.objects[0]
    ys, xs = np.nonzero(obj.mask())
    credits = []
    for k in (0, 4, 8, 12):
        im = scene.render().copy()
        for y, x in list(zip(ys, xs))[:k]:
            im[y, x] = (255, 255, 255)
        credits.append(graded_credit(im, md))
    assert credits[0] == 1.0 and all(a >= b for a, b in zip(credits, credits[1:])) and credits[-1] < 1.0
    assert graded_credit(np.full((32, 32, 3), 255, np.uint8), md) == 0.0  # nothing drawn, no credit
    # counting: 3 asked, 1..4 drawn
    counts = []
    for n in (1, 2, 3, 4):
        counts.append(graded_credit(w.scene(metadata("counting", shape="square", count=n), rng).render(),
                                    metadata("counting", shape="square", count=3)))
    assert counts[2] == 1.0 and counts[0] < counts[1] < 1.0 and counts[3] < 1.0


def test_graded_position_credit_needs_the_relation():
    w = World(0)
    rng = np.random.default_rng(5)
    md = metadata("position", shapes=("circle", "square"), relation="left of")
    s = w.scene(md, rng)
    assert graded_credit(s.render(), md) == 1.0
    flipped = metadata("position", shapes=("circle", "square"), relation="right of")
    # the target clause is met (1.0); the subject clause is not (the circle is on the wrong side: 1.0 × 0.5,
    # or the square standing in for it on the right side: its similarity to a circle, < 1)
    assert 0.75 <= graded_credit(s.render(), flipped) < 0.99
