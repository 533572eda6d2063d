"""Experiment: what would per-tile signals cost the warp-specialized GEMM+RS, communication off?

The GEMM+RS raises each owner's signal once, at a grid barrier after the whole producer phase,
so every push happens before any reduction: at short K (the attention projection, K = hidden /
TP) the peers' rows must cross the link in the first half of the launch. Signals per tile (or
per row block) would let the owners' rows come in turn, with each own tile reduced as soon as
its peers' partials landed; :mod:`megatron_flux.kernels.gemm_rs`'s docstring records that in
the Triton kernel a release per pushed tile ran 2.3-3.7x slower (the release broke the
flattened loop). In the Gluon kernel the epilogue has its own partition, so this measures the
same idea there, on one GPU, as patched copies of ``kernels/gemm_rs_ws.py``:

* ``release``: every producer tile's epilogue drains its TMA store (complete, proxy-fenced),
  meets its partition, and one thread adds 1 (release, system scope) to a word of the owner's
  signals (the copy-engine "produced" word, unused with SM pushes): what a per-tile signal
  costs the producer;
* ``pertile``: that, and every own tile (not only a partition's first) acquires the peers'
  signals before its reduction: what a per-tile wait costs the consumer once the signal is
  there;
* ``turnorder``: the tile order of owners in turn (per group of ``GROUP_M`` row tiles, the
  peers' tiles then the own ones), signals as shipped; ``turns``: that order with the
  per-tile signals of ``pertile``, the schedule such signals would allow (each own tile still
  reduced in its epilogue), minus what crossing NVLink adds.

Against the unpatched kernel (``new``) and the same file loaded as a copy (``prev``, a
control), communication off (``kernel_vs_cublas``'s wiring: local slots, peers' signals
pre-set), the alternating timing of ``kernel_ab.py``. A remote atomic crosses NVLink, so this
is a lower bound of the cost with communication on.

    PYTHONPATH=.:benchmarks/experiments python benchmarks/experiments/per_tile_signal_cost.py \\
        --model-shapes proj:4096:4096:4096 qkvd:4096:6144:6144 fc2:4096:14336:14336 \\
        --m 4096 8192 --json per-tile.json
"""

import argparse
import json
import os
import sys
import tempfile

import kernel_ab
from megatron_flux.tools.tune.candidates import COOPERATIVE_FORM, PINGPONG_FORM

SOURCE = "megatron_flux/kernels/gemm_rs_ws.py"

#: (old text, new text): the producer's release after each pushed tile
RELEASE = ("""            tma_store(push, [off_m, off_n], c_buf)

    @gluon.jit
    def _reduce_own(""", """            tma_store(push, [off_m, off_n], c_buf)
        one_layout: gl.constexpr = gl.BlockedLayout([1], [32], [8 // p.PARTITIONS], [0])
        zero = gl.arange(0, 1, one_layout)
        _drain_stores(zero)
        partition_barrier()
        owner_flags = gl.load(p.flag_ptrs + seg + zero).to(gl.pointer_type(gl.int32))
        gl.atomic_add(owner_flags + p.WORLD + 1, 1 + zero, sem="release", scope="sys")

    @gluon.jit
    def _reduce_own(""")
#: every own tile acquires the peers' signals, not only a partition's first
WAIT_EVERY_TILE = ("""        if waited == 0:
            _wait_peers(p)
            fence_async_proxy(p.epoch, True)""", """        if waited >= 0:
            _wait_peers(p)
            fence_async_proxy(p.epoch, True)""")

#: the owners' row groups in turn: for each group of GROUP_M row tiles, the peers' tiles of it,
#: then the own ones (``step`` as before, so an own tile is still reduced in its epilogue); no
#: serpentine. Only the order: without RELEASE the grid barrier would no longer cover every
#: push, so this is for communication off
TURNS = ("""            tps = tiles_per_segment(p.m_local, p.N, BLOCK_M, BLOCK_N)
            step = t // tps
            seg = segment_of_step(step, p.rank, p.WORLD, True)
            pid_m, pid_n = grouped_tile(serpentine(t, step, tps), gl.cdiv(p.m_local, BLOCK_M),
                                        gl.cdiv(p.N, BLOCK_N), p.GROUP_M)""", """            tps = tiles_per_segment(p.m_local, p.N, BLOCK_M, BLOCK_N)
            n_pid_m = gl.cdiv(p.m_local, BLOCK_M)
            n_pid_n = gl.cdiv(p.N, BLOCK_N)
            group = p.GROUP_M * n_pid_n
            whole = (n_pid_m // p.GROUP_M) * group
            if t < p.WORLD * whole:
                step = (t % (p.WORLD * group)) // group
                local = (t // (p.WORLD * group)) * group + t % group
            else:
                rest = tps - whole
                step = (t - p.WORLD * whole) // rest
                local = whole + (t - p.WORLD * whole) % rest
            seg = segment_of_step(step, p.rank, p.WORLD, True)
            pid_m, pid_n = grouped_tile(local, n_pid_m, n_pid_n, p.GROUP_M)""")


def patched(src: str, patches) -> str:
    for old, new in patches:
        if src.count(old) != 1:
            raise SystemExit(f"patch does not apply ({src.count(old)} matches): {old[:60]!r}")
        src = src.replace(old, new)
    return src


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--forms", default="pp coop", help="pp and/or coop (ping-pong, cooperative)")
    args, rest = p.parse_known_args(argv)
    src = open(SOURCE).read()
    tmp = tempfile.mkdtemp(prefix="per-tile-")
    paths = {}
    for name, patches in (("prev", []), ("release", [RELEASE]),
                          ("pertile", [RELEASE, WAIT_EVERY_TILE]), ("turnorder", [TURNS]),
                          ("turns", [TURNS, RELEASE, WAIT_EVERY_TILE])):
        paths[name] = os.path.join(tmp, f"gemm_rs_ws_{name}.py")
        with open(paths[name], "w") as f:
            f.write(patched(src, patches))
    forms = {"pp": dict(PINGPONG_FORM, rs_warp_specialized=True, stream_k=0),
             "coop": dict(COOPERATIVE_FORM, rs_warp_specialized=True, stream_k=0)}
    chosen = {k: forms[k] for k in args.forms.split()}
    kab = ["--op", "rs", "--prev", paths["prev"], "--launcher", "launch_gemm_rs_ws",
           "--variant", f"release={paths['release']}", "--variant", f"pertile={paths['pertile']}",
           "--variant", f"turnorder={paths['turnorder']}", "--variant", f"turns={paths['turns']}",
           "--forms", json.dumps(chosen)] + rest
    print("kernel_ab.py", " ".join(kab), flush=True)
    kernel_ab.main(kab)


if __name__ == "__main__":
    sys.exit(main())
