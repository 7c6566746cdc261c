"""Train the quickstart's small byte-level BPE tokenizer on the stdlib train split.

The tokenizer (``tokenizers`` library) is:

* no normaliser (text is kept byte for byte: tabs, newlines, trailing spaces,
  indentation, non-NFC Unicode all round-trip exactly);
* pre-tokeniser: the Qwen2 split regex (single digits, runs of newlines, whitespace
  before a word kept with the word) followed by GPT-2 byte-level mapping;
* BPE over the 256 byte symbols (all in the initial alphabet, so every string is
  encodable and there is no unknown token);
* special tokens ``<|endoftext|>`` (id 0), ``<|im_start|>`` (1), ``<|im_end|>`` (2).

It is saved as a Hugging Face tokenizer directory (``PreTrainedTokenizerFast``) with
eos and pad ``<|endoftext|>``, no bos, a ChatML chat template (:data:`CHATML_TEMPLATE`)
and a ``generation_config.json`` whose ``eos_token_id`` is ``[<|endoftext|>, <|im_end|>]``,
so :func:`megatron_jf.tokenizer.load_tokenizer` loads it with both stop ids.
A ``jf_tokenizer_meta.json`` records the training settings.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterable

from ..tokenizer import _replace_dir

__all__ = [
    "SPECIAL_TOKENS",
    "CHATML_TEMPLATE",
    "SPLIT_REGEX",
    "train_bpe_tokenizer",
]

#: Special tokens, in id order (0, 1, 2).
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

#: Qwen2's pre-tokeniser regex.
SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

#: Plain ChatML: ``<|im_start|>{role}\n{content}<|im_end|>\n`` per message, then
#: ``<|im_start|>assistant\n`` if ``add_generation_prompt``.  No default system message.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_META = "jf_tokenizer_meta.json"


def _build(vocab_size: int, min_frequency: int):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False, fuse_unk=False))
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    return tok, trainer


def train_bpe_tokenizer(
    out_dir: str | os.PathLike,
    *,
    texts: Iterable[str] | None = None,
    vocab_size: int = 8192,
    min_frequency: int = 2,
    overwrite: bool = False,
) -> Path:
    """Train the byte-level BPE and save it as a Hugging Face tokenizer directory.

    Idempotent: if ``out_dir`` already holds a tokenizer trained by this function with
    the same ``vocab_size`` / ``min_frequency`` on the default corpus (``texts=None``),
    it is returned unchanged.  With custom ``texts`` an existing ``out_dir`` needs
    ``overwrite=True``.  The directory is written under a temporary name and renamed into place.

    Args:
        out_dir: directory to create.
        texts: training documents (default: the stdlib train split,
            :func:`megatron_jf.data.sources.corpus.iter_documents`).
        vocab_size: target vocabulary size including the 3 special tokens and 256
            byte symbols (the trainer may stop earlier on a small corpus).
        min_frequency: minimum pair count for a merge.
        overwrite: retrain and replace an existing ``out_dir``.

    Returns:
        ``Path(out_dir)``.

    Raises:
        ValueError: ``vocab_size < 259 + 1`` or ``min_frequency < 1``.
        FileExistsError: ``out_dir`` exists, is not an identical earlier result and
            ``overwrite`` is False.
    """
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 260:
        raise ValueError(f"vocab_size must be >= 260 (256 bytes + 3 specials + 1), got {vocab_size}")
    if min_frequency < 1:
        raise ValueError(f"min_frequency must be >= 1, got {min_frequency}")
    out = Path(out_dir)
    meta = {
        "kind": "megatron_jf.quickstart.tokenizer_train.train_bpe_tokenizer",  # a format tag (earlier runs resume)
        "vocab_size": vocab_size,
        "min_frequency": min_frequency,
        "corpus": "stdlib-train" if texts is None else "custom",
        "special_tokens": list(SPECIAL_TOKENS),
    }
    if out.exists() and not overwrite:
        try:
            old = json.loads((out / _META).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            old = None
        if isinstance(old, dict):
            old = {k: v for k, v in old.items() if k != "actual_vocab_size"}
        if old == meta and texts is None and (out / "tokenizer.json").is_file():
            return out
        raise FileExistsError(
            f"{out} already exists and is not this tokenizer (pass overwrite=True to replace it)"
        )
    if texts is None:
        from .sources.corpus import iter_documents

        texts = iter_documents("train")

    tok, trainer = _build(vocab_size, min_frequency)
    tok.train_from_iterator(texts, trainer=trainer)
    for i, s in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(s) != i:
            raise RuntimeError(f"special token {s} got id {tok.token_to_id(s)}, expected {i}")
    meta["actual_vocab_size"] = tok.get_vocab_size()

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 30,
    )
    hf.chat_template = CHATML_TEMPLATE

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        hf.save_pretrained(str(tmp))
        gen = {
            "eos_token_id": [tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")],
            "pad_token_id": tok.token_to_id("<|endoftext|>"),
        }
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2), encoding="utf-8")
        (tmp / _META).write_text(json.dumps(meta, indent=2), encoding="utf-8")
        _replace_dir(tmp, out, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
