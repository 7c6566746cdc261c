"""Named model shapes, each defined once as a :class:`~megatron_jf.models.hf_config.ModelArgs`.

Benchmarks and planners that need an architecture without a checkpoint (random weights of a real model's shape,
memory plans, step timings) take it from here, by name::

    from megatron_jf.models import shapes

    args = shapes.get("qwen2.5-7b")        # a fresh copy: callers may change it
    shapes.names()                          # ('model-a', 'qwen2.5-0.5b', ...)

The published shapes (Qwen2.5 7B / 1.5B / 0.5B, SmolLM2-135M) carry their Hugging Face ``config.json`` values;
``model-a`` and ``tiny`` are this project's own small shapes (the training-step bench's 4-layer model and the GPU
checks' CPU stand-in). Standard library only (no torch): parsers may list :func:`names` as choices.
"""

from __future__ import annotations

import copy

from megatron_jf.models.hf_config import ModelArgs


def _qwen2(vocab: int, hidden: int, ffn: int, layers: int, heads: int, kv_heads: int, *, tied: bool,
           rope_theta: float = 1e6, max_pos: int = 32768, eps: float = 1e-6) -> ModelArgs:
    return ModelArgs(architecture="Qwen2ForCausalLM", vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn,
                     num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=hidden // heads,
                     rms_norm_eps=eps, rope_theta=rope_theta, max_position_embeddings=max_pos,
                     tie_word_embeddings=tied, qkv_bias=True)


#: Qwen2.5-7B(-Instruct): 28 layers, hidden 3584, 28 heads / 4 KV heads, FFN 18944, vocab 152064, QKV bias, untied.
QWEN25_7B = _qwen2(152064, 3584, 18944, 28, 28, 4, tied=False)
#: Qwen2.5-1.5B(-Instruct): 28 layers, hidden 1536, 12 heads / 2 KV heads, FFN 8960, tied embeddings.
QWEN25_1_5B = _qwen2(151936, 1536, 8960, 28, 12, 2, tied=True)
#: Qwen2.5-0.5B(-Instruct): 24 layers, hidden 896, 14 heads / 2 KV heads, FFN 4864, tied embeddings.
QWEN25_0_5B = _qwen2(151936, 896, 4864, 24, 14, 2, tied=True)
#: SmolLM2-135M(-Instruct): a Llama, 30 layers, hidden 576, 9 heads / 3 KV heads, FFN 1536, vocab 49152, tied.
SMOLLM2_135M = ModelArgs(architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5,
                         rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True,
                         qkv_bias=False)
#: The training-step bench's small model: 4 layers, hidden 256, 8 heads / 2 KV heads, FFN 688, vocab 4096.
MODEL_A = _qwen2(4096, 256, 688, 4, 8, 2, tied=False, rope_theta=10000.0, max_pos=4096)
#: The GPU checks' CPU stand-in (``--dry-run``): 2 layers, hidden 64, 4 heads / 2 KV heads, FFN 128, vocab 512.
TINY = _qwen2(512, 64, 128, 2, 4, 2, tied=False, rope_theta=10000.0, max_pos=1024)

SHAPES: dict[str, ModelArgs] = {
    "qwen2.5-7b": QWEN25_7B,
    "qwen2.5-1.5b": QWEN25_1_5B,
    "qwen2.5-0.5b": QWEN25_0_5B,
    "smollm2": SMOLLM2_135M,
    "model-a": MODEL_A,
    "tiny": TINY,
}


def names() -> tuple[str, ...]:
    """The shape names, sorted."""
    return tuple(sorted(SHAPES))


def get(name: str) -> ModelArgs:
    """A copy of the named shape (case-insensitive), so a caller's changes never reach the shared definition.

    Raises:
        KeyError: an unknown name (the message lists the known ones).
    """
    try:
        return copy.deepcopy(SHAPES[name.lower()])
    except KeyError:
        raise KeyError(f"unknown model shape {name!r}; known: {', '.join(names())}") from None
