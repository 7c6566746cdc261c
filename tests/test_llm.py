"""The loaded-model facade (megatron_jf/inference/llm.py): one load sequence for every inference entry point.

A tiny converted checkpoint with its tokenizer: ``LLM.from_checkpoint`` + ``generate`` on text equals
``transformers`` greedy on the Hugging Face model it was converted from, stops on the checkpoint's stop set, and
every load mistake is the error its docstring names."""
import os

import pytest
import torch

from megatron_jf.decoding import DecodeConfig


@pytest.fixture(scope="module")
def tiny(mp1, tmp_path_factory):
    from megatron_jf.models.zoo import build_tiny_checkpoint

    root = str(tmp_path_factory.mktemp("llm"))
    return root, build_tiny_checkpoint(root, seed=3, in_process=True)


def test_generate_on_text_equals_transformers_greedy(tiny):
    from transformers import AutoModelForCausalLM

    from megatron_jf.inference.llm import LLM

    root, ck = tiny
    llm = LLM.from_checkpoint(ck)
    assert llm.ckpt_dir == os.path.abspath(ck) and llm.engine.max_context == llm.model_args.max_position_embeddings
    hf = AutoModelForCausalLM.from_pretrained(os.path.join(root, "hf"), torch_dtype=torch.float32).eval()
    prompts = ["def add(a, b):", "Hello world"]
    for cfg in (DecodeConfig("ar"), DecodeConfig("jacobi", block_size=4)):
        res = llm.generate(prompts, cfg, max_new_tokens=12, eos_ids=frozenset())
        for text, r in zip(prompts, res):
            ids = llm.tokenizer.encode(text)
            with torch.no_grad():
                want = hf.generate(torch.tensor([ids]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                                   pad_token_id=0)[0, len(ids):].tolist()
            assert r.tokens == want, (cfg.decoder, text)
            # token ids and text are the same prompt
            assert llm.generate([ids], cfg, max_new_tokens=12, eos_ids=frozenset())[0].tokens == want


def test_generate_stops_on_the_checkpoints_stop_set(tiny):
    from megatron_jf.checkpointing import load_model
    from megatron_jf.inference.llm import LLM
    from megatron_jf.tokenizer import stop_token_ids

    _, ck = tiny
    llm = LLM.from_checkpoint(ck)
    _, margs, _ = load_model(ck)
    assert llm.eos_ids == stop_token_ids(llm.tokenizer, margs, ck) and llm.eos_ids
    stop = min(llm.eos_ids)
    # the peaked model cycles with period 4: a prompt ending one step before the stop id's cycle reaches it
    prompt = [stop - stop % 4 + (stop % 4 + 3) % 4]
    free = llm.generate([prompt], max_new_tokens=8, eos_ids=frozenset())[0].tokens
    stopped = llm.generate([prompt], max_new_tokens=8)[0]
    assert stop in free
    assert stopped.tokens == free[: free.index(stop) + 1] and stopped.finish_reason == "eos"


def test_load_mistakes_are_named(tiny, tmp_path):
    from megatron_jf.inference.llm import LLM, CheckpointNotFound, TokenizerNotFound
    from megatron_jf.load_errors import HFDirectoryError

    root, ck = tiny
    with pytest.raises(CheckpointNotFound, match="does not exist"):
        LLM.from_checkpoint(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointNotFound, match="holds no megatron_jf checkpoint|not a megatron_jf checkpoint"):
        LLM.from_checkpoint(str(tmp_path / "empty"))
    with pytest.raises(HFDirectoryError, match="hf-to-mcore"):
        LLM.from_checkpoint(os.path.join(root, "hf"))
    with pytest.raises(TokenizerNotFound) as e:  # the checkpoint has a tokenizer: the message names the flag's path
        LLM.from_checkpoint(ck, tokenizer=str(tmp_path / "no-tok"))
    assert str(e.value) == f"tokenizer does not exist: {tmp_path / 'no-tok'} (--tokenizer)"
    window = LLM.from_checkpoint(ck).model_args.max_position_embeddings
    with pytest.raises(ValueError, match=f"context window of {window}"):
        LLM.from_checkpoint(ck, max_context=window + 1)
    assert LLM.from_checkpoint(ck, max_context=window // 2).engine.max_context == window // 2


def test_inference_flags_reach_the_engine_and_change_no_output(tiny):
    """The ``--inference-*`` flags (every inference command's flag group) become the Engine's
    :class:`InferenceOptions`; megatron-core's forward with tree verification and no one-row weight copies generates
    what the defaults (lean forward, pruned verification) generate."""
    import argparse

    from megatron_jf import cli
    from megatron_jf.inference.llm import LLM
    from megatron_jf.inference.options import InferenceOptions

    _, ck = tiny
    p = argparse.ArgumentParser()
    cli.add_inference_args(p)
    assert cli.inference_options(p.parse_args([])) == InferenceOptions()
    opts = cli.inference_options(p.parse_args(["--inference-forward", "megatron", "--inference-mr-verify", "tree",
                                               "--inference-gemv", "none", "--inference-cuda-graphs", "off"]))
    llm, default = LLM.from_checkpoint(ck, options=opts), LLM.from_checkpoint(ck)
    assert llm.engine.options == InferenceOptions(forward="megatron", mr_verify="tree", gemv="none",
                                                  cuda_graphs=False)
    assert llm.engine.mr_verify == "tree" and default.engine.mr_verify == "pruned"  # CPU's default
    with pytest.raises(SystemExit):
        p.parse_args(["--inference-forward", "fast"])
    prompts = ["def add(a, b):", "Hello world"]
    for cfg in (DecodeConfig("ar"), DecodeConfig("mr", block_size=4, num_blocks=2, verification_size=2)):
        got = [r.tokens for r in llm.generate(prompts, cfg, max_new_tokens=16, eos_ids=frozenset())]
        want = [r.tokens for r in default.generate(prompts, cfg, max_new_tokens=16, eos_ids=frozenset())]
        assert got == want and all(len(t) == 16 for t in got), cfg.decoder


def test_from_model_wraps_a_built_model_like_its_checkpoint(tiny):
    """``LLM.from_model`` over the checkpoint's own model and stop set: the same tokens as the loaded LLM, with a
    new engine of the model's context window; without the stop ids it runs to ``max_new_tokens``."""
    from megatron_jf.inference.llm import LLM

    root, ck = tiny
    a = LLM.from_checkpoint(ck)
    b = LLM.from_model(a.model, a.tokenizer, a.eos_ids)
    assert b.engine is not a.engine and b.ckpt_dir == "" and b.engine.max_context == a.engine.max_context
    prompts = ["Hello world!", "def add(a, b):"]
    cfg = DecodeConfig("jacobi", block_size=4)
    want = [r.tokens for r in a.generate(prompts, cfg, max_new_tokens=24)]
    assert [r.tokens for r in b.generate(prompts, cfg, max_new_tokens=24)] == want
    free = LLM.from_model(a.model, a.tokenizer)
    assert all(len(r.tokens) == 24 for r in free.generate(prompts, cfg, max_new_tokens=24))
