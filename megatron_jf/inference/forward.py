"""The inference forward: full-vocabulary logits of a :class:`~megatron_jf.models.gpt.JFGPTModel`, optionally
through a :class:`~megatron_jf.models.kv_cache.KVCache`, by one of three implementations over the same parameters:
the lean forward (:mod:`~megatron_jf.inference.lean_forward`), its static-shape / CUDA-graph decode path
(:mod:`~megatron_jf.inference.static_decode`), or megatron-core's own forward.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state as ps

from megatron_jf.inference import options
from megatron_jf.inference.lean_forward import LeanForward, lean_forward_for
from megatron_jf.inference.static_decode import static_decoder_for
from megatron_jf.models.gpt import attach_kv_cache, unwrap
from megatron_jf.models.kv_cache import KVCache


@torch.no_grad()
def forward_logits(model, tokens: torch.Tensor, position_ids: torch.Tensor, *,
                   allowed: torch.Tensor | None = None, kv_cache: KVCache | None = None,
                   new_mask: torch.Tensor | None = None, return_logits: bool = True,
                   impl: str = "auto", slots: torch.Tensor | None = None,
                   region: int | None = None, static=None) -> torch.Tensor | None:
    """One inference forward; returns full-vocabulary logits (gathered over TP).

    Runs :class:`~megatron_jf.inference.lean_forward.LeanForward` (plain tensor ops over the same
    parameters) when the model is the local layer spec and ``MEGATRON_JF_LEAN_FORWARD`` is not ``0``,
    else megatron-core's forward; both compute the same function (tests/test_lean_forward.py).

    Args:
        tokens: int64 ``[b, s]``.
        position_ids: int64 ``[b, s]`` RoPE positions.
        allowed: optional bool ``[b|1, s, s]`` or ``[s, s]``, True where query i may attend key j
            (no cache). Default: causal.
        kv_cache: optional cache; the tokens are appended after each row's committed length
            (see :class:`KVCache`), and stay uncommitted until ``kv_cache.commit``.
        new_mask: with a cache, bool ``[b|1, s, s]`` visibility among the new tokens (default causal).
        return_logits: False (a prefill whose logits nobody reads) skips the output layer where the
            forward allows it and returns None.
        impl: ``auto`` (lean forward when supported; on CUDA, cached decode forwards take the static-shape
            CUDA-graph path of :mod:`megatron_jf.inference.static_decode`), ``lean`` (required), ``static``
            (lean + the static-shape path, eager off CUDA; for tests) or ``megatron``.
        slots, region: with a cache, a second pass over part of the current block (MR verification of
            recycled candidates, :mod:`megatron_jf.inference.mr_verify`): the tokens go to slots
            ``lengths + slots[i]`` of a block of ``region`` new slots, part of which an earlier forward since
            the last commit wrote; ``new_mask`` is then bool ``[b|1, s, region]`` over the whole block
            (see ``KVCache.begin``). Always the eager lean/megatron forward.
        static: the :class:`~megatron_jf.inference.static_decode.StaticDecoder` of ``kv_cache`` when the static
            path runs (the engine's runner passes the one it owns); None: the one kept on the cache
            (:func:`~megatron_jf.inference.static_decode.static_decoder_for`).

    Returns:
        float32 logits ``[b, s, vocab]`` (vocabulary padding removed), or None with
        ``return_logits=False``. Requires a single pipeline stage (decoding with PP > 1 is not supported).

    Raises:
        ValueError: shape mismatch between tokens and positions, PP > 1, an unknown ``impl``,
            ``impl="lean"`` on a model the lean forward does not support, or ``slots`` without a cache
            (bad slots or masks: see ``KVCache.begin``).
    """
    if tokens.shape != position_ids.shape or tokens.dim() != 2:
        raise ValueError(f"tokens {tuple(tokens.shape)} and position_ids {tuple(position_ids.shape)} must both be [b, s]")
    if ps.get_pipeline_model_parallel_world_size() > 1:
        raise ValueError("forward_logits needs pipeline-parallel size 1 (decoding does not pipeline)")
    options.check_forward(impl)
    m = unwrap(model)
    dev = m.embedding.word_embeddings.weight.device if m.pre_process else next(m.parameters()).device
    tokens, position_ids = tokens.to(dev), position_ids.to(dev)
    if slots is not None:
        if kv_cache is None:
            raise ValueError("forward_logits(slots=...) needs a KV cache")
        return _forward(m, tokens, position_ids, None, kv_cache,
                        dict(num_new=tokens.shape[1], new_mask=new_mask, slots=slots, region=region), return_logits, impl,
                        None)
    mask = None
    if kv_cache is None and allowed is not None:
        a = allowed if allowed.dim() == 3 else allowed.unsqueeze(0)
        mask = (~a.to(dev)).unsqueeze(1)
    return _forward(m, tokens, position_ids, mask, kv_cache, dict(num_new=tokens.shape[1], new_mask=new_mask),
                    return_logits, impl, static)


def _forward(m, tokens, position_ids, mask, kv_cache, begin_kw, return_logits, impl, static):
    lean = None
    if impl != "megatron":
        lean = lean_forward_for(m) if impl == "auto" else (getattr(m, "_jf_lean_forward", None) or LeanForward(m))
        if lean is not None and impl != "auto":
            m._jf_lean_forward = lean
    if lean is not None and kv_cache is not None and return_logits and "slots" not in begin_kw:
        if impl == "static" or (impl == "auto" and options.static_decode_on(tokens.device)):
            # fixed-shape forward over the whole preallocated cache (CUDA graphs per block size on GPU)
            dec = static if static is not None else static_decoder_for(lean, kv_cache)
            out = dec.forward(tokens, position_ids, begin_kw.get("new_mask"))
            if out is not None:
                return out[..., : m.vocab_size_unpadded].float()
    if lean is not None:
        if kv_cache is not None:
            kv_cache.begin(causal_kernel=True, **begin_kw)
            try:
                logits = lean(tokens, position_ids, kv_cache=kv_cache, return_logits=return_logits)
            finally:
                kv_cache.end()
        else:
            logits = lean(tokens, position_ids, mask=mask, return_logits=return_logits)
        return None if logits is None else logits[..., : m.vocab_size_unpadded].float()
    if kv_cache is not None:
        kv_cache.begin(**begin_kw)
        try:
            with attach_kv_cache(m, kv_cache):
                logits = m(tokens, position_ids, None, runtime_gather_output=True)
        finally:
            kv_cache.end()
    else:
        logits = m(tokens, position_ids, mask, runtime_gather_output=True)
    if not return_logits:
        return None
    return logits[..., : m.vocab_size_unpadded].float()

