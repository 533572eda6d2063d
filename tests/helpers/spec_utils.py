"""Test helpers for reading megatron-core layer specs the same way on 0.16 and 0.19."""

import functools

from megatron.core.transformer.spec_utils import ModuleSpec


def mlp_submodules(mlp_spec):
    """The ``*Submodules`` dataclass of an MLP-like spec entry, in either release's form.

    0.16 writes a layer's ``mlp`` (and MoE ``experts``) as ``ModuleSpec(module=..., submodules=...)``;
    0.19 writes it as ``functools.partial(MLP.as_mlp_submodule, submodules=MLPSubmodules(...))``
    (``partial(MoELayer, ...)``, ``partial(SequentialMLP, ...)`` for MoE). Anything else is an
    error, so a test reading through this never passes on a spec it did not understand.
    """
    if isinstance(mlp_spec, ModuleSpec):
        return mlp_spec.submodules
    if isinstance(mlp_spec, functools.partial):
        if "submodules" not in mlp_spec.keywords:
            raise KeyError(f"partial {mlp_spec!r} has no submodules= keyword")
        return mlp_spec.keywords["submodules"]
    raise TypeError(f"not a ModuleSpec or functools.partial spec: {mlp_spec!r}")
