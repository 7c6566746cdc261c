"""Continuous-batching scheduler: one thread steps an :class:`~megatron_jf.inference.engine.BatchSession`.

Every engine step decodes all running requests in one forward, whatever their
:class:`~megatron_jf.inference.request.Request` (decoder, block size, sampling parameters, ``max_new_tokens``, EOS
ids, stop strings): each row carries its own. Between steps the thread

* drops rows whose client went away (:meth:`GenRequest.cancel`): they take no further forward, and their
  tokens are not counted as generated;
* admits waiting requests into free rows (up to ``max_batch``); they are prefilled at the next step and
  join its decode forward, without waiting for the running requests to finish.

When the engine is idle and a request arrives, the thread waits ``batch_wait_s`` so that requests sent
together are prefilled together. A row's output does not depend on the rows next to it, so a greedy
request returns what offline :meth:`Engine.generate <megatron_jf.inference.engine.Engine.generate>`
returns for its prompt, and a seeded sampled one what offline generate with that seed returns.

Streaming. The session's ``on_tokens`` pushes each group of final tokens to the request's asyncio queue
(thread-safe, via ``loop.call_soon_threadsafe``) as ``("tokens", ids)``; the end of the request is
``("done", GenerationResult)`` (with ``queue_s`` set) or ``("error", exception)``.

Admission is the session's :class:`~megatron_jf.inference.slots.SlotTable`: a request joins while the table has free
rows, and :meth:`BatchSession.add <megatron_jf.inference.session.BatchSession.add>` checks it (context window, forward
budget, KV slots); one that does not fit ends with an ``("error", ValueError)`` event. The server's protocol has
checked it against the context window before (:func:`megatron_jf.inference.request.check`).

Tensor parallelism. With ``broadcast=True`` each step's changes (rows added, as ``(prompt, Request)`` pairs;
rows removed) are sent from rank 0 with ``torch.distributed.broadcast_object_list`` before
the step; other ranks run :func:`follower_loop`, which applies the same changes to their own session and
steps it, so all ranks make the same forwards. While idle, rank 0 broadcasts a no-op every
``heartbeat_s`` seconds so followers' collectives never time out.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from megatron_jf.inference.engine import Engine
from megatron_jf.inference.request import Request

log = logging.getLogger("megatron_jf.server")


class QueueFullError(RuntimeError):
    """The scheduler's waiting queue is at ``max_queue``; the server answers 503."""


class SchedulerStoppedError(RuntimeError):
    """The scheduler was shut down; no more requests are accepted."""


_ids = itertools.count()


@dataclass
class GenRequest:
    """One queued generation: a prompt, its :class:`~megatron_jf.inference.request.Request` (as the protocol parsed
    it; passed to the session unchanged) and where its events go.

    Attributes:
        prompt: prompt token ids (non-empty).
        request: the settings (decode config, sampling, ``max_new_tokens``, EOS ids, stop strings, seed).
        loop, queue: where events go.
        id, submitted, started, first_token, finished, cancelled: bookkeeping (``time.perf_counter`` seconds).
    """

    prompt: list[int]
    request: Request
    loop: asyncio.AbstractEventLoop | None = None
    queue: asyncio.Queue | None = None
    id: int = field(default_factory=lambda: next(_ids))
    submitted: float = 0.0
    started: float | None = None
    first_token: float | None = None
    finished: float | None = None
    cancelled: bool = False

    def cancel(self) -> None:
        """Mark the request cancelled: dropped if still waiting, removed from the batch at the next step
        if running."""
        self.cancelled = True

    def _emit(self, kind: str, payload) -> None:
        if self.loop is None or self.queue is None:
            return
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (kind, payload))
        except RuntimeError:  # the event loop is closed (server shutting down)
            pass


def _apply(sess, op: dict) -> list[int | Exception]:
    """Apply one step's changes to ``sess``: remove keys, add ``(prompt, Request)`` rows. Returns the new keys (or
    the ValueError of a row that could not be added), in order."""
    for k in op["remove"]:
        sess.remove(k)
    keys = []
    for prompt, request in op["add"]:
        try:
            keys.append(sess.add(prompt, request))
        except ValueError as e:
            keys.append(e)
    return keys


class Scheduler:
    """Runs requests with continuous batching on a background thread.

    Args:
        engine: the decoding engine.
        detokenize: ``ids -> str`` for stop strings (``tokenizer.decode``).
        max_batch: most requests decoding at once (KV-cache rows).
        max_queue: most waiting requests; :meth:`submit` raises :class:`QueueFullError` beyond it.
        batch_wait_s: when the engine is idle and a request arrives, wait this long (seconds) for more
            requests before the first step, so that requests sent together are prefilled together.
        max_width: most tokens one request may forward per step (the per-request parallel-token budget,
            see :func:`~megatron_jf.inference.engine.forward_width`).
        broadcast: tensor-parallel serving -- broadcast each step's changes from rank 0 (module docstring).
        heartbeat_s: idle no-op broadcast period (seconds; ``broadcast`` only).
        metrics: optional :class:`~megatron_jf.server.metrics.Metrics`.
        group: the process group of the broadcasts.

    Attributes:
        steps_run: engine steps run so far (``/health`` reports it as ``batches_run``).
    """

    def __init__(self, engine: Engine, detokenize=None, *, max_batch: int = 32, max_queue: int = 256,
                 batch_wait_s: float = 0.02, max_width: int = 512, broadcast: bool = False,
                 heartbeat_s: float = 60.0, metrics=None, group=None):
        if max_batch < 1 or max_queue < 1 or max_width < 1:
            raise ValueError(f"max_batch, max_queue and max_width must be >= 1, got {max_batch}, {max_queue}, "
                             f"{max_width}")
        self.engine = engine
        self.detokenize = detokenize
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.batch_wait_s = batch_wait_s
        self.max_width = max_width
        self.broadcast = broadcast
        self.heartbeat_s = heartbeat_s
        self.metrics = metrics
        self.group = group
        self._waiting: deque[GenRequest] = deque()
        self._cv = threading.Condition()
        self._stop = False
        self._live: dict[int, GenRequest] = {}  # session key -> request
        self.steps_run = 0
        self._thread = threading.Thread(target=self._loop, name="jf-scheduler", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ public
    @property
    def max_context(self) -> int:
        return self.engine.max_context

    def submit(self, req: GenRequest) -> GenRequest:
        """Queue a request; events arrive on ``req.queue``.

        Raises:
            QueueFullError: ``max_queue`` requests are already waiting.
            SchedulerStoppedError: after :meth:`shutdown`.
        """
        with self._cv:
            if self._stop:
                raise SchedulerStoppedError("the scheduler is shut down")
            if len(self._waiting) >= self.max_queue:
                raise QueueFullError(f"the request queue is full ({self.max_queue} waiting)")
            req.submitted = time.perf_counter()
            self._waiting.append(req)
            self._gauges()
            self._cv.notify()
        return req

    def queue_depth(self) -> int:
        with self._cv:
            return len(self._waiting)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop accepting requests, fail waiting and running ones, stop the thread (and, with
        ``broadcast``, tell followers to exit)."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout)

    # ------------------------------------------------------------------ thread
    def _gauges(self):
        if self.metrics is not None:
            self.metrics.set_gauges(len(self._waiting), len(self._live))

    def _bcast(self, payload):
        if not self.broadcast:
            return
        import torch.distributed as dist

        dist.broadcast_object_list([payload], src=0, group=self.group)

    def _loop(self):
        sess = self.engine.open_batch(self.max_batch, max_width=self.max_width, detokenize=self.detokenize)
        while True:
            with self._cv:
                deadline = time.monotonic() + self.heartbeat_s
                while not self._waiting and not self._live and not self._stop:
                    left = deadline - time.monotonic()
                    if self.broadcast and left <= 0:
                        break
                    self._cv.wait(timeout=left if self.broadcast else None)
                if self._stop:
                    leftover = list(self._waiting) + list(self._live.values())
                    self._waiting.clear()
                    self._live.clear()
                    break
                idle = not self._waiting and not self._live
                fresh = not self._live
            if idle:  # heartbeat for tensor-parallel followers
                self._bcast({"op": "noop"})
                continue
            if fresh and self.batch_wait_s > 0:
                time.sleep(self.batch_wait_s)
            with self._cv:
                removed = [k for k, r in self._live.items() if r.cancelled]
                for k in removed:
                    del self._live[k]
                admitted = []
                free = sess.free + len(removed)  # the slot table's free rows once the cancelled rows leave
                while self._waiting and len(admitted) < free:
                    r = self._waiting.popleft()
                    if not r.cancelled:
                        admitted.append(r)
            op = {"op": "step", "remove": removed, "add": [(r.prompt, r.request) for r in admitted]}
            try:
                self._bcast(op)
                keys = _apply(sess, op)
                now = time.perf_counter()
                for r, k in zip(admitted, keys):
                    if isinstance(k, Exception):
                        r._emit("error", k)
                        continue
                    r.started = now
                    self._live[k] = r
                with self._cv:
                    self._gauges()
                rows = sess.num_rows
                done = sess.step(self._on_tokens) if rows else []
            except Exception as e:  # noqa: BLE001 -- every running request gets the error
                log.exception("engine step failed")
                for r in self._live.values():
                    r._emit("error", e)
                self._live.clear()
                sess = self.engine.open_batch(self.max_batch, max_width=self.max_width, detokenize=self.detokenize)
                continue
            self.steps_run += 1
            if self.metrics is not None and rows:
                self.metrics.step_done(rows)
            t = time.perf_counter()
            # the finished rows leave the running gauge before any of them is handed back: a client that reads
            # /metrics after its response sees its request no longer running
            with self._cv:
                finished = [(self._live.pop(k), res) for k, res in done]
                if done:
                    self._gauges()
            for r, res in finished:
                r.finished = t
                res.queue_s = (r.started or r.submitted) - r.submitted
                if self.metrics is not None:
                    self.metrics.generation_done(res, t - r.submitted,
                                                 None if r.first_token is None else r.first_token - r.submitted)
                if not r.cancelled:
                    r._emit("done", res)
        for r in leftover:
            r._emit("error", SchedulerStoppedError("the server is shutting down"))
        self._bcast(None)

    def _on_tokens(self, key: int, ids: list[int]) -> None:
        r = self._live.get(key)
        if r is None:
            return
        if r.first_token is None:
            r.first_token = time.perf_counter()
        if not r.cancelled:
            r._emit("tokens", ids)


def follower_loop(engine: Engine, detokenize, group=None, *, max_batch: int = 32, max_width: int = 512) -> None:
    """Tensor-parallel ranks > 0: receive each step's changes from rank 0, apply them to a session of
    the same shape and step it, until rank 0 broadcasts ``None`` (shutdown). Errors in a step are
    swallowed here (rank 0 reports them) and the session is reopened, as on rank 0."""
    import torch.distributed as dist

    sess = engine.open_batch(max_batch, max_width=max_width, detokenize=detokenize)
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=group)
        op = box[0]
        if op is None:
            return
        if op.get("op") != "step":
            continue
        try:
            _apply(sess, op)
            if sess.num_rows:
                sess.step()
        except Exception:  # noqa: BLE001 -- rank 0 raises the same error and answers the client
            sess = engine.open_batch(max_batch, max_width=max_width, detokenize=detokenize)
