"""``SDPACoreAttention``: megatron-core's local ``DotProductAttention`` on ``torch`` SDPA.

Why this exists: megatron-core's *local* core attention (``DotProductAttention``, the one
``get_gpt_layer_local_spec`` puts in every layer, and so the one megatron-flux's specs keep)
computes attention the textbook way: ``baddbmm`` into a ``[b, np, sq, sk]`` score buffer,
softmax, dropout on the ``[b, np, sq, sk]`` probabilities, ``bmm`` with the values. For a
Llama-3-8B-shaped model at sequence length 4096-8192 those matrices (and their saved copies for
backward) dominate the step's time and memory. Transformer Engine's attention avoids that, but
megatron-flux builds on the local spec. This module is a drop-in replacement for that one leaf:
same constructor and forward signatures, same ``[sq, b, np * hn]`` output, the computation done
by :func:`torch.nn.functional.scaled_dot_product_attention`, for which torch picks a fused
kernel on CUDA (FlashAttention-2 / cuDNN for causal attention without an explicit mask,
memory-efficient attention with a mask, the math fallback only where neither applies, e.g. on
CPU). Put it into a spec with :func:`megatron_flux.specs.swap_core_attention`.

Semantics are DotProductAttention's (megatron-core 0.16 and 0.19, whose class is identical):

* Softmax scale ``softmax_scale`` (constructor) or ``1/sqrt(kv_channels)``.
  ``config.apply_query_key_layer_scaling`` divides the QK^T product by ``layer_number`` and
  multiplies the scores by it again before the softmax (Megatron forces the softmax to fp32
  then), so the effective scale is unchanged; it exists to keep fp16 scores in range, which a
  fused kernel (fp32 softmax statistics inside) does not need. We apply the effective scale
  once; the results agree to rounding.
* Mask: ``attention_mask`` is a boolean tensor broadcastable to ``[b, np, sq, sk]``, ``True``
  = masked out (Megatron's convention). Given a mask, it is used whatever the mask type (as in
  DotProductAttention's unfused softmax, the path it takes in fp32 and for ``sk > 4096``).
  Without one, ``AttnMaskType.causal`` means top-left causal attention when ``sq > 1``
  (``sq == sk`` required) and no mask when ``sq == 1`` (decoding with a KV cache); any other
  type means no mask. A query row whose keys are *all* masked gets the mean of the values,
  what Megatron's ``masked_fill(-10000)`` + softmax gives (uniform probabilities), with zero
  gradient to its query and keys (and no dropout); SDPA alone would give zeros or NaN there depending on the
  kernel.
* Like DotProductAttention, the mask type given to ``forward`` is not used; the constructor's
  is.
* Dropout on the probabilities, ``attention_dropout`` (constructor) or
  ``config.attention_dropout``, in training mode only, inside the model-parallel RNG
  tracker's fork unless ``config.sequence_parallel`` (as DotProductAttention). The dropout
  pattern is SDPA's, so it is equal in distribution, not bit for bit, to Megatron's.
* Grouped-query attention (``ng`` key/value heads dividing ``np`` query heads) goes to SDPA as
  ``enable_gqa=True`` where the installed torch has it (2.5+), else k/v are
  ``repeat_interleave``-d to ``np`` heads as DotProductAttention does.

Performance note: an explicit mask (Megatron-LM's GPT dataloader builds a causal one unless
``--no-create-attention-mask-in-dataloader``) rules out the FlashAttention kernel; torch then
uses its memory-efficient kernel, which reads the ``[b, 1, s, s]`` mask but never materialises
per-head scores. Pass ``attention_mask=None`` with ``AttnMaskType.causal`` for the flash path.

Not supported, each refused with a clear error rather than silently computed differently:
context parallelism (``config.context_parallel_size > 1``), packed sequences
(``packed_seq_params``), ``attention_bias``, sliding-window attention on this layer
(``config.window_size``), ``config.softmax_type`` other than ``"vanilla"``, non-boolean masks.
DotProductAttention supports none of the first three either; the last three it does, and they
stay on megatron-core's class.
"""

from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention
from megatron.core.utils import divide
from torch import Tensor

__all__ = ["SDPACoreAttention"]

#: ``scaled_dot_product_attention(..., enable_gqa=...)`` exists from torch 2.5. A module
#: attribute so tests can exercise the ``repeat_interleave`` fallback.
SDPA_SUPPORTS_GQA = torch.__version__ >= (2, 5)


class SDPACoreAttention(MegatronModule):
    """Core attention (``softmax(QK^T * scale + mask) V``) on ``scaled_dot_product_attention``.

    A drop-in for megatron-core's ``DotProductAttention`` in a layer spec's
    ``SelfAttentionSubmodules.core_attention`` (see the module docstring for why and for the
    exact semantics). No parameters, so checkpoints are unaffected by the swap.

    Args (as ``DotProductAttention``'s, 0.16 and 0.19):
        config: the model's ``TransformerConfig``.
        layer_number: 1-based layer number (``apply_query_key_layer_scaling``'s coefficient,
            sliding-window layer selection).
        attn_mask_type: ``AttnMaskType``; ``causal`` without a mask is causal attention.
        attention_type: ``"self"`` / ``"cross"``; unused (as in DotProductAttention).
        attention_dropout: overrides ``config.attention_dropout`` if not None.
        softmax_scale: overrides ``1/sqrt(kv_channels)`` if not None.
        cp_comm_type: unused; context parallelism is refused.
        pg_collection: process groups with ``tp``; default: megatron's ``parallel_state``.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ):
        super().__init__(config=config)
        self.config: TransformerConfig = config

        if config.context_parallel_size != 1:
            raise NotImplementedError(
                f"SDPACoreAttention: context_parallel_size={config.context_parallel_size}; "
                "context parallelism needs Transformer Engine's attention (TEDotProductAttention)"
            )
        softmax_type = getattr(config, "softmax_type", "vanilla")
        if softmax_type != "vanilla":
            raise NotImplementedError(
                f"SDPACoreAttention: softmax_type={softmax_type!r}; only 'vanilla' softmax maps "
                "onto scaled_dot_product_attention. Keep megatron-core's DotProductAttention "
                "for this model."
            )
        if is_layer_window_attention(
            getattr(config, "window_size", None),
            getattr(config, "window_attn_skip_freq", None),
            layer_number,
        ):
            raise NotImplementedError(
                f"SDPACoreAttention: sliding-window attention (window_size={config.window_size}) "
                f"on layer {layer_number} is not supported. Keep megatron-core's "
                "DotProductAttention for this model."
            )

        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type  # unused, as in DotProductAttention

        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        elif not hasattr(pg_collection, "tp"):
            raise ValueError("SDPACoreAttention: pg_collection must have a tp process group")
        self.pg_collection = pg_collection
        self.tp_group = pg_collection.tp

        world_size = self.tp_group.size()
        projection_size = config.kv_channels * config.num_attention_heads
        self.hidden_size_per_partition = divide(projection_size, world_size)
        self.hidden_size_per_attention_head = divide(projection_size, config.num_attention_heads)
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, world_size)
        self.num_query_groups_per_partition = divide(config.num_query_groups, world_size)

        # The effective scale. DotProductAttention stores softmax_scale / layer_number here
        # under apply_query_key_layer_scaling and multiplies the scores by layer_number again
        # in its softmax; the product is this.
        self.softmax_scale = (
            1.0 / math.sqrt(self.hidden_size_per_attention_head)
            if softmax_scale is None
            else softmax_scale
        )
        self.attention_dropout_p = float(
            config.attention_dropout if attention_dropout is None else attention_dropout
        )

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
    ) -> Tensor:
        """``query`` ``[sq, b, np, hn]``, ``key``/``value`` ``[sk, b, ng, hn]`` → ``[sq, b, np*hn]``.

        ``attn_mask_type`` is accepted and not used, as in DotProductAttention.
        """
        if packed_seq_params is not None:
            raise NotImplementedError(
                "SDPACoreAttention: packed sequences (packed_seq_params) are not supported; "
                "use Transformer Engine's attention (as with DotProductAttention)"
            )
        if attention_bias is not None:
            raise NotImplementedError("SDPACoreAttention: attention_bias is not supported")
        if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
            raise ValueError(
                "SDPACoreAttention expects query [sq, b, np, hn] and key/value [sk, b, ng, hn], "
                f"got {tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
            )
        sq, b, n_heads, _ = query.shape
        sk, n_groups = key.size(0), key.size(2)
        if n_groups == 0 or n_heads % n_groups or value.size(2) != n_groups:
            raise ValueError(
                f"SDPACoreAttention: {n_heads} query heads and {n_groups} key / {value.size(2)} "
                "value heads; the key/value head count must divide the query head count"
            )

        mask = attention_mask
        is_causal = False
        if mask is None:
            if self.attn_mask_type == AttnMaskType.causal and sq > 1:
                if sq != sk:
                    raise ValueError(
                        f"SDPACoreAttention: causal attention without a mask needs sq == sk "
                        f"(got sq={sq}, sk={sk}), as in DotProductAttention"
                    )
                is_causal = True
        elif mask.dtype != torch.bool:
            raise ValueError(
                f"SDPACoreAttention: attention_mask must be boolean (True = masked out, "
                f"Megatron's convention), got {mask.dtype}"
            )

        # [s, b, heads, hn] -> [b, heads, s, hn]: views, SDPA's kernels take the strides.
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        rep = n_heads // n_groups
        gqa_kwargs = {}
        if rep > 1:
            if SDPA_SUPPORTS_GQA:
                gqa_kwargs["enable_gqa"] = True
            else:
                k = k.repeat_interleave(rep, dim=1)
                v = v.repeat_interleave(rep, dim=1)

        fully_masked = None
        sdpa_mask = None
        if mask is not None:
            # SDPA's boolean masks mean True = attend. Rows with every key masked are opened
            # up (finite on every kernel) and replaced below by Megatron's value for them.
            fully_masked = mask.all(dim=-1, keepdim=True)
            sdpa_mask = ~mask | fully_masked

        dropout_p = self.attention_dropout_p if self.training else 0.0
        # DotProductAttention drops out inside the model-parallel RNG fork unless SP is on.
        fork = dropout_p > 0.0 and not self.config.sequence_parallel
        with tensor_parallel.get_cuda_rng_tracker().fork() if fork else contextlib.nullcontext():
            out = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=sdpa_mask,
                dropout_p=dropout_p,
                is_causal=is_causal,
                scale=self.softmax_scale,
                **gqa_kwargs,
            )

        if fully_masked is not None:
            # Megatron: all scores -10000 -> uniform probabilities -> the mean of the values.
            v_mean = v.mean(dim=2, keepdim=True)  # [b, heads_v, 1, hv]
            if v_mean.size(1) != n_heads:
                v_mean = v_mean.repeat_interleave(n_heads // v_mean.size(1), dim=1)
            out = torch.where(fully_masked, v_mean, out)

        # [b, np, sq, hv] -> [sq, b, np * hv]
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)
