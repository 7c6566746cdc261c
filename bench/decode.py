#!/usr/bin/env python
"""Decoding benchmark: TPF, TPS and wall-clock ratio to AR for each decoder, measured in one run.

    python bench/decode.py                      # a built-in tiny peaked model (CPU, a few seconds)
    python bench/decode.py --load CKPT --prompts prompts.jsonl --block-size 16

Also reports, per decoder, the engine's own Python time per iteration (decode time outside the model forward,
ms, and its share of decode time; target <= 5%), every speedup against the faster of this project's AR and
``transformers`` greedy on the same weights in the same run (named in the output; ``--no-hf`` skips it), and
the cost of one cached verification at equal full width (after 160 tokens): AR, Jacobi ``1+n`` and MR with
verification size v both ways the engine runs it (``tree``: one forward over every candidate; ``pruned``: main
chain, then only candidates that can still win -- none live / one live), and the share of MR forwards that needed
a second pass in the decode runs above (target <= 1.5x Jacobi at v=4).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _builtin_model(hidden, layers, vocab, ffn=None):
    from megatron_jf.models.convert import hf_to_mcore
    from megatron_jf.models.gpt import build_model
    from megatron_jf.models.hf_config import ModelArgs
    from megatron_jf.testing import peaked_hf_model

    hf = peaked_hf_model("qwen2", period=4, seed=0, vocab=vocab, hidden=hidden, layers=layers, heads=8, kv_heads=2,
                         ffn=ffn or hidden * 3, max_pos=2048)
    args = ModelArgs.from_hf_dict(hf.config.to_dict())
    m = build_model(args).eval()
    m.load_state_dict(hf_to_mcore(hf.state_dict(), args), strict=False)
    return m


def tree_layout(n: int, K: int, v: int):
    """One MR forward at full width: ``[last] + K*n`` main draft (causal) and ``v-1`` recycled candidates of
    ``n`` tokens, each a branch after ``last`` (as the engine lays them out in ``tree`` mode). Returns
    ``(s, tree, cand_lens)``."""
    from megatron_jf.inference.mr_verify import tree_mask

    main = 1 + K * n
    lens = [n] * (v - 1)
    s = main + sum(lens)
    return s, tree_mask(main, lens, s), lens


def forward_costs(model, n: int, context: int = 160, reps: int = 7, layouts=((1, 4), (2, 4), (1, 8))):
    """Median ms of one cached MR verification at full width, interleaved, each after ``context`` committed
    tokens: AR (1 token), Jacobi (1+n, causal), and MR (K, v) both ways the engine runs it
    (:mod:`megatron_jf.inference.mr_verify`): ``tree`` (one forward over main chain + every candidate) and
    ``pruned`` (main chain, then a second pass over the candidates that can still win) with no live candidate and
    with one live candidate that shares nothing with the draft (the worst case: all n of its tokens computed).
    Returns ``{name: ms}``."""
    import statistics

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
    p.add_argument("--ffn", type=int, default=None, help="MLP width of the built-in model (default 3 x hidden; the "
                   "quickstart's model A: --hidden 256 --layers 4 --vocab 4096 --ffn 688)")
    p.add_argument("--mr-verify", default="auto", choices=("auto", "tree", "pruned"),
                   help="how the engine verifies MR candidates (megatron_jf/inference/mr_verify.py)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-hf", action="store_true", help="skip the transformers greedy reference row")
    p.add_argument("--json", default=None, help="also write the results here")
    a = p.parse_args(argv)

    import torch

    torch.set_num_threads(a.threads)
    from megatron_jf import parallel
    from megatron_jf.eval.hf_baseline import HF
    from megatron_jf.eval.speed import measure, warm_up
    from megatron_jf.inference import mr_verify
    from megatron_jf.inference import runner as runner_mod
    from megatron_jf.inference.engine import BatchSession, DecodeConfig, Engine
    from megatron_jf.inference.runner import ModelRunner

    parallel.initialize(1, 1)
    parallel.set_seed(0)
    if a.load:
        from megatron_jf.checkpointing import load_model, tokenizer_path
        from megatron_jf.tokenizer import load_tokenizer

        model, margs, _ = load_model(a.load)
    else:
        model = _builtin_model(a.hidden, a.layers, a.vocab, a.ffn)
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

    # engine Python = decode time outside the model forward; counted per method by wrapping the runner's forward
    # (decode forwards only: prefill forwards return no logits) and MR's second pass, CPU time in the step without
    # its prefill
    cur = {}

    def _counter():
        return dict(fwd_s=0.0, fwds=0, cpu_fwd=0.0, cpu_step=0.0, second=0)

    @contextlib.contextmanager
    def around(name):
        cur["c"] = counters.setdefault(name, _counter())
        yield

    orig_fwd, orig_second = runner_mod.forward_logits, mr_verify.pruned_second_pass
    orig_step, orig_prefill = BatchSession.step, ModelRunner.prefill

    def timed(*args, **kw):
        t, c = time.perf_counter(), time.thread_time()
        out = orig_fwd(*args, **kw)
        if kw.get("return_logits", True):
            cur["c"]["cpu_fwd"] += time.thread_time() - c
            cur["c"]["fwd_s"] += time.perf_counter() - t
            cur["c"]["fwds"] += 1
        return out

    def timed_second(*args, **kw):
        t, c = time.perf_counter(), time.thread_time()
        out = orig_second(*args, **kw)
        cur["c"]["fwd_s"] += time.perf_counter() - t  # model work (its forward and trie), not engine Python
        cur["c"]["cpu_fwd"] += time.thread_time() - c
        cur["c"]["second"] += 1
        return out

    def timed_step(self, *args, **kw):
        c = time.thread_time()
        out = orig_step(self, *args, **kw)
        cur["c"]["cpu_step"] += time.thread_time() - c
        return out

    def timed_prefill(self, *args, **kw):
        c = time.thread_time()
        out = orig_prefill(self, *args, **kw)
        cur["c"]["cpu_step"] -= time.thread_time() - c
        return out

    n = a.block_size
    configs = {"ar": DecodeConfig("ar"), f"jacobi n={n}": DecodeConfig("jacobi", block_size=n),
               f"running-window n={n}": DecodeConfig("running-window", block_size=n),
               f"mr n={n} K=1 v=4": DecodeConfig("mr", block_size=n, num_blocks=1, verification_size=4),
               f"mr n={n} K=2 v=4": DecodeConfig("mr", block_size=n, num_blocks=2, verification_size=4)}
    engine = Engine(model, mr_verify=a.mr_verify)
    hf = None
    if not a.no_hf:
        from megatron_jf.eval.hf_baseline import hf_twin

        hf = hf_twin(model)
    warm_up(engine, prompts[0], configs, max_new_tokens=8, hf=hf)
    counters = {}
    runner_mod.forward_logits, mr_verify.pruned_second_pass = timed, timed_second
    BatchSession.step, ModelRunner.prefill = timed_step, timed_prefill
    try:  # each decoder over every prompt at batch 1 in turn (AR first), transformers greedy last
        speed = measure(engine, prompts, configs, max_new_tokens=a.max_new_tokens, batch_size=1, hf=hf, strict=False,
                        around=around, interleave=False)
    finally:
        runner_mod.forward_logits, mr_verify.pruned_second_pass = orig_fwd, orig_second
        BatchSession.step, ModelRunner.prefill = orig_step, orig_prefill
    rows = []
    for name in configs:
        st, c = speed.methods[name], counters[name]
        decode, fwds = st.decode_s, st.forwards
        py = max(0.0, decode - c["fwd_s"])  # engine Python: decode time outside the model forward
        rows.append(dict(decoder=name, tokens=st.tokens, forwards=fwds, tpf=st.tpf, tps=st.tps,
                         wall_s=st.wall_s, decode_s=decode, fwd_s=c["fwd_s"], lossless=not st.mismatched,
                         ms_per_decode_forward=1000 * decode / fwds, python_ms_per_iter=1000 * py / fwds,
                         overhead_share=py / decode, second_pass_share=c["second"] / fwds,
                         python_cpu_ms_per_iter=1000 * (c["cpu_step"] - c["cpu_fwd"]) / fwds,
                         overhead_share_cpu=(c["cpu_step"] - c["cpu_fwd"]) / c["cpu_step"]))
    hf_tps = speed.methods[HF].tps if hf is not None else None
    ok = hf is not None and not speed.methods[HF].mismatched
    ar = rows[0]
    base_name = "this project's ar" if speed.fastest_ar == "ar" else HF
    base = speed.methods[speed.fastest_ar].tps
    print(f"{'decoder':22s} {'TPF':>6s} {'TPS':>8s} {'speedup':>8s} {'ms/fwd':>7s} {'py ms/it':>9s} {'overhead':>9s} "
          f"{'py CPU ms':>9s} {'CPU share':>9s} {'2nd pass':>8s} lossless")
    for r in rows:
        r["speedup_vs_ar"] = r["tps"] / ar["tps"]
        r["speedup_vs_fastest_ar"] = r["tps"] / base
        print(f"{r['decoder']:22s} {r['tpf']:6.2f} {r['tps']:8.1f} {r['speedup_vs_fastest_ar']:7.2f}x "
              f"{r['ms_per_decode_forward']:7.2f} {r['python_ms_per_iter']:9.3f} {100 * r['overhead_share']:8.1f}% "
              f"{r['python_cpu_ms_per_iter']:9.3f} {100 * r['overhead_share_cpu']:8.1f}% "
              f"{100 * r['second_pass_share']:7.1f}% {r['lossless']}")
    if hf_tps is not None:
        print(f"{'transformers greedy':22s} {1.0:6.2f} {hf_tps:8.1f} {hf_tps / base:7.2f}x   (same weights; "
              f"outputs equal: {ok})")
    print(f"speedup = TPS / TPS of the fastest AR in this run: {base_name} ({base:.1f} tok/s)")
    print(f"max engine Python share of decode time: {100 * max(r['overhead_share'] for r in rows):.1f}% of wall time, "
          f"{100 * max(r['overhead_share_cpu'] for r in rows):.1f}% of this thread's CPU time (target <= 5%; the CPU "
          f"figure does not count time the process waited for a core on a shared machine, and counts only this "
          f"thread, so it is the one to read at --threads 1)")
    costs = forward_costs(model, n)
    jac = costs[f"jacobi n={n}"]
    print(f"one cached verification at full width after 160 tokens (median ms; ratio to Jacobi 1+n={n + 1}):")
    for k, v in costs.items():
        print(f"  {k:40s} {v:8.2f} ms  {v / jac:5.2f}x")
    print("  (MR target: <= 1.5x Jacobi at v=4. 'pruned' runs the main chain, then a second pass only when a candidate"
          " can still win; '2nd pass' above: the share of decode forwards that needed one. Expected pruned cost per"
          " forward = none-live cost + share x (one-live - none-live).)")
    for r in rows:
        if r["decoder"].startswith("mr"):
            tag = r["decoder"].split("mr ")[1]
            none, one = (costs.get(f"mr {tag} pruned, {w}") for w in ("none live", "one live"))
            if none and one:
                exp = none + r["second_pass_share"] * (one - none)
                print(f"  {r['decoder']}: expected pruned verification in the decode runs above {exp:.2f} ms = "
                      f"{exp / jac:.2f}x Jacobi")
    if a.json:
        from megatron_jf.fileio import atomic_write_json

        atomic_write_json(a.json, {"rows": rows, "forward_ms": costs, "fastest_ar": base_name,
                                   "transformers_greedy_tps": hf_tps})
    parallel.destroy()


if __name__ == "__main__":
    main()
