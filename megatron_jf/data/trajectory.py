"""Jacobi-decoding trajectory records (paper Sec. 3.1).

A *trajectory* records, for every block of ``n`` tokens of a greedy response,
every Jacobi iterate ("draft") of that block until its fixed point, which equals
the greedy autoregressive output for the block. This module defines the record
schema shared by the trajectory collector (which writes records) and the data
pipeline (which packs them into training sequences, :mod:`megatron_jf.data.packing`).

Conventions
-----------
* All token tensors are ``torch.int64`` on CPU and hold non-negative vocabulary ids.
* ``drafts[0]`` is the *true* initial draft, stored as a copy. The reference
  collector aliased it to the (in-place updated) fixed point, so the noisiest
  state was never recorded (the reference collector's bug); validation cannot
  detect aliasing, so the collector must ``clone()`` its drafts.
* ``drafts`` may or may not end with a copy of the fixed point; nothing here
  relies on either (a state equal to the fixed point has unconverged fraction 0).
* Blocks are in decoding order, and block ``i`` starts right after the prompt
  and the fixed points of blocks ``0..i-1``: ``context_len_i = P + sum_{j<i} n_j``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["BlockTrajectory", "TrajectoryRecord"]


def _check_int_tensor(x: object, ndim: int, what: str, sample_id: str) -> torch.Tensor:
    """Return ``x`` if it is an int64 tensor with ``ndim`` dims and no negative ids; else raise ValueError."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"sample {sample_id!r}: {what} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype != torch.int64:
        raise ValueError(f"sample {sample_id!r}: {what} must have dtype torch.int64, got {x.dtype}")
    if x.dim() != ndim:
        raise ValueError(
            f"sample {sample_id!r}: {what} must be {ndim}-D, got shape {tuple(x.shape)}"
        )
    if x.numel() > 0 and int(x.min()) < 0:
        raise ValueError(f"sample {sample_id!r}: {what} contains negative token ids (min {int(x.min())})")
    return x


@dataclass
class BlockTrajectory:
    """Jacobi trajectory of one block.

    Attributes:
        context_len: number of tokens before this block: prompt length plus the
            lengths of all previous fixed points (an absolute position, in tokens).
        drafts: int64 ``[S, n_b]``, every Jacobi iterate of the block in order;
            ``drafts[0]`` is the initial draft (a copy, never an alias of the
            fixed point); ``S >= 1``.
        fixed_point: int64 ``[n_b]``, the converged block (= greedy AR output).
    """

    context_len: int
    drafts: torch.Tensor
    fixed_point: torch.Tensor

    @property
    def length(self) -> int:
        """Block length ``n_b`` in tokens."""
        return int(self.fixed_point.shape[0])

    @property
    def num_states(self) -> int:
        """Number of recorded drafts ``S``."""
        return int(self.drafts.shape[0])


@dataclass
class TrajectoryRecord:
    """All block trajectories of one prompt's greedy response (paper Sec. 3.1).

    Attributes:
        sample_id: unique, non-empty id of the prompt/sample.
        prompt_ids: int64 ``[P]``, ``P >= 1``: the (chat-templated) prompt.
        blocks: the block trajectories, in decoding order (at least one).
        block_size: ``n``; every block has ``n_b == n`` except possibly the last (``n_b <= n``).
        eos_reached: True iff the last block's fixed point ends with an EOS token; that last
            block is then truncated right after the EOS, its drafts truncated to the same columns.
    """

    sample_id: str
    prompt_ids: torch.Tensor
    blocks: list[BlockTrajectory] = field(default_factory=list)
    block_size: int = 0
    eos_reached: bool = False

    # ------------------------------------------------------------------ helpers
    @property
    def prompt_len(self) -> int:
        """``P``, the prompt length in tokens."""
        return int(self.prompt_ids.shape[0])

    @property
    def num_blocks(self) -> int:
        """``N``, the number of blocks."""
        return len(self.blocks)

    @property
    def block_lens(self) -> list[int]:
        """``[n_0, ..., n_{N-1}]``, the length of each block in tokens."""
        return [b.length for b in self.blocks]

    @property
    def response_len(self) -> int:
        """``R = sum_i n_i``, the response length in tokens."""
        return sum(self.block_lens)

    def response_ids(self) -> torch.Tensor:
        """The greedy response: int64 ``[R]``, the concatenated fixed points (EOS included if reached)."""
        if not self.blocks:
            return torch.empty(0, dtype=torch.int64)
        return torch.cat([b.fixed_point for b in self.blocks])

    def full_ids(self) -> torch.Tensor:
        """int64 ``[P + R]``: prompt followed by the response."""
        return torch.cat([self.prompt_ids, self.response_ids()])

    def equal(self, other: "TrajectoryRecord") -> bool:
        """Exact equality of every field and tensor (dtype, shape and values)."""
        if not isinstance(other, TrajectoryRecord):
            return False
        if (
            self.sample_id != other.sample_id
            or self.block_size != other.block_size
            or self.eos_reached != other.eos_reached
            or len(self.blocks) != len(other.blocks)
        ):
            return False

        def same(a: torch.Tensor, b: torch.Tensor) -> bool:
            return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))

        if not same(self.prompt_ids, other.prompt_ids):
            return False
        for a, b in zip(self.blocks, other.blocks):
            if a.context_len != b.context_len or not same(a.drafts, b.drafts) or not same(a.fixed_point, b.fixed_point):
                return False
        return True

    # --------------------------------------------------------------- validation
    def validate(self, eos_id: int | None = None) -> "TrajectoryRecord":
        """Check the schema invariants; return ``self`` so calls can be chained.

        Args:
            eos_id: if given, also check the EOS convention: when ``eos_reached`` the response's
                first EOS is its last token, otherwise the response contains no EOS.

        Raises:
            ValueError: naming the sample and the problem, on: a non-string/empty ``sample_id``;
                non-int64 / wrongly shaped / negative token tensors; an empty prompt; no blocks;
                a non-positive ``block_size``; a block with ``S == 0`` or ``n_b == 0``; drafts
                whose width differs from the fixed point's; a non-last block with ``n_b != n`` or a
                last block with ``n_b > n``; a ``context_len`` different from ``P + sum(previous n_b)``;
                a non-bool ``eos_reached``; and (with ``eos_id``) a violated EOS convention.
        """
        sid = self.sample_id
        if not isinstance(sid, str) or not sid:
            raise ValueError(f"sample_id must be a non-empty str, got {sid!r}")
        _check_int_tensor(self.prompt_ids, 1, "prompt_ids", sid)
        P = self.prompt_len
        if P < 1:
            raise ValueError(f"sample {sid!r}: empty prompt (prompt_ids has length 0)")
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"sample {sid!r}: block_size must be a positive int, got {self.block_size!r}")
        if not isinstance(self.eos_reached, bool):
            raise ValueError(f"sample {sid!r}: eos_reached must be a bool, got {type(self.eos_reached).__name__}")
        if not isinstance(self.blocks, list) or not self.blocks:
            raise ValueError(f"sample {sid!r}: empty blocks (a record needs at least one block)")
        n = self.block_size
        expected_ctx = P
        last = len(self.blocks) - 1
        for i, b in enumerate(self.blocks):
            if not isinstance(b, BlockTrajectory):
                raise ValueError(f"sample {sid!r}: blocks[{i}] is a {type(b).__name__}, not a BlockTrajectory")
            fp = _check_int_tensor(b.fixed_point, 1, f"blocks[{i}].fixed_point", sid)
            dr = _check_int_tensor(b.drafts, 2, f"blocks[{i}].drafts", sid)
            n_b = fp.shape[0]
            if n_b == 0:
                raise ValueError(f"sample {sid!r}: blocks[{i}] is empty (fixed_point has length 0)")
            if dr.shape[0] == 0:
                raise ValueError(f"sample {sid!r}: blocks[{i}] has no drafts (S == 0; drafts[0] must be the initial draft)")
            if dr.shape[1] != n_b:
                raise ValueError(
                    f"sample {sid!r}: blocks[{i}] shape mismatch: drafts {tuple(dr.shape)} vs fixed_point [{n_b}]"
                )
            if i < last and n_b != n:
                raise ValueError(
                    f"sample {sid!r}: blocks[{i}] has length {n_b} but block_size is {n} (only the last block may be shorter)"
                )
            if i == last and n_b > n:
                raise ValueError(f"sample {sid!r}: last block has length {n_b} > block_size {n}")
            if isinstance(b.context_len, bool) or not isinstance(b.context_len, int):
                raise ValueError(f"sample {sid!r}: blocks[{i}].context_len must be an int, got {b.context_len!r}")
            if b.context_len != expected_ctx:
                raise ValueError(
                    f"sample {sid!r}: blocks[{i}].context_len is {b.context_len}, expected {expected_ctx} "
                    f"(prompt {P} + previous blocks {expected_ctx - P})"
                )
            expected_ctx += n_b
        if eos_id is not None:
            resp = self.response_ids()
            hits = torch.nonzero(resp == eos_id).flatten()
            if self.eos_reached:
                if hits.numel() == 0 or int(hits[0]) != resp.numel() - 1:
                    where = "absent" if hits.numel() == 0 else f"first at response index {int(hits[0])} of {resp.numel()}"
                    raise ValueError(
                        f"sample {sid!r}: eos_reached=True but EOS {eos_id} is not exactly the last response token ({where})"
                    )
            elif hits.numel() > 0:
                raise ValueError(
                    f"sample {sid!r}: eos_reached=False but the response contains EOS {eos_id} at index {int(hits[0])}"
                )
        return self
