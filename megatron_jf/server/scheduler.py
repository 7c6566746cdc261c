"""Batching scheduler: one thread collects waiting requests and runs them together as one
:meth:`Engine.generate <megatron_jf.inference.engine.Engine.generate>` call.

Grouping. One ``generate`` call takes one :class:`DecodeConfig`, one :class:`SamplingParams`, one
``max_new_tokens`` and one set of stop strings, so a batch holds requests that agree on:

* the decode config (decoder and its parameters);
* the sampling mode: greedy requests batch together; sampled requests without a seed batch together
  when temperature/top-k/top-p agree (the batch gets a fresh random seed); a sampled request *with*
  a seed runs alone, so that its output equals offline ``generate([prompt], seed=seed)`` (the engine
  gives row ``i`` the seed ``seed + i``);
* the stop strings, and -- only when there are stop strings -- ``max_tokens``.

Requests with different ``max_tokens`` (and no stop strings) share a batch run for the largest
``max_tokens``; each row is cut at its own cap (tokens past it are neither streamed nor returned, and
the finish reason becomes ``length``). Rows decode independently and greedy/verified decoding is exact,
so a row's output does not depend on the batch it ran in. A request is only added to a batch when
every row still fits the context window with the batch's ``max_new_tokens``.

Streaming. ``on_tokens`` pushes each committed group of tokens to the request's asyncio queue
(thread-safe, via ``loop.call_soon_threadsafe``) as ``("tokens", ids)``; the end of the request is
``("done", RequestOutput)`` or ``("error", exception)``.

Cancellation. :meth:`GenRequest.cancel` (e.g. the client disconnected mid-stream) removes a waiting
request from the queue; a request already in a running batch keeps its row (the engine cannot drop a
row mid-call) -- the row finishes with the batch and its output is discarded.

Tensor parallelism. With ``broadcast=True`` every batch (token ids + parameters) is sent from rank 0
with ``torch.distributed.broadcast_object_list`` before ``generate``; other ranks run
:func:`follower_loop`, which receives each batch and makes the same ``generate`` call. While idle,
rank 0 broadcasts a no-op every ``heartbeat_s`` seconds so followers' collectives never time out.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from megatron_jf.inference.engine import DecodeConfig, Engine, GenerationResult
from megatron_jf.inference.sampling import SamplingParams


class QueueFullError(RuntimeError):
    """The scheduler's waiting queue is at ``max_queue``; the server answers 503."""


class SchedulerStoppedError(RuntimeError):
    """The scheduler was shut down; no more requests are accepted."""


_ids = itertools.count()


@dataclass
class RequestOutput:
    """Result of one request (one batch row).

    Attributes:
        tokens: emitted ids, cut at the request's own ``max_tokens`` (EOS included when it ended it).
        finish_reason: ``eos``, ``stop`` (a stop string) or ``length``.
        forwards: decode forwards the row took until it finished (or until it reached its own cap).
        prompt_len: prompt tokens.
        batch_size: rows in the ``generate`` call.
        prefill_s, decode_s: engine wall seconds (prefill of the whole batch; this row's decode).
        queue_s: seconds between submit and the start of its batch.
    """

    tokens: list[int]
    finish_reason: str
    forwards: int
    prompt_len: int
    batch_size: int
    prefill_s: float
    decode_s: float
    queue_s: float

    @property
    def tpf(self) -> float:
        """Tokens per decode forward."""
        return len(self.tokens) / max(self.forwards, 1)


@dataclass
class GenRequest:
    """One generation request (one prompt).

    Attributes:
        prompt: prompt token ids (non-empty).
        max_tokens: cap on emitted tokens (>= 1; prompt + cap must fit the context).
        config: decoder and its parameters.
        sampling: sampling parameters (``temperature == 0``: greedy).
        seeded: the client gave a seed (sampled requests with a seed run alone).
        stop: stop strings.
        eos_ids: ids that end the request (kept as its last token).
        loop, queue: where events go (``None`` queue: no streaming, only the ``done`` event is needed --
            :attr:`future`-style waiting through the same queue).
    """

    prompt: list[int]
    max_tokens: int
    config: DecodeConfig
    sampling: SamplingParams
    stop: tuple[str, ...] = ()
    eos_ids: frozenset = frozenset()
    seeded: bool = False
    loop: asyncio.AbstractEventLoop | None = None
    queue: asyncio.Queue | None = None
    id: int = field(default_factory=lambda: next(_ids))
    submitted: float = 0.0
    first_token: float | None = None
    finished: float | None = None
    cancelled: bool = False
    _sent: int = 0  # tokens streamed so far

    def cancel(self) -> None:
        """Mark the request cancelled: dropped if still waiting; output discarded if running."""
        self.cancelled = True

    def group_key(self) -> tuple:
        """Requests with equal keys can share one ``generate`` call (see the module docstring)."""
        s = self.sampling
        if s.greedy:
            samp = ("greedy",)
        elif self.seeded:
            samp = ("seeded", self.id)  # alone
        else:
            samp = ("sampled", s.temperature, s.top_k, s.top_p)
        return (self.config, samp, self.stop, self.max_tokens if self.stop else None, self.eos_ids)

    def _emit(self, kind: str, payload) -> None:
        if self.loop is None or self.queue is None:
            return
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (kind, payload))
        except RuntimeError:  # the event loop is closed (server shutting down)
            pass


class Scheduler:
    """Collects requests and runs them in batches on a background thread.

    Args:
        engine: the decoding engine.
        detokenize: ``ids -> str`` for stop strings (``tokenizer.decode``).
        max_batch: most requests per ``generate`` call.
        max_queue: most waiting requests; :meth:`submit` raises :class:`QueueFullError` beyond it.
        batch_wait_s: before each batch is formed (after the first request arrives, and after the
            previous batch ends) wait this long (seconds) for more requests to join. Without it, closed-loop
            clients split into groups that alternate (the clients of the batch that just ended resubmit
            after the next batch was taken); 20 ms costs little latency and keeps them in one batch.
        broadcast: tensor-parallel serving -- broadcast each batch from rank 0 (see module docstring).
        heartbeat_s: idle no-op broadcast period (seconds; ``broadcast`` only).
        metrics: optional :class:`~megatron_jf.server.metrics.Metrics`.
    """

    def __init__(self, engine: Engine, detokenize=None, *, max_batch: int = 32, max_queue: int = 256,
                 batch_wait_s: float = 0.02, broadcast: bool = False, heartbeat_s: float = 60.0,
                 metrics=None, group=None):
        if max_batch < 1 or max_queue < 1:
            raise ValueError(f"max_batch and max_queue must be >= 1, got {max_batch}, {max_queue}")
        self.engine = engine
        self.detokenize = detokenize
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.batch_wait_s = batch_wait_s
        self.broadcast = broadcast
        self.heartbeat_s = heartbeat_s
        self.metrics = metrics
        self.group = group
        self._waiting: deque[GenRequest] = deque()
        self._cv = threading.Condition()
        self._stop = False
        self._running = 0
        self.batches_run = 0
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
            ValueError: the prompt is empty or prompt + ``max_tokens`` exceeds the context window.
        """
        if not req.prompt:
            raise ValueError("prompt is empty")
        if req.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {req.max_tokens}")
        if len(req.prompt) + req.max_tokens > self.max_context:
            raise ValueError(f"prompt ({len(req.prompt)} tokens) + max_tokens ({req.max_tokens}) exceeds the "
                             f"context window of {self.max_context} tokens")
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
        """Stop accepting requests, finish the running batch, fail waiting requests, stop the thread
        (and, with ``broadcast``, tell followers to exit)."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout)

    # ------------------------------------------------------------------ thread
    def _gauges(self):
        if self.metrics is not None:
            self.metrics.set_gauges(len(self._waiting), self._running)

    def _take_batch(self) -> list[GenRequest]:
        """Pop the oldest request's group (called with the lock held)."""
        while self._waiting and self._waiting[0].cancelled:
            self._waiting.popleft()
        if not self._waiting:
            return []
        head = self._waiting[0]
        key = head.group_key()
        batch, rest = [], deque()
        max_new, max_prompt = 0, 0
        ctx = self.max_context
        for r in self._waiting:
            if r.cancelled:
                continue
            if len(batch) < self.max_batch and r.group_key() == key:
                new_max = max(max_new, r.max_tokens)
                if max(max_prompt, len(r.prompt)) + new_max <= ctx:
                    batch.append(r)
                    max_new, max_prompt = new_max, max(max_prompt, len(r.prompt))
                    continue
            rest.append(r)
        self._waiting = rest
        return batch

    def _loop(self):
        while True:
            with self._cv:
                deadline = time.monotonic() + self.heartbeat_s
                while not self._waiting and not self._stop:
                    left = deadline - time.monotonic()
                    if self.broadcast and left <= 0:
                        break
                    self._cv.wait(timeout=left if self.broadcast else None)
                if self._stop:
                    leftover = list(self._waiting)
                    self._waiting.clear()
                    break
                idle = not self._waiting
            if idle:  # heartbeat for tensor-parallel followers
                self._bcast({"op": "noop"})
                continue
            if self.batch_wait_s > 0:
                time.sleep(self.batch_wait_s)
            with self._cv:
                batch = self._take_batch()
                self._running = len(batch)
                self._gauges()
            if batch:
                self._run(batch)
            with self._cv:
                self._running = 0
                self._gauges()
        for r in leftover:
            r._emit("error", SchedulerStoppedError("the server is shutting down"))
        self._bcast(None)

    def _bcast(self, payload):
        if not self.broadcast:
            return
        import torch.distributed as dist

        dist.broadcast_object_list([payload], src=0, group=self.group)

    def _run(self, batch: list[GenRequest]) -> None:
        t_start = time.perf_counter()
        head = batch[0]
        max_new = max(r.max_tokens for r in batch)
        sampling = head.sampling
        if not sampling.greedy and not head.seeded:
            sampling = SamplingParams(sampling.temperature, sampling.top_k, sampling.top_p,
                                      seed=random.randrange(1 << 31))
        payload = {"op": "generate", "prompts": [r.prompt for r in batch], "config": head.config,
                   "max_new_tokens": max_new, "sampling": sampling, "eos_ids": head.eos_ids, "stop": head.stop}

        def on_tokens(row: int, ids: list[int]) -> None:
            r = batch[row]
            room = r.max_tokens - r._sent
            if room <= 0:
                return
            ids = ids[:room]
            r._sent += len(ids)
            if r.first_token is None:
                r.first_token = time.perf_counter()
            if not r.cancelled:
                r._emit("tokens", ids)

        try:
            self._bcast(payload)
            results = run_payload(self.engine, payload, self.detokenize, on_tokens)
        except Exception as e:  # noqa: BLE001 -- every request of the batch gets the error
            for r in batch:
                r._emit("error", e)
            return
        finally:
            self.batches_run += 1
        now = time.perf_counter()
        if self.metrics is not None:
            self.metrics.batch_done(len(batch))
        for r, res in zip(batch, results):
            out = _cut(r, res, len(batch), t_start - r.submitted)
            r.finished = now
            if self.metrics is not None:
                self.metrics.generation_done(len(r.prompt), len(out.tokens), out.forwards, now - r.submitted,
                                             None if r.first_token is None else r.first_token - r.submitted)
            if not r.cancelled:
                r._emit("done", out)


def _cut(r: GenRequest, res: GenerationResult, batch_size: int, queue_s: float) -> RequestOutput:
    """The row's result cut at the request's own ``max_tokens`` (forwards counted up to the cap)."""
    toks, finish, forwards = res.tokens, res.finish_reason, res.forwards
    if len(toks) > r.max_tokens:
        toks = toks[: r.max_tokens]
        finish = "eos" if toks[-1] in r.eos_ids else "length"
        acc, forwards = 0, 0
        for a in res.accepted:
            forwards += 1
            acc += a
            if acc >= r.max_tokens:
                break
    return RequestOutput(tokens=list(toks), finish_reason=finish, forwards=forwards, prompt_len=len(r.prompt),
                         batch_size=batch_size, prefill_s=res.prefill_s, decode_s=res.decode_s, queue_s=queue_s)


def run_payload(engine: Engine, payload: dict, detokenize, on_tokens=None) -> list[GenerationResult]:
    """The ``generate`` call a broadcast payload describes (identical on every tensor-parallel rank)."""
    return engine.generate(payload["prompts"], payload["config"], max_new_tokens=payload["max_new_tokens"],
                           sampling=payload["sampling"], eos_ids=payload["eos_ids"],
                           stop_strings=payload["stop"], detokenize=detokenize if payload["stop"] else None,
                           on_tokens=on_tokens)


def follower_loop(engine: Engine, detokenize, group=None) -> None:
    """Tensor-parallel ranks > 0: receive batches from rank 0 and run the same ``generate`` calls,
    until rank 0 broadcasts ``None`` (shutdown). Errors in a batch are swallowed here (rank 0 reports
    them), so the ranks stay in step."""
    import torch.distributed as dist

    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=group)
        payload = box[0]
        if payload is None:
            return
        if payload.get("op") != "generate":
            continue
        try:
            run_payload(engine, payload, detokenize)
        except Exception:  # noqa: BLE001 -- rank 0 raises the same error and answers the client
            pass
