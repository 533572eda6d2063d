"""How big a device call's copy of this tree will be, against the device's 64 MiB limit.

    python benchmarks/device_copy_size.py [CARRIED_PATH ...]      (e.g. .device .whl)

A device call copies the tracked files, the untracked files git does not ignore, and the
ignored paths named in ``carry``; above 64 MiB in all it is refused before a machine starts
(e.g. a 43.5 MB tree beside a 21.8 MB Triton cache pack). Prints each part and the room left;
exits 1 when the copy would not fit.
"""

import os
import subprocess
import sys

LIMIT = 64 * 2 ** 20


def _files(args):
    out = subprocess.run(["git", *args, "-z"], capture_output=True, check=True).stdout
    return [p for p in out.decode().split("\0") if p]


def _size(paths):
    return sum(os.path.getsize(p) for p in paths if os.path.isfile(p))


def _tree_size(path):
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def copy_parts(carried):
    """Bytes per part of a call's copy of the tree in the working directory: tracked files,
    untracked files git does not ignore, and each carried path."""
    untracked = _files(["ls-files", "--others", "--exclude-standard"])
    parts = {"tracked": _size(_files(["ls-files"])), "untracked, not ignored": _size(untracked)}
    for path in carried:
        parts[f"carried {path}"] = _tree_size(path)  # 0 when absent (os.walk yields nothing)
    return parts


def main(argv=None, limit=LIMIT):
    parts = copy_parts(sys.argv[1:] if argv is None else argv)
    total = sum(parts.values())
    for name, size in parts.items():
        print(f"{size / 2 ** 20:8.1f} MiB  {name}")
    print(f"{total / 2 ** 20:8.1f} MiB  in all; the limit is {limit / 2 ** 20:.0f} MiB "
          f"({(limit - total) / 2 ** 20:+.1f} MiB room)")
    return 0 if total <= limit else 1


if __name__ == "__main__":
    sys.exit(main())
