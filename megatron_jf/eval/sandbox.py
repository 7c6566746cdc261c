"""Operating-system isolation of generated code with bubblewrap (``bwrap``, Debian package ``bubblewrap``).

Every sandboxed program (see :mod:`megatron_jf.eval.code_exec`) is started as::

    bwrap --unshare-all --unshare-user --disable-userns --die-with-parent --new-session \\
          --uid 65534 --gid 65534 --ro-bind /usr /usr  (+ /bin, /lib, /lib64, /sbin links, /etc/ld.so.cache) \\
          --ro-bind <python prefix> --proc /proc --dev /dev --size <bytes> --tmpfs /tmp --chdir /tmp/jf_work \\
          --clearenv ... -- <python> -I -B -c <child source>

so the program runs in its own user, mount, PID, network, IPC, UTS and cgroup namespaces; it sees a read-only
``/usr`` and interpreter and nothing else of the host (no ``/work``, ``/root``, ``/home``, no evaluator files,
no benchmark data); its only writable place is a private, size-limited ``tmpfs`` at ``/tmp`` (cwd
``/tmp/jf_work``) that vanishes with the sandbox; it has no network (only a down loopback); it cannot see, signal
or ``pidfd_open`` any process outside its PID namespace; and when the sandbox's PID 1 dies (timeout kill, or the
evaluator dying: ``--die-with-parent``) the kernel kills every process left in the namespace, ``setsid``
grandchildren included.

When the evaluator runs as root, ``bwrap`` itself is started as the unprivileged uid/gid :data:`SANDBOX_UID`
(``nobody``), so the program is unprivileged outside its namespace as well (``RLIMIT_NPROC`` then applies, and
files owned by root are not the program's). The interpreter must then be readable by that uid:
:func:`sandbox_python` picks ``sys.executable`` when it is, else ``/usr/bin/python3.X`` of the same minor
version, else ``/usr/bin/python3`` (3.8 or newer; the child and the value codec need nothing newer), or
``$MEGATRON_JF_SANDBOX_PYTHON``.

:func:`check_isolation` probes once per process whether this works here (user namespaces may be disabled, e.g.
``kernel.unprivileged_userns_clone=0`` or a container without ``CLONE_NEWUSER``) and raises
:class:`SandboxUnavailable` with the reason; callers refuse to execute generated code unless explicitly told to
run unisolated (``isolation="none"``, the ``--unisolated`` flag of ``tools/evaluate.py``), which the reports
then state in capitals.
"""

from __future__ import annotations

import functools
import os
import shutil
import stat
import subprocess
import sys
import sysconfig
from typing import Optional, Sequence

from megatron_jf import env

__all__ = [
    "ISOLATIONS",
    "SANDBOX_UID",
    "SandboxUnavailable",
    "bwrap_command",
    "check_isolation",
    "isolation_status",
    "popen_user_kwargs",
    "sandbox_python",
]

#: ``"os"``: bubblewrap namespaces (default); ``"none"``: plain subprocess + audit hook (explicit opt-in only)
ISOLATIONS = ("os", "none")
#: uid/gid the sandbox runs as when the evaluator is root (``nobody``/``nogroup`` on Debian)
SANDBOX_UID = 65534
SANDBOX_GID = 65534
#: the program's cwd (and ``HOME``/``TMPDIR``) inside the sandbox, on the private tmpfs
SANDBOX_WORKDIR = "/tmp/jf_work"
#: default size of the sandbox's private ``/tmp`` (tmpfs), bytes
DEFAULT_TMPFS_BYTES = 64 << 20

_INSTALL_HINT = "install bubblewrap (`apt-get install -y bubblewrap`, or `bash scripts/install_sandbox_deps.sh`)"


class SandboxUnavailable(RuntimeError):
    """OS isolation cannot be set up on this machine; the message says why and how to fix it (or to opt out)."""


def _as_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def _readable_by_other(path: str) -> bool:
    """Every ancestor directory of ``path`` is world-searchable and ``path`` is world-readable/executable."""
    path = os.path.realpath(path)
    try:
        st = os.stat(path)
        if not (st.st_mode & stat.S_IROTH and (stat.S_ISDIR(st.st_mode) or st.st_mode & stat.S_IXOTH)):
            return False
        d = os.path.dirname(path)
        while True:
            if not os.stat(d).st_mode & stat.S_IXOTH:
                return False
            parent = os.path.dirname(d)
            if parent == d:
                return True
            d = parent
    except OSError:
        return False


def _prefix_of(python: str) -> str:
    """Installation prefix of an interpreter binary (``<prefix>/bin/python3.x`` -> ``<prefix>``)."""
    return os.path.dirname(os.path.dirname(os.path.realpath(python)))


@functools.lru_cache(maxsize=None)
def _python_minor(python: str) -> Optional[str]:
    try:
        out = subprocess.run([python, "-I", "-S", "-c", "import sys;print('%d.%d' % sys.version_info[:2])"],
                             capture_output=True, text=True, timeout=60)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def sandbox_python() -> str:
    """Interpreter the sandbox runs (absolute, symlinks resolved): ``$MEGATRON_JF_SANDBOX_PYTHON`` (also read as
    ``JF_SANDBOX_PYTHON``; :func:`megatron_jf.env.sandbox_python`), else the evaluator's own
    base interpreter if the sandbox uid can read it, else ``/usr/bin/python3.X`` of the same minor version, else
    ``/usr/bin/python3`` if it is 3.8 or newer.

    Raises:
        SandboxUnavailable: no suitable interpreter.
    """
    given = env.sandbox_python()
    if given:
        return os.path.realpath(given)
    own = os.path.realpath(sys.executable)
    if not _as_root() or _readable_by_other(own):
        return own
    want = "%d.%d" % sys.version_info[:2]
    same = f"/usr/bin/python{want}"
    if os.path.exists(same) and _readable_by_other(same) and _python_minor(os.path.realpath(same)) == want:
        return os.path.realpath(same)
    cand = "/usr/bin/python3"
    got = _python_minor(os.path.realpath(cand)) if os.path.exists(cand) and _readable_by_other(cand) else None
    if got and tuple(int(x) for x in got.split(".")) >= (3, 8):
        return os.path.realpath(cand)
    raise SandboxUnavailable(
        f"the evaluator's interpreter {own} is not readable by the sandbox uid {SANDBOX_UID} and there is no "
        "/usr/bin/python3 (3.8+); install it (`apt-get install -y python3`, scripts/install_sandbox_deps.sh) or "
        "set MEGATRON_JF_SANDBOX_PYTHON to a world-readable interpreter")


def popen_user_kwargs() -> dict:
    """``subprocess.Popen`` keyword arguments that drop root to :data:`SANDBOX_UID` (empty when not root)."""
    if _as_root():
        return {"user": SANDBOX_UID, "group": SANDBOX_GID, "extra_groups": []}
    return {}


def bwrap_command(python: str, argv: Sequence[str], env: dict, *, tmpfs_bytes: int = DEFAULT_TMPFS_BYTES) -> list:
    """The ``bwrap`` command line that runs ``python *argv`` isolated (see the module docstring).

    Args:
        python: interpreter path (from :func:`sandbox_python`).
        argv: interpreter arguments.
        env: the complete environment inside the sandbox.
        tmpfs_bytes: size of the private writable ``/tmp``, bytes.
    """
    bwrap = shutil.which("bwrap") or "bwrap"
    cmd = [bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session",
           "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_GID),
           "--ro-bind", "/usr", "/usr"]
    for link, target in (("/bin", "usr/bin"), ("/lib", "usr/lib"), ("/lib64", "usr/lib64"), ("/sbin", "usr/sbin")):
        if os.path.islink(link):
            cmd += ["--symlink", target, link]
        elif os.path.isdir(link):
            cmd += ["--ro-bind", link, link]
    cmd += ["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache",
            "--ro-bind-try", "/etc/localtime", "/etc/localtime"]
    prefix = _prefix_of(python)
    if not (prefix == "/usr" or prefix.startswith("/usr/")):
        cmd += ["--ro-bind", prefix, prefix]
    libdir = sysconfig.get_config_var("LIBDIR") if os.path.realpath(sys.executable) == python else None
    if libdir and os.path.isdir(libdir) and not libdir.startswith(prefix + os.sep) and not libdir.startswith("/usr/"):
        cmd += ["--ro-bind", libdir, libdir]
    cmd += ["--proc", "/proc", "--dev", "/dev", "--size", str(int(tmpfs_bytes)), "--tmpfs", "/tmp",
            "--dir", SANDBOX_WORKDIR, "--chdir", SANDBOX_WORKDIR, "--clearenv"]
    for k, v in env.items():
        cmd += ["--setenv", k, v]
    return cmd + ["--", python, *argv]


@functools.lru_cache(maxsize=None)
def _probe() -> Optional[str]:
    """``None`` when an isolated interpreter starts and sees what it should; else the reason it does not."""
    if not shutil.which("bwrap"):
        return f"bubblewrap (`bwrap`) is not installed; {_INSTALL_HINT}"
    try:
        python = sandbox_python()
    except SandboxUnavailable as e:
        return str(e)
    code = ("import os,socket;"
            "a=os.getuid();p=os.getpid();w=os.access('/usr',os.W_OK);h=os.path.exists('/work') or os.path.exists("
            "'/etc/passwd');s=socket.socket();e=s.connect_ex(('10.255.255.1',9));print(a,p,int(w),int(h),int(e!=0))")
    cmd = bwrap_command(python, ["-I", "-B", "-S", "-c", code], {"PATH": "/usr/bin:/bin"})
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, **popen_user_kwargs())
    except (OSError, subprocess.SubprocessError) as e:
        return f"bubblewrap could not be started: {e}"
    if r.returncode != 0:
        return (f"bubblewrap cannot create namespaces here (exit {r.returncode}: {r.stderr.strip()[:300]}); user "
                "namespaces may be disabled (sysctl kernel.unprivileged_userns_clone / user.max_user_namespaces) "
                "or the container forbids them")
    want = f"{SANDBOX_UID} 2 0 0 1"  # uid, pid 2 under bwrap's PID 1, /usr read-only, host dirs hidden, no network
    if r.stdout.strip() != want:
        return f"bubblewrap started but the sandbox is not as expected (got {r.stdout.strip()!r}, want {want!r})"
    return None


def isolation_status() -> Optional[str]:
    """``None`` when OS isolation works on this machine, else the reason it does not (probed once, cached)."""
    return _probe()


def check_isolation(isolation: str) -> None:
    """Raise unless generated code may be executed under ``isolation``.

    Raises:
        ValueError: ``isolation`` is not one of :data:`ISOLATIONS`.
        SandboxUnavailable: ``isolation == "os"`` and bubblewrap namespaces do not work here.
    """
    if isolation not in ISOLATIONS:
        raise ValueError(f"isolation must be one of {ISOLATIONS}, got {isolation!r}")
    if isolation == "os":
        why = _probe()
        if why is not None:
            raise SandboxUnavailable(
                f"refusing to execute generated code without OS isolation: {why}. Pass isolation='none' "
                "(tools/evaluate.py --unisolated) to run it with only the in-process guard, which is NOT a "
                "security boundary.")
