"""Block-wise Jacobi decoding (paper Sec. 2.1) and its trajectory recording (Sec. 3.1: the training data).

The output is cut into blocks of ``n`` tokens. A block starts from a random draft (Algorithm 1 step 1); each
forward accepts the longest verified prefix plus one token (step 3), and the unverified rest of the block takes
the model's predictions from that forward (step 4, the Jacobi update). When every token of the block is accepted
the block has reached its *fixed point* (greedy AR's tokens) and the next block starts from a fresh draft.

With ``record_trajectory`` the policy keeps, per block, every intermediate draft of the whole block (accepted
tokens + draft) and the fixed point: the Jacobi trajectory the paper trains on, in the layout of
:func:`JacobiPolicy.finish`.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_jf.decoding.base import DraftState, Outcome, Policy, draft_rng, jacobi_update


@dataclass(eq=False)
class JacobiState(DraftState):
    """Jacobi state.

    Attributes:
        block_end: output index where the current block ends (a multiple of ``n``).
        traj: with recording, one dict per block: ``{"context_len": P + block start, "drafts": [[n tokens]...],
            "fixed_point": [n tokens]}`` (the last key once the block converged), else None.
    """

    block_end: int = 0
    traj: list[dict] | None = None


class JacobiPolicy(Policy):
    """Block-wise Jacobi: the draft covers the rest of the current block of ``n`` tokens."""

    def new_state(self, prompt: list[int], seed: int, *, record_trajectory: bool = False) -> JacobiState:
        """The first block's random draft (Algorithm 1 step 1); with ``record_trajectory``, its first trajectory
        point. Raises ValueError on an empty prompt."""
        if not prompt:
            raise ValueError("the prompt is empty")
        st = JacobiState(len(prompt), [], draft_rng(prompt, seed), block_end=self.n)
        st.draft = self.init(st, prompt, self.n)
        if record_trajectory:
            st.traj = [{"context_len": len(prompt), "drafts": [list(st.draft)]}]
        return st

    def update(self, state: JacobiState, context: list[int], outcome: Outcome) -> None:
        """Jacobi update of the current block (Algorithm 1 step 4; positions a cut width did not verify keep their
        guesses), or, at its fixed point, a new block."""
        n, P = self.n, state.prompt_len
        e = len(context) - P  # output tokens so far
        rest = state.block_end - e  # unknown positions left in this block
        traj = state.traj
        if rest > 0:
            k = outcome.from_draft
            state.draft = jacobi_update(state.draft, outcome.predictions)[k + 1: k + 1 + rest]
            if traj is not None:
                traj[-1]["drafts"].append(context[P + state.block_end - n:] + state.draft)
            return
        if traj is not None:  # the block reached its fixed point
            traj[-1]["fixed_point"] = context[P + state.block_end - n: P + state.block_end]
        while state.block_end <= e:
            state.block_end += n
        state.draft = self.init(state, context, state.block_end - e)
        if traj is not None:
            start = state.block_end - n
            traj.append({"context_len": P + start, "drafts": [context[P + start:] + state.draft]})

    def finish(self, state: JacobiState, output: list[int]) -> None:
        """Close the recorded trajectory: the last (possibly partial) block gets its fixed point (drafts cut to the
        same columns); tokens emitted past it by the final forward (a bonus token crossing the block end) become one
        more block whose only draft is those known tokens. Without recording, nothing."""
        traj, n, P = state.traj, self.n, state.prompt_len
        if traj is None:
            return
        blk = traj[-1]
        if "fixed_point" not in blk:
            start = blk["context_len"] - P
            fp = output[start: start + n]
            if fp:
                blk["fixed_point"] = fp
                blk["drafts"] = [d[: len(fp)] for d in blk["drafts"]]
            else:
                traj.pop()
        covered = (traj[-1]["context_len"] - P + len(traj[-1]["fixed_point"])) if traj else 0
        if covered < len(output):
            extra = output[covered:covered + n]
            traj.append({"context_len": P + covered, "drafts": [list(extra)], "fixed_point": list(extra)})
