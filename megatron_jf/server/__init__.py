"""HTTP text-generation server (Megatron ``PUT /api`` + OpenAI-compatible endpoints) over the JF engine.

* :mod:`megatron_jf.server.scheduler` -- a thread that batches waiting requests into one
  :meth:`~megatron_jf.inference.engine.Engine.generate` call and streams committed tokens back;
* :mod:`megatron_jf.server.protocol` -- request parsing/validation (errors name the offending field);
* :mod:`megatron_jf.server.app` -- the FastAPI application;
* :mod:`megatron_jf.server.metrics` -- Prometheus text-format metrics.

Launch with ``tools/run_text_generation_server.py`` (or ``examples/run_text_server.sh CKPT [TP] [PORT]``).
"""
