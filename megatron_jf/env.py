"""The library's runtime environment variables: the one module that reads them.

Every variable is named ``MEGATRON_JF_*`` and has one entry in :data:`VARIABLES` (name, kind, default, allowed
values, meaning); README's table of variables is :func:`markdown_table`. One parse rule per kind:

* ``switch``: ``1``/``true``/``on``/``yes`` is on, ``0``/``false``/``off``/``no`` is off (any case); a few switches
  take one more word (``MEGATRON_JF_STATIC_DECODE=force``).
* ``choice``: one of the listed words (any case).
* ``path``: the text as given; ``path`` variables marked ``off`` also take the off words (then: none).

Unset or empty (blank) is the default. Any other value raises ``ValueError`` naming the variable and what it takes.
A variable renamed to the ``MEGATRON_JF_`` prefix is still read under its old name (``JF_SANDBOX_PYTHON``, ...),
with one warning per process; the new name wins when both are set.

Values are read at each call (nothing is cached), so a change applies to the next reader. Every accessor takes an
optional ``environ`` mapping in place of ``os.environ`` (tests). Importing this module imports nothing heavy.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import typing

__all__ = ["Var", "VARIABLES", "ON", "OFF", "get", "parse", "markdown_table",
           "lean_forward", "static_decode", "cuda_graphs", "lean_gemv", "lean_packed", "mr_verify", "cost_cache_dir",
           "disable_te", "te_arbitrary_mask", "cpu_bf16", "sandbox_python", "vllm_untested_ok", "vllm_python"]

PREFIX = "MEGATRON_JF_"
#: the words of a ``switch`` (lower case)
ON = ("1", "true", "on", "yes")
OFF = ("0", "false", "off", "no")
KINDS = ("switch", "choice", "path")

logger = logging.getLogger("megatron_jf.env")


@dataclasses.dataclass(frozen=True)
class Var:
    """One environment variable.

    Attributes:
        name: the variable (``MEGATRON_JF_...``).
        kind: ``switch`` (a bool), ``choice`` (one of ``choices``) or ``path`` (text).
        default: the value when unset or empty: a bool or None (switch; None: decided elsewhere, e.g. by the
            hardware), a string or None (choice, path).
        meaning: one line for README's table.
        choices: ``choice``: the allowed words; ``switch``: words besides on/off, returned as given (lower case).
        off: ``path``: the off words are allowed and give None.
        values: how README's table spells the values (default: made from the kind).
        shown_default: how README's table spells the default (default: made from ``default``).
        old_names: earlier names, still read (with one warning) when ``name`` is unset.
    """

    name: str
    kind: str
    default: typing.Any
    meaning: str
    choices: tuple[str, ...] = ()
    off: bool = False
    values: str = ""
    shown_default: str = ""
    old_names: tuple[str, ...] = ()

    def __post_init__(self):
        if not self.name.startswith(PREFIX):
            raise ValueError(f"{self.name}: library variables are named {PREFIX}*")
        if self.kind not in KINDS:
            raise ValueError(f"{self.name}: unknown kind {self.kind!r}; choose one of {', '.join(KINDS)}")

    def allowed(self) -> str:
        """The values this variable takes, in words (the error messages')."""
        if self.kind == "switch":
            words = [f"{'/'.join(ON)} (on)", f"{'/'.join(OFF)} (off)", *self.choices]
        elif self.kind == "choice":
            words = list(self.choices)
        else:
            words = ["a path", *([f"{'/'.join(OFF)} (none)"] if self.off else [])]
        return ", ".join(words[:-1]) + " or " + words[-1] if len(words) > 1 else words[0]

    def parse(self, raw: str | None):
        """The value of ``raw`` (the variable's text; None or blank: :attr:`default`).

        Raises:
            ValueError: a value the kind does not take; the message names the variable and its allowed values.
        """
        text = (raw or "").strip()
        if not text:
            return self.default
        low = text.lower()
        if self.kind == "path":
            if self.off and low in OFF:
                return None
            return text
        if self.kind == "switch":
            if low in ON:
                return True
            if low in OFF:
                return False
            if low in self.choices:
                return low
        elif low in self.choices:
            return low
        raise ValueError(f"{self.name} must be {self.allowed()}, got {raw!r}")


def _variables(*vs: Var) -> dict[str, Var]:
    return {v.name: v for v in vs}


#: Every runtime variable of the library, in README's order.
VARIABLES: dict[str, Var] = _variables(
    Var("MEGATRON_JF_LEAN_FORWARD", "switch", True,
        "off: megatron-core's own forward instead of the lean inference forward, and inference tools build the "
        "`auto` layer spec instead of `local`", values="`0`"),
    Var("MEGATRON_JF_STATIC_DECODE", "switch", True,
        "static-shape cached decode forwards: on with CUDA; `0` off; `force` on any device (eager on CPU)",
        choices=("force",), values="`0`, `force`", shown_default="on with CUDA"),
    Var("MEGATRON_JF_CUDA_GRAPHS", "switch", True,
        "off: run the static decode path eagerly instead of replaying CUDA graphs", values="`0`",
        shown_default="on with CUDA"),
    Var("MEGATRON_JF_LEAN_GEMV", "choice", None,
        "which weights get CPU copies, transposed for one-row products and oneDNN-packed for multi-row ones",
        choices=("all", "out", "none"), shown_default="`all` up to 4 GiB of weights, else `out`"),
    Var("MEGATRON_JF_LEAN_PACKED", "switch", True,
        "off: multi-row products on CPU through `F.linear` instead of oneDNN on packed weight copies",
        values="`0`", shown_default="on where torch has oneDNN"),
    Var("MEGATRON_JF_CPU_GLUE", "switch", True,
        "off: the lean forward's fp32 CPU glue (norms, RoPE, SwiGLU, a decode step's attention) as torch ops and SDPA "
        "instead of the C library it builds once per machine (`megatron_jf/inference/cpu_glue.py`)", values="`0`",
        shown_default="on where a C compiler builds it"),
    Var("MEGATRON_JF_MR_VERIFY", "choice", "auto",
        "how MR verifies recycled candidates (`megatron_jf/inference/mr_verify.py`)",
        choices=("auto", "tree", "pruned"), shown_default="pruned on CPU, tree on CUDA"),
    Var("MEGATRON_JF_COST_CACHE", "path", None,
        "where the measured forward cost (`--draft-width auto`) is kept; `0`: measure at every start, keep nothing",
        off=True, values="DIR, `0`", shown_default="`$XDG_CACHE_HOME/megatron_jf`, else `~/.cache/megatron_jf`"),
    Var("MEGATRON_JF_DISABLE_TE", "switch", False,
        "behave as if Transformer Engine were absent (`megatron_jf/platform.py` `TESwitches`)", values="`1`"),
    Var("MEGATRON_JF_TE_ARBITRARY_MASK", "switch", False,
        "masked attention through TE's arbitrary-mask (unfused) attention instead of SDPA", values="`1`"),
    Var("MEGATRON_JF_CPU_BF16", "switch", None,
        "`1`: allow bf16 on a CPU without native bf16; `0`: treat the CPU as without it",
        values="`1`, `0`", shown_default="native bf16 in `/proc/cpuinfo`"),
    Var("MEGATRON_JF_VLLM_UNTESTED_OK", "switch", False,
        "load the vLLM plugin on a vLLM version other than the tested ones (without it the plugin stays out with "
        "one warning and vLLM works as without it)", values="`1`", old_names=("JF_VLLM_UNTESTED_OK",)),
    Var("MEGATRON_JF_VLLM_PYTHON", "path", None,
        "the vLLM interpreter the quickstart collects with", values="PATH",
        shown_default="`.venv-vllm/bin/python` when present", old_names=("JF_VLLM_PYTHON",)),
    Var("MEGATRON_JF_SANDBOX_PYTHON", "path", None,
        "the interpreter generated code runs with in the evaluator's sandbox", values="PATH",
        shown_default="the evaluator's own if the sandbox user can read it, else `/usr/bin/python3`",
        old_names=("JF_SANDBOX_PYTHON",)),
)

_warned: set[str] = set()


def _raw(var: Var, environ: typing.Mapping[str, str] | None) -> str | None:
    env = os.environ if environ is None else environ
    raw = env.get(var.name)
    if raw is not None and raw.strip():
        return raw
    for old in var.old_names:
        raw = env.get(old)
        if raw is not None and raw.strip():
            if old not in _warned:
                _warned.add(old)
                logger.warning("%s is deprecated: set %s instead (the old name is still read)", old, var.name)
            return raw
    return None


def parse(name: str, raw: str | None):
    """``raw`` parsed by the rule of the variable ``name`` (:meth:`Var.parse`).

    Raises:
        KeyError: ``name`` is not in :data:`VARIABLES`; ValueError: a bad value.
    """
    return VARIABLES[name].parse(raw)


def get(name: str, environ: typing.Mapping[str, str] | None = None):
    """The value of the variable ``name`` (its old names when it is unset), parsed; its default when unset.

    Raises:
        KeyError: ``name`` is not in :data:`VARIABLES`; ValueError: a bad value.
    """
    var = VARIABLES[name]
    return var.parse(_raw(var, environ))


# ------------------------------------------------------------------------------------------------ accessors
def lean_forward(environ=None) -> bool:
    """``MEGATRON_JF_LEAN_FORWARD``: the lean inference forward where the model supports it (default on)."""
    return get("MEGATRON_JF_LEAN_FORWARD", environ)


def static_decode(environ=None) -> bool | str:
    """``MEGATRON_JF_STATIC_DECODE``: True (default; the static path with CUDA), False, or ``"force"`` (any
    device)."""
    return get("MEGATRON_JF_STATIC_DECODE", environ)


def cuda_graphs(environ=None) -> bool:
    """``MEGATRON_JF_CUDA_GRAPHS``: CUDA graphs on the static path where CUDA is present (default on)."""
    return get("MEGATRON_JF_CUDA_GRAPHS", environ)


def lean_gemv(environ=None) -> str | None:
    """``MEGATRON_JF_LEAN_GEMV``: ``all``, ``out``, ``none``, or None (unset: chosen by model size)."""
    return get("MEGATRON_JF_LEAN_GEMV", environ)


def lean_packed(environ=None) -> bool:
    """``MEGATRON_JF_LEAN_PACKED``: oneDNN-packed weight copies for multi-row CPU products (default on)."""
    return get("MEGATRON_JF_LEAN_PACKED", environ)


def cpu_glue(environ=None) -> bool:
    """``MEGATRON_JF_CPU_GLUE``: the lean forward's C glue on CPU (default on)."""
    return get("MEGATRON_JF_CPU_GLUE", environ)


def mr_verify(environ=None) -> str:
    """``MEGATRON_JF_MR_VERIFY``: ``auto`` (default; chosen by device), ``tree`` or ``pruned``."""
    return get("MEGATRON_JF_MR_VERIFY", environ)


def cost_cache_dir(environ=None) -> str | None:
    """``MEGATRON_JF_COST_CACHE``: the directory measured forward costs are kept in (default
    ``$XDG_CACHE_HOME/megatron_jf``, else ``~/.cache/megatron_jf``); None when it is off (``0``: keep nothing)."""
    env = os.environ if environ is None else environ
    var = VARIABLES["MEGATRON_JF_COST_CACHE"]
    raw = _raw(var, env)
    if raw is None:
        root = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return os.path.join(root, "megatron_jf")
    return var.parse(raw)


def disable_te(environ=None) -> bool:
    """``MEGATRON_JF_DISABLE_TE``: behave as if Transformer Engine were absent (default off)."""
    return get("MEGATRON_JF_DISABLE_TE", environ)


def te_arbitrary_mask(environ=None) -> bool:
    """``MEGATRON_JF_TE_ARBITRARY_MASK``: masked attention through TE's arbitrary-mask attention (default off)."""
    return get("MEGATRON_JF_TE_ARBITRARY_MASK", environ)


def cpu_bf16(environ=None) -> bool | None:
    """``MEGATRON_JF_CPU_BF16``: True (allow bf16 on any CPU), False (treat the CPU as without native bf16), or None
    (unset: the CPU's flags decide)."""
    return get("MEGATRON_JF_CPU_BF16", environ)


def sandbox_python(environ=None) -> str | None:
    """``MEGATRON_JF_SANDBOX_PYTHON`` (formerly ``JF_SANDBOX_PYTHON``): the sandbox's interpreter as given, or
    None (unset)."""
    return get("MEGATRON_JF_SANDBOX_PYTHON", environ)


def vllm_untested_ok(environ=None) -> bool:
    """``MEGATRON_JF_VLLM_UNTESTED_OK`` (formerly ``JF_VLLM_UNTESTED_OK``): load the vLLM plugin on an untested vLLM
    (default off)."""
    return get("MEGATRON_JF_VLLM_UNTESTED_OK", environ)


def vllm_python(environ=None) -> str | None:
    """``MEGATRON_JF_VLLM_PYTHON`` (formerly ``JF_VLLM_PYTHON``): the interpreter of a vLLM environment as given, or
    None (unset)."""
    return get("MEGATRON_JF_VLLM_PYTHON", environ)


# ------------------------------------------------------------------------------------------------ documentation
def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _shown_default(var: Var) -> str:
    if var.shown_default:
        return var.shown_default
    if var.kind == "switch" and isinstance(var.default, bool):
        return "on" if var.default else "off"
    return "unset" if var.default is None else f"`{var.default}`"


def _shown_values(var: Var) -> str:
    if var.values:
        return var.values
    if var.kind == "choice":
        return ", ".join(f"`{c}`" for c in var.choices)
    if var.kind == "switch":
        return ", ".join(["`1`", "`0`", *(f"`{c}`" for c in var.choices)])
    return "PATH"


def markdown_table() -> str:
    """README's table of variables (``| variable | values | default | meaning |``), one row per :data:`VARIABLES`
    entry, newline-terminated."""
    rows = ["| variable | values | default | meaning |", "|---|---|---|---|"]
    for v in VARIABLES.values():
        meaning = v.meaning + "".join(f" (formerly `{o}`, still read)" for o in v.old_names)
        rows.append(f"| `{v.name}` | {_cell(_shown_values(v))} | {_cell(_shown_default(v))} | {_cell(meaning)} |")
    return "\n".join(rows) + "\n"
