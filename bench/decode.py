#!/usr/bin/env python
"""Decoding benchmark: TPF, TPS and wall-clock ratio to AR for each decoder, measured in one run.

    python bench/decode.py                      # a built-in tiny peaked model (CPU, a few seconds)
    python bench/decode.py --load CKPT --prompts prompts.jsonl --block-size 16

Also reports, per decoder, the share of decode wall time spent outside the model forward (engine
overhead; target <= 10%) and the cost of one MR forward with verification size v relative to one
plain Jacobi forward at the same n (target <= 1.5x for v=4).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _builtin_model(hidden, layers, vocab):
    from megatron_jf.models.convert import hf_to_mcore
    from megatron_jf.models.gpt import build_model
    from megatron_jf.models.hf_config import ModelArgs
    from megatron_jf.testing import peaked_hf_model

    hf = peaked_hf_model("qwen2", period=4, seed=0, vocab=vocab, hidden=hidden, layers=layers, heads=8, kv_heads=2,
                         ffn=hidden * 3, max_pos=2048)
    args = ModelArgs.from_hf_dict(hf.config.to_dict())
    m = build_model(args).eval()
    m.load_state_dict(hf_to_mcore(hf.state_dict(), args), strict=False)
    return m


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load", default=None, help="checkpoint (default: built-in tiny peaked model)")
    p.add_argument("--prompts", default=None, help="JSONL with prompt_ids or prompt (needs the checkpoint tokenizer)")
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None, help="also write the results here")
    a = p.parse_args(argv)

    import torch

    torch.set_num_threads(a.threads)
    from megatron_jf import parallel
    from megatron_jf.inference import engine as eng_mod
    from megatron_jf.inference.engine import DecodeConfig, Engine

    parallel.initialize(1, 1)
    parallel.set_seed(0)
    if a.load:
        from megatron_jf.checkpointing import load_model, tokenizer_path
        from megatron_jf.tokenizer import load_tokenizer

        model, margs, _ = load_model(a.load)
    else:
        model = _builtin_model(a.hidden, a.layers, a.vocab)
    vocab = model.vocab_size_unpadded
    prompts = []
    if a.prompts:
        tok = None
        for line in open(a.prompts):
            rec = json.loads(line)
            if "prompt_ids" in rec:
                prompts.append(rec["prompt_ids"])
            else:
                tok = tok or load_tokenizer(tokenizer_path(a.load))
                prompts.append(tok.encode(rec["prompt"]))
            if len(prompts) == a.num_prompts:
                break
    else:
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, vocab, (32,), generator=g).tolist() for _ in range(a.num_prompts)]

    fwd_time = [0.0]
    fwd_count = [0]
    orig = eng_mod.forward_logits

    def timed(*args, **kw):
        t = time.perf_counter()
        out = orig(*args, **kw)
        fwd_time[0] += time.perf_counter() - t
        fwd_count[0] += 1
        return out

    eng_mod.forward_logits = timed
    n = a.block_size
    configs = [("ar", DecodeConfig("ar")), (f"jacobi n={n}", DecodeConfig("jacobi", block_size=n)),
               (f"running-window n={n}", DecodeConfig("running-window", block_size=n)),
               (f"mr n={n} K=1 v=4", DecodeConfig("mr", block_size=n, num_blocks=1, verification_size=4)),
               (f"mr n={n} K=2 v=4", DecodeConfig("mr", block_size=n, num_blocks=2, verification_size=4))]
    engine = Engine(model)
    engine.generate(prompts[:1], DecodeConfig("ar"), max_new_tokens=8)  # warm-up
    rows, ref = [], None
    for name, cfg in configs:
        fwd_time[0], fwd_count[0] = 0.0, 0
        t0 = time.perf_counter()
        res = [engine.generate([pr], cfg, max_new_tokens=a.max_new_tokens)[0] for pr in prompts]
        wall = time.perf_counter() - t0
        decode = sum(r.decode_s for r in res)
        prefill_fwd = sum(1 for r in res if r.prompt_len > 1)
        decode_fwd_time = fwd_time[0] - prefill_fwd * 0  # prefill forwards are outside decode_s
        toks = sum(len(r.tokens) for r in res)
        fwds = sum(r.forwards for r in res)
        if ref is None:
            ref = [r.tokens for r in res]
        lossless = all(r.tokens == t for r, t in zip(res, ref))
        rows.append(dict(decoder=name, tokens=toks, forwards=fwds, tpf=toks / fwds, tps=toks / decode,
                         wall_s=wall, decode_s=decode, fwd_s=fwd_time[0], n_fwd=fwd_count[0], lossless=lossless,
                         ms_per_decode_forward=1000 * decode / fwds))
    eng_mod.forward_logits = orig
    ar = rows[0]
    # per-forward model time: subtract the prefill forwards (one per prompt) measured separately
    print(f"{'decoder':22s} {'TPF':>6s} {'TPS':>8s} {'speedup':>8s} {'ms/fwd':>7s} {'overhead':>9s} lossless")
    for r in rows:
        pre = len(prompts)
        model_in_decode = r["fwd_s"] * (r["n_fwd"] - pre) / r["n_fwd"]
        r["overhead_share"] = max(0.0, 1 - model_in_decode / r["decode_s"])
        r["speedup_vs_ar"] = r["tps"] / ar["tps"]
        print(f"{r['decoder']:22s} {r['tpf']:6.2f} {r['tps']:8.1f} {r['speedup_vs_ar']:7.2f}x "
              f"{r['ms_per_decode_forward']:7.2f} {100 * r['overhead_share']:8.1f}% {r['lossless']}")
    jac = rows[1]["ms_per_decode_forward"]
    mr = rows[3]["ms_per_decode_forward"]
    print(f"MR forward (v=4, K=1) / Jacobi forward (n={n}): {mr / jac:.2f}x   (target <= 1.5x)")
    print(f"max engine overhead share: {100 * max(r['overhead_share'] for r in rows):.1f}%   (target <= 10%)")
    if a.json:
        with open(a.json + ".tmp", "w") as f:
            json.dump({"rows": rows, "mr_over_jacobi_forward": mr / jac}, f, indent=1)
        os.replace(a.json + ".tmp", a.json)
    parallel.destroy()


if __name__ == "__main__":
    main()
