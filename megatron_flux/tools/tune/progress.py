"""A progress bar: tqdm when importable, else a one-line text bar on stderr."""

from __future__ import annotations

import sys
import time
from typing import Optional, TextIO


class SimpleProgress:
    """``[#####.....] 12/48 25% ag n=14336 k=4096 m=1024  0:42 elapsed`` redrawn in place."""

    def __init__(self, total: int, desc: str = "", stream: Optional[TextIO] = None, width: int = 24):
        self.total, self.desc, self.n, self.width = max(0, int(total)), desc, 0, width
        self.stream = stream if stream is not None else sys.stderr
        self.t0 = time.monotonic()
        self.postfix = ""

    def render(self) -> str:
        frac = self.n / self.total if self.total else 1.0
        done = int(round(frac * self.width))
        el = int(time.monotonic() - self.t0)
        return (f"{self.desc}[{'#' * done}{'.' * (self.width - done)}] {self.n}/{self.total} "
                f"{frac:4.0%} {self.postfix} {el // 60}:{el % 60:02d} elapsed").rstrip()

    def _draw(self, end: str = "") -> None:
        self.stream.write("\r" + self.render() + end)
        self.stream.flush()

    def update(self, k: int = 1) -> None:
        self.n = min(self.total, self.n + k)
        self._draw()

    def set_postfix_str(self, s: str) -> None:
        self.postfix = s
        self._draw()

    def write(self, msg: str) -> None:
        self.stream.write("\r" + msg + "\n")
        self._draw()

    def close(self) -> None:
        self._draw("\n")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class NullProgress(SimpleProgress):
    """No bar: ``--no-progress`` (messages only, a line each, flushed: a log cut off by a time
    limit still shows how far a run got) and non-zero ranks (nothing: ``messages=False``)."""

    def __init__(self, total: int, desc: str = "", stream: Optional[TextIO] = None, messages: bool = True):
        super().__init__(total, desc, stream=stream if stream is not None else sys.stdout)
        self.messages = messages

    def _draw(self, end: str = "") -> None:
        pass

    def write(self, msg: str) -> None:
        if self.messages:
            self.stream.write(msg + "\n")
            self.stream.flush()


def progress(total: int, desc: str = "", enabled: bool = True, force_simple: bool = False,
             messages: bool = True):
    """A bar with ``update``, ``set_postfix_str``, ``write``, ``close``; ``enabled=False``: no
    bar, ``write`` prints its line unless ``messages`` is false."""
    if not enabled:
        return NullProgress(total, desc, messages=messages)
    if not force_simple:
        try:
            from tqdm import tqdm
        except ImportError:
            pass
        else:
            return tqdm(total=total, desc=desc, dynamic_ncols=True)
    return SimpleProgress(total, desc)
