"""The model provider: a megatron-core ``GPTModel`` for Qwen2/Qwen2.5 and Llama, with RoPE by position id.

* :func:`build_model` turns :class:`~megatron_jf.models.hf_config.ModelArgs` into a
  :class:`JFGPTModel` for the current tensor/pipeline-parallel rank.
* :class:`JFGPTModel` fixes megatron-core's RoPE, which is computed for ``0..seq_len-1`` whatever
  ``position_ids`` say (upstream NVIDIA/Megatron-LM#453). Jacobi Forcing needs real positions:
  training packs noisy and clean copies of a block at the *same* positions (paper Sec. 3.1), and
  decoding forwards a block at an offset after a KV cache. Here cos/sin are gathered per token from
  one cached table.
* :func:`forward_logits` is the inference-style call: gathered logits ``[b, s, vocab]`` sliced to the
  real vocabulary (TP padding removed), optionally through a KV cache.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megatron_jf import platform
from megatron_jf.models.hf_config import ModelArgs

platform.apply_cpu_shims()

from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402
from megatron.core.transformer.enums import AttnMaskType  # noqa: E402

from megatron_jf.models.attention import JFCoreAttention  # noqa: E402
from megatron_jf.models.kv_cache import KVCache  # noqa: E402
from megatron_jf.models.norm import RMSNorm  # noqa: E402


class JFGPTModel(GPTModel):
    """``GPTModel`` whose rotary embedding honours explicit ``position_ids`` ``[b, s]`` (int64).

    The cos/sin table for positions ``0..max_pos`` is computed once and grown on demand; each token
    gathers its own row, giving RoPE frequencies ``[s, b, 1, d]`` that megatron's unfused
    ``apply_rotary_pos_emb`` broadcasts over heads.
    """

    vocab_size_unpadded: int = 0

    def _preprocess(self, input_ids, position_ids, decoder_input=None, inference_context=None,
                    packed_seq_params=None, padding_mask=None):
        out = super()._preprocess(input_ids, position_ids, decoder_input=decoder_input,
                                  inference_context=inference_context, packed_seq_params=packed_seq_params,
                                  padding_mask=padding_mask)
        if position_ids is None or out[1] is None:
            return out
        needed = int(position_ids.max()) + 1
        table = getattr(self, "_rope_table", None)
        if table is None or table.shape[0] < needed:
            size = max(needed, 2 * (table.shape[0] if table is not None else 0), 256)
            table = self.rotary_pos_emb(size)[:, 0, 0, :]  # [size, d]
            self._rope_table = table
        rope = table[position_ids].transpose(0, 1).unsqueeze(2)  # [s, b, 1, d]
        return (out[0], rope) + tuple(out[2:])


TRANSFORMER_IMPLS = ("auto", "local", "transformer_engine")


def layer_spec(args: ModelArgs, transformer_impl: str = "auto"):
    """The transformer-layer ``ModuleSpec``: megatron's local spec with our :class:`~megatron_jf.models.norm.RMSNorm`,
    or megatron's Transformer Engine spec (fused norm + projections), with our core attention in either.

    Args:
        transformer_impl: ``local``, ``transformer_engine`` or ``auto`` (TE when it and CUDA are present), as
            Megatron-LM's ``--transformer-impl``.

    Raises:
        ValueError: an unknown impl, or ``transformer_engine`` without TE and CUDA.
    """
    if transformer_impl not in TRANSFORMER_IMPLS:
        raise ValueError(f"unknown transformer impl {transformer_impl!r}; choose one of {', '.join(TRANSFORMER_IMPLS)}")
    have_te = platform.HAVE_TE and platform.HAVE_CUDA
    if transformer_impl == "transformer_engine" and not have_te:
        raise ValueError("transformer_impl='transformer_engine' needs Transformer Engine and a CUDA device")
    if have_te and transformer_impl != "local":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        spec = get_gpt_layer_with_transformer_engine_spec()
    else:
        spec = get_gpt_layer_local_spec(normalization="RMSNorm")
        spec.submodules.input_layernorm = RMSNorm  # not megatron's pick by what is installed (models/norm.py)
        spec.submodules.pre_mlp_layernorm = RMSNorm
    spec.submodules.self_attention.submodules.core_attention = JFCoreAttention
    spec.submodules.self_attention.params["attn_mask_type"] = AttnMaskType.arbitrary
    return spec


def is_local_spec(spec) -> bool:
    """True for :func:`layer_spec`'s local spec (its norms are :class:`~megatron_jf.models.norm.RMSNorm`)."""
    return spec.submodules.input_layernorm is RMSNorm


def block_spec(config: TransformerConfig, spec):
    """What ``GPTModel`` gets as its ``transformer_layer_spec``: the TE layer spec as it is (megatron adds ``TENorm``
    as the final norm), or for the local spec a ``TransformerBlockSubmodules`` of this stage's layers whose final norm
    is :class:`~megatron_jf.models.norm.RMSNorm` -- given a bare layer spec, megatron-core would pick the final norm by
    what is installed (``TENorm`` with TE, apex's LayerNorm-only ``FusedLayerNorm`` with apex), so the lean inference
    forward and sequence parallelism would not get the local norm on GPU machines."""
    if not is_local_spec(spec):
        return spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    return TransformerBlockSubmodules(layer_specs=[spec] * get_num_layers_to_build(config), layer_norm=RMSNorm)


def inference_transformer_impl() -> str:
    """The layer spec inference tools build (:func:`megatron_jf.checkpointing.load_model`): ``local`` while the lean
    inference forward is on (``MEGATRON_JF_LEAN_FORWARD``, default on), since decoding runs that forward -- and on
    CUDA its static-shape / CUDA-graph path -- over the local spec's parameters, also where Transformer Engine is
    installed (checkpoints load across specs); ``auto`` when it is off (megatron's forward, TE where present)."""
    from megatron_jf.inference.lean_forward import enabled_by_env

    return "local" if enabled_by_env() else "auto"


def transformer_config(args: ModelArgs, *, params_dtype: torch.dtype | None = None,
                       sequence_parallel: bool = False, recompute: dict | None = None) -> TransformerConfig:
    """megatron-core ``TransformerConfig`` for ``args`` on the current TP/PP group.

    ``recompute``: activation-recomputation fields passed through to ``TransformerConfig``
    (``recompute_granularity``, ``recompute_method``, ``recompute_num_layers``, ``recompute_modules``;
    see :meth:`megatron_jf.training.config.TrainConfig.recompute_kwargs`). None: no recomputation.

    Fusions that need CUDA kernels are enabled only on GPU. Weights are initialised on CPU and then
    split, so TP shards are cut from one master weight (TP=2 equals TP=1 up to rounding).
    """
    tp = ps.get_tensor_model_parallel_world_size()
    pp = ps.get_pipeline_model_parallel_world_size()
    args.validate_parallel(tp, pp)
    dtype = params_dtype or platform.default_dtype()
    gpu = platform.HAVE_CUDA
    return TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.intermediate_size,
        num_attention_heads=args.num_heads,
        num_query_groups=args.num_kv_heads,
        kv_channels=args.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=args.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=args.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        sequence_parallel=sequence_parallel and tp > 1,
        pipeline_dtype=dtype,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=True,
        init_method_std=0.02,
        masked_softmax_fusion=False,
        bias_activation_fusion=gpu,
        bias_dropout_fusion=gpu,
        apply_rope_fusion=False,  # fused RoPE expects [s,1,1,d] freqs; ours are per token
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        **(recompute or {}),
    )


def build_model(args: ModelArgs, *, params_dtype: torch.dtype | None = None, sequence_parallel: bool = False,
                device: torch.device | None = None, recompute: dict | None = None,
                transformer_impl: str = "auto") -> JFGPTModel:
    """Build this rank's part of the model (megatron-core model provider).

    Requires :func:`megatron_jf.parallel.initialize` to have run. The vocabulary is padded to a
    multiple of the TP size; :func:`forward_logits` slices the padding off. ``transformer_impl``: the layer
    spec (see :func:`layer_spec`).

    Returns:
        :class:`JFGPTModel` on ``device`` (default: the platform default) in ``params_dtype``.

    Raises:
        ValueError: the architecture does not split over the TP/PP sizes, or a bad ``transformer_impl``.
    """
    tp = ps.get_tensor_model_parallel_world_size()
    config = transformer_config(args, params_dtype=params_dtype, sequence_parallel=sequence_parallel,
                                recompute=recompute)
    model = JFGPTModel(
        config=config,
        transformer_layer_spec=block_spec(config, layer_spec(args, transformer_impl)),
        vocab_size=args.padded_vocab_size(tp, divisible_by=1),
        max_sequence_length=args.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=args.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=int(args.rope_theta) if float(args.rope_theta).is_integer() else args.rope_theta,
    )
    finish_model(model, args)
    return model.to(device or platform.default_device())


def set_params_dtype(model, dtype: torch.dtype):
    """Cast ``model``'s parameters to ``dtype`` and make its ``TransformerConfig`` say so: ``params_dtype``, ``bf16`` /
    ``fp16`` and ``pipeline_dtype`` -- the dtype megatron's pipeline schedules allocate their receive buffers in, so a
    model built in bf16 (the GPU default) and trained in fp32 (``--precision fp32``, the torch AdamW path) at PP > 1
    would otherwise receive fp32 activations into bf16 buffers. Returns the model (cast in place, as ``Module.to``)."""
    if any(p.dtype != dtype for p in model.parameters()):
        model = model.to(dtype)
    cfg = unwrap(model).config
    cfg.params_dtype = cfg.pipeline_dtype = dtype
    cfg.bf16, cfg.fp16 = dtype == torch.bfloat16, dtype == torch.float16
    return model


def finish_model(model, args: ModelArgs) -> None:
    """Attach what the engine and tools read to a freshly built ``JFGPTModel`` (in place).

    Sets ``model.vocab_size_unpadded`` and ``model.model_args``, numbers this stage's core attentions
    ``cache_slot = 0, 1, ...`` (their layer index in a :class:`~megatron_jf.models.kv_cache.KVCache`) and
    ``model.num_local_layers``. Raises nothing.
    """
    model.vocab_size_unpadded = args.vocab_size
    model.model_args = args
    slot = 0
    for m in model.modules():
        if isinstance(m, JFCoreAttention):
            m.cache_slot = slot
            slot += 1
    model.num_local_layers = slot


def unwrap(model):
    """The :class:`JFGPTModel` inside DDP/Float16 wrappers."""
    while not isinstance(model, JFGPTModel) and hasattr(model, "module"):
        model = model.module
    return model


def new_kv_cache(model, batch_size: int, max_len: int) -> KVCache:
    """A :class:`KVCache` sized for ``model`` on this rank (local layers and local KV heads)."""
    m = unwrap(model)
    tp = ps.get_tensor_model_parallel_world_size()
    a = m.model_args
    p = next(m.parameters())
    return KVCache(m.num_local_layers, batch_size, max_len, a.num_kv_heads // tp, a.head_dim,
                   dtype=p.dtype, device=p.device)


@contextlib.contextmanager
def attach_kv_cache(model, cache: KVCache | None):
    """Context manager: route every core attention of ``model`` through ``cache`` (None detaches)."""
    m = unwrap(model)
    mods = [x for x in m.modules() if isinstance(x, JFCoreAttention)]
    for x in mods:
        x.kv_cache = cache
    try:
        yield
    finally:
        for x in mods:
            x.kv_cache = None


@torch.no_grad()
def forward_logits(model, tokens: torch.Tensor, position_ids: torch.Tensor, *,
                   allowed: torch.Tensor | None = None, kv_cache: KVCache | None = None,
                   new_mask: torch.Tensor | None = None, return_logits: bool = True,
                   impl: str = "auto", slots: torch.Tensor | None = None,
                   region: int | None = None) -> torch.Tensor | None:
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
    if impl not in ("auto", "lean", "static", "megatron"):
        raise ValueError(f"unknown forward impl {impl!r}; choose auto, lean, static or megatron")
    m = unwrap(model)
    dev = m.embedding.word_embeddings.weight.device if m.pre_process else next(m.parameters()).device
    tokens, position_ids = tokens.to(dev), position_ids.to(dev)
    if slots is not None:
        if kv_cache is None:
            raise ValueError("forward_logits(slots=...) needs a KV cache")
        return _forward(m, tokens, position_ids, None, kv_cache,
                        dict(num_new=tokens.shape[1], new_mask=new_mask, slots=slots, region=region), return_logits, impl)
    mask = None
    if kv_cache is None and allowed is not None:
        a = allowed if allowed.dim() == 3 else allowed.unsqueeze(0)
        mask = (~a.to(dev)).unsqueeze(1)
    return _forward(m, tokens, position_ids, mask, kv_cache, dict(num_new=tokens.shape[1], new_mask=new_mask),
                    return_logits, impl)


def _forward(m, tokens, position_ids, mask, kv_cache, begin_kw, return_logits, impl):
    lean = None
    if impl != "megatron":
        from megatron_jf.inference.lean_forward import LeanForward, lean_forward_for

        lean = lean_forward_for(m) if impl == "auto" else (getattr(m, "_jf_lean_forward", None) or LeanForward(m))
        if lean is not None and impl != "auto":
            m._jf_lean_forward = lean
    if lean is not None and kv_cache is not None and return_logits and "slots" not in begin_kw:
        from megatron_jf.inference.static_decode import static_decode_enabled, static_decoder_for

        if impl == "static" or (impl == "auto" and static_decode_enabled(tokens.device)):
            # fixed-shape forward over the whole preallocated cache (CUDA graphs per block size on GPU)
            out = static_decoder_for(lean, kv_cache).forward(tokens, position_ids, begin_kw.get("new_mask"))
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

