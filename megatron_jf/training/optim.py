"""Optimisation pieces of the training loop: parameter groups, gradient clipping, DP gradient averaging.

The CPU path (torch AdamW) uses these directly; the GPU path uses megatron-core's optimizer, DDP and
``finalize_model_grads``, configured here (:func:`megatron_ddp_config`, :func:`megatron_optimizer_config`).

Both paths group parameters by the one rule :func:`no_weight_decay` (Megatron-LM's default: no weight decay on
biases and 1-D parameters, i.e. the RMSNorm weights): the torch path through :func:`param_groups`, the megatron
path through the same predicate passed to ``get_megatron_optimizer`` as a ``wd_mult = 0`` override
(:func:`megatron_config_overrides`), and :func:`set_lr_and_weight_decay` applies ``lr`` and
``weight_decay x wd_mult`` to every group before each step, as Megatron-LM's ``OptimizerParamScheduler`` does
(megatron-core's groups only carry ``wd_mult``; torch's Adam reads ``weight_decay``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_jf import platform

__all__ = ["no_weight_decay", "param_groups", "megatron_config_overrides", "set_lr_and_weight_decay",
           "effective_weight_decay", "megatron_ddp_config", "megatron_optimizer_config", "clip_grad_norm_tp", "all_reduce_grads", "allreduce_sequence_parallel_grads"]


def no_weight_decay(name: str, param: torch.Tensor) -> bool:
    """True for parameters trained without weight decay: biases and 1-D (or 0-D) tensors such as norm weights
    (Megatron-LM's default grouping)."""
    return param.dim() < 2 or name.endswith(".bias")


def param_groups(module, weight_decay: float) -> list[dict]:
    """torch optimizer parameter groups by :func:`no_weight_decay`: ``weight_decay`` on matrices, 0 on the rest.
    Each group also carries ``wd_mult`` (1 / 0), as megatron-core's groups do."""
    decay, no_decay = [], []
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if no_weight_decay(name, p) else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay, "wd_mult": 1.0},
            {"params": no_decay, "weight_decay": 0.0, "wd_mult": 0.0}]


def megatron_config_overrides() -> dict:
    """``config_overrides`` for ``get_megatron_optimizer``: ``wd_mult = 0`` on the :func:`no_weight_decay`
    parameters (and nothing else overridden)."""
    from megatron.core.optimizer.optimizer_config import ParamKey, ParamWithNamePredicate
    from megatron.core.optimizer_param_scheduler import ParamGroupOverride

    pred = ParamWithNamePredicate(name="jf_no_weight_decay", fn=lambda param, name: no_weight_decay(name, param))
    return {ParamKey(with_name_predicate=pred): ParamGroupOverride(wd_mult=0.0)}


def set_lr_and_weight_decay(groups, lr: float, weight_decay: float) -> None:
    """Set ``lr x lr_mult`` and ``weight_decay x wd_mult`` on every optimizer param group (either path)."""
    for g in groups:
        g["lr"] = lr * g.get("lr_mult", 1.0)
        g["weight_decay"] = weight_decay * g.get("wd_mult", 1.0)


def effective_weight_decay(groups, module) -> dict[str, float]:
    """``{parameter name: weight decay its optimizer group applies}`` (for tests and logs)."""
    by_id = {id(p): g["weight_decay"] for g in groups for p in g["params"]}
    return {n: by_id[id(p)] for n, p in module.named_parameters() if id(p) in by_id}


def megatron_ddp_config(cfg):
    """megatron-core ``DistributedDataParallelConfig`` of a run (GPU path): fp32 gradient reduction,
    ``--overlap-grad-reduce``, ``--overlap-param-gather``, ``--use-distributed-optimizer``, ``--ddp-bucket-size``."""
    from megatron.core.distributed import DistributedDataParallelConfig

    par = cfg.parallel
    return DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=par.overlap_grad_reduce,
                                         overlap_param_gather=par.overlap_param_gather,
                                         use_distributed_optimizer=par.use_distributed_optimizer,
                                         bucket_size=par.ddp_bucket_size)


def megatron_optimizer_config(cfg, dtype: torch.dtype):
    """megatron-core ``OptimizerConfig`` of a run (GPU path): AdamW (decoupled decay) with the run's
    hyper-parameters, bf16 with fp32 main weights when ``dtype`` is bf16."""
    from megatron.core.optimizer import OptimizerConfig

    o = cfg.optim
    return OptimizerConfig(optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
                           adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2, adam_eps=o.adam_eps,
                           clip_grad=o.clip_grad, bf16=dtype == torch.bfloat16, params_dtype=dtype,
                           use_distributed_optimizer=cfg.parallel.use_distributed_optimizer,
                           overlap_param_gather=cfg.parallel.overlap_param_gather)


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
