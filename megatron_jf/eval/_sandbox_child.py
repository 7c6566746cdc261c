"""Child side of the code-execution sandbox (see :mod:`megatron_jf.eval.code_exec`).

This file is never imported by the evaluator. Its source is passed to ``python -I -B -c`` in a fresh temporary
directory (the child's cwd). Protocol:

* stdin: one JSON object ``{"nonce", "workdir", "program", "limits": {"as", "cpu", "fsize", "nproc"}}``.
* the child installs resource limits and an audit hook, then ``exec``s ``program`` with ``__name__`` set to
  ``"__jf_solution__"`` (so ``if __name__ == "__main__":`` blocks do not run), with stdin/stdout on ``/dev/null``.
* the result is one JSON line ``{"nonce", "status", "message"}`` written to a private duplicate of the original
  stdout, after which the child leaves with ``os._exit(0)`` (user ``atexit`` handlers do not run).

Guard (``sys.addaudithook``; hooks cannot be removed once added): opening a file for writing, and
remove/rename/mkdir/rmdir/chmod/chown/link/symlink/truncate/utime/``shutil.rmtree``/``shutil.copyfile``/... on a
path that resolves outside the temp dir raise ``PermissionError``; process creation (``os.system``,
``subprocess.Popen``, ``os.fork``, ``os.exec*``, ``os.spawn*``, ``os.posix_spawn``), ``os.kill``, sockets
(connect/bind/send), SQLite files outside the temp dir, foreign calls through ``ctypes``, and changing resource limits are refused everywhere. Every
refusal is recorded: a program that triggered one is reported as ``status="error"`` even if it caught the
exception.
"""

import builtins
import json
import linecache
import os
import resource
import sys
import traceback

_PROCESS_EVENTS = frozenset(
    {
        "os.system",
        "os.exec",
        "os.posix_spawn",
        "os.spawn",
        "os.fork",
        "os.forkpty",
        "os.kill",
        "os.killpg",
        "os.startfile",
        "subprocess.Popen",
        "pty.spawn",
        "socket.connect",
        "socket.bind",
        "socket.sendto",
        "socket.sendmsg",
        "ctypes.call_function",
        "ctypes.dlsym",
        "resource.setrlimit",
        "resource.prlimit",
        "sys.remote_exec",
    }
)
# event -> ((index of a path argument, index of its dir_fd argument or None), ...); every path must resolve inside
# the temp dir (argument layouts from the CPython audit-event table)
_PATH_EVENTS = {
    "os.remove": ((0, 1),),
    "os.rmdir": ((0, 1),),
    "os.mkdir": ((0, 2),),
    "os.chmod": ((0, 2),),
    "os.chown": ((0, 3),),
    "os.chflags": ((0, None),),
    "os.lchflags": ((0, None),),
    "os.truncate": ((0, None),),
    "os.utime": ((0, 3),),
    "os.setxattr": ((0, None),),
    "os.removexattr": ((0, None),),
    "os.rename": ((0, 2), (1, 3)),
    "os.link": ((0, 2), (1, 3)),
    "os.symlink": ((0, None), (1, 2)),
    "os.mkfifo": ((0, 2),),
    "os.mknod": ((0, 3),),
    "shutil.rmtree": ((0, 1),),
    "shutil.copyfile": ((1, None),),
    "shutil.copymode": ((1, None),),
    "shutil.copystat": ((1, None),),
    "shutil.chown": ((0, None),),
    "shutil.move": ((0, None), (1, None)),
    "shutil.make_archive": ((0, None),),
    "shutil.unpack_archive": ((1, None),),
    "sqlite3.connect": ((0, None),),  # SQLite opens files itself, without an "open" event
}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC


def _install_guard(workdir, violations):
    realpath = os.path.realpath
    join = os.path.join
    isabs = os.path.isabs
    getcwd = os.getcwd
    fspath = os.fspath
    fsdecode = os.fsdecode
    readlink = os.readlink
    prefix = workdir.rstrip(os.sep) + os.sep
    allowed_exact = {workdir, "/dev/null"}
    busy = []

    def inside(p, dir_fd=None):
        if p is None or isinstance(p, int):  # file descriptors were checked when they were opened
            return True
        try:
            p = fspath(p)
            if isinstance(p, bytes):
                p = fsdecode(p)
            if isabs(p):
                base = ""
            elif isinstance(dir_fd, int) and dir_fd >= 0:
                base = readlink(f"/proc/self/fd/{dir_fd}")
            else:
                base = getcwd()
            full = realpath(join(base, p))
        except Exception:
            return False
        return full in allowed_exact or full.startswith(prefix)

    def refuse(event, detail):
        msg = f"{event}({detail})" if detail else event
        violations.append(msg)
        raise PermissionError(f"sandbox: {msg} is not allowed")

    def hook(event, args):
        if busy:
            return
        busy.append(1)
        try:
            if event == "open":
                path = args[0]
                mode = args[1] if len(args) > 1 else None
                flags = args[2] if len(args) > 2 else 0
                writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                    isinstance(flags, int) and flags & _WRITE_FLAGS
                )
                if writing and not inside(path):
                    refuse("open for writing", repr(path))
            elif event in _PROCESS_EVENTS:
                refuse(event, "")
            elif event in _PATH_EVENTS:
                for i, fd_i in _PATH_EVENTS[event]:
                    if i < len(args):
                        dir_fd = args[fd_i] if fd_i is not None and fd_i < len(args) else None
                        if not inside(args[i], dir_fd):
                            refuse(event, repr(args[i]))
        finally:
            busy.pop()

    sys.addaudithook(hook)


def _set_limits(limits):
    """Apply the limits; the CPU hard limit is one second above the soft one so that the soft limit's SIGXCPU
    (reported as a timeout) arrives before the hard limit's SIGKILL."""
    pairs = (
        ("as", resource.RLIMIT_AS, 0),
        ("cpu", resource.RLIMIT_CPU, 1),
        ("fsize", resource.RLIMIT_FSIZE, 0),
        ("nproc", getattr(resource, "RLIMIT_NPROC", None), 0),
    )
    for key, res, extra in pairs:
        val = limits.get(key)
        if val is None or res is None:
            continue
        soft, hard = int(val), int(val) + extra
        cur_hard = resource.getrlimit(res)[1]
        if cur_hard != resource.RLIM_INFINITY:
            soft, hard = min(soft, cur_hard), min(hard, cur_hard)
        try:
            resource.setrlimit(res, (soft, hard))
        except (ValueError, OSError):
            pass
    try:
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    except (ValueError, OSError):
        pass


def _describe(exc, program_name):
    name = type(exc).__name__
    text = str(exc)
    where = ""
    for fr in reversed(traceback.extract_tb(exc.__traceback__)):
        if fr.filename == program_name:
            where = f" at line {fr.lineno}: {(fr.line or '').strip()[:200]}"
            break
    return (f"{name}: {text}" if text else name)[:500] + where


def main():
    payload = json.loads(sys.stdin.buffer.read().decode("utf-8"))
    nonce = payload["nonce"]
    workdir = os.path.realpath(payload["workdir"])
    program = payload["program"]
    limits = payload.get("limits", {})

    result_fd = os.dup(1)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    os.chdir(workdir)

    program_name = "<solution>"
    linecache.cache[program_name] = (len(program), None, program.splitlines(True), program_name)
    try:
        code = compile(program, program_name, "exec")
    except SyntaxError as e:
        code = None
        compile_error = f"{type(e).__name__}: {e.msg} (line {e.lineno})"
    except ValueError as e:  # e.g. NUL bytes in the source
        code = None
        compile_error = f"ValueError: {e}"

    violations = []
    _set_limits(limits)
    _install_guard(workdir, violations)

    status, message = "passed", ""
    if code is None:
        status, message = "failed", compile_error
    else:
        glb = {"__name__": "__jf_solution__", "__builtins__": builtins}
        try:
            exec(code, glb)
        except SystemExit as e:
            status, message = "failed", f"program called exit({e.code!r}) before the tests finished"
        except MemoryError as e:
            status, message = "error", "MemoryError (memory limit reached)" + (f": {e}" if str(e) else "")
        except RecursionError as e:
            status, message = "failed", _describe(e, program_name)
        except BaseException as e:  # noqa: BLE001 - the child reports every failure
            status, message = "failed", _describe(e, program_name)
        try:  # free what the program allocated before formatting the result (matters after a MemoryError)
            glb.clear()
        except BaseException:  # noqa: BLE001
            pass
    if violations:
        status = "error"
        message = "sandbox violation: " + "; ".join(violations[:3]) + (f" | {message}" if message else "")
    try:
        line = json.dumps({"nonce": nonce, "status": status, "message": message[:2000]}) + "\n"
    except Exception:  # noqa: BLE001
        line = json.dumps({"nonce": nonce, "status": "error", "message": "unserialisable result"}) + "\n"
    data = line.encode("utf-8", "replace")
    while data:
        n = os.write(result_fd, data)
        data = data[n:]
    os._exit(0)


if __name__ == "__main__":
    main()
