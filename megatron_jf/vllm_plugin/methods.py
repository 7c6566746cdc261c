"""The plugin's speculative methods as vLLM users spell them, and their translation to vLLM's ``custom_class``.

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
    request. vLLM verifies the whole draft (the engine's cost-based width choice is this project's engine's).

Optional keys (both methods unless noted), the fields of :class:`megatron_jf.decoding.DecodeConfig`:
``draft_init`` (``context`` | ``repeat``), and for ``mr`` ``num_blocks`` K (default 2), ``spawn_threshold`` r,
``ngram_pool_size``, ``verification_size`` (>= 2 lets a pool candidate be chosen), ``prompt_lookup_min`` /
``prompt_lookup_max`` (vLLM's n-gram names: the context n-grams' match lengths; ``prompt_lookup_max: 0`` turns them
off). Drafts are seeded by the request's ``SamplingParams.seed`` (0 when unset) and its prompt, as in this project's
engine.

Every other key goes to vLLM's ``SpeculativeConfig`` unchanged. Pure Python: no vLLM import here.
"""

from __future__ import annotations

from dataclasses import asdict

from megatron_jf.decoding import DecodeConfig

#: ``VllmConfig.additional_config`` key under which the decode config reaches every worker.
ADDITIONAL_CONFIG_KEY = "megatron_jf"
#: the proposer class vLLM's ``custom_class`` method loads in each worker.
PROPOSER_PATH = "megatron_jf.vllm_plugin.proposer.JacobiForcingProposer"
METHODS = ("jacobi", "mr")
_OPTIONS = {"jacobi": ("draft_init",),
            "mr": ("draft_init", "num_blocks", "spawn_threshold", "ngram_pool_size", "verification_size",
                   "prompt_lookup_min", "prompt_lookup_max")}


def decode_config(spec: dict) -> DecodeConfig:
    """The :class:`DecodeConfig` a ``{"method": "jacobi" | "mr", ...}`` speculative config asks for.

    Raises:
        ValueError: a missing or non-positive ``num_speculative_tokens``, an option the method does not take
            (named), ``num_speculative_tokens`` not a multiple of ``num_blocks`` (mr), or a value
            :class:`DecodeConfig` rejects.
    """
    method = spec["method"]
    k = spec.get("num_speculative_tokens")
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"speculative_config method {method!r} needs num_speculative_tokens >= 1, got {k!r}")
    opts = {key: spec[key] for key in _OPTIONS[method] if key in spec}
    other = sorted(set(spec) & (set(_OPTIONS["mr"]) - set(opts)))
    if other:
        raise ValueError(f"speculative_config method {method!r} does not take {', '.join(other)}")
    if method == "jacobi":
        return DecodeConfig("running-window", block_size=k, **opts)
    K = opts.pop("num_blocks", DecodeConfig.num_blocks)
    if not isinstance(K, int) or K < 1 or k % K:
        raise ValueError(f"speculative_config method 'mr': num_speculative_tokens ({k}) must be num_blocks ({K!r}) "
                         f"times the block size n")
    return DecodeConfig("mr", block_size=k // K, num_blocks=K, **opts)


def translate(spec: dict) -> tuple[dict, dict | None]:
    """Split a user's speculative config into vLLM's and the plugin's.

    Returns:
        ``(vllm_spec, ours)``: for ``method`` ``jacobi`` / ``mr``, vLLM's ``custom_class`` config with the
        plugin's proposer and ``ours`` = the decode config as a dict (for ``additional_config``); for any other
        method, ``(spec, None)`` unchanged.

    Raises:
        ValueError: see :func:`decode_config`.
    """
    method = spec.get("method")
    if method not in METHODS:
        return spec, None
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
