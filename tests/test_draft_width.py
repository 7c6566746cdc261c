"""The draft width that pays (issue 33), without a model: the cost table's interpolation, each request's acceptance
statistics, the width choice following the cost table, and every policy staying exactly greedy AR whatever width
the verifier forwards (megatron_jf/decoding/width.py). No torch."""
import random

import pytest

from megatron_jf.decoding import DecodeConfig, Outcome, accepted_prefix, jacobi_update, policy_for
from megatron_jf.decoding.width import (AcceptanceStats, ForwardCost, RowDraft, StepCalibration, choose_widths,
                                        expected_accepted, width_grid)


def _linear_cost(per_token: float, rows=(1,)) -> ForwardCost:
    """A forward of s tokens costs 1 + per_token * (s - 1) (per row count: times the rows)."""
    return ForwardCost({b: {s: b * (1 + per_token * (s - 1)) for s in (1, 2, 4, 8, 16, 32, 64)} for b in rows})


def test_width_follows_the_cost_table():
    row = [RowDraft([0.8] * 16)]
    assert choose_widths(_linear_cost(0.0), row) == [16]  # wide forwards free: the ceiling
    assert choose_widths(_linear_cost(1.0), row) == [0]  # a forward of s tokens costs s x: AR
    # 1 + 0.25 (s - 1): expected tokens / cost = (1 + 0.8 + ... + 0.8^W) / (1 + 0.25 W): 1.44, 1.63, 1.69, 1.68 ...
    assert choose_widths(_linear_cost(0.25), row) == [3]
    assert choose_widths(_linear_cost(0.25), [RowDraft([0.8] * 2)]) == [2]  # the row's own draft is its ceiling
    assert choose_widths(_linear_cost(0.01), [RowDraft([0.8, 0.0, 0.5])]) == [1]  # nothing past a sure rejection
    assert choose_widths(_linear_cost(0.0), [RowDraft([0.8, 0.0, 0.5])]) == [3]  # ... unless it costs nothing
    assert choose_widths(_linear_cost(0.0), [RowDraft([])]) == [0]
    # free wide forwards draft the ceiling even when little is expected to be accepted (the margin is for drafts that
    # cost more than AR; it had sent these batch rows to AR, so a batch drafted unlike each row alone)
    assert choose_widths(_linear_cost(0.0, rows=(1, 4)), [RowDraft([0.01] * 4)] * 4) == [4] * 4
    # a predicted gain within the table's measurement error (3 % < MARGIN = 5 %) stays AR
    assert choose_widths(_linear_cost(0.1), [RowDraft([0.133])]) == [0]
    assert choose_widths(_linear_cost(0.1), [RowDraft([0.133])], margin=0.0) == [1]
    # a batch: one forward padded to the longest row; a row that accepts nothing still drafts (padding is free)
    two = [RowDraft([0.9] * 8), RowDraft([0.0] * 8)]
    assert choose_widths(_linear_cost(0.1, rows=(1, 2)), two) == [8, 8]
    assert choose_widths(_linear_cost(0.5, rows=(1, 2)), two) == [0, 0]  # (2 + E) / (1 + 0.5 W) never beats 2
    # a fixed-width row of 8 tokens sets the forward's length: auto rows draft up to 8 for free
    mixed = [RowDraft([0.0] * 8, fixed=True), RowDraft([0.3] * 20)]
    assert choose_widths(_linear_cost(0.5, rows=(2,)), mixed) == [8, 8]
    # tree branches (MR candidates in the same forward) are cut to the width too and lengthen the forward:
    # W tokens cost 1 + 0.05 * 4W: rates 1.50, 1.74, 1.85, 1.87, 1.84 for W = 1..5
    assert choose_widths(_linear_cost(0.05), [RowDraft([0.8] * 16, branches=(16, 16, 16))]) == [4]
    assert choose_widths(_linear_cost(0.05), [RowDraft([0.8] * 16)]) == [8]  # 4.33 / 1.4 = 3.09 beats W = 7, 10


def _choose_widths_every_width(cost, rows, overhead_s=0.0, margin=0.05, draft_penalty=1.0):
    """The reference: choose_widths' documented rule with every width of the grid evaluated (no early stop)."""
    fixed = [r for r in rows if r.fixed]
    auto = [r for r in rows if not r.fixed]

    def emitted(W):  # expected tokens of the step: 1 + E(min(W, ceiling)) per row (fixed rows: their whole draft),
        total = sum(1 + expected_accepted(r.probs)[-1] for r in fixed)  # added up in choose_widths' order (ties)
        for r in auto:
            total += 1 + expected_accepted(r.probs)[min(W, len(r.probs))]
        return total

    def forwarded(W):  # the padded forward's tokens per row
        lens = [1 + len(r.probs) + sum(r.branches) for r in fixed]
        lens += [1 + min(W, len(r.probs)) + sum(min(W, x) for x in r.branches) for r in auto]
        return max(lens + [1])

    def seconds(W):
        return cost.seconds(len(rows), forwarded(W)) * (draft_penalty if W else 1.0) + overhead_s

    grid = width_grid(max((len(r.probs) for r in auto), default=0))
    rates = {W: emitted(W) / seconds(W) for W in grid}
    pick = 0
    for W in grid[1:]:
        need = rates[pick] if pick else rates[0] * (1 + margin if seconds(W) > seconds(0) else 1)
        if rates[W] >= need:
            pick = W
    return [len(r.probs) if r.fixed else min(pick, len(r.probs)) for r in rows]


def test_width_search_stops_early_with_the_same_choice():
    """choose_widths stops once no wider width can reach the best rate: the same widths as trying them all, on
    random cost tables (some nearly flat, some steep, with plateaus), acceptance, branches, fixed rows, penalties."""
    rnd = random.Random(7)
    for case in range(400):
        rows_n = rnd.choice((1, 1, 2, 3))
        pts, t = {}, 1.0
        for s in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64):
            t += rnd.choice((0.0, 0.0, rnd.uniform(0, 0.05), rnd.uniform(0, 0.5)))
            pts[s] = t
        cost = ForwardCost({rows_n: pts})
        rows = []
        for _ in range(rows_n):
            n = rnd.randint(0, 40)
            p = rnd.choice((0.05, 0.3, 0.7, 0.95))
            rows.append(RowDraft([min(1.0, max(0.0, rnd.gauss(p, 0.2))) for _ in range(n)],
                                 branches=[rnd.randint(1, 6) for _ in range(rnd.choice((0, 0, 2)))],
                                 fixed=rnd.random() < 0.1))
        kw = dict(overhead_s=rnd.choice((0.0, 0.3)), draft_penalty=rnd.choice((1.0, 1.4)))
        assert choose_widths(cost, rows, **kw) == _choose_widths_every_width(cost, rows, **kw), case


def test_ties_go_to_the_widest_draft_whatever_the_float_sums():
    """Wide forwards free and drafts whose acceptance stops after two positions: every width from 2 up ties, and the
    widest is taken -- for batches whose expected tokens a compensated sum (Python 3.12's ``sum``, ``math.fsum``)
    rounds below the term-by-term sum, where the search's early stop once quit before the ties (the mixed-batch test
    then drafted differently in a batch and alone on Python 3.12)."""
    import math

    rnd = random.Random(3)
    free = ForwardCost({b: {1: 1.0, 64: 1.0} for b in (1, 8)})
    seen = 0
    for _ in range(300):
        rows = [RowDraft([rnd.random(), rnd.random()] + [0.0] * 6) for _ in range(rnd.randint(2, 8))]
        terms = [1 + expected_accepted(r.probs)[-1] for r in rows]
        seq = 0.0
        for t in terms:
            seq += t
        seen += math.fsum(terms) < seq
        assert choose_widths(free, rows) == [8] * len(rows)
    assert seen > 10  # the rounding this guards against did occur


def test_forward_cost_interpolates_and_stays_monotone():
    c = ForwardCost({1: {1: 1.0, 2: 2.5, 4: 2.0, 8: 3.0}, 3: {1: 3.0, 8: 10.0}})
    assert c.curve(1) == [(1, 1.0), (2, 2.5), (4, 2.5), (8, 3.0)]  # noise made s=4 look cheaper than s=2
    assert c.seconds(1, 3) == 2.5 and c.seconds(1, 6) == 2.75
    assert c.seconds(1, 12) == 4.5  # past 8: proportional (3.0 * 12 / 8), the last slope (3.5) being flatter
    assert ForwardCost({1: {1: 1.0, 2: 1.0, 3: 4.0}}).seconds(1, 4) == 7.0  # ... or the last slope, if steeper
    assert c.seconds(2, 1) == 2.0 and c.seconds(2, 8) == 6.5  # between row counts: linear
    assert c.seconds(6, 1) == 6.0  # past the largest row count: proportional
    assert ForwardCost.from_dict(c.to_dict()).points() == c.points()
    with pytest.raises(ValueError, match="seconds > 0"):
        ForwardCost({1: {1: 0.0}})
    with pytest.raises(ValueError, match="malformed"):
        ForwardCost.from_dict({"points": {"x": {}}})
    assert width_grid(0) == [0] and width_grid(9) == list(range(10)) and width_grid(200)[-3:] == [160, 192, 200]


def test_acceptance_stats_by_position_and_source():
    st = AcceptanceStats(decay=1.0)
    assert st.probs("context3", 2) == [0.85, 0.85] and st.probs("draft", 1) == [0.15]  # the priors
    st.record("draft", tried=3, accepted=1)  # position 0 accepted, 1 rejected, 2 not reached
    mu = (1 + 2 * 0.15) / (2 + 2)  # pooled: 1 of 2 tried, prior 0.15 worth 2
    assert st.rate("draft") == pytest.approx(mu)
    assert st.probs("draft", 3) == pytest.approx([(1 + mu) / 2, mu / 2, mu])
    st.record_chain([("context2", 2), ("draft", 5)], tried=4, accepted=3)  # context 2/2, then draft 1 of 2
    assert st.snapshot()["context2"] == {"accepted": [1.0, 1.0], "tried": [1.0, 1.0]}
    assert st.snapshot()["draft"] == {"accepted": [2.0, 0.0], "tried": [2.0, 2.0]}
    d = AcceptanceStats(decay=0.5)
    d.record("pool", 1, 1)
    d.record("pool", 1, 0)
    assert d.snapshot()["pool"] == {"accepted": [0.5], "tried": [1.5]}  # the older step counts half
    assert expected_accepted([0.5, 0.5, 1.0]) == [0.0, 0.5, 0.75, 1.0]
    with pytest.raises(ValueError, match="accepted must be"):
        st.record("draft", 2, 3)


# ------------------------------------------------------------------------------------------ a model-free loop
def _mixing(seq):
    return (seq[-1] * 7 + seq[-2] * 3 + 1) % 23 if len(seq) > 1 else 5


def _copying(seq):
    """Next token of a 'model' that continues the earliest earlier occurrence of the last two tokens (text that
    repeats itself, as code repeats its prompt), else a mixing rule."""
    for i in range(len(seq) - 2):
        if seq[i] == seq[-2] and seq[i + 1] == seq[-1]:
            return seq[i + 2]
    return (seq[-1] * 5 + 3) % 31


def _decode(cfg, prompt, f, max_new, widths=None, linear=False):
    """Tree verification of draft + candidates against ``f``, each step cut to the width ``widths(step, len)``
    gives (None: the whole draft). Returns (output, forwards)."""
    pol = policy_for(cfg, linear)
    st = pol.new_state(prompt, 0)
    ctx, forwards = list(prompt), 0
    while True:
        prop = pol.propose(st, ctx)
        w = len(prop.draft) if widths is None else widths(forwards, len(prop.draft))
        draft = prop.draft[:w]
        cands = [c[:w] for c in prop.candidates] if w else []
        g = [f(ctx + draft[:j]) for j in range(len(draft) + 1)]
        k = accepted_prefix(draft, g)
        emitted, winner = draft[:k] + [g[k]], None
        for i, c in enumerate(cands):
            gc = [f(ctx + c[:j]) for j in range(len(c) + 1)]
            kc = accepted_prefix(c, gc)
            if kc > len(emitted) - 1:
                emitted, winner = c[:kc] + [gc[kc]], i
        forwards += 1
        emitted = emitted[: max_new - (len(ctx) - len(prompt))]
        ctx = ctx + emitted
        if len(ctx) - len(prompt) >= max_new:
            return ctx[len(prompt):], forwards
        pol.observe(st, ctx, Outcome(g, emitted, len(emitted) - 1, winner))


CONFIGS = ([DecodeConfig("jacobi", block_size=n) for n in (1, 5)]
           + [DecodeConfig("running-window", block_size=4)]
           + [DecodeConfig("mr", block_size=n, num_blocks=K, spawn_threshold=r, verification_size=v, draft_width=dw)
              for n, K, r, v, dw in [(3, 2, 0.5, 2, "auto"), (8, 2, 0.85, 4, "auto"), (4, 3, 0.3, 3, "fixed"),
                                     (4, 3, 0.3, 3, "auto")]])


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.decoder}-n{c.block_size}-K{c.num_blocks}-{c.draft_width}")
def test_any_width_reproduces_greedy_ar(cfg):
    """Whatever prefix of the draft a step verifies (the width cut, or vLLM verifying fewer tokens), the positions
    it did not verify keep their guesses and the output is exactly greedy AR's."""
    rnd = random.Random(0)
    for f in (_mixing, _copying):
        for prompt in ([4, 9], [1, 2, 3, 4, 5, 1, 2, 3], [7] * 5):
            ar, _ = _decode(DecodeConfig("ar"), prompt, f, 40)
            for linear in (False, True):
                out, _ = _decode(cfg, prompt, f, 40, widths=lambda step, m: rnd.randint(0, m), linear=linear)
                assert out == ar, (f.__name__, prompt, linear)


def test_jacobi_update_keeps_guesses_past_the_verified_part():
    assert jacobi_update([5, 6, 7, 8], [9, 9]) == [9, 9, 7, 8]  # 1 draft token verified: g covers positions 0-1
    assert jacobi_update([5, 6], [9, 9, 9]) == [9, 9, 9]  # all verified, bonus prediction included
    pol = policy_for(DecodeConfig("running-window", block_size=4, draft_init="repeat"))
    st = pol.new_state([1, 2, 3], 0)
    st.draft = [5, 6, 7, 8]
    pol.propose(st, [1, 2, 3])
    pol.observe(st, [1, 2, 3, 5, 40], Outcome([5, 40, 41], [5, 40], 1))  # width 2 of 4: 5 accepted, 40 corrects 6
    assert st.draft == [41, 8, 40, 40]  # g past the accepted token, then the unverified guess 8, then refill


def test_an_ar_step_still_observes_the_first_draft_token():
    """A step the width choice made AR forwards no draft token, yet its token says whether the draft's first token
    -- and each MR candidate's -- would have been accepted. Without that record a request whose first drafts failed
    kept its low estimates, drafted nothing and so never saw a draft again (the quickstart JF model: a quarter of
    its steps AR in one run, TPF 1.52 against 1.60-1.70)."""
    pol = policy_for(DecodeConfig("jacobi", block_size=4, draft_init="repeat"))
    ctx = [1, 2, 3]
    st = pol.new_state(ctx, 0)
    st.stats.record("draft", 2, 0)
    st.stats.record("draft", 2, 0)  # two failed drafts: the estimate is now below what a draft must reach
    cost = _linear_cost(0.1)
    widths = []
    for _ in range(6):  # AR steps whose token is the draft's first each time (text the draft foresees)
        pol.propose(st, ctx)
        widths.append(choose_widths(cost, [RowDraft(pol.draft_probs(st))])[0])
        tok = st.draft[0]
        ctx = ctx + [tok]
        pol.observe(st, ctx, Outcome([tok], [tok], 0))
    assert widths[0] == 0 and widths[-1] > 0, widths
    before = st.stats.snapshot()["draft"]["tried"][0]
    pol.propose(st, ctx)
    miss = st.draft[0] + 1
    pol.observe(st, ctx + [miss], Outcome([miss], [miss], 0))  # one it did not foresee: tried, not accepted
    snap = st.stats.snapshot()["draft"]
    assert snap["tried"][0] == pytest.approx(before * st.stats.decay + 1)
    assert snap["accepted"][0] < snap["tried"][0] - 1 + 1e-9

    # MR: the draft and each candidate against the AR step's token, by their sources
    pol = policy_for(DecodeConfig("mr", block_size=4, verification_size=3, draft_init="repeat", spawn_threshold=0.5))
    ctx = [1, 2, 3, 4, 9, 1, 2]  # "1 2" occurred before: a context n-gram leads, the repeated-token draft follows
    st = pol.new_state(ctx, 0)
    prop = pol.propose(st, ctx)
    assert prop.draft[0] == 3 and st.segments[0][0] == "context2" and prop.candidates == [[2, 2, 2, 2]]
    pol.observe(st, ctx + [3], Outcome([3], [3], 0))
    assert st.stats.snapshot() == {"context2": {"accepted": [1.0], "tried": [1.0]},
                                   "draft": {"accepted": [0.0], "tried": [1.0]}}


def test_step_calibration_backs_off_when_drafting_steps_cost_more_than_the_table():
    """Batch 16 on this CPU: the table said a 2-token forward costs 1.1x a 1-token one, the drafting steps took 2x
    their prediction (verification, MR's second pass, padding) while AR steps took 1x: the penalty is 2 and the
    width choice goes from drafting to AR; the same drafts on the table alone still draft."""
    cost = _linear_cost(0.1, rows=(16,))
    rows = [RowDraft([0.5] * 4) for _ in range(16)]
    assert choose_widths(cost, rows) != [0] * 16
    cal = StepCalibration()
    assert cal.penalty(16) == 1.0
    for _ in range(5):
        cal.record(16, False, 1.0, 1.0)
        cal.record(16, True, 1.1, 2.2)
    assert cal.penalty(16) == pytest.approx(2.0) and cal.penalty(1) == 1.0  # per row count (bucketed: 16-31)
    assert cal.penalty(20) == cal.penalty(16) and cal.penalty(32) == 1.0
    assert choose_widths(cost, rows, draft_penalty=cal.penalty(16)) == [0] * 16
    # too few steps of one kind: the table as it is; extreme ratios clamped; bad times ignored
    few = StepCalibration(min_steps=3)
    few.record(4, True, 1.0, 9.0)
    few.record(4, False, 1.0, 1.0)
    assert few.penalty(4) == 1.0
    for _ in range(3):
        few.record(4, True, 1.0, 9.0)
        few.record(4, False, 1.0, 1.0)
        few.record(4, False, 0.0, 1.0)
    assert few.penalty(4) == 4.0



def test_step_calibration_outliers_and_lock_in():
    """SmolLM2 at batch 1 (measured): the first drafting step, a first call, took 3.8x its prediction and the first
    AR step 17x; an average seeded with such a step can price drafting out, after which no drafting step runs and
    the penalty never moves. The median of the recent steps ignores first calls, and a penalty unrefreshed by
    drafting steps for ``stale_steps`` AR steps falls back to 1 (the table alone) until drafting is measured anew."""
    cal = StepCalibration(min_steps=3, stale_steps=10, min_rows=1)  # (one row priced, as a batch is by default)
    for obs in (0.832, 0.0433, 0.0419):
        cal.record(1, False, 0.0481, obs)
    for pred, obs in ((0.0977, 0.3667), (0.0876, 0.0931), (0.1089, 0.1150)):
        cal.record(1, True, pred, obs)
    assert cal.penalty(1) == pytest.approx((0.0931 / 0.0876) / (0.0433 / 0.0481))  # the medians
    # drafting steps measured at 3x their forward: the penalty backs drafting off; 10 AR steps later it is stale
    # and the table alone decides again, until one drafting step refreshes it
    for _ in range(15):
        cal.record(1, True, 0.08, 0.24)
    p = cal.penalty(1)
    assert p == pytest.approx(3 / (0.0433 / 0.0481))
    for i in range(10):
        assert cal.penalty(1) == pytest.approx(p), i
        cal.record(1, False, 0.0481, 0.0433)
    assert cal.penalty(1) == 1.0
    cal.record(1, True, 0.08, 0.24)
    assert cal.penalty(1) == pytest.approx(p)


def test_step_calibration_backs_off_where_drafting_steps_emit_less_per_second():
    """SmolLM2 at batch 16 (measured): steps that drafted cost what the table said relative to AR steps, yet emitted
    fewer tokens per second than the AR steps (the acceptance estimates were high): the penalty goes to its ceiling;
    for one row, to its ratio times the shortfall.
    The rate is a ratio of sums -- most drafting steps emit 1-2 tokens and a few many, and a median of per-step rates
    would back off at batch 1 where drafting paid (1.25x AR)."""
    cal = StepCalibration(min_steps=3)
    for _ in range(5):
        cal.record(16, False, 1.0, 1.0, tokens=16)  # 16 tokens/s
        cal.record(16, True, 1.2, 1.2, tokens=18)  # 15 tokens/s: drafting loses
    assert cal.penalty(16) == 4.0
    # one row (SmolLM2, batch 1, Xeon): its drafting steps lost to its AR steps, a mix of weak drafts and strong
    # ones -- priced up by the shortfall, not stopped: a strong draft still pays, a weak one no longer does
    one = StepCalibration(min_steps=3, min_rows=1)
    for _ in range(5):
        one.record(1, False, 1.0, 1.0, tokens=1)  # 1 token/s
        one.record(1, True, 1.3, 1.3, tokens=1)  # 0.77 tokens/s
    assert one.penalty(1) == pytest.approx(1.3)  # ratio 1 x shortfall 1.3
    cost = _linear_cost(0.3)
    assert choose_widths(cost, [RowDraft([0.9] * 4)], draft_penalty=one.penalty(1)) != [0]
    assert choose_widths(cost, [RowDraft([0.4] * 4)]) != [0]
    assert choose_widths(cost, [RowDraft([0.4] * 4)], draft_penalty=one.penalty(1)) == [0]
    pays = StepCalibration(min_steps=3, min_rows=1)
    for _ in range(4):
        pays.record(1, False, 1.0, 1.0, tokens=1)
    for t in (1, 1, 1, 8):  # per-step rates 0.6, 0.6, 0.6, 5 tokens/s: median 0.6 < 1, sum 11 / 6.4 s = 1.7 > 1
        pays.record(1, True, 1.6, 1.6, tokens=t)
    assert pays.penalty(1) == 1.0


def test_step_calibration_is_recorded_only_where_it_is_read():
    """read_at: the engine skips recording steps whose row count's bucket no penalty reads (one row by default); with
    min_rows=3 two-row steps share the bucket of three rows and are still read."""
    assert [StepCalibration().read_at(r) for r in (1, 2, 3, 4)] == [False, True, True, True]
    assert [StepCalibration(min_rows=3).read_at(r) for r in (1, 2, 3, 5)] == [False, True, True, True]
    assert [StepCalibration(min_rows=4).read_at(r) for r in (2, 3, 4)] == [False, False, True]
    assert StepCalibration(min_rows=1).read_at(1)


def test_step_calibration_leaves_a_single_row_to_the_table():
    """By default one row's steps are not priced (the quickstart JF model at batch 1: calibrated TPF 1.53-1.69,
    not 1.79; StepCalibration's docstring): drafting steps measured at 3x their forward, or emitting less per second
    than AR steps, leave the penalty at 1 for one row, and price a batch of two."""
    cal = StepCalibration(min_steps=3)
    for rows in (1, 2):
        for _ in range(5):
            cal.record(rows, False, 1.0, 1.0, tokens=rows)
            cal.record(rows, True, 1.0, 3.0, tokens=rows)
    assert cal.penalty(1) == 1.0 and cal.penalty(2) == 4.0  # (two rows: the rate fell short: the ceiling)
    one = StepCalibration(min_steps=3, min_rows=1)
    for _ in range(5):
        one.record(1, False, 1.0, 1.0, tokens=1)
        one.record(1, True, 1.0, 3.0, tokens=1)
    assert one.penalty(1) == pytest.approx(4.0)  # ratio 3 x shortfall 3, clamped to the ceiling
