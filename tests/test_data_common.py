"""Shared helpers for the data-pipeline tests (no tests here).

Token ids >= 3 are "ordinary"; 2 is used as EOS and 0 as PAD, so neither appears by accident.
"""

from __future__ import annotations

import torch

from megatron_jf.data.trajectory import BlockTrajectory, TrajectoryRecord

EOS = 2
PAD = 0


def T(*xs: int) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


def make_record(sample_id, prompt, blocks, n, eos_reached=False) -> TrajectoryRecord:
    """``blocks``: list of ``(drafts as list of lists, fixed point as list)``; context lengths are derived."""
    ctx = len(prompt)
    out = []
    for drafts, fp in blocks:
        out.append(
            BlockTrajectory(
                context_len=ctx,
                drafts=torch.tensor(drafts, dtype=torch.int64).reshape(len(drafts), len(fp)),
                fixed_point=torch.tensor(fp, dtype=torch.int64),
            )
        )
        ctx += len(fp)
    return TrajectoryRecord(sample_id, torch.tensor(prompt, dtype=torch.int64), out, n, eos_reached)


def hand_record() -> TrajectoryRecord:
    """P=3, n=3, blocks of 3, 3 and 2 tokens (last ends with EOS).

    block 0: drafts fractions [2/3, 1/3, 0] (the last draft is the fixed point)
    block 1: drafts fractions [2/3, 1/3]
    block 2: drafts fractions [1/2]      (position 1 of the draft is 7, fixed point has EOS)
    """
    return make_record(
        "hand/0",
        [10, 11, 12],
        [
            ([[20, 9, 9], [20, 21, 9], [20, 21, 22]], [20, 21, 22]),
            ([[30, 8, 8], [30, 31, 8]], [30, 31, 32]),
            ([[40, 7]], [40, EOS]),
        ],
        n=3,
        eos_reached=True,
    )


def random_record(
    g: torch.Generator,
    sample_id: str,
    *,
    n: int,
    num_blocks: int,
    prompt_len: int,
    last_len: int | None = None,
    eos: bool = False,
    vocab: int = 12,
) -> TrajectoryRecord:
    """A greedy-Jacobi-like trajectory: each block's drafts have a non-decreasing converged prefix;
    tokens behind the prefix are random (a small vocab makes coincidental matches common)."""

    def ri(lo, hi, shape=()):
        return torch.randint(lo, hi, shape, generator=g)

    prompt = ri(3, vocab, (prompt_len,))
    blocks = []
    ctx = prompt_len
    for i in range(num_blocks):
        nb = n if (i < num_blocks - 1 or last_len is None) else last_len
        fp = ri(3, vocab, (nb,))
        if eos and i == num_blocks - 1:
            fp[-1] = EOS
        S = int(ri(1, nb + 3))
        drafts = ri(3, vocab, (S, nb))
        prefix = sorted(int(v) for v in ri(0, nb + 1, (S,)))
        for s, k in enumerate(prefix):
            drafts[s, :k] = fp[:k]
        blocks.append(BlockTrajectory(context_len=ctx, drafts=drafts, fixed_point=fp))
        ctx += nb
    return TrajectoryRecord(sample_id, prompt, blocks, n, eos)


def random_records(seed: int, count: int, *, n: int = 4, prefix: str = "r") -> list[TrajectoryRecord]:
    g = torch.Generator().manual_seed(seed)
    recs = []
    for i in range(count):
        nb = int(torch.randint(1, 6, (), generator=g))
        last = int(torch.randint(1, n + 1, (), generator=g))
        eos = bool(torch.randint(0, 2, (), generator=g))
        P = int(torch.randint(1, 6, (), generator=g))
        recs.append(random_record(g, f"{prefix}{i:03d}", n=n, num_blocks=nb, prompt_len=P, last_len=last, eos=eos))
    return recs
