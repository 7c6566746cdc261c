"""Every Jacobi Forcing mask as causal THD segments with gathered keys (fused varlen kernels, no ``[L, L]`` mask).

Each mask kind of :mod:`megatron_jf.data.masks` is a union of *bottom-right causal* segments: a run of
queries ``q_1..q_m`` whose keys are a prefix ``p_1..p_a`` followed by the queries themselves, query ``q_i``
seeing ``p_1..p_a, q_1..q_i``. Per sample (prompt ``x``, blocks ``0..N-1`` with noisy copies ``k_j`` and
clean copies ``c_j``):

* the clean stream: queries ``x, c_0, .., c_{N-1}``, no prefix (plain causal; prompt and clean tokens see
  the same keys under every mask kind);
* one segment per window of noisy blocks ``[a, b)``: queries ``k_a, .., k_{b-1}``, prefix ``x, c_0, ..,
  c_{a-1}``. Windows: ``nc_ic`` -- ``[i w, (i + 1) w)`` (window size ``w``); ``clean`` -- every block alone;
  ``nc`` -- one window of all blocks (prefix ``x``: the noisy stream).

Every token is a query exactly once, so the model input is the sample's packed tokens in *query order*
(``[x, c_0..c_{N-1}, noisy window 0, noisy window 1, ...]``) with their own position ids; the keys of a
segment are gathered from the layer's keys by ``kv_index`` (the prefix is duplicated in the gathered
keys only, ``O(windows x prefix x kv_dim)``, never recomputed). The core attention
(:mod:`megatron_jf.models.attention`) runs each segment with a bottom-right causal mask: TE's
``padding_causal_bottom_right`` THD attention on GPU, one SDPA per segment on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .masks import MASK_KINDS, _check_kind
from .packing import ROLE_CLEAN, ROLE_NOISY, PackedSample

__all__ = ["THDLayout", "sample_segments", "thd_layout"]


@dataclass
class THDLayout:
    """Query-ordered THD row of a batch and its segments.

    Shapes: ``T`` model-input tokens (all samples, plus a trailing padding segment), ``S`` segments,
    ``T_kv`` gathered keys.

    Attributes:
        tokens, position_ids: int64 ``[T]`` in query order.
        model_pos: per sample, int64 ``[L_b]``: the model-input position of each packed index of sample b.
        cu_seqlens_q: int32 ``[S + 1]`` query segment boundaries (``cu_seqlens_q[-1] = T``).
        kv_index: int64 ``[T_kv]`` model-input position of each gathered key.
        cu_seqlens_kv: int32 ``[S + 1]`` gathered-key segment boundaries (``[-1] = T_kv``).
        max_seqlen_q, max_seqlen_kv: longest segment.
        num_real: real (non-padding) tokens.
    """

    tokens: torch.Tensor
    position_ids: torch.Tensor
    model_pos: list[torch.Tensor]
    cu_seqlens_q: torch.Tensor
    kv_index: torch.Tensor
    cu_seqlens_kv: torch.Tensor
    max_seqlen_q: int
    max_seqlen_kv: int
    num_real: int


def sample_segments(packed: PackedSample, mask: str, window_size: int | None = None
                    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The segments of one packed sample: ``[(query packed indices [m], prefix packed indices [a])]``.

    Raises:
        ValueError: unknown mask kind or a bad ``window_size`` (as :mod:`megatron_jf.data.masks`).
    """
    _check_kind(mask, window_size if mask == "nc_ic" else None)
    P = packed.prompt_len
    prompt = torch.arange(P, dtype=torch.int64)
    clean = torch.nonzero(packed.roles == ROLE_CLEAN).flatten()
    noisy = torch.nonzero(packed.roles == ROLE_NOISY).flatten()
    clean_blk = packed.block_ids[clean]
    noisy_blk = packed.block_ids[noisy]
    N = packed.num_blocks
    segs = [(torch.cat([prompt, clean]), prompt[:0])]
    w = {"nc": N, "clean": 1, "nc_ic": window_size}[mask]
    for a in range(0, N, w):
        b = min(a + w, N)
        q = noisy[(noisy_blk >= a) & (noisy_blk < b)]
        segs.append((q, torch.cat([prompt, clean[clean_blk < a]])))
    return segs


def thd_layout(samples: Sequence[PackedSample], mask: str, *, window_size: int | None = None, pad_id: int = 0,
               pad_to_multiple_of: int = 1, pad_to: int | None = None) -> THDLayout:
    """Build the query-ordered THD row, segment boundaries and key gather index of a batch (CPU).

    A trailing padding segment (tokens ``pad_id``, positions 0, causal among themselves) rounds ``T`` up
    to ``pad_to_multiple_of``, or to exactly ``pad_to``.

    Raises:
        ValueError: unknown mask, empty batch, or more tokens than ``pad_to``.
    """
    if mask not in MASK_KINDS:
        raise ValueError(f"unknown mask {mask!r}; expected one of {MASK_KINDS}")
    if not samples:
        raise ValueError("cannot build a THD layout from zero samples")
    toks, poss, model_pos, q_lens, kv_parts, kv_lens = [], [], [], [], [], []
    off = 0
    for s in samples:
        segs = sample_segments(s, mask, window_size)
        order = torch.cat([q for q, _ in segs])
        if order.numel() != len(s) or not torch.equal(order.sort().values, torch.arange(len(s))):
            raise ValueError(f"sample {s.sample_id!r}: segments do not cover the packed sample once")
        pos = torch.empty(len(s), dtype=torch.int64)
        pos[order] = off + torch.arange(len(s), dtype=torch.int64)
        model_pos.append(pos)
        toks.append(s.tokens[order])
        poss.append(s.position_ids[order])
        for q, pre in segs:
            q_lens.append(q.numel())
            kv = pos[torch.cat([pre, q])]
            kv_parts.append(kv)
            kv_lens.append(kv.numel())
        off += len(s)
    real = off
    if pad_to is not None:
        if real > pad_to:
            raise ValueError(f"packed row of {len(samples)} samples has {real} tokens, more than {pad_to}")
        T = pad_to
    else:
        m = max(1, pad_to_multiple_of)
        T = -(-real // m) * m
    if T > real:
        toks.append(torch.full((T - real,), pad_id, dtype=torch.int64))
        poss.append(torch.zeros(T - real, dtype=torch.int64))
        q_lens.append(T - real)
        kv_parts.append(torch.arange(real, T, dtype=torch.int64))
        kv_lens.append(T - real)

    def cu(lens):
        return torch.tensor([0] + lens, dtype=torch.int64).cumsum(0).to(torch.int32)

    return THDLayout(tokens=torch.cat(toks), position_ids=torch.cat(poss), model_pos=model_pos,
                     cu_seqlens_q=cu(q_lens), kv_index=torch.cat(kv_parts), cu_seqlens_kv=cu(kv_lens),
                     max_seqlen_q=max(q_lens), max_seqlen_kv=max(kv_lens), num_real=real)
