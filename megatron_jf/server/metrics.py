"""Prometheus metrics of one server process, through ``prometheus_client`` (one private registry each).

vLLM's names, so that existing dashboards work (label ``model_name``):

* ``vllm:spec_decode_num_drafts_total`` -- decode forwards that verified a draft (AR forwards verify none);
* ``vllm:spec_decode_num_draft_tokens_total`` -- draft tokens verified (the winning branch of each forward);
* ``vllm:spec_decode_num_accepted_tokens_total`` -- draft tokens accepted (the correction/bonus token
  each forward adds is not a draft token);
* ``vllm:spec_decode_num_accepted_tokens_per_pos_total{position}`` -- accepted draft tokens by position in
  the draft (position 0 = the first draft token), so that ``sum over positions == accepted``;
* ``vllm:request_success_total{finished_reason}`` -- finished generations (``stop`` includes EOS;
  ``length``); ``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total``;
* ``vllm:e2e_request_latency_seconds``, ``vllm:time_to_first_token_seconds`` (histograms);
* ``vllm:num_requests_running``, ``vllm:num_requests_waiting`` (gauges).

megatron-jf's own (``jf_``):

* ``jf_requests_total{endpoint,code}`` -- HTTP generation requests by *final* status: a stream that ends
  with an error event counts as 500, one whose client disconnected as 499 (nginx's "client closed");
* ``jf_cancelled_requests_total`` -- requests whose client disconnected before the end (their tokens are
  not in the generation counters);
* ``jf_decode_forwards_total`` -- decode forward passes attributed to requests (per row);
* ``jf_tokens_per_forward`` -- per-request TPF (histogram); ``jf_request_latency_seconds`` (histogram);
* ``jf_engine_steps_total``, ``jf_batch_size`` -- engine steps and rows per step (histogram).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

TPF_BUCKETS = (1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 12.0, 16.0)
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    """Counters, gauges and histograms of one server; :meth:`render` gives the ``/metrics`` body.

    Args:
        model_name: the ``model_name`` label of the vLLM-named metrics.
    """

    def __init__(self, model_name: str = "megatron-jf"):
        self.model_name = model_name
        self.registry = reg = CollectorRegistry(auto_describe=True)
        m = ["model_name"]
        self._drafts = Counter("vllm:spec_decode_num_drafts", "Decode forwards that verified a draft.", m,
                               registry=reg)
        self._draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Draft tokens verified.", m, registry=reg)
        self._accepted = Counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", m, registry=reg)
        self._per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                "Accepted draft tokens by position in the draft.", m + ["position"], registry=reg)
        self._success = Counter("vllm:request_success", "Finished generations by finish reason.",
                                m + ["finished_reason"], registry=reg)
        self._prompt = Counter("vllm:prompt_tokens", "Prompt tokens of finished generations.", m, registry=reg)
        self._gen = Counter("vllm:generation_tokens", "Generated tokens of finished generations.", m, registry=reg)
        self._e2e = Histogram("vllm:e2e_request_latency_seconds", "Submit to last token, per request.", m,
                              buckets=LATENCY_BUCKETS, registry=reg)
        self._ttft = Histogram("vllm:time_to_first_token_seconds", "Submit to first token, per request.", m,
                               buckets=LATENCY_BUCKETS, registry=reg)
        self._running = Gauge("vllm:num_requests_running", "Requests in the engine's batch.", m, registry=reg)
        self._waiting = Gauge("vllm:num_requests_waiting", "Requests waiting for a batch row.", m, registry=reg)
        self._requests = Counter("jf_requests", "HTTP generation requests by final status.", ["endpoint", "code"],
                                 registry=reg)
        self._cancelled = Counter("jf_cancelled_requests", "Requests cancelled by client disconnect.", registry=reg)
        self._forwards = Counter("jf_decode_forwards", "Decode forward passes (per request row).", registry=reg)
        self._tpf = Histogram("jf_tokens_per_forward", "Tokens per decode forward, per request.",
                              buckets=TPF_BUCKETS, registry=reg)
        self._latency = Histogram("jf_request_latency_seconds", "Submit to last token, per request.",
                                  buckets=LATENCY_BUCKETS, registry=reg)
        self._steps = Counter("jf_engine_steps", "Engine steps (one decode forward for every running row).",
                              registry=reg)
        self._batch = Histogram("jf_batch_size", "Rows per engine step.", buckets=BATCH_BUCKETS, registry=reg)
        self.cancelled = 0  # plain count, for tests and /health

    def request_done(self, endpoint: str, code: int) -> None:
        """Count one finished HTTP request (``code``: its final status)."""
        self._requests.labels(endpoint, str(code)).inc()

    def generation_done(self, out, latency_s: float, ttft_s: float | None) -> None:
        """Record one finished generation (a :class:`~megatron_jf.inference.results.GenerationResult`)."""
        mn = self.model_name
        n = len(out.tokens)
        self._prompt.labels(mn).inc(out.prompt_len)
        self._gen.labels(mn).inc(n)
        self._success.labels(mn, "length" if out.finish_reason == "length" else "stop").inc()
        self._forwards.inc(out.forwards)
        if out.forwards > 0:
            self._tpf.observe(n / out.forwards)
        self._e2e.labels(mn).observe(latency_s)
        self._latency.observe(latency_s)
        if ttft_s is not None:
            self._ttft.labels(mn).observe(ttft_s)
        drafts = sum(1 for d in out.draft_lens if d > 0)
        if drafts:
            self._drafts.labels(mn).inc(drafts)
            self._draft_tokens.labels(mn).inc(sum(out.draft_lens))
            self._accepted.labels(mn).inc(sum(out.draft_accepted))
            per = {}
            for a in out.draft_accepted:
                for p in range(a):
                    per[p] = per.get(p, 0) + 1
            for p, c in per.items():
                self._per_pos.labels(mn, str(p)).inc(c)

    def request_cancelled(self) -> None:
        """Count one request cancelled by its client (disconnect mid-stream)."""
        self._cancelled.inc()
        self.cancelled += 1

    def step_done(self, rows: int) -> None:
        """Count one engine step of ``rows`` rows."""
        self._steps.inc()
        self._batch.observe(rows)

    def set_gauges(self, queue_depth: int, running: int) -> None:
        self._waiting.labels(self.model_name).set(queue_depth)
        self._running.labels(self.model_name).set(running)

    def render(self) -> str:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry).decode()
