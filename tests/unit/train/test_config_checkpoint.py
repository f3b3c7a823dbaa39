"""The checkpoint section's S3 waits and the writer lease's expiry are validated with one line naming the
field."""

from __future__ import annotations

import pytest

from chunkgrpo.errors import UserError
from chunkgrpo.train.config import TrainConfig


@pytest.mark.parametrize("override, needle", [
    ("checkpoint.s3_wait_s=-1", "checkpoint.s3_wait_s must be >= 0"),
    ("checkpoint.lease_expiry_s=0", "checkpoint.lease_expiry_s must be > 0"),
])
def test_bad_values_are_one_line(override, needle):
    with pytest.raises(UserError, match=needle) as e:
        TrainConfig.load("tiny_cpu", [override])
    assert len(str(e.value).splitlines()) == 1


def test_defaults_wait_out_an_s3_restart():
    c = TrainConfig.load("tiny_cpu", []).checkpoint
    assert c.s3_wait_s == 900 and c.lease_expiry_s == 300
