#!/usr/bin/env python
"""Training-step cost and peak memory of Jacobi Forcing on a tiny model, measured in one run (CPU or GPU).

Step = forward + loss + backward + AdamW step, batches prebuilt; times are the fastest of interleaved
repetitions (the least disturbed by other load on a shared machine; ``--stat median`` for medians), peak memory is the most bytes torch held during one forward + loss + backward above what was
live before it (CPU: the torch profiler's allocator events, :mod:`megatron_jf.training.memstats`; GPU:
``torch.cuda.max_memory_allocated``). Variants:

* **JF (loss rows)** -- today's training step: two-stream path (``2B`` causal rows, noisy + clean streams),
  the output layer only on the loss rows (student, teacher and AR positions; no prompt rows) and the
  KL + AR loss fused with it in chunks of ``--loss-chunk-size`` rows
  (:mod:`megatron_jf.training.output_head`).
* **JF (full rows)** -- the step before: the output layer over all ``2B x S`` rows, then the unchunked
  vocab-parallel KL / CE on the gathered logits (``--no-before`` skips it).
* **causal (unique tokens)** -- a plain next-token step (full logits, CE on every token) over the *unique*
  tokens of the same batch: ``B`` rows of ``P + 2R`` tokens (prompt counted once, noisy and clean
  response). Target: JF (loss rows) <= 1.1x.
* **JF dense** -- the same batch through the dense-mask path (packed ``[prompt, noisy B1, clean B1, ...]``
  with an explicit ``nc`` mask), loss rows.
* **per-block passes** -- ``N`` separate passes, pass ``j`` running the two streams truncated after block
  ``j`` with the loss on block ``j`` only. Target: the packed step >= N/2 times faster.

Usage::

    python -m bench.train_step                      # defaults: N=8 blocks of 16, prompt 64, batch 4, vocab 4096
    python -m bench.train_step --threads 2 --reps 7 --hidden 512 --layers 8 --vocab 32768

``--compare-precision`` times only today's step (JF two-stream, loss rows) in fp32 and in CPU mixed precision
(fp32 master weights, forward + loss + backward under bf16 autocast, as ``pretrain_jf.py --bf16`` trains on CPU:
:mod:`megatron_jf.precision`), interleaved, and reports samples/s of each and their ratio. ``--shape`` sets the
model to SmolLM2-135M's (hidden 576, 30 layers, 9 heads, 3 KV heads, FFN 1536, vocabulary 49152, tied) or the
quickstart's model A (hidden 256, 4 layers, 8 heads, 2 KV heads, FFN 688, vocabulary 4096)::

    python -m bench.train_step --compare-precision --shape smollm2 --prompt 160 --batch 2 --threads 2
    python -m bench.train_step --compare-precision --shape model-a --prompt 64 --blocks 12 --batch 8 --threads 2

On a CPU without native bf16 (no AVX-512 BF16 / AMX) the bf16 figure is emulated and says so.
"""

from __future__ import annotations

import argparse
import statistics
import time


def make_record(seed, *, prompt_len, block_size, num_blocks, vocab, num_states=6):
    """A hand-made trajectory record: random fixed points, drafts converging left to right."""
    import torch

    from megatron_jf.data.trajectory import BlockTrajectory, TrajectoryRecord

    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab - 1, (prompt_len,), generator=g)
    blocks, ctx = [], prompt_len
    for _ in range(num_blocks):
        fp = torch.randint(0, vocab - 1, (block_size,), generator=g)
        st = []
        for s in range(num_states):
            d = torch.randint(0, vocab - 1, (block_size,), generator=g)
            k = round(s * block_size / num_states)
            d[:k] = fp[:k]
            st.append(d)
        blocks.append(BlockTrajectory(context_len=ctx, drafts=torch.stack(st), fixed_point=fp))
        ctx += block_size
    return TrajectoryRecord(f"b{seed}", prompt, blocks, block_size, False).validate()


#: ``--shape`` presets: (hidden, layers, heads, kv_heads, ffn, vocab, tied embeddings).
SHAPES = {"smollm2": (576, 30, 9, 3, 1536, 49152, True), "model-a": (256, 4, 8, 2, 688, 4096, False)}


def compare_precision(step, opt, batch_size: int, reps: int, stat) -> dict:
    """Time ``step()`` (forward + loss + backward) + the optimizer step in fp32 and under bf16 autocast,
    interleaved (first round: warm-up). Returns ``{"fp32": s, "bf16": s}`` per step (``stat`` of ``reps``)."""
    import torch

    from megatron_jf.precision import autocast

    times = {"fp32": [], "bf16": []}
    for rep in range(reps + 1):
        for name, dt in (("fp32", None), ("bf16", torch.bfloat16)):
            opt.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            with autocast(dt):
                step()
            opt.step()
            if rep:
                times[name].append(time.perf_counter() - t0)
    return {k: stat(v) for k, v in times.items()}


#: The ``pretrain_jf.py`` flags the bench takes (their ``TrainConfig`` definitions; the bench's own defaults).
TRAIN_FLAGS = ("block_size", "loss_chunk_size")


def build_parser() -> argparse.ArgumentParser:
    """The bench's command line (torch-free); ``--block-size`` / ``--loss-chunk-size`` / ``--threads`` are
    ``pretrain_jf.py``'s definitions."""
    from bench import common
    from megatron_jf import cli
    from megatron_jf.training.config import TrainConfig

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=8, help="N blocks per sample")
    cli.add_dataclass_arguments(p, TrainConfig, only=TRAIN_FLAGS, defaults={"block_size": 16})
    p.add_argument("--prompt", dest="prompt_tokens", type=int, default=64, help="prompt tokens per sample")
    p.add_argument("--batch", type=int, default=4, help="samples per step")
    common.add_builtin_model_args(p, hidden=256, layers=4, vocab=4096)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--shape", choices=sorted(SHAPES), default=None,
                   help="model shape preset (overrides --hidden/--layers/--heads/--vocab)")
    p.add_argument("--compare-precision", action="store_true",
                   help="time only the JF loss-rows step, fp32 vs bf16 autocast (fp32 master weights)")
    p.add_argument("--no-before", action="store_true", help="skip the full-row (before) JF step")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per measurement")
    p.add_argument("--stat", choices=("min", "median"), default="min", help="statistic over the repetitions")
    cli.THREADS.add(p, default=1)
    return p


def main(argv=None):
    a = build_parser().parse_args(argv)
    import torch

    torch.set_num_threads(a.threads)

    from megatron_jf import parallel, platform

    parallel.initialize(1, 1)
    parallel.set_seed(0)
    from megatron_jf.data.packing import pack_record
    from megatron_jf.models.gpt import build_model
    from megatron_jf.models.hf_config import ModelArgs
    from megatron_jf.models.zoo import tiny_hf_config
    from megatron_jf.training.attention_paths import build_jf_batch, jf_forward
    from megatron_jf.training.config import JFObjective
    from megatron_jf.training.losses import ar_loss, jf_loss, loss_temporary_bytes
    from megatron_jf.training.memstats import peak_bytes
    from megatron_jf.training.output_head import forward_loss_rows, head_loss, output_weight

    chunk = a.loss_chunk_size
    kv, ffn, tied = max(1, a.heads // 4), int(2.75 * a.hidden), False
    if a.shape:
        a.hidden, a.layers, a.heads, kv, ffn, a.vocab, tied = SHAPES[a.shape]
    hf = tiny_hf_config("qwen2", vocab=a.vocab, hidden=a.hidden, layers=a.layers, heads=a.heads,
                        kv_heads=kv, ffn=ffn, tied=tied, max_pos=4096)
    args = ModelArgs.from_hf_dict(hf.to_dict())
    model = build_model(args)
    dev = platform.default_device()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    cfg = JFObjective()
    recs = [make_record(i, prompt_len=a.prompt_tokens, block_size=a.block_size, num_blocks=a.blocks, vocab=a.vocab)
            for i in range(a.batch)]
    packed = [pack_record(r, "progressive", a.blocks) for r in recs]
    two = build_jf_batch(packed, path="two_stream", mask="nc").to(dev)
    dense = build_jf_batch(packed, path="dense", mask="nc").to(dev)
    R, S = two.tokens.shape
    U = a.prompt_tokens + 2 * a.blocks * a.block_size  # unique tokens per sample: prompt once, noisy + clean response
    causal_tokens = torch.randint(0, a.vocab, (a.batch, U + 1), generator=torch.Generator().manual_seed(1)).to(dev)
    causal_pos = torch.arange(U, device=dev).expand(a.batch, U)

    # per-block passes: pass j = both streams up to the end of block j, loss on block j only
    from megatron_jf.data.trajectory import TrajectoryRecord

    per_block = []
    for j in range(a.blocks):
        sub = [pack_record(TrajectoryRecord(r.sample_id, r.prompt_ids, r.blocks[: j + 1], r.block_size, False),
                           pk.target_ratios[: j + 1].double()) for r, pk in zip(recs, packed)]
        b = build_jf_batch(sub, path="two_stream", mask="nc")
        keep = b.pair_block == j
        b.student_index, b.teacher_index = b.student_index[keep], b.teacher_index[keep]
        b.pc_targets, b.pair_sample, b.pair_block = b.pc_targets[keep], b.pair_sample[keep], b.pair_block[keep]
        # AR positions predicting block j's tokens: the last block_size AR positions of each sample
        col = b.ar_index % b.tokens.shape[1]
        akeep = col >= a.prompt_tokens - 1 + j * a.block_size
        b.ar_index, b.ar_targets, b.ar_sample = b.ar_index[akeep], b.ar_targets[akeep], b.ar_sample[akeep]
        per_block.append(b.to(dev))

    def sync():
        if platform.HAVE_CUDA:
            torch.cuda.synchronize()

    def jf_rows(batch):
        rows = forward_loss_rows(model, batch)
        loss, _ = head_loss(rows, output_weight(model), batch, cfg, args.vocab_size, chunk_size=chunk)
        (loss / batch.num_samples).backward()

    def _jf_rows_chunk(ch):
        rows = forward_loss_rows(model, two)
        loss, _ = head_loss(rows, output_weight(model), two, cfg, args.vocab_size, chunk_size=ch)
        (loss / two.num_samples).backward()

    def jf_full(batch):
        loss, _ = jf_loss(jf_forward(model, batch), cfg)
        (loss / batch.num_samples).backward()

    def causal_step():
        logits = model(causal_tokens[:, :-1], causal_pos, None, runtime_gather_output=False)
        loss, n, _ = ar_loss(logits, causal_tokens[:, 1:], vocab_size=args.vocab_size)
        (loss / n).backward()

    def run_once(fn):
        opt.zero_grad(set_to_none=True)
        sync()
        t0 = time.perf_counter()
        fn()
        opt.step()
        sync()
        return time.perf_counter() - t0

    def per_block_step():
        for b in per_block:
            jf_rows(b)

    stat = min if a.stat == "min" else statistics.median
    if a.compare_precision:
        from megatron_jf.precision import cpu_bf16_feature

        feat = cpu_bf16_feature()
        t = compare_precision(lambda: jf_rows(two), opt, a.batch, a.reps, stat)
        n_params = sum(p.numel() for p in model.parameters())
        print(f"model: {n_params / 1e6:.2f}M params ({a.shape or 'custom'}: hidden {a.hidden}, {a.layers} layers, "
              f"{a.heads}/{kv} heads, FFN {ffn}, vocab {a.vocab}), {a.threads} thread(s), device {dev}; CPU bf16: "
              + (f"{feat} (native)" if feat else "none (emulated: pretrain_jf.py --bf16 refuses this CPU)"))
        print(f"batch: {a.batch} samples x (prompt {a.prompt_tokens} + {a.blocks} blocks x {a.block_size}), two-stream "
              f"rows {R} x {S}; JF step (loss rows) + AdamW, {a.stat} of {a.reps}")
        for k in ("fp32", "bf16"):
            print(f"  {k + (' autocast, fp32 master weights' if k == 'bf16' else ''):<40} {t[k] * 1e3:9.1f} ms"
                  f"  {a.batch / t[k]:8.3f} samples/s")
        print(f"bf16 / fp32 samples/s: {t['fp32'] / t['bf16']:.3f}")
        parallel.destroy()
        return

    fns = {"jf": lambda: jf_rows(two), "full": lambda: jf_full(two), "causal": causal_step,
           "dense": lambda: jf_rows(dense), "blocks": per_block_step}
    if a.no_before:
        del fns["full"]
    labels = {"jf": "JF two-stream, loss rows (after)", "full": "JF two-stream, full rows (before)",
              "causal": "causal, unique tokens", "dense": "JF dense, loss rows", "blocks": f"{a.blocks} per-block passes"}
    # peak memory of one forward + loss + backward each (gradients set to None first, so they count alike)
    peak = {}
    for k in ("jf", "full", "causal", "dense"):
        if k in fns:
            opt.zero_grad(set_to_none=True)
            peak[k] = peak_bytes(fns[k], device=dev)[0]
    small = max(1, min(128, chunk or 128))
    opt.zero_grad(set_to_none=True)
    peak_small = peak_bytes(lambda: _jf_rows_chunk(small), device=dev)[0]
    # interleaved repetitions (a shared machine's load hits every variant alike); first round = warm-up
    times = {k: [] for k in fns}
    for rep in range(a.reps + 1):
        for k, fn in fns.items():
            t = run_once(fn)
            if rep:
                times[k].append(t)
    med = {k: stat(v) for k, v in times.items()}
    n_params = sum(p.numel() for p in model.parameters())
    C, M = len(two.pc_targets), len(two.ar_targets)
    loss_rows = 2 * C + M
    print(f"model: {n_params / 1e6:.2f}M params (hidden {a.hidden}, {a.layers} layers, vocab {a.vocab}), "
          f"{a.threads} thread(s), device {dev}")
    print(f"batch: {a.batch} samples x (prompt {a.prompt_tokens} + {a.blocks} blocks x {a.block_size}); "
          f"two-stream rows {R} x {S} = {R * S} tokens ({loss_rows} loss rows: {C} student + {C} teacher + {M} AR; "
          f"chunk {chunk or 'all'}); causal over unique tokens {a.batch} x {U} = {a.batch * U}; "
          f"dense rows {dense.tokens.shape[0]} x {dense.tokens.shape[1]}")
    mib = 2.0 ** 20
    for k in fns:
        mem = f"   peak {peak[k] / mib:7.1f} MiB" if k in peak else ""
        print(f"  {labels[k]:<36} {med[k] * 1e3:8.1f} ms ({a.stat} of {a.reps}){mem}")
    print(f"  {'JF two-stream, loss rows, chunk ' + str(small):<36} {'':>8}    (memory only)  peak {peak_small / mib:7.1f} MiB")
    print(f"loss temporaries (formula, losses.loss_temporary_bytes): after {loss_temporary_bytes(loss_rows, a.vocab, chunk, hidden=a.hidden) / mib:.1f} MiB"
          f" vs one chunk of all {R * S} rows {loss_temporary_bytes(R * S, a.vocab, None) / mib:.1f} MiB")
    print(f"JF step (loss rows) / causal step over the unique tokens: {med['jf'] / med['causal']:.3f}   (target <= 1.1)")
    if "full" in fns:
        print(f"JF step loss rows / full rows (after / before):          time {med['jf'] / med['full']:.3f}, "
              f"peak memory {peak['jf'] / peak['full']:.3f}")
    print(f"JF peak memory / causal step peak memory:                {peak['jf'] / peak['causal']:.3f}")
    print(f"two-stream / dense-mask path:                            {med['jf'] / med['dense']:.3f}")
    print(f"packed / {a.blocks} per-block passes:                            {med['jf'] / med['blocks']:.3f}   "
          f"(speed-up {med['blocks'] / med['jf']:.2f}x, target >= {a.blocks / 2:.1f}x)")
    parallel.destroy()


if __name__ == "__main__":
    main()
