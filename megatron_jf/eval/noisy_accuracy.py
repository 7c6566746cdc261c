"""Noisy-token accuracy by distance from the first wrong draft token: what Jacobi Forcing teaches, measured on fixed
trajectories, so that a change of the model's own output cannot fake it.

Jacobi TPF is measured on a model's own greedy output, so it also rises when that output gets simpler. This measure
holds the data fixed instead: the Jacobi trajectories a *base* model produced on held-out prompts (recorded with
``tools/generate_trajectories.py``). For every recorded draft ``y`` of a block whose first wrong token is at offset
``f`` (``y[f] != y*[f]``, ``y[:f] == y*[:f]``, ``y*`` the fixed point), one causal forward over
``[prompt, fixed points of the earlier blocks, y]`` -- exactly what vanilla Jacobi decoding shows the model (paper
Sec. 2.1) -- gives at each later position ``j > f`` the model's prediction of ``y*[j]`` from a context holding
``k = j - f`` tokens after (and including) the first wrong one. It is right when its argmax equals ``y*[j]``: then
Jacobi decoding keeps that token although the tokens before it were wrong, and it is accepted once they are fixed
(a "fast-forwarded" / "stationary" token, CLLM Sec. 3.2). The report gives the accuracy per distance ``k`` and
the mean length of the run of right predictions starting at ``k = 1``.

A model that has only learned to produce simpler text does not gain here (the fixed points are the base model's);
a model whose predictions through noise improved does. The base model's own value is its starting point.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch

__all__ = ["NoisyAccuracy", "noisy_accuracy"]


@dataclass
class NoisyAccuracy:
    """Totals of :func:`noisy_accuracy`.

    Attributes:
        right: per distance ``k`` (1-based), right predictions.
        total: per distance ``k``, predictions scored.
        run_lengths: per scored state, the number of consecutive right predictions from ``k = 1``.
        states: draft states scored.
    """

    right: dict[int, int] = field(default_factory=dict)
    total: dict[int, int] = field(default_factory=dict)
    run_lengths: list[int] = field(default_factory=list)
    states: int = 0

    def accuracy(self, k: int) -> float:
        """Accuracy at distance ``k`` (nan when nothing was scored there)."""
        t = self.total.get(k, 0)
        return self.right.get(k, 0) / t if t else float("nan")

    @property
    def mean_run(self) -> float:
        """Mean run of right predictions right after the first wrong token (tokens; nan without states)."""
        return sum(self.run_lengths) / len(self.run_lengths) if self.run_lengths else float("nan")

    def summary(self, distances: Sequence[int] = (1, 2, 3, 4, 8)) -> dict:
        """``{"states", "mean_run", "acc_k<k>"...}`` with accuracies rounded to 4 digits; ``acc_k<k>`` for ``k`` in
        ``distances`` (the last one: every distance from it on, pooled: ``acc_k8+``)."""
        out: dict = {"states": self.states, "mean_run": round(self.mean_run, 4)}
        for i, k in enumerate(distances):
            if i == len(distances) - 1:
                r = sum(v for d, v in self.right.items() if d >= k)
                t = sum(v for d, v in self.total.items() if d >= k)
                out[f"acc_k{k}+"] = round(r / t, 4) if t else float("nan")
            else:
                out[f"acc_k{k}"] = round(self.accuracy(k), 4)
        return out


def _states(records, max_states_per_block: int):
    """``(tokens [L], start of the block's draft in tokens, fixed point [n_b], first wrong offset f)`` per chosen
    draft: every draft that differs from its fixed point, evenly subsampled to ``max_states_per_block`` per block."""
    for rec in records:
        ctx = rec.prompt_ids
        for blk in rec.blocks:
            fp = blk.fixed_point
            cand = []
            for s in range(blk.num_states):
                diff = torch.nonzero(blk.drafts[s] != fp).flatten()
                if diff.numel() and int(diff[0]) < fp.shape[0] - 1:  # a later position to score
                    cand.append((s, int(diff[0])))
            if len(cand) > max_states_per_block:
                step = len(cand) / max_states_per_block
                cand = [cand[int(i * step)] for i in range(max_states_per_block)]
            for s, f in cand:
                yield torch.cat([ctx, blk.drafts[s]]), ctx.shape[0], fp, f
            ctx = torch.cat([ctx, fp])


@torch.no_grad()
def noisy_accuracy(model, records: Iterable, *, max_states_per_block: int = 4, batch_rows: int = 16) -> NoisyAccuracy:
    """Noisy-token accuracy by distance of ``model`` on fixed trajectory ``records`` (see the module docstring).

    Args:
        model: a megatron_jf GPT model in eval mode (:func:`megatron_jf.inference.forward.forward_logits`).
        records: :class:`~megatron_jf.data.trajectory.TrajectoryRecord` s (a base model's trajectories on held-out
            prompts).
        max_states_per_block: drafts scored per block, evenly spaced along the trajectory (its order: noisy first).
        batch_rows: sequences per forward (right-padded; causal attention keeps padding out of every scored
            position).

    Returns:
        :class:`NoisyAccuracy`.

    Raises:
        ValueError: ``max_states_per_block`` or ``batch_rows`` < 1.
    """
    from megatron_jf.inference.forward import forward_logits

    if max_states_per_block < 1 or batch_rows < 1:
        raise ValueError(f"max_states_per_block and batch_rows must be >= 1, got {max_states_per_block}, {batch_rows}")
    acc = NoisyAccuracy()
    pending: list = []

    def flush():
        L = max(t.shape[0] for t, *_ in pending)
        tokens = torch.zeros((len(pending), L), dtype=torch.int64)
        for i, (t, *_) in enumerate(pending):
            tokens[i, : t.shape[0]] = t
        pos = torch.arange(L).expand(len(pending), L)
        pred = forward_logits(model, tokens, pos).argmax(-1)  # [B, L]: prediction of the next token
        for i, (_, start, fp, f) in enumerate(pending):
            # the prediction of block token j is at position start + j - 1 (it has seen draft tokens 0..j-1)
            run, in_run = 0, True
            for j in range(f + 1, fp.shape[0]):
                k = j - f
                ok = int(pred[i, start + j - 1]) == int(fp[j])
                acc.total[k] = acc.total.get(k, 0) + 1
                acc.right[k] = acc.right.get(k, 0) + int(ok)
                in_run = in_run and ok
                run += int(in_run)
            acc.run_lengths.append(run)
            acc.states += 1
        pending.clear()

    for item in _states(records, max_states_per_block):
        pending.append(item)
        if len(pending) == batch_rows:
            flush()
    if pending:
        flush()
    return acc
