"""The toy world: captions ⇄ GenEval metadata, the split, deterministic scenes."""

import itertools

import numpy as np
import pytest

from chunkgrpo.errors import UserError
from chunkgrpo.eval.geneval import validate_metadata
from chunkgrpo.toy.world import (
    ALIGN,
    COLORS,
    PALETTE,
    SHAPE_SIZES,
    SHAPES,
    TAGS,
    ToyObject,
    World,
    all_prompts,
    caption,
    classify_shape,
    parse_caption,
    shape_mask,
)


def test_every_caption_parses_back_to_its_metadata():
    n = 0
    for tag, mds in all_prompts().items():
        for md in mds:
            validate_metadata(md, where=md["prompt"])  # the project's GenEval validator accepts it
            assert parse_caption(md["prompt"]) == md
            assert parse_caption("  " + md["prompt"].upper() + " ") == md  # case / whitespace tolerant
            n += 1
    assert n == 6 + 30 + 24 + 48 + 120 + 30 * 64


@pytest.mark.parametrize("bad", ["a photo of a dog", "a photo of two circle", "a photo of one circles",
                                 "a photo of a red circle and a square", "a photo of a circle and a circle",
                                 "a photo of a circle near a square", ""])
def test_non_captions_are_rejected_with_the_prompt_named(bad):
    with pytest.raises(UserError, match="not a toy-world caption"):
        parse_caption(bad)


def test_articles_follow_the_word():
    assert caption("colors", color="orange", shape="circle") == "a photo of an orange circle"
    assert caption("counting", shape="cross", count=3) == "a photo of three crosses"
    assert caption("counting", shape="cross", count=1) == "a photo of one cross"


def test_palette_colours_are_far_apart_and_geneval_colours():
    from chunkgrpo.eval.geneval import COLORS as GENEVAL_COLORS

    assert set(COLORS) <= set(GENEVAL_COLORS)
    refs = np.array([*PALETTE.values(), (255, 255, 255)], float)
    d = np.linalg.norm(refs[:, None] - refs[None], axis=-1) + np.eye(len(refs)) * 1e9
    assert d.min() > 70


@pytest.mark.parametrize("shape", SHAPES)
def test_shape_classifier_is_exact_on_every_rendered_size(shape):
    for w, h in SHAPE_SIZES[shape]:
        m = shape_mask(shape, w, h)
        assert m[0].any() and m[-1].any() and m[:, 0].any() and m[:, -1].any()  # fills its box
        obj = ToyObject(shape, "red", (4, 6, 4 + 2 * w, 6 + 2 * h))  # on the cell grid, 2×2 px per cell
        assert obj.mask().sum() == 4 * m.sum()
        assert classify_shape(obj.mask()) == shape


def test_split_holds_out_combinations_never_seen_in_training():
    w = World(0)
    train, held = w.prompts("train"), w.prompts("heldout")
    train_prompts = {md["prompt"] for mds in train.values() for md in mds}
    assert train["single_object"] == held["single_object"]  # the in-distribution control
    for tag in TAGS[1:]:
        assert held[tag] and train[tag], tag
        assert not train_prompts & {md["prompt"] for md in held[tag]}

    def combos(md):
        inc = md["include"]
        out = {("cs", c["color"], c["class"]) for c in inc if "color" in c}
        if len(inc) == 2:
            out.add(("pair", frozenset(c["class"] for c in inc)))
        if md["tag"] == "counting":
            out.add(("count", inc[0]["count"], inc[0]["class"]))
        return out

    seen = set().union(*(combos(md) for mds in train.values() for md in mds))
    for tag in TAGS[1:]:
        for md in held[tag]:
            assert combos(md) - seen, f"{md['prompt']} combines nothing new"
    # every held-out combination really is absent from training
    s = w.split
    assert not {("cs", c, sh) for c, sh in s.color_shape} & seen
    assert not {("pair", p) for p in s.shape_pairs} & seen
    assert not {("count", n, sh) for n, sh in s.count_shape} & seen


def test_split_and_scenes_are_deterministic_in_the_seed():
    a, b, c = World(0), World(0), World(1)
    assert a.split == b.split and a.split != c.split
    ia = np.stack([s.render() for s in a.sample(24, seed=3)])
    ib = np.stack([s.render() for s in b.sample(24, seed=3)])
    ic = np.stack([s.render() for s in a.sample(24, seed=4)])
    assert np.array_equal(ia, ib) and not np.array_equal(ia, ic)
    assert [s.prompt for s in a.sample(12)] == [s.prompt for s in b.sample(12)]


def test_scenes_hold_exactly_their_objects_apart_and_inside():
    w = World(0)
    for s in w.sample(120, "heldout", seed=1):
        inc = s.metadata["include"]
        want = inc[0]["count"] if s.metadata["tag"] == "counting" else len(inc)
        assert len(s.objects) == want
        for o in s.objects:
            x0, y0, x1, y1 = o.box
            assert 0 <= x0 < x1 <= w.size and 0 <= y0 < y1 <= w.size
            assert all(v % 2 == 0 for v in o.box)  # on the cell grid
            assert x0 % (2 * ALIGN) == 0 and y0 % (2 * ALIGN) == 0  # starts on a 2×2-cell latent token
            assert (x1 - x0, y1 - y0) == tuple(2 * v for v in SHAPE_SIZES[o.shape][0])
        for o1, o2 in itertools.combinations(s.objects, 2):
            assert not (o1.mask(w.size) & o2.mask(w.size)).any()


def test_eval_prompts_are_balanced_and_fixed():
    w = World(0)
    ev = w.eval_prompts(8)
    assert ev == World(0).eval_prompts(8)
    counts = {t: sum(md["tag"] == t for md in ev) for t in TAGS}
    assert counts == {
        "single_object": 6,
        "two_object": 6,
        "counting": 6,
        "colors": 8,
        "position": 8,
        "color_attr": 8,
    }
    assert all(w.split.is_held_out(md) for md in ev if md["tag"] != "single_object")
