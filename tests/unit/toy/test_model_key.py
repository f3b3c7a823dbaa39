"""The toy model's content key ignores docstrings, comments and layout, and sees every code change."""

from chunkgrpo.toy.model import code_fingerprint

SOURCE = '''"""Module doc."""
import math


def f(x):
    """Doc."""
    return math.sqrt(x) + 1  # one
'''


def _fp(tmp_path, text):
    p = tmp_path / "m.py"
    p.write_text(text)
    return code_fingerprint(p)


def test_layout_comments_and_docstrings_do_not_count(tmp_path):
    base = _fp(tmp_path, SOURCE)
    relaid = (
        '"""Another doc,\nrewrapped."""\n\nimport math\n\n\n'
        "def f(\n    x,\n):\n    # a comment\n    return (\n        math.sqrt(x) + 1\n    )\n"
    )
    assert _fp(tmp_path, relaid) == base


def test_code_changes_count(tmp_path):
    base = _fp(tmp_path, SOURCE)
    assert _fp(tmp_path, SOURCE.replace("+ 1", "+ 2")) != base
    assert _fp(tmp_path, SOURCE.replace("import math", "import cmath as math")) != base
    assert _fp(tmp_path, SOURCE.replace('    """Doc."""\n', "    y = 0\n")) != base
