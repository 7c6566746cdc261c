"""Tiny real models for tests, benchmarks and the quickstart recipe: random Qwen2/Llama models built from configs,
and :func:`build_tiny_checkpoint`, a converted checkpoint with a trained BPE tokenizer (server tests, ``bench/serve.py``).

Nothing here is mocked: these are ordinary ``transformers`` models with every tensor randomised
(biases and norms included, so a wrong mapping cannot hide behind zeros or ones).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import torch


def tiny_hf_config(family: str = "qwen2", *, vocab: int = 256, hidden: int = 64, layers: int = 2, heads: int = 4,
                   kv_heads: int = 2, ffn: int = 96, tied: bool = False, rope_theta: float = 10000.0,
                   max_pos: int = 512):
    """A ``transformers`` config for a tiny Qwen2 (``family="qwen2"``) or Llama (``"llama"``) model."""
    from transformers import LlamaConfig, Qwen2Config

    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, rms_norm_eps=1e-6,
                  max_position_embeddings=max_pos, tie_word_embeddings=tied,
                  rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
                  bos_token_id=None, eos_token_id=vocab - 1, pad_token_id=None)
    if family == "qwen2":
        return Qwen2Config(architectures=["Qwen2ForCausalLM"], **common)
    if family == "llama":
        return LlamaConfig(architectures=["LlamaForCausalLM"], attention_bias=False, mlp_bias=False, **common)
    raise ValueError(f"unknown family {family!r}")


def tiny_hf_model(family: str = "qwen2", seed: int = 0, scale: float = 0.08, **kw):
    """A tiny HF causal LM with all tensors drawn from N(0, scale²) (norm weights around 1), fp32, eager."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_hf_config(family, **kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(scale * torch.randn(p.shape, generator=g))
    return model.eval()


def save_tiny_hf(path: str, family: str = "qwen2", seed: int = 0, **kw) -> str:
    """Save a tiny random HF checkpoint (safetensors + config) to ``path`` and return it."""
    model = tiny_hf_model(family, seed=seed, **kw)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    return path


def peaked_hf_model(family: str = "qwen2", period: int = 4, seed: int = 0, sharpness: float = 30.0, **kw):
    """A tiny HF model whose greedy continuation is easy to guess: next token = the next element of a
    cycle of ``period`` tokens containing the current token (``period=1``: repeat the current token).

    Built from a random model by making the embedding dominate the residual stream (attention and MLP
    outputs scaled down, not removed, so the context still matters a little) and setting the LM head to
    the embedding of the predecessor in the cycle, scaled by ``sharpness`` (large logit margins).
    """
    model = tiny_hf_model(family, seed=seed, **kw)
    V = model.config.vocab_size
    idx = torch.arange(V)
    succ = idx - idx % period + (idx % period + 1) % period  # t -> next in its cycle
    pred = torch.empty_like(succ)
    pred[succ] = idx
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        emb.copy_(torch.nn.functional.normalize(emb, dim=-1) * emb.shape[1] ** 0.5)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.02)
            layer.mlp.down_proj.weight.mul_(0.02)
        model.model.norm.weight.fill_(1.0)
        if model.config.tie_word_embeddings:
            raise ValueError("peaked_hf_model needs untied embeddings")
        model.lm_head.weight.copy_(sharpness / emb.shape[1] * emb[pred])
    return model.eval()


def mcore_twin(hf):
    """The megatron-core :class:`~megatron_jf.models.gpt.JFGPTModel` (eval mode) with ``hf``'s weights, built for
    the current TP/PP group (:func:`megatron_jf.parallel.initialize` first)."""
    from megatron_jf.models.convert import hf_to_mcore
    from megatron_jf.models.gpt import build_model
    from megatron_jf.models.hf_config import ModelArgs

    args = ModelArgs.from_hf_dict(hf.config.to_dict())
    m = build_model(args).eval()
    m.load_state_dict(hf_to_mcore(hf.state_dict(), args), strict=False)
    return m


def save_with_tokenizer(model, path: str) -> str:
    """Save ``model`` (a tiny HF causal LM) with a word-level tokenizer over its vocabulary: token ``i`` is the word
    ``t<i>`` and text is `` t<i>`` per token (byte-level spaces, which survive transformers replacing the decoder by
    the architecture's own); the EOS token is the config's ``eos_token_id``. Returns ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    V = model.config.vocab_size
    tok = Tokenizer(models.WordLevel({f"\u0120t{i}": i for i in range(V)}, unk_token="\u0120t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=f"\u0120t{model.config.eos_token_id}")
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    fast.save_pretrained(path)
    return path


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TEXTS = [
    "The quick brown fox jumps over the lazy dog. Jacobi forcing makes decoding parallel.",
    "Hello world! Grüße aus Köln, naïve café, déjà vu — ünïcödé ✓ 你好世界 こんにちは 🙂🚀",
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n",
    "Speculative decoding verifies a draft of tokens in one forward pass; accepted tokens are exact.",
] * 20


def build_tiny_checkpoint(root: str, *, vocab_size: int = 320, period: int = 4, max_pos: int = 256,
                          seed: int = 0, in_process: bool = False) -> str:
    """Build (once) ``root/ckpt``: a megatron-jf checkpoint with tokenizer; returns its path.

    Args:
        root: work directory (``tok/``, ``hf/``, ``ckpt/`` are created inside).
        vocab_size: BPE target vocabulary (the actual size is what the trainer reaches).
        period: the peaked model's token cycle length.
        max_pos: the context window, tokens.
        in_process: convert in this process (needs :func:`megatron_jf.parallel.initialize` with tp=pp=1;
            the same steps as the tool, without its start-up cost) instead of running the tool.

    Raises:
        RuntimeError: the conversion tool failed (its output is in the message).
    """
    from megatron_jf.data.tokenizer_train import train_bpe_tokenizer

    ckpt = os.path.join(root, "ckpt")
    if os.path.isdir(ckpt):
        return ckpt
    tok_dir = train_bpe_tokenizer(os.path.join(root, "tok"), texts=TEXTS, vocab_size=vocab_size, overwrite=True)
    from transformers import AutoTokenizer

    V = len(AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True))
    hf_dir = os.path.join(root, "hf")
    model = peaked_hf_model("qwen2", period=period, seed=seed, vocab=V, max_pos=max_pos)
    model.save_pretrained(hf_dir)
    for f in os.listdir(tok_dir):
        if f != "config.json":
            shutil.copy2(os.path.join(tok_dir, f), os.path.join(hf_dir, f))
    if in_process:
        from megatron_jf.checkpointing import save_checkpoint
        from megatron_jf.hf_io import load_hf_state_dict, read_model_args
        from megatron_jf.models.convert import hf_to_mcore
        from megatron_jf.models.gpt import build_model

        margs = read_model_args(hf_dir)
        m = build_model(margs)
        m.load_state_dict(hf_to_mcore(load_hf_state_dict(hf_dir), margs), strict=False)
        save_checkpoint(ckpt, 0, m, tokenizer_dir=hf_dir, common={"source": hf_dir})
        return ckpt
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tools", "convert_hf.py"), "hf-to-mcore",
                           "--hf", hf_dir, "--out", ckpt], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"convert_hf failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return ckpt

