"""Optimisation pieces of the training loop: parameter groups, gradient clipping, DP gradient averaging.

The CPU path (torch AdamW) uses these directly; the GPU path uses megatron-core's optimizer, DDP and
``finalize_model_grads``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_jf import platform

__all__ = ["param_groups", "clip_grad_norm_tp", "all_reduce_grads", "allreduce_sequence_parallel_grads"]


def param_groups(module, weight_decay: float) -> list[dict]:
    """torch optimizer parameter groups: ``weight_decay`` on matrices, none on biases and norm weights (1-D)."""
    decay, no_decay = [], []
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.dim() < 2 or name.endswith(".bias") else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def clip_grad_norm_tp(params, max_norm: float) -> float:
    """Global gradient L2 norm over all model-parallel ranks, and clip to ``max_norm`` (0: no clip).

    TP-sharded parameters (``param.tensor_model_parallel``) contribute from every TP rank; replicated
    ones (norm weights) only from TP rank 0; the pipeline-tied output embedding (``param.shared``) is
    skipped (its gradient equals the first stage's). The sum of squares is all-reduced over the
    model-parallel (TP x PP) group, so every rank gets the same norm and the same clip factor
    (``max_norm / (norm + 1e-6)`` when below 1, as megatron-core).

    Returns:
        The norm before clipping (a Python float).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.layers import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared

    params = [p for p in params if p.grad is not None]
    counted = [p.grad for p in params if param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p)]
    dev = params[0].grad.device if params else platform.default_device()
    if counted:
        sq = torch.stack([g.detach().float().pow(2).sum() for g in counted]).sum().double()
    else:
        sq = torch.zeros((), dtype=torch.float64, device=dev)
    if ps.get_tensor_model_parallel_world_size() * ps.get_pipeline_model_parallel_world_size() > 1:
        dist.all_reduce(sq, group=ps.get_model_parallel_group())
    norm = float(sq.sqrt())
    if max_norm > 0:
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            for p in params:
                p.grad.detach().mul_(coef)
    return norm


def all_reduce_grads(params, group, size: int) -> None:
    """Average gradients over a process group in one flat buffer (coalesced all-reduce)."""
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    grads = [p.grad for p in params if p.grad is not None]
    if not grads or size == 1:
        return
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=group)
    flat.div_(size)
    for g, r in zip(grads, _unflatten_dense_tensors(flat, grads)):
        g.copy_(r)


def allreduce_sequence_parallel_grads(module) -> None:
    """Sum over the TP group the gradients of parameters marked ``sequence_parallel`` (the norm weights
    under ``--sequence-parallel``: each TP rank saw only its ``S / tp`` positions), in one flat buffer --
    what megatron-core's ``finalize_model_grads`` does on the GPU path. A no-op without sequence
    parallelism or at TP = 1."""
    from megatron.core import parallel_state as ps
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    if not getattr(module.config, "sequence_parallel", False) or ps.get_tensor_model_parallel_world_size() == 1:
        return
    grads = [p.grad for p in module.parameters() if getattr(p, "sequence_parallel", False) and p.grad is not None]
    if not grads:
        return
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=ps.get_tensor_model_parallel_group())
    for g, r in zip(grads, _unflatten_dense_tensors(flat, grads)):
        g.copy_(r)
