"""The repository speaks of the project only, and its README stays a short user document.

No tracked text file mentions how the project was built: work-step numbers ("stop 35", "stops 31-38"),
issue numbers and items, an issue's owner or targets, work sessions, or absolute paths of the machine
that wrote a file (a workspace path in code, or a temporary path in a committed result). Results store
paths relative to the repository, comments state the property they protect, and measurement history
lives in dated files under `benchmarks/results/`.

`python tests/test_repo_hygiene.py` prints every hit (path:line: pattern: text) and exits 1 if any.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_BYTES = 12_288

# Words after "stop N" that make it an ordinary count ("stop 3 servers", "stops 2 workers").
_COUNTED = (r"(?:%|s\b|ms\b|seconds?\b|min(?:utes?)?\b|h\b|hours?\b|servers?\b|process(?:es)?\b|workers?\b"
            r"|ranks?\b|tasks?\b|times?\b|jobs?\b|pods?\b|steps?\b|epochs?\b|iterations?\b|rollouts?\b"
            r"|nodes?\b|threads?\b|containers?\b)")
# The patterns are assembled from pieces so that this file does not match itself.
_ABS = "(?<![\\w.~-])/"
PROCESS_WORDS: dict[str, re.Pattern] = {
    "work-step number": re.compile(r"\bstops?" + r" \d+\b(?!\.\d)(?!\s*" + _COUNTED + r")|\bstop" + r"-\d+\b"
                                   r"|\b(?:this|an earlier|a later) stop" + r"\b", re.I),
    "issue number": re.compile(r"\bissues?" + r" #\d+|#\d+(?:'s)? items?\b|\(#\d+\)", re.I),
    "issue item": re.compile(r"(?<![\w&])#" + r"\d+\.\d+"),
    "issue owner": re.compile(r"\bissue(?:'s)?" + r" owners?\b|\bdecision for the (?:issue )?owner", re.I),
    "the issue": re.compile(r"\bthe" + r" issue(?:'s)?\b", re.I),
    "work session": re.compile(r"\b(?:work|agent|helper)" + r" sessions?\b|\bthis session" + r"'s shared"
                               r"|\bsession's \d+ device" + r" minutes|\blent to this" + r" task", re.I),
    "workspace path": re.compile(_ABS + "work" + "/"),
    "home path": re.compile(_ABS + "root" + r"/(?!\.cache/)"),
}
# A committed result names its files relative to the repository, never a temporary folder of its run.
RESULT_WORDS: dict[str, re.Pattern] = {"temporary path": re.compile(_ABS + "tmp" + "/")}
RESULTS_DIR = "benchmarks/results/"

# Vendored upstream files are kept byte-for-byte as published (their provenance is checked elsewhere).
VENDORED = ("chunkgrpo/data/hpdv2/", "chunkgrpo/data/geneval/", "tests/fixtures/crds/")


def hits_in_text(path: str, text: str) -> list[str]:
    """`path:line: pattern: text` for every line of `text` with a process word (`path` is repo-relative)."""
    patterns = dict(PROCESS_WORDS)
    if path.startswith(RESULTS_DIR):
        patterns.update(RESULT_WORDS)
    found = []
    for n, line in enumerate(text.splitlines(), 1):
        for name, pattern in patterns.items():
            m = pattern.search(line)
            if m:
                start = max(0, m.start() - 60)
                found.append(f"{path}:{n}: {name}: {line[start:m.end() + 60].strip()}")
    return found


def _tracked_files(root: Path = ROOT) -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return []
    return [p for p in out.decode().split("\0") if p]


def _text(path: Path) -> str | None:
    try:
        data = path.read_bytes()
    except OSError:  # deleted in the work tree, not yet in the index
        return None
    if b"\0" in data[:8192]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def scan(root: Path = ROOT) -> list[str]:
    """Every process-word hit in the tracked text files under `root`, vendored upstream files excepted."""
    found = []
    for rel in _tracked_files(root):
        if rel.startswith(VENDORED) or rel == "tests/test_repo_hygiene.py":
            continue
        if (root / rel).is_symlink():  # a tracked link is its target's path (e.g. a checkout's venv)
            target = os.readlink(root / rel)
            resolved = (root / rel).parent.joinpath(target).resolve()
            inside = not os.path.isabs(target) and resolved.is_relative_to(root.resolve())
            found += [] if inside else [f"{rel}:1: link out of the repository: -> {target}"]
            continue
        text = _text(root / rel)
        if text is not None:
            found += hits_in_text(rel, text)
    return found


def test_readme_is_a_short_user_document():
    size = (ROOT / "README.md").stat().st_size
    assert size <= README_MAX_BYTES, (
        f"README.md is {size} bytes (at most {README_MAX_BYTES}): move reference material to docs/ "
        "and measurement history to benchmarks/results/")


def test_no_tracked_file_speaks_of_the_development_process():
    files = _tracked_files()
    if not files:
        pytest.skip("not a git checkout: no list of tracked files")
    found = scan()
    assert not found, f"{len(found)} lines speak of the development process:\n" + "\n".join(found)


@pytest.mark.parametrize("line", [
    "Measured at stop" + " 38 on 2 idle cores.",
    "What stop" + " 39 checked and found coverage-neutral",
    "## 2026-11-28: forked ranks (stop" + " 35), on a slower machine",
    "the runs of stops" + " 31–38",
    "the stop" + "-38 services change",
    "which this stop" + " did not build",
    "On this session" + "'s shared machine (load 10)",
    "the device machine is not lent to this" + " task",
    "Targets (issue" + " #26): at most 2x",
    "a bad input (#24" + " item 7)",
    "the change (#" + "41)",
    '"""#' + '27.5: two promoters at once',
    "refused (#" + "24.6 / #24.11)",
    "a decision for the issue" + " owner",
    "The issue" + "'s target, 12 min of pytest, is not met.",
    "written in a work" + " session",
    '"model": "/' + 'work/main/.chunkgrpo/models/toy"',
    "cp /" + "root/data/x .",
])
def test_the_checker_rejects_process_words(line):
    assert hits_in_text("docs/x.md", line), line


def test_the_checker_rejects_temporary_paths_in_results_only():
    line = '"output_dir": "/' + 'tmp/chunkgrpo-ablation-x8lfar8f/run"'
    assert hits_in_text("benchmarks/results/ablation/run.json", line)
    assert not hits_in_text("chunkgrpo/eval/runner.py", 'output_dir="/' + 'tmp/eval"')


def test_the_checker_accepts_a_clean_file():
    clean = "\n".join([
        "The local runner can stop 3 servers and stops 2 workers; a CI timeout makes it stop 10 s later.",
        "Early stopping after 5 evaluations; `stop_after: 40` in the config; the bus stop sign.",
        "A session fixture's setup; this session's servers stop at its end (pytest's session).",
        "Both are stopped together (each stop waits for its process); processes that stop early.",
        "Colours #000 and #ff0000; see [the section](#faults-and-bad-input); tissue #3 is not an issue.",
        "Version 2.17.1, value 3.5; row 4 of 7; the &#8212; entity.",
        "Paths: benchmarks/results/ablation-toy-v2/n10/plan.json, ./work/out, s3://bucket/work/x, ~/work/x.",
        "Docker caches under /" + "root/.cache/uv; a session-scoped pytest fixture; a pod's owner reference.",
        "Issues are tracked upstream; report a bug with its log.",
    ])
    assert hits_in_text("docs/x.md", clean) == []


def test_the_scan_reads_tracked_files_and_skips_binary_and_vendored(tmp_path):
    def git(*args):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    try:
        git("init", "-q")
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("git is not available")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "dirty.md").write_text("Measured at stop" + " 38.\n")
    (tmp_path / "docs" / "clean.md").write_text("Measured on 2 idle cores.\n")
    (tmp_path / "docs" / "image.bin").write_bytes(b"\0at stop" + b" 38")
    (tmp_path / "chunkgrpo" / "data" / "geneval").mkdir(parents=True)
    (tmp_path / "chunkgrpo" / "data" / "geneval" / "prompts.txt").write_text("see issue" + " #3\n")
    (tmp_path / "untracked.md").write_text("at stop" + " 38\n")
    (tmp_path / ".venv-link").symlink_to(tmp_path / "docs")           # a link to a folder of this machine
    (tmp_path / "docs" / "same.md").symlink_to("clean.md")             # a link inside the repository
    git("add", "docs", "chunkgrpo", ".venv-link")
    found = scan(tmp_path)
    assert [h.split(":")[0] for h in found] == [".venv-link", "docs/dirty.md"], found


if __name__ == "__main__":
    hits = scan()
    print("\n".join(hits))
    print(f"{len(hits)} hits in {len({h.split(':')[0] for h in hits})} files", file=sys.stderr)
    sys.exit(1 if hits else 0)
