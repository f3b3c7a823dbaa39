"""Valid prompt files load whatever their size or spacing: blank lines between prompts are skipped (and
logged as skipped) in .txt, .jsonl and .tsv; a 200k-line, 20 MB file loads whole."""

from __future__ import annotations

import json
import logging

import pytest

from chunkgrpo.prompts import load_prompts

N = 50


def _sparse(kind: str) -> str:
    """N prompts with 1-3 blank (or whitespace-only) lines between them."""
    lines = {"txt": [f"a cat number {i}" for i in range(N)],
             "jsonl": [json.dumps({"prompt": f"a cat number {i}"}) for i in range(N)],
             "tsv": [f"a cat number {i}\t{i}" for i in range(N)]}[kind]
    body = "".join(line + "\n" + "\n" * (i % 3) + ("   \n" if i % 5 == 0 else "")
                   for i, line in enumerate(lines))
    return ("Prompt\tid\n\n" if kind == "tsv" else "\n\n") + body


@pytest.mark.parametrize("kind", ["txt", "jsonl", "tsv"])
def test_blank_lines_between_prompts_are_skipped_and_said(kind, tmp_path, caplog):
    path = tmp_path / f"p.{kind}"
    path.write_text(_sparse(kind))
    with caplog.at_level(logging.INFO, logger="chunkgrpo.prompts"):
        prompts = load_prompts(path)
    assert prompts == [f"a cat number {i}" for i in range(N)]
    assert "blank lines skipped" in caplog.text and f"{N} prompts" in caplog.text


def test_a_200k_line_20_mb_file_loads_whole(tmp_path):
    path = tmp_path / "big.txt"
    path.write_text("".join(f"a photo of cat {i} " + "x" * 80 + "\n" + ("\n" if i % 7 == 0 else "")
                            for i in range(200_000)))
    assert path.stat().st_size > 20_000_000
    prompts = load_prompts(path)
    assert len(prompts) == 200_000 and prompts[-1].startswith("a photo of cat 199999 ")
    assert load_prompts(path, limit=3) == prompts[:3]


def test_parquet_string_prompts_load_and_a_null_is_refused_by_row(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from chunkgrpo.errors import UserError

    pq.write_table(pa.table({"prompt": ["a cat", "a dog"]}), tmp_path / "ok.parquet")
    assert load_prompts(tmp_path / "ok.parquet") == ["a cat", "a dog"]
    pq.write_table(pa.table({"text": ["a cat", None, "a dog"]}), tmp_path / "null.parquet")
    with pytest.raises(UserError, match=r"column 'text': row 1 is null"):
        load_prompts(tmp_path / "null.parquet")
