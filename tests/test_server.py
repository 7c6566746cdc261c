"""Text generation server (issue: "Text generation server with MR decoding").

A real uvicorn server on 127.0.0.1 (free port, background thread) serves a tiny real checkpoint
(byte-level BPE + peaked Qwen2, see megatron_jf.models.zoo); greedy responses are compared with
offline ``Engine.generate`` on the same checkpoint.
"""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

from tests.server_common import MAX_CTX, REPO, serve  # noqa: E402
from tests.server_common import free_port as _free_port  # noqa: E402
from tests.server_common import offline as _offline  # noqa: E402
from tests.server_common import sse as _sse  # noqa: E402
from tests.server_common import text_of as _text  # noqa: E402
from tests.server_common import wait_health as _wait_health  # noqa: E402


@pytest.fixture(scope="module")
def srv(mp1, tmp_path_factory):
    s = serve(str(tmp_path_factory.mktemp("srv")))
    yield s
    s.close()


PROMPTS = ["The quick brown fox", "Grüße aus Köln, 你好", "def add(a, b):"]
DECODERS = [{"decoder": "ar"}, {"decoder": "mr", "block_size": 8, "num_blocks": 2, "verification_size": 3},
            {"decoder": "jacobi", "block_size": 4}, {"decoder": "running-window", "block_size": 5}]


@pytest.mark.parametrize("jf", DECODERS, ids=[d["decoder"] for d in DECODERS])
def test_greedy_endpoints_equal_offline(srv, jf):
    s = srv
    c = httpx.Client(base_url=s.url, timeout=60)
    for prompt in PROMPTS:
        ids = s.tok.encode(prompt)
        ref = _offline(s, ids, jf, 40)
        want_text = _text(s, ids, ref.tokens)
        # OpenAI completions
        r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 40, "temperature": 0, "jf": jf})
        assert r.status_code == 200, r.text
        b = r.json()
        assert b["choices"][0]["text"] == want_text
        assert b["usage"] == {"prompt_tokens": len(ids), "completion_tokens": len(ref.tokens),
                              "total_tokens": len(ids) + len(ref.tokens)}
        assert b["choices"][0]["finish_reason"] == ("length" if ref.finish_reason == "length" else "stop")
        assert b["jf"]["decoder"] == jf["decoder"] and b["jf"]["forwards"] == ref.forwards
        assert b["jf"]["tpf"] == pytest.approx(ref.tpf, abs=1e-3)
        # Megatron PUT /api: text and tokens include the prompt
        r = c.put("/api", json={"prompts": [prompt], "tokens_to_generate": 40, "temperature": 0.0, "jf": jf})
        assert r.status_code == 200, r.text
        b = r.json()
        assert b["tokens"] == [ids + ref.tokens]
        assert b["text"] == [prompt + want_text]
        assert len(b["segments"][0]) == len(ids) + len(ref.tokens)
    # chat: the chat template is applied
    msgs = [{"role": "user", "content": "Hello world! naïve café"}]
    ids = s.tok.encode(s.tok.apply_chat_template(msgs))
    ref = _offline(s, ids, jf, 30)
    r = c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 30, "temperature": 0, "jf": jf})
    assert r.status_code == 200, r.text
    b = r.json()
    assert b["choices"][0]["message"] == {"role": "assistant", "content": _text(s, ids, ref.tokens)}
    assert b["usage"]["prompt_tokens"] == len(ids) and b["usage"]["completion_tokens"] == len(ref.tokens)


def test_default_decoder_eos_and_token_prompt(srv):
    s = srv
    c = httpx.Client(base_url=s.url, timeout=60)
    # peaked model, period 4: token 1 -> 2 (<|im_end|>, an EOS id): finishes at once with "stop"
    r = c.post("/v1/completions", json={"prompt": [40, 41, 1], "max_tokens": 20, "temperature": 0})
    assert r.status_code == 200, r.text
    b = r.json()
    assert b["choices"][0]["finish_reason"] == "stop" and b["usage"]["completion_tokens"] == 1
    assert b["jf"]["decoder"] == "mr" and b["jf"]["config"]["block_size"] == 8  # server default
    # MR (server default) on a prompt with a predictable continuation: > 1 token per forward
    ids = s.tok.encode("The quick brown fox")
    ref = _offline(s, ids, {"decoder": "mr", "block_size": 8}, 120)
    r = c.post("/v1/completions", json={"prompt": ids, "max_tokens": 120, "temperature": 0})
    b = r.json()
    assert b["usage"]["completion_tokens"] == len(ref.tokens) and b["jf"]["forwards"] == ref.forwards
    assert b["jf"]["tpf"] > 1.0


def test_stop_strings(srv):
    s = srv
    c = httpx.Client(base_url=s.url, timeout=60)
    ids = s.tok.encode(PROMPTS[0])
    full = _text(s, ids, _offline(s, ids, {"decoder": "ar"}, 60).tokens)
    stop = full[20:23]
    assert stop.strip() and "\ufffd" not in stop
    jf = {"decoder": "mr", "block_size": 8}
    ref = _offline(s, ids, jf, 60, stop=[stop])
    assert ref.finish_reason == "stop"
    r = c.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 60, "temperature": 0, "stop": stop,
                                        "jf": jf})
    b = r.json()
    assert b["choices"][0]["finish_reason"] == "stop"
    assert b["choices"][0]["text"] == _text(s, ids, ref.tokens) and stop not in b["choices"][0]["text"]
    r = c.put("/api", json={"prompts": [PROMPTS[0]], "tokens_to_generate": 60, "temperature": 0, "stop": [stop],
                            "jf": jf})
    assert r.json()["tokens"] == [ids + ref.tokens]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_streaming_concatenates_to_non_streamed(srv, chat):
    s = srv
    c = httpx.Client(base_url=s.url, timeout=60)
    jf = {"decoder": "mr", "block_size": 8}
    if chat:
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": "Grüße 你好 🙂"}]}
    else:
        path, body = "/v1/completions", {"prompt": "Grüße aus Köln, 你好"}
    body.update(max_tokens=48, temperature=0, jf=jf)
    plain = c.post(path, json=body).json()
    with c.stream("POST", path, json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = _sse(list(r.iter_lines()))
    usage = events[-1]
    assert usage["choices"] == [] and usage["usage"] == plain["usage"]
    chunks = events[:-1]
    key = (lambda ch: ch["delta"].get("content", "")) if chat else (lambda ch: ch["text"])
    pieces = [key(e["choices"][0]) for e in chunks]
    # multi-byte characters are never split: a piece never ends inside one (U+FFFD) -- the final
    # flush may, when the model really emitted an invalid byte sequence (this random model does)
    assert all(not p.endswith("\ufffd") for p in pieces[:-1])
    assert "".join(pieces) == (plain["choices"][0]["message"]["content"] if chat else plain["choices"][0]["text"])
    ids = [t for e in chunks for t in e.get("jf", {}).get("token_ids", [])]
    assert len(ids) == plain["usage"]["completion_tokens"]
    assert sum(1 for e in chunks if e.get("jf", {}).get("token_ids")) == plain["jf"]["forwards"]  # one per commit
    assert [e["choices"][0]["finish_reason"] for e in chunks][-1] == plain["choices"][0]["finish_reason"]
    assert all(e["choices"][0]["finish_reason"] is None for e in chunks[:-1])
    if chat:
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"


def test_32_concurrent_clients_match_sequential(srv):
    s = srv
    words = ["fox", "Köln", "def", "Hello", "quick brown", "你好", "café", "return a"]
    reqs = []
    for i in range(32):
        jf = [{"decoder": "ar"}, {"decoder": "mr", "block_size": 8}][i % 2]
        reqs.append({"prompt": f"{words[i % 8]} {i}", "max_tokens": 8 + (i * 7) % 33, "temperature": 0, "jf": jf})
    c = httpx.Client(base_url=s.url, timeout=60)
    seq = [c.post("/v1/completions", json=b).json() for b in reqs]
    out = [None] * len(reqs)

    def worker(i):
        with httpx.Client(base_url=s.url, timeout=120) as cc:
            out[i] = cc.post("/v1/completions", json=reqs[i]).json()

    ths = [threading.Thread(target=worker, args=(i,)) for i in range(len(reqs))]
    for t in ths:
        t.start()
    for t in ths:
        t.join(120)
    for a, b in zip(seq, out):
        assert b is not None
        assert b["choices"][0]["text"] == a["choices"][0]["text"]
        assert b["usage"] == a["usage"] and b["choices"][0]["finish_reason"] == a["choices"][0]["finish_reason"]
    assert max(o["jf"]["batch_size"] for o in out) > 1  # they were batched
    assert c.get("/health").json()["status"] == "ok"
    from prometheus_client.parser import text_string_to_metric_families

    fams = {f.name: f for f in text_string_to_metric_families(c.get("/metrics").text)}
    ok = [x.value for x in fams["jf_requests"].samples
          if x.name == "jf_requests_total" and x.labels == {"endpoint": "/v1/completions", "code": "200"}]
    assert ok and ok[0] >= 64
    assert "jf_tokens_per_forward" in fams and "jf_request_latency_seconds" in fams


BAD = [
    ("POST", "/v1/completions", b"{not json", 400, "body"),
    ("POST", "/v1/completions", {"max_tokens": 5}, 400, "prompt"),
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 10 ** 9}, 400, "max_tokens"),
    ("POST", "/v1/completions", {"prompt": "x" * 2000, "max_tokens": 4}, 400, "prompt"),
    ("POST", "/v1/completions", {"prompt": "hi", "jf": {"decoder": "beam"}}, 400, "jf.decoder"),
    ("POST", "/v1/completions", {"prompt": "hi", "jf": {"decoder": "mr", "spawn_threshold": 2}}, 400,
     "jf.spawn_threshold"),
    ("POST", "/v1/completions", {"prompt": "hi", "jf": {"decoder": "mr", "ngram_pool_size": 0}}, 400,
     "jf.ngram_pool_size"),
    ("POST", "/v1/completions", {"prompt": "hi", "jf": {"nope": 1}}, 400, "jf.nope"),
    ("POST", "/v1/completions", {"prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ("POST", "/v1/completions", {"prompt": "hi", "n": 2}, 400, "n"),
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": "5"}, 422, "max_tokens"),
    ("POST", "/v1/completions", {"prompt": "hi", "frobnicate": 1}, 400, "frobnicate"),
    ("POST", "/v1/completions", {"prompt": "hi", "logprobs": 3}, 400, "logprobs"),
    ("POST", "/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ("POST", "/v1/chat/completions", {"max_tokens": 5}, 400, "messages"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "messages[0]"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 2}, 400, "n"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream_options": {}}, 400,
     "stream_options"),
    ("PUT", "/api", b"[1,", 400, "body"),
    ("PUT", "/api", {"tokens_to_generate": 5}, 400, "prompts"),
    ("PUT", "/api", {"prompts": ["hi"], "tokens_to_generate": 0}, 400, "tokens_to_generate"),
    ("PUT", "/api", {"prompts": ["hi"], "tokens_to_generate": 100000}, 400, "tokens_to_generate"),
    ("PUT", "/api", {"prompts": ["hi"], "temperature": -1}, 400, "temperature"),
    ("PUT", "/api", {"prompts": ["hi"], "logprobs": True}, 400, "logprobs"),
    ("PUT", "/api", {"prompts": ["hi"], "beam_width": 4}, 400, "beam_width"),
    ("PUT", "/api", {"prompts": ["hi"], "add_BOS": True}, 400, "add_BOS"),  # this tokenizer has no BOS
    ("PUT", "/api", {"prompts": ["hi"], "jf": {"decoder": "mr", "block_size": 0}}, 400, "jf.block_size"),
]


def test_bad_requests_4xx_naming_field(srv):
    c = httpx.Client(base_url=srv.url, timeout=30)
    for method, path, body, status, field in BAD:
        kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) \
            else {"json": body}
        r = c.request(method, path, **kw)
        assert r.status_code == status, (path, body, r.status_code, r.text)
        err = r.json()["error"]
        assert err["param"] == field and err["message"].startswith(field), (body, err)
    r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_sampling_seeded_reproducible(srv):
    s = srv
    from megatron_jf.inference.engine import DecodeConfig
    from megatron_jf.inference.sampling import SamplingParams

    c = httpx.Client(base_url=s.url, timeout=60)
    body = {"prompt": "Hello", "max_tokens": 20, "temperature": 0.9, "top_p": 0.95, "top_k": 50, "seed": 7,
            "jf": {"decoder": "mr", "block_size": 4}}
    a = c.post("/v1/completions", json=body).json()
    b = c.post("/v1/completions", json=body).json()
    assert a["choices"][0]["text"] == b["choices"][0]["text"]
    ids = s.tok.encode("Hello")
    ref = s.engine.generate([ids], DecodeConfig("mr", block_size=4), max_new_tokens=20, eos_ids=s.stop_ids,
                            sampling=SamplingParams(0.9, 50, 0.95, seed=7))[0]
    assert a["choices"][0]["text"] == _text(s, ids, ref.tokens)
    # /api: prompt i samples with random_seed + i (as offline generate on the list); Megatron's /api
    # takes top_k or top_p, not both
    r = c.put("/api", json={"prompts": ["Hello", "Hello"], "tokens_to_generate": 20, "temperature": 0.9,
                            "top_p": 0.95, "random_seed": 7, "jf": {"decoder": "mr", "block_size": 4}})
    refs = s.engine.generate([ids, ids], DecodeConfig("mr", block_size=4), max_new_tokens=20, eos_ids=s.stop_ids,
                             sampling=SamplingParams(0.9, 0, 0.95, seed=7))
    assert r.json()["tokens"] == [ids + x.tokens for x in refs]


def test_disconnect_mid_stream_and_info_endpoints(srv):
    c = httpx.Client(base_url=srv.url, timeout=60)
    before = srv.metrics.cancelled
    with c.stream("POST", "/v1/completions", json={"prompt": "The quick", "max_tokens": 200, "temperature": 0,
                                                   "stream": True, "jf": {"decoder": "ar"}}) as r:
        first = next(r.iter_lines())
        assert first.startswith("data: ")
    # the connection is closed: the request is marked cancelled; the server keeps serving
    t0 = time.time()
    while srv.metrics.cancelled == before and time.time() - t0 < 10:
        time.sleep(0.05)
    assert srv.metrics.cancelled == before + 1
    assert "jf_cancelled_requests_total" in c.get("/metrics").text
    r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200
    m = c.get("/v1/models").json()
    assert m["data"][0]["id"] == "tiny" and m["data"][0]["max_model_len"] == MAX_CTX
    assert c.get("/health").json()["status"] == "ok"


def test_queue_full_503(srv):
    """A scheduler with max_queue=1 and max_batch=1 behind its own app: with one request running and one
    waiting, the next is refused with 503; afterwards the app serves again."""
    from fastapi.testclient import TestClient

    from megatron_jf.inference.engine import DecodeConfig
    from megatron_jf.inference.request import Request, SamplingParams
    from megatron_jf.server.app import create_app
    from megatron_jf.server.scheduler import GenRequest, QueueFullError, Scheduler

    sched = Scheduler(srv.engine, srv.tok.decode, max_batch=1, max_queue=1, batch_wait_s=0)
    app = create_app(sched, srv.tok, default_config=DecodeConfig("ar"))
    ids = srv.tok.encode("The quick")
    long = [GenRequest(prompt=ids, request=Request(DecodeConfig("ar"), SamplingParams(), MAX_CTX - len(ids)))
            for _ in range(2)]
    try:
        with TestClient(app) as tc:
            sched.submit(long[0])
            t0 = time.time()
            while sched.queue_depth() and time.time() - t0 < 10:  # taken by the scheduler thread
                time.sleep(0.005)
            sched.submit(long[1])  # waits
            r = tc.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "temperature": 0})
            assert r.status_code == 503 and r.json()["error"]["type"] == "server_busy", r.text
            assert "queue is full" in r.json()["error"]["message"]
            with pytest.raises(QueueFullError):
                sched.submit(GenRequest(prompt=ids, request=Request(DecodeConfig("ar"), max_new_tokens=2)))
            t0 = time.time()
            while sched.queue_depth() and time.time() - t0 < 30:
                time.sleep(0.01)
            r = tc.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "temperature": 0})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    finally:
        sched.shutdown()


def test_cli_tensor_parallel_2(srv):
    """examples/run_text_server.sh CKPT 2 PORT: torchrun, rank 0 serves, rank 1 follows; same greedy output."""
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO, PYTHON=sys.executable, MASTER_PORT=str(_free_port()))
    proc = subprocess.Popen(["bash", os.path.join(REPO, "examples", "run_text_server.sh"), srv.ckpt, "2", str(port),
                             "--decoder", "mr", "--block-size", "8"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_health(url, 120, proc)
        ids = srv.tok.encode(PROMPTS[1])
        ref = _offline(srv, ids, {"decoder": "mr", "block_size": 8}, 30)
        r = httpx.put(url + "/api", json={"prompts": [PROMPTS[1]], "tokens_to_generate": 30, "temperature": 0},
                      timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == [ids + ref.tokens]
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "n": 2}, timeout=30)
        assert r.status_code == 400
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def test_run_text_server_script_arguments():
    """TP and PORT are optional positionals; a non-integer is a named error, not an argparse error later."""
    script = os.path.join(REPO, "examples", "run_text_server.sh")
    env = dict(os.environ, PYTHON="echo")  # print the command the script would exec

    def run(*args):
        return subprocess.run(["bash", script, *args], env=env, capture_output=True, text=True, timeout=30)

    p = run("/ck", "--decoder", "mr")
    assert p.returncode == 0 and p.stdout.split()[1:] == ["--load", "/ck", "--tp", "1", "--port", "5000",
                                                          "--decoder", "mr"]
    p = run("/ck", "1", "6001", "--block-size", "8")
    assert p.stdout.split()[1:] == ["--load", "/ck", "--tp", "1", "--port", "6001", "--block-size", "8"]
    p = run("/ck", "mr")
    assert p.returncode == 2 and "TP must be a positive integer, got 'mr'" in p.stderr
    p = run("/ck", "1", "http")
    assert p.returncode == 2 and "PORT must be an integer" in p.stderr


def test_running_gauge_drops_before_the_result_is_handed_back(srv):
    """A finished request has left ``vllm:num_requests_running`` when its result reaches the client (the gauge was
    set after the hand-over, so a client reading /metrics right after its response could still see it running)."""
    import asyncio

    from megatron_jf.inference.engine import DecodeConfig
    from megatron_jf.inference.request import Request
    from megatron_jf.server.metrics import Metrics
    from megatron_jf.server.scheduler import GenRequest, Scheduler

    metrics = Metrics("gauge")
    sched = Scheduler(srv.engine, srv.tok.decode, metrics=metrics, max_batch=4, max_queue=4, batch_wait_s=0)
    seen = []

    class Probe(GenRequest):
        def _emit(self, kind, payload):
            if kind == "done":
                seen.append(metrics._running.labels("gauge")._value.get())

    reqs = [Probe(prompt=srv.tok.encode(p), request=Request(DecodeConfig("ar"), max_new_tokens=4 + i),
                  loop=asyncio.new_event_loop(), queue=None) for i, p in enumerate(["The quick", "hi there"])]
    try:
        for r in reqs:
            sched.submit(r)
        t0 = time.time()
        while len(seen) < len(reqs) and time.time() - t0 < 30:
            time.sleep(0.01)
    finally:
        sched.shutdown()
    assert len(seen) == len(reqs)
    # each request is already out of the running gauge when its own result is emitted
    assert seen[-1] == 0 and all(v <= len(reqs) - 1 for v in seen), seen
