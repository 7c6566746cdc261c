"""Training dataset and collators over trajectory shards (paper Sec. 4.1).

:class:`TrajectoryDataset` indexes every sample of the given shards (headers only), and each epoch
iterates a seeded global permutation of them, split across data-parallel ranks and DataLoader
workers, packing each record with :func:`~megatron_jf.data.packing.pack_record`.

Sample order, splitting and resumption (all deterministic given ``seed``):

1. Global order: samples are numbered in shard order (sources as listed, globs/directories
   sorted) then stored order. ``shuffle=True`` applies :func:`portable_permutation` seeded by
   ``derive_seed(seed, epoch)``, so each epoch has a different, reproducible order.
2. Ranks: the permuted list is cut to ``N // W`` samples per rank (``remainder="drop"``: the last
   ``N mod W`` samples of the permutation are skipped this epoch -- a different set each epoch when
   shuffling) or extended to ``ceil(N / W)`` per rank by wrapping around to the start of the
   permutation (``remainder="wrap"``: ``(-N) mod W`` samples are seen twice). Rank ``r`` of ``W``
   takes positions ``r, r + W, r + 2W, ...``. Every rank therefore yields exactly the same number
   of samples, so data-parallel ranks never desynchronise.
3. Length grouping (optional, ``length_group_size > 0``; Hugging Face's ``group_by_length``): the rank's list is
   cut into consecutive groups of ``length_group_size`` samples; each group is sorted by sample length (longest
   first, ties in list order), cut into micro-batches of ``micro_batch_size`` and those micro-batches are shuffled
   within the group (seeded by ``seed``, epoch, rank and group). Each micro-batch then holds samples of similar
   length, so row padding (the ``two_stream`` and ``dense`` paths pad rows to the longest) nearly vanishes, while
   the epoch still covers the same samples and the order stays reproducible. Groups are aligned to the start of
   each epoch, which matches the trainer's micro-batches when ``micro_batch_size`` divides ``samples_per_rank``.
4. Resumption: :meth:`TrajectoryDataset.set_start` skips the first ``num_consumed`` samples of
   this rank's list for the current epoch (the trainer counts consumed samples; the dataset
   cannot, because workers prefetch).
5. Workers: the rank's remaining list is cut into consecutive chunks of ``batch_size`` samples and
   chunk ``c`` goes to worker ``c mod num_workers``. ``torch.utils.data.DataLoader`` collects
   batches from workers round-robin, so with ``DataLoader(batch_size=batch_size)`` the loader yields
   exactly the rank's list in order, whatever the number of workers -- which is what makes
   resumption exact. (Do not use ``persistent_workers=True``: workers would not see
   :meth:`set_epoch` / :meth:`set_start` changes made after they started.)

Sequence length: ``max_seq_len`` bounds the packed length ``L = P + 2R``. ``on_too_long="error"``
(default) raises naming the sample; ``"skip"`` drops it, which breaks the equal-count guarantee of
point 2 (ranks may then yield different numbers of samples) -- pre-filter shards instead when
training data-parallel.
"""

from __future__ import annotations

from typing import BinaryIO, Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from .packing import (
    CONSISTENCY_MODES,
    IGNORE_INDEX,
    ROLE_PAD,
    PackedSample,
    TwoStreamSample,
    pack_record,
    to_two_stream,
)
from .schedule import SCHEDULES, derive_seed, epoch_phase
from .shards import ShardEntry, expand_sources, index_shard, read_lengths, read_record
from .trajectory import TrajectoryRecord

__all__ = ["LENGTH_GROUP_MICRO_BATCHES", "EpochCursor", "TrajectoryDataset", "collate_packed", "collate_two_stream",
           "portable_permutation"]

#: Micro-batches per length group of ``--group-by-length`` (Hugging Face's ``LengthGroupedSampler`` megabatch).
LENGTH_GROUP_MICRO_BATCHES = 50


def portable_permutation(n: int, seed: int) -> torch.Tensor:
    """A seeded permutation of ``0..n-1`` (int64 ``[n]``) that depends only on ``(n, seed)``.

    Indices are sorted by a SplitMix64 hash of ``seed + index`` (numpy uint64 arithmetic, wrapping),
    so the order does not depend on any library's RNG implementation -- resuming a run after a
    torch/numpy upgrade reproduces the same sample order.
    """
    x = np.arange(n, dtype=np.uint64) + np.uint64(seed & 0xFFFFFFFFFFFFFFFF)
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    x = x ^ (x >> np.uint64(31))
    return torch.from_numpy(np.argsort(x, kind="stable").astype(np.int64))


class EpochCursor:
    """Where a rank is in its sample order: ``epoch`` and ``start`` (samples of this rank already consumed).

    Shared by :class:`TrajectoryDataset` and :class:`~megatron_jf.data.text.TokenChunkDataset`; the class
    provides ``samples_per_rank`` and ``seed``. A trainer stores :meth:`state_dict` in its checkpoint and
    resumes exactly with :meth:`load_state_dict`.
    """

    epoch: int = 0
    start: int = 0

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch (a new shuffle, and optionally a new noise draw); resets the start to 0.

        Raises:
            ValueError: ``epoch < 0``.
        """
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        self.epoch = int(epoch)
        self.start = 0

    def set_start(self, num_consumed: int) -> None:
        """Resume the current epoch after ``num_consumed`` samples of this rank's list.

        Raises:
            ValueError: ``num_consumed`` outside ``[0, samples_per_rank]``.
        """
        if not 0 <= num_consumed <= self.samples_per_rank:
            raise ValueError(f"num_consumed must be in [0, {self.samples_per_rank}], got {num_consumed}")
        self.start = int(num_consumed)

    def state_dict(self) -> dict:
        """``{"epoch", "num_consumed", "seed"}``."""
        return {"epoch": self.epoch, "num_consumed": self.start, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`.

        Raises:
            ValueError: the stored ``seed`` differs from this dataset's (the order would not be the same).
        """
        if int(state["seed"]) != self.seed:
            raise ValueError(f"state seed {state['seed']} != dataset seed {self.seed}")
        self.set_epoch(int(state["epoch"]))
        self.set_start(int(state["num_consumed"]))

    def __len__(self) -> int:
        return self.samples_per_rank - self.start


class TrajectoryDataset(EpochCursor, IterableDataset):
    """Iterable dataset of :class:`~megatron_jf.data.packing.PackedSample` over trajectory shards.

    Args:
        sources: shard path(s), glob(s), directories of ``*.tar`` or manifest ``.json`` files.
        window_size: noise-schedule window ``w`` (paper Eq. 7).
        schedule: ``"progressive"`` | ``"reverse"`` | ``"random"``.
        seed: base seed for shuffling and for the ``random`` schedule.
        consistency: ``"all"`` | ``"from_first_diff"`` (see :func:`pack_record`).
        block_size: the ``n`` the trainer expects; a record (or manifest) with another ``n`` raises.
        max_seq_len: optional bound on the packed length ``L``.
        on_too_long: ``"error"`` (default) or ``"skip"``; see the module docstring.
        shuffle: permute samples each epoch.
        rank, world_size: the *data-parallel* rank and size (not the global rank).
        remainder: ``"drop"`` or ``"wrap"``; see the module docstring.
        batch_size: the DataLoader batch size (worker chunk size; see the module docstring).
        length_group_size: samples per length group (0: off; > 0: see point 3 of the module docstring).
        micro_batch_size: samples per micro-batch, the unit shuffled within a length group.
        resample_noise_per_epoch: if True each record's noisy states are re-drawn every epoch: the ``random``
            schedule with seed ``derive_seed(seed, epoch)``, ``progressive`` / ``reverse`` with the ramp shifted by
            :func:`~megatron_jf.data.schedule.epoch_phase` (epoch 0 is the schedule as written); otherwise every
            epoch packs the same state per block (the paper trains one epoch, where the two agree).
        eos_id: if given, records are validated against the EOS convention.

    Raises:
        FileNotFoundError: a source matches no file.
        ValueError: an empty dataset, fewer samples than ranks under ``remainder="drop"``, a
            manifest whose block size differs from ``block_size``, a shard whose record count differs
            from its manifest entry, corrupt shards (naming the path), or bad arguments.
    """

    def __init__(
        self,
        sources: str | Sequence[str],
        *,
        window_size: int,
        schedule: str = "progressive",
        seed: int = 0,
        consistency: str = "all",
        block_size: int | None = None,
        max_seq_len: int | None = None,
        on_too_long: str = "error",
        shuffle: bool = True,
        rank: int = 0,
        world_size: int = 1,
        remainder: str = "drop",
        batch_size: int = 1,
        resample_noise_per_epoch: bool = False,
        eos_id: int | None = None,
        length_group_size: int = 0,
        micro_batch_size: int = 1,
    ) -> None:
        super().__init__()
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown noise schedule {schedule!r}; expected one of {SCHEDULES}")
        if consistency not in CONSISTENCY_MODES:
            raise ValueError(f"unknown consistency mode {consistency!r}; expected one of {CONSISTENCY_MODES}")
        if on_too_long not in ("error", "skip"):
            raise ValueError(f"on_too_long must be 'error' or 'skip', got {on_too_long!r}")
        if remainder not in ("drop", "wrap"):
            raise ValueError(f"remainder must be 'drop' or 'wrap', got {remainder!r}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if window_size < 1:
            raise ValueError(f"window_size must be >= 1, got {window_size}")
        if max_seq_len is not None and max_seq_len < 1:
            raise ValueError(f"max_seq_len must be >= 1, got {max_seq_len}")
        if length_group_size < 0 or micro_batch_size < 1:
            raise ValueError(f"need length_group_size >= 0 and micro_batch_size >= 1, got {length_group_size}, "
                             f"{micro_batch_size}")
        self.length_group_size = length_group_size
        self.micro_batch_size = micro_batch_size
        self._lengths: torch.Tensor | None = None
        self.window_size = window_size
        self.schedule = schedule
        self.seed = seed
        self.consistency = consistency
        self.block_size = block_size
        self.max_seq_len = max_seq_len
        self.on_too_long = on_too_long
        self.shuffle = shuffle
        self.rank = rank
        self.world_size = world_size
        self.remainder = remainder
        self.batch_size = batch_size
        self.resample_noise_per_epoch = resample_noise_per_epoch
        self.eos_id = eos_id
        self.epoch = 0
        self.start = 0
        self.num_skipped = 0  # too-long samples skipped by this process (on_too_long="skip")

        self.shard_paths: list[str] = []
        self.entries: list[tuple[int, ShardEntry]] = []  # global sample index -> (shard idx, entry)
        for path, expected, manifest_bs in expand_sources(sources):
            if block_size is not None and manifest_bs is not None and manifest_bs != block_size:
                raise ValueError(f"shard {path}: manifest block_size {manifest_bs} != requested block_size {block_size}")
            entries = index_shard(path)
            if expected is not None and len(entries) != expected:
                raise ValueError(f"shard {path}: {len(entries)} records but its manifest lists {expected}")
            si = len(self.shard_paths)
            self.shard_paths.append(path)
            self.entries.extend((si, e) for e in entries)
        if not self.entries:
            raise ValueError(f"empty dataset: no records in {len(self.shard_paths)} shard(s) from {sources!r}")
        if remainder == "drop" and len(self.entries) < world_size:
            raise ValueError(
                f"dataset has {len(self.entries)} samples, fewer than world_size={world_size} (remainder='drop' leaves ranks empty)"
            )
        if length_group_size:
            self.sample_lengths()  # now, so that DataLoader workers (forked every epoch) inherit the lengths

    # ------------------------------------------------------------------ order
    @property
    def num_samples(self) -> int:
        """``N``: records in all shards."""
        return len(self.entries)

    @property
    def samples_per_rank(self) -> int:
        """Samples each rank yields per epoch (before :meth:`set_start`)."""
        N, W = self.num_samples, self.world_size
        return N // W if self.remainder == "drop" else -(-N // W)

    def rank_indices(self, epoch: int | None = None) -> torch.Tensor:
        """int64 ``[samples_per_rank]``: global sample indices of this rank for ``epoch``, in yield order."""
        epoch = self.epoch if epoch is None else epoch
        N, W = self.num_samples, self.world_size
        if self.shuffle:
            perm = portable_permutation(N, derive_seed("jf-shuffle", self.seed, epoch))
        else:
            perm = torch.arange(N, dtype=torch.int64)
        total = self.samples_per_rank * W
        order = perm[torch.arange(total) % N]  # drop: a prefix; wrap: wraps to the start
        mine = order[self.rank :: W]
        return self._group_by_length(mine, epoch) if self.length_group_size else mine

    def sample_lengths(self) -> torch.Tensor:
        """int64 ``[N]``: each sample's ``prompt + response`` tokens (one stream of the packed sequence), read from
        the shards' JSON headers once and cached.

        Raises:
            ValueError: a shard's header cannot be read (naming it).
        """
        if self._lengths is None:
            by_shard: dict[int, list[ShardEntry]] = {}
            for si, e in self.entries:
                by_shard.setdefault(si, []).append(e)
            lens: list[int] = []
            for si in range(len(self.shard_paths)):  # entries are in shard order (see __init__)
                lens.extend(p + r for p, r in read_lengths(self.shard_paths[si], by_shard.get(si, [])))
            self._lengths = torch.tensor(lens, dtype=torch.int64)
        return self._lengths

    def _group_by_length(self, idx: torch.Tensor, epoch: int) -> torch.Tensor:
        """``idx`` reordered into length groups (point 3 of the module docstring)."""
        lengths = self.sample_lengths()
        G, mb = self.length_group_size, self.micro_batch_size
        out = []
        for g, lo in enumerate(range(0, idx.shape[0], G)):
            grp = idx[lo:lo + G]
            grp = grp[torch.sort(-lengths[grp], stable=True).indices]  # longest first, ties in list order
            batches = list(torch.split(grp, mb))
            perm = portable_permutation(len(batches), derive_seed("jf-length-groups", self.seed, epoch, self.rank, g))
            out.extend(batches[i] for i in perm.tolist())
        return torch.cat(out) if out else idx

    def worker_indices(self, worker_id: int = 0, num_workers: int = 1) -> torch.Tensor:
        """Global indices yielded by one DataLoader worker for the current epoch and start."""
        idx = self.rank_indices()[self.start :]
        chunk = torch.arange(idx.shape[0]) // self.batch_size
        return idx[chunk % num_workers == worker_id]

    # ------------------------------------------------------------------ reading
    def read_record(self, index: int, handles: dict[int, BinaryIO] | None = None) -> TrajectoryRecord:
        """The record with global index ``index`` (checked against ``block_size``)."""
        si, entry = self.entries[index]
        path = self.shard_paths[si]
        fh = None
        if handles is not None:
            fh = handles.get(si)
            if fh is None:
                if len(handles) >= 8:  # keep a few shards open per worker
                    handles.pop(next(iter(handles))).close()
                fh = handles[si] = open(path, "rb")
        rec = read_record(path, entry, fh)
        if self.eos_id is not None:
            try:
                rec.validate(eos_id=self.eos_id)
            except ValueError as e:
                raise ValueError(f"shard {path}: {e}") from e
        if self.block_size is not None and rec.block_size != self.block_size:
            raise ValueError(
                f"shard {path}, sample {rec.sample_id!r}: block_size {rec.block_size} != requested block_size {self.block_size}"
            )
        return rec

    def pack(self, record: TrajectoryRecord) -> PackedSample:
        """Pack a record with this dataset's schedule settings (for the current epoch)."""
        resample = self.resample_noise_per_epoch
        seed = derive_seed("jf-noise-epoch", self.seed, self.epoch) if resample else self.seed
        phase = epoch_phase(self.seed, self.epoch, record.sample_id, self.window_size) if resample else 0
        # The record was validated when decoded.
        return pack_record(record, self.schedule, self.window_size, seed, self.consistency, validate=False,
                           phase=phase)

    def __iter__(self) -> Iterator[PackedSample]:
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        handles: dict[int, BinaryIO] = {}
        try:
            for i in self.worker_indices(wid, nw).tolist():
                packed = self.pack(self.read_record(i, handles))
                if self.max_seq_len is not None and len(packed) > self.max_seq_len:
                    if self.on_too_long == "skip":
                        self.num_skipped += 1
                        continue
                    raise ValueError(
                        f"sample {packed.sample_id!r} (shard {self.shard_paths[self.entries[i][0]]}): packed length "
                        f"{len(packed)} > max_seq_len {self.max_seq_len}"
                    )
                yield packed
        finally:
            for fh in handles.values():
                fh.close()


# ----------------------------------------------------------------------------- collation
def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _target_len(natural: int, max_len: int | None, pad_to_multiple_of: int, what: str) -> int:
    if pad_to_multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}")
    if max_len is not None:
        if natural > max_len:
            raise ValueError(f"{what} has length {natural} > max_len {max_len}")
        return _round_up(max_len, pad_to_multiple_of)
    return _round_up(natural, pad_to_multiple_of)


def _check_batch(samples: Sequence, pad_id: int) -> None:
    if len(samples) == 0:
        raise ValueError("cannot collate an empty list of samples")
    if isinstance(pad_id, bool) or not isinstance(pad_id, int):
        raise ValueError(f"pad_id must be an int, got {pad_id!r}")


_PACKED_FIELDS = (("tokens", None), ("position_ids", 0), ("roles", ROLE_PAD), ("block_ids", -1), ("ar_targets", IGNORE_INDEX))


def collate_packed(
    samples: Sequence[PackedSample],
    pad_id: int,
    mode: str = "pad",
    max_len: int | None = None,
    pad_to_multiple_of: int = 1,
) -> dict:
    """Batch packed samples for the packed-mask (FlexAttention / dense-mask) path.

    ``mode="pad"``: one row per sample, right-padded to the longest (or to ``max_len``).
    ``mode="pack"``: all samples concatenated into ONE row (padded at the end to ``max_len`` if given),
    with ``segment_ids`` and ``cu_seqlens`` delimiting the samples; attention must then also be
    restricted to the same segment (``masks.make_mask_mod(..., segment_ids=...)``).
    Lengths are rounded up to a multiple of ``pad_to_multiple_of`` (e.g. the TP/CP size).

    Padding values: tokens ``pad_id``, position_ids 0, roles ``ROLE_PAD`` (-1), block_ids -1,
    ar_targets ``IGNORE_INDEX``.

    Returns:
        dict with int64 ``[B', L']`` tensors ``tokens``, ``position_ids``, ``roles``, ``block_ids``,
        ``ar_targets`` (``B' = B`` for pad, 1 for pack); bool ``valid`` ``[B', L']`` (True = real token);
        int64 ``consistency_pairs`` ``[C, 3]`` (row, noisy column, clean column); int64 ``seq_lens [B]``,
        ``prompt_lens [B]``, ``num_blocks [B]``; float32 ``noise_ratios`` / ``target_ratios``
        ``[sum N]`` (samples concatenated); ``sample_ids`` (list of str); and for pack mode int64
        ``segment_ids [1, L']`` (sample index, -1 on padding), int32 ``cu_seqlens [B+1]`` (padding
        lies after ``cu_seqlens[-1]``) and int ``max_seqlen``.

    Raises:
        ValueError: empty batch, bad ``pad_id``/``mode``, or a sample/row longer than ``max_len``.
    """
    _check_batch(samples, pad_id)
    lens = [len(s) for s in samples]
    B = len(samples)
    out: dict = {
        "seq_lens": torch.tensor(lens, dtype=torch.int64),
        "prompt_lens": torch.tensor([s.prompt_len for s in samples], dtype=torch.int64),
        "num_blocks": torch.tensor([s.num_blocks for s in samples], dtype=torch.int64),
        "noise_ratios": torch.cat([s.noise_ratios for s in samples]),
        "target_ratios": torch.cat([s.target_ratios for s in samples]),
        "sample_ids": [s.sample_id for s in samples],
    }
    if mode == "pad":
        Lp = _target_len(max(lens), max_len, pad_to_multiple_of, f"sample {samples[lens.index(max(lens))].sample_id!r}")
        for name, pad in _PACKED_FIELDS:
            t = torch.full((B, Lp), pad_id if pad is None else pad, dtype=torch.int64)
            for b, s in enumerate(samples):
                t[b, : lens[b]] = getattr(s, name)
            out[name] = t
        out["valid"] = torch.arange(Lp)[None, :] < out["seq_lens"][:, None]
        pairs = [
            torch.cat([torch.full((s.consistency_pairs.shape[0], 1), b, dtype=torch.int64), s.consistency_pairs], dim=1)
            for b, s in enumerate(samples)
        ]
        out["consistency_pairs"] = torch.cat(pairs)
    elif mode == "pack":
        total = sum(lens)
        Lp = _target_len(total, max_len, pad_to_multiple_of, f"packed row of {B} samples")
        starts = [0]
        for n in lens:
            starts.append(starts[-1] + n)
        for name, pad in _PACKED_FIELDS:
            t = torch.full((1, Lp), pad_id if pad is None else pad, dtype=torch.int64)
            t[0, :total] = torch.cat([getattr(s, name) for s in samples])
            out[name] = t
        seg = torch.full((1, Lp), -1, dtype=torch.int64)
        seg[0, :total] = torch.repeat_interleave(torch.arange(B), torch.tensor(lens))
        out["segment_ids"] = seg
        out["valid"] = seg >= 0
        out["cu_seqlens"] = torch.tensor(starts, dtype=torch.int32)
        out["max_seqlen"] = max(lens)
        pairs = [
            torch.cat(
                [torch.zeros((s.consistency_pairs.shape[0], 1), dtype=torch.int64), s.consistency_pairs + starts[b]], dim=1
            )
            for b, s in enumerate(samples)
        ]
        out["consistency_pairs"] = torch.cat(pairs)
    else:
        raise ValueError(f"mode must be 'pad' or 'pack', got {mode!r}")
    return out


def collate_two_stream(
    samples: Sequence[PackedSample | TwoStreamSample],
    pad_id: int,
    mode: str = "pad",
    max_len: int | None = None,
    pad_to_multiple_of: int = 1,
) -> dict:
    """Batch samples in the two-stream form (``nc`` mask only: plain causal attention per stream).

    Packed samples are converted with :func:`~megatron_jf.data.packing.to_two_stream`.

    ``mode="pad"``: ``2B`` rows right-padded to the longest stream (or ``max_len``): rows ``0..B-1``
    are the noisy streams and rows ``B..2B-1`` the clean streams of samples ``0..B-1``; the student
    logit for ``consistency_mask[b, j]`` is at row ``b``, column ``j`` and its teacher at row ``B + b``,
    column ``j``.

    ``mode="pack"``: ONE row ``[noisy_0, clean_0, noisy_1, clean_1, ...]`` (THD layout for varlen
    causal kernels) padded at the end to ``max_len`` if given; ``cu_seqlens`` int32 ``[2B+1]`` delimit
    the ``2B`` streams, ``segment_ids`` number them ``0..2B-1`` (-1 on padding), and
    ``consistency_pairs`` int64 ``[C, 2]`` holds (student column, teacher column) in that row.

    Padding values: tokens ``pad_id``, position_ids 0, block_ids -1, ar_targets ``IGNORE_INDEX``.

    Returns:
        dict with int64 ``tokens``, ``position_ids``, ``ar_targets`` (IGNORE_INDEX on noisy streams),
        ``block_ids`` and bool ``valid`` of shape ``[2B, T']`` (pad) or ``[1, L']`` (pack); pad mode:
        bool ``consistency_mask [B, T']``; pack mode: ``consistency_pairs [C, 2]``, ``segment_ids``,
        ``cu_seqlens``, int ``max_seqlen``. Both: int64 ``stream_lens [B]``, ``prompt_lens [B]``,
        ``num_blocks [B]``, float32 ``noise_ratios``/``target_ratios`` ``[sum N]``, ``sample_ids``.

    Raises:
        ValueError: empty batch, bad ``pad_id``/``mode``, or a stream/row longer than ``max_len``.
    """
    _check_batch(samples, pad_id)
    two = [to_two_stream(s) if isinstance(s, PackedSample) else s for s in samples]
    B = len(two)
    lens = [len(s) for s in two]
    out: dict = {
        "stream_lens": torch.tensor(lens, dtype=torch.int64),
        "prompt_lens": torch.tensor([s.prompt_len for s in two], dtype=torch.int64),
        "num_blocks": torch.tensor([s.noise_ratios.shape[0] for s in two], dtype=torch.int64),
        "noise_ratios": torch.cat([s.noise_ratios for s in two]),
        "target_ratios": torch.cat([s.target_ratios for s in two]),
        "sample_ids": [s.sample_id for s in two],
    }
    ignore = [torch.full((n,), IGNORE_INDEX, dtype=torch.int64) for n in lens]
    # Per output stream (noisy streams first in pad mode, interleaved in pack mode): fields in order.
    def stream_fields(s: TwoStreamSample, noisy: bool, ign: torch.Tensor) -> dict[str, torch.Tensor]:
        return {
            "tokens": s.noisy_stream if noisy else s.clean_stream,
            "position_ids": s.position_ids,
            "ar_targets": ign if noisy else s.ar_targets,
            "block_ids": s.block_ids,
        }

    pads = {"tokens": pad_id, "position_ids": 0, "ar_targets": IGNORE_INDEX, "block_ids": -1}
    if mode == "pad":
        T = _target_len(max(lens), max_len, pad_to_multiple_of, f"sample {two[lens.index(max(lens))].sample_id!r}")
        rows = [stream_fields(s, True, ig) for s, ig in zip(two, ignore)] + [
            stream_fields(s, False, ig) for s, ig in zip(two, ignore)
        ]
        row_lens = lens + lens
        for name, pad in pads.items():
            t = torch.full((2 * B, T), pad, dtype=torch.int64)
            for i, r in enumerate(rows):
                t[i, : row_lens[i]] = r[name]
            out[name] = t
        out["valid"] = torch.arange(T)[None, :] < torch.tensor(row_lens)[:, None]
        cm = torch.zeros((B, T), dtype=torch.bool)
        for b, s in enumerate(two):
            cm[b, : lens[b]] = s.consistency_mask
        out["consistency_mask"] = cm
    elif mode == "pack":
        total = 2 * sum(lens)
        Lp = _target_len(total, max_len, pad_to_multiple_of, f"packed row of {B} samples")
        rows, row_lens = [], []
        for s, ig in zip(two, ignore):
            rows += [stream_fields(s, True, ig), stream_fields(s, False, ig)]
            row_lens += [len(s), len(s)]
        for name, pad in pads.items():
            t = torch.full((1, Lp), pad, dtype=torch.int64)
            t[0, :total] = torch.cat([r[name] for r in rows])
            out[name] = t
        starts = [0]
        for n in row_lens:
            starts.append(starts[-1] + n)
        seg = torch.full((1, Lp), -1, dtype=torch.int64)
        seg[0, :total] = torch.repeat_interleave(torch.arange(2 * B), torch.tensor(row_lens))
        out["segment_ids"] = seg
        out["valid"] = seg >= 0
        out["cu_seqlens"] = torch.tensor(starts, dtype=torch.int32)
        out["max_seqlen"] = max(lens)
        pairs = []
        for b, s in enumerate(two):
            j = torch.nonzero(s.consistency_mask).flatten()
            pairs.append(torch.stack([starts[2 * b] + j, starts[2 * b + 1] + j], dim=1))
        out["consistency_pairs"] = torch.cat(pairs)
    else:
        raise ValueError(f"mode must be 'pad' or 'pack', got {mode!r}")
    return out
