"""Scoring of completions and resumable per-sample result files.

:func:`score` dispatches on ``problem.benchmark``: HumanEval/MBPP completions run in the OS sandbox
(:mod:`megatron_jf.eval.sandbox`) and the benchmark's tests compare their returned values here, outside it
(:mod:`megatron_jf.eval.verdict`; pass@1 with one greedy sample, as in Jacobi Forcing Tables 1-3); GSM8K/MATH/
MATH-500 completions are graded by :mod:`megatron_jf.eval.math_grading` under a CPU-time limit, a timeout being
*ungraded* (status ``"ungraded"``), never wrong. :func:`aggregate` gives accuracy per benchmark over the graded
items and lists ungraded ones separately; the paper reports accuracy next to TPF (tokens per forward) and TPS
(tokens per second), which the caller can add to each record with ``make_record(..., extra={...})``.

Code is never executed without OS isolation unless ``isolation="none"`` is passed explicitly
(:class:`megatron_jf.eval.sandbox.SandboxUnavailable` otherwise).

Result files are JSONL, one record per task, rewritten atomically (temporary file in the same directory +
``os.replace``), so an interrupted run leaves either the old or the new file and can be resumed:
:class:`ResultsWriter` skips task ids already present.
"""

from __future__ import annotations

import json
import os
import tempfile
import warnings
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Optional, Sequence

from .benchmarks import CODE_BENCHMARKS, MATH_BENCHMARKS, Problem
from concurrent.futures import ThreadPoolExecutor

from .code_exec import (
    DEFAULT_ISOLATION,
    DEFAULT_MEMORY_BYTES,
    DEFAULT_TIMEOUT_S,
    DEFAULT_WORKERS,
    ExecResult,
    build_humaneval_program,
    build_mbpp_program,
    extract_code,
)
from .math_grading import DEFAULT_SYMBOLIC_CPU_S, GradeResult, grade_gsm8k, grade_math
from .sandbox import check_isolation
from .verdict import verify_humaneval, verify_mbpp

__all__ = [
    "ResultsWriter",
    "Score",
    "aggregate",
    "make_record",
    "program_for",
    "read_jsonl",
    "score",
    "score_many",
    "write_jsonl_atomic",
]


@dataclass(frozen=True)
class Score:
    """Score of one completion.

    Attributes:
        task_id: the problem's task id.
        benchmark: the problem's benchmark.
        correct: passed all tests (code) / answer equivalent to gold (math).
        status: ``"passed"``, ``"failed"``, ``"timeout"`` or ``"error"`` (math: ``"passed"``/``"failed"``/
            ``"ungraded"``, the last when the symbolic step reached its CPU-time limit).
        message: reason (exception and line for code; "predicted X vs gold Y (method)" for math).
        predicted: extracted answer (math) or ``None``.
        gold: gold answer (math) or ``None``.
        duration_s: sandbox wall time for code, seconds (0.0 for math).
        verdict: code: ``"split"`` (decided outside the sandbox) or ``"in-sandbox"``; math: ``""``.
        isolation: code: ``"os"`` or ``"none"`` (ran without OS isolation); math: ``""``.
    """

    task_id: str
    benchmark: str
    correct: bool
    status: str
    message: str = ""
    predicted: Optional[str] = None
    gold: Optional[str] = None
    duration_s: float = 0.0
    verdict: str = ""
    isolation: str = ""

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form."""
        return asdict(self)


def program_for(problem: Problem, completion: str) -> str:
    """The test program the sandbox runs for a code problem (extracted code + tests).

    Raises:
        ValueError: ``problem`` is not a code benchmark.
    """
    code = extract_code(completion)
    if problem.benchmark == "humaneval":
        return build_humaneval_program(problem.prompt, code, problem.entry_point or "", problem.tests[0])
    if problem.benchmark == "mbpp":
        return build_mbpp_program(code, problem.tests, problem.test_setup)
    raise ValueError(f"problem {problem.task_id!r}: {problem.benchmark!r} is not a code benchmark")


def _from_exec(problem: Problem, r: ExecResult, isolation: str) -> Score:
    msg = r.message + (f" [{r.note}]" if r.note else "")
    return Score(problem.task_id, problem.benchmark, r.passed, r.status, msg, None, None, r.duration_s,
                 r.verdict, isolation)


def _verify(problem: Problem, completion: str, *, timeout_s: float, memory_bytes: Optional[int],
            isolation: str) -> ExecResult:
    code = extract_code(completion)
    kw = dict(timeout_s=timeout_s, memory_bytes=memory_bytes, isolation=isolation)
    if problem.benchmark == "humaneval":
        return verify_humaneval(problem.prompt, code, problem.entry_point or "", problem.tests[0], **kw)
    if problem.benchmark == "mbpp":
        return verify_mbpp(code, list(problem.tests), problem.test_setup, entry_point=problem.entry_point, **kw)
    raise ValueError(f"problem {problem.task_id!r}: {problem.benchmark!r} is not a code benchmark")


def _from_grade(problem: Problem, g: GradeResult) -> Score:
    if g.ungraded:
        return Score(problem.task_id, problem.benchmark, False, "ungraded",
                     f"UNGRADED: {g.note} (predicted {g.predicted!r} vs gold {g.gold!r})", g.predicted, g.gold, 0.0)
    if g.predicted is None:
        msg = "no answer found in the completion"
    else:
        msg = f"predicted {g.predicted!r} vs gold {g.gold!r}" + (f" ({g.method})" if g.correct else "")
    return Score(problem.task_id, problem.benchmark, g.correct, "passed" if g.correct else "failed", msg,
                 g.predicted, g.gold, 0.0)


def _check_completion(problem: Problem, completion: Any) -> str:
    if completion is None:
        return ""
    if not isinstance(completion, str):
        raise TypeError(f"problem {problem.task_id!r}: completion must be str, got {type(completion).__name__}")
    return completion


def score(
    problem: Problem,
    completion: Optional[str],
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    memory_bytes: Optional[int] = DEFAULT_MEMORY_BYTES,
    math_timeout_s: float = DEFAULT_SYMBOLIC_CPU_S,
    isolation: str = DEFAULT_ISOLATION,
) -> Score:
    """Score one completion (the model's text after the prompt).

    Args:
        problem: the problem.
        completion: model output; ``None`` counts as an empty completion (wrong).
        timeout_s: sandbox wall-clock limit per problem, seconds (code benchmarks).
        memory_bytes: sandbox address-space limit, bytes (code benchmarks).
        math_timeout_s: CPU-time limit of each symbolic step, CPU seconds (math benchmarks).
        isolation: ``"os"`` (default) or ``"none"`` (code runs without OS isolation; explicit opt-in).

    Returns:
        :class:`Score`. Problems of the completion never raise; they give ``correct=False``.

    Raises:
        TypeError: ``completion`` is neither ``str`` nor ``None``.
        ValueError: unknown benchmark or isolation.
        SandboxUnavailable: code benchmark, ``isolation="os"``, and namespaces do not work here.
    """
    completion = _check_completion(problem, completion)
    if problem.benchmark in CODE_BENCHMARKS:
        check_isolation(isolation)
        r = _verify(problem, completion, timeout_s=timeout_s, memory_bytes=memory_bytes, isolation=isolation)
        return _from_exec(problem, r, isolation)
    if problem.benchmark == "gsm8k":
        return _from_grade(problem, grade_gsm8k(completion, problem.answer or "", timeout_s=math_timeout_s))
    if problem.benchmark in MATH_BENCHMARKS:
        return _from_grade(problem, grade_math(completion, problem.answer or "", timeout_s=math_timeout_s))
    raise ValueError(f"problem {problem.task_id!r}: cannot score benchmark {problem.benchmark!r}")


def score_many(
    problems: Sequence[Problem],
    completions: Sequence[Optional[str]],
    *,
    workers: int = DEFAULT_WORKERS,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    memory_bytes: Optional[int] = DEFAULT_MEMORY_BYTES,
    math_timeout_s: float = DEFAULT_SYMBOLIC_CPU_S,
    isolation: str = DEFAULT_ISOLATION,
) -> list[Score]:
    """Score many completions; code problems run ``workers`` sandboxes at a time. Order is preserved.

    A failure while scoring one item (e.g. a malformed completion type) gives that item an ``"error"`` score
    and the rest continue.

    Raises:
        ValueError: ``problems`` and ``completions`` differ in length, or unknown ``isolation``.
        SandboxUnavailable: there are code problems, ``isolation="os"``, and namespaces do not work here
            (raised before anything runs).
    """
    if len(problems) != len(completions):
        raise ValueError(f"score_many: {len(problems)} problems but {len(completions)} completions")
    if not isinstance(workers, int) or workers < 1:
        raise ValueError(f"score_many: workers must be an int >= 1, got {workers!r}")
    if any(p.benchmark in CODE_BENCHMARKS for p in problems):
        check_isolation(isolation)
    out: list[Optional[Score]] = [None] * len(problems)
    code_items = []
    for i, (p, c) in enumerate(zip(problems, completions)):
        try:
            c = _check_completion(p, c)
            if p.benchmark in CODE_BENCHMARKS:
                code_items.append((i, p, c))
            else:
                out[i] = score(p, c, math_timeout_s=math_timeout_s)
        except Exception as e:  # noqa: BLE001 - keep going
            out[i] = Score(p.task_id, p.benchmark, False, "error", f"{type(e).__name__}: {e}")

    def one(item):
        i, p, c = item
        try:
            r = _verify(p, c, timeout_s=timeout_s, memory_bytes=memory_bytes, isolation=isolation)
            return i, _from_exec(p, r, isolation)
        except Exception as e:  # noqa: BLE001 - keep going after any failure
            return i, Score(p.task_id, p.benchmark, False, "error", f"{type(e).__name__}: {e}", isolation=isolation)

    if workers == 1 or len(code_items) <= 1:
        done = [one(it) for it in code_items]
    else:
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="jf-score") as pool:
            done = list(pool.map(one, code_items))
    for i, sc in done:
        out[i] = sc
    return [s for s in out if s is not None]


def aggregate(scores: Iterable[Score]) -> dict[str, dict[str, Any]]:
    """Accuracy per benchmark.

    Returns:
        ``{benchmark: {"n", "correct", "accuracy", "metric", "status_counts"}}`` where ``accuracy`` is a fraction in
        [0, 1] over the *graded* items and ``metric`` is ``"pass@1"`` for code benchmarks and ``"accuracy"``
        otherwise; plus ``"all"`` over every score when more than one benchmark is present. When some items are
        ungraded (symbolic step over its CPU-time limit) the entry also has ``"ungraded"`` (count) and
        ``"ungraded_ids"``; when some code checks were not split, ``"in_sandbox_ids"``; when code ran without OS
        isolation, ``"unisolated": n``.
    """
    groups: dict[str, list[Score]] = {}
    for s in scores:
        groups.setdefault(s.benchmark, []).append(s)

    def summary(items: list[Score], metric: str) -> dict[str, Any]:
        n = len(items)
        c = sum(1 for s in items if s.correct)
        counts: dict[str, int] = {}
        for s in items:
            counts[s.status] = counts.get(s.status, 0) + 1
        ungraded = [s.task_id for s in items if s.status == "ungraded"]
        graded = n - len(ungraded)
        out = {"n": n, "correct": c, "accuracy": (c / graded) if graded else 0.0, "metric": metric,
               "status_counts": counts}
        if ungraded:
            out["ungraded"] = len(ungraded)
            out["ungraded_ids"] = ungraded
        in_sandbox = [s.task_id for s in items if getattr(s, "verdict", "") == "in-sandbox"]
        if in_sandbox:
            out["in_sandbox_ids"] = in_sandbox
        unisolated = sum(1 for s in items if getattr(s, "isolation", "") == "none")
        if unisolated:
            out["unisolated"] = unisolated
        return out

    out = {b: summary(v, "pass@1" if b in CODE_BENCHMARKS else "accuracy") for b, v in sorted(groups.items())}
    if len(groups) > 1:
        out["all"] = summary([s for v in groups.values() for s in v], "accuracy")
    return out


# ---------------------------------------------------------------------------------------------------------------
# JSONL result files


def make_record(
    problem: Problem,
    completion: Optional[str],
    result: Score,
    *,
    prompt: Optional[str] = None,
    prompt_meta: Optional[dict[str, Any]] = None,
    extra: Optional[dict[str, Any]] = None,
) -> dict[str, Any]:
    """One per-sample record: task id, benchmark, completion, score fields, prompt provenance, extras.

    Args:
        problem, completion, result: what was scored.
        prompt: the rendered prompt text; stored as its SHA-256 (``prompt_sha256``), not verbatim.
        prompt_meta: e.g. :func:`megatron_jf.eval.prompts.prompt_info` output (prompt-set name and hash).
        extra: more JSON-serialisable fields (e.g. ``{"tpf": 3.9, "tps": 150.2, "new_tokens": 311}``); they may
            not overwrite the standard keys.

    Raises:
        ValueError: ``extra`` reuses a standard key or ``result`` belongs to another task.
    """
    from .prompts import text_sha256

    if result.task_id != problem.task_id:
        raise ValueError(f"make_record: score is for {result.task_id!r}, problem is {problem.task_id!r}")
    rec: dict[str, Any] = {
        "task_id": problem.task_id,
        "benchmark": problem.benchmark,
        "completion": completion,
        "correct": result.correct,
        "status": result.status,
        "message": result.message,
        "predicted": result.predicted,
        "gold": result.gold,
        "exec_duration_s": round(result.duration_s, 4),
        "verdict": result.verdict,
        "isolation": result.isolation,
        "prompt_sha256": text_sha256(prompt) if prompt is not None else None,
    }
    if prompt_meta:
        rec["prompt_meta"] = dict(prompt_meta)
    for k, v in (extra or {}).items():
        if k in rec:
            raise ValueError(f"make_record: extra key {k!r} would overwrite a standard field")
        rec[k] = v
    return rec


def read_jsonl(path: str) -> list[dict[str, Any]]:
    """Read a JSONL file of objects; a missing file gives ``[]``.

    A truncated **last** line (e.g. a file written by another tool that was interrupted) is skipped with a
    warning; any other invalid line raises.

    Raises:
        ValueError: invalid JSON or a non-object on a line other than the last (message gives file:line).
    """
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    while lines and not lines[-1].strip():
        lines.pop()
    out = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            if not isinstance(obj, dict):
                raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
        except ValueError as e:
            if i == len(lines):
                warnings.warn(f"{path}:{i}: skipping truncated last line ({e})", RuntimeWarning, stacklevel=2)
                break
            raise ValueError(f"{path}:{i}: invalid record ({e})") from e
        out.append(obj)
    return out


def write_jsonl_atomic(path: str, records: Iterable[dict[str, Any]]) -> None:
    """Write ``records`` as JSONL to a temporary file next to ``path``, fsync it, then ``os.replace`` it into place.

    Raises:
        TypeError: a record is not JSON-serialisable (the target file is left untouched).
        OSError: the directory is not writable.
    """
    from megatron_jf.fileio import atomic_write_text

    atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))


class ResultsWriter:
    """Resumable per-sample JSONL writer.

    Loads the existing file (if any); :meth:`add` ignores records whose ``task_id`` is already present; the
    file is rewritten atomically every ``flush_every`` new records and on :meth:`flush` / leaving the ``with``
    block (also when an exception escapes it, so finished samples are kept).

    Example::

        with ResultsWriter("out/humaneval.jsonl") as w:
            for p in w.pending(problems):
                ...
                w.add(make_record(p, completion, score(p, completion)))

    Args:
        path: output file.
        flush_every: number of new records between rewrites (>= 1).

    Raises:
        ValueError: ``flush_every`` < 1, or the existing file is corrupt (see :func:`read_jsonl`) or has records
            without ``task_id``.
    """

    def __init__(self, path: str, flush_every: int = 20):
        if not isinstance(flush_every, int) or flush_every < 1:
            raise ValueError(f"ResultsWriter: flush_every must be an int >= 1, got {flush_every!r}")
        self.path = path
        self.flush_every = flush_every
        self.records = read_jsonl(path)
        self.done: set[str] = set()
        for i, r in enumerate(self.records):
            if "task_id" not in r:
                raise ValueError(f"{path}: record {i + 1} has no 'task_id'")
            self.done.add(str(r["task_id"]))
        self._unflushed = 0

    def pending(self, problems: Iterable[Problem]) -> list[Problem]:
        """Problems whose ``task_id`` is not yet in the file."""
        return [p for p in problems if p.task_id not in self.done]

    def add(self, record: dict[str, Any]) -> bool:
        """Add a record; returns ``False`` (and ignores it) if its ``task_id`` is already present.

        Raises:
            ValueError: the record has no ``task_id``.
        """
        if "task_id" not in record:
            raise ValueError("ResultsWriter.add: record has no 'task_id'")
        tid = str(record["task_id"])
        if tid in self.done:
            return False
        self.records.append(record)
        self.done.add(tid)
        self._unflushed += 1
        if self._unflushed >= self.flush_every:
            self.flush()
        return True

    def flush(self) -> None:
        """Rewrite the file atomically with all records."""
        write_jsonl_atomic(self.path, self.records)
        self._unflushed = 0

    def __enter__(self) -> "ResultsWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.flush()
