"""Multi-block decoding with rejection recycling ("MR", paper Sec. 3.2, Algorithm 1).

Up to ``K`` blocks of ``n`` tokens are in flight: the real-active (RA) block, whose accepted tokens are the
output, and pseudo-active blocks after it that are drafted on its unverified tokens. The main chain's draft is
the blocks' drafts back to back (the RA block's unknown tokens, then each pseudo-active block's ``n``). Each
step maps onto Algorithm 1 (step numbers of the walk-through, seed text Sec. 3.4.6):

* step 1, initialisation -- :meth:`MRPolicy.new_state`: the RA block gets ``n`` random draft tokens;
* step 2, forward pass -- the engine forwards ``[last] + draft`` and the candidates of :meth:`MRPolicy.propose`;
* step 3, verification with rejection recycling -- the engine accepts the longest greedy-matching prefix of the
  draft or of a recycled candidate (:meth:`MRPolicy.candidates`: n-grams from the pool whose first token is
  ``last``, best first), whichever is longer (the draft on ties); EOS stops the request;
* step 4, tail update -- :meth:`MRPolicy.observe`: every unverified draft position takes the model's prediction
  from this forward (the Jacobi update), shifted past the emitted tokens; the rejected tail goes to the pool;
* step 5, cache management -- the engine keeps ``[last] + emitted`` in the KV cache;
* step 6, spawning -- :meth:`MRPolicy.observe`: when the newest block has ``ceil(r*n)`` stable tokens (RA: accepted;
  pseudo-active: leading tokens the model reproduced) and fewer than ``K`` blocks are in flight, a new block of
  ``n`` starts after it (seeded with the prediction just past the draft);
* step 7, promotion -- :meth:`MRPolicy.observe`: a block whose end the output passed retires; the next block in
  flight becomes the RA block and its carried draft is verified from its first token.

Engines without tree verification (one linear draft per step, e.g. vLLM) use ``MRPolicy(cfg, linear=True)``:
the blocks are still drafted as one chain, and the best pool candidate, when there is one, replaces the RA part
of the draft before verification (:meth:`MRPolicy.propose`) -- one candidate chosen before verification instead
of the tree's best after it; still lossless, since whatever is drafted is verified.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_jf.decoding.base import DraftState, Outcome, Policy, Proposal, accepted_prefix, draft_rng
from megatron_jf.decoding.ngram_pool import NGramPool


@dataclass(eq=False)
class MRState(DraftState):
    """MR state.

    Attributes:
        blocks: output indices where the blocks in flight end, RA first (each a multiple of ``n`` past the
            previous one).
        pool: the request's n-gram pool (persists across blocks).
        candidates: the candidates of the last :meth:`MRPolicy.propose` (the engine's ``winner`` indexes them).
    """

    blocks: list[int] = None
    pool: NGramPool = None
    candidates: list[list[int]] = None


class MRPolicy(Policy):
    """Multi-block decoding + rejection recycling (module docstring).

    Args:
        cfg: the decode config (``block_size`` n, ``num_blocks`` K, ``spawn_threshold`` r, ``verification_size``
            v, ``ngram_pool_size``).
        linear: propose one linear draft (the best pool candidate substituted for the RA part) instead of a draft
            plus candidates (for verifiers without tree verification).
    """

    def __init__(self, cfg, linear: bool = False):
        super().__init__(cfg)
        self.linear = linear
        self.spawn_at = math.ceil(cfg.spawn_threshold * cfg.block_size)

    def _new_state(self, prompt: list[int], seed: int) -> MRState:
        """Algorithm 1 step 1: one RA block of ``n`` random draft tokens, an empty pool."""
        st = MRState(len(prompt), [], draft_rng(prompt, seed), blocks=[self.n],
                     pool=NGramPool(ngram_len=self.n, max_per_key=self.cfg.ngram_pool_size), candidates=[])
        st.draft = self.init(st, prompt, self.n)
        return st

    def candidates(self, state: MRState, context: list[int]) -> list[list[int]]:
        """Rejection recycling's candidates for this step (Algorithm 1 step 3): up to ``v - 1`` pool n-grams that
        continue ``context[-1]`` (those whose recorded preceding token equals ``context[-2]`` first, then newest
        first; the draft itself excluded), each cut or padded with the draft to the RA block's unknown length."""
        v = self.cfg.verification_size
        draft = state.draft
        if v <= 1 or not draft:
            return []
        ra_len = min(len(draft), state.blocks[0] - (len(context) - state.prompt_len))
        if ra_len <= 0:
            return []
        prev = context[-2] if len(context) >= 2 else -1
        out = []
        for c in state.pool.candidates(prev, context[-1], v - 1, exclude=tuple(draft[:ra_len])):
            c = c[:ra_len]
            out.append(c + draft[len(c):ra_len])
        return out

    def propose(self, state: MRState, context: list[int]) -> Proposal:
        """The blocks' drafts as one main chain and the recycled candidates for the RA block; with ``linear``, the
        best candidate substituted for the RA part of the draft and no candidates."""
        cands = self.candidates(state, context)
        if self.linear:
            if cands:
                ra_len = len(cands[0])
                state.draft = cands[0] + state.draft[ra_len:]
            cands = []
        state.candidates = cands
        return Proposal(state.draft, cands)

    def observe(self, state: MRState, context: list[int], outcome: Outcome) -> None:
        """Algorithm 1 steps 4, 6 and 7: recycle the rejected tail, Jacobi-update the blocks in flight, retire
        completed ones, maybe spawn a pseudo-active block."""
        n, P = self.n, state.prompt_len
        g = outcome.predictions
        e = len(context) - P  # output tokens after this step
        shift = len(outcome.emitted)
        old_e = e - shift
        old_draft = state.draft  # old_draft[j] guessed output index old_e + j; g[j] is this forward's prediction
        # positions this forward predicted: the whole draft, or a prefix when a linear verifier checked only part of
        # it (vLLM: its token budget, max_model_len, structured output, preemption); the rest keep their guesses
        checked = min(len(old_draft), len(g))
        k_main = accepted_prefix(old_draft, g)
        if k_main < checked:  # step 3's rejected tail feeds the n-gram pool
            state.pool.add_rejected(old_draft[k_main - 1] if k_main else context[P + old_e - 1], old_draft[k_main:])
        blocks = [b for b in state.blocks if b > e]  # step 7: blocks the output passed retire
        spare = g[len(old_draft)] if blocks and blocks[-1] == state.blocks[-1] and len(g) > len(old_draft) else None
        if not blocks:
            blocks = [(e // n + 1) * n]
        total = blocks[-1] - e
        # step 4: the Jacobi update, past the emitted tokens
        nxt = (g[shift: len(old_draft)] + old_draft[len(g):])[:total]
        state.draft = nxt + self.init(state, context, total - len(nxt))
        state.blocks = blocks
        if len(blocks) >= self.cfg.num_blocks:
            return
        start = blocks[-1] - n
        if len(blocks) == 1:
            stable = e - start  # RA block: tokens already accepted
        else:  # pseudo-active block: leading tokens the model reproduced this forward
            lo = start - old_e
            stable = 0
            while lo + stable < checked and old_draft[lo + stable] == g[lo + stable]:
                stable += 1
        if stable >= self.spawn_at:  # step 6: spawn a pseudo-active block after the newest one
            head = [spare] if spare is not None else []
            state.draft = state.draft + (head + self.init(state, context, n - len(head)))[:n]
            state.blocks.append(blocks[-1] + n)
