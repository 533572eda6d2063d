"""benchmarks/kernel_manifest.py: the line it records is the one Triton keys a kernel by, and
--check tells moved, changed and new kernels apart, from a JSON file or a cache archive."""

import importlib
import io
import json
import os
import shutil
import tarfile

import pytest

import kernel_manifest as km


def test_lines_are_tritons_starting_lines():
    """Every jit function Triton can see at module level: the manifest's line is Triton's own
    ``starting_line_number`` (what its cache key holds), the source hash is present."""
    pytest.importorskip("triton")
    current = km.manifest()
    checked = 0
    for path in sorted(os.listdir(km.KERNELS)):
        if not path.endswith(".py") or path == "__init__.py":
            continue
        stem = path[:-3]
        module = importlib.import_module(f"megatron_flux.kernels.{stem}")
        for name, obj in vars(module).items():
            line = getattr(obj, "starting_line_number", None)
            if line is None or getattr(obj, "__module__", module.__name__) != module.__name__:
                continue
            if getattr(obj, "fn", None) is None or obj.fn.__module__ != module.__name__:
                continue  # imported from another kernel module: checked there
            assert current[f"{stem}:{obj.fn.__name__}"][0] == line, (stem, name)
            checked += 1
    assert checked >= 40  # the Triton kernels and their helpers, across the kernel modules
    assert current["ag_gemm:ag_gemm_kernel"][0] > 0 and len(current["ag_gemm:ag_gemm_kernel"][1]) == 16
    assert any(key.startswith("ag_gemm_ws:") for key in current)  # nested Gluon kernels too


def _tree(tmp_path):
    root = tmp_path / "kernels"
    shutil.copytree(km.KERNELS, root, ignore=shutil.ignore_patterns("__pycache__"))
    return str(root)


def test_compare_tells_moved_changed_and_new(tmp_path):
    root = _tree(tmp_path)
    before = km.manifest(root)
    path = os.path.join(root, "ready_barrier.py")
    text = open(path).read()
    open(path, "w").write("# one line more\n" + text)  # every kernel in the file moves by one
    moved = km.compare(before, km.manifest(root))
    assert moved and all(line.startswith("moved    ready_barrier:") for line in moved)
    assert any("ready_barrier_kernel (line" in line for line in moved)

    path = os.path.join(root, "rs_reduce.py")
    text = open(path).read()
    assert "@triton.jit" in text
    open(path, "w").write(text.replace("@triton.jit", "@triton.jit  # edited", 1))
    now = km.manifest(root)
    assert any(line.startswith("changed  rs_reduce:") for line in km.compare(before, now))

    with open(os.path.join(root, "extra.py"), "w") as f:
        f.write("import triton\n\n\n@triton.jit\ndef brand_new(x):\n    pass\n")
    assert "new      extra:brand_new (line 4)" in km.compare(before, km.manifest(root))
    assert km.compare(before, before) == []


def _archive(files):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_check_reads_the_archive_and_its_pieces(tmp_path, capsys):
    current = km.manifest()
    data = _archive({"./ABC/kernel.json": b"{}",
                     f"./{km.MANIFEST_NAME}": json.dumps(current).encode()})
    one = tmp_path / "one"
    one.mkdir()
    (one / "triton-cache.tgz").write_bytes(data)
    assert km.read_manifest(str(one)) == current
    pieces = tmp_path / "pieces"
    pieces.mkdir()
    cut = len(data) // 2
    (pieces / "triton-cache.tgz.part-aa").write_bytes(data[:cut])
    (pieces / "triton-cache.tgz.part-ab").write_bytes(data[cut:])
    assert km.main(["--check", str(pieces)]) == 0
    assert "all" in capsys.readouterr().out

    stale = dict(current, **{"ag_gemm:ag_gemm_kernel": [1, current["ag_gemm:ag_gemm_kernel"][1]]})
    (tmp_path / "stale.json").write_text(json.dumps(stale))
    assert km.main(["--check", str(tmp_path / "stale.json")]) == 1
    out = capsys.readouterr().out
    assert "moved    ag_gemm:ag_gemm_kernel (line 1 ->" in out and "will compile again" in out

    none = tmp_path / "none"
    none.mkdir()
    (none / "triton-cache.tgz").write_bytes(_archive({"./ABC/kernel.json": b"{}"}))
    assert km.main(["--check", str(none)]) == 1
    assert "none in" in capsys.readouterr().out
