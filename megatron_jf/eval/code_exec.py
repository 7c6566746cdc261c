"""Code extraction and sandboxed execution for HumanEval and MBPP (pass@1 in Jacobi Forcing Tables 1-3).

Extraction (:func:`extract_code`) follows the official JacobiForcing HumanEval drivers: the first
```` ```python ```` block, else the first bare ```` ``` ```` block, else the raw text. An unclosed fence (truncated
generation) runs to the end of the text.

Program assembly:

* HumanEval (:func:`build_humaneval_program`): if the extracted code defines the entry point at top level
  ("full function" form, e.g. the paper's prompt asks the model to "return all completed function in a
  codeblock"), the program is the part of the prompt **before** ``def <entry_point>`` (imports and helper functions)
  followed by the code; otherwise ("body only" form) it is prompt + code, indenting the body by four spaces when
  the model dropped the indentation. Then the benchmark's ``check`` source and ``check(<entry_point>)``.
* MBPP (:func:`build_mbpp_program`): code, ``test_setup_code``, then the ``assert`` lines.

Execution (:func:`run_program`) never happens in the evaluator's process. Each program runs in a fresh
``python -I -B`` child that, by default (``isolation="os"``), is started through bubblewrap in its own user, mount,
PID, network, IPC and UTS namespaces as uid 65534, with a read-only ``/usr`` and interpreter, no view of the host's
other files, no network, and a private size-limited tmpfs ``/tmp`` (cwd ``/tmp/jf_work``) that disappears with it
(:mod:`megatron_jf.eval.sandbox`); on the wall-clock timeout its process group is killed (``SIGKILL``), which takes
down its PID namespace and every process in it. Inside the child (see ``_sandbox_child.py``): ``RLIMIT_AS``
(bytes), ``RLIMIT_CPU`` (seconds), ``RLIMIT_FSIZE`` (bytes), ``RLIMIT_NPROC`` (0: no new processes/threads), no core
dumps, stdin/stdout on ``/dev/null``, and an audit hook that refuses writes/deletes/renames outside the work dir,
process creation, ``os.kill``, sockets, ``ctypes`` calls and ``setrlimit`` (defence in depth: code in the same
process can switch it off; the namespaces are the boundary). ``if __name__ == "__main__":`` blocks of the solution
do not run, and ``sys.exit()`` before the tests finish is a failure. Where namespaces do not work,
:class:`~megatron_jf.eval.sandbox.SandboxUnavailable` is raised unless ``isolation="none"`` is passed (plain subprocess, audit hook only).

The verdict of :func:`run_program` is the program's own result line, which code that defeats the audit hook can
forge; benchmark scoring therefore uses :mod:`megatron_jf.eval.verdict`, where the tests run outside the sandbox
and only the candidate's returned values cross over.

Result statuses: ``"passed"``; ``"failed"`` (an exception such as ``AssertionError``, ``SyntaxError``, an early
``exit``); ``"timeout"`` (wall clock or CPU limit); ``"error"`` (memory limit, sandbox violation, crash, or the
sandbox could not start).
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional, Sequence

from .sandbox import (
    DEFAULT_TMPFS_BYTES,
    SANDBOX_WORKDIR,
    bwrap_command,
    check_isolation,
    popen_user_kwargs,
    sandbox_python,
)

__all__ = [
    "DEFAULT_ISOLATION",
    "DEFAULT_MEMORY_BYTES",
    "DEFAULT_TIMEOUT_S",
    "DEFAULT_WORKERS",
    "ExecResult",
    "build_humaneval_program",
    "build_mbpp_program",
    "extract_code",
    "run_program",
    "run_programs",
]

#: default wall-clock limit per program, seconds (interpreter start-up included; generous for a loaded CPU box)
DEFAULT_TIMEOUT_S = 10.0
#: default address-space limit per program, bytes (1 GiB)
DEFAULT_MEMORY_BYTES = 1 << 30
#: default largest file the program may write, bytes (16 MiB)
DEFAULT_FSIZE_BYTES = 16 << 20
#: default number of programs executed at the same time
DEFAULT_WORKERS = 2
STATUSES = ("passed", "failed", "timeout", "error")
#: default isolation: OS namespaces via bubblewrap (see :mod:`megatron_jf.eval.sandbox`)
DEFAULT_ISOLATION = "os"

_CHILD_SOURCE: Optional[str] = None


def _child_source() -> str:
    """Source run by ``python -c`` in the sandbox: the value codec (``_wire.py``) then ``_sandbox_child.py``."""
    global _CHILD_SOURCE
    if _CHILD_SOURCE is None:
        here = os.path.dirname(os.path.abspath(__file__))
        parts = []
        for name in ("_wire.py", "_sandbox_child.py"):
            with open(os.path.join(here, name), encoding="utf-8") as f:
                parts.append(f.read())
        _CHILD_SOURCE = "\n\n".join(parts)
    return _CHILD_SOURCE


@dataclass(frozen=True)
class ExecResult:
    """Outcome of one sandboxed program run.

    Attributes:
        passed: ``True`` iff ``status == "passed"``.
        status: ``"passed"``, ``"failed"``, ``"timeout"`` or ``"error"`` (see the module docstring).
        message: short human-readable reason (exception type and message, failing line, signal, ...).
        duration_s: wall-clock time of the subprocess, seconds.
        verdict: who decided: ``"split"`` (the trusted evaluator compared the candidate's returned values, see
            :mod:`megatron_jf.eval.verdict`) or ``"in-sandbox"`` (the program's own result line).
        note: extra information (e.g. why a check was not split).
    """

    passed: bool
    status: str
    message: str
    duration_s: float
    verdict: str = "in-sandbox"
    note: str = ""

    def to_dict(self) -> dict:
        """JSON-serialisable form."""
        return {"passed": self.passed, "status": self.status, "message": self.message,
                "duration_s": round(self.duration_s, 4), "verdict": self.verdict, "note": self.note}


# ---------------------------------------------------------------------------------------------------------------
# extraction and assembly

_FENCE_RE = re.compile(r"```[ \t]*([A-Za-z0-9_+.\-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
_PY_LANGS = {"python", "py", "python3", "py3"}


def extract_code(completion: Optional[str]) -> str:
    """Code in a model completion: first ```` ```python ```` block, else first bare fenced block, else the raw text.

    Args:
        completion: model output (``None`` gives ``""``).

    Returns:
        The code with ``\\r\\n`` turned into ``\\n``; an unclosed block runs to the end of the text.
    """
    text = (completion or "").replace("\r\n", "\n")
    blocks = [(lang.lower(), body) for lang, body in _FENCE_RE.findall(text)]
    for lang, body in blocks:
        if lang in _PY_LANGS:
            return body
    for lang, body in blocks:
        if lang == "":
            return body
    return text


def _def_regex(name: str) -> re.Pattern:
    return re.compile(r"^(?:async\s+)?def\s+" + re.escape(name) + r"\s*\(", re.MULTILINE)


def build_humaneval_program(prompt: str, code: str, entry_point: str, test: str) -> str:
    """Assemble a HumanEval test program from the prompt and an extracted completion.

    Args:
        prompt: the HumanEval ``prompt`` (imports, helpers, signature and docstring of ``entry_point``).
        code: extracted completion, either the full function (possibly with imports/helpers) or the body only.
        entry_point: name of the function under test.
        test: the HumanEval ``test`` source defining ``check(candidate)``.

    Returns:
        Program text: solution (:func:`humaneval_solution`), then ``test``, then ``check(<entry_point>)``.

    Raises:
        ValueError: empty ``entry_point`` or ``prompt``.
    """
    solution = humaneval_solution(prompt, code, entry_point)
    return f"{solution}\n\n{test}\n\ncheck({entry_point})\n"


def humaneval_solution(prompt: str, code: str, entry_point: str) -> str:
    """The solution part of a HumanEval program (prompt/completion assembly of :func:`build_humaneval_program`).

    Raises:
        ValueError: empty ``entry_point`` or ``prompt``.
    """
    if not entry_point or not prompt:
        raise ValueError("build_humaneval_program: 'prompt' and 'entry_point' are required")
    code = (code or "").replace("\r\n", "\n")
    def_re = _def_regex(entry_point)
    full = None
    if def_re.search(code):
        full = code
    elif re.search(r"^[ \t]+(?:async\s+)?def\s+" + re.escape(entry_point) + r"\s*\(", code, re.MULTILINE):
        dedented = textwrap.dedent(code)
        if def_re.search(dedented):
            full = dedented
    if full is not None:
        m = def_re.search(prompt)
        prefix = prompt[: m.start()] if m else "".join(
            ln for ln in prompt.splitlines(True) if ln.startswith(("import ", "from "))
        )
        solution = prefix + ("\n" if prefix and not prefix.endswith("\n") else "") + full
    else:
        body = code
        first = next((ln for ln in body.splitlines() if ln.strip()), "")
        if first and not first[0].isspace():
            body = textwrap.indent(body, "    ")
        solution = prompt + ("" if prompt.endswith("\n") else "\n") + body
    return solution


def build_mbpp_program(code: str, tests: Sequence[str], test_setup: str = "") -> str:
    """Assemble an MBPP test program: solution code, ``test_setup_code``, then the ``assert`` statements.

    Args:
        code: extracted solution code.
        tests: MBPP ``test_list`` entries (``assert ...`` lines).
        test_setup: MBPP ``test_setup_code`` (usually empty).

    Returns:
        Program text.

    Raises:
        ValueError: ``tests`` is empty.
    """
    if not tests:
        raise ValueError("build_mbpp_program: no tests given")
    parts = [(code or "").replace("\r\n", "\n"), (test_setup or "").replace("\r\n", "\n"),
             "\n".join(t.replace("\r\n", "\n") for t in tests)]
    return "\n\n".join(parts) + "\n"


# ---------------------------------------------------------------------------------------------------------------
# execution


def _child_env(workdir: str) -> dict:
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": workdir,
        "TMPDIR": workdir,
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "NUMEXPR_NUM_THREADS": "1",
    }


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the child's process group. Called only while the child is not yet reaped (running or zombie), so
    its pid, which is also the group id, cannot have been reused by an unrelated process. With OS isolation the
    child is ``bwrap``; its death takes the sandbox's PID 1 and with it every process of the PID namespace."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.kill()
    except ProcessLookupError:
        pass


def _tail(f, limit: int = 2000) -> str:
    try:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(0, size - limit))
        return f.read().decode("utf-8", "replace").strip()
    except (OSError, ValueError):
        return ""


def _limits(timeout_s: float, memory_bytes, cpu_s, fsize_bytes, block_processes) -> dict:
    return {
        "as": memory_bytes,
        "cpu": int(math.ceil(cpu_s if cpu_s is not None else timeout_s + 1)),
        "fsize": fsize_bytes,
        "nproc": 0 if block_processes else None,
    }


class _Child:
    """One sandboxed child process: ``bwrap`` namespaces (``isolation="os"``) or a plain subprocess (``"none"``).

    ``stdout`` is a pipe when ``stdout_pipe`` (serve mode), else an anonymous temporary file; ``stderr`` is always
    an anonymous temporary file. With ``"none"`` a host temp dir is the child's cwd and is removed by
    :meth:`close`; with ``"os"`` the child's cwd is its private tmpfs ``/tmp`` and nothing is created on the host.
    """

    def __init__(self, isolation: str, python: Optional[str], stdout_pipe: bool, tmpfs_bytes: int):
        check_isolation(isolation)
        self.isolation = isolation
        self.host_dir: Optional[str] = None
        self.err_f = tempfile.TemporaryFile()
        self.out_f = None if stdout_pipe else tempfile.TemporaryFile()
        argv = ["-I", "-B", "-c", _child_source()]
        kw: dict = {}
        if isolation == "os":
            self.workdir = SANDBOX_WORKDIR
            py = python or sandbox_python()
            cmd = bwrap_command(py, argv, _child_env(self.workdir), tmpfs_bytes=tmpfs_bytes)
            kw.update(popen_user_kwargs())
        else:
            self.host_dir = os.path.realpath(tempfile.mkdtemp(prefix="jf_exec_"))
            self.workdir = self.host_dir
            cmd = [python or sys.executable, *argv]
            kw.update(cwd=self.workdir, env=_child_env(self.workdir))
        try:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE if stdout_pipe else self.out_f,
                                         stderr=self.err_f, start_new_session=True, close_fds=True, **kw)
        except BaseException:
            self.close()
            raise

    def kill(self) -> None:
        if self.proc.returncode is None:
            _kill_group(self.proc)

    def close(self) -> None:
        """Kill what is left, reap it, close the files, remove the host temp dir (if any)."""
        proc = getattr(self, "proc", None)
        if proc is not None:
            self.kill()
            for f in (proc.stdin, proc.stdout):
                try:
                    if f is not None:
                        f.close()
                except OSError:
                    pass
            proc.wait()
        for f in (self.out_f, self.err_f):
            if f is not None:
                f.close()
        if self.host_dir:
            shutil.rmtree(self.host_dir, ignore_errors=True)

    def crash_result(self, duration: float, cpu_limit: int) -> ExecResult:
        """Result for a child that ended without a valid reply (signal, memory, exit code)."""
        rc = self.proc.returncode
        err = _tail(self.err_f)
        if self.isolation == "os" and rc is not None and rc > 128 and err == "":
            rc = -(rc - 128)  # bwrap reports the command's death by signal N as exit status 128 + N
        if rc is not None and rc < 0:
            sig = -rc
            try:
                name = signal.Signals(sig).name
            except ValueError:
                name = str(sig)
            if sig == signal.SIGXCPU:
                return ExecResult(False, "timeout", f"CPU-time limit of {cpu_limit} s exceeded", duration)
            hint = " (CPU-time hard limit or out of memory?)" if sig == signal.SIGKILL else ""
            return ExecResult(False, "error", f"killed by {name}{hint}" + (f": {err[-500:]}" if err else ""),
                              duration)
        if rc == 0:
            return ExecResult(False, "failed", "program exited before the tests finished", duration)
        msg = f"sandbox exited with code {rc}" + (f": {err[-500:]}" if err else "")
        if "MemoryError" in err:
            msg = "MemoryError (memory limit reached) " + msg
        return ExecResult(False, "error", msg, duration)


def run_program(
    program: str,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    memory_bytes: Optional[int] = DEFAULT_MEMORY_BYTES,
    cpu_s: Optional[float] = None,
    fsize_bytes: Optional[int] = DEFAULT_FSIZE_BYTES,
    block_processes: bool = True,
    python: Optional[str] = None,
    isolation: str = DEFAULT_ISOLATION,
    audit_guard: bool = True,
) -> ExecResult:
    """Execute ``program`` in the sandbox and report whether it ran to the end without an exception.

    The verdict comes from inside the sandboxed process (a nonce-tagged result line), so code under test that
    defeats the in-process guard can forge it; scoring of HumanEval/MBPP uses the split verdict of
    :mod:`megatron_jf.eval.verdict` instead, and this function only for checks that cannot be split.

    Never raises for problems of the program itself; those become a result with status ``"failed"``,
    ``"timeout"`` or ``"error"``.

    Args:
        program: complete Python source (solution + tests).
        timeout_s: wall-clock limit in seconds, including interpreter start-up; on expiry the child's whole process
            group (with OS isolation: its PID namespace) is killed with ``SIGKILL``.
        memory_bytes: ``RLIMIT_AS`` in bytes (``None``: unlimited).
        cpu_s: ``RLIMIT_CPU`` in seconds (``None``: ``ceil(timeout_s) + 1``).
        fsize_bytes: ``RLIMIT_FSIZE`` in bytes (``None``: unlimited).
        block_processes: set ``RLIMIT_NPROC`` to 0 (effective for non-root users, which the OS-isolated sandbox
            always is; process creation is also refused by the audit hook).
        python: interpreter to run (default: :func:`megatron_jf.eval.sandbox.sandbox_python` with OS isolation,
            ``sys.executable`` without).
        isolation: ``"os"`` (bubblewrap namespaces, default) or ``"none"`` (plain subprocess; explicit opt-in).
        audit_guard: install the in-process audit hook (``False`` leaves only the OS isolation, e.g. to test it).

    Returns:
        :class:`ExecResult`.

    Raises:
        TypeError: ``program`` is not a string.
        ValueError: ``timeout_s`` is not positive, or unknown ``isolation``.
        SandboxUnavailable: ``isolation="os"`` but namespaces do not work on this machine.
    """
    if not isinstance(program, str):
        raise TypeError(f"run_program: program must be str, got {type(program).__name__}")
    if not (timeout_s > 0):
        raise ValueError(f"run_program: timeout_s must be > 0, got {timeout_s!r}")
    limits = _limits(timeout_s, memory_bytes, cpu_s, fsize_bytes, block_processes)
    nonce = secrets.token_hex(16)
    start = time.monotonic()
    try:
        child = _Child(isolation, python, stdout_pipe=False, tmpfs_bytes=max(fsize_bytes or 0, DEFAULT_TMPFS_BYTES))
    except OSError as e:
        return ExecResult(False, "error", f"could not start the sandbox: {e}", time.monotonic() - start)
    payload = json.dumps({"mode": "program", "nonce": nonce, "workdir": child.workdir, "program": program,
                          "limits": limits, "guard": bool(audit_guard)}).encode() + b"\n"
    try:
        proc = child.proc
        timed_out = False
        try:
            proc.communicate(input=payload, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            child.kill()
            proc.communicate()
        except BaseException:
            child.kill()
            proc.communicate()
            raise
        duration = time.monotonic() - start
        if timed_out:
            return ExecResult(False, "timeout", f"wall-clock limit of {timeout_s:g} s exceeded", duration)
        child.out_f.seek(0)
        result = None
        for raw in child.out_f.read().decode("utf-8", "replace").splitlines():
            try:
                obj = json.loads(raw)
            except ValueError:
                continue
            if isinstance(obj, dict) and obj.get("nonce") == nonce:
                result = obj
        if result is not None and result.get("status") in STATUSES:
            st = result["status"]
            return ExecResult(st == "passed", st, str(result.get("message", "")), duration)
        return child.crash_result(duration, limits["cpu"])
    finally:
        child.close()


def run_programs(
    programs: Sequence[str],
    *,
    workers: int = DEFAULT_WORKERS,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    memory_bytes: Optional[int] = DEFAULT_MEMORY_BYTES,
    fsize_bytes: Optional[int] = DEFAULT_FSIZE_BYTES,
    isolation: str = DEFAULT_ISOLATION,
) -> list[ExecResult]:
    """Run many programs with :func:`run_program`, ``workers`` at a time; results keep the input order.

    A failure of any one program (or of starting its sandbox) yields an ``"error"`` result for that program
    and the others still run.

    Args:
        programs: program sources.
        workers: number of concurrent subprocesses (>= 1).
        timeout_s, memory_bytes, fsize_bytes, isolation: see :func:`run_program`.

    Returns:
        One :class:`ExecResult` per program.

    Raises:
        ValueError: ``workers`` < 1.
        SandboxUnavailable: ``isolation="os"`` but namespaces do not work on this machine (checked before any
            program runs).
    """
    if not isinstance(workers, int) or workers < 1:
        raise ValueError(f"run_programs: workers must be an int >= 1, got {workers!r}")
    check_isolation(isolation)

    def one(p: str) -> ExecResult:
        t0 = time.monotonic()
        try:
            return run_program(p, timeout_s=timeout_s, memory_bytes=memory_bytes, fsize_bytes=fsize_bytes,
                               isolation=isolation)
        except Exception as e:  # noqa: BLE001 - keep going after any failure
            return ExecResult(False, "error", f"{type(e).__name__}: {e}", time.monotonic() - t0)

    if workers == 1 or len(programs) <= 1:
        return [one(p) for p in programs]
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="jf-exec") as pool:
        return list(pool.map(one, programs))
