"""A verdict the code under test cannot write: split execution for HumanEval and MBPP.

The candidate's code (HumanEval: prompt + completion; MBPP: completion + ``test_setup_code``) runs in the OS
sandbox of :mod:`megatron_jf.eval.sandbox` as a *server* (``_sandbox_child.py``, ``mode="serve"``). The benchmark's
own check (HumanEval's ``check(candidate)``, MBPP's ``assert`` lines) runs **here, in the evaluator**, with every
name that the solution should define bound to a :class:`CandidateProxy`: calling it sends the (encoded) arguments
to the sandbox, which calls the candidate's function and returns the encoded result (``_wire.py``); the result is
rebuilt from exact built-in types, and the comparison with the expected value happens in this process, which
the sandboxed code cannot reach (other uid, PID and mount namespaces). The sandbox never receives an expected
output, so a forged "passed" line, a cleared violation list or an object whose ``__eq__`` always says yes can no
longer make a wrong solution pass; all it can do is return values, and only right values pass.

Trusted side: HumanEval's ``prompt`` (imports and helpers such as ``encode_cyclic`` / ``poly`` that the checks
use) and ``test`` are executed in a fresh namespace here; MBPP's ``test_setup_code`` too, and stdlib modules a test
uses without importing (``math.isclose`` after the solution's ``import math``) are imported here. Arguments the
candidate mutates in place (lists, dicts, sets, bytearrays) are copied back after each call.

Problems whose check cannot be split (an argument that cannot be transferred, such as a function object, or a
prompt/test source that does not execute on its own) fall back to :func:`megatron_jf.eval.code_exec.run_program`,
the whole program in the sandbox with the in-process verdict; the result says ``verdict="in-sandbox"`` and the
aggregate lists those task ids. None of HumanEval's 164 and MBPP's 500 reference solutions needs it (all are
scored ``verdict="split"``, ``tests/test_eval_code_exec.py``); mbpp/367, whose ``test_setup_code`` builds trees
from the solution's own ``Node`` class, is split with :class:`RemoteRef` arguments. No tampering inside an
``"in-sandbox"`` check can be detected from outside (the process that decides is the one under test); such
results are only ever reported as what they are.
"""

from __future__ import annotations

import ast
import dataclasses
import builtins
import json
import os
import select
import sys
import threading
import time
import traceback
from typing import Any, Optional

from . import _wire
from .code_exec import (
    DEFAULT_FSIZE_BYTES,
    DEFAULT_ISOLATION,
    DEFAULT_MEMORY_BYTES,
    DEFAULT_TIMEOUT_S,
    DEFAULT_TMPFS_BYTES,
    ExecResult,
    _Child,
    _limits,
    build_humaneval_program,
    build_mbpp_program,
    humaneval_solution,
    run_program,
)

__all__ = ["CandidateError", "CandidateProxy", "SandboxSession", "Unsplittable", "verify_humaneval", "verify_mbpp"]

#: largest reply line accepted from the sandbox, bytes
MAX_REPLY_BYTES = 16 << 20
_TEST_FILE = "<test>"


class CandidateError(Exception):
    """The candidate's function raised an exception that is not a built-in ``Exception`` subclass."""


class Unsplittable(BaseException):
    """This check cannot be run with the candidate behind a proxy (e.g. an argument cannot be transferred).
    A ``BaseException``, like :class:`_SessionEnded`, so that an ``except Exception`` in test code cannot
    swallow it and carry on to a "passed"."""


class _SessionEnded(BaseException):
    def __init__(self, result: ExecResult):
        super().__init__(result.message)
        self.result = result


class SandboxSession:
    """The candidate's solution loaded in a sandboxed server process (``_sandbox_child.py`` ``mode="serve"``).

    Args:
        solution: Python source executed once in the sandbox (defines the functions under test).
        timeout_s: wall-clock budget for the whole session (start-up and every call), seconds.
        memory_bytes, fsize_bytes: ``RLIMIT_AS`` / ``RLIMIT_FSIZE`` of the child, bytes.
        isolation: ``"os"`` or ``"none"`` (see :func:`megatron_jf.eval.code_exec.run_program`).

    Raises:
        SandboxUnavailable: ``isolation="os"`` and namespaces do not work here.
        OSError: the child could not be started.
    """

    def __init__(self, solution: str, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 memory_bytes: Optional[int] = DEFAULT_MEMORY_BYTES, fsize_bytes: Optional[int] = DEFAULT_FSIZE_BYTES,
                 isolation: str = DEFAULT_ISOLATION, python: Optional[str] = None):
        self.start = time.monotonic()
        self.deadline = self.start + timeout_s
        self.timeout_s = timeout_s
        self.limits = _limits(timeout_s, memory_bytes, None, fsize_bytes, True)
        self.child = _Child(isolation, python, stdout_pipe=True,
                            tmpfs_bytes=max(fsize_bytes or 0, DEFAULT_TMPFS_BYTES))
        self.calls = 0
        self._buf = b""
        try:
            self._send({"mode": "serve", "workdir": self.child.workdir, "program": solution, "limits": self.limits})
            ready = self._receive()
            if not ready.get("ready"):
                st = ready.get("status") if ready.get("status") in ("failed", "error") else "error"
                raise _SessionEnded(ExecResult(False, st, str(ready.get("message", ""))[:2000], self.elapsed()))
        except BaseException:
            self.close()
            raise

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def _ended(self) -> _SessionEnded:
        if time.monotonic() >= self.deadline:
            self.child.kill()
            return _SessionEnded(ExecResult(False, "timeout", f"wall-clock limit of {self.timeout_s:g} s exceeded",
                                            self.elapsed()))
        self.child.kill()
        try:
            self.child.proc.wait(timeout=5)
        except Exception:  # noqa: BLE001
            pass
        return _SessionEnded(self.child.crash_result(self.elapsed(), self.limits["cpu"]))

    def _send(self, obj: dict) -> None:
        try:
            self.child.proc.stdin.write(json.dumps(obj).encode() + b"\n")
            self.child.proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            raise self._ended() from None

    def _receive(self) -> dict:
        fd = self.child.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise self._ended()
            r, _, _ = select.select([fd], [], [], left)
            if not r:
                continue
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                raise self._ended()
            self._buf += chunk
            if len(self._buf) > MAX_REPLY_BYTES:
                self.child.kill()
                raise _SessionEnded(ExecResult(False, "error", "reply from the sandbox too large", self.elapsed()))
        line, self._buf = self._buf.split(b"\n", 1)
        try:
            obj = json.loads(line.decode("utf-8", "replace"))
        except ValueError:
            obj = None
        if not isinstance(obj, dict):
            self.child.kill()
            raise _SessionEnded(ExecResult(False, "failed", "the solution wrote garbage on the result channel",
                                           self.elapsed()))
        return obj

    def call(self, name: str, args: tuple, kwargs: dict) -> Any:
        """Call the candidate's ``name(*args, **kwargs)`` in the sandbox and return the rebuilt result.

        Raises:
            Unsplittable: an argument cannot be transferred.
            the candidate's exception (a built-in ``Exception`` subclass of the same name) or
            :class:`CandidateError`.
        """
        try:
            enc_args = [_wire.encode(a) for a in args]
            enc_kw = [[str(k), _wire.encode(v)] for k, v in kwargs.items()]
        except _wire.WireError as e:
            raise Unsplittable(f"argument of {name}() cannot be transferred: {e}") from None
        for i, a in enumerate(args):
            if isinstance(a, RemoteRef):
                enc_args[i] = ["ref", a.name]
        for a, enc in zip([*args, *kwargs.values()], [*enc_args, *(v for _, v in enc_kw)]):
            if enc[0] in ("o", "it") and not isinstance(a, RemoteRef):
                raise Unsplittable(f"argument of type {type(a).__name__} to {name}() cannot be transferred")
        self.calls += 1
        self._send({"call": name, "args": enc_args, "kwargs": enc_kw})
        reply = self._receive()
        if "raise" in reply:
            etype, msg, where = (list(reply["raise"]) + ["", "", ""])[:3]
            exc_cls = getattr(builtins, str(etype), None)
            text = f"{msg}" + (f" [in the solution: {where}]" if where else "")
            exc = None
            if isinstance(exc_cls, type) and issubclass(exc_cls, Exception) and exc_cls is not Exception:
                try:
                    exc = exc_cls(text)
                except TypeError:  # exception classes with required extra arguments (UnicodeDecodeError, ...)
                    exc = None
            raise exc if exc is not None else CandidateError(f"{str(etype)[:100]}: {text}")
        try:
            value = _wire.decode(reply.get("ok"))
            after = reply.get("after") or []
            for a, enc in zip(args, after):
                if enc is None:
                    continue
                new = _wire.decode(enc)
                if type(a) is list and type(new) is list:
                    a[:] = new
                elif type(a) is dict and type(new) is dict:
                    a.clear()
                    a.update(new)
                elif type(a) is set and type(new) is set:
                    a.clear()
                    a.update(new)
                elif type(a) is bytearray and type(new) is bytearray:
                    a[:] = new
        except _wire.WireError as e:
            raise CandidateError(f"unreadable result from {name}(): {e}") from None
        return value

    def close(self) -> None:
        """Stop the sandbox and release everything (idempotent)."""
        self.child.close()


class CandidateProxy:
    """Stands for the solution's function ``name`` in trusted test code; calling it runs the real one in the
    sandbox (:meth:`SandboxSession.call`)."""

    __slots__ = ("_session", "_name")

    def __init__(self, session: SandboxSession, name: str):
        self._session = session
        self._name = name

    def __call__(self, *args, **kwargs):
        return self._session.call(self._name, args, kwargs)

    def __getattr__(self, attr):
        raise Unsplittable(f"the test uses attribute {attr!r} of the solution's {self._name!r}")

    def __repr__(self):
        return f"<candidate {self._name} in the sandbox>"


_AST_LOCK = threading.Lock()


def _parse(src: str) -> ast.Module:
    """``ast.parse`` under a lock: CPython 3.11's AST-to-object conversion keeps its recursion depth in
    interpreter-global state, and two threads parsing at once can fail with "AST constructor recursion depth
    mismatch" (gh-106905)."""
    with _AST_LOCK:
        return ast.parse(src)


def _free_names(sources: list[str]) -> list[str]:
    """Names loaded (not stored) at any scope of ``sources`` — over-approximate; filtered by the caller."""
    loaded, stored = [], set()
    for src in sources:
        for node in ast.walk(_parse(src)):
            if isinstance(node, ast.Name):
                (loaded.append(node.id) if isinstance(node.ctx, ast.Load) else stored.add(node.id))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                stored.add(node.name)
            elif isinstance(node, ast.arg):
                stored.add(node.arg)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                for al in node.names:
                    stored.add((al.asname or al.name).split(".")[0])
    seen, out = set(), []
    for n in loaded:
        if n not in stored and n not in seen:
            seen.add(n)
            out.append(n)
    return out


class RemoteRef:
    """A name that exists only in the sandbox (e.g. MBPP ``test_setup_code`` objects built from the solution's own
    classes); passed as an argument, the sandbox substitutes its own object of that name."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __repr__(self):
        return f"<{self.name} in the sandbox>"


def _bind_missing(ns: dict, sources: list[str], session: SandboxSession, entry_point: Optional[str]) -> None:
    """Bind every free name of the test that the trusted namespace lacks: a stdlib module is imported here, any
    other name is taken to be the solution's and becomes a :class:`CandidateProxy`. The entry point is always the
    solution's, also where it shadows a builtin (MBPP's ``sum``) or a prompt stub (HumanEval/33's ``sort_third``)."""
    if entry_point:
        ns[entry_point] = CandidateProxy(session, entry_point)
    for name in _free_names(sources):
        if name in ns or hasattr(builtins, name):
            continue
        if name in getattr(sys, "stdlib_module_names", ()):
            try:
                ns[name] = __import__(name)
                continue
            except ImportError:
                pass
        ns[name] = CandidateProxy(session, name)


def _describe_failure(exc: BaseException, test_src: str = "") -> str:
    name = type(exc).__name__
    text = str(exc)
    where = ""
    lines = test_src.splitlines()
    for fr in reversed(traceback.extract_tb(exc.__traceback__, limit=None)):
        if fr.filename == _TEST_FILE:
            line = lines[fr.lineno - 1] if fr.lineno and 0 < fr.lineno <= len(lines) else (fr.line or "")
            where = f" at test line {fr.lineno}: {line.strip()[:200]}"
            break
    return (f"{name}: {text}" if text else name)[:700] + where


def _run_split(solution: str, trusted_sources: list[tuple[str, str]], run_check, *, timeout_s, memory_bytes,
               isolation, entry_point: Optional[str] = None, remote_names: tuple = (),
               test_src: str = "") -> ExecResult:
    """Load ``solution`` in a session, execute the trusted sources here, run ``run_check(ns)``; map the outcome."""
    ns: dict = {"__name__": "__jf_check__", "__builtins__": builtins}
    codes = []
    for src, fname in trusted_sources:
        try:
            codes.append(compile(src, fname, "exec"))
        except (SyntaxError, ValueError) as e:
            raise Unsplittable(f"trusted source does not compile: {e}") from None
    start = time.monotonic()
    try:
        session = SandboxSession(solution, timeout_s=timeout_s, memory_bytes=memory_bytes, isolation=isolation)
    except _SessionEnded as e:
        return dataclasses.replace(e.result, verdict="split")
    except OSError as e:
        return ExecResult(False, "error", f"could not start the sandbox: {e}", time.monotonic() - start, "split")
    try:
        try:
            for code in codes:
                exec(code, ns)  # noqa: S102 - benchmark code, trusted
        except Exception as e:  # noqa: BLE001
            raise Unsplittable(f"trusted source does not execute on its own: {type(e).__name__}: {e}") from None
        for name in remote_names:
            ns[name] = RemoteRef(name)
        _bind_missing(ns, [src for src, _ in trusted_sources], session, entry_point)
        try:
            run_check(ns, session)
        except (Unsplittable, _SessionEnded):
            raise
        except Exception as e:  # noqa: BLE001 - AssertionError or the candidate's exception: a failed test
            src = test_src or next((t for t, f in trusted_sources if f == _TEST_FILE), "")
            return ExecResult(False, "failed", _describe_failure(e, src), session.elapsed(), "split")
        if session.calls == 0:
            return ExecResult(False, "failed", "the check never called the solution", session.elapsed(), "split")
        return ExecResult(True, "passed", "", session.elapsed(), "split")
    except _SessionEnded as e:
        return dataclasses.replace(e.result, verdict="split")
    finally:
        session.close()


def _fallback(program: str, why: str, **kw) -> ExecResult:
    r = run_program(program, **kw)
    return ExecResult(r.passed, r.status, r.message, r.duration_s, verdict="in-sandbox",
                      note=f"check not split ({why}); verdict from inside the sandbox")


def verify_humaneval(prompt: str, code: str, entry_point: str, test: str, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                     memory_bytes: Optional[int] = DEFAULT_MEMORY_BYTES,
                     isolation: str = DEFAULT_ISOLATION) -> ExecResult:
    """Score a HumanEval completion with the split verdict (see the module docstring).

    Args:
        prompt, code, entry_point, test: as for :func:`megatron_jf.eval.code_exec.build_humaneval_program`.
        timeout_s: wall-clock budget of the whole check, seconds; memory_bytes: sandbox ``RLIMIT_AS``, bytes.
        isolation: ``"os"`` or ``"none"``.

    Returns:
        :class:`ExecResult` with ``verdict="split"`` (or ``"in-sandbox"`` for a check that cannot be split).
    """
    solution = humaneval_solution(prompt, code, entry_point)

    def run_check(ns, session):
        ns["check"](CandidateProxy(session, entry_point))

    kw = dict(timeout_s=timeout_s, memory_bytes=memory_bytes, isolation=isolation)
    try:
        return _run_split(solution, [(prompt, "<prompt>"), (test, _TEST_FILE)], run_check, entry_point=entry_point,
                          **kw)
    except Unsplittable as e:
        return _fallback(build_humaneval_program(prompt, code, entry_point, test), str(e), **kw)


def verify_mbpp(code: str, tests: list[str], test_setup: str = "", *, entry_point: Optional[str] = None,
                timeout_s: float = DEFAULT_TIMEOUT_S, memory_bytes: Optional[int] = DEFAULT_MEMORY_BYTES,
                isolation: str = DEFAULT_ISOLATION) -> ExecResult:
    """Score an MBPP completion with the split verdict: solution + ``test_setup`` in the sandbox, each ``assert``
    line here (see the module docstring). When ``test_setup`` does not execute on its own (it builds objects of the
    solution's classes, as in mbpp/367), the names it assigns are passed to the solution as :class:`RemoteRef`.

    Raises:
        ValueError: ``tests`` is empty.
    """
    if not tests:
        raise ValueError("verify_mbpp: no tests given")
    code = (code or "").replace("\r\n", "\n")
    setup = (test_setup or "").replace("\r\n", "\n")
    solution = code + "\n\n" + setup + "\n"
    test_src = "\n".join(t.replace("\r\n", "\n") for t in tests) + "\n"
    kw = dict(timeout_s=timeout_s, memory_bytes=memory_bytes, isolation=isolation)
    try:
        return _run_split_mbpp(solution, setup, test_src, entry_point, **kw)
    except Unsplittable as e:
        return _fallback(build_mbpp_program(code, tests, test_setup), str(e), **kw)


def _top_level_targets(src: str) -> tuple:
    names = []
    for node in _parse(src).body:
        for t in getattr(node, "targets", None) or [getattr(node, "target", None)]:
            for n in ast.walk(t) if t is not None else ():
                if isinstance(n, ast.Name) and n.id not in names:
                    names.append(n.id)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.append(node.name)
    return tuple(names)


def _run_split_mbpp(solution: str, setup: str, test_src: str, entry_point: Optional[str], **kw) -> ExecResult:
    try:
        test_code = compile(test_src, _TEST_FILE, "exec")
        setup_code = compile(setup, "<setup>", "exec")
    except (SyntaxError, ValueError) as e:
        raise Unsplittable(f"tests do not compile: {e}") from None
    trusted, remote = [(setup, "<setup>")], ()
    try:
        exec(setup_code, {"__builtins__": builtins})  # noqa: S102 - benchmark setup code, trusted; dry run
    except Exception:  # noqa: BLE001 - it needs the solution: its names live in the sandbox only
        trusted, remote = [], _top_level_targets(setup)

    def run_check(ns, session):
        _bind_missing(ns, [test_src], session, entry_point)
        exec(test_code, ns)  # noqa: S102 - benchmark asserts, trusted

    return _run_split(solution, trusted, run_check, remote_names=remote, test_src=test_src, entry_point=entry_point,
                      **kw)
