"""Request limits and the error contract (issue 15): every bad request gets a clear 4xx in OpenAI's
``{"error": {...}}`` shape naming the problem, and the server answers correctly right after each."""
import json
import os

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from tests.server_common import MAX_CTX, offline, serve, text_of  # noqa: E402

LIMIT_BYTES = 64 * 1024


@pytest.fixture(scope="module")
def srv(mp1, tmp_path_factory):
    from megatron_jf.server.protocol import Limits

    s = serve(str(tmp_path_factory.mktemp("srv")), sched_kw={"max_width": 64},
              app_kw={"max_request_bytes": LIMIT_BYTES,
                      "limits": Limits(max_context=MAX_CTX, max_parallel_tokens=64, max_stop=4, max_stop_chars=32,
                                       max_json_depth=16, max_token_chars=8)})
    yield s
    s.close()


def _check_served_ok(s, c):
    """A correct greedy answer (equal to offline decoding) right after a rejected request."""
    ids = s.tok.encode("The quick brown fox")
    ref = offline(s, ids, {"decoder": "mr", "block_size": 8}, 12)
    r = c.post("/v1/completions", json={"prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == text_of(s, ids, ref.tokens)


def _deep(n):
    return ('{"prompt": "hi", "jf": ' + "[" * n + "]" * n + "}").encode()


CASES = [
    # (method, path, body (dict | bytes | callable -> kwargs), status, param, message fragment)
    ("POST", "/v1/completions", {"prompt": "x" * (LIMIT_BYTES + 10)}, 413, "body", "exceeds the limit of 65536 bytes"),
    ("POST", "/v1/completions", lambda: {"content": (b'{"prompt": "' + b"y" * 4096 for _ in range(40)),
                                         "headers": {"content-type": "application/json"}},
     413, "body", "exceeds the limit"),  # chunked: no Content-Length
    ("POST", "/v1/completions", {"prompt": "ab " * 1000}, 400, "prompt", "characters; the context window"),
    ("PUT", "/api", {"prompts": ["ab " * 1000]}, 400, "prompts[0]", "characters"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "ab " * 1000}]}, 400, "messages",
     "characters"),
    ("POST", "/v1/completions", {"prompt": list(range(3)) * 100}, 400, "prompt", "context window"),
    ("POST", "/v1/completions", {"prompt": "hi", "jf": {"decoder": "jacobi", "block_size": 10 ** 6}}, 400,
     "jf.block_size", "exceeds the context window"),
    ("POST", "/v1/completions", {"prompt": "hi", "jf": {"decoder": "jacobi", "block_size": 100}}, 400,
     "jf.block_size", "forwards 101 tokens per step"),
    ("POST", "/v1/completions", {"prompt": "hi", "jf": {"decoder": "mr", "block_size": 8, "num_blocks": 9}}, 400,
     "jf.block_size", "at most 64 per request"),
    ("PUT", "/api", {"prompts": ["hi"], "jf": {"decoder": "mr", "verification_size": 30}}, 400,
     "jf.verification_size", "at most 64"),
    ("POST", "/v1/completions", {"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "at most 4 stop"),
    ("POST", "/v1/completions", {"prompt": "hi", "stop": "z" * 33}, 400, "stop", "at most 32 characters"),
    ("POST", "/v1/completions", _deep(30_000), 400, "body", "nested deeper than 16"),
    ("POST", "/v1/completions", _deep(20), 400, "body", "nested deeper than 16"),
    ("POST", "/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 3}', 400, "prompt",
     "lone surrogate U+D800 at character 1"),
    ("POST", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udfff"}]}', 400,
     "messages[0].content", "lone surrogate U+DFFF"),
    ("PUT", "/api", b'{"prompts": ["ok", "\\ud83d"]}', 400, "prompts[1]", "lone surrogate"),
    ("PUT", "/api", {"prompts": ["hi"], "top_k": 5, "top_p": 0.9}, 400, "top_p", "cannot set both top-k and top-p"),
    ("PUT", "/api", {"prompts": ["hi"], "temperature": 1000}, 400, "temperature", "[0, 100]"),
    ("PUT", "/api", {"prompts": ["hi"], "top_k": 5000}, 400, "top_k", "less than or equal to 1000"),
    ("POST", "/v1/completions", {"prompt": "hi", "temperature": 5}, 400, "temperature", "[0, 2]"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages[0].content[0]", "only text content"),
    ("GET", "/v1/nope", None, 404, None, "GET /v1/nope: not found"),
    ("GET", "/v1/completions", None, 405, None, "method not allowed"),
    ("GET", "/docs", None, 404, None, "not found"),
    ("GET", "/openapi.json", None, 404, None, "not found"),
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}{c[1]}-{c[3]}-{c[5][:24]}" for c in CASES])
def test_limit_is_a_clear_4xx_then_serves(srv, case):
    method, path, body, status, param, fragment = case
    c = httpx.Client(base_url=srv.url, timeout=60)
    if callable(body):
        kw = body()
    elif isinstance(body, bytes):
        kw = {"content": body, "headers": {"content-type": "application/json"}}
    elif body is None:
        kw = {}
    else:
        kw = {"json": body}
    r = c.request(method, path, **kw)
    assert r.status_code == status, (r.status_code, r.text[:500])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    assert err["param"] == param and fragment in err["message"], err
    if param:
        assert err["message"].startswith(param)
    _check_served_ok(srv, c)


def test_chat_content_parts_equal_string_content(srv):
    c = httpx.Client(base_url=srv.url, timeout=60)
    plain = {"messages": [{"role": "user", "content": "Hello\nworld"}], "max_tokens": 10, "temperature": 0}
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hello"},
                                                      {"type": "text", "text": "world"}]}],
             "max_tokens": 10, "temperature": 0}
    a = c.post("/v1/chat/completions", json=plain)
    b = c.post("/v1/chat/completions", json=parts)
    assert a.status_code == b.status_code == 200, b.text
    assert a.json()["choices"] == b.json()["choices"] and a.json()["usage"] == b.json()["usage"]


def test_rejected_requests_counted_by_status(srv):
    from tests.server_common import metric_samples

    c = httpx.Client(base_url=srv.url, timeout=60)
    before = metric_samples(c.get("/metrics").text)
    key = ("jf_requests_total", (("code", "413"), ("endpoint", "/v1/completions")))
    r = c.post("/v1/completions", content=json.dumps({"prompt": "q" * 70000}).encode(),
               headers={"content-type": "application/json"})
    assert r.status_code == 413
    after = metric_samples(c.get("/metrics").text)
    assert after[key] == before.get(key, 0) + 1


def test_encode_bounded_refuses_long_prompt_from_a_prefix(srv):
    """A prompt far over the context is refused after tokenizing a prefix; prompts that fit are encoded whole."""
    from megatron_jf.server.protocol import Limits, RequestError, encode_bounded

    calls = []

    class Counting:
        def encode(self, text):
            calls.append(len(text))
            return srv.tok.encode(text)

    lim = Limits(max_context=MAX_CTX, max_token_chars=10 ** 6)
    text = "naïve café Köln " * 20000
    with pytest.raises(RequestError, match="the prompt has more than .* tokens; the context window is 256"):
        encode_bounded(Counting(), text, lim, "prompt")
    assert max(calls) < len(text) // 100  # never the whole text
    short = "naïve café Köln " * 10
    assert encode_bounded(Counting(), short, lim, "prompt") == srv.tok.encode(short)

    class Words:  # one token per word: long texts that still fit the context
        def encode(self, text):
            calls.append(len(text))
            return [len(w) for w in text.split()]

    calls.clear()
    edge = "abcdefgh " * 250  # 2250 characters > 4 * context, 250 tokens: fits, counted exactly
    assert encode_bounded(Words(), edge, lim, "prompt") == [8] * 250 and len(calls) == 2
    calls.clear()
    with pytest.raises(RequestError, match="context window is 256"):
        encode_bounded(Words(), "abcdefgh " * 100_000, lim, "prompt")
    assert max(calls) <= 4 * 4 * MAX_CTX


# ---- oversized bodies are answered, not reset (issue 25): the 413 reaches a client that is still sending, even one
# that asks the server to close after the answer (urllib sends "Connection: close"), and the server reads the excess
# in chunks and drops it (its RSS stays flat)


def _urllib_post(url, body, headers=None):
    """``(status, JSON body)`` of a POST with urllib (``Connection: close``); ``body``: bytes or an iterable of
    chunks (sent as they come: with a Content-Length header, or chunked without one)."""
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, data=body, method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _zeros(total, chunk=1 << 16):
    block = b"0" * chunk
    for i in range(0, total, chunk):
        yield block[: min(chunk, total - i)]


class _PeakRSS:
    """Peak resident set size of this process (the server runs in a thread of it) over a ``with`` block, in bytes
    above the level at entry, sampled every 5 ms."""

    def __enter__(self):
        import threading

        self.base = self.peak = self._rss()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self._rss())

    @staticmethod
    def _rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.grew = self.peak - self.base


BIG = 64 * 10 ** 6  # a 64 MB body: ~1000x the test server's limit


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_oversized_body_gets_413_while_the_client_is_still_sending(srv, framing):
    headers = {"Content-Length": str(BIG)} if framing == "content-length" else {}
    with _PeakRSS() as rss:
        status, body = _urllib_post(srv.url + "/v1/completions", _zeros(BIG), headers)
    assert status == 413, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == 413 and err["param"] == "body"
    assert "exceeds the limit of 65536 bytes (--max-request-bytes)" in err["message"]
    assert rss.grew < 16 << 20, f"server RSS grew by {rss.grew / 2**20:.1f} MiB reading a 64 MB body"
    _check_served_ok(srv, httpx.Client(base_url=srv.url, timeout=60))


def _default_limits_server(srv):
    """The test server's scheduler behind an app with the CLI's default limits (2 MiB bodies, 16 stop strings of
    at most 512 characters)."""
    import threading

    import uvicorn

    from megatron_jf.server.app import create_app
    from tests.server_common import free_port, wait_health

    from megatron_jf.inference.engine import DecodeConfig

    app = create_app(srv.sched, srv.tok, model_name="tiny", metrics=srv.metrics, stop_ids=srv.stop_ids,
                     default_config=DecodeConfig("mr", block_size=8))  # the scheduler's 64-token steps
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    wait_health(url, 30)
    return server, url


@pytest.mark.parametrize("limits", ["test", "default"])
def test_huge_stop_strings_get_a_json_4xx(srv, limits):
    """A 5 MB stop string and 16 stop strings of 100k characters: whichever limit they hit (the body size, or the
    stop-string length under a limit the body fits) answers OpenAI-shaped JSON, never a closed connection."""
    server, url = (None, srv.url) if limits == "test" else _default_limits_server(srv)
    try:
        cases = [({"prompt": "hi", "stop": "x" * 5_000_000}, 413, "body", "exceeds the limit of"),
                 ({"prompt": "hi", "stop": ["y" * 100_000] * 16}, 413 if limits == "test" else 400,
                  "body" if limits == "test" else "stop",
                  "exceeds the limit of" if limits == "test" else "at most 512 characters, got 100000")]
        for req, status, param, fragment in cases:
            got, body = _urllib_post(url + "/v1/completions", json.dumps(req).encode())
            assert got == status, (got, body)
            assert body["error"]["code"] == status and body["error"]["param"] == param
            assert fragment in body["error"]["message"], body
        _check_served_ok(srv, httpx.Client(base_url=url, timeout=60))
    finally:
        if server is not None:
            server.should_exit = True


def test_body_beyond_the_discard_bound_is_answered_then_closed(srv):
    """A declared body too large to read and drop (over ``DISCARD_MAX_BYTES``) is answered at once with
    ``Connection: close``; nothing of it is read."""
    import socket

    from megatron_jf.server.app import DISCARD_MAX_BYTES

    host, port = srv.url.rsplit("//", 1)[1].split(":")
    with socket.create_connection((host, int(port)), timeout=60) as so:
        so.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   b"Content-Length: %d\r\n\r\n" % (DISCARD_MAX_BYTES + 1))
        data = b""
        while True:
            d = so.recv(1 << 16)
            if not d:
                break
            data += d
    head, _, payload = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413 ") and b"connection: close" in head.lower(), head
    assert json.loads(payload)["error"]["code"] == 413
