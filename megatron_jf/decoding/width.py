"""The draft width that pays on the machine it runs on: a table of what one decode forward costs, each
request's running acceptance by draft position, and the choice of how many draft tokens each row forwards this step.

The paper sizes the draft offline (Appendix E: a grid over block size n and verification size v per model and
GPU; ``tools/search_inference_config.py``). Here the choice is made every step from two measurements:

* :class:`ForwardCost` -- seconds of one decode forward of ``rows`` rows of ``tokens`` tokens each (``[last] +
  draft``), measured on the machine at start-up (:mod:`megatron_jf.inference.cost_model`) and interpolated. On a
  GPU at small batch a 33-token forward costs about what a 1-token one does (memory-bound); on a CPU, or at large
  batch anywhere, it costs several times more (compute-bound).
* :class:`AcceptanceStats` -- per request and per draft *source* (the decoder's own Jacobi draft, a recycled
  n-gram, a context n-gram by how many tokens of its context match), how often the draft token at position ``j``
  was accepted given that positions ``0..j-1`` were: the conditional acceptance rate ``p_j``, shrunk towards the
  source's pooled rate (and that towards a prior, :data:`PRIORS`) while few positions have been seen.

A row drafting ``w`` tokens emits ``1 + E(w)`` tokens in expectation, ``E(w) = sum_{j<w} prod_{i<=j} p_i``
(:func:`expected_accepted`); one forward of ``b`` rows costs ``cost.seconds(b, s)`` with ``s`` the longest row
(rows are padded to it). :func:`choose_widths` picks the widths that maximise expected tokens per second of the
step -- down to 0 (plain AR) when no draft is expected to beat it by :data:`MARGIN` -- with each row's draft length
as its ceiling. The width only
decides what is drafted: verification is unchanged, so the output is exactly what a fixed width gives (greedy: AR's).

Standard library only, engine-independent: this project's engine applies the widths
(:mod:`megatron_jf.inference.session`); the policies (:mod:`megatron_jf.decoding`) keep the statistics, so the vLLM
plugin's proposer has them too.
"""

from __future__ import annotations

import bisect
import statistics
from dataclasses import dataclass
from typing import Mapping, Sequence

__all__ = ["MARGIN", "PRIORS", "AcceptanceStats", "ForwardCost", "RowDraft", "StepCalibration", "StepTimes",
           "choose_flat_width", "choose_widths", "context_source", "expected_accepted", "width_grid"]

#: Prior acceptance rate of each draft source, worth :data:`PRIOR_WEIGHT` observations of its pooled rate: the
#: decoder's own Jacobi draft (``draft``; an ordinary model accepts a few percent of it, a Jacobi Forcing model
#: more; ``draft@context`` where MR sees the text copying, :data:`megatron_jf.decoding.mr.COPY_MATCH`), a recycled
#: n-gram (``pool``) and a context n-gram whose preceding 1, 2 or >= 3 tokens match the committed
#: text (``context1..3``; prompt lookup on HumanEval chat prompts with SmolLM2-135M: 13 %, 43 % and 88 % at the first
#: position). Only where a request has not drafted from a source yet do these matter.
PRIORS = {"draft": 0.15, "draft@context": 0.15, "pool": 0.2, "context1": 0.15, "context2": 0.45, "context3": 0.85}
PRIOR_WEIGHT = 2.0
#: Weight of the pooled rate in each position's estimate (observations).
POSITION_WEIGHT = 1.0


def context_source(match: int) -> str:
    """The :class:`AcceptanceStats` source of a context n-gram whose ``match`` preceding tokens match the committed
    text (``context1``, ``context2``, ``context3`` for 3 or more)."""
    return f"context{max(1, min(int(match), 3))}"


class AcceptanceStats:
    """One request's running acceptance of draft tokens by position, per draft source.

    Args:
        decay: each record first multiplies the source's counts by this (0 < decay <= 1): old steps fade, so the
            estimate follows a request whose text turns repetitive (or stops being so).

    Raises:
        ValueError: ``decay`` outside (0, 1].
    """

    __slots__ = ("decay", "_acc", "_att")

    def __init__(self, decay: float = 0.98):
        if not 0 < decay <= 1:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        self.decay = decay
        self._acc: dict[str, list[float]] = {}
        self._att: dict[str, list[float]] = {}

    def record(self, source: str, tried: int, accepted: int) -> None:
        """One verification of ``tried`` consecutive draft tokens from ``source`` (positions ``0..tried-1`` of its
        segment): the first ``accepted`` were accepted; when ``accepted < tried`` the next one was rejected and the
        rest were not reached.

        Raises:
            ValueError: ``accepted`` outside ``[0, tried]``.
        """
        if not 0 <= accepted <= tried:
            raise ValueError(f"accepted must be in [0, tried={tried}], got {accepted}")
        if tried == 0:
            return
        acc, att = self._acc.setdefault(source, []), self._att.setdefault(source, [])
        if self.decay < 1:
            d = self.decay
            acc[:] = [x * d for x in acc]
            att[:] = [x * d for x in att]
        reached = min(tried, accepted + 1)
        if len(att) < reached:
            acc += [0.0] * (reached - len(acc))
            att += [0.0] * (reached - len(att))
        for j in range(reached):
            att[j] += 1.0
        for j in range(accepted):
            acc[j] += 1.0

    def rate(self, source: str) -> float:
        """The source's pooled acceptance rate over all positions, with the prior (:data:`PRIORS`; 0.2 for an
        unknown source) worth :data:`PRIOR_WEIGHT` observations."""
        prior = PRIORS.get(source, 0.2)
        acc, att = self._acc.get(source), self._att.get(source)
        if not att:
            return prior
        return (sum(acc) + PRIOR_WEIGHT * prior) / (sum(att) + PRIOR_WEIGHT)

    def probs(self, source: str, count: int) -> list[float]:
        """Estimated conditional acceptance ``p_0..p_{count-1}`` of the first ``count`` positions of a draft from
        ``source``: each position's record, shrunk towards :meth:`rate` (worth :data:`POSITION_WEIGHT`
        observations). Floats in [0, 1]."""
        if count <= 0:
            return []
        mu = self.rate(source)
        acc, att = self._acc.get(source, ()), self._att.get(source, ())
        n = min(count, len(att))
        w = POSITION_WEIGHT
        out = [(acc[j] + w * mu) / (att[j] + w) for j in range(n)]
        return out + [mu] * (count - n)

    def chain_probs(self, segments: Sequence[tuple[str, int]]) -> list[float]:
        """:meth:`probs` of a draft made of ``segments`` ``[(source, length), ...]`` back to back (each segment's
        positions counted from its own start)."""
        out: list[float] = []
        for source, n in segments:
            out += self.probs(source, n)
        return out

    def record_chain(self, segments: Sequence[tuple[str, int]], tried: int, accepted: int) -> None:
        """Record a verified draft made of ``segments``: its first ``tried`` tokens were forwarded and the first
        ``accepted`` of them accepted (each segment gets the part it reached)."""
        off = 0
        for source, n in segments:
            if off >= tried or accepted < off:
                break
            t = min(n, tried - off)
            self.record(source, t, min(t, accepted - off))
            off += n

    def snapshot(self) -> dict[str, dict[str, list[float]]]:
        """``{source: {"accepted": [...], "tried": [...]}}`` (decayed counts by position; for reports and tests)."""
        return {s: {"accepted": list(self._acc[s]), "tried": list(self._att[s])} for s in self._att}


def expected_accepted(probs: Sequence[float]) -> list[float]:
    """``E(w)`` for ``w = 0..len(probs)``: expected accepted draft tokens when the first ``w`` positions are
    forwarded, ``sum_{j<w} prod_{i<=j} probs[i]`` (verification stops at the first rejected token)."""
    out, run, total = [0.0], 1.0, 0.0
    for p in probs:
        run *= p
        total += run
        out.append(total)
    return out


class ForwardCost:
    """Seconds of one decode forward of ``rows`` rows x ``tokens`` tokens per row, from measured points.

    Between measured token counts of one row count: linear; past the last: in proportion to the tokens, or with the
    last segment's slope where that is steeper (never cheaper per token than measured: an unmeasured wide forward
    is not taken for free); below the first: the first point. Between measured row counts: linear; past the largest: proportional to the
    rows (the compute-bound worst case); below the smallest: that row's curve. Each row count's curve is made
    non-decreasing in tokens (a noisy measurement must not make a wider forward look cheaper).

    Args:
        points: ``{rows: {tokens: seconds}}``, every count >= 1 and every time > 0.
        about: what was measured and where (device, dtype, threads, context; free-form, kept in reports).

    Raises:
        ValueError: no points, a count < 1 or a time <= 0.
    """

    def __init__(self, points: Mapping[int, Mapping[int, float]], about: Mapping | None = None):
        if not points or not all(points.values()):
            raise ValueError("ForwardCost needs at least one measured point per row count")
        self._rows: list[int] = []
        self._curves: dict[int, tuple[list[int], list[float]]] = {}
        for b in sorted(int(x) for x in points):
            pts = {int(s): float(t) for s, t in points[b if b in points else str(b)].items()}
            if b < 1 or min(pts) < 1 or min(pts.values()) <= 0:
                raise ValueError(f"ForwardCost points must have rows, tokens >= 1 and seconds > 0, got rows {b}: {pts}")
            ss = sorted(pts)
            ts, hi = [], 0.0
            for s in ss:
                hi = max(hi, pts[s])
                ts.append(hi)
            self._rows.append(b)
            self._curves[b] = (ss, ts)
        self.about = dict(about or {})
        self._memo: dict[tuple[int, int], float] = {}

    @property
    def rows(self) -> list[int]:
        """The measured row counts, ascending."""
        return list(self._rows)

    def curve(self, rows: int) -> list[tuple[int, float]]:
        """The measured ``(tokens, seconds)`` points of row count ``rows`` (monotone). Raises KeyError if not
        measured."""
        ss, ts = self._curves[rows]
        return list(zip(ss, ts))

    def points(self) -> dict[int, dict[int, float]]:
        """All measured points, ``{rows: {tokens: seconds}}`` (monotone in tokens)."""
        return {b: dict(self.curve(b)) for b in self._rows}

    def _row_seconds(self, b: int, s: int) -> float:
        ss, ts = self._curves[b]
        if s <= ss[0]:
            return ts[0]
        i = bisect.bisect_left(ss, s)
        if i < len(ss):
            if ss[i] == s:
                return ts[i]
            s0, s1, t0, t1 = ss[i - 1], ss[i], ts[i - 1], ts[i]
            return t0 + (t1 - t0) * (s - s0) / (s1 - s0)
        prop = ts[-1] * s / ss[-1]
        if len(ss) == 1:
            return prop
        slope = (ts[-1] - ts[-2]) / (ss[-1] - ss[-2])
        return max(prop, ts[-1] + slope * (s - ss[-1]))

    def seconds(self, rows: int, tokens: int) -> float:
        """Estimated seconds of one forward of ``rows`` x ``tokens`` (both >= 1)."""
        hit = self._memo.get((rows, tokens))  # (the width choice asks for the same few points every step)
        if hit is None:
            if len(self._memo) >= 4096:
                self._memo.clear()
            hit = self._memo[rows, tokens] = self._seconds(rows, tokens)
        return hit

    def _seconds(self, rows: int, tokens: int) -> float:
        rs = self._rows
        if rows <= rs[0]:
            return self._row_seconds(rs[0], tokens)
        if rows >= rs[-1]:
            return self._row_seconds(rs[-1], tokens) * rows / rs[-1]
        i = bisect.bisect_left(rs, rows)
        if rs[i] == rows:
            return self._row_seconds(rows, tokens)
        b0, b1 = rs[i - 1], rs[i]
        t0, t1 = self._row_seconds(b0, tokens), self._row_seconds(b1, tokens)
        return t0 + (t1 - t0) * (rows - b0) / (b1 - b0)

    def to_dict(self) -> dict:
        """JSON-able ``{"points": {rows: {tokens: seconds}}, "about": {...}}`` (keys as strings)."""
        return {"points": {str(b): {str(s): t for s, t in self.curve(b)} for b in self._rows}, "about": self.about}

    @classmethod
    def from_dict(cls, d: Mapping) -> "ForwardCost":
        """Inverse of :meth:`to_dict`. Raises ValueError on a malformed table."""
        try:
            pts = {int(b): {int(s): float(t) for s, t in row.items()} for b, row in d["points"].items()}
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            raise ValueError(f"malformed forward cost table: {e}") from None
        return cls(pts, d.get("about"))


@dataclass(frozen=True)
class RowDraft:
    """One row's options for this step, as :func:`choose_widths` sees them.

    Attributes:
        probs: estimated conditional acceptance of each position of the row's draft (its length is the row's
            ceiling: the most draft tokens it can forward).
        branches: lengths of candidates verified in the same forward next to the draft (MR's tree), each cut to
            the width; they add tokens to the row's forward (their value is not counted).
        fixed: forward the whole draft and branches whatever the width (a fixed-width row next to auto ones).
    """

    probs: Sequence[float]
    branches: Sequence[int] = ()
    fixed: bool = False


#: Widths :func:`choose_widths` considers (plus the longest draft): every width up to 8, then sparser.
_GRID = (0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 56, 64, 80, 96, 112, 128)


def width_grid(ceiling: int) -> list[int]:
    """The widths considered for drafts of at most ``ceiling`` tokens: :data:`_GRID` below it, every 32 past 128,
    and ``ceiling`` itself."""
    out = [w for w in _GRID if w < ceiling]
    w = _GRID[-1] + 32
    while w < ceiling:
        out.append(w)
        w += 32
    return out + [max(ceiling, 0)]


#: A draft must be expected to beat plain AR's tokens per second by this fraction (the cost table is a measurement
#: on a machine that may be shared: a smaller predicted gain is within its error, and AR is the safe side).
MARGIN = 0.05


def choose_widths(cost: ForwardCost, rows: Sequence[RowDraft], overhead_s: float = 0.0,
                  margin: float = MARGIN, draft_penalty: float = 1.0) -> list[int]:
    """Draft tokens each row forwards this step: the width ``W`` maximising expected tokens per second of one
    padded forward, ``sum_r (1 + E_r(min(W, ceiling_r))) / (cost.seconds(len(rows), s(W)) + overhead_s)``,
    with ``s(W)`` the longest row's ``1 + min(W, ceiling_r) + sum(min(W, branch))`` (fixed rows: their whole
    draft and branches). Rows are padded to the longest, so every auto row drafts ``min(W, ceiling_r)``; ``W = 0``
    is plain AR, and a ``W > 0`` whose forward costs more than AR's must beat it by ``margin``. Ties go to the wider
    width (where the table says a wider forward costs nothing more, it is taken).

    Args:
        cost: the forward's cost table.
        rows: one :class:`RowDraft` per row of the forward.
        overhead_s: seconds each step costs besides the forward (the same whatever the width).
        margin: the fraction by which drafting must beat AR (:data:`MARGIN`).
        draft_penalty: factor on the table's cost of a drafting forward (``W > 0``) relative to an AR one:
            :meth:`StepCalibration.penalty`, what the engine's steps measured against the table (1: the table).

    Returns:
        one width per row, ``0 <= width <= len(row.probs)``.
    """
    if not rows:
        return []
    b = len(rows)
    floor = 1
    auto = []
    for r in rows:
        if r.fixed:
            floor = max(floor, 1 + len(r.probs) + sum(r.branches))
        else:
            auto.append((r, expected_accepted(r.probs)))
    ceiling = max((len(r.probs) for r, _ in auto), default=0)
    fixed_tokens = sum(1 + expected_accepted(r.probs)[-1] for r in rows if r.fixed)
    # no width emits more than every auto row's whole draft: once that many tokens over a width's forward (whose
    # cost only grows with W) cannot reach the best rate, no wider width can, and the search stops. Summed as the
    # loop below sums a width's tokens, term by term (Python 3.12's sum() compensates: an ulp below a tie would stop
    # the search before a wider width that ties)
    most_tokens = fixed_tokens
    for _, e in auto:
        most_tokens += 1 + e[-1]
    best_w, best, ar_seconds = 0, None, None
    seconds_of = cost.seconds
    shapes = [(e, len(r.probs), tuple(r.branches)) for r, e in auto]  # (runs every step: kept to plain int ops)
    for W in width_grid(ceiling):
        s, tokens = floor, fixed_tokens
        for e, n, branches in shapes:
            w = W if W < n else n
            tokens += 1 + e[w]
            x = 1 + w + sum(W if W < y else y for y in branches) if branches else 1 + w
            if x > s:
                s = x
        seconds = seconds_of(b, s) * (draft_penalty if W else 1.0) + overhead_s
        rate = tokens / seconds
        if best is not None and most_tokens / seconds < best:
            break
        if best is None:  # W = 0: plain AR (or the fixed rows' forward)
            best_w, best, ar_seconds = W, rate, seconds
        elif rate >= (best if best_w else best * (1 + margin if seconds > ar_seconds else 1)):
            # (against AR, the margin where drafting costs more; between two drafting widths, the faster)
            best_w, best = W, rate
    return [len(r.probs) if r.fixed else min(best_w, len(r.probs)) for r in rows]


class StepCalibration:
    """What whole engine steps cost against the cost table's forward, per row count: the table times one forward
    alone; a drafting step also runs the verification, MR's second (pruned) pass, the n-gram pool, padding to the
    longest row -- costs the table cannot see and that grow with the batch. Each step records its observed seconds
    over the table's prediction and the tokens it emitted, separately for steps that drafted and AR steps (row counts
    bucketed by powers of two, :meth:`bucket`), in a window of each kind's last :attr:`window` steps.

    :meth:`penalty`, the factor :func:`choose_widths` puts on a drafting forward, is the ratio of the two kinds'
    median observed-over-table. A median, not an average: a first call's allocations (SmolLM2's first drafting step
    took 3.8x its prediction, its first AR step 17x) or a step that waited for a shared core must not set it. Where
    the steps that drafted emitted fewer tokens per second than the AR steps (a ratio of sums over the windows: a
    drafting step emits anything from 1 token to its whole draft), the penalty is its ceiling for a batch -- the
    acceptance estimates (:class:`AcceptanceStats`) were too high for this batch, whatever the table says -- and for
    a single row its ratio times the shortfall: one row's window mixes weak drafts with strong ones, and the
    ceiling stopped the strong ones too (SmolLM2-135M, batch 1, Intel Xeon: 56 % of steps at the ceiling, TPF 1.43,
    1.29x AR; priced by the shortfall, TPF 1.75, 1.36x AR; equal output). And since a penalty
    that made every later step AR could never be corrected by drafting steps, once the last drafting step is
    :attr:`stale_steps` AR steps old the penalty is 1 again until drafting steps are measured anew. Not from the
    paper (its widths are fixed, chosen offline in Appendix E): this is the on-line choice.

    Below :attr:`min_rows` rows (by default: a single row) the penalty is 1. There the table times the very forward
    the step runs, and what a drafting step adds around it -- verification, MR's second pass, the pool, 0.2-0.3 ms
    of the quickstart JF model's 1.2 ms step -- also buys tokens the width choice does not count: the recycled
    candidates verified next to the draft, and the forward's Jacobi update of the draft itself, which an AR step
    skips. Priced, it turned one step in five of that model into an AR step that lost ~0.9 tokens: batch 1, 16
    held-out problems, Intel Xeon, one thread, two runs each: TPF 1.53-1.69 and 909-966 tok/s calibrated, 1.79 and
    992-1001 tok/s not (AR 857-881); SmolLM2-135M on HumanEval prompts: the same either way (29.5-30.4 tok/s).

    Args:
        window: steps of each kind the medians and rates are taken over.
        min_steps: steps of each kind before the penalty departs from 1.
        bounds: the penalty's clamp ``(low, high)`` (a drafting step never costs less than the table says relative
            to an AR step: it runs the same step around a wider forward); a step's seconds count at most ``high``
            times its prediction in the rates.
        stale_steps: AR steps after the last drafting step at which the penalty falls back to 1.
        min_rows: the fewest rows whose steps are priced (fewer: the penalty is 1).
    """

    def __init__(self, window: int = 15, min_steps: int = 3, bounds: tuple[float, float] = (1.0, 4.0),
                 stale_steps: int = 64, min_rows: int = 2):
        self.window, self.min_steps, self.bounds, self.stale_steps = window, min_steps, bounds, stale_steps
        self.min_rows = min_rows
        # (bucket, drafted) -> the last `window` steps as (observed / predicted, tokens or None, seconds counted)
        self._steps: dict[tuple[int, bool], list[tuple[float, int | None, float]]] = {}
        self._count: dict[tuple[int, bool], int] = {}
        self._since_draft: dict[int, int] = {}

    @staticmethod
    def bucket(rows: int) -> int:
        """Row counts share a calibration within powers of two (1, 2-3, 4-7, ...): a batch shrinking as its rows
        finish keeps what it learnt."""
        return max(1, rows).bit_length()

    def read_at(self, rows: int) -> bool:
        """Whether steps of ``rows`` rows are ever read: their :meth:`bucket` is that of a row count of
        :attr:`min_rows` or more (below, :meth:`penalty` is 1 and the engine skips :meth:`record`)."""
        return self.bucket(rows) >= self.bucket(self.min_rows)

    def record(self, rows: int, drafted: bool, predicted_s: float, observed_s: float, tokens: int | None = None) -> None:
        """One step of ``rows`` rows, which ``drafted`` (any row forwarded draft tokens) or not, whose forward the
        table predicted at ``predicted_s`` and which took ``observed_s`` seconds (both > 0, else ignored), emitting
        ``tokens`` tokens over its rows (None: not counted in the rates)."""
        if predicted_s <= 0 or observed_s <= 0:
            return
        key = (self.bucket(rows), drafted)
        steps = self._steps.setdefault(key, [])
        steps.append((observed_s / predicted_s, tokens, min(observed_s, self.bounds[1] * predicted_s)))
        del steps[: -self.window]
        self._count[key] = self._count.get(key, 0) + 1
        self._since_draft[key[0]] = 0 if drafted else self._since_draft.get(key[0], 0) + 1

    @property
    def steps(self) -> int:
        """Steps recorded so far (all row counts, both kinds)."""
        return sum(self._count.values())

    def _rate(self, key: tuple[int, bool]) -> float | None:
        """Tokens per second over the window's steps that counted tokens (None below :attr:`min_steps` of them)."""
        counted = [(t, x) for _, t, x in self._steps[key] if t is not None]
        return sum(t for t, _ in counted) / sum(x for _, x in counted) if len(counted) >= self.min_steps else None

    def penalty(self, rows: int) -> float:
        """The factor on a drafting forward at ``rows`` rows: median observed-over-table of drafting steps divided
        by that of AR steps, clamped to :attr:`bounds`; where drafting steps emitted fewer tokens per second than
        AR steps, the ceiling for a batch, and for one row that ratio (at least 1) times the shortfall (AR steps'
        rate over drafting steps'); 1 below :attr:`min_rows` rows, until each kind has :attr:`min_steps` steps, and
        once the last drafting step is :attr:`stale_steps` AR steps old."""
        if rows < self.min_rows:
            return 1.0
        b = self.bucket(rows)
        d, a = (b, True), (b, False)
        if min(self._count.get(d, 0), self._count.get(a, 0)) < self.min_steps:
            return 1.0
        if self._since_draft.get(b, 0) >= self.stale_steps:
            return 1.0
        lo, hi = self.bounds
        ratio = statistics.median(r for r, _, _ in self._steps[d]) / statistics.median(r for r, _, _ in self._steps[a])
        rd, ra = self._rate(d), self._rate(a)
        if rd is not None and ra is not None and rd < ra:
            # the steps that drafted emitted fewer tokens per second than the AR steps. A batch's steps pool its
            # rows: back off (the ceiling). One row's steps are one request's luck -- a window of weak drafts
            # next to strong ones -- and the ceiling would stop its strong drafts too, with no drafting step left
            # to refresh the window: price drafting up by the shortfall instead
            if rows > 1:
                return hi
            ratio = max(ratio, 1.0) * ra / rd
        return min(hi, max(lo, ratio))


class StepTimes:
    """Seconds of an engine's whole step by the tokens it forwarded, measured from the steps themselves: the cost
    table of an engine whose forward this project does not time (vLLM's, for the plugin's proposer,
    :mod:`megatron_jf.vllm_plugin.proposer`). A flattened batch (vLLM's) costs by its total tokens, so one curve:
    ``tokens -> seconds``.

    Each step records its tokens and seconds; token counts are bucketed (exact up to 8, then by powers of two) and
    each bucket keeps its last :attr:`window` steps, whose medians (tokens, seconds) are the curve's points (a
    median: a step that waited for a shared core, or a first call, must not set it). Not from the paper (its widths
    are fixed, chosen offline in Appendix E): the on-line choice, as :class:`StepCalibration`.

    Args:
        window: steps kept per bucket.
        min_steps: steps a bucket needs before it is a point.

    Raises:
        ValueError: ``window`` or ``min_steps`` < 1, or ``min_steps`` > ``window``.
    """

    def __init__(self, window: int = 15, min_steps: int = 2):
        if not 1 <= min_steps <= window:
            raise ValueError(f"StepTimes needs 1 <= min_steps <= window, got {min_steps} and {window}")
        self.window, self.min_steps = window, min_steps
        self._buckets: dict[int, list[tuple[int, float]]] = {}

    @staticmethod
    def bucket(tokens: int) -> int:
        """Token counts up to 8 are their own bucket; above, powers of two share one (9-16 -> 16, 17-32 -> 32)."""
        return tokens if tokens <= 8 else 1 << (tokens - 1).bit_length()

    def record(self, tokens: int, seconds: float) -> None:
        """One step that forwarded ``tokens`` tokens (>= 1) in ``seconds`` (> 0; others are ignored)."""
        if tokens < 1 or seconds <= 0:
            return
        steps = self._buckets.setdefault(self.bucket(tokens), [])
        steps.append((tokens, seconds))
        del steps[: -self.window]

    def steps_at(self, tokens: int) -> int:
        """Steps kept in the bucket of ``tokens``."""
        return len(self._buckets.get(self.bucket(tokens), ()))

    def table(self, optimistic: bool = False) -> ForwardCost | None:
        """The curve as a one-row :class:`ForwardCost` over total tokens (monotone, extrapolated as it does: no
        cheaper per token past the last point), or None until two buckets have :attr:`min_steps` steps (one point
        says nothing about what a wider step costs). ``optimistic``: flat past the last point instead (a wider step
        priced as the widest timed: what is worth trying once)."""
        pts = {}
        for steps in self._buckets.values():
            if len(steps) >= self.min_steps:
                pts[int(statistics.median(t for t, _ in steps))] = statistics.median(x for _, x in steps)
        if len(pts) < 2:
            return None
        if optimistic:
            last = max(pts)
            pts[1 << 20] = pts[last]
        return ForwardCost({1: pts}, {"source": "step times", "optimistic": optimistic})

    def timed_up_to(self) -> int:
        """The most tokens of a point of :meth:`table` (0 when there is none)."""
        return max((int(statistics.median(t for t, _ in steps)) for steps in self._buckets.values()
                    if len(steps) >= self.min_steps), default=0)


def choose_flat_width(cost: ForwardCost, rows: Sequence[Sequence[float]], margin: float = MARGIN) -> int:
    """The draft width ``W`` every row forwards this step (cut to its own draft) in an engine whose batch is one
    flattened sequence of tokens (vLLM's): the ``W`` maximising ``sum_r (1 + E_r(min(W, len_r))) /
    cost.seconds(1, sum_r (1 + min(W, len_r)))``, ``W = 0`` (AR) unless a draft beats it by ``margin`` where it
    costs more (as :func:`choose_widths`; ties go to the wider).

    Args:
        cost: seconds by total tokens (row count 1), e.g. :meth:`StepTimes.table`.
        rows: each row's estimated conditional acceptance by draft position (its length: the row's draft).

    Returns:
        ``W``, 0 up to the longest draft.
    """
    expect = [expected_accepted(p) for p in rows]
    ceiling = max((len(p) for p in rows), default=0)
    best_w, best, ar_seconds = 0, None, None
    for W in width_grid(ceiling):
        tokens = sum(1 + min(W, len(p)) for p in rows)
        seconds = cost.seconds(1, max(tokens, 1))
        rate = sum(1 + e[min(W, len(e) - 1)] for e in expect) / seconds
        if best is None:
            best_w, best, ar_seconds = W, rate, seconds
        elif rate >= (best if best_w else best * (1 + margin if seconds > ar_seconds else 1)):
            best_w, best = W, rate
    return best_w
