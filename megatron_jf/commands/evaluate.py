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
import sys


from megatron_jf import cli
from megatron_jf.commands import run

NAME = "evaluate"


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser (decoder flags from :class:`megatron_jf.inference.engine.DecodeConfig`, shared with
    every tool; Megatron-LM and vLLM spellings accepted, see :mod:`megatron_jf.cli`)."""
    p = cli.parser(__doc__)
    cli.add_load_arg(p)
    cli.add_benchmark_args(p)
    g = cli.add_decode_args(p, title="decoding (compared against AR on the same prompts)")
    cli.add_max_new_tokens_arg(g, help="most tokens generated per problem")
    cli.add_batch_arg(p, help="problems decoded together")
    cli.add_tokenizer_arg(p)
    cli.OUT.add(p, default="eval_out")
    cli.add_threads_arg(p)
    cli.add_inference_args(p)
    cli.add_parallel_args(p)
    cli.add_precision_args(p)
    cli.SEED.add(p, help="seed of the draft initialisation")
    p.add_argument("--score-timeout", type=float, default=10.0, help="sandbox seconds per program")
    p.add_argument("--math-cpu-limit", type=float, default=20.0,
                   help="CPU seconds per symbolic step of math grading; over it a sample is UNGRADED, not wrong")
    p.add_argument("--unisolated", action="store_true",
                   help="run generated code WITHOUT OS isolation (bubblewrap namespaces) where they are unavailable;"
                        " flagged in the report")
    p.add_argument("--allow-mismatch", action="store_true",
                   help="do not fail when outputs differ from AR beyond a floating-point near tie (those never fail: "
                        "a logit gap within 1e-4 of the logits, 4 epsilons in bf16 -- megatron_jf/eval/speed.py)")
    p.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up generation")
    cli.NO_PROGRESS.add(p)
    p.add_argument("--no-hf-baseline", action="store_true",
                   help="do not time transformers greedy on the same weights (the speedup against the faster AR "
                        "then uses this project's AR)")
    return p


def config_from_args(a: argparse.Namespace):
    """Map parsed arguments to :class:`megatron_jf.eval.harness.EvalConfig`."""
    from megatron_jf.eval.harness import EvalConfig

    from megatron_jf.eval.harness import decode_config_from

    decode = decode_config_from(a.decoder, **{k: v for k, v in cli.decode_kwargs(a).items() if k != "decoder"})
    return EvalConfig(load=a.load, benchmark=a.benchmark, decode=decode, data=a.benchmark_data,
                      limit=a.limit, max_new_tokens=a.max_new_tokens, batch_size=a.batch_size,
                      prompt_mode=a.prompt_mode, prompt_set=a.prompt_set, out_dir=a.out, tokenizer=a.tokenizer,
                      threads=a.threads, tp=a.tp, seed=a.seed, strict_lossless=not a.allow_mismatch,
                      score_timeout_s=a.score_timeout, warmup=not a.no_warmup, progress=not a.no_progress,
                      math_cpu_s=a.math_cpu_limit, isolation="none" if a.unisolated else "os",
                      hf_baseline=not a.no_hf_baseline, params_dtype=a.params_dtype,
                      inference=cli.inference_options(a))


def main(argv=None) -> int:
    """``tools/evaluate.py`` / ``jf evaluate``; returns the exit status (0 ok, 2 bad input, 3 lossless violation:
    :mod:`megatron_jf.commands`)."""
    a, status = cli.parse_or_status(build_parser(), argv)
    if a is None:
        return status
    from megatron_jf.eval.benchmarks import BenchmarkDataError, MissingBenchmarkPackage
    from megatron_jf.eval.harness import HarnessError, ResumeMismatch, run_evaluation
    from megatron_jf.load_errors import check_load_dir

    def body() -> None:
        check_load_dir(a.load)
        cfg = config_from_args(a)
        cfg.validate()
        run_evaluation(cfg)

    return run(NAME, body, (HarnessError, ResumeMismatch, MissingBenchmarkPackage, BenchmarkDataError))


if __name__ == "__main__":
    sys.exit(main())
