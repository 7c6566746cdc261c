#!/usr/bin/env python
"""Generate text from a megatron-jf checkpoint with any decoder; print text, or JSON with tokens and metrics.

    python tools/generate.py --load CKPT --decoder mr --block-size 64 --num-blocks 2 --spawn-threshold 0.85 \\
        --verification-size 4 --max-new-tokens 256 --prompt "def fib(n):"

Under ``torchrun --nproc_per_node T ... --tp T`` every rank runs the same decode (rank 0 prints).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))



def _positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v

def add_decode_args(p: argparse.ArgumentParser) -> None:
    """Decoder flags shared by the tools (generate, evaluate, server)."""
    from megatron_jf.inference.engine import DECODERS, DRAFT_INITS

    g = p.add_argument_group("decoding")
    g.add_argument("--decoder", default="ar", choices=DECODERS)
    g.add_argument("--block-size", type=int, default=16, help="n: draft tokens per block")
    g.add_argument("--num-blocks", type=int, default=2, help="K: blocks in flight (mr)")
    g.add_argument("--spawn-threshold", type=float, default=0.85, help="r: spawn a pseudo-active block at ceil(r*n) stable tokens (mr)")
    g.add_argument("--verification-size", type=int, default=4, help="drafts verified per forward, Jacobi draft included (mr)")
    g.add_argument("--ngram-pool-size", type=int, default=8, help="n-grams kept per first token (mr)")
    g.add_argument("--draft-init", default="context", choices=DRAFT_INITS)
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def decode_config(a):
    """``DecodeConfig`` from parsed decoding flags (raises ValueError on bad values)."""
    from megatron_jf.inference.engine import DecodeConfig

    return DecodeConfig(decoder=a.decoder, block_size=a.block_size, num_blocks=a.num_blocks,
                        spawn_threshold=a.spawn_threshold, verification_size=a.verification_size,
                        ngram_pool_size=a.ngram_pool_size, draft_init=a.draft_init)


def sampling_params(a):
    """``SamplingParams`` from parsed decoding flags (raises ValueError on bad values)."""
    from megatron_jf.inference.sampling import SamplingParams

    return SamplingParams(temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, seed=a.seed)


def main(argv=None):
    """CLI entry point (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load", required=True, help="megatron-jf checkpoint directory")
    p.add_argument("--tokenizer", default=None, help="tokenizer path (default: CKPT/tokenizer)")
    p.add_argument("--prompt", action="append", default=[], help="prompt text (repeatable)")
    p.add_argument("--prompt-file", default=None, help="a text file: one prompt (whole file)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user turn with the chat template")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--threads", type=_positive_int, default=1, help="torch threads per process")
    p.add_argument("--json", action="store_true", help="print tokens and metrics as JSON")
    add_decode_args(p)
    a = p.parse_args(argv)

    import torch

    torch.set_num_threads(a.threads)
    from megatron_jf import parallel
    from megatron_jf.checkpointing import load_model, tokenizer_path
    from megatron_jf.inference.engine import Engine
    from megatron_jf.tokenizer import load_tokenizer

    try:
        cfg, sp = decode_config(a), sampling_params(a)
        prompts = list(a.prompt)
        if a.prompt_file:
            prompts.append(open(a.prompt_file).read())
        if not prompts:
            raise ValueError("give --prompt or --prompt-file")
        tok_path = a.tokenizer or tokenizer_path(a.load)
        if tok_path is None:
            raise ValueError(f"checkpoint {a.load} carries no tokenizer; pass --tokenizer")
        tok = load_tokenizer(tok_path)
        parallel.initialize(a.tp, 1)
        parallel.set_seed(a.seed)
        model, margs, _ = load_model(a.load)
        texts = [tok.apply_chat_template([{"role": "user", "content": x}]) if a.chat else x for x in prompts]
        ids = [tok.encode(t) for t in texts]
        eos = set(tok.eos_ids) | set(margs.eos_token_ids)
        res = Engine(model).generate(ids, cfg, max_new_tokens=a.max_new_tokens, sampling=sp, eos_ids=eos,
                                     stop_strings=tuple(a.stop), detokenize=tok.decode)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"error: {e}") from None
    if parallel.is_rank0():
        for t, r in zip(prompts, res):
            text = tok.decode(r.tokens)
            if a.json:
                print(json.dumps({"prompt": t, "text": text, "tokens": r.tokens, "finish_reason": r.finish_reason,
                                  "forwards": r.forwards, "tpf": r.tpf, "tps": r.tps, "accepted": r.accepted,
                                  "prefill_s": r.prefill_s, "decode_s": r.decode_s}))
            else:
                print(text)
                print(f"[{cfg.decoder}: {len(r.tokens)} tokens, {r.forwards} forwards, TPF {r.tpf:.2f}, "
                      f"{r.tps:.1f} tok/s, finish={r.finish_reason}]", file=sys.stderr)
    parallel.destroy()


if __name__ == "__main__":
    main()
