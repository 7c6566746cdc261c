"""Multi-block decoding with rejection recycling ("MR", paper Sec. 3.2, Algorithm 1), with context n-grams.

Up to ``K`` blocks of ``n`` tokens are in flight: the real-active (RA) block, whose accepted tokens are the
output, and pseudo-active blocks after it that are drafted on its unverified tokens. The main chain's draft is
the blocks' drafts back to back (the RA block's unknown tokens, then each pseudo-active block's ``n``). Each
step maps onto Algorithm 1 (step numbers of the walk-through, seed text Sec. 3.4.6):

* step 1, initialisation -- :meth:`MRPolicy.new_state`: the RA block gets ``n`` random draft tokens;
* step 2, forward pass -- the engine forwards ``[last] + draft`` and the candidates of :meth:`MRPolicy.propose`;
* step 3, verification with rejection recycling -- the engine accepts the longest greedy-matching prefix of the
  draft or of a candidate (:meth:`MRPolicy.candidates`: continuations of ``last`` from the pool, best first),
  whichever is longer (the draft on ties); EOS stops the request;
* step 4, tail update -- :meth:`MRPolicy.update`: every unverified draft position takes the model's prediction
  from this forward (the Jacobi update), shifted past the emitted tokens; the rejected tail goes to the pool;
* step 5, cache management -- the engine keeps ``[last] + emitted`` in the KV cache;
* step 6, spawning -- :meth:`MRPolicy.update`: when the newest block has ``ceil(r*n)`` stable tokens (RA: accepted;
  pseudo-active: leading tokens the model reproduced) and fewer than ``K`` blocks are in flight, a new block of
  ``n`` starts after it (seeded with the prediction just past it);
* step 7, promotion -- :meth:`MRPolicy.update`: a block whose end the output passed retires; the next block in
  flight becomes the RA block and its carried draft is verified from its first token.

The pool (:mod:`megatron_jf.decoding.ngram_pool`) holds the rejected n-grams and, with ``prompt_lookup_max > 0``,
context n-grams: what followed earlier occurrences of ``last`` in the prompt and the output (prompt lookup). They
are ranked together by how many committed tokens their context matches (context before recycled on ties).

Which candidate leads the draft. With ``draft_width="auto"`` the best-ranked candidate replaces the head of the
draft when the request's statistics (:class:`~megatron_jf.decoding.width.AcceptanceStats`) expect more accepted
tokens from it than from the Jacobi draft -- a context n-gram may run past the RA block, up to ``K*n`` tokens --
and the displaced Jacobi guesses become a candidate; the engine then cuts the draft to the width that pays. The
Jacobi draft's statistics are kept apart where the text copies its context (an earlier occurrence matches the last
:data:`COPY_MATCH` or more committed tokens): there the draft, made from predictions on copied text, often agrees
with the copy and is credited as a candidate next to it, which said nothing of the draft where nothing is copied
(SmolLM2-135M on HumanEval chat prompts: Jacobi-led drafting steps of widths 2-7 accepted 0.04-0.11 tokens
against 0.13-0.97 expected). Engines
without tree verification (one linear draft per step, e.g. vLLM) use ``MRPolicy(cfg, linear=True)``: no other
candidates, and with ``draft_width="fixed"`` the best candidate, when there is one, always leads. Whatever is drafted
is verified, so every choice is lossless.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_jf.decoding.base import DraftState, Outcome, Policy, Proposal, accepted_prefix, draft_rng, jacobi_update
from megatron_jf.decoding.ngram_pool import ContextNGrams, NGramPool
from megatron_jf.decoding.width import context_source, expected_accepted

#: The longest context match (committed tokens ending at an earlier occurrence of the newest one that equal those
#: ending at it) from which MR counts a step as copying the context: the Jacobi draft's statistics are then kept as
#: ``draft@context`` (module docstring). Not from the paper (its MR drafts fixed widths and keeps no statistics): it
#: steers only the auto width and which candidate leads, never what is accepted. 2 instead: SmolLM2 +1 %, the
#: quickstart JF model -2 to -5 % (``docs/results.md``).
COPY_MATCH = 3


@dataclass(eq=False)
class MRState(DraftState):
    """MR state.

    Attributes:
        blocks: output indices where the blocks in flight end, RA first (each a multiple of ``n`` past the
            previous one).
        pool: the request's n-gram pool of rejected drafts (persists across blocks).
        candidates: the candidates of the last :meth:`MRPolicy.propose` (the engine's ``winner`` indexes them).
        context: the request's context n-gram index (None with prompt lookup off).
        cand_segments: per candidate, its sources ``[(source, length), ...]`` (as ``segments`` for the draft).
        copying: the last :meth:`MRPolicy.ranked` found a context match of :data:`COPY_MATCH` or more tokens (the
            Jacobi draft's source is then ``draft@context``, else ``draft``).
    """

    blocks: list[int] = None
    pool: NGramPool = None
    candidates: list[list[int]] = None
    context: ContextNGrams | None = None
    cand_segments: list = None
    copying: bool = False


class MRPolicy(Policy):
    """Multi-block decoding + rejection recycling + context n-grams (module docstring).

    Args:
        cfg: the decode config (``block_size`` n, ``num_blocks`` K, ``spawn_threshold`` r, ``verification_size``
            v, ``ngram_pool_size``, ``prompt_lookup_min`` / ``prompt_lookup_max``, ``draft_width``).
        linear: propose one linear draft (a candidate may lead it) and no candidates (for verifiers without tree
            verification).
    """

    def __init__(self, cfg, linear: bool = False):
        super().__init__(cfg)
        self.linear = linear
        self.auto = cfg.draft_width == "auto"
        self.spawn_at = math.ceil(cfg.spawn_threshold * cfg.block_size)
        self.max_main = cfg.num_blocks * cfg.block_size  # the longest main chain (forward_width's K*n)

    def _new_state(self, prompt: list[int], seed: int) -> MRState:
        """Algorithm 1 step 1: one RA block of ``n`` random draft tokens, an empty pool."""
        cfg = self.cfg
        ctx = ContextNGrams(cfg.prompt_lookup_min, cfg.prompt_lookup_max) if cfg.prompt_lookup_max > 0 else None
        st = MRState(len(prompt), [], draft_rng(prompt, seed), blocks=[self.n],
                     pool=NGramPool(ngram_len=self.n, max_per_key=cfg.ngram_pool_size), candidates=[], context=ctx,
                     cand_segments=[])
        st.draft = self.init(st, prompt, self.n)
        return st

    def _ra_len(self, state: MRState, context: list[int]) -> int:
        """Unknown tokens of the RA block covered by the draft."""
        return min(len(state.draft), state.blocks[0] - (len(context) - state.prompt_len))

    def ranked(self, state: MRState, context: list[int]) -> list[tuple[list[int], str]]:
        """The pool's continuations of ``context[-1]``, best first, as ``(tokens, source)``: up to ``v - 1`` context
        n-grams (``context1..3`` by match; at most ``K*n`` tokens) and ``v - 1`` recycled n-grams (``pool``),
        ordered by how many committed tokens their context matches (context n-grams before recycled ones on ties,
        each source keeping its own order), the ones equal to the draft's RA part left out."""
        v = self.cfg.verification_size
        draft = state.draft
        state.copying = False
        if v <= 1 or not draft:
            return []
        ra_len = self._ra_len(state, context)
        if ra_len <= 0:
            return []
        exclude = tuple(draft[:ra_len])
        found = []
        if state.context is not None:
            found += [(c, m, context_source(m))
                      for c, m in state.context.candidates(context, v - 1, self.max_main, exclude=exclude)]
            state.copying = state.context.longest >= COPY_MATCH
        prev = context[-2] if len(context) >= 2 else -1
        found += [(c, m, "pool") for c, m in state.pool.candidates(prev, context[-1], v - 1, exclude=exclude)]
        found.sort(key=lambda x: -x[1])  # stable
        out, seen = [], set()
        for c, _, src in found:
            key = tuple(c[:ra_len])
            if key not in seen:
                seen.add(key)
                out.append((c, src))
        return out

    def candidates(self, state: MRState, context: list[int]) -> list[list[int]]:
        """Algorithm 1 step 3's candidates for this step: the first ``v - 1`` of :meth:`ranked`, each cut or padded
        with the draft to the RA block's unknown length (tree branches next to the draft)."""
        ra_len = self._ra_len(state, context) if state.draft else 0
        top = self.ranked(state, context)[: self.cfg.verification_size - 1]
        return [self._branch(c, state.draft, ra_len) for c, _ in top]

    @staticmethod
    def _branch(c: list[int], draft: list[int], ra_len: int) -> list[int]:
        c = c[:ra_len]
        return c + draft[len(c):ra_len]

    def propose(self, state: MRState, context: list[int]) -> Proposal:
        """The blocks' drafts as one main chain, led by the best candidate where that is expected to accept more
        (``auto``; ``linear`` with ``fixed``: whenever there is one), and the other candidates for the RA block (none
        with ``linear``)."""
        ranked = self.ranked(state, context)
        jac = state.draft
        own = "draft@context" if state.copying else "draft"  # the Jacobi draft's statistics in this regime
        state.segments = [(own, len(jac))]
        state.probs = None
        demoted = None
        if ranked and (self.linear or self.auto):
            c, src = ranked[0]
            c = c[: self.max_main]
            segs = [(src, len(c))] + ([(own, len(jac) - len(c))] if len(jac) > len(c) else [])
            lead = self.linear and not self.auto
            if not lead:  # (the chosen draft's estimates are kept for draft_probs)
                chain, own_chain = state.stats.chain_probs(segs), state.stats.chain_probs(state.segments)
                lead = expected_accepted(chain)[-1] > expected_accepted(own_chain)[-1]
                state.probs = chain if lead else own_chain
            if lead:
                demoted = jac[: self._ra_len(state, context)]
                state.draft, state.segments = c + jac[len(c):], segs
                ranked = ranked[1:]
        cands, csegs = [], []
        if not self.linear:
            ra_len = self._ra_len(state, context)
            pool = ranked + ([(demoted, own)] if demoted else [])
            for c, src in pool[: self.cfg.verification_size - 1]:
                b = self._branch(c, jac, ra_len)
                k = min(len(c), ra_len)
                cands.append(b)
                csegs.append([(src, k)] + ([(own, len(b) - k)] if len(b) > k else []))
        state.candidates, state.cand_segments = cands, csegs
        return Proposal(state.draft, cands)

    def record(self, state: MRState, outcome: Outcome) -> None:
        """The draft's statistics (:meth:`Policy.record`) and the candidates': the winner's accepted count; for the
        others the greedy match where this forward's predictions apply to them (up to where they part from the
        draft), a candidate that agreed with the prediction there counted as accepted so far (no rejection seen)."""
        super().record(state, outcome)
        w = len(outcome.predictions) - 1
        if w < 0 or not state.candidates:
            return
        if w == 0:  # an AR step: each candidate's first token against the step's token, as the draft's
            for c, segs in zip(state.candidates, state.cand_segments):
                if c:
                    state.stats.record_chain(segs, 1, int(c[0] == outcome.emitted[0]))
            return
        g, main = outcome.predictions, state.draft[:w]
        for i, (c, segs) in enumerate(zip(state.candidates, state.cand_segments)):
            c = c[:w]
            if outcome.winner == i:
                state.stats.record_chain(segs, len(c), min(outcome.from_draft, len(c)))
                continue
            d, m = accepted_prefix(c, main), accepted_prefix(c, g)
            if m <= d:
                state.stats.record_chain(segs, min(m + 1, len(c)), m)
            else:
                state.stats.record_chain(segs, d + 1, d + 1)

    def update(self, state: MRState, context: list[int], outcome: Outcome) -> None:
        """Algorithm 1 steps 4, 6 and 7: recycle the rejected tail, Jacobi-update the blocks in flight (positions the
        forward did not verify keep their guesses), retire completed ones, maybe spawn a pseudo-active block."""
        n, P = self.n, state.prompt_len
        g = outcome.predictions
        e = len(context) - P  # output tokens after this step
        shift = len(outcome.emitted)
        old_e = e - shift
        old_draft = state.draft  # old_draft[j] guessed output index old_e + j; g[j] is this forward's prediction
        w = len(g) - 1  # draft tokens this forward verified
        upd = jacobi_update(old_draft, g)
        k_main = accepted_prefix(old_draft[:w], g)
        if k_main < w:  # step 3's rejected tail feeds the n-gram pool
            state.pool.add_rejected(old_draft[k_main - 1] if k_main else context[P + old_e - 1], old_draft[k_main:w])
        blocks = [b for b in state.blocks if b > e]  # step 7: blocks the output passed retire
        after = state.blocks[-1] - old_e  # draft index just past the newest block
        spare = upd[after] if blocks and blocks[-1] == state.blocks[-1] and after < len(upd) else None
        if not blocks:
            blocks = [(e // n + 1) * n]
        total = blocks[-1] - e
        nxt = upd[shift: len(old_draft)][:total]  # step 4: the Jacobi update, past the emitted tokens
        state.draft = nxt + self.init(state, context, total - len(nxt))
        state.blocks = blocks
        if len(blocks) >= self.cfg.num_blocks:
            return
        start = blocks[-1] - n
        if len(blocks) == 1:
            stable = e - start  # RA block: tokens already accepted
        else:  # pseudo-active block: leading tokens the model reproduced this forward
            lo = start - old_e
            end = min(len(old_draft), len(g), lo + n)
            stable = 0
            while lo + stable < end and old_draft[lo + stable] == g[lo + stable]:
                stable += 1
        if stable >= self.spawn_at:  # step 6: spawn a pseudo-active block after the newest one
            head = [spare] if spare is not None else []
            state.draft = state.draft + (head + self.init(state, context, n - len(head)))[:n]
            state.blocks.append(blocks[-1] + n)
