#!/usr/bin/env python
"""Decoding precision on CPU: fp32 weights vs bf16 weights vs fp32 weights under bf16 autocast, in one run.

    python -m bench.decode_precision --load ckpt/smollm2 --humaneval 2 --max-new-tokens 64 --threads 2

For each precision (the same checkpoint loaded once per mode, runs interleaved, fastest of ``--reps`` kept):

* **AR** at batch 1: decode tokens/s (prefill excluded), the serving and evaluation case (a memory-bound GEMV
  per token: bf16 weights halve the bytes read, autocast reads fp32 and converts every forward);
* **Jacobi** at block size ``--block-size`` with trajectories recorded, ``--collect-batch`` prompts decoded
  together, as ``tools/generate_trajectories.py`` collects: forwards/s and tokens/s (compute-bound products);

and whether each precision is lossless in itself (Jacobi output == the same precision's AR output; where not, the
token where they part and the top two logits there: a near-tie that the wider forward rounds the other way), and
how many of the fp32 AR tokens the bf16 outputs reproduce (bf16 outputs differ from fp32 outputs: rounding changes
the argmax where two logits are close). Prints whether the CPU's bf16 is native (AVX-512 BF16 / AMX) or emulated.
"""

from __future__ import annotations

import time


MODES = ("fp32", "bf16 weights", "bf16 autocast")


def _prompts(a, tok):
    from megatron_jf.eval.benchmarks import load_benchmark
    from megatron_jf.eval.prompts import build_messages

    return [tok.encode(tok.apply_chat_template(build_messages(pr)))
            for pr in load_benchmark("humaneval", limit=a.humaneval_problems)]


def _agree(a: list[int], b: list[int]) -> int:
    """Length of the common prefix."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def build_parser():
    """The command line (torch-free)."""
    from megatron_jf import cli

    from bench import common

    p = common.parser(__doc__)
    cli.LOAD.add(p, required=True, help="megatron_jf checkpoint (with its tokenizer)")
    p.add_argument("--humaneval", dest="humaneval_problems", type=cli.positive_int, default=2, metavar="N",
                   help="first N HumanEval problems (chat template) as prompts")
    cli.MAX_NEW_TOKENS.add(p, default=64)
    common.add_block_args(p, block_size=32)
    p.add_argument("--collect-batch", type=cli.positive_int, default=8, help="prompts decoded together in the Jacobi "
                   "run (the prompts are repeated to fill it)")
    common.REPEATS.add(p, default=2, help="timed rounds (after one warm-up round); the fastest is kept")
    cli.THREADS.add(p, default=1)
    return p


def main(argv=None):
    p = build_parser()
    a = p.parse_args(argv)

    import torch

    torch.set_num_threads(a.threads)
    from bench import common
    from megatron_jf import parallel
    from megatron_jf.checkpointing import load_model, tokenizer_path
    from megatron_jf.decoding import PAPER, DecodeConfig
    from megatron_jf.inference.forward import forward_logits
    from megatron_jf.precision import autocast, cpu_bf16_feature
    from megatron_jf.tokenizer import load_tokenizer

    parallel.initialize(1, 1)
    tok = load_tokenizer(tokenizer_path(a.load))
    prompts = _prompts(a, tok)
    batch = [prompts[i % len(prompts)] for i in range(a.collect_batch)]
    models = {"fp32": load_model(a.load, params_dtype=torch.float32)[0],
              "bf16 weights": load_model(a.load, params_dtype=torch.bfloat16)[0]}
    models["bf16 autocast"] = models["fp32"]
    ar, jac = DecodeConfig("ar"), DecodeConfig("jacobi", block_size=a.block_size, **PAPER)
    best = {m: {"ar": float("inf"), "jac": float("inf")} for m in MODES}
    out = {}
    for rep in range(a.repeats + 1):  # round 0 warms up
        for mode in MODES:
            eng = common.engine(models[mode])
            with autocast(torch.bfloat16 if mode == "bf16 autocast" else None):
                r_ar = [eng.generate([pr], ar, max_new_tokens=a.max_new_tokens)[0] for pr in prompts]
                t0 = time.perf_counter()
                r_jac = eng.generate(batch, jac, max_new_tokens=a.max_new_tokens, record_trajectory=True)
                jac_s = time.perf_counter() - t0
            if rep:
                best[mode]["ar"] = min(best[mode]["ar"], sum(r.decode_s for r in r_ar))
                best[mode]["jac"] = min(best[mode]["jac"], jac_s)
            out[mode] = dict(ar=[r.tokens for r in r_ar], jac=[r.tokens for r in r_jac],
                             ar_tokens=sum(len(r.tokens) for r in r_ar),
                             jac_tokens=sum(len(r.tokens) for r in r_jac), jac_forwards=sum(r.forwards for r in r_jac))
    feat = cpu_bf16_feature()
    print(f"{a.load}: {sum(p.numel() for p in models['fp32'].parameters()) / 1e6:.1f}M params, {a.threads} "
          f"thread(s); CPU bf16: {feat + ' (native)' if feat else 'none (emulated: the tools refuse --bf16 here)'}")
    print(f"{len(prompts)} HumanEval prompts, {a.max_new_tokens} new tokens; AR batch 1 (decode only); Jacobi n="
          f"{a.block_size} batch {a.collect_batch} with trajectories (wall, prefill included); fastest of {a.repeats}")
    ref = out["fp32"]["ar"]
    base = best["fp32"]
    for mode in MODES:
        o, b = out[mode], best[mode]
        want = [o["ar"][i % len(prompts)] for i in range(a.collect_batch)]
        lossless = all(j == r for j, r in zip(o["jac"], want))
        agree = sum(_agree(x, y) for x, y in zip(o["ar"], ref))
        print(f"  {mode:<14} AR {o['ar_tokens'] / b['ar']:7.2f} tok/s ({base['ar'] / b['ar']:.2f}x fp32) | Jacobi "
              f"{o['jac_forwards'] / b['jac']:6.2f} forwards/s, {o['jac_tokens'] / b['jac']:7.2f} tok/s "
              f"({base['jac'] / b['jac']:.2f}x fp32) | Jacobi == AR: {lossless} | AR tokens equal to fp32 AR's "
              f"(common prefix): {agree}/{sum(len(x) for x in ref)}")
        for row, (j, r) in enumerate(zip(o["jac"], want)):
            if j != r:  # where Jacobi parts from AR: the top two logits of one forward over prompt + AR prefix
                k = _agree(j, r)
                ctx = torch.tensor([prompts[row % len(prompts)] + r[:k]])
                with autocast(torch.bfloat16 if mode == "bf16 autocast" else None):
                    top = forward_logits(models[mode], ctx, torch.arange(ctx.shape[1])[None])[0, -1].float().topk(2)
                print(f"      batch row {row}: parts from AR at token {k} (AR {r[k]}, Jacobi {j[k]}); top-2 logits "
                      f"{top.values.tolist()} for ids {top.indices.tolist()}")
    parallel.destroy()


if __name__ == "__main__":
    main()
