"""A bound on how long a tune may go without progress.

The fused kernels' waits are bounded, and a timed-out wait stops the tune on every rank. A rank
that blocks outside them (a stream that never drains under a synchronize, a collective its peers
never join) would hold the tune forever. :class:`ProgressWatchdog` ends that process instead:
when no progress was reported for ``seconds`` (a candidate checked, an entry's timing done) it
says which entry and rank stalled, prints every thread's Python stack (where this rank was), and
exits, so torchrun ends the other ranks.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import threading
import time
from typing import Callable


class ProgressWatchdog:
    """``with dog.watching("ag n=... m=..."):`` ends the process once ``seconds`` pass without
    :meth:`progress` (``seconds`` 0: never)."""

    def __init__(self, seconds: float, rank: int, prog: str, *,
                 exit_fn: Callable[[int], None] = os._exit, out=None, poll_s: float = 1.0):
        self.seconds, self.rank, self.prog = seconds, rank, prog
        self._exit, self._out, self._poll = exit_fn, out, poll_s
        self._last = time.monotonic()

    def progress(self) -> None:
        self._last = time.monotonic()

    @contextlib.contextmanager
    def watching(self, what: str):
        if not self.seconds:
            yield
            return
        done = threading.Event()
        self.progress()

        def watch():
            while not done.wait(self._poll):
                if time.monotonic() - self._last > self.seconds:
                    self._fire(what)
                    return

        thread = threading.Thread(target=watch, name="megatron-flux-tune-watchdog", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()

    def _fire(self, what: str) -> None:
        out = self._out if self._out is not None else sys.stderr
        print(f"{self.prog} (rank {self.rank}): {what}: no progress for {self.seconds:g} s "
              f"(--stall-timeout-s): this rank is stuck outside the kernels' bounded waits (a "
              f"stream that never drains, a collective a peer never joined). Its Python stacks "
              f"follow; the tune ends here, keeping the entries written so far.",
              file=out, flush=True)
        faulthandler.dump_traceback(file=out, all_threads=True)
        out.flush()
        self._exit(3)
