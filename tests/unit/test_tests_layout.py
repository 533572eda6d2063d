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


def test_the_device_test_split_runs_every_gpu_test():
    """benchmarks/device_tests.sh names GPU test files, or test functions of a file it splits
    across GPUs: every test function of tests/gpu must be reached, or a new one would never run
    on the GPU machine."""
    import ast

    script = (REPO / "benchmarks" / "device_tests.sh").read_text()
    (split_file,) = re.findall(r"^K=(\S+)$", script, flags=re.M)
    named = {path.replace("$K", split_file).strip("\"'")
             for value in re.findall(r"TESTS_PATHS=(\S+)", script) for path in value.split(",")}
    missing = []
    for path in _test_files("gpu"):
        rel = f"tests/gpu/{path.name}"
        if rel in named:
            continue
        functions = [node.name for node in ast.parse(path.read_text()).body
                     if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")]
        missing += [f"{rel}::{f}" for f in functions if f"{rel}::{f}" not in named]
    assert not missing, f"GPU tests benchmarks/device_tests.sh does not run: {missing}"
