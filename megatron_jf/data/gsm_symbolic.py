"""GSM8K-style math word problems with chain-of-thought answers, generated offline (the quickstart's domain).

The problems come from ``reasoning-gym``'s GSM-Symbolic generators (``reasoning-gym==0.1.25``, Apache-2.0, installed
``--no-deps``: requirements-nodeps.txt): 100 templates made from GSM8K *train* questions, of which the package marks 85
usable (its ``tasks_ok``), each a seeded function returning a question, a chain of thought whose steps are written
``a op b = c``, and the final answer ``#### N``. ``import reasoning_gym`` would load every task family of the package
and need all its dependencies; :func:`generators` loads only the two generator files and the package's ``utils``
(standard library only).

A problem is rendered as a prompt and a response (:meth:`Problem.prompt_text`, :meth:`Problem.response_text`)::

    Question: Robert was a pen pal with 9 people. ... How many hours does he spend writing a week?
    Answer: Robert is penpals with 9-6=3 people
    ...
    So he writes 360/60=6 hours a week
    #### 6

:func:`make_splits` draws the quickstart's disjoint sets: templates held out from everything, and for the other
templates pretraining problems, Jacobi Forcing training prompts and held-out problems from disjoint seed ranges,
with every held-out question also absent from the other sets as text. :func:`final_answer` and
:func:`arithmetic_steps` score a generated answer (exact answer as in GSM8K's ``#### N`` convention; each
``a op b = c`` step checked arithmetically).
"""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
import types
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from pathlib import Path
from random import Random
from typing import Callable, Iterable

__all__ = ["Problem", "Splits", "usable_templates", "generators", "generate", "make_splits", "final_answer",
           "answers_match", "arithmetic_steps", "arithmetic_drills", "drill_steps", "drills_from_steps"]

PACKAGE = "reasoning_gym"
_GEN_DIR = ("arithmetic", "gsm_symbolic")


def _package_root() -> Path:
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "the math domain needs reasoning-gym's GSM-Symbolic generators: pip install --no-deps reasoning-gym==0.1.25 "
            "(requirements-nodeps.txt; scripts/bootstrap.sh installs it)")
    return Path(list(spec.submodule_search_locations)[0])


@lru_cache(maxsize=1)
def usable_templates() -> tuple[int, ...]:
    """The template numbers reasoning-gym marks usable (``tasks_ok`` of its ``gsm_symbolic.py``, read as a literal
    without importing the package), sorted.

    Raises:
        ModuleNotFoundError: reasoning-gym is not installed.
        ValueError: the file has no ``tasks_ok`` list literal (another package version).
    """
    src = (_package_root().joinpath(*_GEN_DIR) / "gsm_symbolic.py").read_text(encoding="utf-8")
    for node in ast.parse(src).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "tasks_ok" for t in node.targets):
            return tuple(sorted(ast.literal_eval(node.value)))
    raise ValueError(f"{PACKAGE}'s gsm_symbolic.py has no tasks_ok list (want reasoning-gym==0.1.25)")


@lru_cache(maxsize=1)
def generators() -> dict[int, Callable]:
    """``{template: generate_<template>(rng, difficulty)}`` from the package's two generator files.

    The files import ``reasoning_gym.utils`` (standard library only); it is loaded under that name with a stand-in
    for the package itself for the time of the load, and ``sys.modules`` is restored afterwards, so a later real
    ``import reasoning_gym`` is unaffected.
    """
    root = _package_root()
    saved = {k: sys.modules.get(k) for k in (PACKAGE, f"{PACKAGE}.utils")}
    stub = types.ModuleType(PACKAGE)
    stub.__path__ = [str(root)]
    out: dict[int, Callable] = {}
    try:
        sys.modules[PACKAGE] = stub
        sys.modules[f"{PACKAGE}.utils"] = _load(f"{PACKAGE}.utils", root / "utils.py")
        for part in ("generators_00_49", "generators_50_99"):
            mod = _load(f"_megatron_jf_gsm_{part}", root.joinpath(*_GEN_DIR) / f"{part}.py")
            out.update({int(name.split("_", 1)[1]): getattr(mod, name) for name in dir(mod)
                        if name.startswith("generate_") and name.split("_", 1)[1].isdigit()})
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    return out


def _load(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@dataclass(frozen=True)
class Problem:
    """One generated problem.

    Attributes:
        template: reasoning-gym's template number.
        seed: the per-template seed it was generated from.
        question: the question text.
        chain: the chain-of-thought answer, ending with the line ``#### <answer>``.
        answer: the final answer as reasoning-gym formats it (``"6"``, ``"2.5"``).
    """

    template: int
    seed: int
    question: str
    chain: str
    answer: str

    @property
    def uid(self) -> str:
        """``t<template>-s<seed>``: unique within the domain."""
        return f"t{self.template}-s{self.seed}"

    def prompt_text(self) -> str:
        """``"Question: <question>\\nAnswer:"`` -- what the model is given."""
        return f"Question: {self.question}\nAnswer:"

    def response_text(self) -> str:
        """``" <chain of thought ending #### N>"`` -- the ground-truth continuation of :meth:`prompt_text`."""
        return " " + self.chain

    def text(self) -> str:
        """Prompt and response: one pretraining document."""
        return self.prompt_text() + self.response_text()


def generate(template: int, seed: int) -> Problem:
    """The problem of ``template`` drawn with ``seed`` (deterministic: ``random.Random(template * 1_000_003 + seed)``).

    Raises:
        KeyError: no such template.
    """
    gen = generators()[template]
    ex = gen(Random(template * 1_000_003 + seed), 1.0)
    meta = ex["metadata"]
    return Problem(template=template, seed=seed, question=str(ex["question"]).strip(),
                   chain=str(meta["answer_cot"]).strip(), answer=str(ex["answer"]).strip())


@dataclass(frozen=True)
class Splits:
    """The domain's disjoint sets (:func:`make_splits`).

    Attributes:
        heldout_templates: templates excluded from every other set.
        pretrain: pretraining problems (documents: question and ground-truth chain of thought).
        train: Jacobi Forcing training prompts (the model's own trajectories are collected on them).
        heldout: held-out problems: other seeds of the training templates, questions absent from ``pretrain`` and
            ``train`` as text.
        heldout_template: problems of the held-out templates.
    """

    heldout_templates: tuple[int, ...]
    pretrain: list[Problem]
    train: list[Problem]
    heldout: list[Problem]
    heldout_template: list[Problem]


def _round_robin(templates: tuple[int, ...], count: int, first_seed: int) -> Iterable[Problem]:
    """``count`` problems cycling through ``templates``, seeds ``first_seed, first_seed + 1, ...`` per template."""
    for i in range(count):
        yield generate(templates[i % len(templates)], first_seed + i // len(templates))


def make_splits(n_pretrain: int, n_train: int, n_heldout: int, n_heldout_template: int, *,
                n_heldout_templates: int = 9, seed: int = 0) -> Splits:
    """Draw the quickstart's sets.

    The held-out templates are ``n_heldout_templates`` of :func:`usable_templates` chosen with ``seed``. The others
    are cycled through in order, each set from its own seed range (pretraining from 0, training prompts from
    10^6, held-out problems from 2 x 10^6); a held-out problem whose question text occurs in the pretraining or
    training sets is replaced by the next seed's, and a training prompt repeating a pretraining question is kept
    (its trajectory is the model's own output either way). Held-out-template problems use seeds from 3 x 10^6.

    Args:
        n_pretrain, n_train, n_heldout, n_heldout_template: problems per set (>= 0).
        n_heldout_templates: templates held out (0 <= k < number of usable templates).
        seed: chooses the held-out templates.

    Raises:
        ValueError: a negative count or too many held-out templates.
    """
    templates = usable_templates()
    if min(n_pretrain, n_train, n_heldout, n_heldout_template) < 0:
        raise ValueError("problem counts must be >= 0")
    if not 0 <= n_heldout_templates < len(templates):
        raise ValueError(f"n_heldout_templates must be in [0, {len(templates) - 1}], got {n_heldout_templates}")
    held_t = tuple(sorted(Random(seed).sample(templates, n_heldout_templates)))
    kept = tuple(t for t in templates if t not in held_t)
    pretrain = list(_round_robin(kept, n_pretrain, 0))
    train = list(_round_robin(kept, n_train, 10 ** 6))
    seen = {p.question for p in pretrain} | {p.question for p in train}
    heldout: list[Problem] = []
    i = 0
    while len(heldout) < n_heldout:
        p = generate(kept[i % len(kept)], 2 * 10 ** 6 + i // len(kept))
        i += 1
        if p.question not in seen:
            seen.add(p.question)
            heldout.append(p)
        if i > 50 * max(n_heldout, 1) + 1000:
            raise ValueError(f"could not draw {n_heldout} held-out problems absent from the other sets")
    heldout_template = list(_round_robin(held_t, n_heldout_template, 3 * 10 ** 6)) if held_t else []
    return Splits(held_t, pretrain, train, heldout, heldout_template)


_FINAL = re.compile(r"####\s*(-?[\d,]*\.?\d+)")


def final_answer(text: str) -> str | None:
    """The number after the first ``####`` of a generated answer (commas removed), or None if there is none."""
    m = _FINAL.search(text)
    return m.group(1).replace(",", "") if m else None


def answers_match(predicted: str | None, reference: str) -> bool:
    """True when ``predicted`` (from :func:`final_answer`) equals ``reference`` as a number (``"6"`` == ``"6.0"``)."""
    if predicted is None:
        return False
    try:
        return Fraction(predicted) == Fraction(reference.replace(",", ""))
    except (ValueError, ZeroDivisionError):
        return predicted.strip() == reference.strip()


_NUM = r"\$?\d[\d,]*(?:\.\d+)?"
_OP = r"[-+*/x×÷]"
_STEP = re.compile(rf"({_NUM}(?:\s*{_OP}\s*{_NUM})+)\s*=\s*({_NUM})(%?)")
_OPS = {"x": "*", "×": "*", "÷": "/"}


def _number(tok: str) -> Fraction:
    return Fraction(tok.lstrip("$").replace(",", "").rstrip(",") or "0")


def arithmetic_steps(text: str) -> tuple[int, int]:
    """``(right, total)``: the chain-of-thought steps ``a op b [op c ...] = d`` in ``text`` and how many of them are
    arithmetically right.

    Operators ``+ - * / x × ÷`` with the usual precedence; numbers may carry ``$`` and thousands commas. ``d`` is
    right when it equals the expression's value up to a relative 1e-6, to the decimals it is written with, or (an
    integer ``d``) to the value rounded down or up -- the ground-truth chains round counts that way (``0.22*80 = 17
    students``); ``d%`` is compared with 100 times the value. A step whose first number follows an operator or an
    ``x`` word (``40 questions x 60/100 = 24``: its left side has units in it) is not counted.
    """
    right = total = 0
    for m in _STEP.finditer(text):
        before = text[:m.start()].rstrip()
        if before and (before[-1] in "+-*/×÷=" or before.endswith(" x")):
            continue
        expr, rhs, pct = m.groups()
        toks = re.findall(rf"{_NUM}|{_OP}", expr)
        code = "".join(_OPS.get(t, t) if re.fullmatch(_OP, t) else f"F({str(_number(t))!r})" for t in toks)
        total += 1
        try:
            val = eval(code, {"__builtins__": {}, "F": Fraction})  # noqa: S307 - built only from matched numbers/ops
        except ZeroDivisionError:
            continue
        if pct:
            val *= 100
        want = _number(rhs)
        decimals = len(rhs.split(".")[1]) if "." in rhs else 0
        close = abs(val - want) <= Fraction(1, 10 ** 6) * max(1, abs(want))
        rounded = round(float(val), decimals) == float(want)
        bracket = decimals == 0 and want.denominator == 1 and int(want) in (val.numerator // val.denominator,
                                                                            -(-val.numerator // val.denominator))
        right += int(close or rounded or bracket)
    return right, total


_BINARY = re.compile(r"(?<![\d.,$])(\d+)( ?)([-+*/x×÷])( ?)(\d+)( ?)=( ?)(\d+)(?![\d.])")


def drill_steps(problems: Iterable[Problem]) -> list[tuple]:
    """The integer steps ``a op b = c`` of ``problems``' ground-truth chains, each as the 8 groups of its match
    (operands, operator, result and the spaces between), in order: what :func:`arithmetic_drills` draws from.
    Scanning the chains is the costly part (~0.3 s per 40,000 problems, once per call of :func:`arithmetic_drills`);
    compute it once and call :func:`drills_from_steps` for each batch. Raises nothing."""
    return [m.groups() for p in problems for m in _BINARY.finditer(p.chain)]


def arithmetic_drills(problems: Iterable[Problem], count: int, *, seed: int = 0, per_document: int = 16) -> list[str]:
    """Arithmetic practice documents in the chains' own style: ``count`` equations ``a op b = c``, ``per_document``
    to a document (one per line), each made from an integer step of ``problems``' ground-truth chains by drawing
    new operands with the same numbers of digits (same operator, same spacing); a division is drawn as
    ``(b * q) / b = q`` so it is exact, a subtraction never goes below zero.

    Mixed into the pretraining text, they give a small model the arithmetic the chains need far more often than
    the problems themselves do (the quickstart's base model: step accuracy, exact answers).
    ``drills_from_steps(drill_steps(problems), ...)`` gives the same documents without rescanning the chains.

    Raises:
        ValueError: ``count < 0``, ``per_document < 1``, or no integer step in ``problems``.
    """
    return drills_from_steps(drill_steps(problems), count, seed=seed, per_document=per_document)


def drills_from_steps(steps: list[tuple], count: int, *, seed: int = 0, per_document: int = 16) -> list[str]:
    """:func:`arithmetic_drills` over steps already found by :func:`drill_steps` (same arguments, same documents).

    Raises:
        ValueError: ``count < 0``, ``per_document < 1``, or ``steps`` empty.
    """
    if count < 0 or per_document < 1:
        raise ValueError(f"need count >= 0 and per_document >= 1, got {count}, {per_document}")
    if not steps:
        raise ValueError("no integer step a op b = c in the given problems")
    rng = Random(seed)

    def draw(digits: int) -> int:
        return rng.randint(10 ** (digits - 1), 10 ** digits - 1)

    lines = []
    for _ in range(count):
        a, s1, op, s2, b, s3, s4, c = rng.choice(steps)
        x, y = draw(len(a)), draw(len(b))
        sym = _OPS.get(op, op)
        if sym == "/":
            y = max(y, 1)
            q = draw(len(c))
            x, z = y * q, q
        elif sym == "-":
            x, y = max(x, y), min(x, y)
            z = x - y
        else:
            z = x + y if sym == "+" else x * y
        lines.append(f"{x}{s1}{op}{s2}{y}{s3}={s4}{z}")
    return ["\n".join(lines[i:i + per_document]) for i in range(0, len(lines), per_document)]
