"""The suite's file order (tests/conftest.py): the long files first, each named file present."""

from pathlib import Path

from tests import conftest

ROOT = Path(__file__).resolve().parents[1]


class _Item:
    def __init__(self, nodeid: str):
        self.nodeid = nodeid


def test_every_long_file_exists():
    missing = [p for p in conftest.LONG_FILES_FIRST if not (ROOT / p).is_file()]
    assert not missing, f"renamed or removed: {missing} (update tests/conftest.py LONG_FILES_FIRST)"


def test_long_files_run_first_in_their_order_the_rest_as_collected():
    first, second = conftest.LONG_FILES_FIRST[:2]
    items = [_Item(n) for n in ("tests/unit/a.py::t1", f"{second}::x", "tests/unit/b.py::t2", f"{first}::y",
                                f"{second}::z", "components/c/tests/test_c.py::t3")]
    conftest.pytest_collection_modifyitems(None, items)
    assert [i.nodeid for i in items] == [f"{first}::y", f"{second}::x", f"{second}::z", "tests/unit/a.py::t1",
                                         "tests/unit/b.py::t2", "components/c/tests/test_c.py::t3"]
