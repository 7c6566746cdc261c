#!/usr/bin/env python
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
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser (Megatron-LM and vLLM spellings accepted, see :mod:`megatron_jf.cli`); the block size
    and draft initialisation are the decoder flags every tool shares."""
    from megatron_jf import cli

    p = cli.parser(__doc__)
    p.add_argument("--prompts", required=True, help="prompt JSONL file (required)")
    cli.add_load_arg(p)
    cli.add_tokenizer_arg(p)
    p.add_argument("--out", required=True, help="output directory for shards and manifest (required)")
    g = cli.add_decode_args(p, title="Jacobi decoding of the trajectories (paper Sec. 3.1)",
                            fields=("block_size", "draft_init"))
    cli.add_max_new_tokens_arg(g, default=1024, help="response length cap per prompt (trajectories are training "
                               "data: longer than the generation tools' 256; the paper uses 2048)")
    cli.add_batch_arg(p, default=8, help="prompts decoded together per rank")
    p.add_argument("--seed", type=int, default=0, help="seed of the draft initialisation")
    p.add_argument("--max-records-per-shard", type=cli.positive_int, default=1000, help="records per shard")
    cli.add_parallel_args(p, tp_help="tensor-parallel size (the data-parallel size is WORLD_SIZE / tp)")
    cli.add_precision_args(p)
    p.add_argument("--no-filter", action="store_true", help="keep degenerate (repetitive) responses")
    p.add_argument("--long-prompts", choices=("skip", "error"), default="skip",
                   help="prompts that do not fit the context window: skip and count them, or stop with an error")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    cli.add_threads_arg(p)
    return p


def parse_args(argv=None):
    """Parse and range-check the command line (argparse errors exit with status 2)."""
    p = build_parser()
    args = p.parse_args(argv)
    if args.block_size < 1:
        p.error(f"--block-size must be >= 1, got {args.block_size}")
    return args


def _broadcast(obj):
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _gather(obj) -> list:
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _barrier():
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def run(args) -> dict | None:
    """Collect; returns the manifest counts on global rank 0 (None elsewhere)."""
    import torch.distributed as dist

    from megatron_jf import parallel
    from megatron_jf.checkpointing import read_meta, tokenizer_path
    from megatron_jf.data import collect as C
    from megatron_jf.load_errors import reject_hf_dir
    from megatron_jf.models.hf_config import ModelArgs
    from megatron_jf.tokenizer import load_tokenizer, stop_token_ids

    t_start = time.perf_counter()
    # ---- cheap checks first: prompt file, checkpoint metadata, tokenizer
    reject_hf_dir(args.load)
    specs = C.read_prompts(args.prompts)
    meta = read_meta(args.load, verify=True)
    margs = ModelArgs.from_dict(meta["model_args"])
    tok_path = args.tokenizer or tokenizer_path(args.load)
    if args.tokenizer and not os.path.exists(args.tokenizer):
        raise FileNotFoundError(f"tokenizer not found: {args.tokenizer}")
    text = next((s for s in specs if s.kind != "prompt_ids"), None)
    if text is not None and tok_path is None:
        raise ValueError(f"{text.where}: id {text.sample_id!r} is a '{text.kind}' prompt, but checkpoint {args.load} "
                         f"has no tokenizer/ directory; pass --tokenizer")
    tokenizer = load_tokenizer(tok_path) if tok_path else None
    if tokenizer is not None and tokenizer.vocab_size > margs.vocab_size:
        raise ValueError(f"tokenizer {tok_path} has {tokenizer.vocab_size} tokens but the model only "
                         f"{margs.vocab_size}: wrong tokenizer for {args.load}")
    eos_ids = stop_token_ids(tokenizer, margs, args.load)  # the one stop set (also the server's)
    if not eos_ids:
        print("warning: no stop token known (tokenizer or checkpoint); every response runs to --max-new-tokens",
              file=sys.stderr)
    cfg = C.CollectConfig(block_size=args.block_size, max_new_tokens=args.max_new_tokens, draft_init=args.draft_init,
                          seed=args.seed, batch_size=args.batch_size, filter=not args.no_filter, eos_ids=eos_ids)

    # ---- processes
    owns_pg = not dist.is_initialized()
    parallel.initialize(args.tp, 1)
    parallel.set_seed(args.seed)
    from megatron.core import parallel_state as ps

    rank0 = parallel.is_rank0()
    dp_rank, dp_size = parallel.dp_rank(), parallel.dp_size()
    writer_rank = ps.get_tensor_model_parallel_rank() == 0

    # ---- output directory: rank 0 prepares and scans it, everyone learns what is done
    out = os.path.abspath(args.out)
    settings = {"load": os.path.abspath(args.load), "iteration": int(meta["iteration"]),
                "tokenizer": os.path.abspath(tok_path) if tok_path else None, "block_size": cfg.block_size,
                "max_new_tokens": cfg.max_new_tokens, "draft_init": cfg.draft_init, "seed": cfg.seed,
                "filter": cfg.filter, "eos_ids": sorted(eos_ids)}
    if getattr(args, "params_dtype", None):  # --bf16/--fp16 change the data; absent: as before the flag existed
        settings["params_dtype"] = args.params_dtype
    info = None
    if rank0:
        try:
            removed = C.prepare_output_dir(out, settings)
            state = C.scan_output_dir(out)
            info = ("ok", {"done": state.done_ids, "shards": state.shards, "removed": removed,
                           "skipped": len(state.skipped)})
        except (OSError, ValueError) as e:
            info = ("error", f"{type(e).__name__}: {e}" if isinstance(e, OSError) else str(e))
    info = _broadcast(info)
    if info[0] == "error":
        raise ValueError(info[1])
    done, prev_shards = info[1]["done"], info[1]["shards"]
    remaining = [s for s in specs if s.sample_id not in done]
    mine = C.rank_slice(remaining, dp_rank, dp_size)
    if rank0:
        prev_records = sum(s.num_records for s in prev_shards)
        msg = f"{len(specs)} prompts in {args.prompts}; {len(remaining)} to collect on {dp_size} data-parallel rank(s)"
        if done:
            msg += (f" ({prev_records} records in {len(prev_shards)} complete shards and {info[1]['skipped']} "
                    f"skipped prompts from earlier runs")
            msg += f", {len(info[1]['removed'])} partial file(s) removed)" if info[1]["removed"] else ")"
        print(msg, flush=True)

    stats = C.CollectStats()
    n_long = 0
    if remaining:  # every rank agrees (same scan), so collective model loading stays in step
        from megatron_jf.checkpointing import load_model
        from megatron_jf.data.shards import TrajectoryShardWriter
        from megatron_jf.inference.engine import Engine

        from megatron_jf.cli import params_dtype

        model, _, _ = load_model(args.load, params_dtype=params_dtype(getattr(args, "params_dtype", None)))
        engine = Engine(model)
        toks = C.tokenize_prompts(mine, tokenizer, engine.vocab_size)
        fit, long = C.split_too_long(toks, engine.max_context, cfg.max_new_tokens, args.long_prompts)
        n_long = len(long)
        fit.sort(key=lambda p: -len(p.ids))  # similar lengths batch together (less padding); longest first
        writer = ledger = None
        if writer_rank:
            prefix = C.shard_prefix(dp_rank)
            state = C.ResumeState(shards=prev_shards)
            writer = TrajectoryShardWriter(out, prefix=prefix, max_records_per_shard=args.max_records_per_shard,
                                           eos_id=next(iter(eos_ids)) if len(eos_ids) == 1 else None,
                                           start_index=C.next_shard_index(state, prefix))
            ledger = C.SkipLedger(out, dp_rank)
            for p in long:
                ledger.add(p.sample_id, f"prompt_too_long({len(p.ids)}+{cfg.max_new_tokens}>{engine.max_context})",
                           "prompt_too_long")
        bar = None
        if rank0 and not args.no_progress:
            from tqdm import tqdm

            bar = tqdm(total=len(fit), unit="sample", desc=f"collect (dp rank 0/{dp_size})", mininterval=1.0,
                       dynamic_ncols=True)
        acc = {"tokens": 0, "forwards": 0, "t0": time.perf_counter()}

        def on_batch(st, n):
            if bar is None:
                return
            acc["tokens"] += st.tokens
            acc["forwards"] += st.forwards
            dt = max(time.perf_counter() - acc["t0"], 1e-9)
            bar.set_postfix_str(f"{acc['tokens'] / dt:.1f} tok/s, TPF {acc['tokens'] / max(acc['forwards'], 1):.2f}",
                                refresh=False)
            bar.update(n)

        try:
            if writer is not None:
                with writer:
                    stats = C.collect(engine, fit, cfg, writer=writer, ledger=ledger, on_batch=on_batch)
            else:
                stats = C.collect(engine, fit, cfg, on_batch=on_batch)
        finally:
            if ledger is not None:
                ledger.close()
            if bar is not None:
                bar.close()

    # ---- gather, manifest, summary
    gathered = _gather((writer_rank, stats.to_dict(), n_long))
    _barrier()  # every shard is renamed into place before rank 0 scans
    counts = None
    if rank0:
        total = C.CollectStats()
        long_total = 0
        for is_writer, d, nl in gathered:
            if is_writer:
                total = total.merge(C.CollectStats(**d))
                long_total += nl
        path, counts = C.write_collection_manifest(
            out, model=os.path.abspath(args.load), tokenizer=os.path.abspath(tok_path) if tok_path else "",
            block_size=cfg.block_size, prompt_ids=[s.sample_id for s in specs],
            extra={"collector": "tools/generate_trajectories.py", "decoder": "jacobi", "draft_init": cfg.draft_init,
                   "max_new_tokens": cfg.max_new_tokens, "seed": cfg.seed, "filter": cfg.filter,
                   "eos_ids": sorted(eos_ids), "checkpoint_iteration": int(meta["iteration"]),
                   "prompts_file": os.path.abspath(args.prompts)})
        _print_summary(total, long_total, counts, path, dp_size, args.tp, time.perf_counter() - t_start)
    _barrier()
    if owns_pg:
        parallel.destroy()
    return counts


def _print_summary(st, n_long, counts, manifest, dp, tp, wall):
    dt = max(st.seconds, 1e-9)
    filt = ", ".join(f"{k} {v}" for k, v in sorted(st.filtered.items())) or "none"
    lines = [
        f"collection finished in {wall:.1f} s on {dp} data-parallel rank(s) x tp {tp}",
        f"  this run   : {st.prompts} prompts decoded -> {st.records} records ({st.eos} ended with EOS); "
        f"filtered: {filt}; too long: {n_long}",
        f"  speed      : {st.prompts / dt:.2f} samples/s, {st.tokens / dt:.1f} tokens/s, "
        f"TPF {st.tpf:.2f} ({st.tokens} tokens in {st.forwards} forwards)",
        f"  dataset    : {counts['records']} records in {counts['shards']} shards, {counts['response_tokens']} "
        f"response tokens, {counts['states']} recorded drafts; prompts {counts.get('prompts')} "
        f"(missing {counts.get('missing')})",
        f"  manifest   : {manifest}",
    ]
    print("\n".join(lines), flush=True)


def main(argv=None):
    args = parse_args(argv)
    from megatron_jf import cli
    from megatron_jf.load_errors import check_load_dir

    try:
        check_load_dir(args.load)  # before torch is imported
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    cli.set_threads(args.threads)
    try:
        return run(args)
    except (FileNotFoundError, ValueError, FileExistsError) as e:
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main()
