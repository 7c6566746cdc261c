"""The RMSNorm of the local layer spec: ``torch.nn.RMSNorm`` built from megatron's norm-builder arguments.

megatron-core chooses norms by what is installed, not by the layer spec it is given: a ``TransformerBlock`` built
from a layer ``ModuleSpec`` gets ``TENorm`` as its final norm whenever Transformer Engine imports, apex's
``FusedLayerNorm`` (LayerNorm only: an RMSNorm model fails to build) with apex but no TE, and ``WrappedTorchNorm``
otherwise -- which asserts ``not config.sequence_parallel``. So on an NGC box the "local" model had a TE final norm
(the lean inference forward, which reads ``torch.nn.RMSNorm``, refused it), and ``--sequence-parallel`` with the
local spec failed to build on CUDA. :func:`megatron_jf.models.gpt.build_model` gives every norm of the local spec
(each layer's two and the final one) this class instead, whatever is installed.

Under sequence parallelism each TP rank normalises ``S / tp`` positions; the norm is per token, so the forward is
unchanged and only the weight gradient needs summing over the TP group. The weight is marked
``sequence_parallel = True`` exactly as apex's ``FusedLayerNorm`` and TE's norms mark theirs, which megatron's
``finalize_model_grads`` (GPU path) and :func:`megatron_jf.training.optim.allreduce_sequence_parallel_grads` (CPU
path) read.
"""

from __future__ import annotations

import torch


class RMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm(hidden_size, eps)`` with megatron's norm-builder signature (megatron-core 0.16 through
    0.19 call ``builder(config=..., hidden_size=..., eps=...)``).

    Args:
        config: the model's ``TransformerConfig`` (reads ``sequence_parallel``).
        hidden_size: normalised width ``h``; input ``[..., h]``, any float dtype; output the input's shape and dtype.
        eps: added to the mean square.

    The weight is created in ``config.params_dtype`` (megatron's ``WrappedTorchNorm`` makes it fp32 whatever the model
    dtype, and torch's fused RMSNorm kernel refuses a bf16 input with an fp32 weight).

    Raises:
        ValueError: ``config.normalization`` is not ``RMSNorm``, or a zero-centred gamma is asked for.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_megatron_kwargs):
        if getattr(config, "normalization", "RMSNorm") != "RMSNorm":
            raise ValueError(f"megatron_jf RMSNorm built for normalization={config.normalization!r}")
        if getattr(config, "layernorm_zero_centered_gamma", False):
            raise ValueError("megatron_jf RMSNorm does not implement a zero-centred gamma")
        super().__init__(hidden_size, eps=eps, dtype=getattr(config, "params_dtype", None))
        if getattr(config, "sequence_parallel", False):
            self.weight.sequence_parallel = True
