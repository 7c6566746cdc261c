"""Child side of the code-execution sandbox (see :mod:`megatron_jf.eval.code_exec`).

This file is never imported by the evaluator. Its source, after the source of ``_wire.py`` (the value codec),
is passed to ``python -I -B -c``; with OS isolation (:mod:`megatron_jf.eval.sandbox`) that interpreter runs inside
bubblewrap namespaces as an unprivileged uid, with a private ``/tmp`` (cwd ``/tmp/jf_work``) as its only writable
place. Protocol: the first line on stdin is a JSON object ``{"mode", "nonce", "workdir", "program", "limits":
{"as", "cpu", "fsize", "nproc"}, "guard"}``; the child installs resource limits and (unless ``guard`` is false) an
audit hook, then ``exec``s ``program`` with ``__name__`` set to ``"__jf_solution__"`` (so ``if __name__ ==
"__main__":`` blocks do not run), with stdin/stdout on ``/dev/null``.
Replies go to a private duplicate of the original stdout, one JSON line each.

* ``mode="program"`` (a whole test program, for problems whose check cannot be split, and :func:`run_program`):
  one result line ``{"nonce", "status", "message"}``, then ``os._exit(0)``. The program runs in this same
  process, so this verdict is only as good as the audit hook; the split mode below does not rely on it.
* ``mode="serve"`` (split verdict, :mod:`megatron_jf.eval.verdict`): after ``exec`` the child answers
  ``{"ready": true}`` (or ``{"ready": false, "status", "message"}``), then serves calls: each further stdin line
  ``{"call": name, "args": [...], "kwargs": [[k, v], ...]}`` (values encoded by ``_wire.encode``) is answered with
  ``{"ok": value, "after": [arg after the call or null, ...]}`` or ``{"raise": [type, message, where]}``. The
  child never sees expected outputs; the comparison happens in the trusted evaluator. EOF ends the child.

Guard (``sys.addaudithook``; hooks cannot be removed once added, but code in the same process can defeat it, e.g.
through ``gc.get_objects()`` or frames, so it is defence in depth, not the boundary): opening a file for writing,
and remove/rename/mkdir/rmdir/chmod/chown/link/symlink/truncate/utime/``shutil.rmtree``/``shutil.copyfile``/... on a
path that resolves outside the temp dir raise ``PermissionError``; process creation (``os.system``,
``subprocess.Popen``, ``os.fork``, ``os.exec*``, ``os.spawn*``, ``os.posix_spawn``), ``os.kill``, sockets
(connect/bind/send), SQLite files outside the temp dir, foreign calls through ``ctypes``, and changing resource
limits are refused everywhere. Every refusal is recorded: in program mode a program that triggered one is reported
as ``status="error"`` even if it caught the exception.
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


def _write_line(fd, obj):
    try:
        line = json.dumps(obj) + "\n"
    except Exception:  # noqa: BLE001
        line = json.dumps({"raise": ["WireError", "unserialisable reply", ""]}) + "\n"
    data = line.encode("utf-8", "replace")
    while data:
        n = os.write(fd, data)
        data = data[n:]


def _read_line(f):
    raw = f.readline()
    if not raw:
        return None
    return json.loads(raw.decode("utf-8"))


_MUTABLE = (list, dict, set, bytearray)


def _serve(glb, req_f, result_fd, program_name):
    """Answer call requests until EOF (see the module docstring)."""
    while True:
        try:
            req = _read_line(req_f)
        except ValueError:
            os._exit(3)
        if req is None:
            os._exit(0)
        try:
            args = [glb.get(a[1]) if isinstance(a, list) and len(a) == 2 and a[0] == "ref" else decode(a)
                    for a in req.get("args", [])]
            kwargs = {str(k): decode(v) for k, v in req.get("kwargs", [])}
        except Exception as e:  # noqa: BLE001
            _write_line(result_fd, {"raise": ["WireError", str(e)[:500], ""]})
            continue
        name = req.get("call")
        fn = glb.get(name) if isinstance(name, str) else None
        if fn is None:
            _write_line(result_fd, {"raise": ["NameError", f"name {name!r} is not defined by the solution", ""]})
            continue
        try:
            value = fn(*args, **kwargs)
            reply = {"ok": encode(value),
                     "after": [encode(a) if isinstance(a, _MUTABLE) else None for a in args]}
        except SystemExit as e:
            reply = {"raise": ["SystemExit", f"the solution called exit({e.code!r})", ""]}
        except BaseException as e:  # noqa: BLE001 - every failure is reported to the verifier
            where = _describe(e, program_name)
            reply = {"raise": [type(e).__name__, str(e)[:500], where[:700]]}
        _write_line(result_fd, reply)


def main():
    req_f = os.fdopen(os.dup(0), "rb", buffering=0)
    payload = json.loads(req_f.readline().decode("utf-8"))
    mode = payload.get("mode", "program")
    nonce = payload.get("nonce", "")
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
    if payload.get("guard", True):
        _install_guard(workdir, violations)

    status, message = "passed", ""
    glb = {"__name__": "__jf_solution__", "__builtins__": builtins}
    if code is None:
        status, message = "failed", compile_error
    else:
        try:
            exec(code, glb)
        except SystemExit as e:
            status, message = "failed", f"program called exit({e.code!r}) before the tests finished"
        except MemoryError as e:
            status, message = "error", "MemoryError (memory limit reached)" + (f": {e}" if str(e) else "")
        except BaseException as e:  # noqa: BLE001 - the child reports every failure
            status, message = "failed", _describe(e, program_name)
    if mode == "serve":
        if status != "passed":
            _write_line(result_fd, {"ready": False, "status": status, "message": message[:2000]})
            os._exit(0)
        _write_line(result_fd, {"ready": True})
        _serve(glb, req_f, result_fd, program_name)
        os._exit(0)
    try:  # free what the program allocated before formatting the result (matters after a MemoryError)
        glb.clear()
    except BaseException:  # noqa: BLE001
        pass
    if violations:
        status = "error"
        message = "sandbox violation: " + "; ".join(violations[:3]) + (f" | {message}" if message else "")
    _write_line(result_fd, {"nonce": nonce, "status": status, "message": message[:2000]})
    os._exit(0)


if __name__ == "__main__":
    main()
