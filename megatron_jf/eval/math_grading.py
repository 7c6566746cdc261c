"""Final-answer extraction, normalisation and equivalence for GSM8K and MATH (Jacobi Forcing Tables 1-3).

Pipeline used by :func:`grade_gsm8k` and :func:`grade_math`:

1. **Extraction** (:func:`extract_answer`): the content of the last ``\\boxed{...}`` / ``\\fbox{...}`` (nested braces
   and escaped ``\\{``/``\\}`` handled; a truncated, unbalanced last box falls back to the previous one), else the
   last GSM8K ``#### N`` line, else Minerva's ``Final Answer: The final answer is X. I hope it is correct.``, else
   the last "the answer is X", else the last LaTeX expression (``math-verify``'s LaTeX extraction of ``$...$``,
   ``\\(...\\)``, ``\\[...\\]`` for MATH; for every benchmark a bare trailing ``\\frac``/``\\sqrt``/``\\binom``,
   so ``\\dfrac{23}{7}`` is not read as ``7``), else the last number in the text.
2. **Normalisation** (:func:`normalize_answer`), following Hendrycks et al.'s MATH ``strip_string`` and
   Lewkowycz et al.'s (Minerva, 2022, App. D) ``normalize_final_answer``: outer ``$``, ``\\left``/``\\right``,
   ``\\dfrac``/``\\tfrac`` -> ``\\frac``, ``\\frac12`` -> ``\\frac{1}{2}``, ``\\sqrt2`` -> ``\\sqrt{2}``, degrees
   (``^\\circ``), ``\\%``, ``\\$``, unit words (``dollars``, ``cm``, ...), ``\\text{...}``/``\\mathrm{...}``
   wrappers, LaTeX spacing, thousands separators, trailing ``.``, ``5.0`` -> ``5``, ``x = 5`` -> ``5``.
3. **Equivalence** (:func:`answers_equivalent`): equal strings after normalisation; else both numbers (integers,
   decimals, ``a/b``, ``\\frac{a}{b}``) compared exactly, with a relative tolerance of 1e-4 only between a decimal
   and a fraction (``0.3333`` vs ``\\frac{1}{3}``) or for scientific notation; else tuples/intervals element by
   element (bare comma lists and ``\\{...\\}`` sets in any order, bracketed tuples/intervals in order); else symbolic
   equality via ``math-verify`` if installed (``math_verify.parse`` + ``math_verify.verify``), or
   sympy ``simplify(a - b) == 0`` on a light LaTeX->sympy translation, under a CPU-time limit.

The limit is **CPU time of the grading thread** (``time.pthread_getcpuclockid``), not wall-clock time, so a busy
machine does not change a verdict: a watchdog thread reads that clock and, past the limit, raises
:class:`SymbolicTimeout` in the grading thread (``PyThreadState_SetAsyncExc``). A timeout is never a wrong
answer: :func:`grade_gsm8k` / :func:`grade_math` return ``ungraded=True`` (``method="timeout"``), which
:func:`megatron_jf.eval.scoring.aggregate` counts and lists separately. Inputs that could make sympy/bignum
arithmetic run away (very long strings, huge exponents/factorials) skip the symbolic step and count as not
equivalent.
"""

from __future__ import annotations

import ctypes
import logging
import math
import re
import threading
import time
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from typing import Any, Callable, Optional

__all__ = [
    "DEFAULT_SYMBOLIC_CPU_S",
    "GradeResult",
    "SymbolicTimeout",
    "answers_equivalent",
    "equivalence_method",
    "extract_answer",
    "extract_gsm8k_gold",
    "grade_gsm8k",
    "grade_math",
    "last_boxed",
    "normalize_answer",
    "symbolic_backend",
]

#: relative tolerance used for numeric comparison (as in Qwen2.5-Math's ``math_equal``)
NUMERIC_REL_TOL = 1e-4
#: default CPU-time limit for one symbolic step (comparison or LaTeX extraction), CPU seconds of the grading thread
DEFAULT_SYMBOLIC_CPU_S = 20.0
#: former name of :data:`DEFAULT_SYMBOLIC_CPU_S` (the limit is CPU time now)
DEFAULT_SYMBOLIC_TIMEOUT_S = DEFAULT_SYMBOLIC_CPU_S
_MAX_SYMBOLIC_CHARS = 300


@dataclass(frozen=True)
class GradeResult:
    """Outcome of grading one math completion.

    Attributes:
        correct: the predicted answer is equivalent to the gold answer.
        predicted: the extracted (un-normalised) answer, or ``None`` when nothing could be extracted.
        gold: the gold answer used (un-normalised).
        method: how equivalence was decided: ``"string"``, ``"numeric"``, ``"tuple"``, ``"symbolic"``,
            ``"none"`` (not equivalent / no prediction) or ``"timeout"`` (ungraded).
        ungraded: the CPU-time limit of a symbolic step was reached; neither right nor wrong.
        note: why it is ungraded.
    """

    correct: bool
    predicted: Optional[str]
    gold: str
    method: str
    ungraded: bool = False
    note: str = ""


# ---------------------------------------------------------------------------------------------------------------
# extraction


def _match_brace(text: str, open_idx: int) -> Optional[int]:
    """Index of the ``}`` matching ``text[open_idx] == "{"``; ``\\{``/``\\}`` are skipped. ``None`` if unbalanced."""
    depth = 0
    i = open_idx
    n = len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return None


_BOX_RE = re.compile(r"\\(?:boxed|fbox)(?![a-zA-Z])")


def last_boxed(text: Optional[str]) -> Optional[str]:
    """Content of the last ``\\boxed{...}`` or ``\\fbox{...}`` in ``text``.

    Handles nested braces (``\\boxed{\\frac{1}{2}}`` -> ``\\frac{1}{2}``), escaped braces, and the brace-less form
    ``\\boxed 5``. If the last box is unbalanced (truncated generation) or empty, earlier boxes are tried.

    Args:
        text: any string (``None`` gives ``None``).

    Returns:
        The stripped box content, or ``None`` if there is no usable box.
    """
    if not text:
        return None
    starts = [m.end() for m in _BOX_RE.finditer(text)]
    for pos in reversed(starts):
        j = pos
        while j < len(text) and text[j] in " \t":
            j += 1
        if j < len(text) and text[j] == "{":
            end = _match_brace(text, j)
            if end is None:
                continue
            content = text[j + 1 : end].strip()
        elif pos < len(text) and text[pos] == " ":
            m = re.match(r"\s*([^\s$]+)", text[pos:])
            content = m.group(1).strip() if m else ""
        else:
            continue
        if content:
            return content
    return None


def extract_gsm8k_gold(answer: Optional[str]) -> Optional[str]:
    """The number after the last ``####`` of a GSM8K reference answer, with thousands commas removed.

    Args:
        answer: the GSM8K ``answer`` field (worked solution ending in ``#### N``), or a bare answer.

    Returns:
        e.g. ``"1450000"`` for ``"... #### 1,450,000"``; ``None`` if there is no ``####``.
    """
    if not answer or "####" not in answer:
        return None
    tail = answer.rsplit("####", 1)[1].strip()
    if not tail:
        return None
    tail = tail.splitlines()[0].strip()
    return tail.replace(",", "")


_NUMBER_RE = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_MINERVA_RE = re.compile(r"final answer is\s*(.+?)\.?\s*I hope it is correct", re.IGNORECASE | re.DOTALL)
_ANSWER_IS_RE = re.compile(r"answer is[:\s]*(.+?)(?:\.\s|\.?\s*$|\n)", re.IGNORECASE)


def extract_answer(text: Optional[str], benchmark: str = "math", *,
                   cpu_s: float = DEFAULT_SYMBOLIC_CPU_S) -> Optional[str]:
    """Extract the final answer from a model completion.

    Order: last ``\\boxed{}``/``\\fbox{}``; last ``#### N``; Minerva "Final Answer: The final answer is X. I hope it
    is correct."; last "the answer is X"; the last LaTeX expression (``math-verify``'s LaTeX extraction for MATH,
    where ``$`` is math and not currency; a bare trailing ``\\frac``/``\\sqrt``/``\\binom`` for any benchmark);
    last number in the text.

    Args:
        text: the completion (``None``/empty gives ``None``).
        benchmark: ``"gsm8k"``, ``"math"`` or ``"math500"``; for GSM8K a non-numeric extracted answer is reduced
            to its last number (``"9 * 2 = 18"`` -> ``"18"``).
        cpu_s: CPU-time limit of the ``math-verify`` extraction, seconds.

    Returns:
        The raw (un-normalised) answer string, or ``None``.

    Raises:
        SymbolicTimeout: the ``math-verify`` extraction used more than ``cpu_s`` CPU seconds.
    """
    if not text:
        return None
    ans = last_boxed(text)
    if ans is None and "####" in text:
        tail = text.rsplit("####", 1)[1].strip()
        ans = tail.splitlines()[0].strip() if tail else None
    if ans is None:
        ms = list(_MINERVA_RE.finditer(text))
        if ms:
            ans = ms[-1].group(1).strip()
    if ans is None:
        ms = list(_ANSWER_IS_RE.finditer(text))
        if ms:
            ans = ms[-1].group(1).strip()
    if ans is None:
        ans = _latex_answer(text, benchmark, cpu_s)
    if ans is None:
        ms = _NUMBER_RE.findall(text)
        ans = ms[-1] if ms else None
    if ans is None:
        return None
    ans = ans.strip()
    if ans.startswith("$") and ans.endswith("$") and len(ans) >= 2:
        ans = ans.strip("$").strip()
    if benchmark == "gsm8k":
        norm = normalize_answer(ans)
        if _to_number(norm) is None:
            nums = _NUMBER_RE.findall(norm.replace("\\frac", ""))
            if nums:
                ans = nums[-1]
    return ans or None


_BARE_LATEX_RE = re.compile(r"(?:-\s*)?(?:\d+(?:\.\d+)?\s*)?\\(?:[dt]?frac|sqrt|binom)(?![a-zA-Z])")


def _bare_latex_span(text: str) -> Optional[str]:
    """The last ``\\frac{a}{b}`` / ``\\sqrt{x}`` / ``\\binom{n}{k}`` (with a leading sign/coefficient) when no
    number follows it in the text."""
    for m in reversed(list(_BARE_LATEX_RE.finditer(text))):
        end = m.end()
        groups = 2 if "sqrt" not in m.group(0) else 1
        j = end
        for _ in range(groups):
            while j < len(text) and text[j] in " \t":
                j += 1
            if j < len(text) and text[j] == "[" and "sqrt" in m.group(0):
                k = text.find("]", j)
                j = k + 1 if k > 0 else j
            if j < len(text) and text[j] == "{":
                k = _match_brace(text, j)
                if k is None:
                    break
                j = k + 1
            elif j < len(text) and text[j].isalnum():
                j += 1
            else:
                break
        else:
            if _NUMBER_RE.search(text, j) is None:
                return text[m.start():j].strip()
            return None
    return None


def _mv_latex_extract(text: str) -> Optional[str]:
    from math_verify import LatexExtractionConfig, parse

    res = parse(text, extraction_config=[LatexExtractionConfig()], parsing_timeout=None)
    if len(res) >= 2 and isinstance(res[1], str) and res[1].strip():
        return res[1].strip()
    return None


def _latex_answer(text: str, benchmark: str, cpu_s: float) -> Optional[str]:
    """``math-verify``'s LaTeX extraction (MATH only: in GSM8K ``$`` is currency), then a bare trailing fraction."""
    if benchmark != "gsm8k" and ("$" in text or "\\(" in text or "\\[" in text) \
            and symbolic_backend() == "math-verify":
        try:
            got = _run_with_cpu_limit(lambda: _mv_latex_extract(text), cpu_s)
        except SymbolicTimeout:
            raise
        except Exception:  # noqa: BLE001 - an extraction error means "nothing found"
            got = None
        if got:
            return got
    return _bare_latex_span(text)


# ---------------------------------------------------------------------------------------------------------------
# normalisation

_UNIT_WORDS = (
    "dollars", "dollar", "cents", "cent", "units", "unit", "square", "sq", "cubic", "inches", "inch", "feet", "foot",
    "ft", "yards", "yard", "miles", "mile", "mph", "km", "kilometers", "kilometer", "meters", "meter", "metres",
    "cm", "centimeters", "centimeter", "mm", "millimeters", "kg", "kilograms", "grams", "gram", "gm", "pounds",
    "pound", "lbs", "lb", "ounces", "ounce", "oz", "liters", "liter", "litres", "ml", "gallons", "gallon",
    "hours", "hour", "hrs", "minutes", "minute", "mins", "seconds", "second", "secs", "days", "day", "weeks",
    "week", "months", "month", "years", "year", "degrees", "degree", "percent", "points", "point", "ways", "people",
    "students", "dogs", "cats", "apples", "cookies", "pages", "books", "marbles", "eggs", "times", "steps",
    "digits", "integers", "numbers", "edges", "sides", "games", "boxes", "bags", "tickets", "items",
)
_UNIT_RE = re.compile(r"(?<![A-Za-z\\])(?:" + "|".join(_UNIT_WORDS) + r")(?:\^?\{?[23]\}?)?(?![A-Za-z])", re.IGNORECASE)
_TEXT_CMD_RE = re.compile(r"\\(?:text|textbf|textit|textrm|mathrm|mathbf|mathit|mbox|operatorname)\s*\{")


def _unwrap_text_commands(s: str) -> str:
    """``\\text{abc}`` -> ``abc`` (also ``\\mathrm``, ``\\mbox``, ...); unit-only contents are dropped."""
    out = []
    i = 0
    while True:
        m = _TEXT_CMD_RE.search(s, i)
        if not m:
            out.append(s[i:])
            break
        open_idx = m.end() - 1
        end = _match_brace(s, open_idx)
        if end is None:
            out.append(s[i:])
            break
        out.append(s[i : m.start()])
        inner = s[open_idx + 1 : end]
        i = end + 1
        if _UNIT_RE.sub("", inner).strip(" .,\t") == "" and out and "".join(out).strip():
            inner = ""  # a unit such as \text{ cm} or \mbox{ inches}^2 after a value
            m_pow = re.match(r"\s*\^\s*\{?\s*[23]\s*\}?", s[i:])
            if m_pow:
                i += m_pow.end()
        out.append(inner)
    return "".join(out)


def _fix_fracs(s: str) -> str:
    """``\\frac12`` -> ``\\frac{1}{2}``, ``\\frac1{2}`` -> ``\\frac{1}{2}``, ``\\frac{1}2`` -> ``\\frac{1}{2}``."""
    s = re.sub(r"\\frac\s*(\d)\s*(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac\s*(\d)\s*\{", r"\\frac{\1}{", s)
    s = re.sub(r"\\frac\s*(\{[^{}]*\})\s*(\d)", r"\\frac\1{\2}", s)
    return s


_THOUSANDS_RE = re.compile(r"^[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_SIMPLE_LHS_RE = re.compile(r"^\s*(?:[A-Za-z]|\\[A-Za-z]+)(?:_\{?\w+\}?)?\s*$")


def normalize_answer(ans: Optional[str]) -> str:
    """Canonical string form of a final answer (see the module docstring for the rules).

    Args:
        ans: raw answer (``None`` gives ``""``).

    Returns:
        Normalised string without whitespace (a space is kept only between a LaTeX command and a following letter,
        e.g. ``\\pi r``).
    """
    if ans is None:
        return ""
    s = str(ans).strip()
    s = s.replace("\n", " ").replace("\u2212", "-").replace("\u00b0", "")
    # outer math delimiters
    for a, b in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if s.startswith(a) and s.endswith(b) and len(s) >= len(a) + len(b):
            s = s[len(a) : len(s) - len(b)].strip()
    # a nested box that survived extraction
    inner = last_boxed(s)
    if inner is not None and re.fullmatch(r"\s*\\(?:boxed|fbox)\s*\{.*\}\s*", s, re.DOTALL):
        s = inner
    # LaTeX thousands separators "5,\!525" / "5{,}525", then spacing commands and display sizing
    s = re.sub(r"(?<=\d)(?:,\\!|\{,\})(?=\d{3})", "", s)
    s = re.sub(r"\\[,;:! ]", "", s)
    s = s.replace("~", " ")
    s = re.sub(r"\\(?:displaystyle|textstyle|scriptstyle)(?![A-Za-z])", "", s)
    s = re.sub(r"\\(?:left|right|big|Big|bigg|Bigg)(?![A-Za-z])\s*(\\[{}|]|[()\[\]|.]|\\langle|\\rangle)?",
               lambda m: "" if (m.group(1) in (None, ".")) else m.group(1), s)
    s = re.sub(r"\\[dt]frac(?![A-Za-z])", r"\\frac", s)
    # degrees, percent, currency
    s = re.sub(r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ|\\circ|\\degree", "", s)
    s = s.replace("\\%", "").replace("%", "")
    s = s.replace("\\$", "").replace("$", "")
    s = s.replace("{,}", "")
    # "1, 2, \text{ and } 3" / "19 \text{ and } 43" -> comma lists (Minerva's substitution)
    s = re.sub(r",?\s*\\(?:text|mbox|textrm)\{\s*and\s*\}\s*", ",", s)
    # text wrappers and units
    s = _unwrap_text_commands(s)
    stripped = _UNIT_RE.sub("", s)
    if stripped.strip(" .,") and stripped != s:
        s = stripped
    s = re.sub(r"\\mathrm\{th\}|(?<=\d)(?:st|nd|rd|th)\b", "", s)
    # sqrt/frac shorthand
    s = re.sub(r"\\sqrt\s*(\w)", r"\\sqrt{\1}", s)
    s = _fix_fracs(s)
    # whitespace: keep one space only between a command and a following letter
    s = re.sub(r"(\\[A-Za-z]+)\s+(?=[A-Za-z])", "\\1\x00", s)
    s = re.sub(r"\s+", "", s).replace("\x00", " ")
    s = s.rstrip(".").rstrip(",").rstrip(";")
    # x = 5  ->  5   (single assignment with a simple variable on the left)
    if s.count("=") == 1 and "\\le" not in s and "\\ge" not in s:
        lhs, rhs = s.split("=")
        if _SIMPLE_LHS_RE.match(lhs) and rhs:
            s = rhs
    # multiple choice "(C)" -> "C"
    m = re.fullmatch(r"\(([A-Ea-e])\)", s)
    if m:
        s = m.group(1).upper()
    # thousands separators
    if _THOUSANDS_RE.match(s):
        s = s.replace(",", "")
    # canonical decimal: 5.0 -> 5, 0.50 -> 0.5, .5 -> 0.5, +3 -> 3
    if re.fullmatch(r"[-+]?(?:\d+\.?\d*|\.\d+)", s):
        try:
            d = Decimal(s)
            s = format(d.normalize(), "f") if d == d.to_integral_value() or "." in s else s
            if "." in s:
                s = s.rstrip("0").rstrip(".")
            if s in ("-0", "+0"):
                s = "0"
            s = s.lstrip("+")
        except InvalidOperation:
            pass
    return s


# ---------------------------------------------------------------------------------------------------------------
# numbers / tuples

_FRAC_NUM_RE = re.compile(r"^(-?)\\frac\{(-?\d+(?:\.\d+)?)\}\{(-?\d+(?:\.\d+)?)\}$")
_PLAIN_NUM_RE = re.compile(r"^[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?$")
_SLASH_NUM_RE = re.compile(r"^(-?\d+(?:\.\d+)?)/(-?\d+(?:\.\d+)?)$")


def _to_number(s: str) -> Optional[float]:
    """Value of a normalised answer that is a plain number, ``a/b`` or ``\\frac{a}{b}`` (numeric a, b)."""
    v = _to_exact(s)
    if v is not None:
        return float(v[0])
    if s and _PLAIN_NUM_RE.match(s):
        try:
            return float(s)
        except (ValueError, OverflowError):
            return None
    return None


def _to_exact(s: str) -> Optional[tuple[Fraction, bool]]:
    """Exact value of an integer, a finite decimal, ``a/b`` or ``\\frac{a}{b}``, and whether it was written as a
    fraction (``True``) or as an integer/decimal (``False``). ``None`` for anything else (incl. scientific notation)."""
    if not s:
        return None
    try:
        if re.fullmatch(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)", s):
            return Fraction(s), False
        m = _SLASH_NUM_RE.match(s)
        if m:
            den = Fraction(m.group(2))
            return (Fraction(m.group(1)) / den, True) if den != 0 else None
        m = _FRAC_NUM_RE.match(s)
        if m:
            den = Fraction(m.group(3))
            if den == 0:
                return None
            v = Fraction(m.group(2)) / den
            return (-v if m.group(1) else v), True
    except (ValueError, ZeroDivisionError):
        return None
    return None


def _numbers_equal(a: str, b: str) -> Optional[bool]:
    """``None`` if either side is not a number; else exact equality for exact numbers (integers, decimals,
    fractions), relative tolerance :data:`NUMERIC_REL_TOL` when a decimal is compared with a fraction
    (``0.3333`` vs ``1/3``) or scientific notation is involved."""
    ea, eb = _to_exact(a), _to_exact(b)
    if ea is not None and eb is not None:
        if ea[0] == eb[0]:
            return True
        if ea[1] != eb[1]:  # decimal approximation of a fraction
            return math.isclose(float(ea[0]), float(eb[0]), rel_tol=NUMERIC_REL_TOL, abs_tol=1e-12)
        return False
    na, nb = _to_number(a), _to_number(b)
    if na is None or nb is None:
        return None
    return math.isclose(na, nb, rel_tol=NUMERIC_REL_TOL, abs_tol=1e-12)


def _split_top_level(s: str, sep: str = ",") -> list[str]:
    parts, depth, cur = [], 0, []
    i = 0
    while i < len(s):
        c = s[i]
        if c == "\\" and i + 1 < len(s) and s[i + 1] in "{}":
            cur.append(s[i : i + 2])
            i += 2
            continue
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        if c == sep and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(c)
        i += 1
    parts.append("".join(cur))
    return parts


def _as_tuple(s: str) -> Optional[tuple[str, str, list[str]]]:
    """``(a,b)`` / ``[a,b)`` / ``\\{a,b\\}`` / ``a,b`` -> (open, close, items), for top-level comma lists."""
    open_c = close_c = ""
    body = s
    if s.startswith("\\{") and s.endswith("\\}"):
        open_c, close_c, body = "\\{", "\\}", s[2:-2]
    elif len(s) >= 2 and s[0] in "([" and s[-1] in ")]":
        # make sure the outer brackets enclose the whole string
        depth = 0
        for i, c in enumerate(s):
            depth += c in "([{"
            depth -= c in ")]}"
            if depth == 0 and i < len(s) - 1:
                return _bare_tuple(s)
        open_c, close_c, body = s[0], s[-1], s[1:-1]
    else:
        return _bare_tuple(s)
    items = _split_top_level(body)
    if len(items) < 2:
        return None
    return open_c, close_c, items


def _bare_tuple(s: str) -> Optional[tuple[str, str, list[str]]]:
    items = _split_top_level(s)
    return ("", "", items) if len(items) >= 2 else None


# ---------------------------------------------------------------------------------------------------------------
# symbolic

_MV_STATE: dict[str, Any] = {}


def symbolic_backend() -> str:
    """``"math-verify"`` if the ``math_verify`` package imports, else ``"sympy"``."""
    if "backend" not in _MV_STATE:
        try:
            import math_verify  # noqa: F401

            _MV_STATE["backend"] = "math-verify"
        except Exception:  # pragma: no cover - depends on the environment
            _MV_STATE["backend"] = "sympy"
    return _MV_STATE["backend"]


class SymbolicTimeout(TimeoutError):
    """A symbolic step used more CPU time than its limit; the answer is *ungraded*, not wrong."""


class _CpuLimit(BaseException):
    """Raised asynchronously in the grading thread by the watchdog (a BaseException, so ``except Exception``
    inside sympy / math-verify does not swallow it)."""


def _set_async_exc(tid: int, exc) -> None:
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(tid), ctypes.py_object(exc) if exc else None)


def _run_with_cpu_limit(fn: Callable[[], Any], cpu_s: float) -> Any:
    """Run ``fn()`` in this thread; raise :class:`SymbolicTimeout` once this thread has used ``cpu_s`` CPU seconds.

    A watchdog thread polls this thread's CPU clock every 10 ms (``time.pthread_getcpuclockid``); time spent
    waiting for a CPU or for the GIL is not counted, so the outcome does not depend on machine load.
    """
    if not (cpu_s > 0):
        raise ValueError(f"CPU-time limit must be > 0 seconds, got {cpu_s!r}")
    tid = threading.get_ident()
    clock = time.pthread_getcpuclockid(tid)
    start = time.clock_gettime(clock)
    stop = threading.Event()
    fired = []

    def watch():
        while not stop.wait(0.01):
            if time.clock_gettime(clock) - start > cpu_s:
                fired.append(1)
                _set_async_exc(tid, _CpuLimit)
                return

    w = threading.Thread(target=watch, daemon=True, name="jf-symbolic-watchdog")
    w.start()
    try:
        try:
            return fn()
        finally:
            stop.set()
            w.join()
            if fired:
                _set_async_exc(tid, None)  # drop a pending, undelivered exception
    except _CpuLimit:
        raise SymbolicTimeout(f"symbolic step exceeded {cpu_s:g} CPU seconds") from None


_RUNAWAY_RE = re.compile(r"(?:\^|\*\*)\s*\{?\s*-?\d{4,}|\d{3,}\s*!|\\binom\{\d{4,}")


def _latex_to_sympy_str(s: str) -> str:
    """Very small LaTeX -> sympy syntax translation for the fallback path."""
    t = s
    for _ in range(5):
        t = re.sub(r"\\frac\{([^{}]*)\}\{([^{}]*)\}", r"((\1)/(\2))", t)
        t = re.sub(r"\\sqrt\[([^{}\]]*)\]\{([^{}]*)\}", r"((\2)**(1/(\1)))", t)
        t = re.sub(r"\\sqrt\{([^{}]*)\}", r"sqrt(\1)", t)
    t = t.replace("\\pi", "pi").replace("\\cdot", "*").replace("\\times", "*").replace("\\infty", "oo")
    t = re.sub(r"\\(sin|cos|tan|log|ln|exp)", r"\1", t)
    t = t.replace("^", "**").replace("{", "(").replace("}", ")")
    return t


def _sympy_equal(a: str, b: str) -> bool:
    import sympy
    from sympy.parsing.sympy_parser import (
        convert_xor,
        implicit_multiplication_application,
        parse_expr,
        standard_transformations,
    )

    tr = standard_transformations + (implicit_multiplication_application, convert_xor)
    ea = parse_expr(_latex_to_sympy_str(a), transformations=tr, evaluate=True)
    eb = parse_expr(_latex_to_sympy_str(b), transformations=tr, evaluate=True)
    diff = sympy.simplify(ea - eb)
    return bool(diff == 0)


class _DropTimeoutWarning(logging.Filter):
    """math-verify warns that its own timeout is off; we apply our own guard (``_run_with_cpu_limit``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Timeout is disabled")


for _name in ("math_verify.grader", "math_verify.parser"):
    logging.getLogger(_name).addFilter(_DropTimeoutWarning())


def _math_verify_equal(pred: str, gold: str) -> bool:
    from math_verify import parse, verify

    g = parse("$" + gold + "$", parsing_timeout=None)
    p = parse("$" + pred + "$", parsing_timeout=None)
    if not g or not p:
        return False
    return bool(verify(g, p, timeout_seconds=None))


def _symbolic_equal(pred: str, gold: str, timeout_s: float, backend: Optional[str] = None) -> bool:
    if len(pred) + len(gold) > _MAX_SYMBOLIC_CHARS or _RUNAWAY_RE.search(pred) or _RUNAWAY_RE.search(gold):
        return False
    backend = backend or symbolic_backend()
    if backend not in ("math-verify", "sympy"):
        raise ValueError(f"unknown symbolic backend {backend!r}; expected 'math-verify' or 'sympy'")
    fn = _math_verify_equal if backend == "math-verify" else _sympy_equal
    try:
        return bool(_run_with_cpu_limit(lambda: fn(pred, gold), timeout_s))
    except SymbolicTimeout:
        raise
    except Exception:  # parse errors etc. mean "not shown equivalent"  # noqa: BLE001
        return False


# ---------------------------------------------------------------------------------------------------------------
# equivalence and grading


def equivalence_method(
    pred: Optional[str],
    gold: Optional[str],
    *,
    symbolic: bool = True,
    timeout_s: float = DEFAULT_SYMBOLIC_TIMEOUT_S,
    backend: Optional[str] = None,
    _depth: int = 0,
) -> Optional[str]:
    """Decide whether two raw answers are equivalent and say how.

    Args:
        pred: predicted answer (raw; ``None`` is never equivalent).
        gold: gold answer (raw).
        symbolic: allow the symbolic step (math-verify or sympy).
        timeout_s: CPU-time limit of the symbolic step, CPU seconds of the calling thread.
        backend: ``"math-verify"``, ``"sympy"`` or ``None`` (math-verify when installed, see
            :func:`symbolic_backend`).

    Returns:
        ``"string"``, ``"numeric"``, ``"tuple"`` or ``"symbolic"`` when equivalent, else ``None``.

    Raises:
        ValueError: unknown ``backend``.
        SymbolicTimeout: the symbolic step reached its CPU-time limit (undecided, not "not equivalent").
    """
    if pred is None or gold is None:
        return None
    a, b = normalize_answer(pred), normalize_answer(gold)
    if not a or not b:
        return None
    if a == b:
        return "string"
    if re.fullmatch(r"[A-Za-z ]+", a) and re.fullmatch(r"[A-Za-z ]+", b):
        return "string" if a.lower() == b.lower() else None
    num = _numbers_equal(a, b)
    if num is not None:
        return "numeric" if num else None
    ta, tb = _as_tuple(a), _as_tuple(b)
    if ta is not None and tb is not None and _depth < 3:
        if ta[0] == tb[0] and ta[1] == tb[1] and len(ta[2]) == len(tb[2]):

            def eq(x: str, y: str) -> bool:
                return equivalence_method(
                    x, y, symbolic=symbolic, timeout_s=timeout_s, backend=backend, _depth=_depth + 1
                ) is not None

            if ta[0] == "" or ta[0] == "\\{":  # bare list or set: order does not matter
                remaining = list(tb[2])
                for x in ta[2]:
                    j = next((k for k, y in enumerate(remaining) if eq(x, y)), None)
                    if j is None:
                        return None
                    remaining.pop(j)
                return "tuple"
            if all(eq(x, y) for x, y in zip(ta[2], tb[2])):
                return "tuple"
        return None
    if (ta is None) != (tb is None):
        return None
    if symbolic and _symbolic_equal(a, b, timeout_s, backend):
        return "symbolic"
    return None


def answers_equivalent(
    pred: Optional[str],
    gold: Optional[str],
    *,
    symbolic: bool = True,
    timeout_s: float = DEFAULT_SYMBOLIC_TIMEOUT_S,
    backend: Optional[str] = None,
) -> bool:
    """``True`` if ``pred`` and ``gold`` denote the same answer (see :func:`equivalence_method`).

    Raises:
        SymbolicTimeout: undecided within the CPU-time limit.
    """
    return equivalence_method(pred, gold, symbolic=symbolic, timeout_s=timeout_s, backend=backend) is not None


def grade_gsm8k(completion: Optional[str], gold: str, *, timeout_s: float = DEFAULT_SYMBOLIC_TIMEOUT_S) -> GradeResult:
    """Grade a GSM8K completion (accuracy in the paper's Tables 1-3).

    Args:
        completion: model output text.
        gold: the gold number, or the full GSM8K reference answer ending in ``#### N``.
        timeout_s: CPU-time limit of each symbolic step, CPU seconds (rarely reached for GSM8K).

    Returns:
        :class:`GradeResult` (``ungraded=True`` when a symbolic step reached its CPU-time limit).

    Raises:
        ValueError: ``gold`` is empty.
    """
    if gold is None or not str(gold).strip():
        raise ValueError("grade_gsm8k: empty gold answer")
    g = extract_gsm8k_gold(str(gold)) if "####" in str(gold) else str(gold).strip()
    return _grade(completion, g, "gsm8k", timeout_s)


def _grade(completion: Optional[str], g: str, benchmark: str, cpu_s: float) -> GradeResult:
    pred = None
    try:
        pred = extract_answer(completion, benchmark, cpu_s=cpu_s)
        method = equivalence_method(pred, g, timeout_s=cpu_s)
    except SymbolicTimeout as e:
        logging.getLogger(__name__).warning("ungraded: %s (predicted %r, gold %r)", e, pred, g)
        return GradeResult(False, pred, g, "timeout", ungraded=True, note=str(e))
    return GradeResult(method is not None, pred, g, method or "none")


def grade_math(
    completion: Optional[str], gold_solution_or_answer: str, *, timeout_s: float = DEFAULT_SYMBOLIC_TIMEOUT_S
) -> GradeResult:
    """Grade a MATH / MATH-500 completion.

    Args:
        completion: model output text.
        gold_solution_or_answer: a worked solution (its last ``\\boxed{}`` is the gold answer) or the bare answer.
        timeout_s: CPU-time limit of each symbolic step, CPU seconds.

    Returns:
        :class:`GradeResult` (``ungraded=True`` when a symbolic step reached its CPU-time limit).

    Raises:
        ValueError: ``gold_solution_or_answer`` is empty.
    """
    if gold_solution_or_answer is None or not str(gold_solution_or_answer).strip():
        raise ValueError("grade_math: empty gold answer")
    g = last_boxed(gold_solution_or_answer) or str(gold_solution_or_answer).strip()
    return _grade(completion, g, "math", timeout_s)

