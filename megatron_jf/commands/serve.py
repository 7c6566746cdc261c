"""Serve a megatron-jf checkpoint over HTTP (Megatron ``PUT /api`` + OpenAI-compatible endpoints).

Single process (``--tp 1``) or under torchrun (``--tp N`` with N ranks): rank 0 runs the HTTP server
and the continuous-batching scheduler; ranks > 0 follow, receiving each engine step's changes (rows
added, with token ids and parameters; rows removed) from rank 0 and stepping the same batch. See
:mod:`megatron_jf.server`.

Example::

    python tools/run_text_generation_server.py --load CKPT --port 5000 --decoder mr --block-size 16
    curl -X PUT localhost:5000/api -H 'Content-Type: application/json' \
         -d '{"prompts": ["Hello"], "tokens_to_generate": 32, "temperature": 0}'

vLLM spellings are accepted as aliases: ``--tensor-parallel-size`` (``--tp``), ``--served-model-name``
(``--model-name``), ``--max-model-len`` (caps the context window), ``--max-num-seqs`` (``--max-batch``), ``--dtype``;
and Megatron-LM's: ``--tensor-model-parallel-size``, ``--tokenizer-model``, ``--bf16``.
Generation stops on :func:`megatron_jf.tokenizer.stop_token_ids` of the checkpoint (tokenizer EOS,
the checkpoint's ``eos_token_ids`` and its ``generation_config.json``), as ``tools/generate.py`` does.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time


from megatron_jf import cli
from megatron_jf.commands import InputError, run

NAME = "run_text_generation_server"


class _Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keep the module docstring's layout and show every flag's default."""


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser (every flag's help shows its default; decoder flags shared with every tool)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=_Help, allow_abbrev=False)
    cli.add_load_arg(p, help="megatron checkpoint directory (a Hugging Face model is converted first with "
                             "tools/convert_hf.py hf-to-mcore)")
    cli.add_tokenizer_arg(p)
    cli.add_parallel_args(p, tp_help="tensor-parallel size (= WORLD_SIZE under torchrun)")
    cli.add_precision_args(p)
    cli.add_threads_arg(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=cli.port, default=5000, help="TCP port, 1-65535")
    p.add_argument("--model-name", "--served-model-name", dest="model_name", default=None,
                   help="model id in /v1/models; none: the checkpoint directory's name")
    p.add_argument("--max-model-len", type=cli.positive_int, default=None,
                   help="context window, tokens; none: the model's max_position_embeddings (may only lower it)")
    p.add_argument("--max-batch", "--max-num-seqs", dest="max_batch", type=cli.positive_int, default=32,
                   help="most requests decoding together (continuous batching rows)")
    p.add_argument("--max-queue", type=cli.positive_int, default=256, help="most waiting requests (503 beyond)")
    p.add_argument("--batch-wait-ms", type=float, default=20.0,
                   help="when idle, wait this long for more requests before the first step (ms)")
    p.add_argument("--max-request-bytes", type=cli.positive_int, default=2 << 20,
                   help="largest request body, bytes (413 beyond)")
    p.add_argument("--max-parallel-tokens", type=cli.positive_int, default=512,
                   help="most tokens one request may forward per step (AR 1, Jacobi n+1, MR 1+K*n+(v-1)*n)")
    p.add_argument("--max-stop-strings", type=cli.positive_int, default=16, help="most stop strings per request")
    p.add_argument("--max-stop-chars", type=cli.positive_int, default=512, help="longest stop string, characters")
    p.add_argument("--docs", action="store_true", help="serve /docs and /openapi.json (Swagger UI loads from a CDN)")
    cli.SEED.add(p, help="process random seed")
    cli.add_decode_args(p, title="default decoder (per-request override: the 'jf' object)")
    cli.add_inference_args(p)
    return p


def main(argv=None) -> int:
    """``tools/run_text_generation_server.py`` / ``jf serve``; returns the exit status (:mod:`megatron_jf.commands`):
    bad input found while loading is one ``error:`` line and status 2, before the server starts."""
    args, status = cli.parse_or_status(build_parser(), argv)
    if args is None:
        return status
    loaded: dict = {}
    status = run(NAME, lambda: _load(args, loaded), (ValueError,))
    return status or _serve(args, **loaded)


def _load(args, out: dict) -> None:
    from megatron_jf.load_errors import check_load_dir

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != args.tp:  # cheap checks before torch is imported
        raise InputError(f"--tp {args.tp} needs {args.tp} ranks (run under torchrun), got WORLD_SIZE={world}")
    check_load_dir(args.load)
    default = cli.decode_config(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cli.set_threads(args.threads)
    from megatron_jf.inference.engine import forward_width
    from megatron_jf.inference.llm import LLM

    if forward_width(default) > args.max_parallel_tokens:
        raise InputError(f"the default decoder forwards {forward_width(default)} tokens per step, over "
                         f"--max-parallel-tokens {args.max_parallel_tokens}")
    # a damaged checkpoint names its file (CheckpointFileError); --max-model-len beyond the model's window
    out["llm"] = LLM.from_checkpoint(args.load, tokenizer=args.tokenizer, tp=args.tp, seed=args.seed,
                                     params_dtype=args.params_dtype, max_context=args.max_model_len,
                                     options=cli.inference_options(args))
    out["default"] = default


def _serve(args, llm, default) -> int:
    from datetime import timedelta

    import torch.distributed as dist

    from megatron_jf import parallel
    from megatron_jf.server.scheduler import follower_loop

    tokenizer, stop_ids, engine = llm.tokenizer, llm.eos_ids, llm.engine
    t0 = time.perf_counter()  # draft_width="auto" rows need the forward's cost: measured (or read) now, not mid-request
    engine.forward_cost(args.max_batch, args.max_parallel_tokens)
    logging.getLogger("megatron_jf.server").info("forward cost ready in %.1f s (%s)", time.perf_counter() - t0,
                                                 "measured or read from MEGATRON_JF_COST_CACHE")
    group = dist.new_group(backend="gloo", timeout=timedelta(hours=24)) if args.tp > 1 else None
    if not parallel.is_rank0():
        follower_loop(engine, tokenizer.decode, group=group, max_batch=args.max_batch,
                      max_width=args.max_parallel_tokens)
        parallel.destroy()
        return 0

    import uvicorn

    from megatron_jf.server.app import create_app
    from megatron_jf.server.metrics import Metrics
    from megatron_jf.server.app import max_token_chars
    from megatron_jf.server.protocol import Limits
    from megatron_jf.server.scheduler import Scheduler

    name = args.model_name or os.path.basename(os.path.normpath(args.load))
    metrics = Metrics(name)
    sched = Scheduler(engine, tokenizer.decode, max_batch=args.max_batch, max_queue=args.max_queue,
                      batch_wait_s=args.batch_wait_ms / 1000, max_width=args.max_parallel_tokens,
                      broadcast=args.tp > 1, metrics=metrics, group=group)
    limits = Limits(max_context=engine.max_context, max_parallel_tokens=args.max_parallel_tokens, max_stop=args.max_stop_strings,
                    max_stop_chars=args.max_stop_chars, max_token_chars=max_token_chars(tokenizer))
    app = create_app(sched, tokenizer, model_name=name, default_config=default, metrics=metrics,
                     stop_ids=stop_ids, limits=limits, max_request_bytes=args.max_request_bytes, docs=args.docs)
    print(f"serving {args.load} as {name!r} on http://{args.host}:{args.port} (tp={args.tp}, "
          f"default decoder {default}, stop tokens {sorted(stop_ids)})", flush=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    finally:
        sched.shutdown()
        parallel.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
