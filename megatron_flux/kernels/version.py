"""The version of the fused kernels' measured behaviour, recorded in every tuning table.

A tuning table's times are only as good as the kernels they were measured with. ``megatron-flux
tune`` (and ``megatron-flux bench``) record :data:`KERNEL_VERSION` in what they write; a table
whose ``kernel_version`` differs from this one is *stale*: its configs still run (every config
stays valid), but its times no longer decide ``auto`` (:mod:`megatron_flux.tuning.registry`),
and one warning per file says to re-tune.

**When to bump it.** Add one whenever a change can move a measured time of a config that a
table may name:

* a kernel's schedule (tile order, where it waits, what a program does between tiles, how the
  communication is issued or delivered, the stream-K split, the reduction);
* a default a table entry relies on (``default_config``'s values for fields an entry does not
  name, which :mod:`megatron_flux.tuning.schema` fills in);
* a knob's meaning (the same value selecting other code).

Do not bump it for changes that cannot move a measured time: host-side refactors, new knobs
whose default keeps the old code, removing knobs no table sets, documentation.

History: 0 = tables that record no version (measured before it existed); 1 = the kernels the
shipped TP 2 tables (2xH200, 2xH100) were measured and confirmed with.

Not bumped for the warp-specialized GEMM+RS's split tail (its parts sharing the sum, running
first at TP 2, keeping their registers): that moves only the shipped entries of that kernel
with ``stream_k=1`` (21 in the 2xH200 TP 2 table, 3 in the TP 4 one), while a bump would stale
every table, the H100 one included. With communication off, on the shapes measured, the
kernel ran 0.78-1.03x its earlier time, the slower ones within the harness's floor
(``docs/performance.md``, "Communication off on shapes no table lists"). So those entries'
times may be longer than the kernel's, and ``auto``'s choice on them errs toward NCCL if at
all; with communication on the change is not measured, and re-tuning those shapes
(``megatron-flux tune``) is what settles it.
"""

KERNEL_VERSION = 1
