#!/usr/bin/env python
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
(``--model-name``), ``--max-model-len`` (caps the context window), ``--max-num-seqs`` (``--max-batch``).
Generation stops on :func:`megatron_jf.tokenizer.stop_token_ids` of the checkpoint (tokenizer EOS,
the checkpoint's ``eos_token_ids`` and its ``generation_config.json``), as ``tools/generate.py`` does.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys



def _port(text: str) -> int:
    """argparse type: a TCP port number."""
    v = int(text)
    if not 1 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in 1-65535, got {v}")
    return v

def _positive(text: str) -> int:
    """argparse type: an integer >= 1."""
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


class _Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keep the module docstring's layout and show every flag's default."""


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser (every flag's help shows its default)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=_Help)
    p.add_argument("--load", required=True, help="megatron-jf checkpoint directory")
    p.add_argument("--tokenizer", default=None, help="tokenizer path; None means CKPT/tokenizer")
    p.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=_positive, default=1,
                   help="tensor-parallel size (= WORLD_SIZE under torchrun)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=_port, default=5000, help="TCP port, 1-65535")
    p.add_argument("--model-name", "--served-model-name", dest="model_name", default=None,
                   help="model id in /v1/models; None means the checkpoint directory's name")
    p.add_argument("--max-model-len", type=_positive, default=None,
                   help="context window, tokens; None means the model's max_position_embeddings (may only lower it)")
    p.add_argument("--max-batch", "--max-num-seqs", dest="max_batch", type=_positive, default=32,
                   help="most requests decoding together (continuous batching rows)")
    p.add_argument("--max-queue", type=_positive, default=256, help="most waiting requests (503 beyond)")
    p.add_argument("--batch-wait-ms", type=float, default=20.0,
                   help="when idle, wait this long for more requests before the first step (ms)")
    p.add_argument("--max-request-bytes", type=_positive, default=2 << 20,
                   help="largest request body, bytes (413 beyond)")
    p.add_argument("--max-parallel-tokens", type=_positive, default=512,
                   help="most tokens one request may forward per step (AR 1, Jacobi n+1, MR 1+K*n+(v-1)*n)")
    p.add_argument("--max-stop-strings", type=_positive, default=16, help="most stop strings per request")
    p.add_argument("--max-stop-chars", type=_positive, default=512, help="longest stop string, characters")
    p.add_argument("--docs", action="store_true", help="serve /docs and /openapi.json (Swagger UI loads from a CDN)")
    p.add_argument("--seed", type=int, default=1234, help="process random seed")
    from megatron_jf.cli import add_precision_args

    add_precision_args(p)
    d = p.add_argument_group("default decoder (per-request override: the 'jf' object)")
    d.add_argument("--decoder", default="mr", choices=("ar", "jacobi", "running-window", "mr"), help="decoder")
    d.add_argument("--block-size", type=int, default=16, help="n, draft tokens per block")
    d.add_argument("--num-blocks", type=int, default=2, help="K, blocks in flight (mr)")
    d.add_argument("--spawn-threshold", type=float, default=0.85, help="r, pseudo-active block spawn threshold (mr)")
    d.add_argument("--verification-size", type=int, default=4, help="drafts verified per forward (mr)")
    d.add_argument("--ngram-pool-size", type=int, default=8, help="n-grams kept per first token (mr)")
    d.add_argument("--draft-init", default="context", choices=("context", "repeat"), help="initial draft tokens")
    return p


def parse_args(argv=None):
    return build_parser().parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from datetime import timedelta

    import torch.distributed as dist

    from megatron_jf import parallel
    from megatron_jf.checkpointing import load_model, tokenizer_path
    from megatron_jf.inference.engine import DecodeConfig, Engine
    from megatron_jf.server.scheduler import follower_loop
    from megatron_jf.inference.engine import forward_width
    from megatron_jf.tokenizer import load_tokenizer, stop_token_ids

    try:
        default = DecodeConfig(args.decoder, args.block_size, args.num_blocks, args.spawn_threshold,
                               args.verification_size, args.ngram_pool_size, args.draft_init)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if forward_width(default) > args.max_parallel_tokens:
        print(f"error: the default decoder forwards {forward_width(default)} tokens per step, over "
              f"--max-parallel-tokens {args.max_parallel_tokens}", file=sys.stderr)
        return 2
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != args.tp:
        print(f"error: --tp {args.tp} needs {args.tp} ranks (run under torchrun), got WORLD_SIZE={world}",
              file=sys.stderr)
        return 2
    if not os.path.isdir(args.load):
        print(f"error: checkpoint directory not found: {args.load}", file=sys.stderr)
        return 2
    from megatron_jf.load_errors import HFDirectoryError, reject_hf_dir

    try:
        reject_hf_dir(args.load)
    except HFDirectoryError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    parallel.initialize(args.tp, 1)
    parallel.set_seed(args.seed)
    tok_path = args.tokenizer or tokenizer_path(args.load)
    if tok_path is None:
        print(f"error: {args.load} has no tokenizer/ directory; pass --tokenizer", file=sys.stderr)
        return 2
    tokenizer = load_tokenizer(tok_path)
    from megatron_jf.cli import params_dtype

    try:
        dtype = params_dtype(args.params_dtype)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    model, margs, _ = load_model(args.load, params_dtype=dtype)
    stop_ids = stop_token_ids(tokenizer, margs, args.load)
    ctx = margs.max_position_embeddings
    if args.max_model_len is not None:
        if args.max_model_len > ctx:
            print(f"error: --max-model-len {args.max_model_len} exceeds the model's context window of {ctx}",
                  file=sys.stderr)
            return 2
        ctx = args.max_model_len
    engine = Engine(model, max_context=ctx)
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
    limits = Limits(max_context=ctx, max_parallel_tokens=args.max_parallel_tokens, max_stop=args.max_stop_strings,
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
