"""Server: exact stop strings, one stop-token set, cancellation, mixed-config continuous batching and the
metrics (issue 15). A real uvicorn server on loopback over the tiny checkpoint; outputs are compared with
offline ``Engine.generate`` (and ``tools/generate.py``)."""
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from tests.server_common import REPO, free_port, metric_samples, offline, serve, sse, text_of, wait_health  # noqa: E402

DECODERS = [{"decoder": "ar"}, {"decoder": "jacobi", "block_size": 4}, {"decoder": "running-window", "block_size": 5},
            {"decoder": "mr", "block_size": 8, "num_blocks": 2, "verification_size": 3}]
PROMPTS = ["The quick brown fox", "Grüße aus Köln, 你好", "def add(a, b):", "Hello world!"]


@pytest.fixture(scope="module")
def srv(mp1, tmp_path_factory):
    s = serve(str(tmp_path_factory.mktemp("srv")))
    yield s
    s.close()


def _stream_text(c, path, body):
    with c.stream("POST", path, json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        ev = sse(list(r.iter_lines()))
    return "".join(e["choices"][0]["text"] for e in ev[:-1]), ev[-1]["usage"], ev


@pytest.mark.parametrize("jf", DECODERS, ids=[d["decoder"] for d in DECODERS])
def test_stop_strings_exact_streamed_equal(srv, jf):
    """Random stop strings cut inside the greedy text: the answer is the greedy text right before the first
    occurrence, streamed == non-streamed, usage counts only the tokens before it."""
    s = srv
    c = httpx.Client(base_url=s.url, timeout=60)
    rnd = random.Random(len(json.dumps(jf)))
    for prompt in PROMPTS:
        ids = s.tok.encode(prompt)
        full_tokens = offline(s, ids, {"decoder": "ar"}, 40).tokens
        full = text_of(s, ids, full_tokens)
        for _ in range(2):
            a = rnd.randrange(max(1, len(full) - 8))
            stops = [full[a: a + rnd.randint(1, 5)], "\u2603never"]
            if not stops[0].strip() or "\ufffd" in stops[0]:
                continue
            want = full[: min(i for i in (full.find(x) for x in stops) if i >= 0)]
            body = {"prompt": prompt, "max_tokens": 40, "temperature": 0, "stop": stops, "jf": jf}
            b = c.post("/v1/completions", json=body).json()
            assert b["choices"][0]["text"] == want, (prompt, stops)
            assert b["choices"][0]["finish_reason"] == "stop"
            n = b["usage"]["completion_tokens"]
            assert text_of(s, ids, full_tokens[:n]) == want[: len(text_of(s, ids, full_tokens[:n]))]
            assert n <= len(full_tokens) and full.startswith(text_of(s, ids, full_tokens[:n]))
            streamed, usage, _ = _stream_text(c, "/v1/completions", body)
            assert streamed == want and usage == b["usage"]


def test_one_stop_token_set_server_equals_generate_py(srv, tmp_path):
    """The tokenizer's EOS, the checkpoint's eos_token_ids and a generation_config.json eos id are all
    stop tokens, for the server (the CLI) and tools/generate.py alike: same outputs for prompts whose
    greedy continuation reaches each of them."""
    from megatron_jf.tokenizer import stop_token_ids

    s = srv
    ck = str(tmp_path / "ckpt")
    shutil.copytree(s.ckpt, ck)
    tok, V = s.tok, s.tok.vocab_size
    succ = lambda t: t - t % 4 + (t % 4 + 1) % 4  # noqa: E731 -- the peaked model's cycle (period 4)
    kinds = {"tokenizer": min(tok.eos_ids), "checkpoint": max(s.margs.eos_token_ids)}
    assert kinds["checkpoint"] not in tok.eos_ids  # the checkpoint's tokenizer/ does not carry config.json
    group = lambda e: {e - e % 4 + j for j in range(4)}  # noqa: E731
    g = next(t for t in range(4, V - 8)
             if tok.encode(tok.decode([t])) == [t] and not group(t) & (set(tok.eos_ids) | set(s.margs.eos_token_ids)))
    kinds["generation_config"] = succ(g)
    with open(os.path.join(ck, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": kinds["generation_config"]}, f)
    stops = stop_token_ids(tok, s.margs, ck)
    assert set(kinds.values()) <= stops
    from megatron_jf.inference.llm import LLM

    assert LLM.from_checkpoint(ck).eos_ids == stops  # evaluation (every LLM) stops on the same set
    # a prompt per kind: its last token's cycle reaches the stop id
    prompts = {}
    for kind, e in kinds.items():
        t = next(x for x in sorted(group(e)) if x != e and tok.encode(tok.decode([x])) == [x])
        prompts[kind] = "Hello " + tok.decode([t])
        ids = tok.encode(prompts[kind])
        assert e in offline(s, ids, {"decoder": "ar"}, 8).tokens[:4], kind  # no stop: the greedy text reaches it
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    cmd = [sys.executable, os.path.join(REPO, "tools", "generate.py"), "--load", ck, "--json", "--decoder", "mr",
           "--block-size", "8", "--max-new-tokens", "30"]
    for p in prompts.values():
        cmd += ["--prompt", p]
    gen = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert gen.returncode == 0, gen.stderr[-3000:]
    offline_out = [json.loads(line) for line in gen.stdout.splitlines() if line.startswith("{")]
    port = free_port()
    proc = subprocess.Popen([sys.executable, os.path.join(REPO, "tools", "run_text_generation_server.py"), "--load", ck,
                             "--port", str(port), "--decoder", "mr", "--block-size", "8"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_health(url, 120, proc)
        for (kind, p), ref in zip(prompts.items(), offline_out):
            ids = tok.encode(p)
            r = httpx.post(url + "/v1/completions", json={"prompt": p, "max_tokens": 30, "temperature": 0},
                           timeout=60).json()
            got = r["usage"]["completion_tokens"]
            assert ref["finish_reason"] == "eos" and ref["tokens"][-1] == kinds[kind], kind
            assert got == len(ref["tokens"]) and r["choices"][0]["finish_reason"] == "stop", kind
            assert r["choices"][0]["text"] == text_of(s, ids, ref["tokens"]), kind
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def jf_fixed(body) -> bool:
    return body["jf"].get("draft_width") == "fixed"


def test_mixed_configs_batch_together_and_match_offline(srv):
    """32 concurrent requests over 4 decoders, several block sizes, both draft widths, caps and temperatures
    (seeded) run in shared engine steps and each equals its offline decoding (tokens; forwards too at the fixed
    width -- ``auto`` widths depend on the batch a request runs in, by design)."""
    from megatron_jf.inference.sampling import SamplingParams

    s = srv
    c = httpx.Client(base_url=s.url, timeout=120)
    reqs = []
    for i in range(32):
        jf = dict(DECODERS[i % 4])
        if "block_size" in jf:
            jf["block_size"] += i % 3
            if (i // 4) % 2:  # half at the fixed width (the others: auto, whose widths follow the batch)
                jf["draft_width"] = "fixed"
        body = {"prompt": f"{PROMPTS[i % 4]} {i}", "max_tokens": 6 + (i * 5) % 30, "jf": jf}
        body.update({"temperature": 0} if i % 5 else {"temperature": 0.8, "top_k": 40, "seed": 1000 + i})
        reqs.append(body)
    out = [None] * len(reqs)

    def worker(i):
        with httpx.Client(base_url=s.url, timeout=120) as cc:
            out[i] = cc.post("/v1/completions", json=reqs[i]).json()

    steps0 = s.sched.steps_run
    ths = [threading.Thread(target=worker, args=(i,)) for i in range(len(reqs))]
    for t in ths:
        t.start()
    for t in ths:
        t.join(120)
    steps = s.sched.steps_run - steps0
    for body, b in zip(reqs, out):
        ids = s.tok.encode(body["prompt"])
        samp = SamplingParams() if body["temperature"] == 0 else SamplingParams(0.8, 40, 1.0, seed=body["seed"])
        ref = offline(s, ids, body["jf"], body["max_tokens"], sampling=samp)
        assert b["choices"][0]["text"] == text_of(s, ids, ref.tokens), body
        assert b["usage"]["completion_tokens"] == len(ref.tokens)
        if jf_fixed(body):  # a fixed width drafts the same whatever the batch: the offline run's forwards
            assert b["jf"]["forwards"] == ref.forwards, body
    # shared steps: far fewer engine steps than the forwards of all requests together
    assert steps < sum(o["jf"]["forwards"] for o in out) / 4
    assert max(o["jf"]["batch_size"] for o in out) >= 8


def test_request_joins_running_batch(srv):
    """A request sent while a long one decodes finishes long before it (it joined the running batch)."""
    s = srv
    done = {}

    def long():
        with httpx.Client(base_url=s.url, timeout=120) as cc:
            done["long_body"] = cc.post("/v1/completions", json={"prompt": "The quick", "max_tokens": 200,
                                                                "temperature": 0, "jf": {"decoder": "ar"}}).json()
            done["long"] = s.sched.steps_run

    th = threading.Thread(target=long)
    th.start()
    t0 = time.time()
    # wait until the long request is decoding (its row is live), not for a step count: the scheduler's steps
    # also count before the long request's parsing and tokenization (worker threads) are done on a busy machine
    while not s.sched._live and time.time() - t0 < 30:
        time.sleep(0.005)
    assert s.sched._live, "the long request never started decoding"
    r = httpx.post(s.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "temperature": 0,
                                                    "jf": {"decoder": "jacobi", "block_size": 4}}, timeout=60).json()
    short_done = s.sched.steps_run
    th.join(120)
    assert r["usage"]["completion_tokens"] == 4
    assert done["long_body"]["usage"]["completion_tokens"] == 200  # the long one ran to max_tokens (no early stop)
    assert short_done < done["long"]  # finished while the long request was still decoding
    assert r["jf"]["batch_size"] == 2  # decoded in the same engine steps as the long one


def test_disconnect_leaves_batch_and_metrics_add_up(srv):
    """A dropped stream's row leaves at the next step, is counted as cancelled (499), not as generated; the
    prometheus counters (parsed with prometheus_client) add up to the requests sent."""
    s = srv
    c = httpx.Client(base_url=s.url, timeout=60)
    m0 = metric_samples(c.get("/metrics").text)
    sent = []
    # at the fixed width every non-AR forward drafts (with auto, a forward may run as AR: its draft counts follow)
    for i, jf in enumerate(DECODERS):
        jf = jf if jf["decoder"] == "ar" else {**jf, "draft_width": "fixed"}
        b = c.post("/v1/completions", json={"prompt": PROMPTS[i], "max_tokens": 20 + i, "temperature": 0,
                                            "jf": jf}).json()
        sent.append(b)
    steps_before = s.sched.steps_run
    with c.stream("POST", "/v1/completions", json={"prompt": "The quick", "max_tokens": 220, "temperature": 0,
                                                   "stream": True, "jf": {"decoder": "ar"}}) as r:
        it = r.iter_lines()
        assert next(it).startswith("data: ")
    t0 = time.time()
    while s.metrics.cancelled == m0.get(("jf_cancelled_requests_total", ()), 0) and time.time() - t0 < 10:
        time.sleep(0.02)
    t0 = time.time()
    while s.sched._live and time.time() - t0 < 10:
        time.sleep(0.02)
    assert not s.sched._live
    # the cancelled row stopped well before its 220 tokens (one token per AR step)
    assert s.sched.steps_run - steps_before < 150
    r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "temperature": 0,
                                        "jf": {"draft_width": "fixed"}})
    assert r.status_code == 200
    sent.append(r.json())
    m1 = metric_samples(c.get("/metrics").text)

    def d(name, **labels):
        k = (name, tuple(sorted(labels.items())))
        return m1.get(k, 0) - m0.get(k, 0)

    mn = {"model_name": "tiny"}
    assert d("jf_requests_total", endpoint="/v1/completions", code="200") == len(sent)
    assert d("jf_requests_total", endpoint="/v1/completions", code="499") == 1
    assert d("jf_cancelled_requests_total") == 1
    assert d("vllm:generation_tokens_total", **mn) == sum(b["usage"]["completion_tokens"] for b in sent)
    assert d("vllm:prompt_tokens_total", **mn) == sum(b["usage"]["prompt_tokens"] for b in sent)
    assert (d("vllm:request_success_total", finished_reason="stop", **mn)
            + d("vllm:request_success_total", finished_reason="length", **mn)) == len(sent)
    assert d("jf_decode_forwards_total") == sum(b["jf"]["forwards"] for b in sent)
    drafts = d("vllm:spec_decode_num_drafts_total", **mn)
    draft_tokens = d("vllm:spec_decode_num_draft_tokens_total", **mn)
    accepted = d("vllm:spec_decode_num_accepted_tokens_total", **mn)
    per_pos = [d("vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(p), **mn) for p in range(64)]
    # AR requests draft nothing; every other request drafts in each forward
    assert drafts == sum(b["jf"]["forwards"] for b in sent if b["jf"]["decoder"] != "ar")
    assert 0 < accepted <= draft_tokens and sum(per_pos) == accepted
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:]))  # position p+1 is accepted only after p
    # every emitted token is an accepted draft token or the one correction/bonus token of a forward
    emitted = sum(b["usage"]["completion_tokens"] for b in sent if b["jf"]["decoder"] != "ar")
    assert accepted + drafts >= emitted
    assert m1[("vllm:num_requests_running", (("model_name", "tiny"),))] == 0


def test_error_mid_stream_counted_as_500(srv):
    """A stream that ends with an error event counts as 500, not 200."""
    from megatron_jf.server.scheduler import GenRequest

    s = srv
    c = httpx.Client(base_url=s.url, timeout=60)
    orig = GenRequest._emit

    def failing(self, kind, payload):  # the engine fails after the first tokens of this request
        if kind == "done" and self.request.max_new_tokens == 17:
            kind, payload = "error", RuntimeError("engine failed")
        orig(self, kind, payload)

    m0 = metric_samples(c.get("/metrics").text)
    GenRequest._emit = failing
    try:
        with c.stream("POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 17, "temperature": 0,
                                                       "stream": True}) as r:
            ev = sse(list(r.iter_lines()))
    finally:
        GenRequest._emit = orig
    assert ev[-1]["error"]["message"] == "RuntimeError: engine failed"
    m1 = metric_samples(c.get("/metrics").text)
    key = ("jf_requests_total", (("code", "500"), ("endpoint", "/v1/completions")))
    ok = ("jf_requests_total", (("code", "200"), ("endpoint", "/v1/completions")))
    assert m1[key] - m0.get(key, 0) == 1 and m1.get(ok, 0) == m0.get(ok, 0)


@pytest.mark.parametrize("path", ["/v1/completions", "/api"])
def test_non_streamed_disconnect_cancels(srv, path):
    """A client that gives up on a non-streamed request (here: a read timeout) cancels it: its row leaves
    the batch, it counts as 499 and its tokens are not generated tokens."""
    s = srv
    c = httpx.Client(base_url=s.url, timeout=60)
    m0 = metric_samples(c.get("/metrics").text)
    body = ({"prompt": "The quick", "max_tokens": 220, "temperature": 0, "jf": {"decoder": "ar"}}
            if path != "/api" else {"prompts": ["The quick", "Hello"], "tokens_to_generate": 220, "temperature": 0,
                                    "jf": {"decoder": "ar"}})
    steps0 = s.sched.steps_run
    with pytest.raises(httpx.ReadTimeout):
        (httpx.put if path == "/api" else httpx.post)(s.url + path, json=body, timeout=0.08)
    t0 = time.time()
    while (s.sched._live or s.sched.queue_depth()) and time.time() - t0 < 20:
        time.sleep(0.02)
    assert not s.sched._live
    assert s.sched.steps_run - steps0 < 200  # left long before its 220 tokens (one per AR step)
    m1 = metric_samples(c.get("/metrics").text)
    key = ("jf_requests_total", (("code", "499"), ("endpoint", path)))
    gen = ("vllm:generation_tokens_total", (("model_name", "tiny"),))
    assert m1[key] - m0.get(key, 0) == 1
    assert m1[gen] == m0[gen]
    r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "temperature": 0,
                                        "jf": {"draft_width": "fixed"}})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
