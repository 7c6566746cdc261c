"""Offline code corpus for the embedded tiny model: the running interpreter's stdlib.

Documents are the ``*.py`` files under ``sysconfig.get_paths()["stdlib"]``, minus tests,
IDLE, site-packages and a few other directories (:data:`DEFAULT_EXCLUDE_DIRS`), the
build-config directory ``config-3.*`` and the machine-specific ``_sysconfigdata*.py``.  Each
file is one document, read as UTF-8 (files that are not valid UTF-8 are skipped).

Split (by file, deterministic, independent of the file list):
``int(md5(relative_posix_path).hexdigest(), 16) % 10 == 0`` -> ``"heldout"``, else
``"train"``.  The relative path is relative to the corpus root, e.g. ``"json/decoder.py"``.

Prompts (:func:`extract_code_prompts`) start at a ``def`` / ``async def`` / ``class``
line and are either a fixed number of lines or (with a tokenizer) a fixed number of
tokens; :func:`make_prompt_sets` builds train prompts from train files and evaluation
prompts from held-out files only, and asserts that the two are disjoint.
"""

from __future__ import annotations

import hashlib
import os
import random
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence

__all__ = [
    "DEFAULT_EXCLUDE_DIRS",
    "HELDOUT_MODULUS",
    "CorpusFile",
    "CodePrompt",
    "stdlib_root",
    "split_of",
    "list_corpus_files",
    "split_files",
    "iter_documents",
    "extract_code_prompts",
    "make_prompt_sets",
]

#: Directory names excluded anywhere in the relative path.
DEFAULT_EXCLUDE_DIRS: frozenset[str] = frozenset(
    {
        "test",
        "tests",
        "idle_test",
        "idlelib",
        "site-packages",
        "dist-packages",
        "__pycache__",
        "encodings",  # 120 generated codec tables (1.4 MB) with identical class bodies
    }
)

#: ``md5(rel) % HELDOUT_MODULUS == 0`` -> held-out.
HELDOUT_MODULUS = 10

_DEF_RE = re.compile(r"^[ \t]*(?:async[ \t]+def|def|class)[ \t]+[A-Za-z_]\w*")


@dataclass(frozen=True)
class CorpusFile:
    """One corpus document.

    Attributes:
        path: absolute path of the file.
        rel: path relative to the corpus root, POSIX separators (the split key).
        split: ``"train"`` or ``"heldout"``.
    """

    path: Path
    rel: str
    split: str

    def read(self) -> str:
        """The file's text (UTF-8; raises ``UnicodeDecodeError`` / ``OSError``)."""
        return self.path.read_text(encoding="utf-8")


@dataclass(frozen=True)
class CodePrompt:
    """A prompt cut from a corpus file.

    Attributes:
        rel: relative path of the source file.
        split: split of the source file (``"train"`` / ``"heldout"``).
        line: 1-based line number of the ``def``/``class`` line the prompt starts at.
        text: the prompt text (starts at the beginning of that line, indentation kept).
        token_ids: the prompt's ids when cut by tokens, else ``None``.
        continuation: the source text right after the prompt (up to
            ``continuation_lines`` lines), a reference completion.
    """

    rel: str
    split: str
    line: int
    text: str
    token_ids: tuple[int, ...] | None
    continuation: str


def stdlib_root() -> Path:
    """The running interpreter's stdlib directory (``sysconfig.get_paths()["stdlib"]``).

    Raises:
        FileNotFoundError: the directory does not exist.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise FileNotFoundError(f"stdlib directory not found: {root}")
    return root


def split_of(rel: str, modulus: int = HELDOUT_MODULUS) -> str:
    """Split of a file given its relative POSIX path: ``"heldout"`` if
    ``int(md5(rel.encode("utf-8")).hexdigest(), 16) % modulus == 0`` else ``"train"``.

    Raises:
        ValueError: ``modulus < 2`` or ``rel`` is absolute / uses backslashes.
    """
    if modulus < 2:
        raise ValueError(f"modulus must be >= 2, got {modulus}")
    if rel.startswith("/") or "\\" in rel:
        raise ValueError(f"rel must be a relative POSIX path, got {rel!r}")
    h = int(hashlib.md5(rel.encode("utf-8")).hexdigest(), 16)
    return "heldout" if h % modulus == 0 else "train"


def list_corpus_files(
    root: str | os.PathLike | None = None,
    *,
    exclude_dirs: Iterable[str] = DEFAULT_EXCLUDE_DIRS,
    min_chars: int = 200,
    modulus: int = HELDOUT_MODULUS,
) -> list[CorpusFile]:
    """All corpus files under ``root``, sorted by relative path.

    Args:
        root: corpus root (default :func:`stdlib_root`).
        exclude_dirs: directory names to skip anywhere in the path.
        min_chars: skip files with fewer characters (tiny ``__init__.py`` etc.).
        modulus: held-out modulus (see :func:`split_of`).

    Returns:
        ``list[CorpusFile]``; files that are not valid UTF-8 are skipped.

    Raises:
        FileNotFoundError: ``root`` does not exist.
        ValueError: no file is left.
    """
    root = Path(root) if root is not None else stdlib_root()
    if not root.is_dir():
        raise FileNotFoundError(f"corpus root not found: {root}")
    excl = frozenset(exclude_dirs)
    out: list[CorpusFile] = []
    for dirpath, dirnames, filenames in os.walk(root):
        # prune excluded directories and the build-config dir (config-3.11-<platform>)
        dirnames[:] = sorted(d for d in dirnames if d not in excl and not d.startswith("config-3"))
        for fn in sorted(filenames):
            if not fn.endswith(".py") or fn.startswith("_sysconfigdata"):
                continue  # _sysconfigdata_*.py is machine-specific build data
            p = Path(dirpath) / fn
            if not p.is_file():
                continue
            rel = p.relative_to(root).as_posix()
            try:
                text = p.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            if len(text) < min_chars:
                continue
            out.append(CorpusFile(path=p, rel=rel, split=split_of(rel, modulus)))
    if not out:
        raise ValueError(f"no .py files with >= {min_chars} chars found under {root}")
    out.sort(key=lambda f: f.rel)
    return out


def split_files(files: Sequence[CorpusFile]) -> tuple[list[CorpusFile], list[CorpusFile]]:
    """Partition ``files`` into ``(train, heldout)`` (order kept).

    Raises:
        AssertionError: a file appears in both (cannot happen for a valid list).
    """
    train = [f for f in files if f.split == "train"]
    held = [f for f in files if f.split == "heldout"]
    assert not ({f.rel for f in train} & {f.rel for f in held}), "train/held-out files overlap"
    return train, held


def iter_documents(
    split: str = "train", files: Sequence[CorpusFile] | None = None
) -> Iterator[str]:
    """Yield the text of every document of ``split`` (``"train"``, ``"heldout"`` or ``"all"``),
    in relative-path order.

    Args:
        split: which split.
        files: the file list (default :func:`list_corpus_files`).

    Raises:
        ValueError: unknown ``split``.
    """
    if split not in ("train", "heldout", "all"):
        raise ValueError(f"split must be 'train', 'heldout' or 'all', got {split!r}")
    if files is None:
        files = list_corpus_files()
    for f in files:
        if split == "all" or f.split == split:
            yield f.read()


def _candidates(text: str, min_remaining_lines: int) -> list[int]:
    """0-based indices of def/class lines with at least ``min_remaining_lines`` lines
    from that line (inclusive) to the end of the file."""
    lines = text.splitlines(keepends=True)
    return [
        i
        for i, ln in enumerate(lines)
        if _DEF_RE.match(ln) and len(lines) - i >= min_remaining_lines
    ]


def extract_code_prompts(
    files: Sequence[CorpusFile],
    n_prompts: int,
    *,
    n_lines: int = 8,
    tokenizer=None,
    n_tokens: int | None = None,
    max_per_file: int = 3,
    continuation_lines: int = 16,
    seed: int = 0,
) -> list[CodePrompt]:
    """Cut up to ``n_prompts`` prompts from ``files``, each starting at a ``def``,
    ``async def`` or ``class`` line (indented methods count; indentation is kept).

    Length: by default a prompt is exactly ``n_lines`` lines (ending with the last
    line's newline).  If ``tokenizer`` (a :class:`megatron_jf.tokenizer.Tokenizer`) and
    ``n_tokens`` are given, a prompt is instead exactly the first ``n_tokens`` tokens of
    ``tokenizer.encode(text from the def line on)``; ``text`` is their decoding and
    ``token_ids`` the ids (the first ``n_tokens`` ids of encoding the whole rest of the
    file, so they are exactly what the tokenizer gives in context).  A start line
    qualifies if the file has at least ``n_lines + continuation_lines`` lines from it
    to the end (line mode), or more than ``n_tokens`` tokens (token mode; start lines
    whose cut would split a character are skipped).

    Selection (deterministic for given ``files`` and ``seed``): the files are shuffled
    with ``random.Random(seed)``; from each file up to ``max_per_file`` start lines are
    drawn at random (without replacement) until ``n_prompts`` prompts are collected.
    Prompts with identical text are kept only once.

    Args:
        files: corpus files (usually all of one split).
        n_prompts: number of prompts wanted (fewer are returned if the files run out).
        n_lines, tokenizer, n_tokens, max_per_file, continuation_lines, seed: see above.

    Returns:
        ``list[CodePrompt]`` of length ``<= n_prompts``.

    Raises:
        ValueError: non-positive sizes, or ``n_tokens`` without ``tokenizer``.
    """
    if n_prompts < 0 or n_lines < 1 or max_per_file < 1 or continuation_lines < 0:
        raise ValueError("n_prompts must be >= 0 and n_lines, max_per_file >= 1, continuation_lines >= 0")
    if (n_tokens is None) != (tokenizer is None):
        raise ValueError("pass both tokenizer and n_tokens (token mode) or neither (line mode)")
    if n_tokens is not None and n_tokens < 1:
        raise ValueError(f"n_tokens must be >= 1, got {n_tokens}")
    rng = random.Random(seed)
    order = sorted(files, key=lambda f: f.rel)
    rng.shuffle(order)
    out: list[CodePrompt] = []
    seen: set[str] = set()
    for f in order:
        if len(out) >= n_prompts:
            break
        text = f.read()
        lines = text.splitlines(keepends=True)
        min_rem = n_lines + continuation_lines if n_tokens is None else 2
        cands = _candidates(text, min_rem)
        rng.shuffle(cands)
        taken = 0
        for i in cands:
            if taken >= max_per_file or len(out) >= n_prompts:
                break
            if n_tokens is None:
                ptext = "".join(lines[i : i + n_lines])
                cont = "".join(lines[i + n_lines : i + n_lines + continuation_lines])
                ids = None
            else:
                rest = "".join(lines[i:])
                all_ids = tokenizer.encode(rest)
                if len(all_ids) < n_tokens + 1:
                    continue
                ids = tuple(all_ids[:n_tokens])
                ptext = tokenizer.decode(list(ids), skip_special_tokens=False)
                if not rest.startswith(ptext):  # cut inside a multi-byte char; skip
                    continue
                cont = "".join(rest[len(ptext) :].splitlines(keepends=True)[:continuation_lines])
            if ptext in seen:
                continue
            seen.add(ptext)
            out.append(CodePrompt(rel=f.rel, split=f.split, line=i + 1, text=ptext, token_ids=ids, continuation=cont))
            taken += 1
    return out


def make_prompt_sets(
    files: Sequence[CorpusFile],
    n_train: int,
    n_eval: int,
    *,
    drop_contaminated: bool = True,
    seed: int = 0,
    **kwargs,
) -> tuple[list[CodePrompt], list[CodePrompt]]:
    """Train prompts from train files and evaluation prompts from held-out files.

    Args:
        files: the corpus file list (both splits).
        n_train, n_eval: numbers of prompts wanted.
        drop_contaminated: also drop evaluation prompts whose text occurs verbatim in a
            train document (stdlib has a few copied functions), so evaluation text was
            never seen in training.
        seed: selection seed (the eval selection uses ``seed + 1``).
        **kwargs: passed to :func:`extract_code_prompts` (``n_lines``, ``tokenizer``,
            ``n_tokens``, ``max_per_file``, ``continuation_lines``).

    Returns:
        ``(train_prompts, eval_prompts)``.

    Raises:
        AssertionError: the two sets share a file or a prompt text (a bug).
    """
    train_files, held_files = split_files(files)
    train = extract_code_prompts(train_files, n_train, seed=seed, **kwargs)
    # draw more eval candidates than needed so that dropping contaminated ones still
    # leaves n_eval when possible
    pool = extract_code_prompts(held_files, n_eval * 2 if drop_contaminated else n_eval, seed=seed + 1, **kwargs)
    if drop_contaminated:
        train_text = "\n".join(f.read() for f in train_files)
        pool = [p for p in pool if p.text not in train_text]
    train_texts = {p.text for p in train}
    evals = [p for p in pool if p.text not in train_texts][:n_eval]
    assert {p.rel for p in train}.isdisjoint({p.rel for p in evals}), "train/eval prompt files overlap"
    assert all(p.split == "train" for p in train) and all(p.split == "heldout" for p in evals)
    assert train_texts.isdisjoint({p.text for p in evals}), "train/eval prompt texts overlap"
    return train, evals
