"""The training loop: megatron-core pipeline schedules, data/tensor/pipeline parallelism, exact resume.

This is the core behind ``pretrain_jf.py`` (Megatron-LM's ``pretrain_gpt.py`` contract, paper Sec. 3.1):
the entry point supplies ``model_provider``, ``forward_step`` and ``train_valid_datasets_provider`` and
calls :func:`pretrain` with a :class:`TrainConfig` (no global mutable arguments).

Where things live: the options and the LR schedule in :mod:`megatron_jf.training.config`, the data streams
in :mod:`megatron_jf.training.streams`, parameter groups / clipping / DP averaging in
:mod:`megatron_jf.training.optim`, the losses in :mod:`megatron_jf.training.losses`, the model inputs of the
attention paths in :mod:`megatron_jf.training.attention_paths`; this module is the loop.

What a step does
    ``get_forward_backward_func()`` (megatron-core: no pipelining, or 1F1B over ``--pp`` stages) runs
    ``num_microbatches = global_batch / (micro_batch * dp)`` microbatches through ``forward_step``; the
    loss function returns ``(loss_sum, count, report)`` so the schedule averages over samples (JF) or
    tokens (AR). Then gradients are synchronised over data parallelism, clipped by their global norm,
    and the optimizer steps with the learning rate of a cosine schedule with linear warmup. With
    ``--pp > 1`` each microbatch keeps its own row length (megatron-core ``variable_seq_lengths``: the stages
    exchange activation shapes) unless ``--no-variable-seq-lengths`` pads every row to ``--seq-length``.

Memory
    ``--recompute-granularity/--recompute-method/--recompute-num-layers`` (Megatron-LM's meaning) go to the
    model provider as megatron-core ``TransformerConfig`` fields (:meth:`RecomputeConfig.kwargs`); the
    trainer checks that the built model carries them.

Optimizers (``--use-megatron-optimizer``, automatic: on with CUDA, off without)
    * **CPU path** (megatron's optimizer hard-codes CUDA: ``FP32Optimizer``, ``clip_grads`` and the distributed
      optimizer allocate on or assert ``cuda`` tensors):
      ``torch.optim.AdamW``, fp32 weights; ``--precision bf16`` runs every microbatch's forward, loss and backward
      under bf16 autocast with those fp32 weights as the master weights (:mod:`megatron_jf.precision`; refused on a
      CPU without native bf16). Data parallelism: ``torch.nn.parallel.DistributedDataParallel``
      over the DP group (gloo) with ``no_sync`` across microbatches when ``pp == 1``. With ``pp > 1``
      megatron's 1F1B schedule runs the last microbatch's *forward* inside ``no_sync`` (megatron's own DDP
      reduces explicitly in ``finish_grad_sync``), so torch DDP would never reduce; there the gradients
      are all-reduced over the DP group explicitly after the schedule. Gradient-norm clipping is
      tensor-parallel aware: squares of TP-sharded parameters are summed over the model-parallel group,
      replicated parameters (RMSNorm weights) and the pipeline-tied output embedding are counted once.
    * **GPU path**: megatron-core ``DistributedDataParallel`` + ``get_megatron_optimizer`` (bf16 with fp32
      main weights, optional ``--use-distributed-optimizer``), megatron's ``finalize_model_grads``;
      ``--overlap-grad-reduce`` / ``--overlap-param-gather`` / ``--ddp-bucket-size`` configure megatron's DDP
      (:func:`~megatron_jf.training.optim.megatron_ddp_config`). Not exercised by the CPU test-suite.
    * Both paths use one parameter grouping (no weight decay on biases and norm weights, Megatron-LM's default)
      and set ``lr`` and ``weight_decay x wd_mult`` on every group before each step
      (:mod:`megatron_jf.training.optim`).

Checkpoints (:mod:`megatron_jf.checkpointing`, atomic)
    model + optimizer state (sharded; reshardable across TP/PP on the CPU path) + per-rank RNG states
    (sharded objects) + ``common``: iteration, data position (epoch, samples consumed), the config.
    A run started with ``--save DIR`` that finds a checkpoint in ``DIR`` resumes from the newest one
    exactly: the remaining steps see the same data, learning rates, optimizer state and weights as an
    uninterrupted run, so they produce identical losses. ``--load`` initialises the weights only
    (e.g. a checkpoint converted with ``tools/convert_hf.py``) and starts at iteration 0.

Anchor term (``--anchor-data``/``--anchor-weight``, JF objective only)
    Self-distillation on the model's own greedy outputs can drift away from real text (held-out NLL
    rises). With ``--anchor-weight lambda > 0`` every JF microbatch also carries ``--anchor-micro-batch-size``
    rows of real corpus text (:class:`~megatron_jf.data.text.TokenChunkDataset`, ``--anchor-seq-length``
    tokens each, split over DP ranks, shuffled with ``--seed``), appended as extra causal rows of the same
    model input (:func:`~megatron_jf.training.attention_paths.append_anchor_rows`), and the step minimises
    ``pc_weight L_pc + ar_weight L_AR + lambda L_anchor`` with ``L_anchor`` the mean next-token CE over the
    microbatch's anchor tokens. The anchor stream's position is saved in the checkpoint's common state
    (``anchor_data``) and restored exactly on resume. Validation does not evaluate the anchor term
    (``--valid-data`` holds trajectories; its reports have no ``anchor loss``).
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import random
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

from megatron_jf import parallel, platform
from megatron_jf.training.config import TrainConfig, effective_seq_length, lr_at
from megatron_jf.training.losses import ANCHOR_METRIC, METRIC_KEYS
from megatron_jf.training.optim import (
    all_reduce_grads,
    clip_grad_norm_tp,
    megatron_config_overrides,
    megatron_ddp_config,
    megatron_optimizer_config,
    param_groups,
    set_lr_and_weight_decay,
)
from megatron_jf.training.streams import AnchoredStream, DatasetSpec, MicrobatchStream, eval_batches

__all__ = ["Trainer", "pretrain"]

class Trainer:
    """Owns model, optimizer, data streams and checkpoints of one run (see the module docstring).

    Args:
        cfg: the validated configuration.
        model_provider: ``(model_args, cfg) -> JFGPTModel`` for this rank's TP/PP shard.
        forward_step_func: ``(data_iterator, model) -> (output, loss_func)`` (megatron-core contract).
        datasets_provider: ``(cfg, model_args) -> (train DatasetSpec, valid DatasetSpec | None)``.

    Raises:
        ValueError / FileNotFoundError: bad configuration, data or checkpoints (clear messages).
    """

    def __init__(self, cfg: TrainConfig, model_provider, forward_step_func, datasets_provider):
        from megatron.core import parallel_state as ps
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from megatron_jf import checkpointing
        from megatron_jf.models.gpt import set_params_dtype, unwrap

        self.cfg = cfg.validate()
        if cfg.runtime.threads:
            torch.set_num_threads(cfg.runtime.threads)
        parallel.initialize(cfg.parallel.tp, cfg.parallel.pp)
        parallel.set_seed(cfg.runtime.seed)
        self.ps = ps
        self.gpu = platform.HAVE_CUDA
        self.device = platform.default_device()
        par = cfg.parallel
        self.use_mopt = self.gpu if par.use_megatron_optimizer is None else par.use_megatron_optimizer
        if self.use_mopt and not self.gpu:
            raise ValueError("--use-megatron-optimizer needs CUDA (megatron's optimizer hard-codes CUDA tensors); "
                             "without a GPU the trainer uses torch AdamW")
        if par.use_distributed_optimizer and not self.use_mopt:
            raise ValueError("--use-distributed-optimizer needs the megatron optimizer (GPU)")
        if (par.overlap_grad_reduce or par.overlap_param_gather or par.ddp_bucket_size) and not self.use_mopt:
            raise ValueError("--overlap-grad-reduce/--overlap-param-gather/--ddp-bucket-size configure megatron's DDP "
                             "(GPU path, --use-megatron-optimizer); the CPU path's torch DDP always overlaps its "
                             "bucketed all-reduce with the backward")
        prec = cfg.runtime.precision
        if prec == "auto":
            prec = "bf16" if (self.gpu and self.use_mopt) else "fp32"
        self.autocast_dtype = None  # CPU bf16: fp32 weights, bf16 autocast (megatron_jf.precision)
        if prec == "bf16" and not self.use_mopt:
            if self.gpu:
                raise ValueError("--precision bf16 on GPU needs the megatron optimizer (fp32 main weights); "
                                 "the torch AdamW path trains in fp32 there")
            from megatron_jf.precision import require_cpu_bf16

            require_cpu_bf16()
            self.autocast_dtype = torch.bfloat16
        self.dtype = torch.bfloat16 if prec == "bf16" and self.use_mopt else torch.float32
        self.dp = ps.get_data_parallel_world_size()
        gbs = cfg.optim.global_batch_size or cfg.optim.micro_batch_size * self.dp
        if gbs % (cfg.optim.micro_batch_size * self.dp):
            raise ValueError(f"--global-batch-size {gbs} is not a multiple of micro-batch-size x dp = "
                             f"{cfg.optim.micro_batch_size} x {self.dp}")
        self.global_batch_size = gbs
        self.num_micro = gbs // (cfg.optim.micro_batch_size * self.dp)

        # ---- architecture and model
        self.resume_iteration = None
        if cfg.checkpoint.save and os.path.isdir(cfg.checkpoint.save):
            self.resume_iteration = checkpointing.latest_iteration(cfg.checkpoint.save)
            if parallel.is_rank0():  # iter_*.tmp left by a run killed mid-save (never a complete checkpoint)
                checkpointing.remove_stale_tmp(cfg.checkpoint.save)
        self.model_args = self._model_args(checkpointing)
        self._check_recompute()
        model = model_provider(self.model_args, cfg)
        got = {k: getattr(model.config, k) for k in cfg.recompute.kwargs()}
        if got != cfg.recompute.kwargs():
            raise ValueError(f"the model provider built a model with {got}, not the requested "
                             f"{cfg.recompute.kwargs()} (pass cfg.recompute.kwargs() to build_model)")
        model = set_params_dtype(model, self.dtype)  # parameters and the config's dtypes (PP receive buffers)
        self.module = unwrap(model)
        self.seq_length = effective_seq_length(cfg, self.model_args.max_position_embeddings)
        two_stream = cfg.dataset.objective == "jf" and cfg.jf.attention_path == "two_stream"
        self.rows_per_micro = cfg.optim.micro_batch_size * (2 if two_stream else 1) + cfg.anchor_mbs

        # ---- wrap for data parallelism and build the optimizer
        self.model = self._wrap(model)
        self.optimizer = self._build_optimizer()
        config = self.module.config
        config.variable_seq_lengths = cfg.parallel.pp > 1 and cfg.dataset.variable_seq_lengths
        if self.autocast_dtype is not None:  # stages exchange the residual stream in the dtype megatron keeps it
            from megatron_jf.precision import residual_stream_dtype

            config.pipeline_dtype = residual_stream_dtype(self.autocast_dtype)
        config.finalize_model_grads_func = self._finalize_grads
        if self.use_mopt:
            from megatron.core.distributed import finalize_model_grads

            config.finalize_model_grads_func = finalize_model_grads
            config.grad_scale_func = self.optimizer.scale_loss
        self.fwd_bwd = get_forward_backward_func()
        self.forward_step = forward_step_func

        # ---- data
        train_spec, valid_spec = datasets_provider(cfg, self.model_args)
        self.train_stream = MicrobatchStream(train_spec, cfg.optim.micro_batch_size, cfg.dataset.num_workers)
        self.anchor_stream = self._anchor_stream() if cfg.anchor_on else None
        self.train_iter = (AnchoredStream(self.train_stream, self.anchor_stream, self._anchor_combine)
                           if self.anchor_stream is not None else self.train_stream)
        self.valid_spec = valid_spec
        self.iteration = 0

        # ---- weights / state
        if self.resume_iteration is not None:
            self._resume(checkpointing)
        elif cfg.model.load:
            checkpointing.load_checkpoint(cfg.model.load, self.module, strict=False)
            if self.use_mopt:
                self.optimizer.reload_model_params()
        self._last_saved = self.iteration
        self._tb = None
        self._log_acc: dict[str, float] = {}
        self.history: list[dict] = []

    # ------------------------------------------------------------------ setup helpers
    def _anchor_stream(self) -> MicrobatchStream:
        """The anchor text stream of this DP rank, and ``self._anchor_combine`` (appends its rows).

        Raises:
            ValueError / FileNotFoundError: unreadable or too short anchor data, ids outside the vocabulary
                (on reading), ``--anchor-seq-length`` beyond the model context or the fixed row length.
        """
        from functools import partial

        from megatron_jf.data.text import TokenChunkDataset, collate_text
        from megatron_jf.training.attention_paths import append_anchor_rows

        cfg, args = self.cfg, self.model_args
        if cfg.jf.anchor_seq_length > args.max_position_embeddings:
            raise ValueError(f"--anchor-seq-length {cfg.jf.anchor_seq_length} exceeds the model's context of "
                             f"{args.max_position_embeddings}")
        pad_to = self.seq_length if cfg.pad_rows_to_seq_length else None
        if pad_to is not None and cfg.jf.anchor_seq_length > pad_to:
            raise ValueError(f"--anchor-seq-length {cfg.jf.anchor_seq_length} exceeds the fixed row length "
                             f"--seq-length {pad_to} (pipeline parallelism with --no-variable-seq-lengths pads "
                             "every row to it)")
        tok = None
        if cfg.dataset.tokenizer:
            from megatron_jf.tokenizer import load_tokenizer

            tok = load_tokenizer(cfg.dataset.tokenizer)
        ds = TokenChunkDataset(cfg.jf.anchor_data, cfg.jf.anchor_seq_length, tokenizer=tok,
                               vocab_size=args.vocab_size,
                               seed=cfg.runtime.seed, shuffle=True, rank=self.ps.get_data_parallel_rank(),
                               world_size=self.dp)
        pad = args.pad_token_id if args.pad_token_id is not None else (
            args.eos_token_ids[0] if args.eos_token_ids else 0)
        self._anchor_combine = partial(append_anchor_rows, pad_id=int(pad), pad_to=pad_to)
        return MicrobatchStream(DatasetSpec(ds, collate_text), cfg.anchor_mbs, 0)

    def _check_recompute(self):
        """``--recompute-method uniform`` chunks must tile this stage's layers (megatron-core indexes past the
        last layer otherwise).

        Raises:
            ValueError: naming the sizes.
        """
        cfg = self.cfg
        rc = cfg.recompute
        if rc.recompute_granularity == "full" and rc.recompute_method == "uniform":
            per_stage = self.model_args.num_layers // cfg.parallel.pp
            if per_stage % rc.recompute_num_layers:
                raise ValueError(f"--recompute-method uniform --recompute-num-layers {rc.recompute_num_layers} "
                                 f"does not divide the {per_stage} layers per pipeline stage")

    def _model_args(self, checkpointing):
        from megatron_jf.models.hf_config import ModelArgs

        cfg = self.cfg
        if cfg.model.hf_config:
            return ModelArgs.from_hf_dir(cfg.model.hf_config)
        if cfg.model.load:
            return ModelArgs.from_dict(checkpointing.read_meta(cfg.model.load)["model_args"])
        if self.resume_iteration is not None:
            meta = checkpointing.read_meta(cfg.checkpoint.save, self.resume_iteration)
            return ModelArgs.from_dict(meta["model_args"])
        raise ValueError(f"no model: --save {cfg.checkpoint.save} holds no checkpoint; give --hf-config or --load")

    def _wrap(self, model):
        cfg = self.cfg
        self.torch_ddp = False
        if self.use_mopt:
            from megatron.core.distributed import DistributedDataParallel

            ddp = DistributedDataParallel(config=model.config, ddp_config=megatron_ddp_config(cfg), module=model)
            model.config.no_sync_func = ddp.no_sync
            return ddp
        model.config.no_sync_func = None
        if self.dp > 1 and cfg.parallel.pp == 1:
            kw = {"device_ids": [self.device.index]} if self.gpu else {}
            ddp = torch.nn.parallel.DistributedDataParallel(
                model, process_group=self.ps.get_data_parallel_group(), broadcast_buffers=False, **kw)
            model.config.no_sync_func = ddp.no_sync
            self.torch_ddp = True
            return ddp
        return model

    def _build_optimizer(self):
        cfg = self.cfg
        if self.use_mopt:
            from megatron.core.optimizer import get_megatron_optimizer

            opt = get_megatron_optimizer(megatron_optimizer_config(cfg, self.dtype), [self.model],
                                         config_overrides=megatron_config_overrides())
        else:
            opt = torch.optim.AdamW(param_groups(self.module, cfg.optim.weight_decay), lr=cfg.optim.lr,
                                    betas=(cfg.optim.adam_beta1, cfg.optim.adam_beta2), eps=cfg.optim.adam_eps)
        set_lr_and_weight_decay(opt.param_groups, cfg.optim.lr, cfg.optim.weight_decay)
        return opt

    def _params(self):
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def _finalize_grads(self, model_list, num_tokens=None, **_kw):
        """Gradient synchronisation after the schedule (torch path): DP average when torch DDP is not
        in use (pp > 1), then the first/last-stage sum of the tied embedding gradient; under
        ``--sequence-parallel`` first the TP sum of the norm gradients (each rank saw ``S / tp`` positions)."""
        from megatron_jf.training.optim import allreduce_sequence_parallel_grads

        ps = self.ps
        allreduce_sequence_parallel_grads(self.module)
        params = [p for p in self.module.parameters() if p.requires_grad]
        if self.dp > 1 and not self.torch_ddp:
            all_reduce_grads(params, ps.get_data_parallel_group(), self.dp)
        if (ps.get_pipeline_model_parallel_world_size() > 1 and self.module.share_embeddings_and_output_weights
                and (ps.is_pipeline_first_stage() or ps.is_pipeline_last_stage())):
            w = self.module.shared_embedding_or_output_weight()
            if w is not None and w.grad is not None:
                dist.all_reduce(w.grad, group=ps.get_embedding_group())

    def release(self) -> None:
        """Cut what would keep this run's model alive after it (call when done with the trainer; its model is not
        for further use: pending ``--overlap-param-gather`` all-gathers are dropped). megatron-core's
        ``RotaryEmbedding.forward`` is a class-level ``functools.lru_cache``, which holds every instance it saw (and
        megatron DDP's forward pre-hooks on it, which hold the DDP, its buffers and the model); the H200 check found
        8.4 GiB of a Qwen2.5-0.5B run still allocated that way. The caches are cleared (for every instance: they
        are only caches) and the pre-hooks removed."""
        if self.use_mopt and self.cfg.parallel.overlap_param_gather:
            with contextlib.suppress(AssertionError, KeyError, AttributeError):  # already removed
                self.model.disable_forward_pre_hook(param_sync=False)
        for cls in {type(m) for m in self.module.modules()}:
            clear = getattr(cls.forward, "cache_clear", None)
            if clear is not None:
                clear()

    # ------------------------------------------------------------------ checkpoint state
    def _ensure_adam_state(self):
        opt = self.optimizer
        for p in self._params():
            st = opt.state[p]
            if not st:
                st["step"] = torch.tensor(0.0, dtype=torch.float32)
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def _ensure_mopt_state(self):
        """Give megatron's optimizer the state a checkpoint's is loaded into before its first step: its own
        ``init_state_fn`` (zero moments) and, for torch's Adam (megatron-core's choice without Apex/TE, whose
        FusedAdam keeps the step in the param groups), a per-parameter ``step`` — without it the distributed
        optimizer's ``state_dict()`` asserts one common step (seen on the H200 without TE); the checkpoint's
        values replace all of these."""
        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            inner = getattr(opt, "optimizer", None)
            if inner is None:
                continue
            if getattr(opt, "init_state_fn", None) is not None:
                opt.init_state_fn(inner, getattr(opt, "config", None))
            if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
                continue
            for group in inner.param_groups:
                on_device = group.get("fused") or group.get("capturable")
                for p in group["params"]:
                    st = inner.state[p]
                    if "step" not in st:
                        st["step"] = torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu")

    def _optimizer_sharding_type(self, common: dict | None = None) -> str:
        """The distributed optimizer's checkpoint format: the saved one when resuming (``common`` of the
        checkpoint; ``fully_sharded_model_space``, megatron-core's old default, for checkpoints that do not say),
        else Megatron-LM's choice: ``dp_reshardable``, or ``fully_reshardable`` with
        ``--dist-ckpt-optim-fully-reshardable``. megatron-core 0.19 refuses ``fully_sharded_model_space`` saves
        (its ShardedTensors carry ``flattened_range``), so that default is never used to save."""
        if common is not None:
            return common.get("optimizer_sharding_type") or "fully_sharded_model_space"
        return "fully_reshardable" if self.cfg.checkpoint.dist_ckpt_optim_fully_reshardable else "dp_reshardable"

    def _optimizer_sharded(self, is_loading: bool, common: dict | None = None):
        model_sd = self.module.sharded_state_dict(prefix="model.")
        if self.use_mopt:
            if is_loading:
                self._ensure_mopt_state()
            meta = {"distrib_optim_sharding_type": self._optimizer_sharding_type(common)}
            return self.optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=meta)
        from megatron.core.dist_checkpointing.optimizer import (
            get_param_id_to_sharded_param_map,
            optim_state_to_sharding_state,
        )

        self._ensure_adam_state()
        id_map = get_param_id_to_sharded_param_map(model_sd, self._params())
        sd = self.optimizer.state_dict()
        optim_state_to_sharding_state(sd, id_map, exclude_keys=("step",))
        return sd

    def _rng_sharded(self):
        from megatron.core.dist_checkpointing.mapping import ShardedObject

        ps = self.ps
        state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
                 "cuda": torch.cuda.get_rng_state() if self.gpu else None}
        return ShardedObject("rng_state", state,
                             (ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size(),
                              self.dp),
                             (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank(),
                              ps.get_data_parallel_rank()), replica_id=0)

    def _common(self) -> dict:
        return {"iteration": self.iteration, "data": self.train_stream.state_dict(),
                "anchor_data": self.anchor_stream.state_dict() if self.anchor_stream is not None else None,
                "consumed_samples": self.iteration * self.global_batch_size, "dp": self.dp,
                "objective": self.cfg.dataset.objective, "block_size": self.cfg.dataset.block_size,
                "optimizer": "megatron" if self.use_mopt else "torch_adamw", "config": self.cfg.to_json(),
                "optimizer_sharding_type": self._optimizer_sharding_type() if self.use_mopt else None}

    def save(self) -> str:
        """Checkpoint the current iteration into ``--save`` (collective)."""
        from megatron_jf import checkpointing

        with self._params_gathered():
            extra = {"optimizer": self._optimizer_sharded(False), "rng": self._rng_sharded()}
            ck = self.cfg.checkpoint
            path = checkpointing.save_checkpoint(ck.save, self.iteration, self.module, sharded_extra=extra,
                                                 common=self._common(), keep_last=ck.keep_last,
                                                 tokenizer_dir=self._tokenizer_source())
        self._last_saved = self.iteration
        self._print(f"saved checkpoint {path}")
        return path

    @contextlib.contextmanager
    def _params_gathered(self):
        """With ``--overlap-param-gather`` the optimizer step leaves the all-gather of the updated parameters to
        the next forward's pre-hooks; finish it (and pause the hooks) while the weights are saved, as
        Megatron-LM does around checkpoints."""
        if not (self.use_mopt and self.cfg.parallel.overlap_param_gather):
            yield
            return
        self.model.disable_forward_pre_hook(param_sync=True)
        try:
            yield
        finally:
            self.model.enable_forward_pre_hook()

    def _tokenizer_source(self) -> str | None:
        """The tokenizer directory the saved checkpoint should carry, so generate/evaluate/serve/collect work on
        it directly: ``--tokenizer``, else the ``--load`` checkpoint's, else the ``--hf-config`` directory's."""
        from megatron_jf import checkpointing

        cfg = self.cfg
        load = cfg.model.load
        for d in (cfg.dataset.tokenizer, load and checkpointing.tokenizer_path(load), cfg.model.hf_config):
            if d and os.path.isdir(d):
                return d
        return None

    def _resume(self, checkpointing):
        cfg, it = self.cfg, self.resume_iteration
        meta = checkpointing.read_meta(cfg.checkpoint.save, it)
        common = meta.get("common", {})
        want = "megatron" if self.use_mopt else "torch_adamw"
        if common.get("optimizer") != want:
            raise ValueError(f"checkpoint {cfg.checkpoint.save} iteration {it} holds {common.get('optimizer')!r} "
                             f"optimizer state but this run uses {want!r}")
        same_layout = (meta.get("tp"), meta.get("pp"), common.get("dp")) == (
            self.ps.get_tensor_model_parallel_world_size(), self.ps.get_pipeline_model_parallel_world_size(), self.dp)
        extra = {"optimizer": self._optimizer_sharded(True, common)}
        if same_layout:
            extra["rng"] = self._rng_sharded()
        res = checkpointing.load_checkpoint(cfg.checkpoint.save, self.module, iteration=it, sharded_extra=extra,
                                            strict=False)
        loaded = res["extra"]
        if self.use_mopt:
            self.optimizer.load_state_dict(loaded["optimizer"])
        else:
            params = self._params()
            step = torch.tensor(float(common["iteration"]), dtype=torch.float32)
            with torch.no_grad():
                for pid, st in loaded["optimizer"]["state"].items():
                    dst = self.optimizer.state[params[int(pid)]]
                    for k, v in st.items():
                        dst[k].copy_(v)
                    dst["step"] = step.clone()
        if "rng" in loaded:
            r = loaded["rng"]
            random.setstate(r["python"])
            np.random.set_state(r["numpy"])
            torch.set_rng_state(r["torch"])
            if self.gpu and r.get("cuda") is not None:
                torch.cuda.set_rng_state(r["cuda"])
        self.iteration = int(common["iteration"])
        self.train_stream.load_state_dict(common["data"])
        if self.anchor_stream is not None:
            if common.get("anchor_data"):
                self.anchor_stream.load_state_dict(common["anchor_data"])
            else:
                self._print("note: the checkpoint holds no anchor-data position (saved without --anchor-data); "
                            "the anchor stream starts from its beginning")
        self._print(f"resumed from {cfg.checkpoint.save} iteration {self.iteration}")

    # ------------------------------------------------------------------ steps
    def _run_schedule(self, data_iterator, num_micro: int, forward_only: bool):
        from megatron_jf.precision import autocast

        with autocast(self.autocast_dtype):  # forwards, losses and backwards of every microbatch
            return self.fwd_bwd(forward_step_func=self.forward_step, data_iterator=data_iterator,
                                model=[self.model], num_microbatches=num_micro, seq_length=self.seq_length,
                                micro_batch_size=self.rows_per_micro, forward_only=forward_only)

    def _is_loss_rank(self) -> bool:
        return self.ps.is_pipeline_last_stage() and self.ps.get_tensor_model_parallel_rank() == 0

    def _reduce(self, reports: list[dict], extra: list[float]) -> dict[str, float]:
        """Sum ``(sum, count)`` reports over microbatches and data-parallel replicas (world all-reduce;
        only one rank per replica contributes: the last stage's TP rank 0)."""
        keys = METRIC_KEYS + (ANCHOR_METRIC,)  # the anchor key only in reports of anchored microbatches
        n = len(keys)
        vec = torch.zeros(2 * n + len(extra), dtype=torch.float64)
        if self._is_loss_rank():
            for r in reports:
                for i, k in enumerate(keys):
                    if k in r:
                        vec[2 * i: 2 * i + 2] += r[k].detach().double().cpu()
            vec[2 * n:] = torch.tensor(extra, dtype=torch.float64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            v = vec.to(self.device)
            dist.all_reduce(v)
            vec = v.cpu()
        out = {k: float(vec[2 * i] / vec[2 * i + 1]) if vec[2 * i + 1] > 0 else float("nan")
               for i, k in enumerate(keys)}
        if not vec[2 * keys.index(ANCHOR_METRIC) + 1] > 0:
            del out[ANCHOR_METRIC]  # no anchored microbatch (anchor off, or validation)
        out["extra"] = vec[2 * n:].tolist()
        return out

    def train_step(self) -> dict:
        """One optimizer step over ``num_microbatches`` microbatches; returns its metrics
        (``loss``, ``pc loss``, ``ar loss``, ``noisy acc``, ``anchor loss`` (only when on), ``lr``,
        ``grad norm``, ``tokens``, ``time``)."""
        t0 = time.perf_counter()
        self.model.train()
        if self.use_mopt:
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
        else:
            self.optimizer.zero_grad(set_to_none=True)
        tok0 = self.train_iter.tokens
        reports = self._run_schedule(self.train_iter, self.num_micro, forward_only=False)
        lr = lr_at(self.iteration + 1, self.cfg)
        set_lr_and_weight_decay(self.optimizer.param_groups, lr, self.cfg.optim.weight_decay)
        if self.use_mopt:
            ok, grad_norm, _ = self.optimizer.step()
            grad_norm = float(grad_norm) if grad_norm is not None else float("nan")
        else:
            grad_norm = clip_grad_norm_tp(self._params(), self.cfg.optim.clip_grad)
            self.optimizer.step()
        self.iteration += 1
        m = self._reduce(reports, [float(self.train_iter.tokens - tok0)])
        tokens = m.pop("extra")[0]
        m.update({"iteration": self.iteration, "lr": lr, "grad norm": grad_norm, "tokens": tokens,
                  "time": time.perf_counter() - t0})
        return m

    @torch.no_grad()
    def evaluate(self) -> dict | None:
        """Forward-only pass over the validation set (or ``--eval-iters`` microbatches); None without one."""
        if self.valid_spec is None:
            return None
        self.model.eval()
        per_rank = self.valid_spec.dataset.samples_per_rank // self.cfg.optim.micro_batch_size
        limit = min(per_rank, self.cfg.logging.eval_iters or per_rank)
        if limit == 0:
            raise ValueError(f"validation data has fewer than micro-batch-size x dp = "
                             f"{self.cfg.optim.micro_batch_size} x {self.dp} samples")
        with torch.no_grad():  # as Megatron-LM's evaluate: no graph, and the fused loss forms no gradients
            reports = self._run_schedule(eval_batches(self.valid_spec, self.cfg.optim.micro_batch_size, limit), limit,
                                         forward_only=True)
        m = self._reduce(reports, [])
        m.pop("extra")
        m["iteration"] = self.iteration
        self.model.train()
        return m

    # ------------------------------------------------------------------ logging
    def _print(self, msg: str):
        if parallel.is_rank0():
            bar = getattr(self, "_bar", None)
            if bar is None:
                print(msg, flush=True)
                return
            # clear the bar (stderr), print and flush the line (stdout), redraw the bar: a log that takes both
            # streams gets whole lines, never a step line inside a bar update
            with bar.external_write_mode(file=sys.stdout):
                print(msg, flush=True)

    def _log_event(self, split: str, m: dict):
        if not parallel.is_rank0():
            return
        rec = {"split": split, **{k.replace(" ", "_"): v for k, v in m.items()}}
        if self.cfg.logging.log_file:
            d = os.path.dirname(os.path.abspath(self.cfg.logging.log_file))
            os.makedirs(d, exist_ok=True)
            with open(self.cfg.logging.log_file, "a") as f:
                f.write(json.dumps(rec) + "\n")
        if self.cfg.logging.tensorboard_dir:
            if self._tb is None:
                try:
                    from torch.utils.tensorboard import SummaryWriter

                    self._tb = SummaryWriter(self.cfg.logging.tensorboard_dir)
                except ImportError:
                    self._tb = False
                    self._print("tensorboard is not installed; --tensorboard-dir ignored")
            if self._tb:
                for k, v in m.items():
                    if k != "iteration" and isinstance(v, float) and math.isfinite(v):
                        self._tb.add_scalar(f"{split}/{k}", v, m["iteration"])

    def _format(self, split: str, m: dict) -> str:
        parts = [f"{split} step {m['iteration']}/{self.cfg.optim.train_steps}", f"loss {m['loss']:.4f}"]
        if self.cfg.dataset.objective == "jf":
            parts += [f"L_pc {m['pc loss']:.4f}", f"L_AR {m['ar loss']:.4f}"]
            if math.isfinite(m.get("anchor loss", float("nan"))):
                parts.append(f"anchor loss {m['anchor loss']:.4f}")
            parts.append(f"noisy acc {m['noisy acc']:.3f}")
        if split == "train":
            parts += [f"lr {m['lr']:.3e}", f"grad norm {m['grad norm']:.3f}", f"tok/s {m['tokens per s']:.0f}"]
        return " | ".join(parts)

    # ------------------------------------------------------------------ loop
    def train(self) -> list[dict]:
        """Train until ``--train-steps`` (or ``--exit-interval``); returns the per-step metrics."""
        cfg = self.cfg
        self._bar = None
        if cfg.logging.progress and parallel.is_rank0():
            try:
                from tqdm import tqdm

                self._bar = tqdm(total=cfg.optim.train_steps, initial=self.iteration, desc="train", dynamic_ncols=True,
                                 file=sys.stderr)
            except ImportError:
                self._bar = None
        acc: dict[str, float] = {}
        nacc = 0
        mkeys = ("loss", "pc loss", "ar loss", "noisy acc") + (("anchor loss",) if cfg.anchor_on else ())
        try:
            while self.iteration < cfg.optim.train_steps:
                m = self.train_step()
                self.history.append(m)
                if self._bar is not None:
                    self._bar.update(1)
                for k in mkeys + ("tokens", "time"):
                    acc[k] = acc.get(k, 0.0) + m[k]
                nacc += 1
                it = self.iteration
                if it % cfg.logging.log_interval == 0 or it == cfg.optim.train_steps:
                    lm = {k: acc[k] / nacc for k in mkeys}
                    lm.update({"iteration": it, "lr": m["lr"], "grad norm": m["grad norm"],
                               "tokens per s": acc["tokens"] / max(acc["time"], 1e-9),
                               "step time": acc["time"] / nacc})
                    self._print(self._format("train", lm))
                    self._log_event("train", lm)
                    acc, nacc = {}, 0
                if cfg.logging.eval_interval and it % cfg.logging.eval_interval == 0:
                    em = self.evaluate()
                    self._print(self._format("valid", em))
                    self._log_event("valid", em)
                if cfg.checkpoint.save and cfg.checkpoint.save_interval and it % cfg.checkpoint.save_interval == 0:
                    self.save()
                if cfg.checkpoint.exit_interval and it % cfg.checkpoint.exit_interval == 0:
                    break
            if cfg.checkpoint.save and self._last_saved != self.iteration:
                self.save()
        finally:
            if self._bar is not None:
                self._bar.close()
                self._bar = None
            if self._tb:
                self._tb.close()
        return self.history


def pretrain(cfg: TrainConfig, model_provider, forward_step_func, datasets_provider) -> list[dict]:
    """Build a :class:`Trainer` and train (Megatron-LM's ``pretrain`` entry point, without global args).

    The trainer is released (:meth:`Trainer.release`) and collected before returning, so a caller that trains
    again in the same process (a pipeline's stages, a test) starts from the memory it had (on the H200 each
    Qwen2.5-0.5B run had left 8.4 GiB allocated: model, gradient buffers and optimizer state).

    Returns:
        The per-step metrics of this run.
    """
    trainer = Trainer(cfg, model_provider, forward_step_func, datasets_provider)
    try:
        return trainer.train()
    finally:
        trainer.release()
        del trainer
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
