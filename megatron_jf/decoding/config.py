"""The decode configuration: which decoder, and its parameters (paper Sec. 2.1, 3.2; Algorithm 1).

Pure Python (standard library only), shared by every engine that runs the drafting policies of
:mod:`megatron_jf.decoding`.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

DECODERS = ("ar", "jacobi", "running-window", "mr")
DRAFT_INITS = ("context", "repeat")
DRAFT_WIDTHS = ("auto", "fixed")
#: The paper's decoders as Algorithm 1 runs them: the whole draft every step and no context n-grams
#: (``DecodeConfig("mr", **PAPER)``; the quickstart report measures the method's TPF this way).
PAPER = {"draft_width": "fixed", "prompt_lookup_max": 0}


@dataclass(frozen=True)
class DecodeConfig:
    """Decoder choice and its parameters.

    Attributes:
        decoder: one of ``DECODERS``.
        block_size: n, draft tokens per block (jacobi, running-window, mr).
        num_blocks: K, blocks in flight (mr; 1 = rejection recycling only).
        spawn_threshold: r in (0, 1]; a pseudo-active block spawns at ``ceil(r*n)`` stable tokens (mr).
        verification_size: drafts verified per forward for the RA block, the Jacobi draft included (mr).
        ngram_pool_size: n-grams kept per first token in the pool (mr).
        draft_init: ``context`` (tokens drawn uniformly from prompt + output, as the paper's
            trajectories are initialised) or ``repeat`` (the last token repeated).
        draft_width: ``auto``: each step forwards the draft width that maximises expected tokens per second, from
            the forward's cost measured on this machine and the request's acceptance so far -- from 0 (plain AR)
            up to the decoder's full draft, so the block size is the ceiling -- and mr puts the candidate expected
            to accept most at the head of its draft; ``fixed``: the full draft every step (AR ignores it; rows
            that record a trajectory run fixed; :mod:`megatron_jf.decoding.width`).
        prompt_lookup_min: prompt lookup (mr): fewest trailing tokens of the context that an earlier occurrence
            must match for the tokens after it to become a candidate (vLLM's name).
        prompt_lookup_max: prompt lookup (mr): most trailing tokens matched when ranking context n-grams; 0 turns
            context n-grams off (vLLM's name).

    Raises:
        ValueError: unknown decoder, draft init or draft width, n < 1, K < 1, r outside (0, 1], verification size
            < 1, n-gram pool size < 1, prompt lookup bounds outside 1 <= min <= max (or max = 0).
    """

    decoder: str = "ar"
    block_size: int = field(default=16, metadata={"cli": {"option": "BLOCK_SIZE"}})  # megatron_jf.cli.BLOCK_SIZE
    num_blocks: int = 2
    spawn_threshold: float = 0.85
    verification_size: int = 4
    ngram_pool_size: int = 8
    draft_init: str = "context"
    draft_width: str = "auto"
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4

    def __post_init__(self):
        if self.decoder not in DECODERS:
            raise ValueError(f"unknown decoder {self.decoder!r}; choose one of {', '.join(DECODERS)}")
        if self.block_size < 1:
            raise ValueError(f"block size n must be >= 1, got {self.block_size}")
        if self.num_blocks < 1:
            raise ValueError(f"number of blocks K must be >= 1, got {self.num_blocks}")
        if not 0 < self.spawn_threshold <= 1:
            raise ValueError(f"spawn threshold r must be in (0, 1], got {self.spawn_threshold}")
        if self.verification_size < 1:
            raise ValueError(f"verification size must be >= 1, got {self.verification_size}")
        if self.ngram_pool_size < 1:
            raise ValueError(f"n-gram pool size must be >= 1, got {self.ngram_pool_size}")
        if self.draft_init not in DRAFT_INITS:
            raise ValueError(f"unknown draft init {self.draft_init!r}; choose one of {', '.join(DRAFT_INITS)}")
        if self.draft_width not in DRAFT_WIDTHS:
            raise ValueError(f"unknown draft width {self.draft_width!r}; choose one of {', '.join(DRAFT_WIDTHS)}")
        if self.prompt_lookup_max < 0 or (self.prompt_lookup_max and not 1 <= self.prompt_lookup_min
                                          <= self.prompt_lookup_max):
            raise ValueError(f"prompt lookup needs 1 <= prompt_lookup_min <= prompt_lookup_max (or "
                             f"prompt_lookup_max = 0: off), got {self.prompt_lookup_min} and {self.prompt_lookup_max}")
        if self.decoder == "mr" and self.num_blocks > 1 and math.ceil(self.spawn_threshold * self.block_size) >= self.block_size:
            # the RA block has at most n-1 accepted tokens while in flight (it retires at n), so a pseudo-active
            # block needs ceil(r*n) <= n-1 to ever spawn
            warnings.warn(f"mr with K={self.num_blocks} never spawns a second block: r={self.spawn_threshold} needs "
                          f"ceil(r*n)={math.ceil(self.spawn_threshold * self.block_size)} stable tokens in a block of "
                          f"n={self.block_size}, which retires at n; this runs as K=1 (use r <= "
                          f"{(self.block_size - 1) / self.block_size:.3g})", UserWarning, stacklevel=3)

    @property
    def label(self) -> str:
        """The method's name in tables and reports: ``"AR"``, ``"Jacobi (n=16)"``, ``"Running-window (n=16)"``,
        ``"MR (n=16, K=2, r=0.85, v=4)"``."""
        d, n = self.decoder, self.block_size
        if d == "ar":
            return "AR"
        if d == "jacobi":
            return f"Jacobi (n={n})"
        if d == "running-window":
            return f"Running-window (n={n})"
        return f"MR (n={n}, K={self.num_blocks}, r={self.spawn_threshold:g}, v={self.verification_size})"


def forward_width(cfg: DecodeConfig) -> int:
    """Most tokens one row forwards per decode step under ``cfg`` (``last`` + drafts + recycled candidates):
    AR 1, Jacobi / running window ``n + 1``, MR ``1 + K*n + (v-1)*n`` -- every step with ``draft_width="fixed"``,
    the ceiling with ``auto``."""
    n = cfg.block_size
    return {"ar": 1, "jacobi": n + 1, "running-window": n + 1,
            "mr": 1 + cfg.num_blocks * n + (cfg.verification_size - 1) * n}[cfg.decoder]
