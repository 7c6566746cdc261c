"""Data streams of the training loop: endless, exactly resumable microbatch iterators.

* :class:`DatasetSpec` is what a datasets provider returns for one split (dataset + collate).
* :class:`MicrobatchStream` iterates collated microbatches over epochs with a ``(epoch, consumed)`` position.
* :class:`AnchoredStream` appends real-text anchor rows to each JF microbatch (``--anchor-data``).
* :func:`eval_batches` is one pass over the validation split.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator

__all__ = ["DatasetSpec", "MicrobatchStream", "AnchoredStream", "eval_batches"]


@dataclass
class DatasetSpec:
    """What a datasets provider returns for one split.

    Attributes:
        dataset: an iterable dataset with ``set_epoch(e)``, ``set_start(n)`` and ``samples_per_rank``
            (e.g. :class:`~megatron_jf.data.dataset.TrajectoryDataset`,
            :class:`~megatron_jf.data.text.TokenChunkDataset`), already split for this DP rank.
        collate: list of samples -> batch with ``.to(device)`` and ``.num_tokens``.
    """

    dataset: Any
    collate: Callable[[list], Any]


class MicrobatchStream:
    """Endless iterator of collated microbatches over epochs, with an exact resume position.

    The position is ``(epoch, samples consumed in that epoch)`` counted where samples are *consumed*
    (not where workers prefetch), so :meth:`state_dict` after step ``k`` plus
    :meth:`load_state_dict` reproduces the rest of the stream exactly.

    Raises:
        ValueError: (on iteration) the dataset yields no sample for this rank.
    """

    def __init__(self, spec: DatasetSpec, micro_batch_size: int, num_workers: int = 0):
        self.spec = spec
        self.mb = micro_batch_size
        self.num_workers = num_workers
        self.epoch = 0
        self.consumed = 0
        self.tokens = 0
        self._it: Iterator | None = None

    def _open(self) -> Iterator:
        ds = self.spec.dataset
        ds.set_epoch(self.epoch)
        ds.set_start(self.consumed)
        if self.num_workers:
            from torch.utils.data import DataLoader

            return iter(DataLoader(ds, batch_size=None, num_workers=self.num_workers))
        return iter(ds)

    def __iter__(self):
        return self

    def __next__(self):
        samples = []
        while len(samples) < self.mb:
            if self._it is None:
                self._it = self._open()
            try:
                s = next(self._it)
            except StopIteration:
                if self.consumed == 0:
                    raise ValueError("the training data yields no samples for this data-parallel rank") from None
                self.epoch += 1
                self.consumed = 0
                self._it = None
                continue
            samples.append(s)
            self.consumed += 1
        batch = self.spec.collate(samples)
        self.tokens += int(batch.num_tokens)
        return batch

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "consumed": self.consumed}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = int(state["epoch"])
        self.consumed = int(state["consumed"])
        self._it = None


class AnchoredStream:
    """JF microbatches with anchor text rows appended (``--anchor-data``), advancing both streams in lockstep.

    Args:
        jf: the JF :class:`MicrobatchStream`.
        anchor: a :class:`MicrobatchStream` of :class:`~megatron_jf.data.text.TextBatch` (``A`` rows each).
        combine: ``(JFBatch, TextBatch) -> JFBatch`` (e.g. a partial of
            :func:`~megatron_jf.training.attention_paths.append_anchor_rows`).

    ``tokens`` counts the model-input tokens of both streams; the positions (and so the exact resume)
    are the two streams' own :meth:`MicrobatchStream.state_dict`.
    """

    def __init__(self, jf: MicrobatchStream, anchor: MicrobatchStream, combine: Callable[[Any, Any], Any]):
        self.jf = jf
        self.anchor = anchor
        self.combine = combine

    def __iter__(self):
        return self

    def __next__(self):
        batch = next(self.jf)
        return self.combine(batch, next(self.anchor))

    @property
    def tokens(self) -> int:
        return self.jf.tokens + self.anchor.tokens


def eval_batches(spec: DatasetSpec, mb: int, limit: int) -> Iterator:
    """At most ``limit`` collated microbatches of ``mb`` samples from the start of ``spec`` (epoch 0)."""
    ds = spec.dataset
    ds.set_epoch(0)
    ds.set_start(0)
    buf, n = [], 0
    for s in ds:
        buf.append(s)
        if len(buf) == mb:
            yield spec.collate(buf)
            buf, n = [], n + 1
            if n >= limit:
                return
