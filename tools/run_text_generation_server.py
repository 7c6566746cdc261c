#!/usr/bin/env python
"""Serve a megatron-jf checkpoint over HTTP (Megatron ``PUT /api`` + OpenAI-compatible endpoints).

Single process (``--tp 1``) or under torchrun (``--tp N`` with N ranks): rank 0 runs the HTTP server
and the batching scheduler; ranks > 0 follow, receiving each batch (token ids + parameters) from rank 0
and making the same ``Engine.generate`` call. See :mod:`megatron_jf.server`.

Example::

    python tools/run_text_generation_server.py --load CKPT --port 5000 --decoder mr --block-size 16
    curl -X PUT localhost:5000/api -H 'Content-Type: application/json' \
         -d '{"prompts": ["Hello"], "tokens_to_generate": 32, "temperature": 0}'
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

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load", required=True, help="megatron-jf checkpoint directory")
    p.add_argument("--tokenizer", default=None, help="tokenizer path (default: CKPT/tokenizer)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (= WORLD_SIZE under torchrun)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=_port, default=5000, help="TCP port, 1-65535")
    p.add_argument("--model-name", default=None, help="model id in /v1/models (default: checkpoint dir name)")
    p.add_argument("--max-batch", type=int, default=32, help="most requests per batched generate call")
    p.add_argument("--max-queue", type=int, default=256, help="most waiting requests (503 beyond)")
    p.add_argument("--batch-wait-ms", type=float, default=20.0,
                   help="wait for more requests before forming each batch (ms)")
    p.add_argument("--seed", type=int, default=1234)
    d = p.add_argument_group("default decoder (per-request override: the 'jf' object)")
    d.add_argument("--decoder", default="mr", choices=("ar", "jacobi", "running-window", "mr"))
    d.add_argument("--block-size", type=int, default=16)
    d.add_argument("--num-blocks", type=int, default=2)
    d.add_argument("--spawn-threshold", type=float, default=0.85)
    d.add_argument("--verification-size", type=int, default=4)
    d.add_argument("--ngram-pool-size", type=int, default=8)
    d.add_argument("--draft-init", default="context", choices=("context", "repeat"))
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from datetime import timedelta

    import torch.distributed as dist

    from megatron_jf import parallel
    from megatron_jf.checkpointing import load_model, tokenizer_path
    from megatron_jf.inference.engine import DecodeConfig, Engine
    from megatron_jf.server.scheduler import follower_loop
    from megatron_jf.tokenizer import load_tokenizer

    try:
        default = DecodeConfig(args.decoder, args.block_size, args.num_blocks, args.spawn_threshold,
                               args.verification_size, args.ngram_pool_size, args.draft_init)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != args.tp:
        print(f"error: --tp {args.tp} needs {args.tp} ranks (run under torchrun), got WORLD_SIZE={world}",
              file=sys.stderr)
        return 2
    if not os.path.isdir(args.load):
        print(f"error: checkpoint directory not found: {args.load}", file=sys.stderr)
        return 2
    parallel.initialize(args.tp, 1)
    parallel.set_seed(args.seed)
    tok_path = args.tokenizer or tokenizer_path(args.load)
    if tok_path is None:
        print(f"error: {args.load} has no tokenizer/ directory; pass --tokenizer", file=sys.stderr)
        return 2
    tokenizer = load_tokenizer(tok_path)
    model, _, _ = load_model(args.load)
    engine = Engine(model)
    group = dist.new_group(backend="gloo", timeout=timedelta(hours=24)) if args.tp > 1 else None
    if not parallel.is_rank0():
        follower_loop(engine, tokenizer.decode, group=group)
        parallel.destroy()
        return 0

    import uvicorn

    from megatron_jf.server.app import create_app
    from megatron_jf.server.metrics import Metrics
    from megatron_jf.server.scheduler import Scheduler

    metrics = Metrics()
    sched = Scheduler(engine, tokenizer.decode, max_batch=args.max_batch, max_queue=args.max_queue,
                      batch_wait_s=args.batch_wait_ms / 1000, broadcast=args.tp > 1, metrics=metrics, group=group)
    name = args.model_name or os.path.basename(os.path.normpath(args.load))
    app = create_app(sched, tokenizer, model_name=name, default_config=default, metrics=metrics)
    print(f"serving {args.load} as {name!r} on http://{args.host}:{args.port} (tp={args.tp}, "
          f"default decoder {default})", flush=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    finally:
        sched.shutdown()
        parallel.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
