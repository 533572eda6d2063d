"""Where the repository and the tests' data are, for tests that read files or run scripts."""

from pathlib import Path

#: the repository root (the directory holding ``pyproject.toml``)
REPO = Path(__file__).resolve().parents[2]
#: files the tests read (``tests/data``)
DATA = REPO / "tests" / "data"
