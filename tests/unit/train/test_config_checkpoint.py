"""The checkpoint section's S3 waits and the writer lease's expiry are validated with one line naming the
field."""

from __future__ import annotations

import pytest

from chunkgrpo.errors import UserError
from chunkgrpo.train.config import TrainConfig


@pytest.mark.parametrize("override, needle", [
    ("checkpoint.s3_wait_s=-1", "checkpoint.s3_wait_s must be >= 0"),
    ("checkpoint.lease_expiry_s=0", "checkpoint.lease_expiry_s must be > 0"),
    ("checkpoint.mirror_min_mb_s=0", "checkpoint.mirror_min_mb_s must be > 0"),
    ("checkpoint.final_uri=/tmp/final", "checkpoint.final_uri='/tmp/final' is not an S3 URI"),
])
def test_bad_values_are_one_line(override, needle):
    with pytest.raises(UserError, match=needle) as e:
        TrainConfig.load("tiny_cpu", [override])
    assert len(str(e.value).splitlines()) == 1


def test_defaults_wait_out_an_s3_restart():
    c = TrainConfig.load("tiny_cpu", []).checkpoint
    assert c.s3_wait_s == 900 and c.lease_expiry_s == 300


def test_the_end_of_training_wait_is_sized_from_the_bytes_left():
    from chunkgrpo.train.checkpoint_format import mirror_budget_s

    c = TrainConfig.load("tiny_cpu", []).checkpoint
    assert c.mirror_min_mb_s == 50 and c.mirror_wait_s == 120
    assert mirror_budget_s(0, c.mirror_min_mb_s, c.mirror_wait_s) == 120
    # a full FLUX.1-dev checkpoint from one rank at 50 MB/s: 48 min, beyond the old fixed 600 s
    assert mirror_budget_s(143_000_000_000, 50, 120) == pytest.approx(120 + 2860)
    # sharded over 8 ranks, each rank waits for its own eighth
    assert mirror_budget_s(143_000_000_000 // 8, 50, 120) == pytest.approx(120 + 357.5)
