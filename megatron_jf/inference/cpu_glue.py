"""The lean forward's fp32 CPU glue: a layer's norms, RoPE and SwiGLU as three calls into C (``csrc/glue.c``).

On CPU each torch op is a dispatch, and the first ops after a product that streamed megabytes of weights find torch's
own code and data evicted from the caches: measured on an Intel Xeon (one thread), ``x + 1`` on 576 floats costs
2.6 us after another op and 26 us after a ``[1, 1536] @ [1536, 576]`` product; an RMSNorm 12 us and 52-65 us. A
layer of :class:`~megatron_jf.inference.lean_forward.LeanForward` runs about 30 such ops between its four products.
Here they are :func:`Glue.add_rmsnorm` (residual add and RMSNorm), :func:`Glue.rope_split_qkv` (split the QKV
product, RoPE on q and k) and :func:`Glue.silu_mul` (SwiGLU), called through ``ctypes`` on preallocated fp32 tensors.
:func:`Glue.skinny_mm` is a product kernel for a few rows (the lean forward's ``skinny`` kernel, taken per weight
shape and row count where :func:`~megatron_jf.inference.cost_model.calibrate_products` measures it fastest): MKL and
oneDNN read a weight from memory markedly slower for 2-4 rows than for one, this kernel nearly as fast.
:func:`Glue.decode_attn` is a decode step's attention (a few new tokens per row over the KV cache, causal among them;
:func:`Glue.rope_split_qkv_to_cache` writes their keys and values into the cache first): SDPA's call cost 25-40 us a
layer for a handful of queries where the arithmetic is a few microseconds (the quickstart's 4-layer model, one
thread, Intel Xeon, same process: a one-token forward 1.05 -> 0.88 ms, a 4-token one 1.24 -> 1.01).

Exactness: each token's values come from the same loop in the same order whatever the number of tokens in the
forward, so the glue adds no dependence on the row count of its own (the products may still round a row differently
by row count, as before; greedy output is AR's either way, by verification); values differ from the torch ops' by
rounding (a fixed summation order in the norm and the attention, a polynomial ``exp`` in SiLU and the softmax: about
one ulp). Not from the paper: this is the CPU engine's forward, and it changes no decoding rule.

:func:`load` compiles the source once per machine with the C compiler (``$CC``, else ``cc``) and ``-O3
-march=native -ffp-contract=off`` into ``<cost cache dir>/glue/<hash>.so`` (the hash covers the source, flags,
compiler and CPU, written to a temporary name and renamed), and returns None -- the lean forward then runs the torch
ops -- where ``MEGATRON_JF_CPU_GLUE=0``, no compiler or build works, or the library's result differs from the torch
ops' beyond rounding on a check case. Only fp32, contiguous CPU tensors, outside autograd and autocast.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile

import torch
import torch.nn.functional as F

from megatron_jf import env

logger = logging.getLogger(__name__)

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "glue.c")
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC")

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class Glue:
    """The compiled glue functions (see module docstring), made by :func:`load`.

    Every tensor argument is a contiguous fp32 CPU tensor of the shape each method names; the methods check nothing
    (they run between the products of every decode forward) and raise nothing: a wrong shape reads or writes out of
    bounds. Callers are the lean forward, which takes this path only for fp32 CPU forwards it builds the buffers of
    (:meth:`~megatron_jf.inference.lean_forward.LeanForward._hidden_glue`), and ``_check`` below."""

    def __init__(self, lib: ctypes.CDLL, path: str):
        self.path = path
        self._lib = lib
        self._add_rmsnorm = lib.jf_add_rmsnorm
        self._add_rmsnorm.argtypes = [_P, _P, _P, _P, _I, _I, _F]
        self._add = lib.jf_add
        self._add.argtypes = [_P, _P, _I, _I]
        self._rope = lib.jf_rope_split_qkv
        self._rope.argtypes = [_P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _I]
        self._attn = lib.jf_decode_attn
        self._attn.argtypes = [_P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _I, _I, _F]
        self._silu_mul = lib.jf_silu_mul
        self._silu_mul.argtypes = [_P, _P, _I, _I]
        self._pack = lib.jf_pack_panels
        self._pack.argtypes = [_P, _P, _I, _I]
        self._skinny = lib.jf_skinny_mm
        self._skinny.argtypes = [_P, _P, _P, _P, _I, _I, _I]
        for f in (self._add_rmsnorm, self._add, self._rope, self._attn, self._silu_mul, self._pack, self._skinny):
            f.restype = None
        lib.jf_skinny_fused.restype = ctypes.c_int
        #: True where :meth:`skinny_mm` fuses each multiply-add (the CPU has FMA: one rounding per k), False where a
        #: product and a sum round apart.
        self.fused = bool(lib.jf_skinny_fused())

    def add_rmsnorm(self, x: torch.Tensor, r: torch.Tensor | None, w: torch.Tensor, out: torch.Tensor,
                    eps: float) -> None:
        """``x += r`` (in place; skipped when ``r`` is None), then ``out = x / sqrt(mean(x^2) + eps) * w``.

        Shapes: ``x``, ``r``, ``out`` ``[..., d]``; ``w`` ``[d]``."""
        d = x.shape[-1]
        self._add_rmsnorm(x.data_ptr(), None if r is None else r.data_ptr(), w.data_ptr(), out.data_ptr(),
                          x.numel() // d, d, eps)

    def add(self, x: torch.Tensor, r: torch.Tensor) -> None:
        """``x += r`` in place (same shapes)."""
        d = x.shape[-1]
        self._add(x.data_ptr(), r.data_ptr(), x.numel() // d, d)

    def rope_split_qkv(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q: torch.Tensor,
                       k: torch.Tensor, v: torch.Tensor, ng: int, qpg: int, hd: int) -> None:
        """Split ``qkv`` ``[b, s, ng * (qpg + 2) * hd]`` (per query group: ``qpg`` query heads, its key, its value)
        into ``q`` ``[b, ng * qpg, s, hd]``, ``k`` and ``v`` ``[b, ng, s, hd]``, with megatron's (non-interleaved)
        RoPE on q and k: ``x * cos + rotate_half(x) * sin``, ``cos``/``sin`` ``[b, s, hd]``."""
        b, s = qkv.shape[0], qkv.shape[1]
        self._rope(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(),
                   b, s, ng, qpg, hd, ng * s * hd, s * hd)

    def rope_split_qkv_to_cache(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q: torch.Tensor,
                                kc: torch.Tensor, vc: torch.Tensor, start: int, ng: int, qpg: int, hd: int) -> None:
        """:meth:`rope_split_qkv` with the keys and values written straight into one layer's KV cache rows:
        ``kc``, ``vc`` ``[b, ng, max_len, hd]`` (each row contiguous, as ``KVCache.k[layer]``), token ``t`` at slot
        ``start + t``."""
        b, s = qkv.shape[0], qkv.shape[1]
        off = start * hd * kc.element_size()  # bytes to slot `start`
        self._rope(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), q.data_ptr(), kc.data_ptr() + off,
                   vc.data_ptr() + off, b, s, ng, qpg, hd, kc.stride(0), kc.stride(1))

    def decode_attn(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, out: torch.Tensor,
                    scratch: torch.Tensor, start: int, qpg: int, scale: float) -> None:
        """Attention of ``q`` ``[b, nh, s, hd]`` (``nh = ng * qpg``) over one layer's KV cache rows ``kc``, ``vc``
        ``[b, ng, max_len, hd]`` (each row contiguous; the ``s`` new tokens' keys and values already at slots
        ``start..start+s-1``), token ``t`` attending slots ``0..start+t``, into ``out`` ``[b, s, nh * hd]``:
        ``softmax(q k^T * scale) v`` per head, query head ``h`` on key/value head ``h // qpg``. ``scratch``: at
        least :meth:`attn_scratch` floats. ``hd`` a multiple of 16, at most 256 (:data:`ATTN_MAX_HD`). Each token's
        result is the same whatever ``s`` (one loop, one summation order); a KV head's keys and values are read once
        per 64-key chunk for all its queries."""
        b, nh, s, hd = q.shape
        ng = nh // qpg
        self._attn(q.data_ptr(), kc.data_ptr(), vc.data_ptr(), out.data_ptr(), scratch.data_ptr(), b, s, ng, qpg, hd,
                   start, kc.stride(0), kc.stride(1), scale)

    @staticmethod
    def attn_scratch(s: int, qpg: int, hd: int, start: int) -> int:
        """Floats of scratch :meth:`decode_attn` needs for ``s`` tokens after ``start`` cached ones, ``qpg`` query
        heads per KV head of ``hd`` channels: each of a KV head's ``qpg * s`` queries keeps its scores and four
        partial sums of the values."""
        return qpg * s * (start + s + 4 * hd + 1)

    def silu_mul(self, gu: torch.Tensor, out: torch.Tensor) -> None:
        """``out = silu(gu[..., :ff]) * gu[..., ff:]`` with ``gu`` ``[..., 2 * ff]``, ``out`` ``[..., ff]``."""
        ff = out.shape[-1]
        self._silu_mul(gu.data_ptr(), out.data_ptr(), out.numel() // ff, ff)


    def pack_panels(self, w: torch.Tensor) -> torch.Tensor:
        """The copy of ``w`` ``[N, K]`` (contiguous fp32) that :meth:`skinny_mm` reads: ``[N // 32, K, 32]``, the
        columns of ``W^T`` 32 at a time, each panel contiguous (the last ``N % 32`` columns are read from ``w``)."""
        n, k = w.shape
        panels = torch.empty(n // PANEL, k, PANEL)
        self._pack(w.data_ptr(), panels.data_ptr(), n, k)
        return panels

    def skinny_mm(self, x: torch.Tensor, panels: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``x @ w.T`` ``[..., N]`` for ``x`` ``[..., K]`` (contiguous fp32) through ``panels`` (:meth:`pack_panels`
        of ``w``). Each output element is the sequential fp32 sum over ``k`` of ``x[r, k] * w[n, k]`` (one fused
        multiply-add per ``k`` where :attr:`fused`), so a row's bits do not depend on the rows beside it; fast for a
        few rows (the weight is read once per 16 rows, from several panels at a time)."""
        n, k = w.shape
        y = x.new_empty(*x.shape[:-1], n)
        self._skinny(x.data_ptr(), panels.data_ptr(), w.data_ptr(), y.data_ptr(), x.numel() // k, n, k)
        return y


#: output columns per panel of :meth:`Glue.pack_panels` (``PANEL`` in ``csrc/glue.c``)
PANEL = 32
#: the widest head :meth:`Glue.decode_attn` takes (``ATTN_MAX_HD`` in ``csrc/glue.c``; a multiple of 16 up to it)
ATTN_MAX_HD = 256

_LOADED: dict[str, Glue | None] = {}


def _compiler() -> str | None:
    cc = os.environ.get("CC") or "cc"
    return shutil.which(cc)


def _build_key(cc: str) -> str:
    h = hashlib.sha256()
    with open(SOURCE, "rb") as f:
        h.update(f.read())
    h.update(" ".join(FLAGS).encode())
    try:
        h.update(subprocess.run([cc, "--version"], capture_output=True, timeout=30).stdout)
    except (OSError, subprocess.SubprocessError):
        pass
    h.update(platform.machine().encode())
    try:  # -march=native: the library is this CPU's (model name and flags)
        with open("/proc/cpuinfo", "rb") as f:
            seen = set()
            for line in f:
                if (line.startswith(b"model name") or line.startswith(b"flags")) and line not in seen:
                    seen.add(line)
                    h.update(line)
    except OSError:
        pass
    return h.hexdigest()[:20]


def _build(cc: str, out_dir: str) -> str:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"glue-{_build_key(cc)}.so")
    if os.path.exists(path):
        return path
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        done = subprocess.run([cc, *FLAGS, "-o", tmp, SOURCE, "-lm"], capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{cc} failed: {done.stderr.strip()[-500:]}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def _check(glue: Glue) -> None:
    """Compare each function with the torch ops it replaces on a small case (raises RuntimeError on a mismatch)."""
    g = torch.Generator().manual_seed(0)
    b, s, ng, qpg, hd, hid, ff = 2, 3, 2, 2, 8, 24, 20
    x = torch.randn(b, s, hid, generator=g)
    r = torch.randn(b, s, hid, generator=g)
    w = torch.randn(hid, generator=g)
    ref = F.rms_norm(x + r, (hid,), w, 1e-5)
    x2, out = x.clone(), torch.empty_like(x)
    glue.add_rmsnorm(x2, r, w, out, 1e-5)
    qkv = torch.randn(b, s, ng * (qpg + 2) * hd, generator=g)
    ang = torch.randn(b, s, hd, generator=g)
    cos, sin = ang.cos(), ang.sin()
    q, k, v = torch.empty(b, ng * qpg, s, hd), torch.empty(b, ng, s, hd), torch.empty(b, ng, s, hd)
    glue.rope_split_qkv(qkv, cos, sin, q, k, v, ng, qpg, hd)
    parts = qkv.view(b, s, ng, (qpg + 2) * hd)
    rq, rk, rv = torch.split(parts, [qpg * hd, hd, hd], dim=3)
    c4, s4 = cos.unsqueeze(1), sin.unsqueeze(1)

    def rot(t):
        t1, t2 = torch.chunk(t, 2, dim=-1)
        return t * c4 + torch.cat((-t2, t1), dim=-1) * s4

    rq = rot(rq.reshape(b, s, ng * qpg, hd).transpose(1, 2))
    rk = rot(rk.transpose(1, 2))
    gu = torch.randn(b, s, 2 * ff, generator=g) * 8
    act = torch.empty(b, s, ff)
    glue.silu_mul(gu, act)
    gate, up = torch.chunk(gu, 2, dim=-1)
    w3 = torch.randn(5 * PANEL + 5, hid, generator=g)
    prod = glue.skinny_mm(x, glue.pack_panels(w3), w3)
    # decode attention: 3 new tokens after 19 committed ones in a cache of 24 slots, against SDPA with the causal tail
    start, slots, dh = 19, 24, 32
    kc, vc = torch.randn(b, ng, slots, dh, generator=g), torch.randn(b, ng, slots, dh, generator=g)
    qd = torch.randn(b, ng * qpg, s, dh, generator=g)
    att = torch.empty(b, s, ng * qpg * dh)
    glue.decode_attn(qd, kc, vc, att, torch.empty(glue.attn_scratch(s, qpg, dh, start)), start, qpg, 0.25)
    allow = torch.ones(s, start + s, dtype=torch.bool).tril_(start)
    ref_att = F.scaled_dot_product_attention(qd, kc[:, :, :start + s], vc[:, :, :start + s], attn_mask=allow,
                                             scale=0.25, enable_gqa=True).transpose(1, 2).reshape(b, s, -1)
    checks = {"skinny_mm": (prod, x @ w3.T), "add": (x2, x + r), "rmsnorm": (out, ref), "rope q": (q, rq),
              "rope k": (k, rk), "v": (v, rv.transpose(1, 2)), "silu_mul": (act, F.silu(gate) * up),
              "decode_attn": (att, ref_att)}
    for name, (got, want) in checks.items():
        if not torch.allclose(got, want, rtol=1e-5, atol=1e-5):
            raise RuntimeError(f"glue {name} differs from torch by {(got - want).abs().max().item():.3g}")


def load() -> Glue | None:
    """The compiled glue for this machine, built on first use (see module docstring); None where it is off
    (``MEGATRON_JF_CPU_GLUE=0``) or cannot be built or fails its check (logged once).

    Raises:
        ValueError: a bad value of ``MEGATRON_JF_CPU_GLUE``. A failed build or check raises nothing: it is logged
        and gives None."""
    if not env.cpu_glue():
        return None
    cc = _compiler()
    key = cc or ""
    if key in _LOADED:
        return _LOADED[key]
    glue = None
    if cc is None:
        logger.info("no C compiler (CC / cc): the lean forward runs its CPU glue as torch ops")
    else:
        root = env.cost_cache_dir()
        try:
            out_dir = os.path.join(root, "glue") if root else tempfile.mkdtemp(prefix="megatron_jf_glue_")
            path = _build(cc, out_dir)
            glue = Glue(ctypes.CDLL(path), path)
            _check(glue)
        except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as e:
            logger.warning("the lean forward's C glue is off (%s); it runs torch ops instead", e)
            glue = None
    _LOADED[key] = glue
    return glue
