"""What counts as S3 being unreachable (wait, then stop) and what as content that was read and is wrong
(reject the checkpoint, fall back): a cut connection or a timeout after the store's retries is the first; a
checksum mismatch or a bad manifest the second."""

from __future__ import annotations

from urllib3.exceptions import ProtocolError, ReadTimeoutError

from chunkgrpo.store import ChecksumMismatchError, StoreError
from chunkgrpo.train.checkpoint_policy import unreachable


def _after_retries(cause: BaseException) -> StoreError:
    try:
        raise StoreError("S3 at http://s3:9000 still failing after 6 attempts") from cause
    except StoreError as e:
        return e


def test_a_cut_or_timed_out_transfer_is_unreachable():
    assert unreachable(_after_retries(ProtocolError("Connection broken: IncompleteRead")))
    assert unreachable(_after_retries(ReadTimeoutError(None, "/k", "read timed out")))
    assert unreachable(ConnectionRefusedError(111, "refused"))


def test_content_that_was_read_and_is_wrong_is_not():
    assert not unreachable(ChecksumMismatchError("s3://b/k: sha256 a != recorded b"))
    assert not unreachable(StoreError("s3://b/k/MANIFEST.json: not valid JSON"))
    assert not unreachable(FileNotFoundError(2, "no such object", "s3://b/k"))
