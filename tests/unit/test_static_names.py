"""Every name the package, its tools, benchmarks and examples use is defined: pyflakes'
undefined-name check over the tree, so a name that only a GPU path reaches (a tuner's table
writer, a kernel launcher) fails here on the CPU instead of on the device."""
import pytest

from helpers.paths import REPO

pyflakes_api = pytest.importorskip("pyflakes.api", reason="pyflakes is installed by .ci/run and the test extra")
from pyflakes import messages  # noqa: E402
from pyflakes.reporter import Reporter  # noqa: E402

CHECKED = ("megatron_flux", "benchmarks", "examples", "tests")
UNDEFINED = (messages.UndefinedName, messages.UndefinedLocal, messages.UndefinedExport)


class _Collect(Reporter):
    def __init__(self):
        self.problems = []

    def flake(self, message):
        if isinstance(message, UNDEFINED):
            self.problems.append(str(message))

    def syntaxError(self, filename, msg, lineno, offset, text):
        self.problems.append(f"{filename}:{lineno}: {msg}")

    def unexpectedError(self, filename, msg):
        self.problems.append(f"{filename}: {msg}")


def test_no_undefined_names():
    report = _Collect()
    pyflakes_api.checkRecursive([str(REPO / folder) for folder in CHECKED], report)
    assert not report.problems, "\n".join(report.problems)
