"""Prometheus metrics in the text exposition format (version 0.0.4), written by hand (thread-safe).

Metric names (all prefixed ``jf_``):

* ``jf_requests_total{endpoint,code}`` -- finished HTTP generation requests by status code;
* ``jf_prompt_tokens_total`` / ``jf_generation_tokens_total`` -- tokens in / out;
* ``jf_decode_forwards_total`` -- decode forward passes attributed to requests (per row);
* ``jf_cancelled_requests_total`` -- streams whose client disconnected before the end;
* ``jf_batches_total`` -- ``Engine.generate`` calls; ``jf_batch_size`` -- rows per call (histogram);
* ``jf_tokens_per_forward`` -- per-request TPF (histogram);
* ``jf_request_latency_seconds`` -- submit -> last token, per request (histogram);
* ``jf_time_to_first_token_seconds`` -- submit -> first committed token (histogram);
* ``jf_queue_depth`` / ``jf_running_requests`` -- gauges.
"""

from __future__ import annotations

import bisect
import threading

TPF_BUCKETS = (1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 12.0, 16.0)
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


class _Histogram:
    def __init__(self, buckets):
        self.buckets = tuple(float(b) for b in buckets)
        self.counts = [0] * (len(self.buckets) + 1)  # last: +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, v)] += 1
        self.sum += v
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out, acc = [], 0
        for b, c in zip(self.buckets, self.counts):
            acc += c
            out.append(f'{name}_bucket{{le="{b:g}"}} {acc}')
        out.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        out.append(f"{name}_sum {self.sum:.6f}")
        out.append(f"{name}_count {self.count}")
        return out


class Metrics:
    """Counters, gauges and histograms of one server process; :meth:`render` gives the ``/metrics`` body."""

    def __init__(self):
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = {}
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.forwards = 0
        self.batches = 0
        self.cancelled = 0
        self.queue_depth = 0
        self.running = 0
        self.tpf = _Histogram(TPF_BUCKETS)
        self.latency = _Histogram(LATENCY_BUCKETS)
        self.ttft = _Histogram(LATENCY_BUCKETS)
        self.batch_size = _Histogram(BATCH_BUCKETS)

    def request_done(self, endpoint: str, code: int) -> None:
        """Count one finished HTTP request (``code``: HTTP status)."""
        with self._lock:
            self.requests[(endpoint, code)] = self.requests.get((endpoint, code), 0) + 1

    def generation_done(self, prompt_tokens: int, tokens: int, forwards: int, latency_s: float,
                        ttft_s: float | None) -> None:
        """Record one finished generation (one batch row)."""
        with self._lock:
            self.prompt_tokens += prompt_tokens
            self.generation_tokens += tokens
            self.forwards += forwards
            if forwards > 0:
                self.tpf.observe(tokens / forwards)
            self.latency.observe(latency_s)
            if ttft_s is not None:
                self.ttft.observe(ttft_s)

    def request_cancelled(self) -> None:
        """Count one request cancelled by its client (disconnect mid-stream)."""
        with self._lock:
            self.cancelled += 1

    def batch_done(self, size: int) -> None:
        with self._lock:
            self.batches += 1
            self.batch_size.observe(size)

    def set_gauges(self, queue_depth: int, running: int) -> None:
        with self._lock:
            self.queue_depth, self.running = queue_depth, running

    def render(self) -> str:
        """The Prometheus text exposition of every metric."""
        with self._lock:
            L = ["# HELP jf_requests_total Finished HTTP generation requests.", "# TYPE jf_requests_total counter"]
            for (ep, code), n in sorted(self.requests.items()):
                L.append(f'jf_requests_total{{endpoint="{ep}",code="{code}"}} {n}')
            for name, help_, v in (("jf_prompt_tokens_total", "Prompt tokens of finished generations.", self.prompt_tokens),
                                   ("jf_generation_tokens_total", "Generated tokens.", self.generation_tokens),
                                   ("jf_decode_forwards_total", "Decode forward passes (per request row).", self.forwards),
                                   ("jf_batches_total", "Engine.generate calls.", self.batches),
                                   ("jf_cancelled_requests_total", "Requests cancelled by client disconnect.",
                                    self.cancelled)):
                L += [f"# HELP {name} {help_}", f"# TYPE {name} counter", f"{name} {v}"]
            for name, help_, v in (("jf_queue_depth", "Requests waiting for a batch.", self.queue_depth),
                                   ("jf_running_requests", "Requests in the running batch.", self.running)):
                L += [f"# HELP {name} {help_}", f"# TYPE {name} gauge", f"{name} {v}"]
            for name, help_, h in (("jf_tokens_per_forward", "Tokens per decode forward, per request.", self.tpf),
                                   ("jf_request_latency_seconds", "Submit to last token, per request.", self.latency),
                                   ("jf_time_to_first_token_seconds", "Submit to first token, per request.", self.ttft),
                                   ("jf_batch_size", "Rows per Engine.generate call.", self.batch_size)):
                L += [f"# HELP {name} {help_}", f"# TYPE {name} histogram"] + h.lines(name)
            return "\n".join(L) + "\n"
