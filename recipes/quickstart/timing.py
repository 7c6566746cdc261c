"""Batch-1 decode timing for the quickstart report: one warm-up call per decoder, then interleaved rounds, and
each decoder's fastest round.

Why: the report used to time each decoder once, one after the other, with the pipeline's 2 torch threads, and the
same AR decode of models of one shape measured anywhere from 34 to 1,497 tokens/s. Measured on the smoke preset's
round-2 model (2 prompts x 64 tokens, this 2-core machine shared with other jobs, load average ~25; 5 repeated
rounds each; ``/tmp`` probe, not kept):

* **threads** -- the dominant cause. AR at batch 1 ran 414-582 tokens/s with 1 torch thread and 11-26 tokens/s
  with 2 (Jacobi n=32: 4,126-8,802 vs 12-123): a one-row forward of a small model is microseconds of work per
  operator, and with 2 OpenMP threads every operator waits for the thread whose core another process holds.
  Timing therefore runs at ``timing_threads`` (1) whatever the training threads are (:func:`torch_threads`).
* **other processes** -- even at 1 thread a round's rate moved by up to 2x (0.015-0.031 s for the Jacobi decode);
  timed one after the other, a burst of another tenant lands on one decoder only and the *ratio* swings.
  Decoders are therefore timed in interleaved rounds (the order rotated every round) and each keeps its fastest
  round (the least disturbed, as ``bench/train_step.py`` does); ``spread`` = slowest / fastest round says how
  noisy the machine was.
* **first-call work** -- the first batch-1 AR step builds the lean forward's transposed weight copies and the
  rotary tables; each decoder gets one untimed warm-up call first.

The runners are plain callables, so the same method can drive any loop that times decoders (the evaluator,
``bench/decode.py``).
"""

from __future__ import annotations

import contextlib
from typing import Callable

__all__ = ["time_interleaved", "torch_threads"]


@contextlib.contextmanager
def torch_threads(n: int | None):
    """Run the block with ``torch.set_num_threads(n)`` (None or 0: unchanged), restoring the count after."""
    import torch

    old = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def time_interleaved(runners: dict[str, Callable[[], tuple[float, float, int]]], rounds: int = 3,
                     warmup: dict[str, Callable[[], object]] | None = None) -> dict[str, dict]:
    """Time decoders at batch 1: a warm-up call each, then ``rounds`` interleaved rounds; the fastest round wins.

    Args:
        runners: ``{name: fn}``; ``fn()`` decodes the timing prompts once and returns ``(decode_s, e2e_s,
            tokens)``: decode seconds (prefill excluded), end-to-end seconds, tokens emitted. Every call of one
            runner must emit the same number of tokens (greedy decoding; checked).
        rounds: timed rounds (>= 1).
        warmup: ``{name: fn}`` called once untimed before the rounds (default: the runner itself).

    Returns:
        ``{name: {"decode_s", "e2e_s", "tokens", "tps", "tps_e2e", "spread"}}``: the fastest round's decode and
        end-to-end seconds (each minimised over rounds on its own), tokens per round, ``tokens / decode_s``,
        ``tokens / e2e_s``, and ``spread`` = slowest / fastest decode time over the rounds (1.0 = steady).

    Raises:
        ValueError: ``rounds < 1``, no runners, or a runner that emits a different number of tokens per call.
    """
    if rounds < 1 or not runners:
        raise ValueError(f"need rounds >= 1 and at least one runner, got rounds={rounds}, {len(runners)} runners")
    names = list(runners)
    for name in names:
        (warmup or {}).get(name, runners[name])()
    times: dict[str, list[tuple[float, float, int]]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append(tuple(runners[name]()))
    out = {}
    for name, ts in times.items():
        toks = {t[2] for t in ts}
        if len(toks) != 1:
            raise ValueError(f"{name}: tokens differ between rounds ({sorted(toks)}); the timed decode must be "
                             "deterministic")
        dec, e2e, n = min(t[0] for t in ts), min(t[1] for t in ts), ts[0][2]
        out[name] = {"decode_s": dec, "e2e_s": e2e, "tokens": n, "tps": n / dec if dec > 0 else float("nan"),
                     "tps_e2e": n / e2e if e2e > 0 else float("nan"),
                     "spread": max(t[0] for t in ts) / dec if dec > 0 else float("nan")}
    return out
