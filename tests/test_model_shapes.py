"""megatron_jf/models/shapes.py: the named model shapes, defined once."""

from __future__ import annotations

import pytest

from megatron_jf.models import shapes
from megatron_jf.models.hf_config import ModelArgs


def test_named_shapes_are_model_args_and_round_trip_through_hf_config():
    assert {"qwen2.5-7b", "smollm2", "model-a", "tiny"} <= set(shapes.names())
    for name in shapes.names():
        a = shapes.get(name)
        assert isinstance(a, ModelArgs)
        assert a.head_dim * a.num_heads == a.hidden_size and a.num_heads % a.num_kv_heads == 0
        back = ModelArgs.from_hf_dict(a.to_hf_dict()).to_dict()
        assert {k: v for k, v in back.items() if k != "extra"} == {k: v for k, v in a.to_dict().items() if k != "extra"}


def test_qwen25_7b_is_the_published_shape():
    a = shapes.get("Qwen2.5-7B")
    assert (a.vocab_size, a.hidden_size, a.intermediate_size, a.num_layers, a.num_heads, a.num_kv_heads) == \
        (152064, 3584, 18944, 28, 28, 4)
    assert a.qkv_bias and not a.tie_word_embeddings and a.rope_theta == 1e6


def test_get_returns_a_copy_and_names_unknown_shapes():
    shapes.get("tiny").eos_token_ids.append(7)
    shapes.get("tiny").num_layers = 99
    assert shapes.get("tiny").eos_token_ids == [] and shapes.get("tiny").num_layers == 2
    with pytest.raises(KeyError, match="known: model-a"):
        shapes.get("nope")
