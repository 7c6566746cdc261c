"""Request limits and the error contract (issue 15): every bad request gets a clear 4xx in OpenAI's
``{"error": {...}}`` shape naming the problem, and the server answers correctly right after each."""
import json

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
