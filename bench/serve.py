#!/usr/bin/env python
"""Bounded serving load test on loopback: same-config vs mixed-config traffic, 1 / 8 / 32 clients.

Starts ``tools/run_text_generation_server.py`` as a subprocess on 127.0.0.1 (a free port) for a
checkpoint (default: the tiny test checkpoint of :mod:`megatron_jf.models.zoo`, built once under
``--work``). For each *mix* and each client count, every client sends ``--requests-per-client`` greedy
``/v1/completions`` requests (closed loop: each waits for its answer before the next). Mixes:

* one per decoder of ``--decoders`` (every client uses that decoder: "same config");
* ``mixed``: client ``i`` uses decoder ``i mod len(decoders)``, so the server batches different decoder
  configs together (continuous batching across configs).

Reported per run: ``tok_s`` (aggregate generated tokens / wall seconds), ``p50_s`` / ``p95_s``
(per-request latency), ``tpf`` (mean tokens per forward), ``batch`` (mean rows in the engine step that
finished a request), ``speedup`` (``tok_s`` / the same mix's 1-client ``tok_s``). The summary compares
``mixed`` with the same-config runs at each client count: ``mixed / mean(same)`` (target >= 0.8 at 32
clients -- the mean over the mixed decoders is what serving each decoder's share alone would give).

Example::

    python -m bench.serve                                  # tiny model, 4 decoders, 1 / 8 / 32 clients
    python -m bench.serve --ckpt CKPT --max-tokens 128 --clients 1 8 32 --json out.json
"""

from __future__ import annotations

import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time

from bench.common import REPO

PROMPTS = ["The quick brown fox", "Hello world!", "def add(a, b):", "Speculative decoding", "Grüße aus Köln",
           "Jacobi forcing makes", "print(add(1, 2))", "naïve café"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def run_load(url: str, jfs: list[dict], clients: int, per_client: int, max_tokens: int, timeout_s: float,
             mix: str) -> dict:
    """Closed-loop load: ``clients`` threads each send ``per_client`` requests, client ``i`` with decode
    config ``jfs[i % len(jfs)]``. Returns the stats dict.

    Raises:
        RuntimeError: a request failed (non-200) -- the message has the server's error.
    """
    import httpx

    lat, toks, tpf, bsz, errors = [], [], [], [], []
    lock = threading.Lock()

    def client(ci):
        with httpx.Client(base_url=url, timeout=timeout_s) as c:
            for k in range(per_client):
                body = {"prompt": f"{PROMPTS[(ci + k) % len(PROMPTS)]} {ci}-{k}", "max_tokens": max_tokens,
                        "temperature": 0, "jf": jfs[ci % len(jfs)]}
                t0 = time.perf_counter()
                r = c.post("/v1/completions", json=body)
                dt = time.perf_counter() - t0
                with lock:
                    if r.status_code != 200:
                        errors.append(r.text)
                        return
                    b = r.json()
                    lat.append(dt)
                    toks.append(b["usage"]["completion_tokens"])
                    tpf.append(b["jf"]["tpf"])
                    bsz.append(b["jf"]["batch_size"])

    t0 = time.perf_counter()
    ths = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in ths:
        t.start()
    for t in ths:
        t.join(timeout_s * per_client)
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, e.g. {errors[0][:500]}")
    return {"mix": mix, "clients": clients, "requests": len(lat), "tokens": sum(toks),
            "wall_s": round(wall, 3), "tok_s": round(sum(toks) / wall, 1), "p50_s": round(_pct(lat, 0.5), 3),
            "p95_s": round(_pct(lat, 0.95), 3), "tpf": round(statistics.mean(tpf), 3),
            "batch": round(statistics.mean(bsz), 2)}


def engine_steps(ckpt: str, cfgs: list[dict], rows: int, max_tokens: int, repeats: int, splits=(256, None)) -> list[dict]:
    """Engine-level check without HTTP: ``rows`` prompts decoded in one BatchSession, same config (each of
    ``cfgs``) vs mixed (row ``i`` uses ``cfgs[i % len(cfgs)]``), with the step split on and off; runs are
    interleaved ``repeats`` times and the median tok/s is reported (less noise than the HTTP load)."""
    from megatron_jf.decoding import DecodeConfig
    from megatron_jf.inference.request import Request
    from megatron_jf.inference.llm import LLM

    llm = LLM.from_checkpoint(ckpt)  # parallel.initialize, the model, its tokenizer
    tok, eng = llm.tokenizer, llm.engine
    prompts = [tok.encode(f"{PROMPTS[i % len(PROMPTS)]} {i}") for i in range(rows)]
    mixes = [(c["decoder"], [c]) for c in cfgs] + [("mixed", cfgs)]
    times: dict[tuple, list[float]] = {}
    toks: dict[tuple, int] = {}
    for _ in range(repeats):
        for mix, jfs in mixes:
            for split in splits:
                sess = eng.open_batch(rows, max_width=512, split_min_saving=split)
                for i, pr in enumerate(prompts):
                    sess.add(pr, Request(decode=DecodeConfig(**jfs[i % len(jfs)]), max_new_tokens=max_tokens))
                t0, n = time.perf_counter(), 0
                while sess.num_rows:
                    n += sum(len(r.tokens) for _, r in sess.step())
                times.setdefault((mix, split), []).append(time.perf_counter() - t0)
                toks[(mix, split)] = n
    out = []
    for (mix, split), ts in times.items():
        out.append({"engine_mix": mix, "split_min_saving": split, "rows": rows,
                    "tok_s": round(toks[(mix, split)] / statistics.median(ts), 1)})
    return out


def build_parser():
    """The command line (torch-free)."""
    from megatron_jf import cli

    from bench import common

    p = common.parser(__doc__)
    p.add_argument("--ckpt", default=None, help="checkpoint (default: build the tiny test checkpoint)")
    common.WORK.add(p, default="/tmp/jf_bench_serve", help="where the tiny checkpoint is built")
    p.add_argument("--decoders", nargs="+", default=["ar", "jacobi", "running-window", "mr"],
                   help="decoders of the same-config runs; the mixed run cycles through them")
    common.add_block_args(p, block_size=8, help="decoding: n for jacobi/running-window/mr")
    p.add_argument("--clients", nargs="+", type=cli.positive_int, default=[1, 8, 32], help="client counts to run")
    p.add_argument("--requests-per-client", type=cli.positive_int, default=4, help="requests each client sends")
    p.add_argument("--max-tokens", type=cli.positive_int, default=64,
                   help="max_tokens of every request (the OpenAI field)")
    p.add_argument("--timeout", type=float, default=120.0, help="per-request timeout (s)")
    # the server's own flag, passed through (dest named apart from the server's --batch-wait-ms)
    p.add_argument("--batch-wait-ms", dest="server_batch_wait_ms", type=float, default=None,
                   help="server --batch-wait-ms (none: its own default)")
    cli.JSON_OUT.add(p)
    p.add_argument("--engine-repeats", type=int, default=3,
                   help="interleaved repeats of the engine-level (no HTTP) same vs mixed check; 0 skips it")
    return p


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)

    import httpx

    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONPATH=REPO)
    ckpt = args.ckpt
    if ckpt is None:
        from megatron_jf.models.zoo import build_tiny_checkpoint

        ckpt = build_tiny_checkpoint(args.work)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, os.path.join(REPO, "tools", "run_text_generation_server.py"),
                             "--load", ckpt, "--port", str(port), "--max-batch", "32"]
                            + ([] if args.server_batch_wait_ms is None
                               else ["--batch-wait-ms", str(args.server_batch_wait_ms)]),
                            env=env,
                            start_new_session=True)
    results = []
    try:
        t0 = time.time()
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"server exited with {proc.returncode}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() - t0 > 180:
                raise SystemExit("server did not come up in 180 s")
            time.sleep(0.3)
        cfgs = [{"decoder": d} if d == "ar" else {"decoder": d, "block_size": args.block_size} for d in args.decoders]
        mixes = [(d, [jf]) for d, jf in zip(args.decoders, cfgs)] + [("mixed", cfgs)]
        run_load(url, cfgs, len(cfgs), 1, args.max_tokens, args.timeout, "warm-up")
        for mix, jfs in mixes:
            base = None
            for n in args.clients:
                r = run_load(url, jfs, n, args.requests_per_client, args.max_tokens, args.timeout, mix)
                base = base or r["tok_s"]
                r["speedup"] = round(r["tok_s"] / base, 2)
                results.append(r)
                print(json.dumps(r), flush=True)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    print(f"\n{'mix':15} {'clients':>7} {'reqs':>5} {'tok/s':>8} {'p50 s':>7} {'p95 s':>7} {'TPF':>6} "
          f"{'batch':>6} {'speedup':>7}")
    for r in results:
        print(f"{r['mix']:15} {r['clients']:7d} {r['requests']:5d} {r['tok_s']:8.1f} {r['p50_s']:7.3f} "
              f"{r['p95_s']:7.3f} {r['tpf']:6.2f} {r['batch']:6.2f} {r['speedup']:7.2f}")
    summary = []
    for n in args.clients:
        same = [r["tok_s"] for r in results if r["clients"] == n and r["mix"] != "mixed"]
        mixed = [r["tok_s"] for r in results if r["clients"] == n and r["mix"] == "mixed"]
        if same and mixed:
            mean = sum(same) / len(same)
            summary.append({"clients": n, "mixed_tok_s": mixed[0], "same_mean_tok_s": round(mean, 1),
                            "mixed_over_same_mean": round(mixed[0] / mean, 3),
                            "mixed_over_same_best": round(mixed[0] / max(same), 3)})
            print(f"{n:3d} clients: mixed {mixed[0]:.1f} tok/s = {mixed[0] / mean:.2f} x mean same-config "
                  f"({mean:.1f}), {mixed[0] / max(same):.2f} x best same-config ({max(same):.1f})")
    results.append({"summary": summary})
    if args.engine_repeats > 0:
        eng = engine_steps(ckpt, cfgs, max(args.clients), args.max_tokens, args.engine_repeats)
        print(f"\nengine only (one BatchSession, {max(args.clients)} rows, median of {args.engine_repeats}):")
        for split in (256, None):
            same = [r["tok_s"] for r in eng if r["split_min_saving"] == split and r["engine_mix"] != "mixed"]
            mixed = next(r["tok_s"] for r in eng if r["split_min_saving"] == split and r["engine_mix"] == "mixed")
            per = ", ".join(f"{r['engine_mix']} {r['tok_s']:.0f}" for r in eng
                            if r["split_min_saving"] == split and r["engine_mix"] != "mixed")
            print(f"  split {'on ' if split else 'off'}: mixed {mixed:.1f} tok/s = "
                  f"{mixed / (sum(same) / len(same)):.2f} x mean same-config ({per})")
        results.append({"engine": eng})
    if args.json:
        from megatron_jf.fileio import atomic_write_json

        atomic_write_json(args.json, results, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
