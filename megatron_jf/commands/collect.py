"""Collect greedy Jacobi-decoding trajectories into WebDataset shards (paper Sec. 3.1, 4.1).

Single process, or data-parallel under torchrun (each data-parallel rank decodes its own disjoint
slice of the prompts and writes its own shards; with ``--tp`` > 1 the ranks of one tensor-parallel
group share prompts and one of them writes)::

    python tools/generate_trajectories.py --prompts prompts.jsonl --load ckpt/qwen7b --out data/traj \\
        --block-size 32 --max-new-tokens 1024 --batch-size 8
    torchrun --nproc_per_node 8 tools/generate_trajectories.py --tp 2 ...   # 4 data-parallel ranks

Prompts: JSONL lines ``{"id", "prompt"}`` (raw text, whitespace kept exactly), ``{"id", "messages"}``
(chat turns, rendered with the tokenizer's chat template) or ``{"id", "prompt_ids"}`` (token ids).
The tokenizer is the checkpoint's ``tokenizer/`` unless ``--tokenizer`` is given (none is needed for
``prompt_ids``). Decoding stops at any stop id of the tokenizer or the checkpoint, or after
``--max-new-tokens``; the last block is cut right after the EOS (``eos_reached`` set).

Output (``--out``): shards ``traj-dpRRRRR-IIIIII.tar``, skip ledgers ``traj-dpRRRRR.skipped.jsonl``,
``collect_config.json`` and, once every rank has finished, ``manifest.json`` (model, tokenizer,
block size, counts, shard list, filtered counts by reason). See :mod:`megatron_jf.data.collect`.

vLLM (``--engine vllm``, in an environment with vLLM: ``JF_ENV=vllm bash scripts/bootstrap.sh``): the same shards,
ledgers and manifest, decoded by vLLM's engine (:mod:`megatron_jf.vllm_plugin.collect`); ``--load`` is then a Hugging
Face model directory (``tools/convert_hf.py mcore-to-hf`` exports a megatron checkpoint), one process, no torchrun.
``--bf16`` runs vLLM in bfloat16: the fixed points are then bf16 greedy (labelled in the manifest)::

    python tools/generate_trajectories.py --engine vllm --load models/qwen7b-hf --prompts prompts.jsonl \
        --out data/traj --block-size 32 --max-new-tokens 1024 --batch-size 64

Resume: re-run the same command; prompts already in complete shards (or in a skip ledger) are not
decoded again and temporary files of the killed run are deleted, so the result has every prompt
exactly once. Settings that change the data (model, block size, ...) must match the first run.

Repetition filter: degenerate responses are dropped and counted by reason (``--no-filter`` keeps them).
Prompts too long for the context window (prompt + ``--max-new-tokens``) are skipped and counted as
``prompt_too_long`` (``--long-prompts error`` stops with an error naming the first one instead).
"""

from __future__ import annotations

import argparse
import os
import sys

from megatron_jf import cli
from megatron_jf.commands import run

NAME = "generate_trajectories"


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser (Megatron-LM and vLLM spellings accepted, see :mod:`megatron_jf.cli`); the block size
    and draft initialisation are the decoder flags every tool shares."""
    p = cli.parser(__doc__)
    cli.PROMPTS.add(p, required=True)
    cli.add_load_arg(p, help="megatron checkpoint directory (required; a Hugging Face model is converted first with "
                     "tools/convert_hf.py hf-to-mcore); with --engine vllm a Hugging Face model directory")
    p.add_argument("--engine", choices=("megatron", "vllm"), default="megatron",
                   help="decode with this project's engine, or with vLLM (needs vllm installed; one process)")
    cli.add_tokenizer_arg(p)
    cli.OUT.add(p, required=True, help="output directory for shards and manifest (required)")
    g = cli.add_decode_args(p, title="Jacobi decoding of the trajectories (paper Sec. 3.1)",
                            fields=("block_size", "draft_init"))
    cli.add_max_new_tokens_arg(g, default=1024, help="response length cap per prompt (trajectories are training "
                               "data: longer than the generation tools' 256; the paper uses 2048)")
    cli.add_batch_arg(p, default=8, help="prompts decoded together per rank")
    cli.SEED.add(p, default=0, help="seed of the draft initialisation")
    p.add_argument("--max-records-per-shard", type=cli.positive_int, default=1000, help="records per shard")
    cli.add_parallel_args(p, tp_help="tensor-parallel size (the data-parallel size is WORLD_SIZE / tp)")
    cli.add_precision_args(p)
    p.add_argument("--no-filter", action="store_true", help="keep degenerate (repetitive) responses")
    p.add_argument("--long-prompts", choices=("skip", "error"), default="skip",
                   help="prompts that do not fit the context window: skip and count them, or stop with an error")
    cli.NO_PROGRESS.add(p)
    cli.add_threads_arg(p)
    v = p.add_argument_group("vLLM engine (--engine vllm)")
    v.add_argument("--kv-cache-gb", type=float, default=None, help="vLLM KV-cache size in GiB (default: vLLM's)")
    cli.ENFORCE_EAGER.add(v)
    return p


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Range checks the flags' types cannot express (``p.error``: usage and exit 2)."""
    if args.block_size < 1:
        p.error(f"--block-size must be >= 1, got {args.block_size}")
    if args.engine == "vllm" and args.tp != 1:
        p.error("--engine vllm runs one in-process vLLM worker: --tp must be 1")
    if args.engine == "vllm" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        p.error("--engine vllm runs as one process, not under torchrun (split the prompt file to run several)")


def main(argv=None) -> int:
    """``tools/generate_trajectories.py`` / ``jf collect``; returns the exit status (:mod:`megatron_jf.commands`)."""
    p = build_parser()
    args, status = cli.parse_or_status(p, argv)
    if args is None:
        return status
    try:
        check_args(p, args)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2

    def body() -> int:
        if args.engine != "vllm":  # vLLM reads a Hugging Face directory (run_vllm checks it)
            from megatron_jf.load_errors import check_load_dir

            check_load_dir(args.load)  # before torch is imported
        cli.set_threads(args.threads)
        from megatron_jf.data.collect_job import run as collect

        collect(args)
        return 0

    return run(NAME, body, (ValueError, FileExistsError))


if __name__ == "__main__":
    sys.exit(main())
