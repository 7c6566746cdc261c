#!/usr/bin/env python
"""Jacobi Forcing training (arXiv 2512.14681, Sec. 3.1, Eq. 8-9) on megatron-core.

The same shape as Megatron-LM's ``pretrain_gpt.py``: a model provider, a ``forward_step`` returning
``(output, partial(loss_func, ...))``, a datasets provider, and :func:`megatron_jf.training.trainer.pretrain`
-- with one :class:`~megatron_jf.training.config.TrainConfig` passed explicitly instead of global args.

Examples (CPU, 2 processes; add ``--tp``/``--pp`` to split the model)::

    # Jacobi Forcing on trajectory shards, from a converted checkpoint
    torchrun --nproc_per_node 2 pretrain_jf.py --load ckpt/qwen-mcore --data shards/train \\
        --valid-data shards/valid --block-size 32 --window-size 16 --train-steps 1000 \\
        --micro-batch-size 1 --global-batch-size 8 --lr 1e-5 --save ckpt/jf --save-interval 200

    # plain next-token training on int32 token ids
    python pretrain_jf.py --objective ar --hf-config tiny_cfg --data tokens.npy --seq-length 256 --train-steps 100

Run ``python pretrain_jf.py --help`` for every option, grouped by concern.
"""

from __future__ import annotations

import math
import sys
from functools import partial

# light imports only: the command line is parsed (and --help / argument errors answered) before torch and
# megatron-core are imported in main()
from megatron_jf.training.config import TrainConfig, effective_seq_length, parse_config


def model_provider(model_args, cfg: TrainConfig):
    """This rank's :class:`~megatron_jf.models.gpt.JFGPTModel` (pre/post-process from the PP stage), with the
    run's activation-recomputation settings (``--recompute-*``) and layer spec (``--transformer-impl``)."""
    from megatron_jf.models.gpt import build_model

    return build_model(model_args, recompute=cfg.recompute.kwargs(),
                       sequence_parallel=cfg.parallel.sequence_parallel,
                       transformer_impl=cfg.runtime.transformer_impl)


def loss_func(batch, loss_cfg, vocab_size: int, output_tensor: torch.Tensor):
    """Jacobi Forcing loss of one microbatch (paper Eq. 8-9).

    Args:
        batch: the :class:`~megatron_jf.training.attention_paths.JFBatch` the output came from.
        loss_cfg: :class:`~megatron_jf.training.config.JFObjective` (the loss options).
        vocab_size: real vocabulary size (padding columns excluded).
        output_tensor: vocab-parallel logits ``[R, S, V_local]``.

    Returns:
        ``(loss summed over samples, number of samples (int tensor), report)``: megatron-core divides
        by the count, so the step minimises the mean over samples. ``report`` values are
        ``(sum, count)`` pairs: ``loss``, ``pc loss`` (L_pc), ``ar loss`` (L_AR), ``noisy acc``, and
        ``anchor loss`` (L_anchor, mean nats per anchor token) when the batch carries anchor rows
        (``--anchor-data``); then ``loss`` includes ``anchor_weight * L_anchor``.
    """
    import torch

    from megatron_jf.training.attention_paths import gather_anchor_logits, gather_jf_logits
    from megatron_jf.training.losses import ANCHOR_METRIC, anchor_term, jf_loss

    loss_sum, report = jf_loss(gather_jf_logits(output_tensor, batch, vocab_size), loss_cfg)
    B = batch.num_samples
    if batch.has_anchor:
        add, metric = anchor_term(gather_anchor_logits(output_tensor, batch), batch.anchor_targets, B,
                                  weight=loss_cfg.anchor_weight, vocab_size=vocab_size)
        loss_sum = loss_sum + add
        report["loss"] = report["loss"] + torch.stack([add.detach().double().reshape(()),
                                                       torch.zeros((), dtype=torch.float64, device=add.device)])
        report[ANCHOR_METRIC] = metric
    return loss_sum, torch.tensor(B, dtype=torch.int), report


def rows_loss_func(batch, loss_cfg, vocab_size: int, weight: torch.Tensor, chunk_size: int, output_tensor: torch.Tensor):
    """The same loss as :func:`loss_func` from the hidden states of the loss rows only (``output_tensor``
    ``[N, h]``, :func:`megatron_jf.training.output_head.forward_loss_rows`): the output layer ``weight``
    ``[V_local, h]`` and the loss run on them in chunks of ``chunk_size`` rows (``--loss-chunk-size``)."""
    import torch

    from megatron_jf.training.output_head import head_loss

    loss_sum, report = head_loss(output_tensor, weight, batch, loss_cfg, vocab_size, chunk_size=chunk_size)
    return loss_sum, torch.tensor(batch.num_samples, dtype=torch.int), report


def ar_loss_func(batch, vocab_size: int, output_tensor: torch.Tensor):
    """Next-token loss (``--objective ar``): ``(loss summed over tokens, token count, report)``."""
    from megatron_jf.training.losses import ar_loss

    return ar_loss(output_tensor, batch.labels, vocab_size=vocab_size)


def forward_step(data_iterator, model, *, cfg: TrainConfig):
    """Forward one microbatch (megatron-core ``forward_step_func`` contract).

    Returns:
        ``(output, partial(loss function, ...))``: on the last pipeline stage the logits (``--objective ar``)
        or the hidden states of the JF loss rows (:func:`rows_loss_func`); hidden states elsewhere (the
        schedule only calls the loss function on the last stage).
    """
    from megatron_jf import platform
    from megatron_jf.models.gpt import unwrap

    batch = next(data_iterator).to(platform.default_device())
    vocab = unwrap(model).vocab_size_unpadded
    if cfg.dataset.objective == "ar":
        output = model(batch.tokens, batch.position_ids, None, runtime_gather_output=False)
        return output, partial(ar_loss_func, batch, vocab)
    from megatron_jf.training.output_head import forward_loss_rows, output_weight

    loss_cfg = cfg.jf
    rows = forward_loss_rows(model, batch, with_teacher=loss_cfg.consistency_loss != "hard")
    return rows, partial(rows_loss_func, batch, loss_cfg, vocab, output_weight(model), cfg.jf.loss_chunk_size)


def train_valid_datasets_provider(cfg: TrainConfig, model_args):
    """Training and validation data for this data-parallel rank.

    Returns:
        ``(train DatasetSpec, valid DatasetSpec or None)``.

    Raises:
        ValueError / FileNotFoundError: missing, empty or corrupt data, or (jf) shards whose block size
            differs from ``--block-size`` (checked on the first record, and on every record read).
    """
    from megatron_jf import parallel
    from megatron_jf.training.streams import DatasetSpec

    rank, world = parallel.dp_rank(), parallel.dp_size()
    seq = effective_seq_length(cfg, model_args.max_position_embeddings)
    data, tp = cfg.dataset, cfg.parallel.tp
    if cfg.parallel.sequence_parallel and (data.objective == "ar" or cfg.pad_rows_to_seq_length) and seq % tp:
        raise ValueError(f"--sequence-parallel splits every row over --tp {tp}: --seq-length {seq} must be a "
                         "multiple of it")
    if data.objective == "ar":
        from megatron_jf.data.text import TokenChunkDataset, collate_text

        tok = None
        if data.tokenizer:
            from megatron_jf.tokenizer import load_tokenizer

            tok = load_tokenizer(data.tokenizer)
        if seq > model_args.max_position_embeddings:
            raise ValueError(f"--seq-length {seq} exceeds the model's context of {model_args.max_position_embeddings}")

        def make(paths, shuffle):
            return DatasetSpec(TokenChunkDataset(paths, seq, tokenizer=tok, vocab_size=model_args.vocab_size,
                                                 seed=cfg.runtime.seed, shuffle=shuffle, rank=rank, world_size=world),
                               collate_text)
    else:
        from megatron_jf.data.dataset import LENGTH_GROUP_MICRO_BATCHES, TrajectoryDataset
        from megatron_jf.training.attention_paths import build_jf_batch

        pad = model_args.pad_token_id if model_args.pad_token_id is not None else (
            model_args.eos_token_ids[0] if model_args.eos_token_ids else 0)
        collate = partial(build_jf_batch, path=cfg.jf.attention_path, mask=cfg.jf.mask, window_size=data.window_size,
                          pad_id=int(pad), pad_to=seq if cfg.pad_rows_to_seq_length else None, max_len=seq,
                          pad_to_multiple_of=math.lcm(8, tp), max_position=model_args.max_position_embeddings,
                          vocab_size=model_args.vocab_size)

        def make(paths, shuffle):
            ds = TrajectoryDataset(paths, window_size=data.window_size, schedule=data.noise_schedule,
                                   seed=cfg.runtime.seed, consistency=data.consistency_positions,
                                   block_size=data.block_size,
                                   shuffle=shuffle, rank=rank, world_size=world, remainder="drop", batch_size=1,
                                   resample_noise_per_epoch=data.resample_noise_per_epoch and shuffle,
                                   length_group_size=LENGTH_GROUP_MICRO_BATCHES * cfg.optim.micro_batch_size
                                   if data.group_by_length and shuffle else 0,
                                   micro_batch_size=cfg.optim.micro_batch_size)
            ds.read_record(0)  # fail fast on a block-size mismatch or an unreadable first record
            return DatasetSpec(ds, collate)
    return make(data.data, True), (make(data.valid_data, False) if data.valid_data else None)


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the process exit status: 2 with one ``pretrain_jf.py: error: ...`` line for bad input
    (as every command, :mod:`megatron_jf.commands`)."""
    from megatron_jf.commands import EXIT_INPUT
    from megatron_jf.load_errors import check_load_dir

    try:  # arguments and the --load path first: answered before torch and megatron-core are imported
        cfg = parse_config(argv)
        check_load_dir(cfg.model.load)
        if cfg.runtime.precision == "bf16":  # refused on a CPU without native bf16 before megatron-core is imported
            import torch

            if not torch.cuda.is_available():
                from megatron_jf.precision import require_cpu_bf16

                require_cpu_bf16()
    except (ValueError, FileNotFoundError) as e:
        print(f"pretrain_jf.py: error: {e}", file=sys.stderr, flush=True)
        return EXIT_INPUT
    from megatron_jf import parallel
    from megatron_jf.training.trainer import pretrain

    try:
        pretrain(cfg, model_provider, partial(forward_step, cfg=cfg), train_valid_datasets_provider)
    except (ValueError, FileNotFoundError) as e:
        print(f"pretrain_jf.py: error: {e}", file=sys.stderr, flush=True)
        return EXIT_INPUT
    finally:
        parallel.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
