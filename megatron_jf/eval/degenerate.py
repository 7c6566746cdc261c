"""Flags for degenerate model output, shown next to TPF and speedup in the reports.

A model that emits one token over and over (the smoke preset's tiny model emits only spaces) is trivially easy
to decode in parallel: every Jacobi iteration "converges" at once, TPF approaches the block size and the
speedup looks spectacular. Such numbers say nothing about Jacobi Forcing, so the reports (``tools/evaluate.py``
via :mod:`megatron_jf.eval.harness`, and :mod:`recipes.quickstart.report`) print a warning beside them when

* the completions are mostly one repeated token: the most frequent token is at least
  :data:`TOP_TOKEN_SHARE_THRESHOLD` of all generated tokens, or the mean per-completion distinct-2 ratio
  (distinct bigrams / bigrams, Li et al. 2016) is below :data:`DISTINCT_THRESHOLD`; or
* the consistency loss of a Jacobi Forcing training run (``pc_loss`` in its ``--log-file`` JSONL) was zero at
  every logged training step (nothing was learned from the trajectories).
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from typing import Iterable, Optional, Sequence

__all__ = [
    "DISTINCT_THRESHOLD",
    "TOP_TOKEN_SHARE_THRESHOLD",
    "degeneracy",
    "degeneracy_from_stats",
    "pc_loss_identically_zero",
    "token_stats",
]

#: mean distinct-2 below this flags the output as degenerate
DISTINCT_THRESHOLD = 0.1
#: one token making up at least this share of all generated tokens flags the output as degenerate
TOP_TOKEN_SHARE_THRESHOLD = 0.5
#: completions shorter than this (tokens) do not enter the distinct-2 mean
MIN_TOKENS = 4


def token_stats(tokens: Sequence) -> dict:
    """Per-completion statistics: ``{"n", "distinct_2", "top_token", "top_count"}``.

    Args:
        tokens: generated token ids (or any hashable units).

    Returns:
        ``distinct_2`` is ``None`` for fewer than :data:`MIN_TOKENS` tokens; ``top_token`` is ``None`` when empty.
    """
    toks = list(tokens)
    n = len(toks)
    if n == 0:
        return {"n": 0, "distinct_2": None, "top_token": None, "top_count": 0}
    top, cnt = Counter(toks).most_common(1)[0]
    d2 = len(set(zip(toks, toks[1:]))) / (n - 1) if n >= MIN_TOKENS else None
    return {"n": n, "distinct_2": d2, "top_token": top, "top_count": cnt}


def degeneracy(seqs: Iterable[Sequence], *, distinct_threshold: float = DISTINCT_THRESHOLD,
               top_share_threshold: float = TOP_TOKEN_SHARE_THRESHOLD, decode=None) -> dict:
    """Pooled degeneracy verdict over many completions.

    Args:
        seqs: token sequences (one per completion).
        distinct_threshold, top_share_threshold: see the module docstring.
        decode: optional ``ids -> str`` to show the repeated token in the warning.

    Returns:
        ``{"distinct_2": mean or None, "top_token_share": fraction or None, "degenerate": bool,
        "warning": str or None}``.
    """
    total, counts, d2s = 0, Counter(), []
    for s in seqs:
        s = list(s)
        total += len(s)
        counts.update(s)
        st = token_stats(s)
        if st["distinct_2"] is not None:
            d2s.append(st["distinct_2"])
    return _verdict(total, counts.most_common(1)[0] if counts else (None, 0), d2s, distinct_threshold,
                    top_share_threshold, decode)


def degeneracy_from_stats(stats: Iterable[dict], **kw) -> dict:
    """:func:`degeneracy` from per-completion :func:`token_stats` dicts (as stored in result records); the top
    token share is pooled over completions whose most frequent token is the same."""
    total, tops, d2s = 0, Counter(), []
    for st in stats:
        if not st or st.get("n") is None:
            continue
        total += int(st["n"])
        if st.get("top_token") is not None:
            tops[json.dumps(st["top_token"])] += int(st.get("top_count", 0))
        if st.get("distinct_2") is not None:
            d2s.append(float(st["distinct_2"]))
    top = tops.most_common(1)[0] if tops else (None, 0)
    top = (json.loads(top[0]) if top[0] is not None else None, top[1])
    return _verdict(total, top, d2s, kw.get("distinct_threshold", DISTINCT_THRESHOLD),
                    kw.get("top_share_threshold", TOP_TOKEN_SHARE_THRESHOLD), kw.get("decode"))


def _verdict(total, top, d2s, distinct_threshold, top_share_threshold, decode) -> dict:
    share = top[1] / total if total else None
    d2 = sum(d2s) / len(d2s) if d2s else None
    reasons = []
    if share is not None and share >= top_share_threshold:
        shown = repr(top[0])
        if decode is not None and top[0] is not None:
            try:
                shown = f"{top[0]!r} ({decode([top[0]])!r})"
            except Exception:  # noqa: BLE001 - the warning must not fail
                pass
        reasons.append(f"{100 * share:.0f}% of generated tokens are one token {shown}")
    if d2 is not None and d2 < distinct_threshold:
        reasons.append(f"distinct-2 {d2:.3f} < {distinct_threshold:g}")
    warning = ("DEGENERATE OUTPUT: " + "; ".join(reasons) + " - TPF and speedup are not meaningful") if reasons \
        else None
    return {"distinct_2": d2, "top_token_share": share, "degenerate": bool(reasons), "warning": warning}


def pc_loss_identically_zero(log_file: str, key: str = "pc_loss") -> Optional[bool]:
    """Whether every logged training step of a JF run had ``pc_loss == 0`` (trainer ``--log-file`` JSONL).

    Returns:
        ``True`` / ``False``, or ``None`` when the file is missing or has no training records with ``key``.
    """
    if not os.path.isfile(log_file):
        return None
    vals = []
    with open(log_file, encoding="utf-8") as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and rec.get("split", "train") == "train" and key in rec:
                try:
                    vals.append(float(rec[key]))
                except (TypeError, ValueError):
                    continue
    if not vals:
        return None
    return all(v == 0.0 or (math.isfinite(v) and abs(v) < 1e-12) for v in vals)
