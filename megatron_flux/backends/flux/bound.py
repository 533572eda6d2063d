"""Eager fused calls through their call plan's bound launch.

A call plan (:func:`.rs.rs_plan`, :func:`.ag.ag_plan`) fixes everything a launch of its
signature passes except the operands, the output and the epoch. So each parity's first eager
call launches through the kernel's launcher (its plan, descriptors and specialisation key), and
that launch is bound (:func:`~megatron_flux.kernels.launch.bind_last_launch`) with the call's
operands as per-call roles and the plan's buffers as kept; the parity's later calls pass just
their operands and epoch to it (:class:`~megatron_flux.kernels.launch.BoundLaunch`). Where the
bound launch steps aside, the call launches as usual and binds that launch instead; a launch
that cannot be bound (Triton's own launch path, an argument the plan does not keep) leaves the
parity unbound for good.
"""

from __future__ import annotations

from megatron_flux.backends.flux.resources import deps


def launch_or_bound(backend, plan, parity: int, eager: bool, roles: tuple, epoch: int, kept: tuple,
                    launch) -> None:
    """One launch of ``plan``'s kernel for parity ``parity``: through its bound launch with
    ``roles`` (the call's tensors, in the plan's order) and ``epoch``, else ``launch()``, bound
    afterwards where nothing was bound yet. Only eager calls with call plans and the direct
    launch on (``FluxBackend.bound_launches``, ``call_plans``, ``FluxOptions.direct_launch``)."""
    bound = plan.bound[parity] if eager and backend.options.direct_launch else False
    if bound and bound(roles + (epoch,)):
        return
    bind = bound is not False and backend.bound_launches and backend.call_plans
    d = deps()
    if bind:
        d.forget_last_launch()  # bind this launch, not an earlier one
    launch()
    if bind:
        plan.bound[parity] = d.bind_last_launch(roles, ("epoch",), kept) or False
