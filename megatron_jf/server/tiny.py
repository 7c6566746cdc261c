"""A tiny real checkpoint (BPE tokenizer + peaked Qwen2 model) for server tests and ``bench/serve.py``.

The model is :func:`megatron_jf.testing.peaked_hf_model` (next token mostly determined by the current
one, so Jacobi/MR decoding accepts several tokens per forward) with the vocabulary of a byte-level BPE
trained on a small text that includes multi-byte characters; it is converted with
``tools/convert_hf.py hf-to-mcore``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

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
    from megatron_jf.quickstart.tokenizer_train import train_bpe_tokenizer
    from megatron_jf.testing import peaked_hf_model

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


if __name__ == "__main__":
    print(build_tiny_checkpoint(sys.argv[1]))
