"""Whether a carried Triton cache still matches this tree's kernels.

Triton (3.6 on the GPU box) keys a compiled kernel by its source *and its starting line number*
(``JITFunction.cache_key``; ``starting_line_number`` is the first line of
``inspect.getsourcelines``, the first decorator). So an edit that only moves a kernel in its file
makes every cache entry of it, and of the kernels that call it, miss: one- to four-line moves
above five kernels once cost two ten-minute device calls of cold compiles.

The manifest lists every ``@triton.jit`` / ``@gluon.jit`` function under ``megatron_flux/kernels``
with that line and a hash of its source text, read with :mod:`ast` (no Triton import, so it runs
on the CPU machine). ``device_env.sh``'s ``pack_triton_cache`` stores it in the cache archive as
``kernel-manifest.json``; ``--check`` compares it with the tree:

    python benchmarks/kernel_manifest.py --write manifest.json
    python benchmarks/kernel_manifest.py --check .device/          # the carried pieces
    python benchmarks/kernel_manifest.py --check manifest.json

``--check`` prints each kernel that moved, changed, or is new, and exits 1 if any did (the
cache will compile those again: pack it afresh in the call that first runs them).
"""

from __future__ import annotations

import argparse
import ast
import glob
import hashlib
import io
import json
import os
import sys
import tarfile
from typing import Dict, List, Optional, Tuple

KERNELS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "megatron_flux", "kernels")
MANIFEST_NAME = "kernel-manifest.json"


def _is_jit(decorator: ast.expr) -> bool:
    """``@triton.jit``, ``@gluon.jit``, ``@jit``, with or without a call."""
    if isinstance(decorator, ast.Call):
        decorator = decorator.func
    if isinstance(decorator, ast.Attribute):
        return decorator.attr == "jit"
    return isinstance(decorator, ast.Name) and decorator.id == "jit"


def module_kernels(path: str) -> Dict[str, Tuple[int, str]]:
    """``{name: (first line, source hash)}`` of the jit functions in one file (nested ones too:
    the Gluon kernels sit under an ``if``)."""
    with open(path) as f:
        text = f.read()
    lines = text.splitlines()
    out = {}
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(
                _is_jit(d) for d in node.decorator_list):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            source = "\n".join(lines[first - 1:node.end_lineno])
            name, i = node.name, 1
            while name in out:  # one name defined twice (e.g. per Triton version)
                i += 1
                name = f"{node.name}#{i}"
            out[name] = (first, hashlib.sha256(source.encode()).hexdigest()[:16])
    return out


def manifest(root: str = KERNELS) -> Dict[str, List]:
    """``{"<file stem>:<function>": [first line, source hash]}`` for every kernel file."""
    out = {}
    for path in sorted(glob.glob(os.path.join(root, "*.py"))):
        stem = os.path.splitext(os.path.basename(path))[0]
        for name, (line, digest) in module_kernels(path).items():
            out[f"{stem}:{name}"] = [line, digest]
    return out


def read_manifest(where: str) -> Optional[Dict[str, List]]:
    """A manifest from a JSON file, a cache archive (``.tgz``), or a folder holding the archive
    or its pieces (``triton-cache.tgz.part-*``); None if the archive has none."""
    if os.path.isdir(where):
        pieces = sorted(glob.glob(os.path.join(where, "triton-cache.tgz.part-*")))
        whole = os.path.join(where, "triton-cache.tgz")
        if not pieces and os.path.exists(whole):
            pieces = [whole]
        if not pieces:
            raise FileNotFoundError(f"no triton-cache.tgz or pieces under {where}")
        data = b"".join(open(p, "rb").read() for p in pieces)
    elif where.endswith(".json"):
        with open(where) as f:
            return json.load(f)
    else:
        with open(where, "rb") as f:
            data = f.read()
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        for member in tar.getmembers():
            if os.path.basename(member.name) == MANIFEST_NAME:
                return json.load(tar.extractfile(member))
    return None


def compare(old: Dict[str, List], new: Dict[str, List]) -> List[str]:
    """One line per kernel the cache will miss (moved, changed or new), sorted."""
    lines = []
    for key in sorted(new):
        if key not in old:
            lines.append(f"new      {key} (line {new[key][0]})")
        elif old[key][1] != new[key][1]:
            lines.append(f"changed  {key} (source differs)")
        elif old[key][0] != new[key][0]:
            lines.append(f"moved    {key} (line {old[key][0]} -> {new[key][0]})")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = ap.add_mutually_exclusive_group(required=True)
    group.add_argument("--write", metavar="PATH", help="write this tree's manifest here")
    group.add_argument("--check", metavar="WHERE",
                       help="a manifest JSON, a cache .tgz, or a folder with the cache's pieces")
    args = ap.parse_args(argv)
    current = manifest()
    if args.write:
        with open(args.write, "w") as f:
            json.dump(current, f, indent=0, sort_keys=True)
        print(f"kernel manifest: {len(current)} jit functions -> {args.write}")
        return 0
    old = read_manifest(args.check)
    if old is None:
        print(f"kernel manifest: none in {args.check}; cannot tell whether the cache matches")
        return 1
    stale = compare(old, current)
    for line in stale:
        print("  " + line)
    if stale:
        print(f"kernel manifest: {len(stale)} of {len(current)} jit functions will compile again "
              f"(Triton keys them by source and starting line)")
        return 1
    print(f"kernel manifest: all {len(current)} jit functions match the cache's")
    return 0


if __name__ == "__main__":
    sys.exit(main())
