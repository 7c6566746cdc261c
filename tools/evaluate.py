#!/usr/bin/env python
"""Evaluate speed and accuracy of a decoder against greedy AR in one run (Jacobi Forcing Tables 1-3).

AR and the chosen decoder run on the same prompts in the same process; the speedup is their wall-clock ratio
(also reported against the faster of this project's AR and ``transformers`` greedy on the same weights, timed in
the same run: ``speedup_vs_fastest_ar``, ``fastest_ar``),
greedy outputs are checked to be identical (lossless), both completions are scored (code in the sandbox)::

    python tools/evaluate.py --load ckpt/jf-coder --benchmark humaneval --decoder mr --block-size 64 \\
        --num-blocks 2 --spawn-threshold 0.85 --verification-size 4 --max-new-tokens 512 --out results/

Writes ``{out}/{benchmark}_{decoder}.jsonl`` (per sample, resumable: re-run the same command to continue),
``.summary.json`` and ``.md`` (``| Task | Method | Speedup | TPF | TPS | Acc |``). Exit codes: 0 ok, 2 bad input,
3 lossless check failed.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser (decoder flags mirror :class:`megatron_jf.inference.engine.DecodeConfig`;
    Megatron-LM spellings accepted, see :mod:`megatron_jf.cli`)."""
    from megatron_jf.cli import (BATCH_FLAGS, MAX_NEW_TOKENS_FLAGS, TOKENIZER_FLAGS, HelpFormatter,
                                 add_parallel_args, add_precision_args, positive_int)
    from megatron_jf.inference.engine import DECODERS, DRAFT_INITS, DecodeConfig

    d = DecodeConfig()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--load", required=True, help="megatron_jf checkpoint directory (required; a Hugging Face model "
                   "is converted first with tools/convert_hf.py hf-to-mcore)")
    p.add_argument("--benchmark", help="humaneval, mbpp, gsm8k, math or math500 (default: none; give it or --data)")
    p.add_argument("--data", help="local JSONL problems instead of the packaged benchmark (default: none)")
    p.add_argument("--decoder", default="jacobi", help=f"{', '.join(DECODERS)} (compared against AR)")
    p.add_argument("--block-size", type=int, help=f"n, tokens per block (default: {d.block_size})")
    p.add_argument("--num-blocks", type=int, help=f"K, blocks in flight (mr) (default: {d.num_blocks})")
    p.add_argument("--spawn-threshold", type=float, help=f"r in (0, 1] (mr) (default: {d.spawn_threshold})")
    p.add_argument("--verification-size", type=int,
                   help=f"drafts verified per forward (mr) (default: {d.verification_size})")
    p.add_argument("--ngram-pool-size", type=int, help=f"n-grams kept per key (mr) (default: {d.ngram_pool_size})")
    p.add_argument("--draft-init", help=f"initial draft, {' or '.join(DRAFT_INITS)} (default: {d.draft_init})")
    p.add_argument(*MAX_NEW_TOKENS_FLAGS, dest="max_new_tokens", type=int, default=256,
                   help="most tokens generated per problem")
    p.add_argument("--limit", type=int, help="first N problems (default: all)")
    p.add_argument(*BATCH_FLAGS, dest="batch_size", type=int, default=1, help="problems decoded together")
    p.add_argument("--prompt-mode", default="chat", help="chat (instruct models) or raw (base models)")
    p.add_argument("--prompt-set", default=None, help="prompt set name (default: jf-paper-v1)")
    p.add_argument(*TOKENIZER_FLAGS, dest="tokenizer", help="tokenizer path (default: the checkpoint's)")
    p.add_argument("--out", default="eval_out", help="output directory")
    p.add_argument("--threads", type=positive_int, help="torch CPU threads (default: torch's)")
    add_parallel_args(p)
    add_precision_args(p)
    p.add_argument("--seed", type=int, default=1234, help="seed of the draft initialisation")
    p.add_argument("--score-timeout", type=float, default=10.0, help="sandbox seconds per program")
    p.add_argument("--math-cpu-limit", type=float, default=20.0,
                   help="CPU seconds per symbolic step of math grading; over it a sample is UNGRADED, not wrong")
    p.add_argument("--unisolated", action="store_true",
                   help="run generated code WITHOUT OS isolation (bubblewrap namespaces) where they are unavailable;"
                        " flagged in the report")
    p.add_argument("--allow-mismatch", action="store_true", help="do not fail when outputs differ from AR")
    p.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up generation")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-hf-baseline", action="store_true",
                   help="do not time transformers greedy on the same weights (the speedup against the faster AR "
                        "then uses this project's AR)")
    return p


def config_from_args(a: argparse.Namespace):
    """Map parsed arguments to :class:`megatron_jf.eval.harness.EvalConfig`."""
    from megatron_jf.eval.harness import EvalConfig

    decode = dict(block_size=a.block_size, num_blocks=a.num_blocks, spawn_threshold=a.spawn_threshold,
                  verification_size=a.verification_size, ngram_pool_size=a.ngram_pool_size, draft_init=a.draft_init)
    return EvalConfig(load=a.load, benchmark=a.benchmark, decoder=a.decoder, decode=decode, data=a.data,
                      limit=a.limit, max_new_tokens=a.max_new_tokens, batch_size=a.batch_size,
                      prompt_mode=a.prompt_mode, prompt_set=a.prompt_set, out_dir=a.out, tokenizer=a.tokenizer,
                      threads=a.threads, tp=a.tp, seed=a.seed, strict_lossless=not a.allow_mismatch,
                      score_timeout_s=a.score_timeout, warmup=not a.no_warmup, progress=not a.no_progress,
                      math_cpu_s=a.math_cpu_limit, isolation="none" if a.unisolated else "os",
                      hf_baseline=not a.no_hf_baseline, params_dtype=a.params_dtype)


def main(argv=None) -> int:
    """Run the evaluation; returns the exit code (0 ok, 2 bad input, 3 lossless violation)."""
    a = build_parser().parse_args(argv)
    from megatron_jf.eval.benchmarks import BenchmarkDataError, MissingBenchmarkPackage
    from megatron_jf.eval.harness import (CheckpointNotFound, HarnessError, LosslessViolation, ResumeMismatch,
                                          TokenizerNotFound, run_evaluation)

    from megatron_jf.load_errors import reject_hf_dir

    try:
        reject_hf_dir(a.load)
        cfg = config_from_args(a)
        cfg.validate()
        run_evaluation(cfg)
    except (HarnessError, CheckpointNotFound, TokenizerNotFound, ResumeMismatch, MissingBenchmarkPackage,
            BenchmarkDataError, FileNotFoundError) as e:
        print(f"evaluate: error: {e}", file=sys.stderr)
        return 2
    except LosslessViolation as e:
        print(f"evaluate: LOSSLESS CHECK FAILED: {e}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
