"""What every drafting policy shares: the step's records, greedy acceptance, draft initialisation, the Jacobi
update of a draft verified in part, each request's acceptance statistics, the policy interface (paper Sec. 2.1
Jacobi decoding; Algorithm 1 step 1, initialisation, step 3, verification, and step 4, the update).

Pure Python, standard library only. Token ids are ``int``; sequences are ``list[int]``.
"""

from __future__ import annotations

import random
import struct
import zlib
from dataclasses import dataclass, field

from megatron_jf.decoding.width import AcceptanceStats


@dataclass
class Proposal:
    """What a policy asks the verifier to check in one step.

    Attributes:
        draft: the main chain's draft tokens ``d_0..d_{m-1}`` (m >= 0). The verifier forwards
            ``[context[-1]] + draft``; position ``j`` of that forward predicts ``draft[j]``, position ``m``
            the token after the whole draft (``m + 1`` predictions).
        candidates: recycled n-gram candidates (MR's rejection recycling, paper Sec. 3.2): each a
            continuation of ``context[-1]`` verified next to the draft (a tree branch sharing ``context[-1]``);
            the branch with the longest greedy match wins, the draft on ties. Empty for every other decoder.
    """

    draft: list[int]
    candidates: list[list[int]] = field(default_factory=list)


@dataclass
class Outcome:
    """What the verifier reports back after one step (before any stop condition ended the request).

    Attributes:
        predictions: g, the target's greedy (argmax) token at each of the ``len(draft) + 1`` positions of the
            proposal's main chain (``g[j]`` predicts ``draft[j]``; ``g[-1]`` is the bonus position). Greedy even
            when the verifier samples: the Jacobi update always takes the model's argmax.
        emitted: the tokens committed this step, in order: the accepted prefix of the winning branch and one
            more (correction or bonus) token; at least one.
        from_draft: how many of ``emitted`` came from the winning branch (``len(emitted) - 1``).
        winner: None when the draft won, else the index into ``Proposal.candidates`` of the winning candidate.
    """

    predictions: list[int]
    emitted: list[int]
    from_draft: int
    winner: int | None = None


def accepted_prefix(draft: list[int], g: list[int]) -> int:
    """Greedy acceptance (paper Sec. 2.1; Algorithm 1 step 3): the length ``k`` of the longest prefix with
    ``draft[j] == g[j]`` for every ``j < k`` (``g[j]`` is the greedy prediction for ``draft[j]``)."""
    k = 0
    n = min(len(draft), len(g))
    while k < n and draft[k] == g[k]:
        k += 1
    return k


def jacobi_update(draft: list[int], g: list[int]) -> list[int]:
    """The draft's positions after a forward that verified its first ``len(g) - 1`` tokens (all of them, or fewer
    when the width was cut -- :mod:`megatron_jf.decoding.width` -- or vLLM verified fewer): position ``j`` takes the
    model's prediction ``g[j]`` where the forward made one (``j < len(g)``: the Jacobi update, Algorithm 1 step 4)
    and keeps its guess ``draft[j]`` past it. Length ``max(len(draft), len(g))``."""
    return g + draft[len(g):] if len(g) < len(draft) else list(g)


def draft_rng(prompt: list[int], seed: int) -> random.Random:
    """The request's draft-initialisation generator: seeded by ``seed`` and the prompt only, so a request's
    drafts do not depend on the batch (or the engine) it runs in."""
    return random.Random(zlib.crc32(struct.pack(f"<q{len(prompt)}q", seed, *prompt)))


@dataclass(eq=False)
class DraftState:
    """Per-request state every policy keeps (subclasses add their own fields).

    Attributes:
        prompt_len: P, tokens of the prompt (output index ``i`` is context index ``P + i``).
        draft: the draft for the next step (what :meth:`Policy.propose` returns).
        rng: the draft-initialisation generator (:func:`draft_rng`).
        stats: the request's acceptance by draft position and source
            (:class:`~megatron_jf.decoding.width.AcceptanceStats`).
        segments: where the last proposal's draft came from, ``[(source, length), ...]`` back to back (the
            decoder's own draft is ``draft``).
        probs: the last proposal's :meth:`Policy.draft_probs` where the proposal already computed them, else None.
    """

    prompt_len: int
    draft: list[int]
    rng: random.Random
    stats: AcceptanceStats = field(default_factory=AcceptanceStats)
    segments: list = field(default_factory=list)
    probs: list | None = None


class Policy:
    """A drafting policy: the decoder's rule for the next draft, given what verification found.

    An engine holds one policy per :class:`~megatron_jf.decoding.config.DecodeConfig` (stateless, shared by
    every request with that config) and one state per request::

        state = policy.new_state(prompt, seed)
        while not finished:
            p = policy.propose(state, context)          # context: prompt + output so far (committed tokens)
            ... forward [context[-1]] + p.draft (+ p.candidates), verify, emit, stop on EOS / length / stop string
            if not finished:
                policy.observe(state, context_after, Outcome(g, emitted, from_draft, winner))

    Args:
        cfg: the decode config (its ``decoder`` names the policy; see :func:`~megatron_jf.decoding.policy_for`).
    """

    def __init__(self, cfg):
        self.cfg = cfg
        self.n = cfg.block_size
        self.repeat = cfg.draft_init == "repeat"

    def new_state(self, prompt: list[int], seed: int, *, record_trajectory: bool = False) -> DraftState:
        """The request's state, with its first draft (Algorithm 1 step 1: a random block of ``n`` tokens).

        Raises:
            ValueError: an empty prompt, or ``record_trajectory`` for a policy that records none (only Jacobi does).
        """
        if not prompt:
            raise ValueError("the prompt is empty")
        if record_trajectory:
            raise ValueError("trajectories are recorded by the 'jacobi' decoder")
        return self._new_state(list(prompt), seed)

    def _new_state(self, prompt: list[int], seed: int) -> DraftState:
        st = DraftState(len(prompt), [], draft_rng(prompt, seed))
        st.draft = self.init(st, prompt, self.n)
        return st

    def init(self, state: DraftState, context: list[int], k: int) -> list[int]:
        """``k`` fresh draft tokens for unknown positions: ``context`` draws ``k`` tokens uniformly (with
        replacement) from ``context`` (prompt + output, as the paper's trajectories are initialised), using the
        request's generator; ``repeat`` repeats ``context[-1]``."""
        if k <= 0:
            return []
        if self.repeat:
            return [context[-1]] * k
        rnd = state.rng.randrange
        L = len(context)
        return [context[rnd(L)] for _ in range(k)]

    def propose(self, state: DraftState, context: list[int]) -> Proposal:
        """This step's proposal: the current draft (no candidates)."""
        state.segments, state.probs = [("draft", len(state.draft))], None
        return Proposal(state.draft)

    def draft_probs(self, state: DraftState) -> list[float]:
        """Estimated conditional acceptance of each position of the last proposal's draft (from the request's
        statistics by source and position; :meth:`AcceptanceStats.chain_probs`): what the width choice weighs."""
        return state.probs if state.probs is not None else state.stats.chain_probs(state.segments)

    def observe(self, state: DraftState, context: list[int], outcome: Outcome) -> None:
        """Update ``state`` after a step that did not end the request: record how much of the verified draft was
        accepted (:meth:`record`), then the decoder's own update (:meth:`update`). ``context``: prompt + output,
        the step's emitted tokens included. The forward may have verified fewer draft tokens than proposed
        (``len(outcome.predictions) - 1`` of them: a width cut or vLLM's budget); the rest keep their guesses."""
        self.record(state, outcome)
        self.update(state, context, outcome)

    def record(self, state: DraftState, outcome: Outcome) -> None:
        """Add this step to the request's acceptance statistics: the draft's verified part by source (its greedy
        match, or the speculative rule's count when the draft won). After a step that verified none of it (the
        width choice made it an AR step), whether its first token equals the step's token: the very event by
        which a forwarded draft's first position is accepted, known without forwarding it -- a request whose
        first drafts failed would otherwise stay AR to its end, its estimates never revised. (After several AR steps
        the decoder's own draft is guesses no forward has refined: this is what drafting them now would show, not
        what a refined draft would; MR's context and recycled n-grams are the same either way. Not from the paper,
        whose widths are fixed: it serves the on-line width choice, :mod:`megatron_jf.decoding.width`.)"""
        w = len(outcome.predictions) - 1
        if not state.segments:
            return
        if w <= 0:
            if w == 0 and state.draft:
                state.stats.record_chain(state.segments, 1, int(state.draft[0] == outcome.emitted[0]))
            return
        k = outcome.from_draft if outcome.winner is None else accepted_prefix(state.draft[:w], outcome.predictions)
        state.stats.record_chain(state.segments, w, min(k, w))

    def update(self, state: DraftState, context: list[int], outcome: Outcome) -> None:
        """The decoder's next draft (each policy's rule)."""
        raise NotImplementedError

    def finish(self, state: DraftState, output: list[int]) -> None:
        """The request ended with ``output`` (its final tokens); policies that record something close it."""
