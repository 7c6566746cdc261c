"""The model provider: a megatron-core ``GPTModel`` for Qwen2/Qwen2.5 and Llama, with RoPE by position id.

* :func:`build_model` turns :class:`~megatron_jf.models.hf_config.ModelArgs` into a
  :class:`JFGPTModel` for the current tensor/pipeline-parallel rank.
* :class:`JFGPTModel` fixes megatron-core's RoPE, which is computed for ``0..seq_len-1`` whatever
  ``position_ids`` say (upstream NVIDIA/Megatron-LM#453). Jacobi Forcing needs real positions:
  training packs noisy and clean copies of a block at the *same* positions (paper Sec. 3.1), and
  decoding forwards a block at an offset after a KV cache. Here cos/sin are gathered per token from
  one cached table.
* The output layer hands its backward a contiguous gradient (:func:`contiguous_logits_grad`): megatron returns
  the logits transposed to ``[b, s, V]``, so their gradient reaches the output layer as a strided ``[s, b, V]``
  view, and its ``grad_output.matmul(weight)`` then cannot fold to one matrix product: on CPU torch materialises
  the ``[V, h]`` weight ``s`` times for a batched product (measured on an Intel Xeon, the default quickstart's
  base, 2 threads: 77 ms of a 480 ms training step).
* :func:`new_kv_cache` and :func:`attach_kv_cache` size and attach a
  :class:`~megatron_jf.models.kv_cache.KVCache`; the inference forward over them
  (:func:`megatron_jf.inference.forward.forward_logits`) lives with the engine.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
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

# megatron-core 0.19 logs "GPTModel IS DEPRECATED ... HybridModel" at every model build (a warning about its own
# roadmap, not about this call; README "Tests and CI" notes the port a release without GPTModel will need)
logging.getLogger("megatron.core.models.gpt.gpt_model").addFilter(
    lambda record: not record.getMessage().startswith("GPTModel IS DEPRECATED"))
# ... and "Unknown MLP type" for the local spec's MLP (megatron_jf/models/mlp.py: a subclass of its MLP, which its
# TransformerLayer matches by identity to pass tp_group; without it the MLP takes the same TP group from
# parallel_state, so the "default kwargs" it warns about are the ones it would have passed)
logging.getLogger("megatron.core.transformer.transformer_layer").addFilter(
    lambda record: not record.getMessage().startswith("Unknown MLP type"))

from megatron_jf.models.attention import JFCoreAttention  # noqa: E402
from megatron_jf.models.kv_cache import KVCache  # noqa: E402
from megatron_jf.models.mlp import use_in_spec as use_jf_mlp  # noqa: E402
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
    """The transformer-layer ``ModuleSpec``: megatron's local spec with our :class:`~megatron_jf.models.norm.RMSNorm`
    and :class:`~megatron_jf.models.mlp.MLP`, or megatron's Transformer Engine spec (fused norm + projections), with
    our core attention in either.

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
        use_jf_mlp(spec)  # megatron's MLP, its SwiGLU compiled under CPU autocast (models/mlp.py)
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


def _transformer_config(**kw) -> TransformerConfig:
    """``TransformerConfig(**kw)`` without megatron-core 0.16's deprecation warning about its own default
    (``cuda_graph_scope="full"``, "full scope is deprecated"; 0.17+ defaults to the empty list and does not warn)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="full scope is deprecated", category=UserWarning,
                                module=r"megatron\.core\.transformer\.transformer_config")
        return TransformerConfig(**kw)


def transformer_config(args: ModelArgs, *, params_dtype: torch.dtype | None = None,
                       sequence_parallel: bool = False, recompute: dict | None = None) -> TransformerConfig:
    """megatron-core ``TransformerConfig`` for ``args`` on the current TP/PP group.

    ``recompute``: activation-recomputation fields passed through to ``TransformerConfig``
    (``recompute_granularity``, ``recompute_method``, ``recompute_num_layers``, ``recompute_modules``;
    see :meth:`megatron_jf.training.config.RecomputeConfig.kwargs`). None: no recomputation.

    Fusions that need CUDA kernels are enabled only on GPU. Weights are initialised on CPU and then
    split, so TP shards are cut from one master weight (TP=2 equals TP=1 up to rounding).
    """
    tp = ps.get_tensor_model_parallel_world_size()
    pp = ps.get_pipeline_model_parallel_world_size()
    args.validate_parallel(tp, pp)
    dtype = params_dtype or platform.default_dtype()
    gpu = platform.HAVE_CUDA
    return _transformer_config(
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
    multiple of the TP size; :func:`~megatron_jf.inference.forward.forward_logits` slices the padding off. ``transformer_impl``: the layer
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


class _ContiguousGrad(torch.autograd.Function):
    """Identity forward; the backward makes the incoming gradient contiguous."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g.contiguous()


def contiguous_logits_grad(module, args, output):
    """Forward hook of the output layer (``ColumnParallelLinear``, output ``(logits [s, b, V_local], bias)``):
    the logits' gradient arrives contiguous at the layer's backward (module docstring). Values unchanged; only when
    the logits need a gradient (otherwise returns None: the output stays as it is). Raises nothing."""
    logits, bias = output
    if not (torch.is_grad_enabled() and logits.requires_grad):
        return None
    return _ContiguousGrad.apply(logits), bias


def finish_model(model, args: ModelArgs) -> None:
    """Attach what the engine and tools read to a freshly built ``JFGPTModel`` (in place).

    Sets ``model.vocab_size_unpadded`` and ``model.model_args``, numbers this stage's core attentions
    ``cache_slot = 0, 1, ...`` (their layer index in a :class:`~megatron_jf.models.kv_cache.KVCache`) and
    ``model.num_local_layers``, and hooks :func:`contiguous_logits_grad` on the output layer. Raises nothing.
    """
    if getattr(model, "output_layer", None) is not None:
        model.output_layer.register_forward_hook(contiguous_logits_grad)
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
