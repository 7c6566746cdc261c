"""The output layer on the loss rows only (paper Sec. 3.1: the loss lives on the response positions).

Of the ``R x S`` positions a Jacobi Forcing microbatch runs through the model, only a few carry a loss:
the noisy (student) and clean (teacher) positions of the consistency pairs, the clean positions with an
AR target and the anchor rows' labelled positions. The prompt rows of the two streams (and all padding)
carry none. So instead of the output layer over every row (``[R, S, V_local]`` logits) the model returns
the final-norm hidden states of the loss rows, and :func:`~megatron_jf.training.losses.fused_head_loss`
runs the output layer and the loss on them in chunks (peak memory ``O(chunk x V_local)``).

* :func:`loss_row_index`: flat ``[R * S]`` indices of the loss rows in the order the fused loss expects
  (student rows, teacher rows, AR rows, anchor rows). Rows are not deduplicated (a clean position can be
  both a teacher and an AR row): the hidden rows are ``h``-wide, cheap next to the ``V_local``-wide logits.
* :func:`forward_loss_rows`: the model forward returning those hidden rows ``[N, h]``, identical on
  every TP rank. Without sequence parallelism the rows are gathered from the full ``[S, R, h]`` output
  and enter the TP region (identity forward, all-reduce of the gradient, as the output layer's input
  does). With ``--sequence-parallel`` each rank holds ``S / tp`` positions of every row: it gathers the
  loss rows that fall in its shard (zeros elsewhere) and the rows are summed over the TP group, forward
  and backward -- the same data movement as megatron's all-gather before the output layer, on the loss
  rows only.
* :func:`head_loss`: the microbatch loss from those rows (:func:`~megatron_jf.training.losses.jf_head_loss`).

The full-row path (:func:`~megatron_jf.training.attention_paths.forward_model` +
:func:`~megatron_jf.training.attention_paths.gather_jf_logits` + :func:`~megatron_jf.training.losses.jf_loss`)
stays as the reference; tests check both give the same loss and gradients.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_jf.training.config import JFObjective
from megatron_jf.training.losses import DEFAULT_LOSS_CHUNK, jf_head_loss

__all__ = ["loss_row_index", "output_weight", "select_rows", "run_forward_pre_hooks", "forward_loss_rows", "head_loss"]


def loss_row_index(batch, *, with_teacher: bool = True) -> torch.Tensor:
    """int64 ``[2C + M + K]`` (``[C + M + K]`` without teacher rows) flat indices into the model output
    viewed as ``[R * S]``: student, teacher, AR and anchor positions of ``batch`` (a
    :class:`~megatron_jf.training.attention_paths.JFBatch`), in that order."""
    parts = [batch.student_index] + ([batch.teacher_index] if with_teacher else []) + [batch.ar_index]
    if batch.has_anchor:
        parts.append(batch.anchor_index)
    return torch.cat(parts)


def output_weight(model) -> torch.Tensor:
    """This rank's output-layer weight ``[V_local, h]`` (the word embedding when tied); None on a pipeline
    stage without the output layer."""
    from megatron_jf.models.gpt import unwrap

    m = unwrap(model)
    if not m.post_process:
        return None
    if m.share_embeddings_and_output_weights:
        return m.shared_embedding_or_output_weight()
    return m.output_layer.weight


class _SumOverTP(torch.autograd.Function):
    """All-reduce (sum) over the TP group in the forward and in the backward.

    Each rank contributes the loss rows of its sequence shard (zeros elsewhere); every rank's loss is a
    function of the summed rows, so the gradient of each contribution is the sum of the ranks' gradients."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


def select_rows(hidden: torch.Tensor, index: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The rows ``index`` (flat into ``[R, seq_len]``) of the model's hidden states, on every TP rank.

    Args:
        hidden: ``[S_local, R, h]`` final-norm hidden states (megatron's sequence-first layout);
            ``S_local = seq_len / tp`` when sequence parallelism is on, else ``seq_len``.
        index: int64 ``[N]``, values in ``[0, R * seq_len)``.
        seq_len: ``S``, the full row length.

    Returns:
        ``[N, h]`` in the TP region: identical on every TP rank, gradients summed over the TP group.

    Raises:
        ValueError: ``S_local`` is neither ``seq_len`` nor ``seq_len / tp``.
    """
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    s_local, R, h = hidden.shape
    tp = ps.get_tensor_model_parallel_world_size() if ps.model_parallel_is_initialized() else 1
    pos = index % seq_len
    row = torch.div(index, seq_len, rounding_mode="floor")
    flat = hidden.reshape(s_local * R, h)
    if s_local == seq_len:
        rows = flat.index_select(0, pos * R + row)
        return tensor_parallel.copy_to_tensor_model_parallel_region(rows) if tp > 1 else rows
    if s_local * tp != seq_len:
        raise ValueError(f"hidden states hold {s_local} positions per row; expected {seq_len} or {seq_len} / {tp}")
    lo = ps.get_tensor_model_parallel_rank() * s_local
    mine = (pos >= lo) & (pos < lo + s_local)
    local = (pos - lo).clamp(0, s_local - 1) * R + row
    rows = torch.where(mine.unsqueeze(1), flat.index_select(0, local), torch.zeros((), dtype=hidden.dtype,
                                                                                     device=hidden.device))
    return _SumOverTP.apply(rows, ps.get_tensor_model_parallel_group())


def run_forward_pre_hooks(module: torch.nn.Module) -> None:
    """Run the forward pre-hooks of ``module`` as calling it would, without calling it.

    The loss-row forward never calls the output layer, but :func:`head_loss` reads its weight. Hooks on the output
    layer must still run: with ``--use-distributed-optimizer --overlap-param-gather`` megatron-core's DDP gathers the
    updated parameters of each bucket in a forward pre-hook of the modules using them (``finish_param_sync``). An
    untied output layer (Qwen2.5-7B) sits in a bucket of its own, so without its hook step 1 read a weight still being
    gathered and step 2 stopped on megatron's ``assert self.param_gather_handle is None``. Hooks that return a value
    (input rewriting) have nothing to rewrite here; their return is ignored.
    """
    kw_hooks = getattr(module, "_forward_pre_hooks_with_kwargs", {})
    for hook_id, hook in list(module._forward_pre_hooks.items()):
        if hook_id in kw_hooks:
            hook(module, (), {})
        else:
            hook(module, ())


def forward_loss_rows(model, batch, *, with_teacher: bool = True) -> torch.Tensor:
    """Forward ``batch`` through ``model`` and return, on the last pipeline stage, the final-norm hidden
    states of its loss rows ``[N, h]`` (:func:`loss_row_index` order, identical on every TP rank); other
    stages return their hidden states for the next stage, as :func:`~megatron_jf.training.attention_paths.
    forward_model` does."""
    from megatron_jf.models.gpt import unwrap
    from megatron_jf.training.attention_paths import forward_model

    m = unwrap(model)
    if not m.post_process:
        return forward_model(model, batch)
    index = loss_row_index(batch, with_teacher=with_teacher).to(batch.tokens.device)
    S = batch.tokens.shape[1]

    def postprocess(hidden_states, **_kw):
        # megatron-core's GPTModel.forward ends with self._postprocess(hidden_states=..., ...): the output
        # layer (and MTP, which we do not use). For this one forward it selects the loss rows instead.
        if m.output_layer is not None:
            run_forward_pre_hooks(m.output_layer)  # the fused loss reads its weight as if it had been called
        return select_rows(hidden_states, index, S)

    m._postprocess = postprocess  # instance attribute: shadows GPTModel._postprocess for this forward only
    try:
        return forward_model(model, batch)
    finally:
        del m._postprocess


def head_loss(hidden_rows: torch.Tensor, weight: torch.Tensor, batch, cfg: JFObjective, vocab_size: int | None, *,
              chunk_size: int | None = DEFAULT_LOSS_CHUNK) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The JF microbatch loss (paper Eq. 8-9, plus the anchor term when ``batch`` has anchor rows) from the
    loss-row hidden states of :func:`forward_loss_rows`.

    Returns:
        ``(loss summed over samples, report)``: as ``pretrain_jf.loss_func`` on full-row logits.
    """
    return jf_head_loss(hidden_rows, weight, pc_targets=batch.pc_targets, pair_sample=batch.pair_sample,
                        pair_block=batch.pair_block, ar_targets=batch.ar_targets, ar_sample=batch.ar_sample,
                        num_blocks=batch.num_blocks, cfg=cfg, vocab_size=vocab_size, max_blocks=batch.max_blocks,
                        anchor_targets=batch.anchor_targets if batch.has_anchor else None, chunk_size=chunk_size)
