"""Stream-K tail for the persistent fused GEMMs: the last, partial wave split along K.

A persistent grid of ``G`` programs over ``T`` equal output tiles runs ``ceil(T / G)`` rounds,
the last one only ``(T % G) / G`` full. On H200 (``G = 132``) the 128x256 tiles of llama3-70b's
fc1 at m = 4096 (TP=2) make 27.15 waves, run as 28: 3 % of the kernel's time with most SMs
idle. With the fused op's whole margin over NCCL + cuBLAS at a few percent, that matters.

Schedule (``GemmConfig.stream_k``; in GEMM+RS the tail's own tiles end in the reduction):

* ``0``: off, every tile is one program's (the data-parallel schedule).
* ``1``: when the partial last wave is small (``T % G <= MAX_TAIL_FRACTION * G``), its tiles
  are *stream-K tiles*; the rest stays data-parallel. Stream-K tiles are kept inside the last
  segment (see :func:`stream_k_plan`).
* The stream-K tiles' ``S * k_tiles`` K-iterations are cut into ``G`` equal contiguous ranges,
  one per program (``per = cdiv(S * k_tiles, G)``), walked after the program's data-parallel
  tiles. A range covers the end of one tile, maybe whole tiles, and the start of another.
* A tile covered by one program is stored directly. Otherwise every program covering it
  writes its fp32 partial to its own scratch slot (``[program, 0]`` for the first tile of its
  range, ``[program, 1]`` for the last: only those can be partial), then counts itself in on
  the tile's counter (acq_rel, GPU scope). The last to arrive resets the counter, adds the
  slots up in program order and stores the tile, so the result does not depend on who arrived
  last: repeated calls are bitwise identical. Nobody waits for anybody, so a program that is
  not resident yet (another kernel holding SMs) delays the tile but cannot deadlock it.

Why the threshold (measured on H200 with communication disabled, two GPUs as replicates):
splitting saves ``1 - tail`` of a tile's time and costs the
partials' round trip and a shorter, 2-stage K loop. With the tail at 0.15-0.30 of a wave it
was 0.9-3.8 % faster than data-parallel (llama3-70b fc1 at m = 4096 and 8192, gpt3-175b at 4096,
llama3-8b at 8192); at 0.55-0.82 it was 0.2-15 % slower. A variant that also split one full
wave before the tail was slower than this one on all 12 grid shapes and was removed.

The host side here sizes the plan and keeps one scratch (slots + counters) per device and
stream: kernels on one stream run one after another, so they can share it, and the counters
are back at zero when each launch ends.
"""

from __future__ import annotations

import warnings
from typing import Callable, Dict, Tuple

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

STREAM_K_MODES = (0, 1)
#: split the partial last wave only when it fills at most this share of the grid
MAX_TAIL_FRACTION = 0.35


def stream_k_plan(total_tiles: int, num_sms: int, mode: int, last_segment_tiles: int) -> Tuple[int, int]:
    """``(grid, stream-K tiles)`` for ``total_tiles`` output tiles on ``num_sms`` SMs.

    Stream-K (mode 1) takes the ``total_tiles % num_sms`` tiles of the partial last wave when
    they are at most :data:`MAX_TAIL_FRACTION` of a wave, there is at least one whole wave
    before them, and they lie in the last segment (``last_segment_tiles`` tiles): the kernel
    reads them through one A descriptor (one K loop: two loops feeding one accumulator made
    ptxas serialise every wgmma of the kernel). Otherwise the grid is
    ``min(num_sms, total_tiles)`` and nothing is split."""
    if mode not in STREAM_K_MODES:
        raise ValueError(f"stream_k mode must be one of {STREAM_K_MODES}, got {mode}")
    if total_tiles <= 0:
        return 0, 0
    tail = total_tiles % num_sms
    if (mode == 0 or tail == 0 or total_tiles < num_sms or tail > MAX_TAIL_FRACTION * num_sms
            or tail > last_segment_tiles):
        return min(num_sms, total_tiles), 0
    return num_sms, tail


class _Scratch:
    __slots__ = ("partials", "counters")

    def __init__(self, partials: torch.Tensor, counters: torch.Tensor):
        self.partials = partials
        self.counters = counters


_SCRATCH: Dict[tuple, _Scratch] = {}


def _scratch_key(device: torch.device) -> tuple:
    """Which scratch launches on the current stream of ``device`` use (one per CPU)."""
    if device.type == "cpu":
        return ("cpu",)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return (index, torch.cuda.current_stream(device).cuda_stream)


def current_scratch(device: torch.device):
    """The scratch :func:`stream_k_scratch` holds for the current stream of ``device``, or None."""
    return _SCRATCH.get(_scratch_key(device))


def stream_k_scratch(device: torch.device, grid: int, block_m: int, block_n: int) -> _Scratch:
    """Slots ``[grid, 2, block_m * block_n]`` fp32 and ``2 * grid`` int32 counters (zero) for
    launches on the current stream of ``device`` (one per CPU, for the interpreter); grown,
    never shrunk."""
    key = _scratch_key(device)
    need = grid * 2 * block_m * block_n
    counters = 2 * grid
    s = _SCRATCH.get(key)
    if s is None or s.partials.numel() < need or s.counters.numel() < counters:
        old_p = s.partials.numel() if s is not None else 0
        old_c = s.counters.numel() if s is not None else 0
        s = _SCRATCH[key] = _Scratch(
            torch.empty(max(need, old_p), dtype=torch.float32, device=device),
            torch.zeros(max(counters, old_c), dtype=torch.int32, device=device))
    return s


#: ``(op, config)`` pairs whose stream-K loop did not fit in shared memory beside the config's
#: own pipeline (:func:`launch_with_stream_k_fallback`); their launches plan no split
_TOO_BIG: set = set()


def stream_k_fits(op: str, cfg) -> bool:
    """False once ``cfg``'s stream-K variant of ``op`` ran out of shared memory."""
    return (op, cfg) not in _TOO_BIG


def launch_with_stream_k_fallback(op: str, cfg, launch: Callable[[], None],
                                  relaunch: Callable[[], None], split: Callable[[], bool]) -> None:
    """Run ``launch()``. If loading its binary raises OutOfResources (before anything ran) and
    the launch split a tail (``split()``: the plan it compiled had stream-K tiles), the stream-K
    loop's own pipeline buffers did not fit beside the config's: remember ``(op, cfg)``
    (:func:`stream_k_fits`), warn, and ``relaunch()`` the same call, which then plans no split.
    Any other OutOfResources propagates. The AG+GEMM and GEMM+RS launchers share it."""
    try:
        launch()
    except OutOfResources as exc:
        if not split():
            raise
        _TOO_BIG.add((op, cfg))
        warnings.warn(f"megatron-flux {op}: {cfg} needs more shared memory with stream_k="
                      f"{cfg.stream_k} than this GPU has ({exc}); running it without stream-K")
        relaunch()


@triton.jit
def sk_range(pid, sk_tiles, k_tiles, NUM_SMS: tl.constexpr):
    """This program's K-iterations ``[start, end)`` of the stream-K phase, and ``per``."""
    total = sk_tiles * k_tiles
    per = tl.cdiv(total, NUM_SMS)
    start = tl.minimum(pid * per, total)
    end = tl.minimum(start + per, total)
    return start, end, per


@triton.jit
def sk_covering(u, per, k_tiles):
    """The first and last program whose K-iterations cover stream-K tile ``u``."""
    return (u * k_tiles) // per, ((u + 1) * k_tiles - 1) // per


@triton.jit
def sk_publish_part(acc, partials_ptr, counters_ptr, pid, u, per, k_tiles, first, last,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Write this program's part ``acc`` of tile ``u`` (covered by programs ``first..last``,
    more than one) to its slot and count it in; True for the last to arrive, which then owns
    the tile (:func:`sk_sum_parts`). The caller stores a tile covered by one program itself:
    keeping the two paths apart keeps ``acc`` out of any merge with the summed tile (a merged
    accumulator made ptxas serialise every wgmma of the kernel, C7515)."""
    return publish_part(acc, _slot_ptrs(partials_ptr, pid, u, per, k_tiles, BLOCK_M, BLOCK_N),
                        counters_ptr + u) == last - first


@triton.jit
def publish_part(acc, part_ptrs, counter_ptr):
    """Store a program's fp32 part of a tile at ``part_ptrs``, then count it in at the tile's
    counter (acq_rel, GPU scope, after the whole CTA's stores); returns how many had arrived
    before. The one that sees the tile's part count less one owns the tile: it calls
    :func:`claim_tile`, then reads the parts (``.cg``). ``part_ptrs`` is the program's own
    slot for the tile (:func:`_slot_ptrs`): no two parts of one launch share a slot."""
    tl.store(part_ptrs, acc)
    tl.debug_barrier()
    return tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")


@triton.jit
def claim_tile(counter_ptr):
    """The tile's last arrival resets its counter for the next launch, before its CTA reads
    the parts (:func:`publish_part`)."""
    tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")
    tl.debug_barrier()


@triton.jit
def sk_sum_parts(partials_ptr, counters_ptr, u, per, k_tiles, first, last,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Tile ``u`` as the sum of its programs' parts in program order (fixed, so bitwise
    reproducible); resets the tile's counter for the next launch."""
    claim_tile(counters_ptr + u)
    tile = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for p in range(first, last + 1):
        tile += tl.load(_slot_ptrs(partials_ptr, p, u, per, k_tiles, BLOCK_M, BLOCK_N),
                        cache_modifier=".cg")
    return tile


@triton.jit
def _slot_ptrs(partials_ptr, program, u, per, k_tiles, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Pointers of ``program``'s slot for stream-K tile ``u``: ``[program, 0]`` when ``u`` is
    the first tile of its K range, else ``[program, 1]`` (only a range's first and last tiles
    can be partial)."""
    j = tl.where(u == (program * per) // k_tiles, 0, 1)
    offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    return partials_ptr + (program * 2 + j).to(tl.int64) * (BLOCK_M * BLOCK_N) + offs


def fallback_generation() -> int:
    """How many ``(op, config)`` pairs have lost their stream-K split so far: part of the key of
    a launcher's per-shape plan, so a plan made before a fallback is not reused after it."""
    return len(_TOO_BIG)


def scratch_of(device_index: int, stream: int):
    """The scratch :func:`stream_k_scratch` holds for launches on ``stream`` (a raw CUDA stream
    handle) of device ``device_index``, or None: a bound launch that passes its buffers checks
    they are still the ones held (:class:`~megatron_flux.kernels.launch.BoundLaunch`)."""
    return _SCRATCH.get((device_index, stream))
