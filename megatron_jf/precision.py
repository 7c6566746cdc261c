"""Mixed precision on CPU: bf16 support detection and the bf16 autocast region of training and inference.

What ``bf16`` means where (``pretrain_jf.py --precision bf16`` / ``--bf16``):

* **GPU** (megatron's optimizer): bf16 weights and compute, fp32 main weights and optimizer state in megatron's
  optimizer -- unchanged, not handled here.
* **CPU** (torch AdamW): the weights stay fp32 -- they are the master weights, and AdamW and its state stay fp32
  -- and every forward (and the loss) runs under ``torch.autocast("cpu", dtype=torch.bfloat16)``: matrix products
  (the linear layers and output layer) take bf16 inputs and accumulate in fp32, bf16 results; embeddings, norms,
  residual sums, the losses (they cast logits to fp32) and -- up to :data:`CPU_FP32_ATTENTION_MAX_KEYS` keys -- the
  core attention stay fp32 (:func:`cpu_attention_in_fp32`). Gradients
  reach the fp32 weights as fp32. Same compute precision as the GPU path, without a second copy of the weights.

bf16 only pays on a CPU with native bf16 dot products (x86 AVX-512 BF16 or AMX, Arm ``bf16``); elsewhere
they are emulated and bf16 runs many times *slower* than fp32 (an AVX2-only AMD EPYC, one thread: the JF training
step of a SmolLM2-135M-shaped model at 0.078x the fp32 samples/s, ``bench/train_step.py --compare-precision --shape
smollm2``), so :func:`require_cpu_bf16` refuses it with a one-line error. ``MEGATRON_JF_CPU_BF16=1`` runs it anyway (tests, measurements); ``=0`` behaves as a
CPU without support.

megatron-core's linear layers run their matrix product inside ``torch.autograd.Function`` s whose backward
multiplies the output gradient by the saved weight; under CPU autocast the forward's product is bf16 while the
saved weight is the fp32 parameter, and that backward fails (``expected m1 and m2 to have the same dtype``).
:func:`autocast` therefore wraps those Functions' forwards (once, process-wide, a no-op outside a CPU autocast
region): inside the region the input, weight and bias are cast to the autocast dtype before the product, so the
backward sees bf16 tensors throughout; the weight gradient (bf16) is cast back to the fp32 parameter's dtype by
autograd, as for any autocast product.
"""

from __future__ import annotations

import contextlib
import warnings

import torch

from megatron_jf import env

__all__ = ["CPU_BF16_ENV", "CPU_FP32_ATTENTION_MAX_KEYS", "cpu_bf16_feature", "cpu_bf16_supported", "require_cpu_bf16",
           "residual_stream_dtype", "cpu_autocast_dtype", "cpu_attention_in_fp32", "CompiledOnCPU", "autocast"]

#: ``1``: allow bf16 on a CPU without native bf16 (tests, measurements); ``0``: treat the CPU as without it.
CPU_BF16_ENV = "MEGATRON_JF_CPU_BF16"
#: ``/proc/cpuinfo`` flags of native bf16 dot products: x86 AMX and AVX-512 BF16, Arm (``Features``) BF16.
_BF16_FLAGS = ("amx_bf16", "avx512_bf16", "bf16")


def _cpuinfo_flags(path: str = "/proc/cpuinfo") -> set[str] | None:
    """The first CPU's feature flags (x86 ``flags``, Arm ``Features``); None where the file is unreadable."""
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return set(value.split())
    except OSError:
        return None
    return set()


def cpu_bf16_feature(cpuinfo: str = "/proc/cpuinfo") -> str | None:
    """The CPU feature that gives native bf16 dot products (``amx_bf16``, ``avx512_bf16`` or Arm ``bf16``), or
    None. Read from ``cpuinfo``; without it (not Linux), from torch's own CPU probe (AVX-512 BF16 only)."""
    flags = _cpuinfo_flags(cpuinfo)
    if flags is None:
        probe = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
        return "avx512_bf16" if probe is not None and probe() else None
    return next((f for f in _BF16_FLAGS if f in flags), None)


def cpu_bf16_supported() -> bool:
    """True when bf16 compute is allowed on this CPU: native support (:func:`cpu_bf16_feature`), or
    ``MEGATRON_JF_CPU_BF16=1``; ``MEGATRON_JF_CPU_BF16=0`` makes it False.

    Raises:
        ValueError: a value of the variable that is not a switch word (:mod:`megatron_jf.env`).
    """
    forced = env.cpu_bf16()
    if forced is not None:
        return forced
    return cpu_bf16_feature() is not None


def require_cpu_bf16(option: str = "--precision bf16") -> None:
    """Refuse bf16 compute on a CPU without native bf16 (see the module docstring).

    Raises:
        ValueError: one line naming ``option``, what is missing, and the way out.
    """
    if not cpu_bf16_supported():
        raise ValueError(f"{option} on CPU needs native bf16 dot products (AVX-512 BF16 or AMX; /proc/cpuinfo "
                         "flags avx512_bf16 / amx_bf16), which this CPU lacks, so bf16 would run several times "
                         f"slower than fp32: use fp32, or set {CPU_BF16_ENV}=1 to run bf16 anyway")


def residual_stream_dtype(compute_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the residual stream (what one pipeline stage sends the next) of an fp32 model run under CPU
    autocast to ``compute_dtype``: megatron-core's bias-dropout-add adds a layer's ``compute_dtype`` output to the
    fp32 residual, and up to 0.16 casts the residual down (``compute_dtype`` leaves the layer) while later versions
    (0.19) cast the output up (fp32 leaves it). megatron's ``pipeline_dtype`` must match it, or the receiving
    stage's buffer is the wrong size (gloo: ``Received data size doesn't match expected size``). Measured by
    calling that function on one element, so it follows whatever the installed version does."""
    from megatron.core.fusions.fused_bias_dropout import _bias_dropout_add_func

    x = torch.zeros(1, dtype=compute_dtype)
    return _bias_dropout_add_func((x, None), torch.zeros(1, dtype=torch.float32), 0.0, True).dtype


_LINEARS_WRAPPED = False


def _autocast_linear_forward(forward):
    """``forward(ctx, input, weight, bias, *rest)`` of a megatron linear Function, casting its tensors to the CPU
    autocast dtype inside a CPU autocast region (and running with autocast off, as ``torch.amp.custom_fwd`` with
    ``cast_inputs`` does), unchanged elsewhere."""

    def wrapped(ctx, input, weight, bias, *rest):
        if input.device.type != "cpu" or not torch.is_autocast_enabled("cpu"):
            return forward(ctx, input, weight, bias, *rest)
        dt = torch.get_autocast_dtype("cpu")
        with torch.autocast("cpu", enabled=False):
            return forward(ctx, input.to(dt), weight.to(dt), None if bias is None else bias.to(dt), *rest)

    return wrapped


def _wrap_megatron_linears() -> None:
    """Make megatron-core's linear Functions CPU-autocast aware (see the module docstring); idempotent."""
    global _LINEARS_WRAPPED
    if _LINEARS_WRAPPED:
        return
    from megatron.core.tensor_parallel import layers

    for cls in (layers.LinearWithGradAccumulationAndAsyncCommunication, layers.LinearWithFrozenWeight):
        cls.forward = staticmethod(_autocast_linear_forward(cls.forward))
    # the residual stream is bf16 in the region (megatron casts it to the dtype of the layer outputs) while the norm
    # weights stay fp32: torch's RMSNorm then takes its unfused path and says so once; that is the intended mix
    warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight")
    _LINEARS_WRAPPED = True


#: Under CPU bf16 autocast the core attention (softmax(QK^T)V, forward and backward) runs in fp32 on its bf16 inputs
#: up to this many keys. torch's CPU flash-attention backward is slower in bf16 than in fp32 at short rows: on an
#: Intel Xeon with AMX (torch 2.13, 2 threads, causal, 8 query / 2 KV heads of 32) forward + backward of
#: [16 rows x 256 tokens] took 35.0 ms in bf16 against 23.8 ms cast to fp32, 376 tokens 76.7 vs 61.8, 128 tokens 23.9 vs
#: 6.7, but 1,024 tokens 47.6 vs 54.5: fp32 pays up to ~600 keys there. The default quickstart's training steps
#: (2 threads): base +12 % tokens/s, JF round +9 %.
CPU_FP32_ATTENTION_MAX_KEYS = 512


def cpu_autocast_dtype() -> torch.dtype | None:
    """The lower-precision dtype of the CPU autocast region this runs in (bf16 / fp16), or None outside one (or in
    an fp32 one). Raises nothing."""
    try:
        on = torch.is_autocast_enabled("cpu")
        dtype = torch.get_autocast_dtype("cpu")
    except TypeError:  # torch < 2.4
        on, dtype = torch.is_autocast_cpu_enabled(), torch.get_autocast_cpu_dtype()
    return dtype if on and dtype != torch.float32 else None


def cpu_attention_in_fp32(query: torch.Tensor, num_keys: int) -> bool:
    """True when the core attention over ``num_keys`` keys should run in fp32: ``query`` is on the CPU inside a
    bf16 / fp16 CPU autocast region and ``num_keys <= CPU_FP32_ATTENTION_MAX_KEYS`` (see there). Raises nothing."""
    if query.is_cuda or num_keys > CPU_FP32_ATTENTION_MAX_KEYS:
        return False
    return cpu_autocast_dtype() is not None


class CompiledOnCPU:
    """``fn`` compiled by torch's inductor on first call (dynamic shapes: new lengths do not recompile), for the
    elementwise chains of the CPU mixed-precision step that torch runs as one pass per operation (RMSNorm).

    Calling it returns ``fn``'s result, or None where compiling failed (e.g. no C++ compiler): then one warning, and
    every later call returns None at once, so the caller keeps its uncompiled path. Compiling takes seconds, once
    per process (inductor's cache on disk shortens later ones). Raises nothing of its own: an error inside ``fn``
    also ends in None and the warning, and the caller's uncompiled path then meets it again.
    """

    def __init__(self, fn, name: str):
        self.fn, self.name = fn, name
        self.compiled = None  # None: not built yet; False: compiling failed

    def __call__(self, *args):
        if self.compiled is False:
            return None
        if self.compiled is None:
            self.compiled = torch.compile(self.fn, dynamic=True)
        try:
            return self.compiled(*args)
        except Exception as err:  # inductor could not build its kernel
            self.compiled = False
            first = str(err).splitlines()[0] if str(err) else ""
            warnings.warn(f"{self.name}: torch.compile failed on this CPU ({type(err).__name__}: {first}); "
                          "the uncompiled path is used")
            return None


@contextlib.contextmanager
def autocast(dtype: torch.dtype | None):
    """The CPU mixed-precision region: ``torch.autocast("cpu", dtype=dtype)`` with megatron's linear layers made
    autocast aware. ``dtype`` None (fp32 runs, and every GPU run: megatron's bf16 path needs no autocast): a
    no-op. Weights keep their dtype; see the module docstring for which operations run in ``dtype``."""
    if dtype is None:
        yield
        return
    _wrap_megatron_linears()
    with torch.autocast("cpu", dtype=dtype):
        yield
