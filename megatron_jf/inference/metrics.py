"""Aggregate decoding metrics over requests: TPF, TPS, latency percentiles (paper Sec. 4, Table 1).

TPF (tokens per forward) = emitted tokens / decode forward passes, counted after EOS truncation and
without the prefill forward; AR has TPF exactly 1. TPS = emitted tokens / decode seconds.
"""

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


def summarize(results) -> dict:
    """Summary of :class:`~megatron_jf.inference.engine.GenerationResult` objects.

    Returns:
        dict with ``requests``, ``tokens``, ``forwards``, ``tpf`` (pooled: total tokens / total forwards),
        ``tpf_mean`` (mean of per-request TPF), ``tps`` (pooled decode tokens/s), ``tps_e2e`` (including
        prefill), per-request latency ``latency_p50_s`` / ``latency_p95_s`` (prefill + decode, seconds),
        ``accepted_p50`` / ``accepted_p95`` (tokens per forward, per iteration).
    """
    results = list(results)
    toks = sum(len(r.tokens) for r in results)
    fwd = sum(r.forwards for r in results)
    dec = sum(r.decode_s for r in results)
    e2e = sum(r.decode_s + r.prefill_s for r in results)
    lat = [r.decode_s + r.prefill_s for r in results]
    acc = [a for r in results for a in r.accepted]
    return {
        "requests": len(results), "tokens": toks, "forwards": fwd,
        "tpf": toks / fwd if fwd else float("nan"),
        "tpf_mean": sum(r.tpf for r in results) / len(results) if results else float("nan"),
        "tps": toks / dec if dec > 0 else float("nan"),
        "tps_e2e": toks / e2e if e2e > 0 else float("nan"),
        "latency_p50_s": percentile(lat, 50), "latency_p95_s": percentile(lat, 95),
        "accepted_p50": percentile(acc, 50), "accepted_p95": percentile(acc, 95),
    }
