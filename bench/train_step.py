#!/usr/bin/env python
"""Training-step cost of Jacobi Forcing on a tiny model, measured in one run (CPU or GPU).

Prints three ratios (median step times, forward + loss + backward + AdamW step, batches prebuilt):

1. **JF / plain causal**: a JF step on the two-stream path (``2B`` causal rows: noisy + clean streams,
   KL + AR loss) divided by a plain next-token step over the same number of tokens (``2B`` rows of the
   same length, CE on every token). Target: <= 1.1.
2. **two-stream / dense**: the same JF batch through the two-stream path vs the dense-mask path
   (packed ``[prompt, noisy B1, clean B1, ...]`` with an explicit ``nc`` mask).
3. **packed / per-block**: one packed two-stream pass over all ``N`` blocks divided by ``N`` separate
   passes, pass ``j`` running the two streams truncated after block ``j`` with the loss on block ``j``
   only (recomputing the shared prefix each time). Target: packed >= N/2 times faster.

Usage::

    python bench/train_step.py                      # defaults: N=8 blocks of 16, prompt 64, batch 4
    python bench/train_step.py --threads 2 --reps 7 --hidden 512 --layers 8
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402


def make_record(seed, *, prompt_len, block_size, num_blocks, vocab, num_states=6):
    """A hand-made trajectory record: random fixed points, drafts converging left to right."""
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


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=8, help="N blocks per sample")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--batch", type=int, default=4, help="samples per step")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per measurement (median)")
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)

    from megatron_jf import parallel, platform

    parallel.initialize(1, 1)
    parallel.set_seed(0)
    from megatron_jf.data.packing import pack_record
    from megatron_jf.models.gpt import build_model
    from megatron_jf.models.hf_config import ModelArgs
    from megatron_jf.testing import tiny_hf_config
    from megatron_jf.training.attention_paths import build_jf_batch, jf_forward
    from megatron_jf.training.losses import LossConfig, ar_loss, jf_loss

    hf = tiny_hf_config("qwen2", vocab=a.vocab, hidden=a.hidden, layers=a.layers, heads=a.heads,
                        kv_heads=max(1, a.heads // 4), ffn=int(2.75 * a.hidden), max_pos=4096)
    args = ModelArgs.from_hf_dict(hf.to_dict())
    model = build_model(args)
    dev = platform.default_device()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    cfg = LossConfig()
    recs = [make_record(i, prompt_len=a.prompt, block_size=a.block_size, num_blocks=a.blocks, vocab=a.vocab)
            for i in range(a.batch)]
    packed = [pack_record(r, "progressive", a.blocks) for r in recs]
    two = build_jf_batch(packed, path="two_stream", mask="nc").to(dev)
    dense = build_jf_batch(packed, path="dense", mask="nc").to(dev)
    R, S = two.tokens.shape
    plain_tokens = torch.randint(0, a.vocab, (R, S + 1), generator=torch.Generator().manual_seed(1)).to(dev)
    plain_pos = torch.arange(S, device=dev).expand(R, S)

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
        akeep = col >= a.prompt - 1 + j * a.block_size
        b.ar_index, b.ar_targets, b.ar_sample = b.ar_index[akeep], b.ar_targets[akeep], b.ar_sample[akeep]
        per_block.append(b.to(dev))

    def sync():
        if platform.HAVE_CUDA:
            torch.cuda.synchronize()

    def jf_step(batch):
        loss, _ = jf_loss(jf_forward(model, batch), cfg)
        (loss / batch.num_samples).backward()

    def plain_step():
        logits = model(plain_tokens[:, :-1], plain_pos, None, runtime_gather_output=False)
        loss, n, _ = ar_loss(logits, plain_tokens[:, 1:], vocab_size=args.vocab_size)
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
            jf_step(b)

    # interleaved repetitions (a shared machine's load hits every variant alike); first round = warm-up
    fns = {"jf": lambda: jf_step(two), "plain": plain_step, "dense": lambda: jf_step(dense), "blocks": per_block_step}
    times = {k: [] for k in fns}
    for rep in range(a.reps + 1):
        for k, fn in fns.items():
            t = run_once(fn)
            if rep:
                times[k].append(t)
    t_jf, t_plain, t_dense, t_blocks = (statistics.median(times[k]) for k in ("jf", "plain", "dense", "blocks"))
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M params (hidden {a.hidden}, {a.layers} layers, vocab {a.vocab}), "
          f"{a.threads} thread(s), device {dev}")
    print(f"batch: {a.batch} samples x (prompt {a.prompt} + {a.blocks} blocks x {a.block_size}); "
          f"two-stream rows {R} x {S} = {R * S} tokens; dense rows {dense.tokens.shape[0]} x {dense.tokens.shape[1]}")
    print(f"step times (median of {a.reps}): JF two-stream {t_jf * 1e3:.1f} ms | plain causal {t_plain * 1e3:.1f} ms"
          f" | JF dense {t_dense * 1e3:.1f} ms | {a.blocks} per-block passes {t_blocks * 1e3:.1f} ms")
    print(f"JF step / plain causal step (same tokens): {t_jf / t_plain:.3f}   (target <= 1.1)")
    print(f"two-stream / dense-mask path:            {t_jf / t_dense:.3f}")
    print(f"packed / {a.blocks} per-block passes:            {t_jf / t_blocks:.3f}   "
          f"(speed-up {t_blocks / t_jf:.2f}x, target >= {a.blocks / 2:.1f}x)")
    parallel.destroy()


if __name__ == "__main__":
    main()
