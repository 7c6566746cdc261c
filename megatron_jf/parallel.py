"""Process groups for ``torchrun``: gloo on CPU, NCCL on GPU; tensor/pipeline/data parallel sizes.

Usage (every entry point)::

    initialize(tp=2, pp=1)      # reads RANK/WORLD_SIZE/MASTER_ADDR from torchrun, or runs single-process
    set_seed(1234)

Data-parallel size is ``world_size / (tp * pp)``.
"""

from __future__ import annotations

import os
import random
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from megatron_jf import platform


def initialize(tp: int = 1, pp: int = 1, *, timeout_s: int = 600) -> None:
    """Create the default process group (if needed) and megatron-core's model-parallel groups.

    Args:
        tp: tensor-parallel size. Must divide the world size together with ``pp``.
        pp: pipeline-parallel size.
        timeout_s: collective timeout in seconds.

    Raises:
        ValueError: if ``tp * pp`` does not divide the world size, or a size is < 1.
    """
    from megatron.core import parallel_state as ps

    platform.apply_cpu_shims()
    if tp < 1 or pp < 1:
        raise ValueError(f"tensor/pipeline parallel sizes must be >= 1, got tp={tp} pp={pp}")
    if not dist.is_initialized():
        backend = "nccl" if platform.HAVE_CUDA else "gloo"
        if platform.HAVE_CUDA:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if "WORLD_SIZE" not in os.environ:
            # a single process not started by torchrun: an in-process store, no TCP port to collide on
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                    timeout=timedelta(seconds=timeout_s))
        else:
            dist.init_process_group(backend, rank=int(os.environ.get("RANK", "0")),
                                    world_size=int(os.environ["WORLD_SIZE"]), timeout=timedelta(seconds=timeout_s))
    world = dist.get_world_size()
    if world % (tp * pp) != 0:
        hint = f" (launch with torchrun --nproc_per_node {tp * pp})" if world == 1 else ""
        raise ValueError(f"tp*pp = {tp}*{pp} does not divide the world size {world}{hint}")
    if ps.model_parallel_is_initialized():
        if ps.get_tensor_model_parallel_world_size() == tp and ps.get_pipeline_model_parallel_world_size() == pp:
            return
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)


def set_seed(seed: int) -> None:
    """Seed Python, NumPy and torch, and megatron-core's model-parallel RNG tracker.

    On CPU the tracker is megatron's inference tracker (its ``fork()`` is a no-op; our models have
    no dropout). Weights are initialised on CPU from the global torch RNG and then split, so all
    TP ranks must use the same seed to get the same master weights.
    """
    from megatron.core import tensor_parallel

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed, inference_rng_tracker=not platform.HAVE_CUDA)


def destroy() -> None:
    """Tear down model-parallel groups and the default process group."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def is_rank0() -> bool:
    """True on global rank 0 or when torch.distributed is not initialised."""
    return not dist.is_initialized() or dist.get_rank() == 0


def tp_size() -> int:
    """The tensor-parallel size (1 before :func:`initialize`)."""
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_world_size() if ps.model_parallel_is_initialized() else 1


def pp_size() -> int:
    """The pipeline-parallel size (1 before :func:`initialize`)."""
    from megatron.core import parallel_state as ps

    return ps.get_pipeline_model_parallel_world_size() if ps.model_parallel_is_initialized() else 1


def dp_size() -> int:
    """The data-parallel size (1 before :func:`initialize`)."""
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_world_size() if ps.model_parallel_is_initialized() else 1


def dp_rank() -> int:
    """This process's data-parallel rank (0 before :func:`initialize`)."""
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_rank() if ps.model_parallel_is_initialized() else 0


def broadcast_object(obj):
    """``obj`` from global rank 0 on every rank (a picklable object; itself when not distributed)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_objects(obj) -> list:
    """Every rank's ``obj``, in rank order, on every rank (``[obj]`` when not distributed)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def barrier() -> None:
    """Wait for every rank (nothing when not distributed)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
