"""Hardware detection and the small set of shims that let megatron-core 0.16 run on CPU.

megatron-core is written for CUDA. On a machine without a GPU (our CI, laptops) a handful of
call sites allocate on ``cuda`` unconditionally. :func:`apply_cpu_shims` patches exactly those,
and only when CUDA is absent, so the GPU path runs the library unmodified. Each patch says why
it exists. The call sites were found by running megatron-core 0.16.1 on torch 2.13 CPU.

megatron-core versions: 0.16.1 (the last release for Python 3.11) through 0.19.x (Python 3.12) are tested in CI
(README "Tests and CI"). Every shim below applies unchanged to both ends: each patched name
(``torch.cuda.current_device``, ``transformer.utils.get_default_causal_mask``, the ``torch`` global of
``pipeline_parallel.schedules``, ``tensor_parallel.random._get_cuda_rng_state`` / ``_set_cuda_rng_state``) exists with the same meaning in
0.16.1 and 0.19.2. What differs between them and is handled here:

* 0.17+ warns at import that ``absl`` is not installed (``hyper_comm_grid``) and falls back to ``logging``:
  filtered below with the TE/Apex fallback warnings, since that fallback is what we want.
* 0.17+ gives some layer-spec submodules as ``functools.partial(MLP.as_mlp_submodule, ...)`` instead of a
  ``ModuleSpec``; only the TE-spec fixture generator walks specs (``tests/fixtures/make_te_spec_keys.py``).
* 0.19 leaves a layer's absent submodules (``q_layernorm`` / ``k_layernorm`` without QK norm) as ``None`` where
  0.16 built ``IdentityOp``: code that asks whether such a submodule is absent uses :func:`is_absent_submodule`.
* 0.19 logs "GPTModel IS DEPRECATED" (in favour of ``HybridModel``) once per model built; GPTModel is still
  the supported model class there. A release that removes it needs ``megatron_jf/models/gpt.py`` ported.

Switches (all automatic, overridable by environment variables for experiments):

* ``HAVE_CUDA``: ``torch.cuda.is_available()``.
* ``HAVE_TE``: Transformer Engine importable *and* CUDA present, unless ``MEGATRON_JF_DISABLE_TE=1``
  (:class:`TESwitches`). A broken TE install makes ``import megatron.core`` crash, so never install TE on CPU
  machines (on GPU it comes with the NGC container).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import types
import warnings

import torch

from megatron_jf import env

# megatron-core warns at import that it falls back to torch implementations without TE/Apex (and, from 0.17,
# to ``logging`` without absl); on CPU that is the intended configuration, so keep the logs readable.
warnings.filterwarnings("ignore", message=".*(Transformer Engine and Apex|Apex is not installed|"
                        "absl.logging is not installed).*")

HAVE_CUDA: bool = torch.cuda.is_available()
if not HAVE_CUDA:  # a CUDA build of torch on a machine without the driver (py312's wheel) logs this once, when
    # megatron-core imports torch.utils.cpp_extension; nothing here builds an extension, so it says nothing useful
    import logging

    logging.getLogger("torch.utils.cpp_extension").addFilter(
        lambda record: not record.getMessage().startswith("No CUDA runtime is found"))


@dataclasses.dataclass(frozen=True)
class TESwitches:
    """The Transformer Engine code-path switches, with their environment overrides (read by :mod:`megatron_jf.env`).

    Attributes:
        disable: behave as if TE were absent (``MEGATRON_JF_DISABLE_TE=1``): the local layer spec under ``auto``, and
            the packed attention path on per-segment SDPA instead of TE's fused THD attention.
        arbitrary_mask: run the masked attention mode (NC-IC / clean-context masks on the dense path) through TE's
            arbitrary-mask attention instead of torch SDPA (``MEGATRON_JF_TE_ARBITRARY_MASK=1``; TE serves it only with
            its unfused backend, ``[b, h, L, L]`` scores: for comparison). Also
            :class:`~megatron_jf.models.attention.JFCoreAttention`'s ``te_arbitrary_mask`` argument.
    """

    disable: bool = False
    arbitrary_mask: bool = False

    ENV = {"disable": "MEGATRON_JF_DISABLE_TE", "arbitrary_mask": "MEGATRON_JF_TE_ARBITRARY_MASK"}

    @classmethod
    def from_env(cls, environ=None) -> "TESwitches":
        """The switches as the environment (``environ``, default ``os.environ``) sets them (unset: off).

        Raises:
            ValueError: a value that is not a switch word (:mod:`megatron_jf.env`).
        """
        return cls(disable=env.disable_te(environ), arbitrary_mask=env.te_arbitrary_mask(environ))


def _have_te() -> bool:
    if not HAVE_CUDA or TESwitches.from_env().disable:
        return False
    if importlib.util.find_spec("transformer_engine") is None:
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # a broken TE install: behave as if absent
        return False
    return True


HAVE_TE: bool = _have_te()


def is_absent_submodule(module) -> bool:
    """True when a megatron layer submodule does nothing: ``IdentityOp`` (megatron-core 0.16) or ``None`` (0.19
    builds absent submodules such as ``q_layernorm`` without QK norm as ``None``)."""
    if module is None:
        return True
    from megatron.core.transformer.identity_op import IdentityOp

    return isinstance(module, IdentityOp)

_SHIMS_APPLIED = False


def default_device() -> torch.device:
    """The device models and caches live on: the current CUDA device if present, else CPU."""
    if HAVE_CUDA:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def default_dtype() -> torch.dtype:
    """bf16 on GPU (as the paper trains), fp32 on CPU (bf16 CPU matmuls are slower and inexact)."""
    return torch.bfloat16 if HAVE_CUDA else torch.float32


class _CudaToCpuTorch(types.ModuleType):
    """A proxy of the ``torch`` module that maps ``device="cuda"`` to CPU in tensor factories.

    Installed as the ``torch`` global of the few megatron modules that hard-code
    ``device="cuda"`` (pipeline schedules count tokens with ``torch.zeros(..., device="cuda")``).
    """

    _FACTORIES = {"zeros", "ones", "empty", "tensor", "full", "arange"}

    def __init__(self):
        super().__init__("torch")

    def __getattr__(self, name):
        attr = getattr(torch, name)
        if name in self._FACTORIES:
            def factory(*args, **kwargs):
                dev = kwargs.get("device")
                if dev is not None and str(dev).startswith("cuda"):
                    kwargs["device"] = "cpu"
                return attr(*args, **kwargs)
            return factory
        return attr


def apply_cpu_shims() -> None:
    """Patch megatron-core 0.16 for CPU-only runs. A no-op when CUDA is available.

    Patches (each is the smallest change that removes one hard CUDA dependency):

    1. ``torch.cuda.current_device`` returns the CPU device and ``torch.cuda.synchronize`` is a
       no-op. About 175 megatron call sites allocate with ``device=torch.cuda.current_device()``
       (global memory buffer, rotary tables, TP gathers, pipeline p2p buffers).
    2. ``megatron.core.transformer.utils.get_default_causal_mask`` builds on ``cuda``; replaced by
       a CPU version (our own core attention never needs it, but megatron helpers may).
    3. The model-parallel RNG tracker: ``model_parallel_cuda_manual_seed`` reads CUDA RNG state.
       :func:`megatron_jf.parallel.set_seed` uses the inference tracker on CPU, whose ``fork()``
       is a no-op; our models use no dropout (Qwen2.5/Llama have none), so this changes nothing.
    4. ``pipeline_parallel.schedules`` counts tokens with ``torch.zeros(device="cuda")``; its
       ``torch`` global is replaced by a proxy that maps ``cuda`` to CPU in tensor factories.
    5. ``Tensor.cuda()`` returns the tensor unchanged: tied embeddings under pipeline parallelism
       all-reduce ``weight.data.cuda()`` between the first and last stage. Without CUDA every such
       call would fail, so the identity is the only meaningful behaviour.
    6. (none: sequence parallelism with the local spec used to need a patch of megatron's ``WrappedTorchNorm``
       here, CPU only; the local spec now builds :class:`megatron_jf.models.norm.RMSNorm` on every machine.)
    7. Activation recomputation (``--recompute-granularity``): megatron's ``CheckpointFunction`` saves and
       restores the CUDA RNG state around the recomputed forward. Without CUDA there is none: the getter
       returns None and the setter does nothing (the CPU RNG state is still saved and restored).

    Raises:
        Nothing. Safe to call many times.
    """
    global _SHIMS_APPLIED
    if HAVE_CUDA or _SHIMS_APPLIED:
        return
    _SHIMS_APPLIED = True
    torch.cuda.current_device = lambda: torch.device("cpu")  # (1)
    torch.cuda.synchronize = lambda *a, **k: None

    from megatron.core.transformer import utils as tutils  # (2)

    def _cpu_causal_mask(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)

    tutils.get_default_causal_mask = _cpu_causal_mask
    with contextlib.suppress(Exception):
        from megatron.core.fusions import fused_softmax

        fused_softmax.get_default_causal_mask = _cpu_causal_mask

    from megatron.core.pipeline_parallel import schedules  # (4)

    schedules.torch = _CudaToCpuTorch()
    torch.Tensor.cuda = lambda self, *a, **k: self  # (5)

    from megatron.core.tensor_parallel import random as tp_random  # (7)

    tp_random._get_cuda_rng_state = lambda *a, **k: None
    tp_random._set_cuda_rng_state = lambda *a, **k: None
