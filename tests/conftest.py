"""Settings every test file shares.

Triton's nanobind leak report
-----------------------------
Compiling a Gluon kernel in a process (``test_kernels_compile``'s warp-specialized kernels,
whenever Triton's cache does not already hold them: a fresh machine, a kernel edit, a Triton
upgrade) leaves four ``triton._C.libtriton.ir.attribute`` objects referenced from C++ inside
libtriton, where no Python code can free them. At interpreter exit nanobind lists everything
of its bindings still alive: "nanobind: leaked 4 instances!", then the 7 types and 326 functions
those keep alive, one line each, after pytest's summary. It is Triton's (libtriton's Gluon
bindings) and says nothing about this repository; Triton drops the same report in its own
compile workers by sending their stderr to /dev/null at exit
(``triton/_compile_warmup_pool.py``).

Here only the report's lines go: at exit, after pytest has written its summary and given the
terminal back, this process's stderr is routed through a small filter process that drops the
lines nanobind writes and passes everything else through (a crash or a warning while the
interpreter shuts down still shows).
"""

import atexit
import os
import subprocess
import sys

#: beginnings of the lines of nanobind's shutdown leak report
_NANOBIND_REPORT = (b"nanobind: leaked ", b" - leaked ", b" - ... skipped remainder",
                    b"nanobind: this is likely caused by a reference counting issue",
                    b"See https://nanobind.readthedocs.io/en/latest/refleaks.html")

_FILTER = f"""
import sys
drop = {_NANOBIND_REPORT!r}
out = sys.stderr.buffer
for line in sys.stdin.buffer:
    if not line.startswith(drop):
        out.write(line)
        out.flush()
"""


def _drop_nanobind_leak_report() -> None:
    """Route the rest of this process's stderr through :data:`_FILTER` (only where libtriton,
    whose bindings report, was loaded)."""
    if "triton._C.libtriton" not in sys.modules:
        return
    try:
        sys.stderr.flush()
        proc = subprocess.Popen([sys.executable, "-S", "-c", _FILTER], stdin=subprocess.PIPE,
                                stdout=subprocess.DEVNULL)
        os.dup2(proc.stdin.fileno(), 2)
        proc.stdin.close()  # fd 2 keeps the pipe open until this process is gone
    except OSError:
        pass  # no filter: the report shows, nothing else changes


atexit.register(_drop_nanobind_leak_report)
