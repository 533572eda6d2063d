"""The tests mirror what they need: CPU tests in ``tests/unit``, GPU-marked tests in ``tests/gpu``
(the GPU machine's runs select ``tests/gpu -m gpu``), shared code in ``tests/helpers``, imported
as ``helpers.<module>`` through pytest's ``pythonpath`` (no test edits ``sys.path``)."""

import re

from helpers.paths import REPO

TESTS = REPO / "tests"
THIS = __file__.rsplit("/", 1)[-1]


def _test_files(folder):
    """The test files of ``tests/<folder>`` (not this one, which names what it looks for)."""
    return sorted(p for p in (TESTS / folder).glob("test_*.py") if p.name != THIS)


def test_gpu_tests_live_in_tests_gpu_and_cpu_tests_in_tests_unit():
    gpu = _test_files("gpu")
    assert gpu, "no GPU tests found"
    unmarked = [p.name for p in gpu if not re.search(r"^pytestmark = .*pytest\.mark\.gpu",
                                                     p.read_text(), flags=re.M)]
    assert not unmarked, f"tests/gpu files whose tests are not all marked gpu: {unmarked}"
    marked = [p.name for p in _test_files("unit") if "pytest.mark.gpu" in p.read_text()]
    assert not marked, f"GPU-marked tests outside tests/gpu: {marked}"
    assert not list(TESTS.glob("test_*.py")), "test files belong in tests/unit or tests/gpu"


def test_no_test_file_edits_sys_path():
    edits = [str(p.relative_to(TESTS)) for p in _test_files("unit") + _test_files("gpu")
             if re.search(r"sys\.path\.(insert|append)|sys\.path\[", p.read_text())]
    assert not edits, f"test files that edit sys.path (use helpers / pyproject pythonpath): {edits}"
