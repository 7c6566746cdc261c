"""The slot table of a batch: which request holds which KV-cache row, admission, compaction and swaps.

Live rows occupy a compact prefix of the cache's rows (row ``i`` of :attr:`SlotTable.rows` sits in cache row
``i``), so a forward covers only live rows: a finishing row's slot is filled by the last live row
(:meth:`SlotTable.release`), and two rows can trade places (:meth:`SlotTable.swap`, used to put the wide rows of a
split step first). Requests wait in :attr:`SlotTable.pending` until the next step prefills them into free rows.
Admission (:meth:`SlotTable.check`) checks a request against this batch -- a free row, the per-row forward budget,
the KV slots -- and against the context window through :func:`megatron_jf.inference.request.check`, the one
definition of that check (the server's protocol calls it too, against the server's window, to answer 400 before
queueing).
"""

from __future__ import annotations

from megatron_jf.decoding import forward_width
from megatron_jf.inference.request import Request, check


class SlotTable:
    """Rows of one batch over a :class:`~megatron_jf.models.kv_cache.KVCache` of ``capacity`` rows.

    Args:
        cache: the batch's cache (owned by the :class:`~megatron_jf.inference.runner.ModelRunner`).
        capacity: most rows at once (decoding or waiting for their prefill).
        max_context: the model's context window, tokens.
        max_width: most tokens one row may forward per step (:func:`~megatron_jf.decoding.forward_width`).
        max_len: KV slots per row.

    Rows are any objects with a ``slot`` attribute (set here) and a ``key``.
    """

    def __init__(self, cache, capacity: int, *, max_context: int, max_width: int, max_len: int):
        self.cache = cache
        self.capacity = capacity
        self.max_context = max_context
        self.max_width = max_width
        self.max_len = max_len
        self.rows: list = []      # live rows; rows[i] sits in cache row i
        self.pending: list = []   # admitted, not prefilled yet

    @property
    def num_rows(self) -> int:
        """Rows decoding or waiting for their prefill."""
        return len(self.rows) + len(self.pending)

    @property
    def free(self) -> int:
        """Rows that can still be admitted."""
        return self.capacity - self.num_rows

    def check(self, prompt, request: Request, *, detokenize=None) -> None:
        """Whether ``request`` for ``prompt`` (token ids) can join now: a free row; stop strings only with
        ``detokenize``; the prompt within the context window (:func:`~megatron_jf.inference.request.check`); the
        config's width within ``max_width``; prompt + ``max_new_tokens`` + width within the row's ``max_len`` slots.

        Raises:
            ValueError: no free row, or the request does not fit (message names the limit and ``request.name``).
        """
        if self.free <= 0:
            raise ValueError(f"the batch is full ({self.capacity} rows)")
        if request.stop_strings and detokenize is None:
            raise ValueError("stop strings need a detokenize function")
        check(request, len(prompt), self.max_context)
        w = forward_width(request.decode)
        if w > self.max_width:
            raise ValueError(f"decode config forwards {w} tokens per step; this batch allows at most {self.max_width}")
        if len(prompt) + request.max_new_tokens + w + 1 > self.max_len:
            raise ValueError(f"{request.name}: prompt + max_new_tokens + {w} draft tokens exceed the KV cache "
                             f"({self.max_len} slots)")

    def place(self, rows: list) -> int:
        """Give ``rows`` (just prefilled) the next free cache rows, in order; returns the first row index."""
        base = len(self.rows)
        for i, r in enumerate(rows):
            r.slot = base + i
            self.rows.append(r)
        return base

    def remove(self, key) -> bool:
        """Drop the row with ``key`` (waiting or live; a live row's slot is released). False when absent."""
        for i, r in enumerate(self.pending):
            if r.key == key:
                del self.pending[i]
                return True
        for i, r in enumerate(self.rows):
            if r.key == key:
                self.release(i)
                return True
        return False

    def release(self, i: int) -> None:
        """Free cache row ``i``: the last live row moves into it, so live rows stay a prefix."""
        last = len(self.rows) - 1
        if i != last:
            moved = self.rows[last]
            self.cache.copy_row(last, i)
            moved.slot = i
            self.rows[i] = moved
        self.cache.lengths[last] = 0
        self.rows.pop()

    def swap(self, i: int, j: int) -> None:
        """Exchange rows ``i`` and ``j`` (their committed keys/values, lengths and slots)."""
        c = self.cache
        li, lj = int(c.lengths[i]), int(c.lengths[j])
        ki, vi = c.k[:, i, :, :li].clone(), c.v[:, i, :, :li].clone()
        c.k[:, i, :, :lj] = c.k[:, j, :, :lj]
        c.v[:, i, :, :lj] = c.v[:, j, :, :lj]
        c.k[:, j, :, :li] = ki
        c.v[:, j, :, :li] = vi
        c.lengths[i], c.lengths[j] = lj, li
        rows = self.rows
        rows[i], rows[j] = rows[j], rows[i]
        rows[i].slot, rows[j].slot = i, j
