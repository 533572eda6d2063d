"""benchmarks/device_copy_size.py counts what a device call copies: tracked files, untracked
files git does not ignore, and the carried ignored paths, not other ignored files."""

import os
import subprocess

import device_copy_size


def _write(path, nbytes):
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "wb") as f:
        f.write(b"x" * nbytes)


def test_counts_tracked_untracked_and_carried_only(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    subprocess.run(["git", "init", "-q"], check=True)
    with open(".gitignore", "w") as f:
        f.write(".cache/\n.whl/\n")
    _write("src/a.py", 1000)
    subprocess.run(["git", "add", "."], check=True)
    _write("notes.txt", 300)  # untracked, not ignored: copied
    _write(".cache/pack.part-aa", 5000)  # ignored and carried
    _write(".cache/pack.part-ab", 700)
    _write(".whl/core.whl", 9000)  # ignored, not carried
    tracked = 1000 + os.path.getsize(".gitignore")
    parts = device_copy_size.copy_parts([".cache", "absent"])
    assert parts == {"tracked": tracked, "untracked, not ignored": 300,
                     "carried .cache": 5700, "carried absent": 0}
    total = tracked + 300 + 5700
    assert device_copy_size.main([".cache"], limit=total) == 0
    assert device_copy_size.main([".cache"], limit=total - 1) == 1
    assert "in all" in capsys.readouterr().out
