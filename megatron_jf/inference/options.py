"""How the inference forward runs (never what it generates): :class:`InferenceOptions`, the choices of its fields,
and the functions that resolve a field to its value on a device.

Each field resolves the same way: an explicit value wins; a field left at ``auto`` / None takes its ``MEGATRON_JF_*``
variable (read by :mod:`megatron_jf.env`); without one, the device's default.

=================  ==============================  ===========================================================
field              variable                        default without either
=================  ==============================  ===========================================================
``forward``        ``MEGATRON_JF_LEAN_FORWARD``    the lean forward where the model supports it, else megatron's
``static_decode``  ``MEGATRON_JF_STATIC_DECODE``   on with CUDA (``force``: on any device)
``cuda_graphs``    ``MEGATRON_JF_CUDA_GRAPHS``     on with CUDA
``gemv``           ``MEGATRON_JF_LEAN_GEMV``       ``all`` up to 4 GiB of weights, else ``out``
``lean_packed``    ``MEGATRON_JF_LEAN_PACKED``     on where torch has oneDNN
``mr_verify``      ``MEGATRON_JF_MR_VERIFY``       pruned on CPU, tree on CUDA
=================  ==============================  ===========================================================

Variables are read when a runner is built (one per :meth:`Engine.generate
<megatron_jf.inference.engine.Engine.generate>` call or batch session), so a change applies to the next one.
Torch-free (the command-line flags, :func:`megatron_jf.cli.add_inference_args`, are built from this module).
"""

from __future__ import annotations

import dataclasses

from megatron_jf import env
from megatron_jf.config_fields import cli_field

FORWARDS = ("auto", "lean", "static", "megatron")
GEMV_MODES = ("all", "out", "none")
MR_VERIFY_MODES = ("auto", "tree", "pruned")


@dataclasses.dataclass(frozen=True)
class InferenceOptions:
    """The inference forward's switches (:class:`~megatron_jf.inference.engine.Engine`,
    :class:`~megatron_jf.inference.runner.ModelRunner`, ``LLM.from_checkpoint(options=...)``, the ``--inference-*``
    flags). None of them changes the generated tokens.

    Raises:
        ValueError: a field outside its choices.
    """

    forward: str = cli_field("auto", choices=FORWARDS)
    """The decode forward: lean (this project's, over the model's weights), static (the lean forward with static
    shapes; CUDA graphs on a GPU), megatron (megatron-core's own); auto: the lean forward where the model supports it
    and MEGATRON_JF_LEAN_FORWARD is on (its static path per static_decode), else megatron's."""
    static_decode: bool | None = cli_field(None, tristate=True)
    """Under forward auto, the static path for cached decode forwards (on: on any device, eager on CPU); auto:
    MEGATRON_JF_STATIC_DECODE, else on with CUDA."""
    cuda_graphs: bool | None = cli_field(None, "--cuda-graphs", tristate=True)
    """Replay CUDA graphs on the static path; auto: MEGATRON_JF_CUDA_GRAPHS, else on with CUDA."""
    gemv: str = cli_field("auto", "--lean-gemv", choices=("auto",) + GEMV_MODES)
    """CPU copies of the weights for one-row products: all, out (output layer only) or none; auto:
    MEGATRON_JF_LEAN_GEMV, else all up to 4 GiB of weights, else out. A value set here stays on the model's lean
    forward."""
    lean_packed: bool | None = cli_field(None, tristate=True)
    """Multi-row CPU products through oneDNN on packed weight copies (off: F.linear); auto: MEGATRON_JF_LEAN_PACKED,
    else on where torch has oneDNN. A value set here stays on the model's lean forward."""
    mr_verify: str = cli_field("auto", "--mr-verify", choices=MR_VERIFY_MODES)
    """How MR verifies recycled candidates: tree (one forward with a tree mask) or pruned (the main chain, then only
    the candidates that can still win); auto: MEGATRON_JF_MR_VERIFY, else pruned on CPU, tree on CUDA."""

    def __post_init__(self):
        for name, allowed in (("forward", FORWARDS), ("gemv", ("auto",) + GEMV_MODES),
                              ("mr_verify", MR_VERIFY_MODES)):
            v = getattr(self, name)
            if v not in allowed:
                label = "forward impl" if name == "forward" else f"{name.replace('_', ' ')} mode"
                raise ValueError(f"unknown {label} {v!r}; choose one of {', '.join(allowed)}")
        for name in ("static_decode", "cuda_graphs", "lean_packed"):
            if getattr(self, name) not in (None, True, False):
                raise ValueError(f"{name} must be True, False or None (auto), got {getattr(self, name)!r}")


# ------------------------------------------------------------------------------------------------ resolution
def lean_forward_on() -> bool:
    """``MEGATRON_JF_LEAN_FORWARD`` (default on): whether ``forward="auto"`` may take the lean forward.

    Raises:
        ValueError: a bad value of the variable.
    """
    return env.lean_forward()


def lean_packed_on(explicit: bool | None = None) -> bool:
    """``explicit``, else ``MEGATRON_JF_LEAN_PACKED`` (default on)."""
    return env.lean_packed() if explicit is None else bool(explicit)


def static_decode_on(device, explicit: bool | None = None) -> bool:
    """The static path for cached decode forwards on ``device`` (a ``torch.device``) under ``forward="auto"``:
    ``explicit``, else ``MEGATRON_JF_STATIC_DECODE`` (``force``: on any device; off; default: on with CUDA)."""
    if explicit is not None:
        return bool(explicit)
    v = env.static_decode()
    return v == "force" or (v is True and device.type == "cuda")


def cuda_graphs_on(device, explicit: bool | None = None) -> bool:
    """CUDA-graph capture on the static path: ``explicit``, else on a CUDA ``device`` unless
    ``MEGATRON_JF_CUDA_GRAPHS`` is off."""
    if explicit is not None:
        return bool(explicit)
    return device.type == "cuda" and env.cuda_graphs()


def gemv_mode(mode: str | None = None) -> str:
    """``mode`` (``all``/``out``/``none``), else (``auto``/None) ``MEGATRON_JF_LEAN_GEMV``; ``""`` when neither is
    set (the lean forward picks by model size).

    Raises:
        ValueError: a mode or variable value other than auto, all, out, none.
    """
    m = "auto" if mode is None else str(mode).strip().lower()
    if m == "auto":
        return env.lean_gemv() or ""
    if m not in GEMV_MODES:
        raise ValueError(f"unknown gemv mode {mode!r}; choose one of auto, {', '.join(GEMV_MODES)}")
    return m


def mr_verify_mode(mode: str | None, device) -> str:
    """``tree`` or ``pruned`` for ``mode`` (``auto``/None: ``MEGATRON_JF_MR_VERIFY``, else pruned on CPU and tree
    on CUDA).

    Raises:
        ValueError: an unknown mode (argument or environment).
    """
    m = (mode or "auto").strip().lower()
    if m == "auto":
        m = env.mr_verify()
    elif m not in MR_VERIFY_MODES:
        raise ValueError(f"unknown MR verification mode {m!r} (from the argument); choose one of "
                         f"{', '.join(MR_VERIFY_MODES)}")
    if m == "auto":
        return "tree" if device.type == "cuda" else "pruned"
    return m


def check_forward(forward: str) -> str:
    """``forward`` if it names a forward implementation. Raises ValueError otherwise."""
    if forward not in FORWARDS:
        raise ValueError(f"unknown forward impl {forward!r}; choose one of {', '.join(FORWARDS)}")
    return forward
