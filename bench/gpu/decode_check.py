#!/usr/bin/env python
"""GPU decode check (one H200, <= 8 min): batch-1 decode speed of a Qwen2.5-7B-shaped model against the roofline.

    python -m bench.gpu.decode_check                 # on a CUDA machine: random bf16 weights built on the GPU
    python -m bench.gpu.decode_check --dry-run       # CPU, a tiny model, a few steps: proves the script runs

Measures, in one run, on a Qwen2.5-7B-shaped megatron-core model (28 layers, hidden 3584, 28 heads / 4 KV
heads, FFN 18944, vocab 152064, QKV bias, untied head) whose random bf16 weights are drawn on the GPU (nothing is
downloaded):

1. AR tokens/s at batch 1 after a 512-token prompt, with the static-shape path and CUDA graphs
   (:mod:`megatron_jf.inference.static_decode`), the static path eager, and the plain eager lean forward,
   against the bandwidth roofline ``HBM bandwidth / weight bytes`` (bandwidth: ``--hbm-gbs``, default the
   H200's 4800 GB/s, and the device-to-device copy bandwidth measured here);
2. the cost of one ``1 + n`` token forward (Jacobi block) for n = 16, 32, 64, 128 relative to a 1-token forward;
3. an MR forward with verification size 4 (K = 1 and 2 at n = 16, full tree, and the two-pass form with one
   live branch) relative to the Jacobi forward at the same n.

Every figure is a median of timed repeats (``torch.cuda.synchronize`` around each), under ``torch.inference_mode``.
Prints a table and, with ``--json``, writes the numbers. ``bash bench/gpu/check.sh`` (issue 21) is the one-window GPU
check that also decodes with the engine; this script is the detailed decode-speed companion.
"""

from __future__ import annotations

import statistics
import time

from bench.common import DRY_RUN_SHAPE, GPU_SHAPE, build_random_model


def _median_ms(fn, reps, sync):
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(1000 * (time.perf_counter() - t0))
    return statistics.median(times)


def build_parser():
    """The command line (torch-free)."""
    from megatron_jf import cli

    from bench import common

    p = common.parser(__doc__)
    common.DRY_RUN.add(p, help="CPU, tiny model, few steps (no GPU figures)")
    p.add_argument("--prompt-len", type=cli.positive_int, default=512, help="prompt tokens before the timed steps")
    p.add_argument("--decode-steps", type=cli.positive_int, default=64, help="AR steps timed per mode")
    common.REPEATS.add(p, default=10, help="timed repeats per forward shape")
    p.add_argument("--hbm-gbs", type=float, default=4800.0, help="HBM bandwidth for the roofline, GB/s (H200: 4800)")
    cli.JSON_OUT.add(p)
    return p


def main(argv=None):
    p = build_parser()
    a = p.parse_args(argv)
    import torch

    with torch.inference_mode():  # no autograd: the KV buffers must not join a graph (timings, memory)
        return _measure(a)


def _measure(a):
    import torch

    from megatron_jf import parallel
    from megatron_jf.inference.lean_forward import LeanForward
    from megatron_jf.inference.static_decode import StaticDecoder
    from megatron_jf.inference.forward import forward_logits
    from megatron_jf.models.gpt import new_kv_cache

    cuda = torch.cuda.is_available() and not a.dry_run
    if not cuda and not a.dry_run:
        raise SystemExit("no CUDA device: run with --dry-run (CPU tiny mode) or on a GPU machine")
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    shape = GPU_SHAPE if cuda else DRY_RUN_SHAPE
    prompt_len = a.prompt_len if cuda else 32
    steps = a.decode_steps if cuda else 4
    reps = a.repeats if cuda else 2
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    parallel.initialize(1, 1)
    t0 = time.perf_counter()
    with torch.inference_mode(False):  # parameters stay normal tensors (LeanForward reads their version counters)
        model = build_random_model(shape, dtype, device)
    wbytes = sum(x.numel() * x.element_size() for x in model.parameters())
    print(f"model: {'Qwen2.5-7B shape' if cuda else 'tiny (dry run)'}, {wbytes / 1e9:.2f} GB of {dtype} weights on "
          f"{device} ({torch.cuda.get_device_name() if cuda else 'cpu'}), built in {time.perf_counter() - t0:.1f} s")
    lean = LeanForward(model)
    vocab = model.vocab_size_unpadded
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (1, prompt_len), generator=g)
    max_len = prompt_len + steps + 300
    results = {"device": str(device), "weight_bytes": wbytes, "dtype": str(dtype)}

    # measured copy bandwidth (read + write of a 1 GB buffer) for a second roofline
    if cuda:
        buf = torch.empty(1 << 29, dtype=torch.bfloat16, device=device)
        out = torch.empty_like(buf)
        ms = _median_ms(lambda: out.copy_(buf), 5, sync)
        results["copy_gbs"] = 2 * buf.numel() * 2 / ms / 1e6
        del buf, out

    def fresh_cache():
        c = new_kv_cache(model, 1, max_len)
        forward_logits(model, prompt, torch.arange(prompt_len)[None], kv_cache=c, return_logits=False, impl="lean")
        c.commit([prompt_len])
        return c

    # 1. AR tokens/s, three modes
    ar = {}
    for mode in ("cuda graphs", "static eager", "eager lean") if cuda else ("static eager", "eager lean"):
        cache = fresh_cache()
        dec = StaticDecoder(lean, cache, buckets=[1], use_graphs=(mode == "cuda graphs")) if mode != "eager lean" else None
        tok = prompt[:, -1:]

        def step():
            nonlocal tok
            pos = cache.lengths[:, None].clone()
            logits = dec.forward(tok, pos) if dec is not None else forward_logits(model, tok, pos, kv_cache=cache,
                                                                                 impl="lean")
            tok = logits[:, -1:].argmax(-1).cpu()
            cache.commit([1])

        for _ in range(3):  # warm-up (capture)
            step()
        sync()
        t1 = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        ar[mode] = steps / (time.perf_counter() - t1)
    results["ar_tok_s"] = ar
    roof = a.hbm_gbs * 1e9 / wbytes
    results["roofline_tok_s"] = roof
    print(f"\n1. AR at batch 1 after {prompt_len} prompt tokens ({steps} steps):")
    for k, v in ar.items():
        print(f"   {k:14s} {v:9.1f} tok/s   {100 * v / roof:5.1f}% of the {a.hbm_gbs:.0f} GB/s roofline "
              f"({roof:.1f} tok/s)" + (f", {100 * v / (results['copy_gbs'] * 1e9 / wbytes):5.1f}% of the measured "
                                        f"{results['copy_gbs']:.0f} GB/s copy roofline" if cuda else ""))

    # 2 + 3. forward cost by width (eager static path; graphs for the bucket when CUDA)
    from bench.common import tree_layout  # the engine's MR layout at full width

    cache = fresh_cache()
    widths = {"1 token": (1, None, None)}
    for n in (16, 32, 64, 128):
        widths[f"1+{n}"] = (1 + n, None, None)
    for K in (1, 2):
        s, tree, _ = tree_layout(16, K, 4)
        widths[f"mr n=16 K={K} v=4 tree (one forward)"] = (s, tree, None)
        widths[f"mr n=16 K={K} v=4 pruned, one live"] = (1 + K * 16, None, "pruned")
    dec = StaticDecoder(lean, cache, buckets=sorted({w for w, _, _ in widths.values()}), use_graphs=cuda)
    base_tok = prompt[:, -1:]
    g0 = int(dec.forward(base_tok, cache.lengths[:, None].clone())[0, 0].argmax())
    cache.commit([0])
    costs = {}
    from megatron_jf.inference import mr_verify

    for name, (s, tree, kind) in widths.items():
        toks = torch.randint(0, vocab, (1, s), generator=g)
        toks[0, 0] = base_tok[0, 0]
        pos = cache.lengths[:, None] + torch.arange(s)[None]
        if tree is not None:  # the 3 candidate branches sit at positions last+1.. like the main draft
            pos[0, s - 3 * 16:] = torch.cat([cache.lengths + 1 + torch.arange(16)] * 3)
        if kind == "pruned":  # main chain (static path), then one live 16-token candidate (eager second pass)
            toks[0, 1] = (g0 + 1) % vocab
            cand = [g0] + torch.randint(0, vocab, (15,), generator=g).tolist()

        def fwd():
            if kind == "pruned":
                base = int(cache.lengths[0])
                main = dec.forward(toks, pos)[0, :s, :vocab].float()
                gm = main.argmax(-1).tolist()
                k = mr_verify.matches(toks[0, 1:].tolist(), gm)
                live = mr_verify.live_candidates(toks[0, 1:].tolist(), gm, k, [cand])
                if live:
                    mr_verify.pruned_second_pass(model, cache, base=base, block=s, main_logits=main, g=gm, k_main=k,
                                                 live=live)
            elif tree is not None:
                dec.forward(toks, pos, tree)
            else:
                dec.forward(toks, pos)
            cache.commit([0])

        fwd()
        fwd()
        costs[name] = _median_ms(fwd, reps, sync)
    results["forward_ms"] = costs
    one = costs["1 token"]
    print(f"\n2. one forward after {prompt_len} cached tokens (median of {reps}; static shapes"
          f"{', CUDA graphs' if cuda else ', eager'}):")
    for name, ms in costs.items():
        extra = ""
        if name.startswith("mr"):
            extra = f"   {ms / costs['1+16']:.2f}x the Jacobi 1+16 forward"
        print(f"   {name:36s} {ms:9.3f} ms  {ms / one:6.2f}x a 1-token forward{extra}")
    if a.json:
        from megatron_jf.fileio import atomic_write_json

        atomic_write_json(a.json, results)
    if not cuda:
        print("\n(dry run on CPU: the script works; these are not GPU figures)")
    parallel.destroy()


if __name__ == "__main__":
    main()
