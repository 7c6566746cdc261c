"""Autoregressive decoding as a drafting policy: no draft, one token per forward (the baseline; TPF is exactly 1)."""

from __future__ import annotations

from megatron_jf.decoding.base import DraftState, Outcome, Policy, draft_rng


class ARPolicy(Policy):
    """The empty draft: the verifier forwards ``[context[-1]]`` and emits its greedy (or sampled) next token."""

    def _new_state(self, prompt: list[int], seed: int) -> DraftState:
        return DraftState(len(prompt), [], draft_rng(prompt, seed))

    def update(self, state: DraftState, context: list[int], outcome: Outcome) -> None:
        """Nothing to update: the draft stays empty."""
