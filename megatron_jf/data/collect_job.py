"""The trajectory-collection job behind ``jf collect`` / ``tools/generate_trajectories.py``
(:mod:`megatron_jf.commands.collect`, which documents the command line): a prompt file decoded greedily with Jacobi
into WebDataset shards under data parallelism, resumable, by this project's engine or by vLLM's
(:mod:`megatron_jf.vllm_plugin.collect`). The records, shards, ledgers and manifest are :mod:`megatron_jf.data.collect`'s.
"""

from __future__ import annotations

import os
import sys
import time

from megatron_jf import parallel


def _tokenizer_and_stops(args, specs, tok_path, margs, no_tokenizer: str):
    """The tokenizer (None when every prompt is ``prompt_ids`` and none is known) and the stop ids (tokenizer, model
    config, ``generation_config.json`` of ``--load``). ``no_tokenizer`` completes the error for text prompts
    without a tokenizer. Raises FileNotFoundError / ValueError naming the problem."""
    from megatron_jf.tokenizer import load_tokenizer, stop_token_ids

    if args.tokenizer and not os.path.exists(args.tokenizer):
        raise FileNotFoundError(f"tokenizer not found: {args.tokenizer}")
    text = next((s for s in specs if s.kind != "prompt_ids"), None)
    if text is not None and tok_path is None:
        raise ValueError(f"{text.where}: id {text.sample_id!r} is a '{text.kind}' prompt, but {no_tokenizer}; pass "
                         f"--tokenizer")
    tokenizer = load_tokenizer(tok_path) if tok_path else None
    if tokenizer is not None and tokenizer.vocab_size > margs.vocab_size:
        raise ValueError(f"tokenizer {tok_path} has {tokenizer.vocab_size} tokens but the model only "
                         f"{margs.vocab_size}: wrong tokenizer for {args.load}")
    eos_ids = stop_token_ids(tokenizer, margs, args.load)  # the one stop set (also the server's)
    if not eos_ids:
        print("warning: no stop token known (tokenizer or checkpoint); every response runs to --max-new-tokens",
              file=sys.stderr)
    return tokenizer, eos_ids


def _collect_config(args, eos_ids):
    from megatron_jf.data import collect as C

    return C.CollectConfig(block_size=args.block_size, max_new_tokens=args.max_new_tokens, draft_init=args.draft_init,
                           seed=args.seed, batch_size=args.batch_size, filter=not args.no_filter, eos_ids=eos_ids)


def _settings(args, cfg, tok_path, **model) -> dict:
    """What ``collect_config.json`` pins for a resumed run: the model (``model``), tokenizer and decoding settings."""
    settings = {"load": os.path.abspath(args.load), **model,
                "tokenizer": os.path.abspath(tok_path) if tok_path else None, "block_size": cfg.block_size,
                "max_new_tokens": cfg.max_new_tokens, "draft_init": cfg.draft_init, "seed": cfg.seed,
                "filter": cfg.filter, "eos_ids": sorted(cfg.eos_ids)}
    if getattr(args, "params_dtype", None):  # --bf16/--fp16 change the data; absent: as before the flag existed
        settings["params_dtype"] = args.params_dtype
    return settings


def _scan(out, settings) -> dict:
    """Prepare and scan the output directory (one process): what is done, complete shards, partials removed."""
    from megatron_jf.data import collect as C

    removed = C.prepare_output_dir(out, settings)
    state = C.scan_output_dir(out)
    return {"done": state.done_ids, "shards": state.shards, "removed": removed, "skipped": len(state.skipped)}


def _announce(args, specs, remaining, info, dp_size) -> None:
    done, prev_shards = info["done"], info["shards"]
    prev_records = sum(s.num_records for s in prev_shards)
    msg = f"{len(specs)} prompts in {args.prompts}; {len(remaining)} to collect on {dp_size} data-parallel rank(s)"
    if done:
        msg += (f" ({prev_records} records in {len(prev_shards)} complete shards and {info['skipped']} "
                f"skipped prompts from earlier runs")
        msg += f", {len(info['removed'])} partial file(s) removed)" if info["removed"] else ")"
    print(msg, flush=True)


def _fit_prompts(args, cfg, toks, max_context):
    """Prompts that fit ``max_context`` (longest first: similar lengths batch together) and those that do not."""
    from megatron_jf.data import collect as C

    fit, long = C.split_too_long(toks, max_context, cfg.max_new_tokens, args.long_prompts)
    fit.sort(key=lambda p: -len(p.ids))
    return fit, long


def _writer_and_ledger(args, cfg, out, dp_rank, prev_shards, long, max_context):
    """The shard writer (next free index after the complete shards) and the skip ledger, with the too-long prompts
    already in it."""
    from megatron_jf.data import collect as C
    from megatron_jf.data.shards import TrajectoryShardWriter

    prefix = C.shard_prefix(dp_rank)
    eos_ids = cfg.eos_ids
    writer = TrajectoryShardWriter(out, prefix=prefix, max_records_per_shard=args.max_records_per_shard,
                                   eos_id=next(iter(eos_ids)) if len(eos_ids) == 1 else None,
                                   start_index=C.next_shard_index(C.ResumeState(shards=prev_shards), prefix))
    ledger = C.SkipLedger(out, dp_rank)
    for p in long:
        ledger.add(p.sample_id, f"prompt_too_long({len(p.ids)}+{cfg.max_new_tokens}>{max_context})", "prompt_too_long")
    return writer, ledger


def _progress(args, total, desc):
    """A tqdm bar (or None with --no-progress) and the ``on_batch`` callback that advances it."""
    bar = None
    if not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="sample", desc=desc, mininterval=1.0, dynamic_ncols=True)
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

    return bar, on_batch


def _manifest_extra(args, cfg, **more) -> dict:
    return {"collector": "tools/generate_trajectories.py", "decoder": "jacobi", "draft_init": cfg.draft_init,
            "max_new_tokens": cfg.max_new_tokens, "seed": cfg.seed, "filter": cfg.filter,
            "eos_ids": sorted(cfg.eos_ids), **more, "prompts_file": os.path.abspath(args.prompts)}


def run(args) -> dict | None:
    """Collect; returns the manifest counts on global rank 0 (None elsewhere)."""
    if args.engine == "vllm":
        return run_vllm(args)
    import torch.distributed as dist

    from megatron_jf.checkpointing import read_meta, tokenizer_path
    from megatron_jf.data import collect as C
    from megatron_jf.load_errors import reject_hf_dir
    from megatron_jf.models.hf_config import ModelArgs

    t_start = time.perf_counter()
    # ---- cheap checks first: prompt file, checkpoint metadata, tokenizer
    reject_hf_dir(args.load)
    specs = C.read_prompts(args.prompts)
    meta = read_meta(args.load, verify=True)
    margs = ModelArgs.from_dict(meta["model_args"])
    tok_path = args.tokenizer or tokenizer_path(args.load)
    tokenizer, eos_ids = _tokenizer_and_stops(args, specs, tok_path, margs,
                                              f"checkpoint {args.load} has no tokenizer/ directory")
    cfg = _collect_config(args, eos_ids)

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
    settings = _settings(args, cfg, tok_path, iteration=int(meta["iteration"]))
    info = None
    if rank0:
        try:
            info = ("ok", _scan(out, settings))
        except (OSError, ValueError) as e:
            info = ("error", f"{type(e).__name__}: {e}" if isinstance(e, OSError) else str(e))
    info = parallel.broadcast_object(info)
    if info[0] == "error":
        raise ValueError(info[1])
    done, prev_shards = info[1]["done"], info[1]["shards"]
    remaining = [s for s in specs if s.sample_id not in done]
    mine = C.rank_slice(remaining, dp_rank, dp_size)
    if rank0:
        _announce(args, specs, remaining, info[1], dp_size)

    stats = C.CollectStats()
    n_long = 0
    if remaining:  # every rank agrees (same scan), so collective model loading stays in step
        from megatron_jf.checkpointing import load_model
        from megatron_jf.cli import params_dtype
        from megatron_jf.inference.llm import LLM

        model, _, _ = load_model(args.load, params_dtype=params_dtype(getattr(args, "params_dtype", None)))
        engine = LLM.from_model(model).engine
        toks = C.tokenize_prompts(mine, tokenizer, engine.vocab_size)
        fit, long = _fit_prompts(args, cfg, toks, engine.max_context)
        n_long = len(long)
        fit.sort(key=lambda p: -len(p.ids))  # similar lengths batch together (less padding); longest first
        writer = ledger = None
        if writer_rank:
            writer, ledger = _writer_and_ledger(args, cfg, out, dp_rank, prev_shards, long, engine.max_context)
        bar, on_batch = (_progress(args, len(fit), f"collect (dp rank 0/{dp_size})") if rank0
                         else (None, lambda st, n: None))
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
    gathered = parallel.gather_objects((writer_rank, stats.to_dict(), n_long))
    parallel.barrier()  # every shard is renamed into place before rank 0 scans
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
            extra=_manifest_extra(args, cfg, checkpoint_iteration=int(meta["iteration"])))
        _print_summary(total, long_total, counts, path, dp_size, args.tp, time.perf_counter() - t_start)
    parallel.barrier()
    if owns_pg:
        parallel.destroy()
    return counts


def run_vllm(args) -> dict:
    """``--engine vllm``: one process, vLLM's engine in it (:mod:`megatron_jf.vllm_plugin.collect`); the same output
    directory, shards, ledger and manifest as :func:`run`. Returns the manifest counts."""
    from megatron_jf.data import collect as C
    from megatron_jf.vllm_plugin import collect as V

    t_start = time.perf_counter()
    hf_config = V.check_hf_model_dir(args.load)
    specs = C.read_prompts(args.prompts)
    margs = V.model_args(hf_config)
    tok_path = args.tokenizer or (args.load if V.has_tokenizer(args.load) else None)
    tokenizer, eos_ids = _tokenizer_and_stops(args, specs, tok_path, margs,
                                              f"model directory {args.load} has no tokenizer files")
    cfg = _collect_config(args, eos_ids)
    dtype = {None: V.default_dtype(), "bf16": "bfloat16", "fp16": "float16"}[getattr(args, "params_dtype", None)]
    out = os.path.abspath(args.out)
    settings = _settings(args, cfg, tok_path, engine="vllm", dtype=dtype, weights=V.weights_fingerprint(args.load))
    try:
        info = _scan(out, settings)
    except OSError as e:
        raise ValueError(f"{type(e).__name__}: {e}") from None
    remaining = [s for s in specs if s.sample_id not in info["done"]]
    _announce(args, specs, remaining, info, 1)
    stats, n_long, collector = C.CollectStats(), 0, None
    if remaining:
        max_context = V.context_window(hf_config) - V.context_room(cfg.block_size)  # vLLM must keep drafting
        toks = C.tokenize_prompts(remaining, tokenizer, margs.vocab_size)
        fit, long = _fit_prompts(args, cfg, toks, max_context)
        n_long = len(long)
        kv = int(args.kv_cache_gb * 2**30) if args.kv_cache_gb else None
        need = V.engine_length(max((len(p.ids) for p in fit), default=1), cfg.max_new_tokens, cfg.block_size)
        collector = V.VLLMCollector(args.load, block_size=cfg.block_size, draft_init=cfg.draft_init, dtype=dtype,
                                    max_num_seqs=args.batch_size, max_model_len=need, kv_cache_bytes=kv,
                                    enforce_eager=args.enforce_eager)
        writer, ledger = _writer_and_ledger(args, cfg, out, 0, info["shards"], long, max_context)
        bar, on_batch = _progress(args, len(fit), "collect (vLLM)")
        try:
            with writer:
                stats = V.collect(collector, fit, cfg, writer=writer, ledger=ledger, on_batch=on_batch)
        finally:
            ledger.close()
            if bar is not None:
                bar.close()
    path, counts = C.write_collection_manifest(
        out, model=os.path.abspath(args.load), tokenizer=os.path.abspath(tok_path) if tok_path else "",
        block_size=cfg.block_size, prompt_ids=[s.sample_id for s in specs],
        extra=_manifest_extra(args, cfg, engine="vllm", dtype=dtype,
                              fixed_points=f"{dtype} greedy of vLLM {V.vllm_version()}"))
    _print_summary(stats, n_long, counts, path, 1, 1, time.perf_counter() - t_start,
                   engine=f"vLLM {V.vllm_version()}, {dtype}")
    if collector is not None and collector.prefill_disagreements:
        print(f"  near-ties  : {collector.prefill_disagreements} prompt(s) whose second request re-derived another "
              f"token at the first iteration's end (records follow the second request)", flush=True)
    return counts


def _print_summary(st, n_long, counts, manifest, dp, tp, wall, engine=None):
    dt = max(st.seconds, 1e-9)
    filt = ", ".join(f"{k} {v}" for k, v in sorted(st.filtered.items())) or "none"
    where = f"with {engine}" if engine else f"on {dp} data-parallel rank(s) x tp {tp}"
    lines = [
        f"collection finished in {wall:.1f} s {where}",
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
