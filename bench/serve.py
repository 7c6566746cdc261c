#!/usr/bin/env python
"""Bounded serving load test on loopback: throughput and latency of AR vs MR, 1 vs N concurrent clients.

Starts ``tools/run_text_generation_server.py`` as a subprocess on 127.0.0.1 (a free port) for a
checkpoint (default: the tiny test checkpoint of :mod:`megatron_jf.server.tiny`, built once under
``--work``), then for each decoder and each client count sends ``--requests-per-client`` greedy
``/v1/completions`` requests per client (closed loop: each client waits for its answer before the next)
and reports:

* ``tok_s``: aggregate generated tokens / wall seconds of the run;
* ``p50_s`` / ``p95_s``: per-request latency (seconds);
* ``tpf``: mean tokens per forward (from the responses' ``jf`` stats), ``batch``: mean batch size;
* ``speedup``: ``tok_s`` of N clients / ``tok_s`` of 1 client (target >= 3 for N = 8).

Example::

    python bench/serve.py                       # tiny model, AR and MR, 1 and 8 clients
    python bench/serve.py --ckpt CKPT --max-tokens 128 --clients 1 8 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = ["The quick brown fox", "Hello world!", "def add(a, b):", "Speculative decoding", "Grüße aus Köln",
           "Jacobi forcing makes", "print(add(1, 2))", "naïve café"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def run_load(url: str, jf: dict, clients: int, per_client: int, max_tokens: int, timeout_s: float) -> dict:
    """Closed-loop load: ``clients`` threads each send ``per_client`` requests. Returns the stats dict.

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
                        "temperature": 0, "jf": jf}
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
    return {"decoder": jf["decoder"], "clients": clients, "requests": len(lat), "tokens": sum(toks),
            "wall_s": round(wall, 3), "tok_s": round(sum(toks) / wall, 1), "p50_s": round(_pct(lat, 0.5), 3),
            "p95_s": round(_pct(lat, 0.95), 3), "tpf": round(statistics.mean(tpf), 3),
            "batch": round(statistics.mean(bsz), 2)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", default=None, help="checkpoint (default: build the tiny test checkpoint)")
    p.add_argument("--work", default="/tmp/jf_bench_serve", help="where the tiny checkpoint is built")
    p.add_argument("--decoders", nargs="+", default=["ar", "mr"])
    p.add_argument("--block-size", type=int, default=8, help="n for jacobi/running-window/mr")
    p.add_argument("--clients", nargs="+", type=int, default=[1, 8])
    p.add_argument("--requests-per-client", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--timeout", type=float, default=120.0, help="per-request timeout (s)")
    p.add_argument("--batch-wait-ms", type=float, default=None, help="server --batch-wait-ms (default: its own)")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)

    import httpx

    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONPATH=REPO)
    ckpt = args.ckpt
    if ckpt is None:
        sys.path.insert(0, REPO)
        from megatron_jf.server.tiny import build_tiny_checkpoint

        ckpt = build_tiny_checkpoint(args.work)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, os.path.join(REPO, "tools", "run_text_generation_server.py"),
                             "--load", ckpt, "--port", str(port), "--max-batch", "32"]
                            + ([] if args.batch_wait_ms is None else ["--batch-wait-ms", str(args.batch_wait_ms)]),
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
        for dec in args.decoders:
            jf = {"decoder": dec} if dec == "ar" else {"decoder": dec, "block_size": args.block_size}
            run_load(url, jf, 1, 1, args.max_tokens, args.timeout)  # warm-up
            base = None
            for n in args.clients:
                r = run_load(url, jf, n, args.requests_per_client, args.max_tokens, args.timeout)
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
    print(f"\n{'decoder':8} {'clients':>7} {'reqs':>5} {'tok/s':>8} {'p50 s':>7} {'p95 s':>7} {'TPF':>6} "
          f"{'batch':>6} {'speedup':>7}")
    for r in results:
        print(f"{r['decoder']:8} {r['clients']:7d} {r['requests']:5d} {r['tok_s']:8.1f} {r['p50_s']:7.3f} "
              f"{r['p95_s']:7.3f} {r['tpf']:6.2f} {r['batch']:6.2f} {r['speedup']:7.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
