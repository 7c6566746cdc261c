"""Plain next-token data for ``--objective ar``: a flat token stream cut into fixed-length samples.

Sources (picked by file extension):

* ``.npy`` -- a 1-D integer NumPy array of token ids (memory-mapped);
* ``.bin`` -- raw little-endian **int32** token ids (memory-mapped; Megatron-style flat dump);
* ``.jsonl`` -- one JSON object per line with a text field (``text_key``, default ``"text"``), tokenized
  with a :class:`megatron_jf.tokenizer.Tokenizer`; an EOS id is appended after every document.

Several files are concatenated in the order given. The stream of ``T`` tokens gives
``N = (T - 1) // seq_length`` samples; sample ``i`` is ``tokens[i*S : i*S + S + 1]``, split into
``input = [:S]`` and ``labels = [1:]`` (so consecutive samples share one boundary token).

Order, data-parallel split and resumption follow :class:`megatron_jf.data.dataset.TrajectoryDataset`:
each epoch permutes the samples with a seeded generator (``shuffle=True``), cuts the permutation to
``N // W`` samples per rank (the remainder is dropped) and rank ``r`` takes positions ``r, r+W, ...``;
:meth:`TokenChunkDataset.set_start` skips the samples already consumed in the current epoch.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import IterableDataset

from .dataset import EpochCursor
from .schedule import derive_seed

__all__ = ["TextSample", "TextBatch", "TokenChunkDataset", "collate_text", "load_token_stream"]


@dataclass
class TextSample:
    """One next-token sample: int64 ``tokens [S]`` and ``labels [S]`` (``labels[i] = next token``)."""

    tokens: torch.Tensor
    labels: torch.Tensor
    index: int


def _load_one(path: str, tokenizer, eos_id: int | None, text_key: str) -> np.ndarray:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"token data not found: {path}")
    ext = os.path.splitext(path)[1].lower()
    if ext == ".npy":
        try:
            arr = np.load(path, mmap_mode="r", allow_pickle=False)
        except Exception as e:
            raise ValueError(f"cannot read {path} as a .npy array: {e}") from None
        if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"{path}: expected a 1-D integer array of token ids, got {arr.dtype} {arr.shape}")
        return arr
    if ext == ".bin":
        size = os.path.getsize(path)
        if size % 4:
            raise ValueError(f"{path}: size {size} is not a multiple of 4 bytes (expected raw int32 token ids)")
        if size == 0:
            return np.zeros(0, dtype=np.int32)
        return np.memmap(path, dtype="<i4", mode="r")
    if ext in (".jsonl", ".json"):
        if tokenizer is None:
            raise ValueError(f"{path}: JSONL text data needs a tokenizer (--tokenizer DIR)")
        eos = eos_id if eos_id is not None else (min(tokenizer.eos_ids) if tokenizer.eos_ids else None)
        ids: list[int] = []
        with open(path, encoding="utf-8") as f:
            for ln, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{ln}: invalid JSON ({e.msg})") from None
                if not isinstance(obj, dict) or not isinstance(obj.get(text_key), str):
                    raise ValueError(f"{path}:{ln}: expected an object with a string field {text_key!r}")
                ids.extend(tokenizer.encode(obj[text_key]))
                if eos is not None:
                    ids.append(int(eos))
        return np.asarray(ids, dtype=np.int64)
    raise ValueError(f"{path}: unsupported token data format {ext!r} (use .npy, .bin or .jsonl)")


def load_token_stream(paths: str | Sequence[str], *, tokenizer=None, eos_id: int | None = None,
                      text_key: str = "text") -> np.ndarray:
    """The concatenated token stream of ``paths`` (memory-mapped when there is a single binary file).

    Raises:
        FileNotFoundError: a missing file.
        ValueError: an unsupported extension, a malformed file, or JSONL without a tokenizer.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    parts = [_load_one(os.fspath(p), tokenizer, eos_id, text_key) for p in paths]
    if len(parts) == 1:
        return parts[0]
    return np.concatenate([np.asarray(p, dtype=np.int64) for p in parts])


class TokenChunkDataset(EpochCursor, IterableDataset):
    """Fixed-length next-token samples over a token stream (see the module docstring).

    Args:
        paths: token files (``.npy`` / ``.bin`` / ``.jsonl``).
        seq_length: ``S``, tokens per sample.
        tokenizer: needed for ``.jsonl``.
        vocab_size: if given, every token of a yielded sample must be below it.
        seed, shuffle: per-epoch permutation.
        rank, world_size: the data-parallel rank and size.

    Raises:
        FileNotFoundError / ValueError: see :func:`load_token_stream`; also an empty stream, fewer than
            ``S + 1`` tokens, fewer samples than ranks, or bad arguments.
    """

    def __init__(self, paths, seq_length: int, *, tokenizer=None, eos_id: int | None = None,
                 text_key: str = "text", vocab_size: int | None = None, seed: int = 0, shuffle: bool = True,
                 rank: int = 0, world_size: int = 1):
        super().__init__()
        if seq_length < 1:
            raise ValueError(f"seq_length must be >= 1, got {seq_length}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
        self.paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
        self.tokens = load_token_stream(self.paths, tokenizer=tokenizer, eos_id=eos_id, text_key=text_key)
        T = int(self.tokens.shape[0])
        if T == 0:
            raise ValueError(f"empty token data: {self.paths}")
        if T < seq_length + 1:
            raise ValueError(f"token data {self.paths} has {T} tokens, fewer than seq_length + 1 = {seq_length + 1}")
        self.seq_length = seq_length
        self.vocab_size = vocab_size
        self.seed = seed
        self.shuffle = shuffle
        self.rank = rank
        self.world_size = world_size
        self.epoch = 0
        self.start = 0
        self.num_samples = (T - 1) // seq_length
        if self.num_samples < world_size:
            raise ValueError(f"token data gives {self.num_samples} samples of {seq_length} tokens, "
                             f"fewer than the {world_size} data-parallel ranks")

    @property
    def samples_per_rank(self) -> int:
        return self.num_samples // self.world_size

    def rank_indices(self, epoch: int | None = None) -> torch.Tensor:
        """int64 ``[samples_per_rank]``: this rank's sample indices for ``epoch`` in yield order."""
        epoch = self.epoch if epoch is None else epoch
        N, W = self.num_samples, self.world_size
        if self.shuffle:
            g = torch.Generator().manual_seed(derive_seed("jf-text-shuffle", self.seed, epoch))
            perm = torch.randperm(N, generator=g)
        else:
            perm = torch.arange(N, dtype=torch.int64)
        return perm[: self.samples_per_rank * W][self.rank :: W]

    def sample(self, i: int) -> TextSample:
        """Sample ``i`` of the stream.

        Raises:
            ValueError: a token id outside ``[0, vocab_size)`` (naming the file set and offset).
        """
        S = self.seq_length
        chunk = torch.from_numpy(np.asarray(self.tokens[i * S : i * S + S + 1], dtype=np.int64))
        lo, hi = int(chunk.min()), int(chunk.max())
        if lo < 0 or (self.vocab_size is not None and hi >= self.vocab_size):
            raise ValueError(f"token data {self.paths}: sample {i} (tokens {i * S}..{i * S + S}) has id "
                             f"{lo if lo < 0 else hi} outside the vocabulary [0, {self.vocab_size})")
        return TextSample(tokens=chunk[:-1], labels=chunk[1:], index=i)

    def __iter__(self) -> Iterator[TextSample]:
        for i in self.rank_indices()[self.start :].tolist():
            yield self.sample(i)


@dataclass
class TextBatch:
    """int64 ``tokens``, ``labels``, ``position_ids``, all ``[b, S]``."""

    tokens: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel())

    def to(self, device) -> "TextBatch":
        return TextBatch(self.tokens.to(device), self.labels.to(device), self.position_ids.to(device))


def collate_text(samples: Sequence[TextSample]) -> TextBatch:
    """Stack samples into a :class:`TextBatch` (positions ``0..S-1``).

    Raises:
        ValueError: an empty list or samples of different lengths.
    """
    if not samples:
        raise ValueError("cannot collate zero samples")
    lens = {s.tokens.shape[0] for s in samples}
    if len(lens) != 1:
        raise ValueError(f"samples have different lengths {sorted(lens)}")
    tokens = torch.stack([s.tokens for s in samples])
    S = tokens.shape[1]
    return TextBatch(tokens=tokens, labels=torch.stack([s.labels for s in samples]),
                     position_ids=torch.arange(S, dtype=torch.int64).expand(len(samples), S).contiguous())
