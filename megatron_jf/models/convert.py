"""Exact weight mapping between Hugging Face Qwen2/Llama state dicts and megatron-core ``GPTModel``.

Notation: ``nh`` heads, ``ng`` KV groups, ``hd`` head dim, ``qpg = nh // ng``, TP size ``t``, rank ``r``.

=========================================  ===========================================================
HF                                          megatron-core (this rank)
=========================================  ===========================================================
``model.embed_tokens.weight``               ``embedding.word_embeddings.weight``: vocab padded, rows split
``layers.i.input_layernorm.weight``         ``decoder.layers.i.input_layernorm.weight`` (replicated)
``q_proj/k_proj/v_proj .weight/.bias``      ``...linear_qkv.weight/.bias``: per query group ``[q_g; k_g; v_g]``,
                                            whole groups per rank (``ng % t == 0``)
``self_attn.o_proj.weight``                 ``...linear_proj.weight``: columns split
``post_attention_layernorm.weight``         ``decoder.layers.i.pre_mlp_layernorm.weight``
``mlp.gate_proj`` / ``mlp.up_proj``         ``...mlp.linear_fc1.weight = [gate_r; up_r]`` (gate first, per rank)
``mlp.down_proj.weight``                    ``...mlp.linear_fc2.weight``: columns split
``model.norm.weight``                       ``decoder.final_layernorm.weight``
``lm_head.weight`` (absent when tied)       ``output_layer.weight``: vocab padded, rows split
=========================================  ===========================================================

Layer ``i`` of pipeline stage ``p`` is HF layer ``p * L/pp + i``. The inverse mapping concatenates
the TP shards and drops vocabulary padding, so HF -> megatron -> HF is bit-exact.

Layer specs. The names above are the local spec's. Under the Transformer Engine spec the two norms of a
layer are fused into the following linear layer: ``input_layernorm.weight`` is
``self_attention.linear_qkv.layer_norm_weight`` and ``pre_mlp_layernorm.weight`` is
``mlp.linear_fc1.layer_norm_weight`` (the rename is megatron-core's own ``sharded_state_dict_keys_map`` of
the local spec, which also makes distributed checkpoints identical under both specs).
:func:`hf_to_mcore` emits either naming (``fused_norms``), :func:`mcore_to_hf` accepts both, and
:func:`uses_fused_norms` tells which one a model has. Fixture: ``tests/fixtures/te_spec_keys.json``.
"""

from __future__ import annotations

import functools

import torch

from megatron_jf.models.hf_config import ModelArgs


def _split_qkv_hf(args: ModelArgs, q, k, v):
    """Interleave q/k/v (weights ``[out, h]`` or biases ``[out]``) per query group: ``[ng, (qpg+2)*hd, ...]``."""
    ng, hd = args.num_kv_heads, args.head_dim
    qpg = args.num_heads // ng
    tail = q.shape[1:]
    return torch.cat([q.reshape(ng, qpg * hd, *tail), k.reshape(ng, hd, *tail), v.reshape(ng, hd, *tail)], dim=1)


def _pad_vocab(w: torch.Tensor, rows: int) -> torch.Tensor:
    if w.shape[0] == rows:
        return w
    return torch.cat([w, w.new_zeros(rows - w.shape[0], *w.shape[1:])], dim=0)


@functools.lru_cache(maxsize=1)
def fused_norm_keys_map() -> dict[str, str]:
    """Where the TE layer spec keeps each norm's parameters, per layer: ``{"input_layernorm.":
    "self_attention.linear_qkv.layer_norm_", "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}``,
    read from megatron-core's local spec (its ``sharded_state_dict_keys_map``)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return dict(get_gpt_layer_local_spec(normalization="RMSNorm").submodules.sharded_state_dict_keys_map)


def _rename_layer_keys(sd: dict, mapping: dict[str, str]) -> dict:
    out = {}
    for k, v in sd.items():
        if k.startswith("decoder.layers."):
            head, rest = k.split(".", 3)[:3], k.split(".", 3)[3]
            for src, dst in mapping.items():
                if rest.startswith(src):
                    k = ".".join(head + [dst + rest[len(src):]])
                    break
        out[k] = v
    return out


def to_fused_norm_names(sd: dict) -> dict:
    """Local-spec names -> TE-spec names (``...input_layernorm.weight`` -> ``...linear_qkv.layer_norm_weight``)."""
    return _rename_layer_keys(sd, fused_norm_keys_map())


def to_local_norm_names(sd: dict) -> dict:
    """TE-spec names -> local-spec names (inverse of :func:`to_fused_norm_names`; local names pass through)."""
    return _rename_layer_keys(sd, {v: k for k, v in fused_norm_keys_map().items()})


def uses_fused_norms(keys) -> bool:
    """Whether a model's state-dict ``keys`` use the TE spec's fused-norm names."""
    fused = tuple(v for v in fused_norm_keys_map().values())
    return any(k.startswith("decoder.layers.") and k.split(".", 3)[3].startswith(fused) for k in keys)


def hf_to_mcore(hf: dict[str, torch.Tensor], args: ModelArgs, *, tp_rank: int = 0, tp_size: int = 1,
                pp_rank: int = 0, pp_size: int = 1, pre_process: bool | None = None,
                post_process: bool | None = None, fused_norms: bool = False) -> dict[str, torch.Tensor]:
    """Map an HF state dict to the megatron-core state dict of one (TP, PP) rank.

    Args:
        hf: HF tensors by name (``model.*``, ``lm_head.weight`` unless tied).
        args: the architecture.
        tp_rank, tp_size, pp_rank, pp_size: the target rank.
        pre_process, post_process: whether this stage holds the embedding / output layer
            (default: first / last stage). With tied embeddings and PP > 1 the last stage holds
            ``output_layer.weight``, a copy of the embedding, as megatron-core expects.
        fused_norms: emit the TE layer spec's names for the norms (see the module docstring); pass
            ``uses_fused_norms(model.state_dict())`` to match a built model.

    Returns:
        megatron parameter names -> tensors (clones, contiguous).

    Raises:
        KeyError: a tensor the architecture needs is missing from ``hf`` (names it).
        ValueError: a tensor has the wrong shape (names it, with expected and actual shapes),
            or the TP/PP sizes do not divide the architecture.
    """
    args.validate_parallel(tp_size, pp_size)
    pre = pp_rank == 0 if pre_process is None else pre_process
    post = pp_rank == pp_size - 1 if post_process is None else post_process
    h, ffn = args.hidden_size, args.intermediate_size
    nh, ng, hd = args.num_heads, args.num_kv_heads, args.head_dim
    vocab_rows = args.padded_vocab_size(tp_size, divisible_by=1)
    t, r = tp_size, tp_rank

    def get(name, shape):
        if name not in hf:
            raise KeyError(f"HF checkpoint is missing tensor {name!r}")
        x = hf[name]
        if tuple(x.shape) != tuple(shape):
            raise ValueError(f"HF tensor {name!r} has shape {tuple(x.shape)}, expected {tuple(shape)} from config.json")
        return x

    out: dict[str, torch.Tensor] = {}
    emb = get("model.embed_tokens.weight", (args.vocab_size, h))
    if pre:
        out["embedding.word_embeddings.weight"] = _pad_vocab(emb, vocab_rows).chunk(t, 0)[r]
    per_stage = args.num_layers // pp_size
    for i in range(per_stage):
        g = pp_rank * per_stage + i
        p = f"model.layers.{g}."
        m = f"decoder.layers.{i}."
        q = get(p + "self_attn.q_proj.weight", (nh * hd, h))
        k = get(p + "self_attn.k_proj.weight", (ng * hd, h))
        v = get(p + "self_attn.v_proj.weight", (ng * hd, h))
        out[m + "self_attention.linear_qkv.weight"] = _split_qkv_hf(args, q, k, v).chunk(t, 0)[r].reshape(-1, h)
        if args.qkv_bias:
            qb = get(p + "self_attn.q_proj.bias", (nh * hd,))
            kb = get(p + "self_attn.k_proj.bias", (ng * hd,))
            vb = get(p + "self_attn.v_proj.bias", (ng * hd,))
            out[m + "self_attention.linear_qkv.bias"] = _split_qkv_hf(args, qb, kb, vb).chunk(t, 0)[r].reshape(-1)
        out[m + "self_attention.linear_proj.weight"] = get(p + "self_attn.o_proj.weight", (h, nh * hd)).chunk(t, 1)[r]
        out[m + "input_layernorm.weight"] = get(p + "input_layernorm.weight", (h,))
        out[m + "pre_mlp_layernorm.weight"] = get(p + "post_attention_layernorm.weight", (h,))
        gate = get(p + "mlp.gate_proj.weight", (ffn, h)).chunk(t, 0)[r]
        up = get(p + "mlp.up_proj.weight", (ffn, h)).chunk(t, 0)[r]
        out[m + "mlp.linear_fc1.weight"] = torch.cat([gate, up], 0)
        out[m + "mlp.linear_fc2.weight"] = get(p + "mlp.down_proj.weight", (h, ffn)).chunk(t, 1)[r]
    if post:
        out["decoder.final_layernorm.weight"] = get("model.norm.weight", (h,))
        if not args.tie_word_embeddings:
            out["output_layer.weight"] = _pad_vocab(get("lm_head.weight", (args.vocab_size, h)), vocab_rows).chunk(t, 0)[r]
        elif not pre:  # tied, last stage of several: megatron keeps a synchronised copy of the embedding
            out["output_layer.weight"] = _pad_vocab(emb, vocab_rows).chunk(t, 0)[r]
    if fused_norms:
        out = to_fused_norm_names(out)
    return {k: v.detach().clone().contiguous() for k, v in out.items()}


def mcore_to_hf(shards: list[list[dict[str, torch.Tensor]]], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Inverse of :func:`hf_to_mcore`: merge per-rank state dicts into one HF state dict.

    Args:
        shards: ``shards[pp_rank][tp_rank]`` = that rank's megatron state dict, local- or TE-spec names
            (non-parameter entries such as ``_extra_state`` are ignored).
        args: the architecture.

    Returns:
        HF tensors by name; ``lm_head.weight`` only when embeddings are untied.

    Raises:
        KeyError: a megatron tensor is missing (names it and the rank).
    """
    shards = [[to_local_norm_names(sd) for sd in row] for row in shards]
    pp_size, tp_size = len(shards), len(shards[0])
    h = args.hidden_size
    nh, ng, hd = args.num_heads, args.num_kv_heads, args.head_dim
    qpg = nh // ng
    per_stage = args.num_layers // pp_size

    def cat(pp, name, dim, rank=0):
        """TP shards of ``name`` concatenated along ``dim``, or rank ``rank``'s copy when ``dim`` is None."""
        try:
            if dim is None:
                return shards[pp][rank][name]
            return torch.cat([shards[pp][r][name] for r in range(tp_size)], dim=dim)
        except KeyError:
            raise KeyError(f"megatron checkpoint is missing tensor {name!r} on pipeline stage {pp}") from None

    hf: dict[str, torch.Tensor] = {}
    hf["model.embed_tokens.weight"] = cat(0, "embedding.word_embeddings.weight", 0)[: args.vocab_size]
    for pp in range(pp_size):
        for i in range(per_stage):
            g = pp * per_stage + i
            p = f"model.layers.{g}."
            m = f"decoder.layers.{i}."
            qkv = cat(pp, m + "self_attention.linear_qkv.weight", 0).reshape(ng, (qpg + 2) * hd, h)
            hf[p + "self_attn.q_proj.weight"] = qkv[:, : qpg * hd].reshape(nh * hd, h)
            hf[p + "self_attn.k_proj.weight"] = qkv[:, qpg * hd: (qpg + 1) * hd].reshape(ng * hd, h)
            hf[p + "self_attn.v_proj.weight"] = qkv[:, (qpg + 1) * hd:].reshape(ng * hd, h)
            if args.qkv_bias:
                b = cat(pp, m + "self_attention.linear_qkv.bias", 0).reshape(ng, (qpg + 2) * hd)
                hf[p + "self_attn.q_proj.bias"] = b[:, : qpg * hd].reshape(-1)
                hf[p + "self_attn.k_proj.bias"] = b[:, qpg * hd: (qpg + 1) * hd].reshape(-1)
                hf[p + "self_attn.v_proj.bias"] = b[:, (qpg + 1) * hd:].reshape(-1)
            hf[p + "self_attn.o_proj.weight"] = cat(pp, m + "self_attention.linear_proj.weight", 1)
            hf[p + "input_layernorm.weight"] = cat(pp, m + "input_layernorm.weight", None)
            hf[p + "post_attention_layernorm.weight"] = cat(pp, m + "pre_mlp_layernorm.weight", None)
            fc1 = [cat(pp, m + "mlp.linear_fc1.weight", None, r) for r in range(tp_size)]
            hf[p + "mlp.gate_proj.weight"] = torch.cat([x.chunk(2, 0)[0] for x in fc1], 0)
            hf[p + "mlp.up_proj.weight"] = torch.cat([x.chunk(2, 0)[1] for x in fc1], 0)
            hf[p + "mlp.down_proj.weight"] = cat(pp, m + "mlp.linear_fc2.weight", 1)
    last = pp_size - 1
    hf["model.norm.weight"] = cat(last, "decoder.final_layernorm.weight", None)
    if not args.tie_word_embeddings:
        hf["lm_head.weight"] = cat(last, "output_layer.weight", 0)[: args.vocab_size]
    return {k: v.detach().clone().contiguous() for k, v in hf.items()}
