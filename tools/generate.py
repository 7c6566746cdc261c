#!/usr/bin/env python
"""Generate text from a megatron-jf checkpoint with any decoder; print text, or JSON with tokens and metrics.

    python tools/generate.py --load CKPT --decoder mr --block-size 64 --num-blocks 2 --spawn-threshold 0.85 \\
        --verification-size 4 --max-new-tokens 256 --prompt "def fib(n):"

Under ``torchrun --nproc_per_node T ... --tp T`` every rank runs the same decode (rank 0 prints). Megatron-LM
spellings work too: ``--tensor-model-parallel-size``, ``--bf16``, ``--num-tokens-to-generate``, ``--top_k`` ...
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_jf.cli import (MAX_NEW_TOKENS_FLAGS, TOKENIZER_FLAGS, HelpFormatter, add_parallel_args,  # noqa: E402
                             add_precision_args, positive_int)

_positive_int = positive_int  # kept for callers of the old name


def add_decode_args(p: argparse.ArgumentParser) -> None:
    """Decoder and sampling flags of ``tools/generate.py`` (Megatron-LM's ``--num-tokens-to-generate``,
    ``--top_k`` and ``--top_p`` are aliases)."""
    from megatron_jf.inference.engine import DECODERS, DRAFT_INITS

    g = p.add_argument_group("decoding")
    g.add_argument("--decoder", default="ar", choices=DECODERS, help="decoding algorithm")
    g.add_argument("--block-size", type=int, default=16, help="n: draft tokens per block")
    g.add_argument("--num-blocks", type=int, default=2, help="K: blocks in flight (mr)")
    g.add_argument("--spawn-threshold", type=float, default=0.85, help="r: spawn a pseudo-active block at ceil(r*n) stable tokens (mr)")
    g.add_argument("--verification-size", type=int, default=4, help="drafts verified per forward, Jacobi draft included (mr)")
    g.add_argument("--ngram-pool-size", type=int, default=8, help="n-grams kept per first token (mr)")
    g.add_argument("--draft-init", default="context", choices=DRAFT_INITS,
                   help="initial draft: tokens drawn from prompt+output (paper) or the last token repeated")
    g.add_argument(*MAX_NEW_TOKENS_FLAGS, dest="max_new_tokens", type=int, default=128,
                   help="most tokens generated per prompt")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 is greedy")
    g.add_argument("--top-k", "--top_k", dest="top_k", type=int, default=0, help="keep the k most likely tokens; 0 keeps all")
    g.add_argument("--top-p", "--top_p", dest="top_p", type=float, default=1.0, help="nucleus sampling mass; 1 keeps all")
    g.add_argument("--seed", type=int, default=0, help="seed of sampling and draft initialisation")
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


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser (Megatron-LM spellings accepted: see :mod:`megatron_jf.cli`)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--load", required=True, help="megatron-jf checkpoint directory (required; a Hugging Face model is converted first with tools/convert_hf.py hf-to-mcore)")
    p.add_argument(*TOKENIZER_FLAGS, dest="tokenizer", default=None,
                   help="tokenizer path (default: the checkpoint's tokenizer/)")
    p.add_argument("--prompt", action="append", default=[], help="prompt text (repeatable)")
    p.add_argument("--prompt-file", default=None, help="a text file: one prompt (whole file) (default: none)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user turn with the chat template")
    add_parallel_args(p)
    add_precision_args(p)
    p.add_argument("--threads", type=positive_int, default=1, help="torch threads per process")
    p.add_argument("--json", action="store_true", help="print tokens and metrics as JSON")
    add_decode_args(p)
    return p


def main(argv=None):
    """CLI entry point (see the module docstring)."""
    a = build_parser().parse_args(argv)

    import torch

    torch.set_num_threads(a.threads)
    from megatron_jf import parallel
    from megatron_jf.checkpointing import load_model, tokenizer_path
    from megatron_jf.cli import params_dtype
    from megatron_jf.inference.engine import Engine
    from megatron_jf.load_errors import reject_hf_dir
    from megatron_jf.tokenizer import load_tokenizer, stop_token_ids

    try:
        reject_hf_dir(a.load)
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
        model, margs, _ = load_model(a.load, params_dtype=params_dtype(a.params_dtype))
        texts = [tok.apply_chat_template([{"role": "user", "content": x}]) if a.chat else x for x in prompts]
        ids = [tok.encode(t) for t in texts]
        eos = stop_token_ids(tok, margs, a.load)  # the one stop set (also the server's)
        res = Engine(model).generate(ids, cfg, max_new_tokens=a.max_new_tokens, sampling=sp, eos_ids=eos,
                                     stop_strings=tuple(a.stop), detokenize=tok.decode)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"error: {e}") from None
    if parallel.is_rank0():
        for t, r in zip(prompts, res):
            text = tok.decode(r.tokens) + r.tail_text  # tail: start of a token straddling a stop string
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
