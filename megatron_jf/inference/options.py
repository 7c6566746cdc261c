"""Inference switches: the fields a :class:`~megatron_jf.inference.runner.ModelRunner` is built with, and the
``MEGATRON_JF_*`` environment variables that set a field left at its default -- the one place they are read.

==============================  ===============  ==========================================================
variable                        field            meaning
==============================  ===============  ==========================================================
``MEGATRON_JF_LEAN_FORWARD``    ``forward``      ``0``: megatron-core's own forward instead of the lean forward
                                                 (:mod:`~megatron_jf.inference.lean_forward`; default on where
                                                 the model supports it); inference tools then build the
                                                 ``auto`` layer spec instead of ``local``
``MEGATRON_JF_STATIC_DECODE``   ``forward``      static-shape cached decode forwards
                                                 (:mod:`~megatron_jf.inference.static_decode`): default on with
                                                 CUDA, ``0`` off, ``force`` on any device (eager on CPU; tests)
``MEGATRON_JF_CUDA_GRAPHS``     ``cuda_graphs``  ``0``: run the static path eagerly instead of replaying CUDA
                                                 graphs (default: graphs on CUDA)
``MEGATRON_JF_LEAN_GEMV``       ``gemv``         ``all`` / ``out`` / ``none``: weights with CPU copies, transposed
                                                 for one-row products and oneDNN-packed for multi-row ones
                                                 (default ``all`` up to 4 GiB of weights, else ``out``)
``MEGATRON_JF_LEAN_PACKED``     (the forward)    ``0``: multi-row products through ``F.linear`` instead of the
                                                 oneDNN-packed copies (default on where torch has oneDNN)
``MEGATRON_JF_MR_VERIFY``       ``mr_verify``    ``tree`` / ``pruned``: how MR verifies recycled candidates
                                                 (:mod:`~megatron_jf.inference.mr_verify`; default pruned on
                                                 CPU, tree on CUDA)
``MEGATRON_JF_COST_CACHE``      (the engine)     where measured forward costs are kept
                                                 (:mod:`~megatron_jf.inference.cost_model`; default
                                                 ``$XDG_CACHE_HOME/megatron_jf``, else ``~/.cache/megatron_jf``);
                                                 ``0``: measure at every start, keep nothing
==============================  ===============  ==========================================================

An explicit constructor argument wins over the variable; the variable wins over the device default. Values are
read when a runner is built (one per :meth:`Engine.generate <megatron_jf.inference.engine.Engine.generate>` call
or batch session), so a change applies to the next one.
"""

from __future__ import annotations

import os

LEAN_FORWARD = "MEGATRON_JF_LEAN_FORWARD"
STATIC_DECODE = "MEGATRON_JF_STATIC_DECODE"
CUDA_GRAPHS = "MEGATRON_JF_CUDA_GRAPHS"
LEAN_GEMV = "MEGATRON_JF_LEAN_GEMV"
LEAN_PACKED = "MEGATRON_JF_LEAN_PACKED"
MR_VERIFY = "MEGATRON_JF_MR_VERIFY"
COST_CACHE = "MEGATRON_JF_COST_CACHE"

FORWARDS = ("auto", "lean", "static", "megatron")
GEMV_MODES = ("all", "out", "none")
MR_VERIFY_MODES = ("auto", "tree", "pruned")
_OFF = ("0", "false", "off", "no")


def _env(name: str, default: str = "") -> str:
    return os.environ.get(name, default).strip().lower()


def lean_forward_on() -> bool:
    """False when ``MEGATRON_JF_LEAN_FORWARD`` is ``0``/``false``/``off``/``no`` (default: on)."""
    return _env(LEAN_FORWARD, "1") not in _OFF


def lean_packed_on() -> bool:
    """False when ``MEGATRON_JF_LEAN_PACKED`` is ``0``/``false``/``off``/``no`` (default: on)."""
    return _env(LEAN_PACKED, "1") not in _OFF


def static_decode_on(device) -> bool:
    """The static path for cached decode forwards on ``device`` (a ``torch.device``): on with CUDA unless
    ``MEGATRON_JF_STATIC_DECODE`` is off; ``=force`` turns it on for any device."""
    v = _env(STATIC_DECODE, "1")
    return v == "force" or (device.type == "cuda" and v not in _OFF)


def cuda_graphs_on(device) -> bool:
    """CUDA-graph capture on the static path: on a CUDA ``device`` unless ``MEGATRON_JF_CUDA_GRAPHS`` is off."""
    return device.type == "cuda" and _env(CUDA_GRAPHS, "1") not in _OFF


def gemv_mode(mode: str | None = None) -> str:
    """``mode``, else ``MEGATRON_JF_LEAN_GEMV``; ``""`` when neither is set (the lean forward picks by model size).

    Raises:
        ValueError: a value other than all, out, none.
    """
    m = (mode if mode is not None else _env(LEAN_GEMV)).strip().lower()
    if m and m not in GEMV_MODES:
        raise ValueError(f"{LEAN_GEMV} must be all, out or none, got {m!r}")
    return m


def mr_verify_mode(mode: str | None, device) -> str:
    """``tree`` or ``pruned`` for ``mode`` (``auto``/None: ``MEGATRON_JF_MR_VERIFY``, else pruned on CPU and tree
    on CUDA).

    Raises:
        ValueError: an unknown mode (argument or environment).
    """
    m = (mode or "auto").strip().lower()
    if m == "auto":
        m = _env(MR_VERIFY, "auto") or "auto"
    if m not in MR_VERIFY_MODES:
        src = "the argument" if mode not in (None, "auto") else MR_VERIFY
        raise ValueError(f"unknown MR verification mode {m!r} (from {src}); choose one of {', '.join(MR_VERIFY_MODES)}")
    if m == "auto":
        return "tree" if device.type == "cuda" else "pruned"
    return m


def cost_cache_dir() -> str | None:
    """The directory measured forward costs are cached in (``MEGATRON_JF_COST_CACHE``, else
    ``$XDG_CACHE_HOME/megatron_jf`` or ``~/.cache/megatron_jf``); None when the variable is ``0`` (no cache)."""
    v = os.environ.get(COST_CACHE, "").strip()
    if v.lower() in _OFF:
        return None
    if v:
        return v
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "megatron_jf")


def inference_transformer_impl() -> str:
    """The layer spec inference tools build (:func:`megatron_jf.checkpointing.load_model`): ``local`` while the lean
    inference forward is on (``MEGATRON_JF_LEAN_FORWARD``, default on), since decoding runs that forward -- and on
    CUDA its static-shape / CUDA-graph path -- over the local spec's parameters, also where Transformer Engine is
    installed (checkpoints load across specs); ``auto`` when it is off (megatron's forward, TE where present)."""
    return "local" if lean_forward_on() else "auto"


def check_forward(forward: str) -> str:
    """``forward`` if it names a forward implementation. Raises ValueError otherwise."""
    if forward not in FORWARDS:
        raise ValueError(f"unknown forward impl {forward!r}; choose auto, lean, static or megatron")
    return forward
