"""Core attention for megatron-core layers: torch SDPA with three modes and a Jacobi KV cache.

Plugged into the layer spec as ``core_attention`` (replacing megatron's ``DotProductAttention``),
so megatron keeps the projections, RoPE, tensor parallelism and pipelining, and we own the part
Jacobi Forcing changes: which keys a query sees.

Modes, chosen per forward:

* **causal** (``attention_mask is None``, no cache): ordinary causal attention. This is also the
  two-stream fast path for the noise-conditioned packed sequence (paper Sec. 3.1): the packed
  ``[prompt, noisy B1, clean B1, …]`` sequence is exactly two causal sequences that share position ids,
  so training runs stock causal kernels (FlashAttention inside SDPA on GPU).
* **masked** (``attention_mask`` given, megatron convention ``True = masked out``, ``[b|1, 1, sq, sk]``):
  any block-sparse pattern (NC-IC, clean-context, or NC as a reference).
* **cached** (a :class:`~megatron_jf.models.kv_cache.KVCache` attached): decoding; keys/values of the
  new tokens are written to the cache and attention runs over committed + new slots.

Shapes: query ``[sq, b, np, hn]``, key/value ``[sk, b, ng, hn]`` (np/ng = heads/KV groups on this TP
rank); output ``[sq, b, np * hn]``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule


class JFCoreAttention(MegatronModule):
    """SDPA core attention with causal / explicit-mask / KV-cache modes (see module docstring).

    Constructor arguments follow megatron-core's ``DotProductAttention`` so the class drops into a
    layer spec. Dropout is not supported (Qwen2.5 and Llama use none).

    Raises:
        ValueError: at construction, for attention dropout > 0 or context parallelism.
    """

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None):
        super().__init__(config=config)
        if (attention_dropout if attention_dropout is not None else config.attention_dropout) > 0:
            raise ValueError("JFCoreAttention does not implement attention dropout")
        if config.context_parallel_size != 1:
            raise ValueError("JFCoreAttention does not support context parallelism")
        self.layer_number = layer_number
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)
        self.kv_cache = None  # set by megatron_jf.models.gpt.attach_kv_cache
        self.cache_slot = -1

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is not None:
            raise NotImplementedError("packed THD sequences need the Transformer Engine attention path")
        if attention_bias is not None:
            raise NotImplementedError("attention_bias is not supported")
        sq, b, nh, hd = query.shape
        q = query.permute(1, 2, 0, 3)
        k = key.permute(1, 2, 0, 3)
        v = value.permute(1, 2, 0, 3)
        gqa = k.shape[1] != nh
        cache = self.kv_cache
        if cache is not None:
            k, v, allow = cache.update(self.cache_slot, k, v)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=allow, scale=self.softmax_scale,
                                                 enable_gqa=gqa)
        elif attention_mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale,
                                                 enable_gqa=gqa)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=~attention_mask, scale=self.softmax_scale,
                                                 enable_gqa=gqa)
        return out.permute(2, 0, 1, 3).reshape(sq, b, nh * hd)
