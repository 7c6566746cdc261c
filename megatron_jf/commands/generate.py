"""Generate text from a megatron-jf checkpoint with any decoder; print text, or JSON with tokens and metrics.

    python tools/generate.py --load CKPT --decoder mr --block-size 64 --num-blocks 2 --spawn-threshold 0.85 \\
        --verification-size 4 --max-new-tokens 256 --prompt "def fib(n):"

Under ``torchrun --nproc_per_node T ... --tp T`` every rank runs the same decode (rank 0 prints). Megatron-LM and
vLLM spellings work too: ``--tensor-model-parallel-size`` / ``--tensor-parallel-size``, ``--bf16`` / ``--dtype``,
``--num-tokens-to-generate``, ``--top_k`` ...
"""

from __future__ import annotations

import argparse
import json
import sys

from megatron_jf import cli
from megatron_jf.commands import InputError, run

NAME = "generate"


def add_decode_args(p: argparse.ArgumentParser) -> None:
    """Decoder flags (one per ``DecodeConfig`` field, :func:`megatron_jf.cli.add_decode_args`), the generation
    length and sampling (Megatron-LM's ``--num-tokens-to-generate``, ``--top_k`` and ``--top_p`` are aliases)."""
    g = cli.add_decode_args(p)
    cli.add_max_new_tokens_arg(g)
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 is greedy")
    g.add_argument("--top-k", "--top_k", dest="top_k", type=int, default=0,
                   help="keep the k most likely tokens; 0 keeps all")
    g.add_argument("--top-p", "--top_p", dest="top_p", type=float, default=1.0,
                   help="nucleus sampling mass; 1 keeps all")
    cli.SEED.add(g, default=0, help="seed of sampling and draft initialisation")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def sampling_params(a):
    """``SamplingParams`` from parsed decoding flags (raises ValueError on bad values)."""
    from megatron_jf.inference.sampling import SamplingParams

    return SamplingParams(temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, seed=a.seed)


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser (Megatron-LM and vLLM spellings accepted: see :mod:`megatron_jf.cli`)."""
    p = cli.parser(__doc__)
    cli.add_load_arg(p)
    cli.add_tokenizer_arg(p)
    cli.PROMPT.add(p, action="append", default=[], help="prompt text (repeatable)")
    p.add_argument("--prompt-file", default=None, help="a text file: one prompt (whole file) (default: none)")
    cli.CHAT.add(p)
    cli.add_parallel_args(p)
    cli.add_precision_args(p)
    cli.add_threads_arg(p)
    cli.add_inference_args(p)
    p.add_argument("--json", dest="print_json", action="store_true", help="print tokens and metrics as JSON")
    add_decode_args(p)
    return p


def main(argv=None) -> int:
    """``tools/generate.py`` / ``jf generate``; returns the exit status (:mod:`megatron_jf.commands`)."""
    a, status = cli.parse_or_status(build_parser(), argv)
    if a is None:
        return status
    return run(NAME, lambda: _generate(a), (ValueError, OSError))


def _generate(a) -> int:
    from megatron_jf.load_errors import check_load_dir

    check_load_dir(a.load)  # cheap checks before torch is imported
    prompts = list(a.prompt)
    if a.prompt_file:
        prompts.append(open(a.prompt_file).read())
    if not prompts:
        raise InputError("give --prompt or --prompt-file")
    cli.set_threads(a.threads)
    from megatron_jf import parallel
    from megatron_jf.inference.llm import LLM

    cfg, sp = cli.decode_config(a), sampling_params(a)
    llm = LLM.from_checkpoint(a.load, tokenizer=a.tokenizer, tp=a.tp, seed=a.seed, params_dtype=a.params_dtype,
                              options=cli.inference_options(a))
    tok = llm.tokenizer
    texts = [tok.apply_chat_template([{"role": "user", "content": x}]) if a.chat else x for x in prompts]
    res = llm.generate(texts, cfg, max_new_tokens=a.max_new_tokens, sampling=sp, stop_strings=tuple(a.stop))
    if parallel.is_rank0():
        for t, r in zip(prompts, res):
            text = tok.decode(r.tokens) + r.tail_text  # tail: start of a token straddling a stop string
            if a.print_json:
                print(json.dumps({"prompt": t, "text": text, "tokens": r.tokens, "finish_reason": r.finish_reason,
                                  "forwards": r.forwards, "tpf": r.tpf, "tps": r.tps, "accepted": r.accepted,
                                  "prefill_s": r.prefill_s, "decode_s": r.decode_s}))
            else:
                print(text)
                print(f"[{cfg.decoder}: {len(r.tokens)} tokens, {r.forwards} forwards, TPF {r.tpf:.2f}, "
                      f"{r.tps:.1f} tok/s, finish={r.finish_reason}]", file=sys.stderr)
    parallel.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
