"""The tracked tree states what is true now: no development-history narration, small results.

The history of how the code got here lives in git log. Tracked files (code, docs, scripts,
result files) describe the current code and cite measurements by file and command, never by a
working period ("session 12", "sessions 15-16", a "Next, in order" to-do list) or by the lab
notebooks that were removed (``benchmarks/NOTES.md``, ``docs/measurements.md``). And
``benchmarks/results/`` keeps only the result files the docs cite, so it stays small.

Both checks read ``git ls-files``; they skip where git or the repository metadata is missing
(e.g. a copy of the tree without ``.git``).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
THIS_FILE = Path(__file__).resolve()

#: development-history narration that no tracked text file may contain (regex, flags)
NARRATION_PATTERNS = (
    (r"\bsession \d+", re.IGNORECASE),
    (r"\bsessions \d+", re.IGNORECASE),  # "sessions 15-16", "sessions 15 and 21"
    (r"\bsessions \d+[–-]\d+", re.IGNORECASE),
    (r"Next, in order", 0),
    (r"benchmarks/NOTES\.md", 0),
    (r"docs/measurements\.md", 0),
    (r"benchmarks/sessions/", 0),
)

#: the most that the tracked files under benchmarks/results/ may take, in bytes
RESULTS_LIMIT_BYTES = 5_150_000

#: bytes read from the start of a file to decide whether it is text (a NUL byte means binary)
_SNIFF = 8192


def _tracked_files() -> list[str]:
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    probe = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=REPO,
                           capture_output=True, text=True)
    if probe.returncode != 0 or Path(probe.stdout.strip()).resolve() != REPO:
        pytest.skip("not a git checkout of this repository")
    out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    return [p for p in out.decode("utf-8", "surrogateescape").split("\0") if p]


def _text(path: Path):
    """The file's text, or None for a binary or unreadable file."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if b"\0" in data[:_SNIFF]:
        return None
    return data.decode("utf-8", errors="replace")


def narration_hits(text: str) -> int:
    """How many narration matches ``text`` has (each pattern counted on its own)."""
    return sum(len(re.findall(pattern, text, flags)) for pattern, flags in NARRATION_PATTERNS)


def test_the_patterns_catch_narration_and_spare_ordinary_text():
    for narrated in ("as measured in session 27", "Session 3 (2026-11-22): TP=4",
                     "sessions 15-16 found", "sessions 15–16", "### Next, in order",
                     "see benchmarks/NOTES.md", "earlier numbers: docs/measurements.md",
                     "benchmarks/sessions/device_s33.sh"):
        assert narration_hits(narrated) > 0, narrated
    for plain in ("a training session of 30 steps", "the session's data", "sessions are torchrun jobs",
                  "bench-h200x2-2026-11-26-s27-conn1-run1.json", "docs/performance.md"):
        assert narration_hits(plain) == 0, plain


def test_no_tracked_file_narrates_the_development_history():
    hits = {}
    for rel in _tracked_files():
        path = REPO / rel
        if path.resolve() == THIS_FILE:
            continue
        text = _text(path)
        if text is None:
            continue
        n = narration_hits(text)
        if n:
            hits[rel] = n
    listing = "\n".join(f"  {rel}: {n}" for rel, n in sorted(hits.items()))
    assert not hits, (f"{len(hits)} tracked files narrate the project's history (state what is true "
                      f"now; cite a result file or command instead):\n{listing}")


def test_tracked_results_stay_small():
    files = [rel for rel in _tracked_files() if rel.startswith("benchmarks/results/")]
    sizes = {rel: os.path.getsize(REPO / rel) for rel in files if (REPO / rel).is_file()}
    total = sum(sizes.values())
    largest = sorted(sizes.items(), key=lambda kv: -kv[1])[:5]
    assert total <= RESULTS_LIMIT_BYTES, (
        f"benchmarks/results/ holds {total / 1e6:.1f} MB in {len(sizes)} tracked files (limit "
        f"{RESULTS_LIMIT_BYTES / 1e6:.0f} MB); largest: {largest}")
