"""The GPU identity used in table keys: normalised name and SM count, cached per device."""

from __future__ import annotations

from typing import Dict, Tuple

from megatron_flux.tuning.keys import normalize_gpu_name

_CACHE: Dict[Tuple[str, int], Tuple[str, int, str]] = {}


def device_identity(device) -> Tuple[str, int, str]:
    """``(normalised name, SM count, raw name)`` of a CUDA ``device`` (cached; no GPU work)."""
    import torch

    device = torch.device(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (device.type, index)
    ident = _CACHE.get(key)
    if ident is None:
        props = torch.cuda.get_device_properties(index)
        ident = _CACHE[key] = (normalize_gpu_name(props.name), int(props.multi_processor_count), props.name)
    return ident
