"""Percentiles of per-request metrics (latency, accepted tokens; paper Sec. 4, Table 1)."""

from __future__ import annotations

import math


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) with linear interpolation; NaN for an empty list.

    Raises:
        ValueError: ``q`` outside [0, 100].
    """
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    if not values:
        return float("nan")
    v = sorted(float(x) for x in values)
    k = (len(v) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)
