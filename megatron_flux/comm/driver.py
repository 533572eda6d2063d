"""CUDA driver entry points that torch does not expose, looked up in ``libcuda`` by ctypes."""

from __future__ import annotations

import ctypes
from typing import Callable, Optional, Sequence, Tuple


def load_driver_function(names: Sequence[str], argtypes: Sequence[type]
                         ) -> Tuple[Optional[Callable[..., int]], Optional[str]]:
    """``(function, None)``: the first of ``names`` that ``libcuda.so.1`` exports, typed with
    ``argtypes`` and returning its ``CUresult`` as an int; or ``(None, why not)``. Callers keep
    the answer (a lookup opens the library)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        return None, f"libcuda.so.1 not loadable: {exc}"
    for name in names:
        fn = getattr(lib, name, None)
        if fn is not None:
            fn.restype = ctypes.c_int
            fn.argtypes = list(argtypes)
            return fn, None
    return None, f"libcuda has no {' or '.join(names)}"
