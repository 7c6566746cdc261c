"""Noise schedules and noisy-state selection (paper Sec. 4.1, Eq. 7).

Jacobi Forcing pairs each block's fixed point with one recorded Jacobi draft of that block.
Which draft is chosen is governed by a per-block *target noise level* ``t_i`` in ``[0, 1)``
(the schedule) and by the *unconverged fraction* of each draft (how much of it is still wrong).

Schedules (``i`` = block index, ``w`` = window size, all levels on the grid ``{0, 1/w, ..., (w-1)/w}``):

* ``progressive`` (paper Eq. 7): ``t_i = (i mod w) / w`` -- clean-ish to noisy within each window
  of ``w`` consecutive blocks, then the ramp restarts.
* ``reverse``: ``t_i = (w - 1 - (i mod w)) / w`` -- the same levels in the opposite order within
  each window. We deliberately do NOT use ``1 - (i mod w)/w``: that would shift the level set to
  ``{1/w, ..., 1}`` (never clean, always including the fully-noisy level), so ``progressive`` and
  ``reverse`` would no longer differ only in order.
* ``random``: ``t_i = k_i / w`` with ``k_i`` uniform on ``{0..w-1}``, drawn deterministically as
  ``splitmix64(sha256(seed, sample_id) + i) mod w`` -- independent of any global RNG, worker or rank, reproducible
  across processes and library versions.

The reference code used ``linspace(0, 1, w)[i mod w]`` (levels ``0..1`` inclusive, step ``1/(w-1)``),
which differs from Eq. 7; we implement Eq. 7.
"""

from __future__ import annotations

import hashlib
import math

import torch

__all__ = [
    "SCHEDULES",
    "derive_seed",
    "noise_targets",
    "epoch_phase",
    "first_mismatch",
    "unconverged_fraction",
    "unconverged_fractions",
    "select_state",
    "TIE_TOLERANCE",
]

SCHEDULES = ("progressive", "reverse", "random")

#: Two candidate distances ``|u - t|`` closer than this are treated as a tie (float rounding guard).
TIE_TOLERANCE = 1e-9


def derive_seed(*parts: object) -> int:
    """Deterministic 63-bit seed from ``parts`` (joined by their ``repr``, hashed with SHA-256).

    Unlike Python's ``hash`` this does not depend on ``PYTHONHASHSEED`` or the process.
    """
    h = hashlib.sha256("\x1f".join(repr(p) for p in parts).encode("utf-8")).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)


_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """SplitMix64 finaliser of ``x`` (a well-mixed, portable 64-bit hash of a counter)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def noise_targets(
    schedule: str,
    num_blocks: int,
    window_size: int,
    *,
    seed: int = 0,
    sample_id: str = "",
    phase: int = 0,
) -> torch.Tensor:
    """Per-block target noise levels ``t_i`` (paper Eq. 7 and variants, see module docstring).

    Args:
        schedule: one of :data:`SCHEDULES`.
        num_blocks: ``N >= 0`` blocks.
        window_size: ``w >= 1``.
        seed, sample_id: only used by ``random`` (the draw depends on both and on the block index).
        phase: ``progressive`` / ``reverse`` only: shift the ramp by ``phase`` blocks, ``t_i = ((i + phase) mod w)
            / w`` (0: Eq. 7 as written). Re-drawing a record's noisy states per epoch
            (:func:`epoch_phase`) uses it, so that over epochs every block meets every level of the window.

    Returns:
        float64 ``[N]`` tensor with values in ``{0, 1/w, ..., (w-1)/w}``.

    Raises:
        ValueError: unknown schedule, ``num_blocks < 0`` or ``window_size < 1``.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown noise schedule {schedule!r}; expected one of {SCHEDULES}")
    if isinstance(window_size, bool) or not isinstance(window_size, int) or window_size < 1:
        raise ValueError(f"window_size must be a positive int, got {window_size!r}")
    if not isinstance(num_blocks, int) or num_blocks < 0:
        raise ValueError(f"num_blocks must be a non-negative int, got {num_blocks!r}")
    w = window_size
    i = torch.arange(num_blocks, dtype=torch.int64) + int(phase)
    if schedule == "progressive":
        k = i % w
    elif schedule == "reverse":
        k = (w - 1) - (i % w)
    else:  # random
        base = derive_seed("jf-noise", seed, sample_id)
        k = torch.tensor([_splitmix64(base + j) % w for j in range(num_blocks)], dtype=torch.int64)
    return k.to(torch.float64) / w


def epoch_phase(seed: int, epoch: int, sample_id: str, window_size: int) -> int:
    """The schedule phase of record ``sample_id`` in ``epoch`` when noisy states are re-drawn every epoch
    (``--resample-noise-per-epoch``): 0 in epoch 0 (the paper's schedule, Eq. 7), then a portable hash of
    ``(seed, epoch, sample_id)`` modulo ``w`` -- each epoch shifts each record's ramp by its own amount, so multi-epoch
    training pairs each block with states of other noise levels instead of the same state every epoch.

    Raises:
        ValueError: ``epoch < 0`` or ``window_size < 1``.
    """
    if epoch < 0 or window_size < 1:
        raise ValueError(f"need epoch >= 0 and window_size >= 1, got {epoch}, {window_size}")
    if epoch == 0:
        return 0
    return _splitmix64(derive_seed("jf-noise-phase", seed, epoch, sample_id)) % window_size


def first_mismatch(drafts: torch.Tensor, fixed_point: torch.Tensor) -> torch.Tensor:
    """Index of the first position where each draft differs from the fixed point.

    Args:
        drafts: int ``[S, n_b]`` (or ``[n_b]`` for a single draft).
        fixed_point: int ``[n_b]``.

    Returns:
        int64 ``[S]`` (or a 0-d tensor for a 1-D ``drafts``); ``n_b`` for a draft equal to the fixed point.

    Raises:
        ValueError: shape mismatch or an empty block.
    """
    single = drafts.dim() == 1
    d = drafts.unsqueeze(0) if single else drafts
    if d.dim() != 2 or fixed_point.dim() != 1 or d.shape[1] != fixed_point.shape[0]:
        raise ValueError(
            f"first_mismatch: drafts {tuple(drafts.shape)} and fixed_point {tuple(fixed_point.shape)} do not match"
        )
    n_b = fixed_point.shape[0]
    if n_b == 0:
        raise ValueError("first_mismatch: empty block (n_b == 0)")
    mism = d != fixed_point.unsqueeze(0)
    # argmax over a bool->uint8 row returns the first maximal index (documented torch behaviour).
    first = torch.where(mism.any(dim=1), mism.to(torch.uint8).argmax(dim=1), torch.full_like(mism[:, 0], n_b, dtype=torch.int64))
    return first[0] if single else first


def unconverged_fractions(drafts: torch.Tensor, fixed_point: torch.Tensor) -> torch.Tensor:
    """Unconverged fraction of each draft: ``(n_b - first_mismatch) / n_b`` (paper Sec. 4.1).

    Every token from the first mismatch on counts as unconverged, *even if it coincidentally
    equals the fixed point*: a Jacobi step can only commit the longest prefix that matches, so a
    correct token behind a wrong one is not usable yet and its context (the tokens before it) is
    still noisy. This matches the reference implementation's ratio.

    Args:
        drafts: int ``[S, n_b]``; fixed_point: int ``[n_b]``.

    Returns:
        float64 ``[S]`` in ``[0, 1]``; exactly 0.0 for a draft equal to the fixed point.
    """
    n_b = fixed_point.shape[0] if fixed_point.dim() == 1 else -1
    first = first_mismatch(drafts, fixed_point)
    return (n_b - first).to(torch.float64) / n_b


def unconverged_fraction(draft: torch.Tensor, fixed_point: torch.Tensor) -> float:
    """Unconverged fraction of one draft ``[n_b]`` against ``fixed_point`` ``[n_b]``; see :func:`unconverged_fractions`.

    Example: fixed point ``[5, 6, 7, 8]``, draft ``[5, 9, 7, 8]`` -> first mismatch at 1 -> ``3/4 = 0.75``
    (positions 2 and 3 match coincidentally but still count as unconverged).
    """
    if draft.dim() != 1:
        raise ValueError(f"unconverged_fraction expects a 1-D draft, got shape {tuple(draft.shape)}")
    return float(unconverged_fractions(draft.unsqueeze(0), fixed_point)[0])


def _select_from_fractions(fracs: list[float], t: float) -> int:
    """Index of the fraction nearest to ``t``; ties (within :data:`TIE_TOLERANCE`) go to the
    larger fraction (noisier state), then to the smallest index (earliest state)."""
    best_i = 0
    best_d = math.inf
    best_u = -math.inf
    for i, u in enumerate(fracs):
        d = abs(u - t)
        if d < best_d - TIE_TOLERANCE or (abs(d - best_d) <= TIE_TOLERANCE and u > best_u):
            best_i, best_d, best_u = i, d, u
    return best_i


def select_state(drafts: torch.Tensor, fixed_point: torch.Tensor, t: float) -> int:
    """Index of the draft whose unconverged fraction is nearest to the target level ``t`` (paper Sec. 4.1).

    Tie-break (distances within :data:`TIE_TOLERANCE`): prefer the *noisier* state (larger
    unconverged fraction); among states of equal fraction prefer the *earliest* one. Rationale:
    (1) on a greedy trajectory the fraction never increases, so "noisier" coincides with the
    reference's "first index wins" rule (earlier = noisier); (2) noisy states are the scarce end
    of the schedule (a trajectory has one initial draft but the clean side is always available
    as the fixed point), so rounding towards noise keeps the achieved levels from drifting below
    the schedule, and a noisier state yields more consistency positions under ``from_first_diff``.

    Args:
        drafts: int ``[S, n_b]``, ``S >= 1``; fixed_point: int ``[n_b]``; t: target in ``[0, 1]``.

    Returns:
        int index into ``drafts``.

    Raises:
        ValueError: ``S == 0``, shape mismatch, or a non-finite ``t``.
    """
    if drafts.dim() != 2 or drafts.shape[0] == 0:
        raise ValueError(f"select_state: drafts must be [S>=1, n_b], got shape {tuple(drafts.shape)}")
    t = float(t)
    if not math.isfinite(t):
        raise ValueError(f"select_state: target level must be finite, got {t}")
    return _select_from_fractions(unconverged_fractions(drafts, fixed_point).tolist(), t)
