"""Run pytest and record the outcome as JSON (command, versions, GPU, per-test results).

``python benchmarks/record_pytest.py OUT.json [pytest args...]``; exits with pytest's status."""
import json
import os
import platform
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET


def _versions():
    out = {"python": platform.python_version()}
    for mod in ("torch", "triton", "megatron.core"):
        try:
            m = __import__(mod, fromlist=["__version__"])
            out[mod] = getattr(m, "__version__", "?")
        except Exception as exc:  # recorded, not fatal
            out[mod] = f"unavailable: {exc}"
    try:
        import torch

        out["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        out["cuda"] = torch.version.cuda
    except Exception:
        out["gpus"] = []
    return out


def tests_from_junit(xml_path):
    """Per-test outcome, time and message from a pytest ``--junitxml`` file."""
    tests = []
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        outcome, message = "passed", None
        for child in case:
            if child.tag in ("failure", "error"):
                outcome, message = "failed", (child.get("message") or "")[:2000]
            elif child.tag == "skipped":
                outcome, message = "skipped", (child.get("message") or "")[:500]
        tests.append({"test": f"{case.get('classname')}::{case.get('name')}",
                      "outcome": outcome, "time_s": float(case.get("time", 0)), "message": message})
    return tests


def main():
    out_path, args = sys.argv[1], sys.argv[2:]
    with tempfile.TemporaryDirectory() as tmp:
        xml_path = os.path.join(tmp, "junit.xml")
        cmd = [sys.executable, "-m", "pytest", *args, f"--junitxml={xml_path}"]
        # Stream pytest's output as it comes, unfinished lines included (`-v` writes a test's
        # name before it runs and its outcome after), so a run cut off by an outer `timeout`
        # still leaves a log that says which test was running; keep the last line for the record.
        tail = b""
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as proc:
            for chunk in iter(lambda: proc.stdout.read1(65536), b""):
                sys.stdout.buffer.write(chunk)
                sys.stdout.buffer.flush()
                tail = (tail + chunk)[-4096:]
        lines = [ln.strip() for ln in tail.decode(errors="replace").splitlines() if ln.strip()]
        last = lines[-1] if lines else ""
        tests = tests_from_junit(xml_path) if os.path.exists(xml_path) else []
    counts = {k: sum(t["outcome"] == k for t in tests) for k in ("passed", "failed", "skipped")}
    record = {"command": " ".join(["python", "-m", "pytest", *args]), "exit_status": proc.returncode,
              "counts": counts, "env": _versions(),
              "env_vars": {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                                            "NVSHMEM_DISABLE_NVLS", "CUDA_DEVICE_MAX_CONNECTIONS")},
              "summary_line": last, "tests": tests}
    with open(out_path, "w") as f:
        json.dump(record, f, indent=1)
    sys.exit(proc.returncode)


if __name__ == "__main__":
    main()
