"""Running-window Jacobi decoding (paper Sec. 4.3, Fig. 5): the draft always holds ``n`` guesses, refilled
as tokens are committed, instead of waiting for a block's fixed point."""

from __future__ import annotations

from megatron_jf.decoding.base import DraftState, Outcome, Policy, jacobi_update


class RunningWindowPolicy(Policy):
    """Next draft: the model's predictions past the accepted prefix (the Jacobi update, Algorithm 1 step 4),
    then fresh tokens (:meth:`Policy.init`) up to ``n``; positions the forward did not verify (a cut width) keep
    their guesses."""

    def update(self, state: DraftState, context: list[int], outcome: Outcome) -> None:
        k = outcome.from_draft
        nxt = jacobi_update(state.draft, outcome.predictions)[k + 1:] if outcome.winner is None else []
        state.draft = (nxt + self.init(state, context, self.n - len(nxt)))[: self.n]
