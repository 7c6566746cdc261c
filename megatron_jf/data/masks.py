"""Attention masks for the packed Jacobi Forcing layout (paper Sec. 4.1; Table 5 for ``nc_ic``).

Convention: **True = the query may attend to the key**.

Layout: ``[prompt, k_0, c_0, k_1, c_1, ...]`` with ``k_j`` the noisy and ``c_j`` the clean copy of
block ``j`` (see :mod:`megatron_jf.data.packing`). Mask kinds:

``nc`` (noise-conditioned; the paper's and the reference trainer's mask)
    prompt token: earlier-or-same prompt tokens (causal).
    ``k_j``: whole prompt, all of ``k_0..k_{j-1}``, ``k_j`` causally.
    ``c_j``: whole prompt, all of ``c_0..c_{j-1}``, ``c_j`` causally.
``nc_ic`` (NC with intra-window clean context, paper Table 5; window size ``w``)
    ``k_j`` with window start ``i = floor(j / w) * w``: whole prompt, the clean blocks of earlier
    windows ``c_0..c_{i-1}``, the noisy blocks ``k_i..k_{j-1}`` of its own window, ``k_j`` causally.
    Prompt and clean tokens as in ``nc``.
``clean`` (CLLM clean context)
    ``k_j``: whole prompt, clean blocks ``c_0..c_{j-1}``, ``k_j`` causally. Prompt and clean as in ``nc``.

Every allowed key precedes (or is) its query in packed order, so all kinds are sub-masks of the
causal mask. ``nc`` equals two independent causal masks on the noisy and clean streams
(:func:`megatron_jf.data.packing.to_two_stream`); ``nc_ic`` and ``clean`` do not decompose so.

Batched / packed inputs: ``roles`` and ``block_ids`` may be ``[B, L]`` (rows of a collated batch)
and ``segment_ids`` ``[L]``/``[B, L]`` restricts attention to the same segment (multi-sample
packing). Positions with role :data:`~megatron_jf.data.packing.ROLE_PAD` attend only to themselves
(so a dense softmax row is never empty) and are never attended by other tokens.
"""

from __future__ import annotations

from typing import Callable

import torch

from .packing import ROLE_CLEAN, ROLE_NOISY, ROLE_PAD, ROLE_PROMPT, PackedSample

__all__ = ["MASK_KINDS", "make_mask_mod", "dense_mask", "dense_mask_from_layout", "block_mask"]

MASK_KINDS = ("nc", "nc_ic", "clean")

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _check_kind(kind: str, window_size: int | None) -> None:
    if kind not in MASK_KINDS:
        raise ValueError(f"unknown mask kind {kind!r}; expected one of {MASK_KINDS}")
    if kind == "nc_ic":
        if isinstance(window_size, bool) or not isinstance(window_size, int) or window_size < 1:
            raise ValueError(f"mask kind 'nc_ic' needs a positive int window_size, got {window_size!r}")
    elif window_size is not None:
        raise ValueError(f"mask kind {kind!r} takes no window_size (got {window_size!r}); only 'nc_ic' is windowed")


def make_mask_mod(
    kind: str,
    roles: torch.Tensor,
    block_ids: torch.Tensor,
    *,
    window_size: int | None = None,
    segment_ids: torch.Tensor | None = None,
) -> MaskMod:
    """Build a FlexAttention-style ``mask_mod(b, h, q_idx, kv_idx) -> bool tensor`` for ``kind``.

    The returned function is pure tensor code (no data-dependent Python control flow), so it works
    both under FlexAttention's ``vmap`` (0-d index tensors) and with broadcast index grids
    (``q_idx [L, 1]``, ``kv_idx [1, L]``), as :func:`dense_mask_from_layout` uses it. Indices
    ``>= L`` (FlexAttention block padding) are masked out.

    Args:
        kind: one of :data:`MASK_KINDS`.
        roles: int64 ``[L]`` or ``[B, L]`` (ROLE_PROMPT / ROLE_NOISY / ROLE_CLEAN / ROLE_PAD).
        block_ids: int64, same shape; block index of noisy/clean tokens (-1 elsewhere).
        window_size: ``w``, required for ``nc_ic`` and rejected for the other kinds.
        segment_ids: optional int64, same shape: tokens only attend within their segment.

    Raises:
        ValueError: unknown kind, bad window size, or mismatched shapes.
    """
    _check_kind(kind, window_size)
    if roles.shape != block_ids.shape or roles.dim() not in (1, 2):
        raise ValueError(f"roles {tuple(roles.shape)} and block_ids {tuple(block_ids.shape)} must share a [L] or [B, L] shape")
    if segment_ids is not None and segment_ids.shape != roles.shape:
        raise ValueError(f"segment_ids {tuple(segment_ids.shape)} must match roles {tuple(roles.shape)}")
    batched = roles.dim() == 2
    L = roles.shape[-1]
    w = window_size

    def mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        in_range = (q_idx < L) & (kv_idx < L)
        q = q_idx.clamp(max=L - 1)
        k = kv_idx.clamp(max=L - 1)
        if batched:
            rq, rk, bq, bk = roles[b, q], roles[b, k], block_ids[b, q], block_ids[b, k]
        else:
            rq, rk, bq, bk = roles[q], roles[k], block_ids[q], block_ids[k]
        causal = k <= q
        key_prompt = rk == ROLE_PROMPT
        own_block = (rk == rq) & (bk == bq) & causal
        if kind == "nc":
            earlier = (rk == rq) & (bk < bq)
        elif kind == "clean":
            earlier = (rk == ROLE_CLEAN) & (bk < bq)
        else:  # nc_ic
            win_start = torch.div(bq, w, rounding_mode="floor") * w
            noisy_q = ((rk == ROLE_CLEAN) & (bk < win_start)) | ((rk == ROLE_NOISY) & (bk >= win_start) & (bk < bq))
            clean_q = (rk == ROLE_CLEAN) & (bk < bq)
            earlier = torch.where(rq == ROLE_NOISY, noisy_q, clean_q)
        block_rule = key_prompt | earlier | own_block
        allowed = torch.where(rq == ROLE_PROMPT, key_prompt & causal, block_rule)
        allowed = torch.where(rq == ROLE_PAD, k == q, allowed & (rk != ROLE_PAD))
        if segment_ids is not None:
            if batched:
                allowed = allowed & (segment_ids[b, q] == segment_ids[b, k])
            else:
                allowed = allowed & (segment_ids[q] == segment_ids[k])
        return allowed & in_range

    return mod


def dense_mask_from_layout(
    kind: str,
    roles: torch.Tensor,
    block_ids: torch.Tensor,
    *,
    window_size: int | None = None,
    segment_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dense boolean mask (True = may attend): ``[L, L]`` for ``[L]`` inputs, ``[B, L, L]`` for ``[B, L]``.

    Memory is ``O(B L^2)`` bytes; intended for tests, small models and debugging.

    Raises:
        ValueError: as :func:`make_mask_mod`.
    """
    mod = make_mask_mod(kind, roles, block_ids, window_size=window_size, segment_ids=segment_ids)
    L = roles.shape[-1]
    q = torch.arange(L, dtype=torch.int64)
    if roles.dim() == 1:
        zero = torch.zeros((), dtype=torch.int64)
        return mod(zero, zero, q[:, None], q[None, :])
    B = roles.shape[0]
    b = torch.arange(B, dtype=torch.int64)[:, None, None]
    return mod(b, torch.zeros((), dtype=torch.int64), q[None, :, None], q[None, None, :])


def dense_mask(kind: str, packed: PackedSample, *, window_size: int | None = None) -> torch.Tensor:
    """Dense ``[L, L]`` bool mask (True = may attend) of ``kind`` for one packed sample.

    Raises:
        ValueError: unknown kind or bad window size.
    """
    return dense_mask_from_layout(kind, packed.roles, packed.block_ids, window_size=window_size)


def block_mask(
    kind: str,
    roles: torch.Tensor,
    block_ids: torch.Tensor,
    *,
    window_size: int | None = None,
    segment_ids: torch.Tensor | None = None,
    device: str | torch.device = "cpu",
    block_size: int = 128,
    compile: bool = False,
):
    """FlexAttention ``BlockMask`` for ``kind`` (``torch.nn.attention.flex_attention.create_block_mask``).

    The mask is head-independent (``H=None``, broadcast over heads). ``B`` is ``None`` for ``[L]``
    inputs and ``B`` for ``[B, L]`` inputs. Tensors are moved to ``device`` first.

    Returns:
        ``torch.nn.attention.flex_attention.BlockMask`` of shape ``[B or 1, 1, L, L]``.

    Raises:
        ValueError: as :func:`make_mask_mod`.
        ImportError: if this torch build lacks FlexAttention.
    """
    from torch.nn.attention.flex_attention import create_block_mask

    roles = roles.to(device)
    block_ids = block_ids.to(device)
    if segment_ids is not None:
        segment_ids = segment_ids.to(device)
    mod = make_mask_mod(kind, roles, block_ids, window_size=window_size, segment_ids=segment_ids)
    L = roles.shape[-1]
    B = roles.shape[0] if roles.dim() == 2 else None
    return create_block_mask(
        mod, B=B, H=None, Q_LEN=L, KV_LEN=L, device=device, BLOCK_SIZE=block_size, _compile=compile
    )
