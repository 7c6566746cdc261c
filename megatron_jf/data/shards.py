"""WebDataset ``.tar`` shards of :class:`~megatron_jf.data.trajectory.TrajectoryRecord` (paper Sec. 3.1).

Shard format (version 1). Each record is one WebDataset sample with three members:

* ``<key>.json`` -- UTF-8 metadata: ``format``, ``version``, ``sample_id`` (original, unsanitized),
  ``block_size``, ``eos_reached``, ``prompt_len``, ``block_lens``, ``num_states``, ``context_lens``;
* ``<key>.npz`` -- ``numpy.savez_compressed`` arrays (no pickle): ``prompt_ids [P]``,
  ``fixed_points [R]`` (concatenated), ``drafts [sum_i S_i * n_i]`` (each block's ``[S_i, n_i]``
  drafts flattened row-major, concatenated); int32 when every id fits, else int64;
* ``<key>.sha256`` -- hex SHA-256 of the json bytes followed by the npz bytes (detects corruption
  anywhere in a sample, including bytes that would still parse).

Keys are ``<global index:09d>_<sanitized sample id>`` (only ``[A-Za-z0-9_-]``, at most 64 id
characters) so they never contain dots (WebDataset splits key and extension at the first dot) and
stay unique even when two ids sanitize to the same string.

Atomicity: a shard is written to a hidden temporary name in the same directory and renamed to
its final ``<prefix>-<index:06d>.tar`` with ``os.replace`` only once complete (after ``fsync``), so a
crash never leaves a partial file under a final name. The manifest is written the same way.

Integrity on read: tar header checksums (``tarfile``), a required end-of-archive marker (two zero
blocks -- ``tarfile`` silently stops at a corrupt or missing header, so we check the marker
ourselves), the per-sample SHA-256, and record validation. Every failure raises ``ValueError``
naming the shard path (and the sample key where known).
"""

from __future__ import annotations

from megatron_jf.fileio import atomic_write_bytes

import glob as _glob
import hashlib
import io
import json
import os
import re
import tarfile
from dataclasses import dataclass
from typing import BinaryIO, Iterator, Sequence

import numpy as np
import torch
import webdataset

from .trajectory import BlockTrajectory, TrajectoryRecord

__all__ = [
    "SHARD_FORMAT",
    "MANIFEST_FORMAT",
    "FORMAT_VERSION",
    "ShardEntry",
    "TrajectoryShardWriter",
    "sanitize_key",
    "encode_record",
    "decode_record",
    "index_shard",
    "read_record",
    "iter_shard",
    "read_shard",
    "write_manifest",
    "read_manifest",
    "expand_sources",
]

SHARD_FORMAT = "megatron-jf-trajectory"
MANIFEST_FORMAT = "megatron-jf-trajectory-manifest"
FORMAT_VERSION = 1
_MEMBERS = ("json", "npz", "sha256")
_TAR_BLOCK = 512
_INT32_MAX = 2**31 - 1


# ----------------------------------------------------------------------------- encoding
def sanitize_key(sample_id: str, index: int) -> str:
    """WebDataset key for the ``index``-th record written: ``f"{index:09d}_{id}"`` with the id reduced
    to ``[A-Za-z0-9_-]`` (other characters -> ``_``) and cut to 64 characters. Never contains a dot."""
    clean = re.sub(r"[^A-Za-z0-9_-]", "_", sample_id)[:64]
    return f"{index:09d}_{clean}"


def encode_record(record: TrajectoryRecord, key: str) -> dict[str, bytes | str]:
    """Encode a (validated) record as a WebDataset sample dict ``{"__key__", "json", "npz", "sha256"}`` of bytes."""
    blocks = record.blocks
    meta = {
        "format": SHARD_FORMAT,
        "version": FORMAT_VERSION,
        "sample_id": record.sample_id,
        "block_size": record.block_size,
        "eos_reached": record.eos_reached,
        "prompt_len": record.prompt_len,
        "block_lens": [b.length for b in blocks],
        "num_states": [b.num_states for b in blocks],
        "context_lens": [b.context_len for b in blocks],
    }
    prompt = record.prompt_ids
    fixed = torch.cat([b.fixed_point for b in blocks])
    drafts = torch.cat([b.drafts.reshape(-1) for b in blocks])
    vmax = max(int(prompt.max()), int(fixed.max()), int(drafts.max()))
    dtype = np.int32 if vmax <= _INT32_MAX else np.int64
    buf = io.BytesIO()
    np.savez_compressed(
        buf,
        prompt_ids=prompt.numpy().astype(dtype),
        fixed_points=fixed.numpy().astype(dtype),
        drafts=drafts.numpy().astype(dtype),
    )
    npz_bytes = buf.getvalue()
    json_bytes = json.dumps(meta, separators=(",", ":")).encode("utf-8")
    digest = hashlib.sha256(json_bytes + npz_bytes).hexdigest().encode("ascii")
    return {"__key__": key, "json": json_bytes, "npz": npz_bytes, "sha256": digest}


def _int_array(arr: np.ndarray, name: str, where: str) -> torch.Tensor:
    if arr.dtype not in (np.int32, np.int64) or arr.ndim != 1:
        raise ValueError(f"{where}: array {name!r} must be 1-D int32/int64, got {arr.dtype} {arr.shape}")
    return torch.from_numpy(arr.astype(np.int64, copy=False).copy())


def decode_record(json_bytes: bytes, npz_bytes: bytes, sha256_hex: bytes, *, where: str = "<bytes>") -> TrajectoryRecord:
    """Decode and validate one sample's members (inverse of :func:`encode_record`).

    Args:
        where: a location string used in error messages (e.g. ``"shard /x/a.tar, key 000000001_abc"``).

    Raises:
        ValueError: checksum mismatch, unparsable json/npz, unknown format/version, inconsistent sizes,
            or an invalid record -- all naming ``where``.
    """
    digest = hashlib.sha256(json_bytes + npz_bytes).hexdigest()
    if digest.encode("ascii") != bytes(sha256_hex).strip():
        raise ValueError(f"{where}: checksum mismatch (corrupt sample)")
    try:
        meta = json.loads(json_bytes.decode("utf-8"))
        with np.load(io.BytesIO(npz_bytes), allow_pickle=False) as z:
            arrays = {k: z[k] for k in ("prompt_ids", "fixed_points", "drafts")}
    except Exception as e:  # json/zip/zlib/key errors all mean a bad sample
        raise ValueError(f"{where}: cannot decode sample ({type(e).__name__}: {e})") from e
    if not isinstance(meta, dict) or meta.get("format") != SHARD_FORMAT or meta.get("version") != FORMAT_VERSION:
        raise ValueError(f"{where}: not a {SHARD_FORMAT} v{FORMAT_VERSION} sample")
    try:
        block_lens = [int(v) for v in meta["block_lens"]]
        num_states = [int(v) for v in meta["num_states"]]
        context_lens = [int(v) for v in meta["context_lens"]]
        sid, bs, eos = meta["sample_id"], meta["block_size"], meta["eos_reached"]
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{where}: bad metadata ({type(e).__name__}: {e})") from e
    prompt = _int_array(arrays["prompt_ids"], "prompt_ids", where)
    fixed = _int_array(arrays["fixed_points"], "fixed_points", where)
    drafts = _int_array(arrays["drafts"], "drafts", where)
    if not (len(block_lens) == len(num_states) == len(context_lens)):
        raise ValueError(f"{where}: block_lens/num_states/context_lens lengths differ")
    if sum(block_lens) != fixed.numel() or sum(s * n for s, n in zip(num_states, block_lens)) != drafts.numel():
        raise ValueError(f"{where}: array sizes do not match the metadata")
    if any(v <= 0 for v in block_lens) or any(v <= 0 for v in num_states):
        raise ValueError(f"{where}: non-positive block length or state count in metadata")
    fps = torch.split(fixed, block_lens)
    drs = torch.split(drafts, [s * n for s, n in zip(num_states, block_lens)])
    blocks = [
        BlockTrajectory(context_len=c, drafts=d.reshape(s, n), fixed_point=f)
        for c, d, f, s, n in zip(context_lens, drs, fps, num_states, block_lens)
    ]
    rec = TrajectoryRecord(sample_id=sid, prompt_ids=prompt, blocks=blocks, block_size=bs, eos_reached=eos)
    try:
        rec.validate()
    except ValueError as e:
        raise ValueError(f"{where}: invalid record: {e}") from e
    return rec


# ----------------------------------------------------------------------------- reading
@dataclass(frozen=True)
class ShardEntry:
    """Location of one sample inside a shard: its key and ``(offset, size)`` in bytes of each member."""

    key: str
    json: tuple[int, int]
    npz: tuple[int, int]
    sha256: tuple[int, int]


def index_shard(path: str) -> list[ShardEntry]:
    """Scan a shard's tar headers (member data is skipped, not read) and return its samples in order.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: naming ``path``: unreadable/corrupt/truncated tar, missing end-of-archive marker,
            a member that is not a regular ``<key>.<json|npz|sha256>`` file, or a sample missing members.
    """
    if not os.path.exists(path):
        raise FileNotFoundError(f"shard not found: {path}")
    try:
        with open(path, "rb") as fh:
            with tarfile.open(fileobj=fh, mode="r:") as tf:
                members = tf.getmembers()
                end = tf.offset
            fh.seek(end)
            marker = fh.read(2 * _TAR_BLOCK)
    except (tarfile.TarError, EOFError, OSError) as e:
        raise ValueError(f"corrupt or truncated shard {path}: {type(e).__name__}: {e}") from e
    if len(marker) < 2 * _TAR_BLOCK or any(marker):
        raise ValueError(
            f"corrupt or truncated shard {path}: no valid tar header or end-of-archive marker at byte {end}"
        )
    entries: list[ShardEntry] = []
    seen: set[str] = set()
    cur_key: str | None = None
    cur: dict[str, tuple[int, int]] = {}

    def flush() -> None:
        if cur_key is None:
            return
        if set(cur) != set(_MEMBERS):
            raise ValueError(f"shard {path}: sample {cur_key!r} has members {sorted(cur)}, expected {list(_MEMBERS)}")
        entries.append(ShardEntry(key=cur_key, json=cur["json"], npz=cur["npz"], sha256=cur["sha256"]))

    for m in members:
        if not m.isreg():
            raise ValueError(f"shard {path}: unexpected non-file member {m.name!r}")
        base = os.path.basename(m.name)
        if "." not in base:
            raise ValueError(f"shard {path}: member {m.name!r} has no extension")
        key, ext = base.split(".", 1)
        if ext not in _MEMBERS:
            raise ValueError(f"shard {path}: unexpected member {m.name!r}")
        if key != cur_key:
            flush()
            if key in seen:
                raise ValueError(f"shard {path}: duplicate or non-contiguous sample key {key!r}")
            seen.add(key)
            cur_key, cur = key, {}
        if ext in cur:
            raise ValueError(f"shard {path}: duplicate member {m.name!r}")
        cur[ext] = (m.offset_data, m.size)
    flush()
    return entries


def _read_exact(fh: BinaryIO, span: tuple[int, int], where: str) -> bytes:
    off, size = span
    fh.seek(off)
    data = fh.read(size)
    if len(data) != size:
        raise ValueError(f"{where}: truncated member data")
    return data


def read_record(path: str, entry: ShardEntry, fh: BinaryIO | None = None) -> TrajectoryRecord:
    """Read one sample of a shard by its :class:`ShardEntry` (``fh``: an optional open handle on ``path``).

    Raises:
        ValueError: naming the shard and key, on any corruption (see :func:`decode_record`).
    """
    where = f"shard {path}, key {entry.key}"
    own = fh is None
    try:
        f = open(path, "rb") if own else fh
        try:
            j = _read_exact(f, entry.json, where)
            z = _read_exact(f, entry.npz, where)
            s = _read_exact(f, entry.sha256, where)
        finally:
            if own:
                f.close()
    except OSError as e:
        raise ValueError(f"{where}: read error: {e}") from e
    return decode_record(j, z, s, where=where)


def read_lengths(path: str, entries: Sequence[ShardEntry]) -> list[tuple[int, int]]:
    """``(prompt tokens, response tokens)`` of each of ``entries`` of the shard at ``path``, from the samples' JSON
    headers only (their arrays are not read): what a length-grouped sampler needs.

    Raises:
        ValueError: naming the shard and key, on a read error or a header without ``prompt_len`` / ``block_lens``.
    """
    out = []
    try:
        with open(path, "rb") as fh:
            for e in entries:
                where = f"shard {path}, key {e.key}"
                try:
                    meta = json.loads(_read_exact(fh, e.json, where))
                    out.append((int(meta["prompt_len"]), int(sum(meta["block_lens"]))))
                except (KeyError, TypeError, json.JSONDecodeError) as err:
                    raise ValueError(f"{where}: bad header ({type(err).__name__}: {err})") from err
    except OSError as e:
        raise ValueError(f"shard {path}: read error: {e}") from e
    return out


def iter_shard(path: str) -> Iterator[TrajectoryRecord]:
    """Yield the records of one shard in stored order (the whole shard is indexed, i.e. checked, first).

    Raises:
        FileNotFoundError / ValueError: as :func:`index_shard` and :func:`read_record`.
    """
    entries = index_shard(path)
    with open(path, "rb") as fh:
        for e in entries:
            yield read_record(path, e, fh)


def read_shard(path: str) -> list[TrajectoryRecord]:
    """All records of one shard, in order. Raises as :func:`iter_shard`."""
    return list(iter_shard(path))


# ----------------------------------------------------------------------------- writing
def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class TrajectoryShardWriter:
    """Write validated records into rolling, atomically-renamed WebDataset shards (see module docstring).

    Usage (the collector)::

        with TrajectoryShardWriter(out_dir, prefix="traj", max_records_per_shard=1000, eos_id=eos) as w:
            for rec in records:
                if is_degenerate(rec.response_ids(), eos_id=eos):
                    w.count_filtered("degenerate"); continue
                w.write(rec)
        w.write_manifest(model="...", tokenizer="...")

    Leaving the ``with`` block by an exception aborts the open shard (its temporary file is deleted;
    completed shards stay) and writes no manifest.

    Args:
        directory: output directory (created if missing).
        prefix: shard name prefix; shards are ``<prefix>-<index:06d>.tar``.
        max_records_per_shard: roll to a new shard after this many records (>= 1).
        max_bytes_per_shard: also roll once a shard reaches about this many bytes (optional; checked
            after each record, tarfile buffers up to 10 KiB, so shards may overshoot by a record + 10 KiB).
        eos_id: forwarded to ``record.validate`` to check the EOS convention.
        start_index: index of the first shard (to append to an existing directory).

    Raises:
        FileExistsError: a final shard name already exists (shards are never overwritten).
        ValueError: an invalid record, or a record whose ``block_size`` differs from the first one's.
    """

    def __init__(
        self,
        directory: str,
        prefix: str = "trajectories",
        max_records_per_shard: int = 1000,
        max_bytes_per_shard: int | None = None,
        eos_id: int | None = None,
        start_index: int = 0,
    ) -> None:
        if max_records_per_shard < 1:
            raise ValueError(f"max_records_per_shard must be >= 1, got {max_records_per_shard}")
        if not re.fullmatch(r"[A-Za-z0-9_-]+", prefix):
            raise ValueError(f"shard prefix must match [A-Za-z0-9_-]+, got {prefix!r}")
        os.makedirs(directory, exist_ok=True)
        self.directory = os.path.abspath(directory)
        self.prefix = prefix
        self.max_records = max_records_per_shard
        self.max_bytes = max_bytes_per_shard
        self.eos_id = eos_id
        self.block_size: int | None = None
        self.shards: list[dict] = []  # completed: {"path", "num_records", "num_bytes"}
        self.filtered: dict[str, int] = {}
        self.num_records = 0
        self.num_blocks = 0
        self.num_response_tokens = 0
        self._next_index = start_index
        self._closed = False
        self._fh: BinaryIO | None = None
        self._tw: webdataset.TarWriter | None = None
        self._tmp: str | None = None
        self._final: str | None = None
        self._cur_records = 0

    # -- shard lifecycle
    def _open_shard(self) -> None:
        name = f"{self.prefix}-{self._next_index:06d}.tar"
        final = os.path.join(self.directory, name)
        if os.path.exists(final):
            raise FileExistsError(f"shard already exists, refusing to overwrite: {final}")
        self._final = final
        self._tmp = os.path.join(self.directory, f".{name}.partial-{os.getpid()}")
        self._fh = open(self._tmp, "wb")
        self._tw = webdataset.TarWriter(self._fh, mtime=0.0)
        self._cur_records = 0
        self._next_index += 1

    def _finish_shard(self) -> None:
        assert self._tw is not None and self._fh is not None and self._tmp and self._final
        self._tw.close()  # writes the end-of-archive blocks; does not close our file object
        self._fh.flush()
        os.fsync(self._fh.fileno())
        size = self._fh.tell()
        self._fh.close()
        os.replace(self._tmp, self._final)
        _fsync_dir(self.directory)
        self.shards.append({"path": os.path.basename(self._final), "num_records": self._cur_records, "num_bytes": size})
        self._tw = self._fh = self._tmp = self._final = None

    def abort(self) -> None:
        """Discard the shard being written (delete its temporary file); completed shards are kept."""
        if self._fh is not None:
            try:
                if self._tw is not None:
                    try:
                        self._tw.close()  # release tarfile's stream now (its __del__ would write to a closed file)
                    except Exception:
                        pass  # the file is discarded anyway
                self._fh.close()
            finally:
                if self._tmp and os.path.exists(self._tmp):
                    os.remove(self._tmp)
        self._tw = self._fh = self._tmp = self._final = None
        self._closed = True

    # -- public API
    def write(self, record: TrajectoryRecord) -> None:
        """Validate and append one record (rolls to a new shard when the current one is full).

        Raises:
            ValueError: invalid record or block-size mismatch (nothing is written for it).
            RuntimeError: the writer is closed.
        """
        if self._closed:
            raise RuntimeError("TrajectoryShardWriter is closed")
        record.validate(eos_id=self.eos_id)
        if self.block_size is None:
            self.block_size = record.block_size
        elif record.block_size != self.block_size:
            raise ValueError(
                f"sample {record.sample_id!r}: block_size {record.block_size} differs from this dataset's {self.block_size}"
            )
        sample = encode_record(record, sanitize_key(record.sample_id, self.num_records))
        if self._tw is None:
            self._open_shard()
        assert self._tw is not None and self._fh is not None
        self._tw.write(sample)
        self._cur_records += 1
        self.num_records += 1
        self.num_blocks += record.num_blocks
        self.num_response_tokens += record.response_len
        if self._cur_records >= self.max_records or (
            self.max_bytes is not None and self._fh.tell() >= self.max_bytes
        ):
            self._finish_shard()

    def count_filtered(self, reason: str, count: int = 1) -> None:
        """Count records dropped before writing (e.g. ``"degenerate"``); recorded in the manifest."""
        self.filtered[reason] = self.filtered.get(reason, 0) + int(count)

    def close(self) -> list[dict]:
        """Finish the open shard (if any) and return the list of completed shards. Idempotent."""
        if not self._closed:
            if self._tw is not None:
                self._finish_shard()
            self._closed = True
        return list(self.shards)

    def __enter__(self) -> "TrajectoryShardWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def write_manifest(
        self,
        path: str | None = None,
        *,
        model: str,
        tokenizer: str,
        extra: dict | None = None,
    ) -> str:
        """Close the writer and atomically write the manifest (default ``<directory>/<prefix>.manifest.json``).

        Returns:
            The manifest path.

        Raises:
            ValueError: no record was written (an empty dataset gets no manifest).
        """
        self.close()
        if self.block_size is None:
            raise ValueError(f"no records were written to {self.directory}; refusing to write an empty manifest")
        path = path or os.path.join(self.directory, f"{self.prefix}.manifest.json")
        write_manifest(
            path,
            model=model,
            tokenizer=tokenizer,
            block_size=self.block_size,
            shards=self.shards,
            counts={
                "records": self.num_records,
                "blocks": self.num_blocks,
                "response_tokens": self.num_response_tokens,
                "shards": len(self.shards),
            },
            filtered=self.filtered,
            extra=extra,
            shard_dir=self.directory,
        )
        return path


# ----------------------------------------------------------------------------- manifest
def write_manifest(
    path: str,
    *,
    model: str,
    tokenizer: str,
    block_size: int,
    shards: Sequence[dict],
    counts: dict | None = None,
    filtered: dict | None = None,
    extra: dict | None = None,
    shard_dir: str | None = None,
) -> None:
    """Atomically write a dataset manifest (JSON).

    Schema: ``{"format", "format_version", "model", "tokenizer", "block_size", "counts": {"records",
    ...}, "shards": [{"path" (relative to the manifest's directory), "num_records", "num_bytes"}],
    "filtered": {reason: count}, "extra": {...}}``.

    Args:
        shard_dir: directory the shard ``path`` entries are relative to (default: the manifest's).
    """
    mdir = os.path.dirname(os.path.abspath(path))
    sdir = os.path.abspath(shard_dir) if shard_dir else mdir
    rel = [{**s, "path": os.path.relpath(os.path.join(sdir, s["path"]), mdir)} for s in shards]
    counts = dict(counts or {})
    counts.setdefault("records", sum(int(s["num_records"]) for s in shards))
    counts.setdefault("shards", len(shards))
    doc = {
        "format": MANIFEST_FORMAT,
        "format_version": FORMAT_VERSION,
        "model": model,
        "tokenizer": tokenizer,
        "block_size": int(block_size),
        "counts": counts,
        "shards": rel,
        "filtered": dict(filtered or {}),
        "extra": dict(extra or {}),
    }
    atomic_write_bytes(path, (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode("utf-8"))


def read_manifest(path: str) -> dict:
    """Load and check a manifest; adds ``"shard_paths"`` (absolute paths, in manifest order).

    Raises:
        FileNotFoundError: missing manifest.
        ValueError: naming ``path``: unparsable JSON, wrong format/version or missing fields.
    """
    if not os.path.exists(path):
        raise FileNotFoundError(f"manifest not found: {path}")
    try:
        with open(path, "rb") as f:
            doc = json.loads(f.read().decode("utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read manifest {path}: {e}") from e
    if not isinstance(doc, dict) or doc.get("format") != MANIFEST_FORMAT or doc.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"manifest {path}: not a {MANIFEST_FORMAT} v{FORMAT_VERSION} file")
    for k in ("block_size", "shards", "counts"):
        if k not in doc:
            raise ValueError(f"manifest {path}: missing field {k!r}")
    mdir = os.path.dirname(os.path.abspath(path))
    try:
        doc["shard_paths"] = [os.path.normpath(os.path.join(mdir, s["path"])) for s in doc["shards"]]
    except (TypeError, KeyError) as e:
        raise ValueError(f"manifest {path}: bad shard list ({e})") from e
    return doc


def expand_sources(sources: str | Sequence[str]) -> list[tuple[str, int | None, int | None]]:
    """Expand shard sources into ``(shard_path, expected_records or None, manifest block_size or None)``.

    Each source is a ``.tar`` path, a glob (expanded and sorted), a directory (its ``*.tar`` files,
    sorted) or a manifest ``.json`` (its shards, in manifest order). Duplicates are removed
    (first occurrence wins); the order is otherwise preserved.

    Raises:
        FileNotFoundError: a source matches nothing (the message names it).
    """
    if isinstance(sources, (str, os.PathLike)):
        sources = [sources]
    out: list[tuple[str, int | None, int | None]] = []
    seen: set[str] = set()

    def add(p: str, count: int | None, bs: int | None) -> None:
        ap = os.path.abspath(p)
        if ap not in seen:
            seen.add(ap)
            out.append((ap, count, bs))

    for src in sources:
        src = os.fspath(src)
        if src.endswith(".json") and not _glob.has_magic(src):
            doc = read_manifest(src)
            for p, s in zip(doc["shard_paths"], doc["shards"]):
                add(p, int(s["num_records"]), int(doc["block_size"]))
        elif os.path.isdir(src):
            paths = sorted(_glob.glob(os.path.join(src, "*.tar")))
            if not paths:
                raise FileNotFoundError(f"no .tar shards in directory {src}")
            for p in paths:
                add(p, None, None)
        elif _glob.has_magic(src):
            paths = sorted(_glob.glob(src))
            if not paths:
                raise FileNotFoundError(f"shard pattern matched no files: {src}")
            for p in paths:
                add(p, None, None)
        else:
            if not os.path.exists(src):
                raise FileNotFoundError(f"shard not found: {src}")
            add(src, None, None)
    return out
