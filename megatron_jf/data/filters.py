"""Repetition filter for collected trajectories (reference report Sec. 11.1: CLLM issue #11).

Self-distillation on degenerate greedy outputs (a short loop repeated until the length limit)
teaches the model to collapse, and a collapsed output is trivially easy for Jacobi decoding, so
it also inflates tokens-per-forward. The trajectory collector should drop such samples and
count them (``TrajectoryShardWriter.count_filtered``, recorded in the manifest).

A response (fixed points concatenated, a trailing EOS stripped first when ``eos_id`` is given)
of length ``L`` is *degenerate* if either

1. **periodic tail**: for some period ``p <= max_period`` (the smallest such ``p`` is reported) the longest suffix that repeats with
   period ``p`` (``x[j] == x[j - p]`` throughout) has length ``>= min_tail_fraction * L`` and
   covers ``>= min_repeats`` full periods. Defaults ``max_period=32``, ``min_tail_fraction=0.5``,
   ``min_repeats=4``: at least half of the response is one loop of at most 32 tokens, repeated at
   least 4 times. Ordinary code or prose essentially never repeats a window verbatim that long
   (numbers, names and indentation change), while collapsed generations do; or
2. **low distinct-n ratio**: ``L >= min_len_for_distinct`` (64) and the ratio of distinct
   ``ngram``-grams (4) to all ``ngram``-grams is ``< min_distinct_ratio`` (0.3), i.e. every 4-gram
   occurs more than ~3 times on average. Typical non-degenerate text/code scores 0.6-0.95
   (boilerplate-heavy code at the low end); the tiny prototype's visibly repetitive base model
   scored 0.24. This catches near-periodic loops (e.g. incrementing counters)
   that rule 1 misses.

Both rules are cheap tensor operations (``O(max_period * L)`` and one ``unique``).
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["degeneracy_reason", "is_degenerate", "periodic_tail", "periodic_tail_lengths", "distinct_ngram_ratio"]


def _as_ids(token_ids: torch.Tensor | Sequence[int]) -> torch.Tensor:
    x = torch.as_tensor(token_ids)
    if x.dim() != 1:
        raise ValueError(f"token_ids must be 1-D, got shape {tuple(x.shape)}")
    if x.is_floating_point() or x.dtype == torch.bool:
        raise ValueError(f"token_ids must be integers, got {x.dtype}")
    return x.to(torch.int64)


def periodic_tail_lengths(token_ids: torch.Tensor | Sequence[int], max_period: int = 32) -> list[int]:
    """For each period ``p = 1..max_period``: the length of the longest suffix with period ``p``.

    The suffix ``x[L - t:]`` has period ``p`` if ``x[j] == x[j - p]`` for all its positions past the
    first period; ``t`` counts that first period too, and is 0 if not even one token repeats
    (``x[-1] != x[-1 - p]``) or ``p >= L``. Returns a list of ``max_period`` ints (index ``p - 1``).
    """
    x = _as_ids(token_ids)
    L = x.shape[0]
    out = [0] * max_period
    for p in range(1, min(max_period, L - 1) + 1):
        eq = x[p:] == x[:-p]  # [L - p]
        run = int(eq.flip(0).to(torch.int64).cumprod(0).sum())  # trailing run of matches
        out[p - 1] = run + p if run > 0 else 0
    return out


def periodic_tail(token_ids: torch.Tensor | Sequence[int], max_period: int = 32) -> tuple[int, int]:
    """Longest periodic suffix over periods ``1..max_period`` (see :func:`periodic_tail_lengths`).

    Returns:
        ``(tail_len, period)``; among periods with the same tail length the smallest wins;
        ``(0, 0)`` if no period repeats even once (or ``L < 2``).
    """
    best_len, best_p = 0, 0
    for p, t in enumerate(periodic_tail_lengths(token_ids, max_period), start=1):
        if t > best_len:
            best_len, best_p = t, p
    return best_len, best_p


def distinct_ngram_ratio(token_ids: torch.Tensor | Sequence[int], ngram: int = 4) -> float:
    """Distinct ``ngram``-grams / all ``ngram``-grams (1.0 if the sequence is shorter than ``ngram``)."""
    x = _as_ids(token_ids)
    if ngram < 1:
        raise ValueError(f"ngram must be >= 1, got {ngram}")
    if x.shape[0] < ngram:
        return 1.0
    grams = x.unfold(0, ngram, 1)
    return torch.unique(grams, dim=0).shape[0] / grams.shape[0]


def degeneracy_reason(
    token_ids: torch.Tensor | Sequence[int],
    *,
    eos_id: int | None = None,
    max_period: int = 32,
    min_tail_fraction: float = 0.5,
    min_repeats: int = 4,
    ngram: int = 4,
    min_distinct_ratio: float = 0.3,
    min_len_for_distinct: int = 64,
) -> str | None:
    """Why ``token_ids`` (a response, int ``[L]``) is degenerate, or ``None`` if it is not (see module docstring).

    Returns:
        ``"periodic_tail(p=..., len=.../L)"``, ``"distinct_{ngram}gram=.../..."`` or ``None``.

    Raises:
        ValueError: non-1-D or non-integer input, or ``ngram < 1``.
    """
    x = _as_ids(token_ids)
    if eos_id is not None and x.shape[0] > 0 and int(x[-1]) == eos_id:
        x = x[:-1]
    L = x.shape[0]
    if L == 0:
        return None
    for p, tail in enumerate(periodic_tail_lengths(x, max_period), start=1):
        if tail > 0 and tail >= min_tail_fraction * L and tail >= min_repeats * p:
            return f"periodic_tail(p={p}, len={tail}/{L})"
    if L >= min_len_for_distinct:
        r = distinct_ngram_ratio(x, ngram)
        if r < min_distinct_ratio:
            return f"distinct_{ngram}gram={r:.3f}<{min_distinct_ratio}"
    return None


def is_degenerate(token_ids: torch.Tensor | Sequence[int], **kwargs) -> bool:
    """True iff :func:`degeneracy_reason` finds a reason (same keyword arguments and thresholds)."""
    return degeneracy_reason(token_ids, **kwargs) is not None
