"""One record of a test suite run in parts (GPU lanes, several device calls).

``python benchmarks/merge_pytest_records.py OUT.json PART...``: each PART is a
``device_parallel.sh`` ``results.tgz``, a folder holding ``lane*/`` folders, or one lane folder.
A lane's ``tests-gpu.json`` (``benchmarks/record_pytest.py``) gives its command, versions and
per-test outcomes; a lane cut off by its timeout has no JSON, so its ``-v`` log gives the tests
that passed or failed before the cut (and the one it was in, as ``unfinished``). The record
lists the parts and, per test id (``path::name[params]``), the outcome of the last part that
finished it. Exit status 1 when any test failed or none was found."""

import json
import os
import re
import sys
import tarfile
import tempfile
from collections import Counter

_LOG_LINE = re.compile(r"^(tests/\S+::\S+)(?: (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS))?")


def _test_id(junit_name: str) -> str:
    """``tests.gpu.test_x::test_y[p]`` (JUnit's class name form) -> ``tests/gpu/test_x.py::test_y[p]``."""
    if ".py::" in junit_name:
        return junit_name
    module, name = junit_name.split("::", 1)
    return module.replace(".", "/") + ".py::" + name


def _from_log(path: str):
    """Outcomes in a ``-v`` log; the last test named without an outcome is ``unfinished``."""
    tests, unfinished = [], None
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            m = _LOG_LINE.match(line.strip())
            if not m:
                continue
            if m.group(2):
                tests.append({"test": m.group(1), "outcome": m.group(2).lower()})
                unfinished = None
            else:
                unfinished = m.group(1)
    if unfinished:
        tests.append({"test": unfinished, "outcome": "unfinished"})
    return tests


def _lanes(part: str):
    """``(label, lane folder)`` of every lane in ``part`` (extracting a ``.tgz`` first)."""
    if part.endswith(".tgz"):
        tmp = tempfile.mkdtemp(prefix="pytest-parts-")
        with tarfile.open(part) as tar:
            tar.extractall(tmp)
        root = tmp
    else:
        root = part
    if os.path.exists(os.path.join(root, "tests-gpu.log")):
        return [(part, root)]
    names = sorted(n for n in os.listdir(root) if n.startswith("lane"))
    return [(f"{part}:{n}", os.path.join(root, n)) for n in names]


def merge(parts):
    record = {"parts": [], "outcomes": {}, "tests": {}}
    for part in parts:
        for label, lane in _lanes(part):
            json_path = os.path.join(lane, "tests-gpu.json")
            log_path = os.path.join(lane, "tests-gpu.log")
            if os.path.exists(json_path):
                rec = json.load(open(json_path))
                tests = [{"test": _test_id(t["test"]), "outcome": t["outcome"],
                          "time_s": t.get("time_s")} for t in rec["tests"]]
                entry = {"part": label, "command": rec["command"], "exit_status": rec["exit_status"],
                         "env": rec.get("env"), "env_vars": rec.get("env_vars")}
            elif os.path.exists(log_path):
                tests = _from_log(log_path)
                entry = {"part": label, "command": None, "exit_status": None,
                         "note": "no JSON (cut off by its timeout): outcomes from the -v log"}
            else:
                continue
            entry["counts"] = dict(Counter(t["outcome"] for t in tests))
            record["parts"].append(entry)
            for t in tests:
                if t["outcome"] != "unfinished" or t["test"] not in record["tests"]:
                    record["tests"][t["test"]] = t["outcome"]
    record["outcomes"] = dict(Counter(record["tests"].values()))
    return record


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2:
        print(__doc__)
        return 2
    record = merge(argv[1:])
    with open(argv[0], "w") as f:
        json.dump(record, f, indent=1)
    print(f"{len(record['tests'])} tests: {record['outcomes']}")
    bad = set(record["outcomes"]) - {"passed", "skipped"}
    return 1 if bad or not record["tests"] else 0


if __name__ == "__main__":
    sys.exit(main())
