"""The plugin's speculative methods as vLLM users spell them, their translation to vLLM's ``custom_class``, and the
per-request options.

``speculative_config`` (``vllm.LLM(speculative_config=...)``, ``vllm serve --speculative-config '{...}'``):

``{"method": "jacobi", "num_speculative_tokens": n}``
    Running-window Jacobi decoding (paper Sec. 2.1, 4.3): every step drafts ``n`` tokens, the target's own
    predictions past the accepted prefix (the Jacobi update) refilled with fresh tokens
    (:class:`megatron_jf.decoding.RunningWindowPolicy`, ``block_size = n``).
``{"method": "mr", "num_speculative_tokens": K*n, "num_blocks": K}``
    Multi-block decoding with rejection recycling (paper Sec. 3.2, Algorithm 1) on vLLM's linear verification:
    up to ``K`` blocks of ``n`` drafted back to back as one draft of at most ``K*n`` tokens, led by the pool's best
    candidate -- a recycled n-gram or a context n-gram (prompt lookup: what followed earlier occurrences of the
    newest tokens in the prompt and output) -- where the request's acceptance so far expects it to accept more
    than the Jacobi draft (:class:`megatron_jf.decoding.MRPolicy` with ``linear=True``); the pool persists per
    request.

``num_speculative_tokens`` is 1 to :data:`MAX_SPEC_LEN` (vLLM's cap). Optional keys (both methods unless noted), the
fields of :class:`megatron_jf.decoding.DecodeConfig`: ``draft_init`` (``context`` | ``repeat``), ``draft_width``
(``auto``, the default: each step's drafts cut to the width that pays on vLLM's steps as the proposer times them,
:mod:`megatron_jf.vllm_plugin.proposer`; ``fixed``: the whole draft every step), and for ``mr``
``num_blocks`` K (default 2), ``spawn_threshold`` r, ``ngram_pool_size``, ``verification_size`` (>= 2 lets a pool
candidate be chosen), ``prompt_lookup_min`` / ``prompt_lookup_max`` (vLLM's n-gram names: the context n-grams'
match lengths; ``prompt_lookup_max: 0`` turns them off). Drafts are seeded by the request's ``SamplingParams.seed`` (0 when unset) and its prompt, as
in this project's engine. Method names are case-insensitive and keys may use ``-`` for ``_`` (as vLLM's own keys);
a bad value, an unknown key or a near-miss of a method name is refused with one line naming the key, the allowed
values and the value given.

Every other key goes to vLLM's ``SpeculativeConfig`` unchanged.

Per request (:func:`request_block_size`), ``SamplingParams.extra_args`` (the OpenAI server's ``vllm_xargs``):
``{"jf_draft": false}`` turns drafting off for that request (plain AR steps), ``{"jf_block_size": b}`` drafts
blocks of ``b`` tokens, 1 to the engine's block size ``n``.

Pure Python: no vLLM import here.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import asdict

from megatron_jf.decoding import DecodeConfig

#: ``VllmConfig.additional_config`` key under which the decode config reaches every worker.
ADDITIONAL_CONFIG_KEY = "megatron_jf"
#: the proposer class vLLM's ``custom_class`` method loads in each worker.
PROPOSER_PATH = "megatron_jf.vllm_plugin.proposer.JacobiForcingProposer"
METHODS = ("jacobi", "mr")
#: vLLM's cap on the draft tokens it verifies per request and step (``MAX_SPEC_LEN`` of
#: ``vllm/v1/sample/rejection_sampler.py``; the plugin checks it against the installed vLLM when it loads).
MAX_SPEC_LEN = 128
_OPTIONS = {"jacobi": ("draft_init", "draft_width"),
            "mr": ("draft_init", "draft_width", "num_blocks", "spawn_threshold", "ngram_pool_size", "verification_size",
                   "prompt_lookup_min", "prompt_lookup_max")}
#: each option's allowed values as errors state them (the range checks themselves are DecodeConfig's)
_ALLOWED = {"draft_init": "'context' or 'repeat'", "draft_width": "'auto' or 'fixed'",
            "num_blocks": "an integer >= 1 dividing num_speculative_tokens",
            "spawn_threshold": "a number in (0, 1]", "ngram_pool_size": "an integer >= 1",
            "verification_size": "an integer >= 1", "prompt_lookup_min": "an integer >= 1",
            "prompt_lookup_max": "an integer >= 0 (0: off)"}
_TYPES = {f.name: f.type for f in dataclasses.fields(DecodeConfig)}  # "int" / "float" / "str"
#: ``SamplingParams.extra_args`` keys of one request (see :func:`request_block_size`)
REQUEST_OPTIONS = ("jf_draft", "jf_block_size")


def _nearest(word: str, choices) -> str:
    near = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.75)
    return f" (did you mean {near[0]!r}?)" if near else ""


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_option(method: str, key: str, v) -> None:
    want = _TYPES[key]
    ok = isinstance(v, str) if want == "str" else _is_int(v) or (want == "float" and isinstance(v, float))
    if ok:
        try:
            # DecodeConfig's own check of this field's range (the prompt-lookup pair alone: min <= max is
            # checked with both below)
            pair = ({"prompt_lookup_max": max(v, 1)} if key == "prompt_lookup_min" else
                    {"prompt_lookup_min": 1} if key == "prompt_lookup_max" else {})
            DecodeConfig(**{key: v, **pair})
        except ValueError:
            ok = False
    if not ok:
        raise ValueError(f"speculative_config method {method!r}: {key} must be {_ALLOWED[key]}, got {v!r}")


def decode_config(spec: dict) -> DecodeConfig:
    """The :class:`DecodeConfig` a ``{"method": "jacobi" | "mr", ...}`` speculative config asks for (method name and
    keys as :func:`translate` normalises them).

    Raises:
        ValueError: one line naming the key, its allowed values and the value given: ``num_speculative_tokens``
            missing or outside 1..:data:`MAX_SPEC_LEN`, an option the method does not take, an option of the wrong
            type or out of range, ``num_speculative_tokens`` not a multiple of ``num_blocks`` (mr).
    """
    method = spec["method"]
    k = spec.get("num_speculative_tokens")
    if not _is_int(k) or not 1 <= k <= MAX_SPEC_LEN:
        raise ValueError(f"speculative_config method {method!r}: num_speculative_tokens must be an integer in "
                         f"1..{MAX_SPEC_LEN} (vLLM's MAX_SPEC_LEN), got {k!r}")
    opts = {key: spec[key] for key in _OPTIONS[method] if key in spec}
    other = sorted(set(spec) & (set(_OPTIONS["mr"]) - set(opts)))
    if other:
        raise ValueError(f"speculative_config method {method!r} does not take {', '.join(other)} (its options: "
                         f"{', '.join(_OPTIONS[method])})")
    for key, v in opts.items():
        _check_option(method, key, v)
    if method == "jacobi":
        return DecodeConfig("running-window", block_size=k, **opts)
    K = opts.pop("num_blocks", DecodeConfig.num_blocks)
    if k % K:
        raise ValueError(f"speculative_config method 'mr': num_blocks must be {_ALLOWED['num_blocks']} ({k}), "
                         f"got {K!r}")
    try:
        return DecodeConfig("mr", block_size=k // K, num_blocks=K, **opts)
    except ValueError as e:  # options valid alone but not together (prompt_lookup_min > prompt_lookup_max)
        raise ValueError(f"speculative_config method 'mr': {e}") from None


def plugin_method(method) -> str | None:
    """``"jacobi"`` / ``"mr"`` when ``method`` names one of the plugin's methods (any capitalisation, surrounding
    spaces), else None."""
    if not isinstance(method, str):
        return None
    name = method.strip().lower()
    return name if name in METHODS else None


def translate(spec: dict, *, vllm_methods=(), vllm_keys=None) -> tuple[dict, dict | None]:
    """Split a user's speculative config into vLLM's and the plugin's.

    Args:
        spec: the ``speculative_config`` dict as given.
        vllm_methods: vLLM's own method names; a method close to ``jacobi`` / ``mr`` that is not one of them is
            refused as a misspelling.
        vllm_keys: ``SpeculativeConfig``'s keys; when given, any other key (beyond the plugin's) is refused for
            ``jacobi`` / ``mr``, with the nearest valid key.

    Returns:
        ``(vllm_spec, ours)``: for ``method`` ``jacobi`` / ``mr``, vLLM's ``custom_class`` config with the
        plugin's proposer and ``ours`` = the decode config as a dict (for ``additional_config``); for any other
        method, ``(spec, None)`` unchanged.

    Raises:
        ValueError: a near-miss of a method name, a draft ``model`` for a plugin method, an unknown key; see also
            :func:`decode_config`.
    """
    raw = spec.get("method")
    method = plugin_method(raw)
    if method is None:
        if isinstance(raw, str) and raw not in vllm_methods:
            hint = _nearest(raw.strip().lower(), METHODS)
            if hint:
                raise ValueError(f"speculative_config: unknown method {raw!r}{hint}; the megatron-jf plugin adds "
                                 f"{' and '.join(map(repr, METHODS))}")
        return spec, None
    spec = {key.replace("-", "_"): v for key, v in spec.items()}
    spec["method"] = method
    if spec.get("model") is not None:
        raise ValueError(f"speculative_config method {method!r} drafts without a model: remove 'model' "
                         f"(got {spec['model']!r})")
    if vllm_keys is not None:
        known = set(vllm_keys) | set(_OPTIONS["mr"])
        for key in spec:
            if key not in known:
                raise ValueError(f"speculative_config method {method!r}: unknown key {key!r}"
                                 f"{_nearest(key, list(_OPTIONS[method]) + sorted(vllm_keys))}")
    cfg = decode_config(spec)
    vllm_spec = {key: v for key, v in spec.items() if key not in _OPTIONS["mr"]}
    vllm_spec.update(method="custom_class", model=PROPOSER_PATH)
    return vllm_spec, dict(asdict(cfg), method=method)


def from_additional_config(additional: dict | None) -> tuple[str, DecodeConfig]:
    """``(method, DecodeConfig)`` back from ``VllmConfig.additional_config`` in a worker.

    Raises:
        RuntimeError: the plugin's entry is missing (the proposer was named directly as a ``custom_class``
            model instead of through ``method: jacobi | mr``, or the front end ran without the plugin).
    """
    entry = (additional or {}).get(ADDITIONAL_CONFIG_KEY)
    if not entry:
        raise RuntimeError(f"{PROPOSER_PATH} needs speculative_config method 'jacobi' or 'mr' (with the megatron-jf "
                           f"plugin loaded in the front end), not method 'custom_class'")
    entry = dict(entry)
    method = entry.pop("method")
    return method, DecodeConfig(**entry)


def request_block_size(extra_args: dict | None, cfg: DecodeConfig) -> int:
    """The block size one request drafts with, from its ``SamplingParams.extra_args``.

    Args:
        extra_args: the request's ``extra_args`` (None or a dict; keys other than ``jf_*`` belong to others).
        cfg: the engine's decode config (its ``block_size`` n is the largest a request may ask for).

    Returns:
        0 when ``jf_draft`` is false (or 0): no drafting for this request; else ``jf_block_size`` when given
        (1..n), else n.

    Raises:
        ValueError: one line naming the key, its allowed values and the value: a ``jf_*`` key that is not one of
            :data:`REQUEST_OPTIONS`, ``jf_draft`` not a boolean (or 0 / 1), ``jf_block_size`` not an integer in
            1..n.
    """
    if not extra_args:
        return cfg.block_size
    for key in extra_args:
        if isinstance(key, str) and key.startswith("jf_") and key not in REQUEST_OPTIONS:
            raise ValueError(f"extra_args: unknown megatron-jf request option {key!r}{_nearest(key, REQUEST_OPTIONS)};"
                             f" the options are {', '.join(REQUEST_OPTIONS)}")
    draft = extra_args.get("jf_draft", True)
    if not (isinstance(draft, int) and draft in (0, 1)):
        raise ValueError(f"extra_args: jf_draft must be true or false (or 1 / 0), got {draft!r}")
    if not draft:
        return 0
    n = extra_args.get("jf_block_size", cfg.block_size)
    if not _is_int(n) or not 1 <= n <= cfg.block_size:
        raise ValueError(f"extra_args: jf_block_size must be an integer in 1..{cfg.block_size} (this engine's block "
                         f"size), got {n!r}")
    return n
