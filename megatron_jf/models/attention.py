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
* **packed** (``packed_seq_params`` given, megatron-core
  :class:`~megatron.core.packed_seq_params.PackedSeqParams` with ``qkv_format="thd"``): several causal
  segments packed back to back into one sequence without padding, delimited by ``cu_seqlens_q``
  (int32 ``[num_segments + 1]``, the cumulative segment lengths). This is the ``packed`` attention path
  (:mod:`megatron_jf.training.attention_paths`): the noisy and clean streams of every sample are
  segments. Each query sees the keys of its own segment up to itself. With
  :class:`GatheredKVPackedSeqParams` (the ``nc_ic`` / ``clean`` masks on the packed path,
  :mod:`megatron_jf.data.thd`) each query segment attends instead to its own keys gathered by ``kv_index``
  (a prefix, then the segment itself), bottom-right causal: query ``i`` of ``m`` sees gathered keys
  ``0 .. a + i`` of ``a + m``.
* **cached** (a :class:`~megatron_jf.models.kv_cache.KVCache` attached): decoding; keys/values of the
  new tokens are written to the cache and attention runs over committed + new slots.

Backends. With Transformer Engine and CUDA present (:data:`megatron_jf.platform.HAVE_TE`) the packed
mode runs TE's fused attention (megatron-core ``TEDotProductAttention``, ``qkv_format="thd"``, mask type
``padding_causal``, or ``padding_causal_bottom_right`` with gathered keys: FlashAttention/cuDNN varlen
kernels, no padding, no ``[L, L]`` mask). Otherwise (CPU, or ``MEGATRON_JF_DISABLE_TE=1``) it runs one
torch SDPA per segment. The masked mode runs torch
SDPA by default: on CUDA, SDPA with a boolean mask takes its memory-efficient kernel (``O(L)`` saved
activations), whereas TE's arbitrary-mask attention (``AttnMaskType.arbitrary``) is served only by TE's
*unfused* backend (TE's backend selection disables FlashAttention and FusedAttention for arbitrary
masks), which materialises ``[b, h, L, L]`` scores. TE's arbitrary-mask path is there for comparison:
``MEGATRON_JF_TE_ARBITRARY_MASK=1`` (or the ``te_arbitrary_mask`` argument; :class:`megatron_jf.platform.TESwitches`)
selects it. The causal and
cached modes always use SDPA (FlashAttention inside SDPA on GPU). The TE module holds no parameters and
is kept out of the module tree, so checkpoints are identical with and without TE.

Shapes: query ``[sq, b, np, hn]``, key/value ``[sk, b, ng, hn]`` (np/ng = heads/KV groups on this TP
rank); output ``[sq, b, np * hn]``. Packed mode (megatron squeezes the dummy batch dimension):
query ``[t, np, hn]``, key/value ``[t, ng, hn]``, output ``[t, np * hn]`` with ``t = cu_seqlens_q[-1]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from megatron_jf import platform
from megatron_jf.precision import cpu_attention_in_fp32


@dataclass
class GatheredKVPackedSeqParams(PackedSeqParams):
    """``PackedSeqParams`` whose query segments attend to gathered keys (see the module docstring).

    megatron-core reads the parent fields (``cu_seqlens_kv`` must equal ``cu_seqlens_q``: RoPE is applied
    to the ``t`` keys before the gather); the core attention reads these.

    Attributes:
        kv_index: int64 ``[t_kv]``: the row of ``key``/``value`` ``[t, ...]`` behind each gathered key.
        cu_seqlens_kv_gathered: int32 ``[segments + 1]``: gathered-key segment boundaries.
        max_seqlen_kv_gathered: the longest gathered-key segment.
    """

    kv_index: torch.Tensor = None
    cu_seqlens_kv_gathered: torch.Tensor = None
    max_seqlen_kv_gathered: int = None


class JFCoreAttention(MegatronModule):
    """SDPA core attention with causal / explicit-mask / KV-cache modes (see module docstring).

    Constructor arguments follow megatron-core's ``DotProductAttention`` so the class drops into a
    layer spec, plus ``te_arbitrary_mask`` (see the module docstring; None: the environment's
    :class:`~megatron_jf.platform.TESwitches`). Dropout is not supported (Qwen2.5 and Llama use none).

    Raises:
        ValueError: at construction, for attention dropout > 0 or context parallelism.
    """

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None, te_arbitrary_mask: bool | None = None):
        super().__init__(config=config)
        if (attention_dropout if attention_dropout is not None else config.attention_dropout) > 0:
            raise ValueError("JFCoreAttention does not implement attention dropout")
        if config.context_parallel_size != 1:
            raise ValueError("JFCoreAttention does not support context parallelism")
        self.layer_number = layer_number
        self.attention_type = attention_type
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)
        self.pg_collection = pg_collection
        self.kv_cache = None  # set by megatron_jf.models.gpt.attach_kv_cache
        self.cache_slot = -1
        #: None = automatic (TE when platform.HAVE_TE and the inputs are on CUDA); False = always SDPA.
        self.use_te: bool | None = None
        #: Masked mode through TE's arbitrary-mask (unfused) attention instead of SDPA (see module docstring);
        #: None: ``MEGATRON_JF_TE_ARBITRARY_MASK`` (:class:`megatron_jf.platform.TESwitches`).
        self.te_arbitrary_mask: bool = (platform.TESwitches.from_env().arbitrary_mask if te_arbitrary_mask is None
                                        else te_arbitrary_mask)

    def _te_enabled(self, query: torch.Tensor) -> bool:
        if self.use_te is False or not platform.HAVE_TE or not query.is_cuda:
            return False
        return True

    def _te_attention(self):
        """megatron-core's ``TEDotProductAttention`` for this layer, built on first use.

        Stored outside the module tree (``object.__setattr__``): it has no parameters, and keeping it
        unregistered leaves the state dict (and so every checkpoint) the same as without TE.
        """
        te = self.__dict__.get("_te")
        if te is None:
            from megatron.core.extensions.transformer_engine import TEDotProductAttention

            te = TEDotProductAttention(self.config, self.layer_number, AttnMaskType.padding_causal,
                                       self.attention_type, attention_dropout=0.0,
                                       softmax_scale=self.softmax_scale, pg_collection=self.pg_collection)
            object.__setattr__(self, "_te", te)
        return te

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        """Core attention in the mode the arguments select (module docstring).

        Args:
            query: ``[sq, b, np, hn]`` (packed: ``[t, np, hn]``); key/value ``[sk, b, ng, hn]`` (packed ``[t, ng, hn]``).
            attention_mask: bool ``[b|1, 1, sq, sk]``, True = masked out, or None (causal / cached).
            packed_seq_params: megatron-core ``PackedSeqParams`` (``qkv_format="thd"``) for the packed mode.

        Returns:
            ``[sq, b, np * hn]`` (packed: ``[t, np * hn]``), the input dtype.

        Raises:
            NotImplementedError: ``attention_bias``, or packed sequences with a KV cache attached.
            ValueError: malformed ``packed_seq_params``.
        """
        if attention_bias is not None:
            raise NotImplementedError("attention_bias is not supported")
        if packed_seq_params is not None:
            if self.kv_cache is not None:
                raise NotImplementedError("packed THD sequences cannot be decoded through a KV cache")
            _check_packed(packed_seq_params, query)
            kv_index = getattr(packed_seq_params, "kv_index", None)
            if kv_index is not None:
                key, value = key.index_select(0, kv_index), value.index_select(0, kv_index)
                cu_kv = packed_seq_params.cu_seqlens_kv_gathered
                if self._te_enabled(query):
                    from transformer_engine.pytorch import DotProductAttention

                    p = packed_seq_params
                    # TE's own forward (megatron's wrapper maps only causal -> padding_causal for thd)
                    return DotProductAttention.forward(
                        self._te_attention(), query, key, value, None, qkv_format="thd",
                        attn_mask_type="padding_causal_bottom_right", cu_seqlens_q=p.cu_seqlens_q,
                        cu_seqlens_kv=cu_kv, max_seqlen_q=p.max_seqlen_q, max_seqlen_kv=p.max_seqlen_kv_gathered)
                return packed_causal_sdpa(query, key, value, packed_seq_params.cu_seqlens_q, self.softmax_scale,
                                          cu_seqlens_kv=cu_kv)
            if self._te_enabled(query):
                return self._te_attention()(query, key, value, None, attn_mask_type=AttnMaskType.padding_causal,
                                            packed_seq_params=packed_seq_params)
            return packed_causal_sdpa(query, key, value, packed_seq_params.cu_seqlens_q, self.softmax_scale)
        if attention_mask is not None and self.kv_cache is None and self.te_arbitrary_mask and self._te_enabled(query):
            return self._te_attention()(query, key, value, attention_mask, attn_mask_type=AttnMaskType.arbitrary)
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
        else:
            allow = None if attention_mask is None else ~attention_mask
            if cpu_attention_in_fp32(q, k.shape[2]):  # CPU bf16 autocast: fp32 is faster here (megatron_jf.precision)
                with torch.autocast("cpu", enabled=False):
                    out = gqa_sdpa(q.float(), k.float(), v.float(), allow, self.softmax_scale).to(q.dtype)
            else:
                out = gqa_sdpa(q, k, v, allow, self.softmax_scale)
        return out.permute(2, 0, 1, 3).reshape(sq, b, nh * hd)


def gqa_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allow: torch.Tensor | None, scale: float | None, *,
             expand_kv: bool | None = None) -> torch.Tensor:
    """Torch SDPA over grouped-query K/V for the training modes: causal (``allow`` None: the two-stream path) or
    under a boolean mask (the masked path).

    Args:
        q: ``[b, np, sq, hn]``; k, v: ``[b, ng, sk, hn]`` (``np`` a multiple of ``ng``).
        allow: bool, broadcastable to ``[b, np, sq, sk]``, ``True`` = attend; None: causal (``sq == sk``).
        scale: softmax scale (None: ``1/sqrt(hn)``).
        expand_kv: repeat each K/V group for its query heads (``repeat_interleave``, the grouping ``enable_gqa``
            uses) instead of passing ``enable_gqa``. Default: on CUDA under a mask. On the H200 (torch 2.11, cuDNN
            9.19; 28/4 heads, head dim 128, 2,048 tokens, bf16) forward + backward under a boolean mask took
            4.2-8.7 ms with ``enable_gqa`` and 1.0-1.1 ms with expanded K/V in three runs of ``bench/gpu_check.sh``
            (``sdpa`` row); causal, the two were within run-to-run noise (0.67 vs 0.50 ms, then 0.61 vs 0.90 ms),
            so causal calls keep ``enable_gqa``. On CPU expanding only costs memory.

    Returns:
        ``[b, np, sq, hn]``.
    """
    groups = q.shape[1] // k.shape[1]
    if expand_kv is None:
        expand_kv = q.is_cuda and allow is not None
    if groups > 1 and expand_kv:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allow, is_causal=allow is None, scale=scale,
                                          enable_gqa=groups > 1 and not expand_kv)


def _check_packed(params, query: torch.Tensor) -> None:
    """Validate ``PackedSeqParams`` for self-attention over causal segments (clear errors, no crash)."""
    if params.qkv_format != "thd":
        raise ValueError(f"packed_seq_params.qkv_format must be 'thd', got {params.qkv_format!r}")
    cu = params.cu_seqlens_q
    if cu is None or cu.dim() != 1 or cu.numel() < 2:
        raise ValueError("packed_seq_params.cu_seqlens_q must be a 1-D tensor [num_segments + 1]")
    kv = params.cu_seqlens_kv
    if kv is not None and kv is not cu and (kv.shape != cu.shape or not torch.equal(kv, cu)):
        raise ValueError("packed self-attention needs cu_seqlens_kv == cu_seqlens_q")
    for name in ("cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        pad = getattr(params, name)
        if pad is not None and (pad.shape != cu.shape or not torch.equal(pad, cu)):
            raise ValueError(f"packed_seq_params.{name} differing from cu_seqlens_q is not supported "
                             "(padding is a segment of its own)")
    if query.dim() != 3:
        raise ValueError(f"packed query must be [t, heads, head_dim], got {tuple(query.shape)}")


def _bounds(cu: torch.Tensor, total: int, name: str) -> list[int]:
    bounds = [int(x) for x in cu.tolist()]
    if bounds[0] != 0 or bounds[-1] != total or any(b > a for a, b in zip(bounds[1:], bounds[:-1])):
        raise ValueError(f"{name} {bounds[:8]}{'...' if len(bounds) > 8 else ''} must rise from 0 to the "
                         f"packed length {total}")
    return bounds


def packed_causal_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
                       scale: float, *, cu_seqlens_kv: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention within each packed segment (torch SDPA, one call per segment).

    Args:
        query: ``[t, np, hn]``; key/value: ``[t_kv, ng, hn]`` (``np`` a multiple of ``ng``: GQA).
        cu_seqlens: int ``[num_segments + 1]``, ``0 = cu[0] <= cu[1] <= ... <= cu[-1] = t``.
        scale: softmax scale.
        cu_seqlens_kv: key segment boundaries (``[-1] = t_kv``), each key segment at least as long as its
            query segment; the mask is then bottom-right aligned (query ``i`` of ``m`` sees keys
            ``0 .. n - m + i`` of ``n``). Default: ``cu_seqlens`` (plain causal).

    Returns:
        ``[t, np * hn]``.

    Raises:
        ValueError: boundaries that do not start at 0, decrease, do not end at ``t`` / ``t_kv``, differ in
            count, or a key segment shorter than its query segment.
    """
    t, nh, hd = query.shape
    bq = _bounds(cu_seqlens, t, "cu_seqlens")
    bk = bq if cu_seqlens_kv is None else _bounds(cu_seqlens_kv, key.shape[0], "cu_seqlens_kv")
    if len(bk) != len(bq):
        raise ValueError(f"{len(bq) - 1} query segments but {len(bk) - 1} key segments")
    q = query.transpose(0, 1)  # [np, t, hn]
    k = key.transpose(0, 1)
    v = value.transpose(0, 1)
    gqa = k.shape[0] != nh
    outs = []
    for a, b, c, d in zip(bq[:-1], bq[1:], bk[:-1], bk[1:]):
        m, n = b - a, d - c
        if m == 0:
            continue
        if n < m:
            raise ValueError(f"a key segment ({n}) is shorter than its query segment ({m})")
        if n == m:
            o = F.scaled_dot_product_attention(q[None, :, a:b], k[None, :, c:d], v[None, :, c:d], is_causal=True,
                                               scale=scale, enable_gqa=gqa)
        else:  # bottom-right causal: torch's CausalBias keeps SDPA on its fused kernels (no mask tensor)
            try:
                o = F.scaled_dot_product_attention(q[None, :, a:b], k[None, :, c:d], v[None, :, c:d],
                                                   attn_mask=causal_lower_right(m, n), scale=scale, enable_gqa=gqa)
            except (TypeError, RuntimeError, NotImplementedError):  # older torch: an explicit boolean mask
                allow = torch.arange(n, device=q.device)[None, :] <= (n - m) + torch.arange(m, device=q.device)[:, None]
                o = F.scaled_dot_product_attention(q[None, :, a:b], k[None, :, c:d], v[None, :, c:d],
                                                   attn_mask=allow, scale=scale, enable_gqa=gqa)
        outs.append(o[0])
    out = torch.cat(outs, dim=1)  # [np, t, hn]
    return out.transpose(0, 1).reshape(t, nh * hd)
