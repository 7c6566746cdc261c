"""The MLP of the local layer spec: megatron-core's ``MLP``, with its SwiGLU compiled under CPU mixed precision.

megatron-core fuses the gated activation only on its GPU path (``bias_activation_fusion``); elsewhere it runs
``silu(x_glu) * x_linear`` as separate passes over the ``[s, b, 2 * ffn]`` activations, forward and backward -- on
the default quickstart's bf16 CPU step (hidden 256, ffn 688, 16 rows x 256 tokens) the largest elementwise cost
after attention. Inside a CPU autocast region :class:`MLP` runs it as one function compiled by torch's inductor
(:func:`swiglu_fp32`: fp32 throughout, one rounding to the input dtype at the end, as the compiled RMSNorm of
:mod:`megatron_jf.models.norm`); everywhere else -- fp32 runs, bf16 weights without autocast (inference), GPUs,
expert MLPs with per-token scales -- megatron's own forward runs unchanged, bit for bit.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from megatron.core.transformer.mlp import MLP as MegatronMLP

from megatron_jf.precision import CompiledOnCPU, cpu_autocast_dtype

__all__ = ["MLP", "swiglu_fp32", "COMPILED_SWIGLU", "use_in_spec"]


def swiglu_fp32(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU computed in fp32: ``silu(x[..., :f]) * x[..., f:]`` for ``x`` of width ``2 f``, cast back to ``x.dtype``.

    Args:
        x: ``[..., 2 f]``, any float dtype (megatron's ``linear_fc1`` output: the gate half first).

    Returns:
        ``[..., f]`` in ``x.dtype``. Raises nothing of its own.
    """
    gate, linear = torch.chunk(x.float(), 2, dim=-1)
    return (F.silu(gate) * linear).to(x.dtype)


#: :func:`swiglu_fp32` compiled (None from a call where compiling failed)
COMPILED_SWIGLU = CompiledOnCPU(swiglu_fp32, "SwiGLU")


class MLP(MegatronMLP):
    """megatron-core's ``MLP`` (same constructor, parameters and checkpoint keys) whose gated SiLU runs compiled
    in fp32 inside a CPU autocast region (module docstring).

    Input ``hidden_states [s, b, h]``; returns ``(output [s, b, h], output_bias or None)`` as megatron's does.
    Raises what megatron's forward raises.
    """

    def _compiled_swiglu_applies(self, hidden_states: torch.Tensor, per_token_scale) -> bool:
        cfg = self.config
        return (per_token_scale is None and hidden_states.device.type == "cpu" and cpu_autocast_dtype() is not None
                and cfg.gated_linear_unit and cfg.activation_func is F.silu
                and not getattr(cfg, "use_te_activation_func", False)
                and getattr(cfg, "activation_func_clamp_value", None) is None
                and not getattr(cfg, "glu_linear_offset", 0.0))

    def forward(self, hidden_states, per_token_scale=None, **kwargs):
        """See the class docstring."""
        if not self._compiled_swiglu_applies(hidden_states, per_token_scale):
            return super().forward(hidden_states, per_token_scale, **kwargs)
        x, bias = self.linear_fc1(hidden_states)
        if bias is not None:
            x = x + bias
        y = COMPILED_SWIGLU(x)
        if y is None:  # inductor could not compile here: megatron's composite glu, as its forward runs it
            gate, linear = torch.chunk(x, 2, dim=-1)
            y = F.silu(gate) * linear
        return self.linear_fc2(y)


def use_in_spec(layer_spec) -> None:
    """Make ``layer_spec`` (megatron's local transformer-layer spec, changed in place) build :class:`MLP` where it
    would build megatron's. megatron-core 0.16-0.18 give the MLP as a ``ModuleSpec`` (its ``module`` is swapped);
    0.19 as ``functools.partial(MLP.as_mlp_submodule, submodules=...)`` (rebound to this class's classmethod, so
    the layer's TP group still reaches it).

    Raises:
        TypeError: the spec's MLP is neither (a megatron-core release this does not know).
    """
    mlp = layer_spec.submodules.mlp
    if isinstance(mlp, functools.partial):
        builder = getattr(MegatronMLP, "as_mlp_submodule", None)
        if builder is None or getattr(mlp.func, "__func__", None) is not builder.__func__:
            raise TypeError(f"unexpected MLP builder in megatron's local spec: {mlp!r}")
        layer_spec.submodules.mlp = functools.partial(MLP.as_mlp_submodule, *mlp.args, **mlp.keywords)
    elif getattr(mlp, "module", None) is MegatronMLP:
        mlp.module = MLP
    else:
        raise TypeError(f"unexpected MLP in megatron's local spec: {mlp!r}")
