"""HTTP text-generation server (Megatron ``PUT /api`` + OpenAI-compatible endpoints) over the JF engine.

* :mod:`megatron_jf.server.scheduler` -- a thread that steps one continuous batch
  (:class:`~megatron_jf.inference.engine.BatchSession`): requests with any decode config join at the
  next engine step, leave when done or disconnected, and stream their final tokens back;
* :mod:`megatron_jf.server.protocol` -- request parsing/validation (errors name the offending field);
* :mod:`megatron_jf.server.app` -- the FastAPI application;
* :mod:`megatron_jf.server.metrics` -- Prometheus metrics (prometheus_client; vLLM's names where vLLM has one).

Launch with ``tools/run_text_generation_server.py`` (or ``examples/run_text_server.sh CKPT [TP] [PORT]``).
"""
