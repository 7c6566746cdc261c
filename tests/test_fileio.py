"""megatron_jf.fileio: atomic writes keep the old file on failure and give new files open()'s mode."""
import json
import os
import stat

import pytest

from megatron_jf.fileio import atomic_write_bytes, atomic_write_json, atomic_write_text


def test_atomic_write_mode_follows_umask(tmp_path):
    old = os.umask(0o022)
    try:
        atomic_write_text(tmp_path / "a.txt", "x")
        os.umask(0o077)
        atomic_write_text(tmp_path / "b.txt", "y")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a.txt").stat().st_mode) == 0o644  # not mkstemp's 0600
    assert stat.S_IMODE((tmp_path / "b.txt").stat().st_mode) == 0o600


def test_atomic_write_replaces_and_leaves_no_temp(tmp_path):
    p = tmp_path / "sub" / "r.json"
    atomic_write_json(p, {"a": 1})
    atomic_write_json(p, {"a": 2})
    assert json.loads(p.read_text()) == {"a": 2}
    assert sorted(os.listdir(p.parent)) == ["r.json"]


def test_atomic_write_failure_keeps_old_file(tmp_path):
    p = tmp_path / "r.json"
    atomic_write_json(p, {"a": 1})
    with pytest.raises(TypeError):  # fails while writing the temporary file
        atomic_write_bytes(p, "not bytes")
    assert json.loads(p.read_text()) == {"a": 1}
    assert sorted(os.listdir(tmp_path)) == ["r.json"]  # the temporary file was removed
