"""Atomic file writes: a reader (or a crash) sees the old file or the new one, never a partial one."""

from __future__ import annotations

import json
import os
import tempfile


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary file in the same directory, fsync and ``os.replace``.

    Raises:
        OSError: the directory cannot be created or written (the target is left untouched).
    """
    path = os.fspath(path)
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=d)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; give the file the mode open() would
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """UTF-8 text version of :func:`atomic_write_bytes`."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj, **kw) -> None:
    """JSON version of :func:`atomic_write_bytes` (``indent=1`` unless given; non-JSON values via ``str``)."""
    kw.setdefault("indent", 1)
    kw.setdefault("default", str)
    atomic_write_text(path, json.dumps(obj, **kw))
