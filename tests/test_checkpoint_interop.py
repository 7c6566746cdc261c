"""Checkpoints move to and from Megatron-LM: the format (pointer, ``common.pt`` fields, sharded model keys)
is checked against a plain megatron-core ``GPTModel`` built from the stored Megatron-LM arguments, the way
Megatron-LM's ``load_args_from_checkpoint`` + ``load_checkpoint`` build and fill one. Old checkpoints of this
project (``model.``-prefixed keys) still load; bad pointers and folders get errors that name the problem."""
import argparse
import json
import os

import pytest
import torch

from tests.conftest import REPO


def _tiny(**kw):
    from megatron_jf.models.hf_config import ModelArgs
    from megatron_jf.models.zoo import tiny_hf_model

    hf = tiny_hf_model("qwen2", seed=5, **kw)
    return hf, ModelArgs.from_hf_dict(hf.config.to_dict())


def _jf_model(hf, args):
    from megatron_jf.models.convert import hf_to_mcore
    from megatron_jf.models.gpt import build_model

    m = build_model(args, params_dtype=torch.float32)
    m.load_state_dict(hf_to_mcore(dict(hf.state_dict()), args), strict=False)
    return m


def _gpt_from_megatron_lm_args(a: argparse.Namespace):
    """A megatron-core GPTModel (local spec) from Megatron-LM arguments, as Megatron-LM's model provider
    builds one from ``core_transformer_config_from_args(args)``."""
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    eps = getattr(a, "norm_epsilon", None) or getattr(a, "layernorm_epsilon")
    cfg = TransformerConfig(
        num_layers=a.num_layers, hidden_size=a.hidden_size, ffn_hidden_size=a.ffn_hidden_size,
        num_attention_heads=a.num_attention_heads,
        num_query_groups=a.num_query_groups if a.group_query_attention else None, kv_channels=a.kv_channels,
        normalization=a.normalization, layernorm_epsilon=eps, gated_linear_unit=a.swiglu,
        activation_func=F.silu if a.swiglu else F.gelu, add_bias_linear=a.add_bias_linear,
        add_qkv_bias=a.add_qkv_bias, hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
        params_dtype=torch.float32)
    return GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(normalization=a.normalization),
                    vocab_size=a.padded_vocab_size, max_sequence_length=a.max_position_embeddings,
                    position_embedding_type=a.position_embedding_type, rotary_base=a.rotary_base,
                    share_embeddings_and_output_weights=not a.untie_embeddings_and_output_weights)


def _params(m) -> dict:
    return {k: v for k, v in m.state_dict().items() if not k.endswith("_extra_state")}


def test_saved_checkpoint_is_megatron_lm_format(tmp_path, mp1):
    """common.pt has args/iteration/checkpoint_version; the model keys are GPTModel.sharded_state_dict() keys
    (no prefix) and equal the TE spec's names (fixture); Megatron-LM's model load path fills a GPTModel built
    from the stored args with exactly our weights."""
    from megatron.core import dist_checkpointing

    from megatron_jf import checkpointing as C

    hf, args = _tiny()
    m = _jf_model(hf, args)
    path = C.save_checkpoint(str(tmp_path / "ck"), 7, m, common={"consumed_samples": 56})
    assert os.path.isfile(os.path.join(path, C.META))  # kept as an extra file
    assert open(tmp_path / "ck" / C.LATEST).read().strip() == "7"

    common = dist_checkpointing.load_common_state_dict(path)
    a = common["args"]
    assert isinstance(a, argparse.Namespace)
    assert common["iteration"] == 7 and common["checkpoint_version"] == 3.0
    assert (a.num_layers, a.hidden_size, a.ffn_hidden_size, a.num_attention_heads, a.num_query_groups,
            a.kv_channels) == (2, 64, 96, 4, 2, 16)
    assert a.group_query_attention and a.add_qkv_bias and a.swiglu and not a.add_bias_linear
    assert a.untie_embeddings_and_output_weights and a.normalization == "RMSNorm"
    assert a.position_embedding_type == "rope" and a.rotary_base == 10000 and a.padded_vocab_size == 256
    assert a.tensor_model_parallel_size == 1 and a.pipeline_model_parallel_size == 1
    assert a.ckpt_format == "torch_dist" and a.consumed_train_samples == 56 and a.iteration == 7

    saved = set(dist_checkpointing.load_tensors_metadata(path))
    gpt = _gpt_from_megatron_lm_args(a)
    want = {v.key for v in gpt.sharded_state_dict().values() if type(v).__name__ != "ShardedObject"}
    assert want <= saved and not any(k.startswith("model.") for k in saved)
    fx = json.load(open(os.path.join(REPO, "tests", "fixtures", "te_spec_keys.json")))
    te_stacked = {".".join(k.split(".")[:2] + k.split(".")[3:]) if k.startswith("decoder.layers.") else k
                  for k in fx["te_keys"]}
    assert {k for k in saved if not k.startswith("optimizer")} == te_stacked

    loaded = dist_checkpointing.load({"model": gpt.sharded_state_dict()}, path)  # Megatron-LM's load
    gpt.load_state_dict(loaded["model"], strict=False)
    ours, theirs = _params(m), _params(gpt)
    assert set(ours) == set(theirs)
    for k in ours:
        assert torch.equal(ours[k], theirs[k]), k


def _save_megatron_lm_release(root, a: argparse.Namespace, seed=11):
    """A checkpoint as Megatron-LM writes one: ``release/`` named by the pointer, common.pt with args, no
    jf_meta.json."""
    from megatron.core import dist_checkpointing

    torch.manual_seed(seed)
    gpt = _gpt_from_megatron_lm_args(a)
    with torch.no_grad():
        for p in gpt.parameters():
            p.copy_(torch.randn_like(p) * 0.05)
    d = os.path.join(root, "release")
    os.makedirs(d)
    dist_checkpointing.save({"args": a, "checkpoint_version": 3.0, "iteration": 0,
                             "model": gpt.sharded_state_dict()}, d)
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("release")
    return gpt


def _megatron_lm_args(**over):
    a = argparse.Namespace(
        num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, group_query_attention=True,
        num_query_groups=2, kv_channels=16, max_position_embeddings=512, seq_length=256,
        position_embedding_type="rope", rotary_base=1000000, normalization="RMSNorm", norm_epsilon=1e-6,
        swiglu=True, add_bias_linear=False, add_qkv_bias=True, untie_embeddings_and_output_weights=True,
        padded_vocab_size=256, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
        ckpt_format="torch_dist")
    for k, v in over.items():
        setattr(a, k, v)
    return a


@pytest.mark.parametrize("tied", [False, True])
def test_load_megatron_lm_release_checkpoint(tmp_path, mp1, tied):
    """A Megatron-LM checkpoint (pointer 'release', no jf_meta.json, args in common.pt) loads with the right
    architecture and bit-identical weights."""
    from megatron_jf import checkpointing as C

    a = _megatron_lm_args(untie_embeddings_and_output_weights=not tied)
    gpt = _save_megatron_lm_release(str(tmp_path / "mlm"), a)
    assert C.latest_iteration(str(tmp_path / "mlm")) == 0
    model, margs, meta = C.load_model(str(tmp_path / "mlm"))
    assert meta["release"] and meta["path"].endswith("release")
    assert (margs.architecture, margs.num_kv_heads, margs.rope_theta, margs.rms_norm_eps,
            margs.tie_word_embeddings) == ("Qwen2ForCausalLM", 2, 1e6, 1e-6, tied)
    ours, theirs = _params(model), _params(gpt)
    assert set(ours) == set(theirs)
    for k in ours:
        assert torch.equal(ours[k], theirs[k]), k
    assert margs.eos_token_ids == []  # no tokenizer named: no stop tokens invented


def test_megatron_lm_stop_tokens_come_from_its_tokenizer_model(tmp_path, mp1):
    """Megatron-LM names its HF tokenizer folder in args.tokenizer_model; its EOS becomes the stop token."""
    from megatron_jf import checkpointing as C
    from transformers import AutoTokenizer

    from megatron_jf.data.tokenizer_train import train_bpe_tokenizer

    tok = train_bpe_tokenizer(tmp_path / "tok", texts=["def f(x):\n    return x + 1\n"] * 20, vocab_size=300,
                              overwrite=True)
    eos = AutoTokenizer.from_pretrained(str(tok)).eos_token_id
    assert eos is not None
    _save_megatron_lm_release(str(tmp_path / "mlm"), _megatron_lm_args(tokenizer_model=str(tok),
                                                                       tokenizer_type="HuggingFaceTokenizer"))
    assert C.read_meta(str(tmp_path / "mlm"))["model_args"]["eos_token_ids"] == [eos]


def test_megatron_lm_checkpoint_converts_to_hf(tmp_path):
    """tools/convert_hf.py mcore-to-hf on a Megatron-LM release checkpoint gives a directory transformers loads."""
    import subprocess
    import sys

    from transformers import AutoModelForCausalLM

    from megatron_jf import parallel

    parallel.initialize(1, 1)
    a = _megatron_lm_args(add_qkv_bias=False, group_query_attention=False, num_query_groups=None)
    _save_megatron_lm_release(str(tmp_path / "mlm"), a)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    p = subprocess.run([sys.executable, os.path.join(REPO, "tools", "convert_hf.py"), "mcore-to-hf",
                        "--load", str(tmp_path / "mlm"), "--out", str(tmp_path / "hf")],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    m, info = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), output_loading_info=True)
    assert type(m).__name__ == "LlamaForCausalLM" and m.config.num_key_value_heads == 4
    assert not info["missing_keys"] and not info["unexpected_keys"]


def test_old_layout_checkpoint_still_loads(tmp_path, mp1):
    """A checkpoint saved in this project's previous layout (model keys prefixed 'model.', no args in
    common.pt, jf_meta.json without model_key_prefix) loads bit-exactly."""
    from megatron.core import dist_checkpointing

    from megatron_jf import checkpointing as C

    hf, args = _tiny()
    m = _jf_model(hf, args)
    d = tmp_path / "old" / "iter_0000003"
    d.mkdir(parents=True)
    dist_checkpointing.save({"model": m.sharded_state_dict(prefix="model.")}, str(d))
    (d / C.META).write_text(json.dumps({"format": C.FORMAT, "iteration": 3, "model_args": args.to_dict(),
                                        "tp": 1, "pp": 1, "common": {}}))
    (tmp_path / "old" / C.LATEST).write_text("3")
    assert any(k.startswith("model.") for k in dist_checkpointing.load_tensors_metadata(str(d)))
    model, _, meta = C.load_model(str(tmp_path / "old"))
    assert meta["model_key_prefix"] == "model."
    ours, src = _params(model), _params(m)
    for k in src:
        assert torch.equal(ours[k], src[k]), k


class _NormWithExtraState(torch.nn.RMSNorm):
    """A final norm that saves an ``_extra_state`` next to its weight, as Transformer Engine's ``TENorm`` does (TE
    itself cannot run on CPU); megatron-core shards it as TE's, a ``ShardedObject`` ``decoder.final_layernorm.
    _extra_state``."""

    def get_extra_state(self):
        return torch.tensor([21], dtype=torch.uint8)

    def set_extra_state(self, state):
        self.loaded_extra_state = state


def _with_te_norm(m):
    old = m.decoder.final_layernorm
    norm = _NormWithExtraState(old.weight.shape[0], eps=old.eps)
    with torch.no_grad():
        norm.weight.copy_(old.weight)
    m.decoder.final_layernorm = norm
    return m


@pytest.mark.parametrize("direction", ["cpu_to_te", "te_to_cpu"])
def test_checkpoints_load_with_and_without_te_extra_state(tmp_path, mp1, direction):
    """Issue 21 item 3: a checkpoint written without TE (no ``decoder.final_layernorm._extra_state``) loads into a
    model whose sharded state dict has that key (before: ``Missing key in checkpoint state_dict``), and a checkpoint
    that has it loads into a model without it; the weights arrive exactly, strict loading included."""
    from megatron_jf import checkpointing as C
    from megatron_jf.models.zoo import tiny_hf_model

    hf, args = _tiny()
    other = tiny_hf_model("qwen2", seed=6)
    src, dst = _jf_model(hf, args), _jf_model(other, args)
    _with_te_norm(dst if direction == "cpu_to_te" else src)
    key = "decoder.final_layernorm._extra_state"
    assert (key in dst.sharded_state_dict()) == (direction == "cpu_to_te") != (key in src.sharded_state_dict())
    C.save_checkpoint(str(tmp_path / "ck"), 1, src)
    C.load_checkpoint(str(tmp_path / "ck"), dst)  # strict
    got, want = _params(dst), _params(src)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    if direction == "te_to_cpu":  # the inference tools' path too
        model, _, _ = C.load_model(str(tmp_path / "ck"))
        assert all(torch.equal(_params(model)[k], want[k]) for k in want)


def test_unloadable_checkpoints_are_named(tmp_path, mp1):
    from megatron_jf import checkpointing as C

    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / C.LATEST).write_text("latest!")
    with pytest.raises(ValueError, match="corrupt checkpoint pointer .*'latest!'"):
        C.read_meta(str(ck))
    (ck / C.LATEST).write_text("release")
    with pytest.raises(ValueError, match="names 'release' but .*release is missing"):
        C.read_meta(str(ck))
    (ck / "release").mkdir()
    with pytest.raises(ValueError, match="incomplete"):
        C.read_meta(str(ck))
    # a dist checkpoint without model arguments: says what is missing, not "corrupt pointer"
    from megatron.core import dist_checkpointing

    import shutil
    shutil.rmtree(ck / "release")
    (ck / "release").mkdir()
    dist_checkpointing.save({"iteration": 0}, str(ck / "release"))
    with pytest.raises(ValueError, match="carries no 'args'"):
        C.read_meta(str(ck))
    a = _megatron_lm_args(swiglu=False)
    with pytest.raises(ValueError, match="swiglu=False"):
        C.model_args_from_megatron_lm(a)
