"""Request parsing and validation for ``PUT /api`` (Megatron) and ``/v1/completions``,
``/v1/chat/completions`` (OpenAI).

Every field a request may carry is either honoured or rejected with a :class:`RequestError`
(HTTP 400, or 422 for a wrong type) that names the field; unknown fields are rejected too, so nothing
is silently ignored. Decoder selection: an optional ``"jf"`` object,
``{"decoder": "ar"|"jacobi"|"running-window"|"mr", "block_size": n, "num_blocks": K,
"spawn_threshold": r, "verification_size": v, "ngram_pool_size": p, "draft_init": "context"|"repeat",
"draft_width": "auto"|"fixed", "prompt_lookup_min": a, "prompt_lookup_max": b}`` (the fields of
:class:`~megatron_jf.decoding.DecodeConfig`); missing keys take the server default config's values (a different
``decoder`` alone keeps the default's parameters).

Limits (:class:`Limits`; every one answered with a 4xx naming the field, never a 5xx): prompt tokens
(the context window; a prompt longer than ``context x longest token`` characters is refused before it
is tokenized), the decode config's tokens per forward (``jf.block_size`` etc., bounded by the context
and a per-request parallel-token budget), number and length of stop strings, prompts per ``/api``
request, JSON nesting depth and invalid Unicode (lone surrogates) anywhere in the body.
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass

from megatron_jf.decoding import DecodeConfig, forward_width
from megatron_jf.inference.request import ContextError, Request, SamplingParams, check


class RequestError(ValueError):
    """A client error: HTTP ``status`` with a message naming ``field``."""

    def __init__(self, field: str, message: str, status: int = 400):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = f"{field}: {message}"
        self.status = status


@dataclass
class ParsedRequest:
    """A validated request, in engine terms.

    Attributes:
        prompts: token ids per prompt (``/api`` may carry several; OpenAI endpoints one).
        prompt_texts: the prompt strings (for Megatron's ``text`` = prompt + generation).
        requests: one :class:`~megatron_jf.inference.request.Request` per prompt, final: ``max_new_tokens`` from
            ``tokens_to_generate`` / ``max_tokens`` / ``max_completion_tokens``, EOS ids the server's plus
            Megatron's ``stop_token``, the seed of prompt ``i`` the client's seed ``+ i`` (a sampled request without
            one: a fresh random seed per prompt), each checked against the context window.
        stream: SSE streaming (OpenAI endpoints).
        include_usage: ``stream_options.include_usage``.
        no_log: Megatron ``no_log`` (do not log the request).
    """

    prompts: list[list[int]]
    prompt_texts: list[str]
    requests: list[Request]
    stream: bool = False
    include_usage: bool = False
    no_log: bool = False

    @property
    def decode(self) -> DecodeConfig:
        """The decode config (the same for every prompt)."""
        return self.requests[0].decode


JF_FIELDS = {f.name: f.type for f in dataclasses.fields(DecodeConfig)}


@dataclass(frozen=True)
class Limits:
    """What one request may ask for.

    Attributes:
        max_context: the context window, tokens (prompt + generated).
        max_parallel_tokens: most tokens one request may forward per engine step
            (:func:`~megatron_jf.inference.engine.forward_width`: AR 1, Jacobi ``n+1``, MR ``1+K*n+(v-1)*n``).
        max_stop: most stop strings per request; max_stop_chars: longest stop string, characters.
        max_prompts: most prompts per ``PUT /api`` request.
        max_json_depth: deepest nesting of arrays/objects in a body.
        max_token_chars: the tokenizer's longest token, characters (prompts longer than
            ``max_context * max_token_chars`` characters cannot fit and are refused untokenized).
    """

    max_context: int
    max_parallel_tokens: int = 512
    max_stop: int = 16
    max_stop_chars: int = 512
    max_prompts: int = 128
    max_json_depth: int = 32
    max_token_chars: int = 64

    @property
    def max_prompt_chars(self) -> int:
        return self.max_context * self.max_token_chars


def check_json(body, max_depth: int) -> None:
    """Walk a parsed JSON body (iteratively): nesting at most ``max_depth`` and no string (or key) that is
    not valid Unicode (a lone surrogate such as ``"\\ud800"`` cannot be encoded as UTF-8).

    Raises:
        RequestError: naming the field (``messages[0].content``) or ``body``.
    """
    stack = [(body, "", 1)]
    while stack:
        v, path, depth = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as e:
                raise RequestError(path or "body", f"invalid Unicode: lone surrogate U+{ord(v[e.start]):04X} at "
                                                   f"character {e.start}") from None
            continue
        if not isinstance(v, (dict, list)):
            continue
        if depth > max_depth:
            raise RequestError("body", f"JSON nested deeper than {max_depth} levels")
        if isinstance(v, dict):
            for k, x in v.items():
                name = f"{path}.{k}" if path else str(k)
                stack.append((k, name, depth))
                stack.append((x, name, depth + 1))
        else:
            for i, x in enumerate(v):
                stack.append((x, f"{path}[{i}]", depth + 1))


def _type_error(field, want, v):
    return RequestError(field, f"must be {want}, got {type(v).__name__} {v!r}"[:300], status=422)


def _int(body, key, default=None, *, lo=None, hi=None, field=None):
    field = field or key
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        else:
            raise _type_error(field, "an integer", v)
    if lo is not None and v < lo:
        raise RequestError(field, f"must be >= {lo}, got {v}")
    if hi is not None and v > hi:
        raise RequestError(field, f"must be <= {hi}, got {v}")
    return v


def _float(body, key, default=None, *, field=None):
    field = field or key
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _type_error(field, "a number", v)
    v = float(v)
    if not math.isfinite(v):
        raise RequestError(field, f"must be finite, got {v}")
    return v


def _bool(body, key, default=False, *, field=None):
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _type_error(field or key, "a boolean", v)
    return v


def _check_unknown(body: dict, allowed: set[str]) -> None:
    bad = sorted(set(body) - allowed)
    if bad:
        raise RequestError(bad[0], f"unknown or unsupported field (supported: {', '.join(sorted(allowed))})")


def parse_decode_config(jf, default: DecodeConfig, limits: Limits | None = None) -> DecodeConfig:
    """The ``jf`` extension object -> :class:`DecodeConfig` (missing keys from ``default``).

    Raises:
        RequestError: ``jf`` is not an object, has an unknown key, a wrong type, or an invalid value
            (unknown decoder, n < 1, K < 1, r outside (0, 1], ...), naming ``jf.<key>``; or (with
            ``limits``) a block size past the context window or a config that forwards more than
            ``limits.max_parallel_tokens`` tokens per step.
    """
    cfg = _decode_config(jf, default)
    if limits is not None and jf is not None:
        keys = [k for k in ("block_size", "num_blocks", "verification_size") if k in jf] or ["block_size"]
        if cfg.block_size > limits.max_context:
            raise RequestError("jf.block_size", f"block size {cfg.block_size} exceeds the context window of "
                                                f"{limits.max_context} tokens")
        w = forward_width(cfg)
        if w > limits.max_parallel_tokens:
            formula = {"mr": "1 + K*n + (v-1)*n", "jacobi": "n + 1", "running-window": "n + 1"}.get(cfg.decoder, "1")
            raise RequestError(f"jf.{keys[0]}", f"decoder {cfg.decoder!r} with n={cfg.block_size}, K={cfg.num_blocks}, "
                                                f"v={cfg.verification_size} forwards {w} tokens per step ({formula}); "
                                                f"this server allows at most {limits.max_parallel_tokens} per request")
    return cfg


def _decode_config(jf, default: DecodeConfig) -> DecodeConfig:
    if jf is None:
        return default
    if not isinstance(jf, dict):
        raise _type_error("jf", "an object", jf)
    kw = {}
    for k, v in jf.items():
        if k not in JF_FIELDS:
            raise RequestError(f"jf.{k}", f"unknown decoder parameter (supported: {', '.join(JF_FIELDS)})")
        want = JF_FIELDS[k]
        if want in ("str", str):
            if not isinstance(v, str):
                raise _type_error(f"jf.{k}", "a string", v)
        elif want in ("int", int):
            v = _int(jf, k, field=f"jf.{k}")
        else:
            v = _float(jf, k, field=f"jf.{k}")
        kw[k] = v
    try:
        return dataclasses.replace(default, **kw)
    except ValueError as e:
        msg = str(e)
        field = next((f"jf.{k}" for k, words in (("decoder", "decoder"), ("draft_init", "draft init"),
                                                  ("block_size", "block size"), ("num_blocks", "blocks K"),
                                                  ("spawn_threshold", "threshold"),
                                                  ("verification_size", "verification"),
                                                  ("draft_width", "draft width"),
                                                  ("prompt_lookup_max", "prompt lookup"),
                                                  ("ngram_pool_size", "pool size"))
                      if words in msg), "jf")
        raise RequestError(field, msg) from None


def _sampling(temperature, top_k, top_p, seed) -> SamplingParams:
    try:
        return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    except ValueError as e:
        msg = str(e)
        field = "temperature" if "temperature" in msg else "top_k" if "top_k" in msg else "top_p"
        raise RequestError(field, msg) from None


def _stop_list(v, field="stop", max_n=16, max_chars=512) -> tuple[str, ...]:
    if v is None:
        return ()
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise _type_error(field, "a string or a list of strings", v)
    if len(v) > max_n:
        raise RequestError(field, f"at most {max_n} stop strings, got {len(v)}")
    if any(s == "" for s in v):
        raise RequestError(field, "stop strings must be non-empty")
    long = max(v, key=len, default="")
    if len(long) > max_chars:
        raise RequestError(field, f"stop strings may have at most {max_chars} characters, got {len(long)}")
    return tuple(dict.fromkeys(v))


def _check_chars(text: str, limits: Limits, field: str) -> None:
    """Refuse, before tokenizing it, a prompt that cannot fit the context window whatever its tokens."""
    if len(text) > limits.max_prompt_chars:
        raise RequestError(field, f"the prompt has {len(text)} characters; the context window of "
                                  f"{limits.max_context} tokens holds at most {limits.max_prompt_chars} "
                                  f"(tokens of at most {limits.max_token_chars} characters)")


def encode_bounded(tokenizer, text: str, limits: Limits, field: str) -> list[int]:
    """``tokenizer.encode(text)``, but a text far over the context window is refused after encoding a prefix
    (growing 4x from ``4 * max_context`` characters, cut at whitespace) instead of all of it, so a huge
    prompt costs little CPU. A prefix cut at whitespace has at most a few tokens more than the same
    region of the whole text, hence the margin of 16.

    Raises:
        RequestError: the prefix already has more than ``max_context + 16`` tokens.
    """
    k = 4 * limits.max_context
    while k < len(text):
        cut = text.rfind(" ", k - 256, k)
        n = len(tokenizer.encode(text[: cut if cut > 0 else k]))
        if n > limits.max_context + 16:
            raise RequestError(field, f"the prompt has more than {n - 16} tokens; the context window is "
                                      f"{limits.max_context} tokens")
        k *= 4
    return tokenizer.encode(text)


def _requests(n: int, *, decode: DecodeConfig, sampling: SamplingParams, seeded: bool, max_new_tokens: int,
              stop: tuple[str, ...], eos_ids: frozenset) -> list[Request]:
    """One :class:`Request` per prompt: prompt ``i`` samples with seed ``sampling.seed + i`` (Megatron's
    ``random_seed + i``, as offline generate on the list); a sampled request without a client seed gets a fresh
    random seed per prompt."""
    out = []
    for i in range(n):
        s = sampling
        if not s.greedy and not seeded:
            s = dataclasses.replace(s, seed=random.randrange(1 << 31))
        out.append(Request(decode, s, max_new_tokens, stop, eos_ids, seed=s.seed + i))
    return out


def _check_context(request: Request, prompt_len: int, max_context: int, prompt_field: str, max_field: str):
    """:func:`~megatron_jf.inference.request.check`, answered as a :class:`RequestError` naming the HTTP field
    (``max_field``: the body's name of ``max_new_tokens``)."""
    try:
        check(request, prompt_len, max_context)
    except ContextError as e:
        if e.field == "prompt" and prompt_len == 0:
            raise RequestError(prompt_field, "the prompt is empty (no tokens)") from None
        if e.field == "prompt":
            raise RequestError(prompt_field, f"the prompt has {prompt_len} tokens; the context window is "
                                             f"{max_context} tokens (at least one must be left to generate)") from None
        m = request.max_new_tokens
        raise RequestError(max_field, f"prompt ({prompt_len} tokens) + {max_field}={m} exceeds the context window "
                                      f"of {max_context} tokens (at most {max_context - prompt_len})") from None


# ---------------------------------------------------------------------------------------- Megatron
MEGATRON_FIELDS = {"prompts", "tokens_to_generate", "temperature", "top_k", "top_p", "add_BOS", "stop_token",
                   "stop", "random_seed", "logprobs", "no_log", "stop_on_eol", "stop_on_double_eol",
                   "prevent_newline_after_colon", "beam_width", "length_penalty", "top_p_decay", "top_p_bound",
                   "jf"}


def parse_megatron(body, tokenizer, limits: Limits, default: DecodeConfig,
                   eos_ids: frozenset = frozenset()) -> ParsedRequest:
    """Megatron ``PUT /api`` body -> :class:`ParsedRequest` (``eos_ids``: the server's stop ids).

    Megatron semantics kept: ``tokens_to_generate`` (default 64, >= 1 here: prompt-only scoring is not
    supported), ``temperature`` default 1.0 (0 = greedy), ``top_p`` 0 = off, ``add_BOS`` prepends the
    tokenizer's BOS, ``stop_token`` is a token id that ends generation, ``random_seed`` seeds sampling
    (prompt ``i`` uses ``random_seed + i``), ``stop_on_eol``/``stop_on_double_eol`` stop at
    ``"\\n"``/``"\\n\\n"``. ``stop`` (list of strings) is an extension. Features the engine does not have
    (``logprobs``, beam search, ``prevent_newline_after_colon``, top-p decay) are rejected when requested.
    Validation as Megatron's server: ``temperature`` in [0, 100] (0 = greedy, an extension: Megatron
    asks for > 0), ``top_k`` an integer in [0, 1000], ``top_p`` in [0, 1], and not both ``top_k`` and
    ``top_p``.

    Raises:
        RequestError: naming the offending field.
    """
    if not isinstance(body, dict):
        raise _type_error("body", "a JSON object", body)
    _check_unknown(body, MEGATRON_FIELDS)
    if "prompts" not in body:
        raise RequestError("prompts", "is required")
    prompts = body["prompts"]
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise _type_error("prompts", "a list of strings", prompts)
    if not prompts:
        raise RequestError("prompts", "must hold at least one prompt")
    if len(prompts) > limits.max_prompts:
        raise RequestError("prompts", f"at most {limits.max_prompts} prompts per request, got {len(prompts)}")
    max_new_tokens = _int(body, "tokens_to_generate", 64, lo=1)
    temperature = _float(body, "temperature", 1.0)
    if not 0.0 <= temperature <= 100.0:
        raise RequestError("temperature", f"must be a number in [0, 100] (0 = greedy), got {temperature}")
    top_k = _int(body, "top_k", 0)
    if not 0 <= top_k <= 1000:
        raise RequestError("top_k", f"must be equal to or greater than 0 and less than or equal to 1000, got {top_k}")
    top_p = _float(body, "top_p", 0.0)
    if not 0.0 <= top_p <= 1.0:
        raise RequestError("top_p", f"must be in [0, 1], got {top_p}")
    if top_p > 0.0 and top_k > 0:
        raise RequestError("top_p", "cannot set both top-k and top-p samplings.")
    if top_p == 0.0:
        top_p = 1.0
    seed = _int(body, "random_seed", None, lo=0, hi=2**31 - 1)
    if _bool(body, "logprobs"):
        raise RequestError("logprobs", "log-probabilities are not supported by this server")
    if _bool(body, "prevent_newline_after_colon"):
        raise RequestError("prevent_newline_after_colon", "is not supported by this server")
    if _int(body, "beam_width", None) not in (None, 1):
        raise RequestError("beam_width", "beam search is not supported by this server")
    if _float(body, "length_penalty", 1.0) != 1.0:
        raise RequestError("length_penalty", "is only meaningful with beam search, which is not supported")
    if _float(body, "top_p_decay", 0.0) != 0.0:
        raise RequestError("top_p_decay", "is not supported by this server")
    if _float(body, "top_p_bound", 0.0) != 0.0:
        raise RequestError("top_p_bound", "is not supported by this server")
    stop = list(_stop_list(body.get("stop"), max_n=limits.max_stop, max_chars=limits.max_stop_chars))
    if _bool(body, "stop_on_double_eol"):
        stop.append("\n\n")
    if _bool(body, "stop_on_eol"):
        stop.append("\n")
    extra = frozenset()
    st = _int(body, "stop_token", None, lo=0)
    if st is not None:
        if st >= tokenizer.vocab_size:
            raise RequestError("stop_token", f"token id {st} is outside the vocabulary [0, {tokenizer.vocab_size})")
        extra = frozenset({st})
    add_bos = _bool(body, "add_BOS")
    if add_bos and tokenizer.bos_id is None:
        raise RequestError("add_BOS", "the tokenizer has no BOS token")
    sampling = _sampling(temperature, top_k, top_p, 0 if seed is None else seed)
    config = parse_decode_config(body.get("jf"), default, limits)
    for i, p in enumerate(prompts):
        _check_chars(p, limits, f"prompts[{i}]")
    requests = _requests(len(prompts), decode=config, sampling=sampling, seeded=seed is not None,
                         max_new_tokens=max_new_tokens, stop=tuple(dict.fromkeys(stop)), eos_ids=eos_ids | extra)
    ids = []
    for i, (p, r) in enumerate(zip(prompts, requests)):
        t = encode_bounded(tokenizer, p, limits, f"prompts[{i}]")
        if add_bos:
            t = [tokenizer.bos_id] + t
        _check_context(r, len(t), limits.max_context, f"prompts[{i}]", "tokens_to_generate")
        ids.append(t)
    return ParsedRequest(prompts=ids, prompt_texts=list(prompts), requests=requests, no_log=_bool(body, "no_log"))


# ---------------------------------------------------------------------------------------- OpenAI
COMMON_OPENAI = {"model", "max_tokens", "temperature", "top_p", "top_k", "stop", "seed", "n", "stream",
                 "stream_options", "user", "jf", "logprobs", "presence_penalty", "frequency_penalty", "logit_bias"}
COMPLETION_FIELDS = COMMON_OPENAI | {"prompt", "echo", "best_of", "suffix"}
CHAT_FIELDS = COMMON_OPENAI | {"messages", "max_completion_tokens", "top_logprobs"}


def _openai_common(body, model_name: str, default: DecodeConfig, limits: Limits):
    m = body.get("model")
    if m is not None and m != model_name:
        raise RequestError("model", f"unknown model {m!r}; this server serves {model_name!r}", status=404)
    if not (body.get("user") is None or isinstance(body.get("user"), str)):
        raise _type_error("user", "a string", body.get("user"))
    n = _int(body, "n", 1)
    if n != 1:
        raise RequestError("n", f"only n=1 is supported, got {n}")
    lp = body.get("logprobs")
    if lp not in (None, False, 0):
        raise RequestError("logprobs", "log-probabilities are not supported by this server")
    for k in ("presence_penalty", "frequency_penalty"):
        if _float(body, k, 0.0) != 0.0:
            raise RequestError(k, "penalties are not supported by this server (must be 0)")
    if body.get("logit_bias") not in (None, {}):
        raise RequestError("logit_bias", "is not supported by this server")
    temperature = _float(body, "temperature", 1.0)
    if not 0.0 <= temperature <= 2.0:
        raise RequestError("temperature", f"must be in [0, 2] (0 = greedy), got {temperature}")
    top_p = _float(body, "top_p", 1.0)
    top_k = _int(body, "top_k", 0)
    if top_k == -1:  # vLLM's spelling of "off"
        top_k = 0
    seed = _int(body, "seed", None, lo=0, hi=2**31 - 1)
    sampling = _sampling(temperature, top_k, top_p, 0 if seed is None else seed)
    stream = _bool(body, "stream")
    so = body.get("stream_options")
    include_usage = False
    if so is not None:
        if not stream:
            raise RequestError("stream_options", "is only allowed with stream=true")
        if not isinstance(so, dict):
            raise _type_error("stream_options", "an object", so)
        _check_unknown({f"stream_options.{k}": v for k, v in so.items()}, {"stream_options.include_usage"})
        include_usage = _bool(so, "include_usage", field="stream_options.include_usage")
    stop = _stop_list(body.get("stop"), max_n=limits.max_stop, max_chars=limits.max_stop_chars)
    config = parse_decode_config(body.get("jf"), default, limits)
    return dict(sampling=sampling, seeded=seed is not None, stream=stream, include_usage=include_usage,
                stop=stop, decode=config)


def _openai_request(c: dict, ids: list[int], text: str, max_new_tokens: int, eos_ids: frozenset, limits: Limits,
                    prompt_field: str, max_field: str) -> ParsedRequest:
    """The :class:`ParsedRequest` of an OpenAI endpoint's one prompt (``c``: :func:`_openai_common`)."""
    (request,) = _requests(1, decode=c["decode"], sampling=c["sampling"], seeded=c["seeded"],
                           max_new_tokens=max_new_tokens, stop=c["stop"], eos_ids=eos_ids)
    _check_context(request, len(ids), limits.max_context, prompt_field, max_field)
    return ParsedRequest(prompts=[ids], prompt_texts=[text], requests=[request], stream=c["stream"],
                         include_usage=c["include_usage"])


def parse_completion(body, tokenizer, limits: Limits, model_name: str, default: DecodeConfig,
                     eos_ids: frozenset = frozenset()) -> ParsedRequest:
    """``POST /v1/completions`` body -> :class:`ParsedRequest`. ``prompt``: a string, a list with one
    string, or a list of token ids. ``max_tokens`` default 16 (as OpenAI). ``eos_ids``: the server's stop ids.

    Raises:
        RequestError: naming the offending field.
    """
    if not isinstance(body, dict):
        raise _type_error("body", "a JSON object", body)
    _check_unknown(body, COMPLETION_FIELDS)
    if "prompt" not in body or body["prompt"] is None:
        raise RequestError("prompt", "is required")
    if _bool(body, "echo"):
        raise RequestError("echo", "is not supported by this server")
    if _int(body, "best_of", 1) != 1:
        raise RequestError("best_of", "only best_of=1 is supported")
    if body.get("suffix") not in (None, ""):
        raise RequestError("suffix", "is not supported by this server")
    c = _openai_common(body, model_name, default, limits)
    p = body["prompt"]
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
        p = p[0]
    if isinstance(p, list) and len(p) > limits.max_context:
        raise RequestError("prompt", f"the prompt has {len(p)} tokens; the context window is "
                                     f"{limits.max_context} tokens")
    if isinstance(p, str):
        _check_chars(p, limits, "prompt")
        text, ids = p, encode_bounded(tokenizer, p, limits, "prompt")
    elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        if any(t < 0 or t >= tokenizer.vocab_size for t in p):
            raise RequestError("prompt", f"token ids must be in [0, {tokenizer.vocab_size})")
        ids, text = list(p), tokenizer.decode(p)
    elif isinstance(p, list) and len(p) > 1 and all(isinstance(t, str) for t in p):
        raise RequestError("prompt", "only one prompt per request is supported")
    else:
        raise _type_error("prompt", "a string or a list of token ids", p)
    max_new_tokens = _int(body, "max_tokens", 16, lo=1)
    return _openai_request(c, ids, text, max_new_tokens, eos_ids, limits, "prompt", "max_tokens")


def parse_chat(body, tokenizer, limits: Limits, model_name: str, default: DecodeConfig,
               eos_ids: frozenset = frozenset()) -> ParsedRequest:
    """``POST /v1/chat/completions`` body -> :class:`ParsedRequest` (the tokenizer's chat template is
    applied with a generation prompt). ``content`` is a string or a list of text parts
    (``[{"type": "text", "text": ...}]``, joined with newlines as vLLM does). ``max_tokens`` /
    ``max_completion_tokens`` default: the rest of the context window. ``eos_ids``: the server's stop ids.

    Raises:
        RequestError: naming the offending field.
    """
    if not isinstance(body, dict):
        raise _type_error("body", "a JSON object", body)
    _check_unknown(body, CHAT_FIELDS)
    if body.get("top_logprobs") is not None:
        raise RequestError("top_logprobs", "log-probabilities are not supported by this server")
    msgs = body.get("messages")
    if msgs is None:
        raise RequestError("messages", "is required")
    if not isinstance(msgs, list) or not msgs:
        raise RequestError("messages", "must be a non-empty list of {role, content} objects")
    contents = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or \
                not isinstance(m.get("content"), (str, list)):
            raise RequestError(f"messages[{i}]", "must be an object with string 'role' and 'content' (a string "
                                                 "or a list of text parts)")
        extra = set(m) - {"role", "content", "name"}
        if extra:
            raise RequestError(f"messages[{i}].{sorted(extra)[0]}", "unsupported message field")
        contents.append(_content(m["content"], f"messages[{i}].content"))
    c = _openai_common(body, model_name, default, limits)
    _check_chars("".join(contents), limits, "messages")
    try:
        text = tokenizer.apply_chat_template([{"role": m["role"], "content": t} for m, t in zip(msgs, contents)])
    except ValueError as e:
        raise RequestError("messages", str(e)) from None
    _check_chars(text, limits, "messages")
    ids = encode_bounded(tokenizer, text, limits, "messages")
    if "max_tokens" in body and "max_completion_tokens" in body:
        raise RequestError("max_completion_tokens", "give max_tokens or max_completion_tokens, not both")
    key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    max_new_tokens = _int(body, key, None, lo=1)
    if max_new_tokens is None:  # the rest of the window (a prompt that fills it is refused by the check)
        max_new_tokens = max(1, limits.max_context - len(ids))
    return _openai_request(c, ids, text, max_new_tokens, eos_ids, limits, "messages", key)


def _content(v, field: str) -> str:
    """A message's ``content``: a string, or a list of ``{"type": "text", "text": str}`` parts."""
    if isinstance(v, str):
        return v
    parts = []
    for j, part in enumerate(v):
        f = f"{field}[{j}]"
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise RequestError(f, f"only text content parts are supported, got {kind!r}")
        if set(part) - {"type", "text"}:
            raise RequestError(f"{f}.{sorted(set(part) - {'type', 'text'})[0]}", "unsupported content part field")
        if not isinstance(part.get("text"), str):
            raise _type_error(f"{f}.text", "a string", part.get("text"))
        parts.append(part["text"])
    return "\n".join(parts)
