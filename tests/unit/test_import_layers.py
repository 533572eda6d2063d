"""The package's layers, as imports: the runtime never reaches the tools at the edge.

Megatron's surface (layers, specs, output_layer, arguments) -> autograd ops -> backends ->
kernels and comm; the runtime reads tuning tables (``megatron_flux.tuning``). What people run
(``megatron-flux bench|tune|plan|check``, the diagnostics) lives in ``megatron_flux.tools`` and
must never be imported by a training step: it pulls in benchmark and tuner code, and the
benchmark's plotting pulls in matplotlib.

Each check runs in a fresh interpreter, since this test process has imported everything.
"""

import json
import os
import subprocess
import sys

import pytest

from helpers import paths

REPO = str(paths.REPO)
PACKAGE = os.path.join(REPO, "megatron_flux")
#: module prefixes a runtime import must not load
FORBIDDEN = ("megatron_flux.tools", "matplotlib")


def runtime_modules():
    """Every module of the package outside ``megatron_flux.tools``, found on disk (nothing is
    imported here), so a module added later is checked without editing this list."""
    mods = []
    for root, dirs, files in os.walk(PACKAGE):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__" and not d.startswith("."))
        rel = os.path.relpath(root, os.path.dirname(PACKAGE)).replace(os.sep, ".")
        if rel == "megatron_flux.tools" or rel.startswith("megatron_flux.tools."):
            dirs[:] = []
            continue
        if "__init__.py" not in files:
            dirs[:] = []
            continue
        for f in sorted(files):
            if f.endswith(".py") and f != "__main__.py":
                mods.append(rel if f == "__init__.py" else f"{rel}.{f[:-3]}")
    return mods


def _run(code: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


_IMPORT_EACH = """
import importlib, json, sys, warnings
warnings.simplefilter("ignore")
FORBIDDEN = {forbidden!r}
def bad():
    return {{m for m in sys.modules for p in FORBIDDEN if m == p or m.startswith(p + ".")}}
seen, found = set(), {{}}
for name in {modules!r}:
    importlib.import_module(name)
    new = bad() - seen
    if new:
        found[name] = sorted(new)
        seen |= new
import megatron_flux
for name in megatron_flux.__all__:  # the public API's lazy attributes
    getattr(megatron_flux, name)
    new = bad() - seen
    if new:
        found["megatron_flux." + name] = sorted(new)
        seen |= new
print(json.dumps(found))
"""


@pytest.fixture(scope="module")
def imported_by():
    """``{module: [forbidden modules its import loaded first]}`` over every runtime module,
    imported one after the other in one fresh interpreter (a forbidden module is blamed on the
    first runtime module whose import loaded it)."""
    return _run(_IMPORT_EACH.format(forbidden=FORBIDDEN, modules=runtime_modules()))


def test_the_runtime_modules_are_found():
    mods = runtime_modules()
    for expected in ("megatron_flux", "megatron_flux.layers.linear", "megatron_flux.ops.row_parallel",
                     "megatron_flux.backends.flux", "megatron_flux.kernels.ag_gemm",
                     "megatron_flux.comm.workspace", "megatron_flux.tuning.registry",
                     "megatron_flux.specs", "megatron_flux.arguments"):
        assert expected in mods
    assert not [m for m in mods if m.startswith("megatron_flux.tools")]


def test_no_runtime_module_imports_the_tools_or_matplotlib(imported_by):
    assert imported_by == {}, (
        "runtime modules that import the edge (megatron_flux.tools) or matplotlib: "
        + "; ".join(f"{m} -> {', '.join(v)}" for m, v in imported_by.items()))


_TUNING_ONLY = """
import json, sys
import megatron_flux.tuning
print(json.dumps(sorted(m for m in sys.modules if m.startswith("megatron_flux."))))
"""


def test_importing_the_table_lookup_does_not_import_the_backends():
    loaded = _run(_TUNING_ONLY)
    assert "megatron_flux.tuning.registry" in loaded
    assert not [m for m in loaded if m.startswith(("megatron_flux.backends", "megatron_flux.tools"))], loaded


_TUNING_LOOKUP = """
import json, sys, torch
import megatron_flux.tuning as T
from megatron_flux.tuning import device, keys, provider, registry, schema
T.reset()
T.lookup_entry("ag", 4096, 14336, 4096, torch.bfloat16, 2, ("NVIDIA H200", 132))
print(json.dumps(sorted(m for m in sys.modules if m.startswith("megatron_flux."))))
"""


def test_no_tuning_module_nor_a_table_lookup_imports_the_backends():
    loaded = _run(_TUNING_LOOKUP)
    assert not [m for m in loaded if m.startswith("megatron_flux.backends")], loaded
