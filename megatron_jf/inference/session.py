"""The step: one decode forward for every live row of a batch, driven by the drafting policies.

Per step and row (paper Sec. 2.1, 3.2, Algorithm 1): the row's policy proposes a draft (and, for MR, recycled
candidates) from its committed tokens (:mod:`megatron_jf.decoding`); the model runner
(:class:`~megatron_jf.inference.runner.ModelRunner`) forwards ``[last] + draft`` (+ candidates) over the row's
KV cache; verification accepts the longest verified prefix and one more token (greedy, or the speculative rule
when sampling: :func:`~megatron_jf.inference.sampling.verify`), so every forward emits >= 1 token and the output
is exactly AR's; EOS, ``max_new_tokens`` and stop strings end the row; the cache keeps ``[last] + accepted``; the
policy observes the model's predictions and builds the next draft. Rows live in a
:class:`~megatron_jf.inference.slots.SlotTable`.

Draft width (issue 33): rows with ``draft_width="auto"`` forward, each step, only the part of their draft that pays
-- :func:`~megatron_jf.decoding.width.choose_widths` weighs the engine's measured forward cost
(:meth:`Engine.forward_cost <megatron_jf.inference.engine.Engine.forward_cost>`) against each row's acceptance
statistics -- down to no draft at all (an AR step); ``fixed`` rows, and rows recording a trajectory, forward their
whole draft. What is verified and accepted does not change, only how much is drafted.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import torch

from megatron_jf.decoding import Outcome, accepted_prefix, forward_width, policy_for
from megatron_jf.decoding.width import ForwardCost, RowDraft, choose_widths
from megatron_jf.inference import cost_model, mr_verify
from megatron_jf.inference.request import Request
from megatron_jf.inference.results import GenerationResult
from megatron_jf.inference.runner import ModelRunner
from megatron_jf.inference.sampling import argmax_list, verify
from megatron_jf.inference.slots import SlotTable
from megatron_jf.inference.stops import find_stop


@dataclass(eq=False)
class Row:
    """One request in a batch: its :class:`~megatron_jf.inference.request.Request` (as given to
    :meth:`BatchSession.add`), its policy and policy state, and what it emitted so far."""

    key: int
    prompt: list[int]
    request: Request
    policy: object
    state: object
    eos_ids: frozenset                                # request.eos_ids, or none when it is None
    ctx: list[int]                                    # prompt + out: the committed tokens the policy sees
    slot: int = -1
    out: list[int] = field(default_factory=list)
    sent: int = 0                                     # tokens of `out` passed to on_tokens so far
    done: bool = False
    finish: str = ""
    tail: str = ""
    forwards: int = 0
    accepted: list[int] = field(default_factory=list)
    draft_lens: list[int] = field(default_factory=list)
    draft_accepted: list[int] = field(default_factory=list)
    gen: torch.Generator | None = None
    prefill_s: float = 0.0
    decode_s: float = 0.0
    # this step's proposal
    draft: list[int] = field(default_factory=list)
    cands: list[list[int]] = field(default_factory=list)
    n_main: int = 0


class BatchSession:
    """Continuous batching: rows with their own :class:`~megatron_jf.inference.request.Request` (decode config,
    sampling parameters, ``max_new_tokens``, EOS ids, stop strings) decode together, one forward per :meth:`step`
    for every row.

    A row :meth:`add`-ed between steps is prefilled at the start of the next step and then joins that
    step's decode forward; a row :meth:`remove`-d (e.g. its client disconnected) leaves before the next
    forward. Rows occupy a compact prefix of the KV-cache rows (:class:`~megatron_jf.inference.slots.SlotTable`),
    so a forward covers only the live rows. When rows forward very different numbers of tokens (AR next to MR),
    the step runs as two forwards -- wide rows, then narrow ones -- rather than padding every row to the widest
    (``split_min_saving``). A row's output does not depend on the other rows (shapes are padded per forward), so
    greedy output equals offline :meth:`Engine.generate <megatron_jf.inference.engine.Engine.generate>`, and
    sampled rows draw from their own seeded generator. With ``draft_width="auto"`` the widths follow the batch's
    forward cost, so a row's forwards -- and, when sampling, the tokens it draws (from the same distribution) --
    can differ from its offline run's; greedy tokens cannot.

    Create with :meth:`Engine.open_batch <megatron_jf.inference.engine.Engine.open_batch>`. Not thread-safe: one
    thread calls add/remove/step.
    """

    def __init__(self, engine, capacity: int, *, max_width: int, max_len: int | None, detokenize,
                 split_min_saving: int | None = 256):
        if capacity < 1 or max_width < 1:
            raise ValueError(f"capacity and max_width must be >= 1, got {capacity}, {max_width}")
        self.engine = engine
        self.max_context = engine.max_context
        self.capacity = capacity
        self.max_width = max_width
        self.max_len = max_len or (engine.max_context + max_width + 1)
        self.detokenize = detokenize
        self.split_min_saving = split_min_saving
        self.runner = ModelRunner(engine.model, capacity, self.max_len, options=engine.options)
        self.cache = self.runner.cache
        self.slots = slots = SlotTable(self.cache, capacity, max_context=self.max_context, max_width=max_width,
                                       max_len=self.max_len)
        self._rows = slots.rows
        self._keys = itertools.count()

    # ------------------------------------------------------------------ rows in and out
    @property
    def num_rows(self) -> int:
        """Rows decoding or waiting for their prefill."""
        return self.slots.num_rows

    @property
    def free(self) -> int:
        """Rows that can still be added."""
        return self.slots.free

    def add(self, prompt: list[int], request: Request = Request()) -> int:
        """Queue one request; it joins at the next :meth:`step`. Returns its key (for results and on_tokens).

        Args:
            prompt: token ids (non-empty).
            request: the row's settings (:class:`~megatron_jf.inference.request.Request`), kept as ``Row.request``;
                its :attr:`~megatron_jf.inference.request.Request.row_seed` seeds this row's sampling generator, and
                ``sampling.seed`` with the prompt the draft initialisation.

        Raises:
            ValueError: no free row, an empty prompt, prompt + ``max_new_tokens`` past the context window
                (:class:`~megatron_jf.inference.request.ContextError`), a config wider than ``max_width`` tokens per
                forward, stop strings without a detokenize function, trajectories with a decoder other than
                ``jacobi``.
        """
        self.slots.check(prompt, request, detokenize=self.detokenize)
        policy = policy_for(request.decode)
        state = policy.new_state(prompt, request.sampling.seed, record_trajectory=request.record_trajectory)
        r = Row(key=next(self._keys), prompt=list(prompt), request=request, policy=policy, state=state,
                eos_ids=request.eos_ids or frozenset(), ctx=list(prompt))
        if not request.sampling.greedy:
            r.gen = torch.Generator().manual_seed(request.row_seed)
        self.slots.pending.append(r)
        return r.key

    def remove(self, key: int) -> bool:
        """Drop a row (waiting or decoding) now: it takes no further forward and yields no result.
        Returns False when ``key`` is not in the batch (already finished or removed)."""
        return self.slots.remove(key)

    # ------------------------------------------------------------------ one step
    @torch.no_grad()
    def step(self, on_tokens=None) -> list[tuple[int, GenerationResult]]:
        """Prefill rows added since the last step, then one decode forward for every live row.

        Args:
            on_tokens: optional ``(key, new_token_ids)`` callback for tokens that became final.

        Returns:
            ``(key, GenerationResult)`` for each row that finished in this step (its slot is freed).
        """
        if self.slots.pending:
            self._prefill()
        rows = self._rows
        if not rows:
            return []
        t1 = time.perf_counter()
        m = len(rows)
        seqs = []
        for r in rows:
            p = r.policy.propose(r.state, r.ctx)
            r.draft, r.cands = p.draft, p.candidates
        cost = self._cut_widths(rows)
        for r in rows:
            r.n_main = 1 + len(r.draft)
            seqs.append(_tokens(r))
        a = self._arrange(seqs)
        if a:  # rows moved
            seqs = [_tokens(r) for r in rows]
        for lo, hi in ([(0, a), (a, m)] if a else [(0, m)]):
            self._forward(lo, hi, seqs[lo:hi], on_tokens)
        dt = time.perf_counter() - t1
        for r in rows:
            r.decode_s += dt
        calib = self.engine.step_calibration
        if cost is not None and calib is not None and calib.read_at(m):  # the step against the table's forward
            s = max(len(x) for x in seqs)  # (the slowest TP rank's time: every rank must choose the same widths)
            calib.record(m, s > 1, cost.seconds(m, s), cost_model.agreed_seconds(dt),
                         tokens=sum(r.accepted[-1] for r in rows))
        if self.engine.check_invariants:
            for i, r in enumerate(rows):  # the cache holds prompt + emitted tokens, all but the newest one
                want = len(r.prompt) + len(r.out) - 1
                if int(self.cache.lengths[i]) != want and not r.done:
                    raise AssertionError(f"row {r.key}: cache length {int(self.cache.lengths[i])} != {want}")
        finished = []
        for i in range(len(rows) - 1, -1, -1):
            r = rows[i]
            if r.done:
                r.policy.finish(r.state, r.out)
                finished.append((r.key, GenerationResult(
                    tokens=r.out, finish_reason=r.finish, forwards=r.forwards, accepted=r.accepted,
                    prefill_s=r.prefill_s, decode_s=r.decode_s, prompt_len=len(r.prompt),
                    trajectory=getattr(r.state, "traj", None), tail_text=r.tail, draft_lens=r.draft_lens,
                    draft_accepted=r.draft_accepted, batch_size=m)))
                self.slots.release(i)
        finished.reverse()
        return finished

    def _prefill(self) -> None:
        new, self.slots.pending = self.slots.pending, []
        dt = self.runner.prefill([r.prompt for r in new], len(self._rows))
        for r in new:
            r.prefill_s = dt
        self.slots.place(new)

    def _cut_widths(self, rows: list[Row]) -> ForwardCost | None:
        """Cut the drafts of ``draft_width="auto"`` rows (and their candidates) to this step's widths
        (:func:`~megatron_jf.decoding.width.choose_widths` over the engine's forward cost, its step calibration and
        each row's acceptance statistics); other rows forward their whole draft, and count as such in the forward's
        length. Returns the cost table used (None when no auto row had a draft)."""
        auto = [r.request.decode.draft_width == "auto" and getattr(r.state, "traj", None) is None for r in rows]
        if not any(a and r.draft for a, r in zip(auto, rows)):
            return None
        cost = self.engine.forward_cost(len(rows), self.max_width)
        calib = self.engine.step_calibration
        tree = self.runner.mr_verify == "tree"
        specs = []
        for r, a in zip(rows, auto):
            branches = [len(c) for c in r.cands] if tree else ()
            probs = r.policy.draft_probs(r.state) if a else [0.0] * len(r.draft)
            specs.append(RowDraft(probs[: len(r.draft)], branches, fixed=not a))
        penalty = calib.penalty(len(rows)) if calib is not None else 1.0
        for r, a, w in zip(rows, auto, choose_widths(cost, specs, draft_penalty=penalty)):
            if a and w < len(r.draft):
                r.draft = r.draft[:w]
                r.cands = [c[:w] for c in r.cands] if w else []
        return cost

    def _arrange(self, seqs: list[list[int]]) -> int:
        """Split the step into two forwards when rows forward very different numbers of tokens (e.g. AR
        next to MR): rows are reordered (KV rows swapped) so the wide ones come first. Returns the number
        of wide rows, or 0 for one forward. A row is narrow when its config's width (tokens per forward)
        is at most a quarter of the widest live config's; the split is taken when it saves at least
        ``split_min_saving`` padded tokens."""
        m = len(self._rows)
        if self.split_min_saving is None or m < 2:
            return 0
        ws = [forward_width(r.request.decode) for r in self._rows]
        wmax = max(ws)
        narrow = [4 * w <= wmax for w in ws]
        n_wide = m - sum(narrow)
        if n_wide in (0, m):
            return 0
        lens = [len(x) for x in seqs]
        s_w = max(n for n, nr in zip(lens, narrow) if not nr)
        s_n = max(n for n, nr in zip(lens, narrow) if nr)
        if m * max(s_w, s_n) - (n_wide * s_w + (m - n_wide) * s_n) < self.split_min_saving:
            return 0
        i, j = 0, m - 1
        while True:  # partition: wide rows to the front
            while i < m and not narrow[i]:
                i += 1
            while j >= 0 and narrow[j]:
                j -= 1
            if i >= j:
                break
            self._swap(i, j)
            narrow[i], narrow[j] = narrow[j], narrow[i]
        return n_wide

    def _swap(self, i: int, j: int) -> None:
        self.slots.swap(i, j)

    def _forward(self, lo: int, hi: int, seqs: list[list[int]], on_tokens) -> None:
        """One decode forward for rows ``[lo, hi)`` (their drafts and candidates in ``seqs``), then verification
        and the KV commit of each. MR candidates are verified as :mod:`~megatron_jf.inference.mr_verify` says: in
        the same forward (``tree``) or, after the main chains, in a second pass over only the candidates that can
        still win (``pruned``; rows of ``draft_width="auto"`` run none)."""
        rows = self._rows[lo:hi]
        runner = self.runner
        any_cands = any(r.cands for r in rows)
        pruned = any_cands and runner.mr_verify == "pruned"
        if pruned:
            seqs = [x[: r.n_main] for r, x in zip(rows, seqs)]  # pass 1: the main chains
        s = max(len(x) for x in seqs)
        bases, n_mains, cand_lens = [], [], []
        for r in rows:
            bases.append(len(r.ctx) - 1)
            n_mains.append(r.n_main)
            cand_lens.append(list(map(len, r.cands)))
        logits, view = runner.decode(lo, hi, seqs, bases, n_mains, cand_lens, tree=any_cands and not pruned)
        keep = []
        for i, r in enumerate(rows):
            main = logits[i, : r.n_main]  # row j predicts draft[j]; the last row predicts past the draft
            g = argmax_list(main)
            k_main = accepted_prefix(r.draft, g)
            best = None
            if r.cands and not pruned:
                best = mr_verify.best_in_tree(main, g, k_main, logits[i], r.cands, r.n_main)
            elif r.cands and r.request.decode.draft_width != "auto":  # (auto: no second pass, mr_verify's docstring)
                live = mr_verify.live_candidates(r.draft, g, k_main, r.cands)
                if live:
                    best, _ = runner.second_pass(view, i, base=len(r.ctx) - 1, block=s, main_logits=main, g=g,
                                                 k_main=k_main, live=live)
            keep.append(self._update(r, main, g, k_main, best, on_tokens))
        view.commit(keep)

    def _update(self, r: Row, main: torch.Tensor, g: list[int], k_main: int, best, on_tokens):
        """Verify this row's winning branch, emit tokens, stop on EOS / length / stop strings, let the policy
        build the next draft. ``main``: logits ``[n_main, V]`` of ``[last] + draft`` (``g`` their argmax,
        ``k_main`` the draft's greedy match); ``best``: the winning recycled candidate
        (:class:`~megatron_jf.inference.mr_verify.Branch`) or None for the draft. Returns the row's
        ``KVCache.commit`` entry: a count (prefix of this forward's tokens) or slot indices."""
        greedy = r.request.sampling.greedy  # greedy verification needs only the argmax, computed once already
        if best is None:
            emitted = r.draft[:k_main] + [g[k_main]] if greedy else verify(r.draft, main, r.request.sampling, r.gen)
            slots = None
        else:
            emitted = (best.tokens[:best.matched] + [best.next_token] if greedy
                       else verify(best.tokens, best.logits, r.request.sampling, r.gen))
            slots = best.slots
        from_draft = len(emitted) - 1
        finish = ""
        for j, t in enumerate(emitted):
            if t in r.eos_ids:
                emitted, finish = emitted[: j + 1], "eos"
                break
        room = r.request.max_new_tokens - len(r.out)
        if len(emitted) > room:
            emitted = emitted[:room]
            finish = "eos" if emitted and emitted[-1] in r.eos_ids else "length"
        elif len(emitted) == room and not finish:
            finish = "length"
        prev_len = len(r.out)
        r.out.extend(emitted)
        r.ctx.extend(emitted)
        safe = len(r.out)
        if r.request.stop_strings:
            cut, tail, safe = find_stop(r.out, r.sent, r.request.stop_strings, self.detokenize)
            if cut is not None:
                del r.out[cut:]
                r.tail, finish, safe = tail, "stop", cut
                emitted = r.out[prev_len:]
                if cut < prev_len:  # the stop string began in an earlier forward's tokens: uncount them
                    total = 0
                    for j, a in enumerate(r.accepted):
                        r.accepted[j] = min(a, cut - total)
                        total += r.accepted[j]
            elif finish:
                safe = len(r.out)  # nothing can follow: whatever was held back is final
        r.forwards += 1
        r.accepted.append(len(emitted))
        r.draft_lens.append(len(r.draft) if best is None else len(best.tokens))
        r.draft_accepted.append(min(from_draft, len(emitted)))
        if on_tokens is not None and safe > r.sent:
            on_tokens(r.key, r.out[r.sent:safe])
        r.sent = max(r.sent, safe)
        # keep `last` and the emitted tokens before the new `last` (which is forwarded next time)
        keep = len(emitted) if slots is None else slots[: len(emitted)]
        if finish:
            r.done, r.finish = True, finish
            return keep
        winner = None if best is None else next(j for j, c in enumerate(r.cands) if c is best.tokens)
        r.policy.observe(r.state, r.ctx, Outcome(g, emitted, from_draft, winner))
        return keep


def _tokens(r: Row) -> list[int]:
    """What row ``r`` forwards this step: ``[last] + draft``, then its recycled candidates back to back."""
    seq = [r.ctx[-1]] + r.draft
    for c in r.cands:
        seq += c
    return seq
