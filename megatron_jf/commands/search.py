"""Grid search of MR/Jacobi inference settings (Jacobi Forcing Appendix E, Figure 5-style surface).

For every point of block size n x verification size v (x blocks K x spawn threshold r) the decoder runs greedy on a
fixed prompt set; TPF and TPS (decode-only tokens/s, ratio of sums) are measured. A quadratic least-squares
surface ``TPS ~ 1 + x + v + x^2 + v^2 + x*v`` with ``x = log2 n`` is fitted over the (K, r) slice holding the best
point, drawn as a contour plot with the measured points (PNG), and the best configuration (highest measured TPS)
is printed and saved as JSON together with every point, the fit and the AR baseline::

    python tools/search_inference_config.py --load ckpt/ --benchmark humaneval --limit 8 --decoder mr \\
        --block-sizes 16,32,64 --verification-sizes 1,2,4,8 --num-blocks 1,2 --spawn-thresholds 0.85 --out search/

Outputs: ``{out}/search.json`` and ``{out}/surface.png`` (atomic writes).
"""

from __future__ import annotations

import argparse
import json
import os
import sys


from megatron_jf import cli
from megatron_jf.commands import run

NAME = "search_inference_config"


#: The grid searched when no values are given (paper Appendix E, Figure 5: n up to 64, v up to 8).
GRID_DEFAULTS = {"block_size": (16, 32, 64), "verification_size": (1, 2, 4, 8), "num_blocks": (2,),
                 "spawn_threshold": (0.85,)}


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser: the decoder flags of every tool (:func:`megatron_jf.cli.add_decode_args`), with
    ``--block-size(s)``, ``--verification-size(s)``, ``--num-blocks`` and ``--spawn-threshold(s)`` taking
    comma-separated grids (Megatron-LM and vLLM spellings accepted, see :mod:`megatron_jf.cli`)."""
    p = cli.parser(__doc__)
    cli.add_load_arg(p)
    cli.add_benchmark_args(p, benchmark="humaneval", limit=8)
    cli.add_tokenizer_arg(p)
    g = cli.add_decode_args(p, title="decoding: the drafting decoder searched, and the grid (paper Appendix E)",
                            decoders=("jacobi", "running-window", "mr"), grids=GRID_DEFAULTS)
    cli.add_max_new_tokens_arg(g)
    cli.add_batch_arg(p)
    cli.add_threads_arg(p)
    cli.add_inference_args(p)
    cli.OUT.add(p, default="search_out", help="output directory (search.json, surface.png)")
    cli.NO_PROGRESS.add(p)
    return p


def main(argv=None) -> int:
    """``tools/search_inference_config.py`` / ``jf search``; returns the exit status (0, or 2 on bad input:
    :mod:`megatron_jf.commands`)."""
    a, status = cli.parse_or_status(build_parser(), argv)
    if a is None:
        return status
    from megatron_jf.eval.benchmarks import BenchmarkDataError, MissingBenchmarkPackage
    from megatron_jf.eval.harness import HarnessError

    return run(NAME, lambda: _search(a), (HarnessError, MissingBenchmarkPackage, BenchmarkDataError))


def _search(a) -> int:
    from megatron_jf.eval.benchmarks import load_benchmark
    from megatron_jf.eval.harness import ChatTemplateAdapter, HarnessError, decode_config_from
    from megatron_jf.fileio import atomic_write_text
    from megatron_jf.eval.prompts import prompt_info, render_prompt
    from megatron_jf.eval.search import plot_surface, search
    from megatron_jf.inference.llm import LLM
    from megatron_jf.load_errors import check_load_dir

    check_load_dir(a.load)
    if a.benchmark not in (None, "humaneval", "mbpp", "gsm8k", "math", "math500") and not a.benchmark_data:
        raise HarnessError(f"unknown benchmark {a.benchmark!r}")
    decode_config_from(a.decoder, draft_init=a.draft_init, ngram_pool_size=a.ngram_pool_size)
    lm = LLM.from_checkpoint(a.load, tokenizer=a.tokenizer, threads=a.threads, options=cli.inference_options(a))
    problems = load_benchmark(a.benchmark, limit=a.limit, data_path=a.benchmark_data)
    if not problems:
        raise HarnessError("empty prompt set")
    chat = ChatTemplateAdapter(lm.tokenizer)
    prompts = [lm.tokenizer.encode(render_prompt(q, chat, mode=a.prompt_mode, prompt_set=a.prompt_set))
               for q in problems]
    lm.engine.generate([prompts[0]], decode_config_from("ar"), max_new_tokens=2)  # warm-up
    res = search(lm.engine, prompts, decoder=a.decoder, block_sizes=a.block_size,
                 verification_sizes=a.verification_size, num_blocks=a.num_blocks,
                 spawn_thresholds=a.spawn_threshold, max_new_tokens=a.max_new_tokens, eos_ids=lm.eos_ids,
                 batch_size=a.batch_size, progress=not a.no_progress,
                 draft_init=a.draft_init, ngram_pool_size=a.ngram_pool_size)
    os.makedirs(a.out, exist_ok=True)
    best = res["best"]
    label = decode_config_from(best["decoder"], block_size=best["block_size"],
                               verification_size=best["verification_size"], num_blocks=best["num_blocks"],
                               spawn_threshold=best["spawn_threshold"]).label
    res.update({"checkpoint": lm.ckpt_dir, "benchmark": a.benchmark, "data": a.benchmark_data,
                "num_prompts": len(prompts),
                "max_new_tokens": a.max_new_tokens, "prompt": prompt_info(a.prompt_set, mode=a.prompt_mode,
                                                                            tokenizer=chat),
                "best_label": label, "paths": {"json": os.path.join(a.out, "search.json"),
                                               "png": os.path.join(a.out, "surface.png")}})
    slice_ = [q for q in res["points"] if q["num_blocks"] == best["num_blocks"]
              and q["spawn_threshold"] == best["spawn_threshold"]]
    plot_surface(slice_, res["fit"], res["paths"]["png"], f"TPS over (n, v), K={best['num_blocks']}, "
                 f"r={best['spawn_threshold']:g}")
    atomic_write_text(res["paths"]["json"], json.dumps(res, indent=2) + "\n")
    print("| n | v | K | r | TPF | TPS |\n|---|---|---|---|---|---|")
    for q in res["points"]:
        print(f"| {q['block_size']} | {q['verification_size']} | {q['num_blocks']} | {q['spawn_threshold']:g} | "
              f"{q['tpf']:.2f} | {q['tps']:.1f} |")
    print(f"AR: TPF {res['ar']['tpf']:.2f}, TPS {res['ar']['tps']:.1f}")
    print(f"best: {label}: TPF {best['tpf']:.2f}, TPS {best['tps']:.1f} ({best['speedup_tps']:.2f}x AR TPS); "
          f"lossless on all points: {res['lossless']} -> {res['paths']['json']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
