"""FastAPI application: ``PUT /api`` (Megatron), ``POST /v1/completions``, ``POST /v1/chat/completions``,
``GET /health``, ``GET /v1/models``, ``GET /metrics``.

Responses carry decoding stats in a ``"jf"`` extension object: ``decoder``, ``forwards`` (decode
forward passes), ``tpf`` (tokens per forward), ``batch_size``, ``prefill_s``, ``decode_s``, ``queue_s``.
Streaming (``"stream": true``) sends Server-Sent Events ``data: {json}\\n\\n``, one per committed group
of tokens (text decoded incrementally, so multi-byte characters are never split; each chunk's
``jf.token_ids`` lists its tokens), then a final chunk with ``finish_reason``, an optional usage chunk
(``stream_options.include_usage``), and ``data: [DONE]``. A client that disconnects (mid-stream, or
before a non-streamed answer) cancels its request: its row leaves the batch at the next engine step
(see :mod:`megatron_jf.server.scheduler`); it is counted as status 499 and not as generated tokens.

Errors: every status (400 invalid value, 404 unknown model or path, 405 method, 413 body too large (answered
to a client that is still sending: the rest of the body is read and dropped, up to :data:`DISCARD_MAX_BYTES`),
422 wrong type, 503 queue full / shutting down, 500) answers OpenAI's shape
``{"error": {"message", "type", "param", "code"}}``. Limits are in
:class:`~megatron_jf.server.protocol.Limits` plus ``max_request_bytes`` (the body). Parsing,
tokenization and detokenization run in worker threads, so a large request never blocks the event loop
(``/health`` keeps answering). ``/docs`` and ``/openapi.json`` are off unless ``docs=True``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from megatron_jf.inference.engine import DecodeConfig
from megatron_jf.inference.results import GenerationResult
from megatron_jf.server import protocol
from megatron_jf.server.metrics import CONTENT_TYPE, Metrics
from megatron_jf.server.protocol import Limits, ParsedRequest, RequestError
from megatron_jf.server.scheduler import GenRequest, QueueFullError, Scheduler, SchedulerStoppedError
from megatron_jf.tokenizer import IncrementalDecoder, stop_token_ids

_ETYPES = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
           413: "invalid_request_error", 422: "invalid_request_error", 503: "server_busy"}

log = logging.getLogger("megatron_jf.server")


#: An oversized body is read and dropped up to this many bytes (in at most ``DISCARD_MAX_S`` seconds, nginx's
#: ``lingering_time``) so its 413 reaches the client; a larger one is answered at once with ``Connection: close``.
DISCARD_MAX_BYTES = 128 << 20
DISCARD_MAX_S = 30.0


class BodyTooLarge(RequestError):
    """413: the body is over ``max_request_bytes``; ``close``: the rest was not read (answer with
    ``Connection: close``)."""

    def __init__(self, message: str, close: bool):
        super().__init__("body", message, status=413)
        self.close = close


class ClientDisconnected(Exception):
    """The client of a non-streamed request went away before its answer (counted as status 499)."""


def _error(status: int, message: str, param: str | None = None, etype: str | None = None):
    etype = etype or _ETYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return JSONResponse({"error": {"message": message, "type": etype, "param": param, "code": status}},
                        status_code=status)


def max_token_chars(tokenizer, default: int = 64) -> int:
    """Characters of the tokenizer's longest token (vocabulary strings of byte-level BPE and sentencepiece
    have at least as many characters as the text they decode to); ``default`` when unknown."""
    try:
        if hasattr(tokenizer, "hf"):
            return max(1, max(map(len, tokenizer.hf.get_vocab())))
        if hasattr(tokenizer, "sp"):
            return max(1, max(len(tokenizer.sp.id_to_piece(i)) for i in range(tokenizer.sp.get_piece_size())))
    except Exception:  # noqa: BLE001 -- a bound only; fall back
        pass
    return default


def _finish(reason: str) -> str:
    """Engine finish reason -> OpenAI's (EOS and stop strings are both ``stop``)."""
    return "length" if reason == "length" else "stop"


def _stats(cfg: DecodeConfig, out: GenerationResult) -> dict:
    return {"decoder": cfg.decoder, "config": {k: getattr(cfg, k) for k in protocol.JF_FIELDS},
            "forwards": out.forwards, "tpf": round(out.tpf, 4), "batch_size": out.batch_size,
            "prefill_s": round(out.prefill_s, 6), "decode_s": round(out.decode_s, 6), "queue_s": round(out.queue_s, 6),
            "finish": out.finish_reason}


def create_app(scheduler: Scheduler, tokenizer, *, model_name: str = "megatron-jf",
               default_config: DecodeConfig = DecodeConfig("mr"), metrics: Metrics | None = None,
               stop_ids: frozenset | None = None, limits: Limits | None = None,
               max_request_bytes: int = 2 << 20, docs: bool = False) -> FastAPI:
    """Build the app.

    Args:
        scheduler: the batching scheduler (owns the engine).
        tokenizer: a :class:`megatron_jf.tokenizer.Tokenizer` (encode/decode/chat template).
        model_name: the id reported by ``/v1/models`` and accepted in ``model``.
        default_config: decode config when a request has no ``jf`` object.
        metrics: shared metrics (the scheduler's, normally).
        stop_ids: token ids that end every request -- :func:`megatron_jf.tokenizer.stop_token_ids` of the
            checkpoint (default: of the tokenizer alone).
        limits: request limits (default: the scheduler's context and parallel-token budget).
        max_request_bytes: largest request body (413 beyond).
        docs: serve ``/docs`` (Swagger UI, which loads its assets from a CDN) and ``/openapi.json``.
    """
    app = FastAPI(title="megatron-jf text generation server", docs_url="/docs" if docs else None,
                  redoc_url=None, openapi_url="/openapi.json" if docs else None)
    metrics = metrics or scheduler.metrics or Metrics(model_name)
    max_ctx = scheduler.max_context
    limits = limits or Limits(max_context=max_ctx, max_parallel_tokens=scheduler.max_width,
                              max_token_chars=max_token_chars(tokenizer))
    eos = frozenset(stop_token_ids(tokenizer) if stop_ids is None else stop_ids)
    created = int(time.time())

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        msg = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        if exc.status_code == 404:
            msg = f"{request.method} {request.url.path}: not found"
        elif exc.status_code == 405:
            msg = f"{request.method} {request.url.path}: method not allowed"
        return _error(exc.status_code, msg)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        errs = exc.errors()
        loc = ".".join(str(x) for x in errs[0].get("loc", ())[1:]) if errs else None
        return _error(422, f"{loc or 'body'}: {errs[0].get('msg') if errs else 'invalid request'}", loc or "body")

    async def _body(request: Request) -> bytes:
        """The request body; over ``max_request_bytes`` a 413 that reaches the client (:func:`_too_large`)."""
        n = request.headers.get("content-length")
        stream = request.stream()
        if n is not None and n.isdigit() and int(n) > max_request_bytes:
            raise await _too_large(stream, f"request body of {int(n)} bytes", int(n))
        chunks, size = [], 0
        async for c in stream:
            size += len(c)
            if size > max_request_bytes:
                raise await _too_large(stream, "request body", None, already=size)
            chunks.append(c)
        return b"".join(chunks)

    async def _too_large(stream, what: str, declared: int | None, already: int = 0) -> BodyTooLarge:
        """The 413 for an oversized body, after reading and dropping the rest of it (chunk by chunk, nothing kept)
        so that the answer reaches a client that is still sending -- also one that asked for ``Connection: close``,
        after which the server closes at once and the client's next write would be reset. At most
        ``DISCARD_MAX_BYTES`` in ``DISCARD_MAX_S``; beyond that (or when the declared length is over it) the answer
        says ``Connection: close`` and nothing more is read."""
        drained = declared is None or declared <= DISCARD_MAX_BYTES
        if drained:
            async def drop():
                total = already
                async for c in stream:
                    total += len(c)
                    if total > DISCARD_MAX_BYTES:
                        return False
                return True

            try:
                drained = await asyncio.wait_for(drop(), DISCARD_MAX_S)
            except (asyncio.TimeoutError, ClientDisconnect):
                drained = False
        return BodyTooLarge(f"{what} exceeds the limit of {max_request_bytes} bytes (--max-request-bytes)",
                            close=not drained)

    def _decode_json(raw: bytes):
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RequestError("body", f"invalid JSON: {e}") from None
        except RecursionError:
            raise RequestError("body", f"JSON nested deeper than {limits.max_json_depth} levels") from None
        protocol.check_json(body, limits.max_json_depth)
        return body

    def _submit(p: ParsedRequest, i: int, loop) -> GenRequest:
        req = GenRequest(prompt=p.prompts[i], request=p.requests[i], loop=loop, queue=asyncio.Queue())
        scheduler.submit(req)
        return req

    async def _wait(req: GenRequest) -> GenerationResult:
        while True:
            kind, payload = await req.queue.get()
            if kind == "done":
                return payload
            if kind == "error":
                raise payload

    async def _disconnected(request: Request) -> None:
        """Returns when the client closes the connection (the body was read: the next message is the
        disconnect)."""
        while (await request.receive()).get("type") != "http.disconnect":
            pass

    async def _wait_all(request: Request, reqs: list[GenRequest]) -> list[GenerationResult]:
        """The outputs of ``reqs``; if the client disconnects first (or anything fails), every request is
        cancelled -- its row leaves the batch at the next engine step."""
        watcher = asyncio.ensure_future(_disconnected(request))
        outs = asyncio.ensure_future(asyncio.gather(*[_wait(r) for r in reqs]))
        try:
            done, _ = await asyncio.wait({watcher, outs}, return_when=asyncio.FIRST_COMPLETED)
            if outs in done:
                return outs.result()
            metrics.request_cancelled()
            raise ClientDisconnected("the client disconnected")
        except BaseException:
            for r in reqs:
                r.cancel()
            outs.cancel()
            raise
        finally:
            watcher.cancel()

    def _handle_errors(endpoint):
        def deco(fn):
            async def wrapped(request: Request):
                try:
                    resp = await fn(request)
                except RequestError as e:
                    resp = _error(e.status, e.message, e.field)
                    if isinstance(e, BodyTooLarge) and e.close:
                        resp.headers["connection"] = "close"
                except QueueFullError as e:
                    resp = _error(503, str(e), None, "server_busy")
                except SchedulerStoppedError as e:
                    resp = _error(503, str(e), None, "server_shutting_down")
                except ClientDisconnected as e:
                    resp = _error(499, str(e), None, "client_closed_request")
                except Exception as e:  # noqa: BLE001
                    log.exception("request failed")
                    resp = _error(500, f"{type(e).__name__}: {e}", None, "server_error")
                if not isinstance(resp, StreamingResponse):  # a stream counts its own final status
                    metrics.request_done(endpoint, resp.status_code)
                return resp
            wrapped.__name__ = fn.__name__
            return wrapped
        return deco

    def _text(prompt_ids, out: GenerationResult) -> str:
        d = IncrementalDecoder(tokenizer, prompt_ids)
        return d.push(out.tokens) + d.flush() + out.tail_text

    def _api_answer(p: ParsedRequest, outs: list[GenerationResult]) -> dict:
        texts, segs, toks = [], [], []
        for ptxt, pids, o in zip(p.prompt_texts, p.prompts, outs):
            texts.append(ptxt + _text(pids, o))
            all_ids = pids + o.tokens
            toks.append(all_ids)
            segs.append([tokenizer.decode([t], skip_special_tokens=False) for t in all_ids])
        return {"text": texts, "segments": segs, "tokens": toks, "logprobs": None,
                "jf": [_stats(p.decode, o) for o in outs]}

    # ------------------------------------------------------------------ Megatron
    @app.put("/api")
    @_handle_errors("/api")
    async def api(request: Request):
        raw = await _body(request)
        p = await run_in_threadpool(lambda: protocol.parse_megatron(_decode_json(raw), tokenizer, limits,
                                                                     default_config, eos))
        loop = asyncio.get_running_loop()
        reqs = []
        try:
            for i in range(len(p.prompts)):
                reqs.append(_submit(p, i, loop))
        except Exception:  # e.g. the queue filled up after some prompts: drop those too
            for r in reqs:
                r.cancel()
            raise
        outs = await _wait_all(request, reqs)
        if not p.no_log:
            log.info("/api %d prompts, %d tokens", len(reqs), sum(len(o.tokens) for o in outs))
        return JSONResponse(await run_in_threadpool(_api_answer, p, outs))

    # ------------------------------------------------------------------ OpenAI
    async def _openai(request: Request, chat: bool):
        raw = await _body(request)
        parse = protocol.parse_chat if chat else protocol.parse_completion
        p = await run_in_threadpool(lambda: parse(_decode_json(raw), tokenizer, limits, model_name, default_config,
                                                  eos))
        loop = asyncio.get_running_loop()
        req = _submit(p, 0, loop)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        obj = "chat.completion" if chat else "text_completion"
        plen = len(p.prompts[0])
        if not p.stream:
            (out,) = await _wait_all(request, [req])
            text = await run_in_threadpool(_text, p.prompts[0], out)
            choice = {"index": 0, "finish_reason": _finish(out.finish_reason), "logprobs": None}
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            return JSONResponse({"id": rid, "object": obj, "created": int(time.time()), "model": model_name,
                                 "choices": [choice],
                                 "usage": {"prompt_tokens": plen, "completion_tokens": len(out.tokens),
                                           "total_tokens": plen + len(out.tokens)},
                                 "jf": _stats(p.decode, out)})
        endpoint = "/v1/chat/completions" if chat else "/v1/completions"
        return StreamingResponse(_stream(req, p, rid, chat, plen, endpoint), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _stream(req: GenRequest, p: ParsedRequest, rid: str, chat: bool, plen: int, endpoint: str):
        obj = "chat.completion.chunk" if chat else "text_completion"
        created_t = int(time.time())
        dec = IncrementalDecoder(tokenizer, p.prompts[0])

        def chunk(text, finish=None, ids=None, extra=None, role=False):
            if chat:
                delta = {"role": "assistant", "content": text} if role else ({"content": text} if text or
                                                                              finish is None else {})
                c = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            else:
                c = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
            d = {"id": rid, "object": obj, "created": created_t, "model": model_name, "choices": [c]}
            if ids is not None:
                d["jf"] = {"token_ids": ids}
            if extra:
                d.update(extra)
            return f"data: {json.dumps(d, ensure_ascii=False)}\n\n"

        done, code = False, 499  # 499: the client closed the connection first
        try:
            if chat:
                yield chunk("", role=True)
            n = 0
            while True:
                kind, payload = await req.queue.get()
                if kind == "tokens":
                    n += len(payload)
                    piece = await run_in_threadpool(dec.push, payload)
                    yield chunk(piece, ids=list(payload))
                elif kind == "error":
                    done, code = True, 500
                    err = {"error": {"message": f"{type(payload).__name__}: {payload}", "type": "server_error"}}
                    yield f"data: {json.dumps(err)}\n\n"
                    yield "data: [DONE]\n\n"
                    return
                else:
                    out: GenerationResult = payload
                    done, code = True, 200
                    tail = await run_in_threadpool(dec.flush) + out.tail_text
                    yield chunk(tail, finish=_finish(out.finish_reason), ids=[],
                                extra={"jf": {"token_ids": [], **_stats(p.decode, out)}})
                    if p.include_usage:
                        u = {"id": rid, "object": obj, "created": created_t, "model": model_name, "choices": [],
                             "usage": {"prompt_tokens": plen, "completion_tokens": len(out.tokens),
                                       "total_tokens": plen + len(out.tokens)}}
                        yield f"data: {json.dumps(u)}\n\n"
                    yield "data: [DONE]\n\n"
                    return
        finally:
            if not done:  # client went away (generator closed/cancelled) before the end
                req.cancel()
                metrics.request_cancelled()
            metrics.request_done(endpoint, code)

    @app.post("/v1/completions")
    @_handle_errors("/v1/completions")
    async def completions(request: Request):
        return await _openai(request, chat=False)

    @app.post("/v1/chat/completions")
    @_handle_errors("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _openai(request, chat=True)

    # ------------------------------------------------------------------ info
    @app.get("/health")
    async def health():
        return {"status": "ok", "queue_depth": scheduler.queue_depth(), "batches_run": scheduler.steps_run}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "megatron-jf", "max_model_len": max_ctx,
                                            "jf": {"default_decoder": {k: getattr(default_config, k)
                                                                       for k in protocol.JF_FIELDS}}}]}

    @app.get("/metrics")
    async def prom():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app
