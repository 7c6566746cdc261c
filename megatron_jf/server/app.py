"""FastAPI application: ``PUT /api`` (Megatron), ``POST /v1/completions``, ``POST /v1/chat/completions``,
``GET /health``, ``GET /v1/models``, ``GET /metrics``.

Responses carry decoding stats in a ``"jf"`` extension object: ``decoder``, ``forwards`` (decode
forward passes), ``tpf`` (tokens per forward), ``batch_size``, ``prefill_s``, ``decode_s``, ``queue_s``.
Streaming (``"stream": true``) sends Server-Sent Events ``data: {json}\\n\\n``, one per committed group
of tokens (text decoded incrementally, so multi-byte characters are never split; each chunk's
``jf.token_ids`` lists its tokens), then a final chunk with ``finish_reason``, an optional usage chunk
(``stream_options.include_usage``), and ``data: [DONE]``. A client that disconnects mid-stream cancels
its request (see :mod:`megatron_jf.server.scheduler`). Errors: ``{"error": {"message", "type", "param"}}``
with 4xx (400 invalid value / 422 wrong type / 404 unknown model / 503 queue full) or 500.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from megatron_jf.inference.engine import DecodeConfig
from megatron_jf.server import protocol
from megatron_jf.server.metrics import Metrics
from megatron_jf.server.protocol import ParsedRequest, RequestError
from megatron_jf.server.scheduler import GenRequest, QueueFullError, RequestOutput, Scheduler, SchedulerStoppedError
from megatron_jf.tokenizer import IncrementalDecoder

log = logging.getLogger("megatron_jf.server")


def _error(status: int, message: str, param: str | None = None, etype: str = "invalid_request_error"):
    return JSONResponse({"error": {"message": message, "type": etype, "param": param}}, status_code=status)


def _finish(reason: str) -> str:
    """Engine finish reason -> OpenAI's (EOS and stop strings are both ``stop``)."""
    return "length" if reason == "length" else "stop"


def _stats(cfg: DecodeConfig, out: RequestOutput) -> dict:
    return {"decoder": cfg.decoder, "config": {k: getattr(cfg, k) for k in protocol.JF_FIELDS},
            "forwards": out.forwards, "tpf": round(out.tpf, 4), "batch_size": out.batch_size,
            "prefill_s": round(out.prefill_s, 6), "decode_s": round(out.decode_s, 6), "queue_s": round(out.queue_s, 6),
            "finish": out.finish_reason}


def create_app(scheduler: Scheduler, tokenizer, *, model_name: str = "megatron-jf",
               default_config: DecodeConfig = DecodeConfig("mr"), metrics: Metrics | None = None) -> FastAPI:
    """Build the app.

    Args:
        scheduler: the batching scheduler (owns the engine).
        tokenizer: a :class:`megatron_jf.tokenizer.Tokenizer` (encode/decode/chat template/eos ids).
        model_name: the id reported by ``/v1/models`` and accepted in ``model``.
        default_config: decode config when a request has no ``jf`` object.
        metrics: shared metrics (the scheduler's, normally).
    """
    app = FastAPI(title="megatron-jf text generation server")
    metrics = metrics or scheduler.metrics or Metrics()
    max_ctx = scheduler.max_context
    eos = frozenset(tokenizer.eos_ids)
    created = int(time.time())

    async def _json(request: Request):
        raw = await request.body()
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RequestError("body", f"invalid JSON: {e}") from None

    def _submit(p: ParsedRequest, i: int, loop, seed_offset: int = 0) -> GenRequest:
        s = p.sampling
        if seed_offset:
            from megatron_jf.inference.sampling import SamplingParams
            s = SamplingParams(s.temperature, s.top_k, s.top_p, s.seed + seed_offset)
        req = GenRequest(prompt=p.prompts[i], max_tokens=p.max_tokens, config=p.config, sampling=s,
                         stop=p.stop, eos_ids=eos | p.extra_eos, seeded=p.seeded, loop=loop, queue=asyncio.Queue())
        scheduler.submit(req)
        return req

    async def _wait(req: GenRequest) -> RequestOutput:
        while True:
            kind, payload = await req.queue.get()
            if kind == "done":
                return payload
            if kind == "error":
                raise payload

    def _handle_errors(endpoint):
        def deco(fn):
            async def wrapped(request: Request):
                try:
                    resp = await fn(request)
                except RequestError as e:
                    resp = _error(e.status, e.message, e.field)
                except QueueFullError as e:
                    resp = _error(503, str(e), None, "server_busy")
                except SchedulerStoppedError as e:
                    resp = _error(503, str(e), None, "server_shutting_down")
                except Exception as e:  # noqa: BLE001
                    log.exception("request failed")
                    resp = _error(500, f"{type(e).__name__}: {e}", None, "server_error")
                metrics.request_done(endpoint, resp.status_code)
                return resp
            wrapped.__name__ = fn.__name__
            return wrapped
        return deco

    def _text(prompt_ids, tokens) -> str:
        d = IncrementalDecoder(tokenizer, prompt_ids)
        return d.push(tokens) + d.flush()

    # ------------------------------------------------------------------ Megatron
    @app.put("/api")
    @_handle_errors("/api")
    async def api(request: Request):
        p = protocol.parse_megatron(await _json(request), tokenizer, max_ctx, default_config)
        loop = asyncio.get_running_loop()
        reqs = []
        for i in range(len(p.prompts)):
            reqs.append(_submit(p, i, loop, seed_offset=i))
        outs = await asyncio.gather(*[_wait(r) for r in reqs])
        if not p.no_log:
            log.info("/api %d prompts, %d tokens", len(reqs), sum(len(o.tokens) for o in outs))
        texts, segs, toks = [], [], []
        for ptxt, pids, o in zip(p.prompt_texts, p.prompts, outs):
            gen = _text(pids, o.tokens)
            texts.append(ptxt + gen)
            all_ids = pids + o.tokens
            toks.append(all_ids)
            segs.append([tokenizer.decode([t], skip_special_tokens=False) for t in all_ids])
        return JSONResponse({"text": texts, "segments": segs, "tokens": toks, "logprobs": None,
                             "jf": [_stats(p.config, o) for o in outs]})

    # ------------------------------------------------------------------ OpenAI
    async def _openai(request: Request, chat: bool):
        body = await _json(request)
        if chat:
            p = protocol.parse_chat(body, tokenizer, max_ctx, model_name, default_config)
        else:
            p = protocol.parse_completion(body, tokenizer, max_ctx, model_name, default_config)
        loop = asyncio.get_running_loop()
        req = _submit(p, 0, loop)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        obj = "chat.completion" if chat else "text_completion"
        plen = len(p.prompts[0])
        if not p.stream:
            out = await _wait(req)
            text = _text(p.prompts[0], out.tokens)
            choice = {"index": 0, "finish_reason": _finish(out.finish_reason), "logprobs": None}
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            return JSONResponse({"id": rid, "object": obj, "created": int(time.time()), "model": model_name,
                                 "choices": [choice],
                                 "usage": {"prompt_tokens": plen, "completion_tokens": len(out.tokens),
                                           "total_tokens": plen + len(out.tokens)},
                                 "jf": _stats(p.config, out)})
        return StreamingResponse(_stream(req, p, rid, chat, plen), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _stream(req: GenRequest, p: ParsedRequest, rid: str, chat: bool, plen: int):
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

        done = False
        try:
            if chat:
                yield chunk("", role=True)
            n = 0
            while True:
                kind, payload = await req.queue.get()
                if kind == "tokens":
                    n += len(payload)
                    piece = dec.push(payload)
                    yield chunk(piece, ids=list(payload))
                elif kind == "error":
                    done = True
                    err = {"error": {"message": f"{type(payload).__name__}: {payload}", "type": "server_error"}}
                    yield f"data: {json.dumps(err)}\n\n"
                    yield "data: [DONE]\n\n"
                    return
                else:
                    out: RequestOutput = payload
                    done = True
                    tail = dec.flush()
                    yield chunk(tail, finish=_finish(out.finish_reason), ids=[],
                                extra={"jf": {"token_ids": [], **_stats(p.config, out)}})
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
        return {"status": "ok", "queue_depth": scheduler.queue_depth(), "batches_run": scheduler.batches_run}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "megatron-jf", "max_model_len": max_ctx,
                                            "jf": {"default_decoder": {k: getattr(default_config, k)
                                                                       for k in protocol.JF_FIELDS}}}]}

    @app.get("/metrics")
    async def prom():
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    return app
