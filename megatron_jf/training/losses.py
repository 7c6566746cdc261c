"""Jacobi Forcing losses on vocab-parallel logits (paper Sec. 3.1, Eq. 8-9).

Total objective (paper Eq. 9)::

    L = pc_weight * L_pc + ar_weight * L_AR

* **L_pc, progressive consistency loss** (paper Eq. 8). For every consistency pair (a noisy position
  and the clean position of the same block and offset, see :mod:`megatron_jf.data.packing`):
  ``D(p_teacher || p_student)`` where the *teacher* is the model's distribution at the clean position
  (clean context; **stop-gradient**, the same model in the same forward, not a frozen copy) and the
  *student* is the distribution at the paired noisy position (noisy context). ``D`` is chosen by
  ``consistency_loss``:

  - ``"kl"`` (default, paper Eq. 8): ``KL(p_t || p_s) = sum_v p_t (log p_t - log p_s)``.
  - ``"soft_ce"`` (reference code, ``soft_flexattn_cllm_trainer_multiblock.py``):
    ``-sum_v p_t log p_s`` = KL + H(p_t); same gradient as ``"kl"``, larger value.
  - ``"hard"``: cross-entropy of the student against the fixed-point token (the clean position's
    AR target), as in CLLM's global consistency loss.

  With a temperature ``tau`` (``"kl"``/``"soft_ce"`` only) both distributions are ``softmax(z / tau)``
  and the value is multiplied by ``tau**2`` (Hinton et al. 2015), so the gradient scale does not depend
  on ``tau``. The reference code's effective temperature is 1 (its ``distill_temperature`` is never set).

  Normalisation (``pc_normalization``), per sample with ``N`` = the sample's number of blocks:

  - ``"paper"`` (default): average over the kept positions of each block, sum over blocks, divide by
    ``N`` (the paper's ``1/N sum_i``). A block without kept positions contributes 0.
  - ``"reference"``: mean over all kept positions of the sample, divided by ``N`` (``T`` in the
    reference code, L542) -- the two agree when every block has the same number of kept positions,
    up to the factor ``1/N`` that the reference applies on top of a mean.

* **L_AR**: next-token cross-entropy on the clean stream against the fixed-point tokens (AR targets),
  averaged over the sample's AR positions.

* **L_anchor** (optional, ``anchor_weight > 0``; not in the paper): ordinary next-token cross-entropy
  on *real* corpus text carried as extra causal rows of the same microbatch, averaged over the
  microbatch's anchor tokens (:func:`anchor_term`). It keeps the self-distillation on the model's own
  greedy outputs from drifting away from real text. Then ``L = pc_weight L_pc + ar_weight L_AR +
  anchor_weight L_anchor``.

Each sample contributes ``pc_weight * L_pc + ar_weight * L_AR`` (plus ``anchor_weight * L_anchor``, the
microbatch's anchor mean, per sample); a microbatch returns the **sum over
its samples** and the number of samples, which is megatron-core's ``(loss, num_tokens, report)``
contract with "tokens" = samples, so the schedule's division gives the mean over samples.

Weights (defaults, with sources):

* ``pc_weight = 1``, ``ar_weight = 1``: the paper writes ``L = L_pc + w L_AR`` (Eq. 9) with ``w`` a
  hyper-parameter; its value could not be verified here (only the abstract was readable), so ``w = 1``
  is used, as in the project's first tiny prototype.
* The reference code uses ``ar_weight = 10`` and divides the consistency loss by ``T`` (the number of
  blocks) after a mean over positions: ``--ar-weight 10 --pc-normalization reference
  --consistency-loss soft_ce`` reproduces it (the official total loss: ``10 CE_AR + (1/T) softCE_pc``).

Tensor parallelism: logits are vocab-parallel (``[..., V_pad / tp]`` on each TP rank, rank ``r`` holding
columns ``[r V_local, (r+1) V_local)``). Softmax statistics (max, sum of exp) and the per-row sums are
all-reduced over the TP group; the columns ``>= vocab_size`` (padding of the vocabulary to a multiple
of ``tp``) are excluded. Every TP rank returns the same loss value and the gradient of its own shard.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_jf.training.config import CONSISTENCY_LOSSES, JFObjective

__all__ = [
    "IGNORE_INDEX",
    "JFLossInputs",
    "vocab_shard_range",
    "mask_vocab_padding",
    "vocab_parallel_divergence",
    "vocab_parallel_ce",
    "vocab_parallel_argmax",
    "jf_loss",
    "ar_loss",
    "anchor_term",
    "METRIC_KEYS",
    "ANCHOR_METRIC",
    "DEFAULT_LOSS_CHUNK",
    "fused_head_loss",
    "jf_head_loss",
    "loss_temporary_bytes",
]

IGNORE_INDEX = -100
#: Keys of the report dict returned by :func:`jf_loss` / :func:`ar_loss`; each value is a float64
#: tensor ``[2] = (sum, count)`` so that microbatches and data-parallel ranks reduce by summing.
METRIC_KEYS = ("loss", "pc loss", "ar loss", "noisy acc")
#: Report key of the anchor term (present only in reports of microbatches that carry anchor rows).
ANCHOR_METRIC = "anchor loss"


# ----------------------------------------------------------------------------- TP helpers
def _tp():
    """(group, rank, size) of the tensor-parallel group; (None, 0, 1) when not initialised."""
    try:
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized():
            return (ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank(),
                    ps.get_tensor_model_parallel_world_size())
    except ImportError:  # pragma: no cover - megatron is a hard dependency
        pass
    return None, 0, 1


def _all_reduce(x: torch.Tensor, op, group, size: int) -> torch.Tensor:
    if size > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


def vocab_shard_range(local_width: int, vocab_size: int | None) -> tuple[int, int]:
    """``(start, n_valid)``: the first global vocabulary id of this TP rank's shard and how many of
    its ``local_width`` columns are real tokens (the rest is padding, ids ``>= vocab_size``).

    Raises:
        ValueError: this rank's shard holds no real token (a vocabulary smaller than the TP padding).
    """
    _, rank, _ = _tp()
    start = rank * local_width
    if vocab_size is None:
        return start, local_width
    n_valid = max(0, min(local_width, vocab_size - start))
    if n_valid == 0:
        raise ValueError(f"TP rank {rank} holds only vocabulary padding (vocab {vocab_size}, shard width {local_width})")
    return start, n_valid


def mask_vocab_padding(logits: torch.Tensor, vocab_size: int | None) -> torch.Tensor:
    """A float32 copy of vocab-parallel ``logits [..., V_local]`` with padding columns set to ``-inf``.

    Always returns a new tensor (megatron's cross-entropy works in place on its input).
    """
    start, n_valid = vocab_shard_range(logits.shape[-1], vocab_size)
    out = logits.float()
    out = out.clone() if out is logits else out
    if n_valid < logits.shape[-1]:
        out[..., n_valid:] = float("-inf")
    return out


# ----------------------------------------------------------------------------- divergence
class _VocabParallelDivergence(torch.autograd.Function):
    """Per-row ``tau^2 * D(softmax(t/tau) || softmax(s/tau))`` over vocab-parallel shards (see
    :func:`vocab_parallel_divergence`); gradient w.r.t. the student only."""

    @staticmethod
    def forward(ctx, student, teacher, n_valid, temperature, with_entropy, group, size):
        width = student.shape[-1]
        s = student[..., :n_valid].float() / temperature
        t = teacher[..., :n_valid].float() / temperature
        # student log-softmax with TP-reduced max and sum-exp
        s_max = _all_reduce(s.amax(dim=-1), dist.ReduceOp.MAX, group, size)
        s = s - s_max.unsqueeze(-1)
        s_sum = _all_reduce(s.exp().sum(dim=-1), dist.ReduceOp.SUM, group, size)
        log_q = s - s_sum.log().unsqueeze(-1)
        del s
        # teacher
        t_max = _all_reduce(t.amax(dim=-1), dist.ReduceOp.MAX, group, size)
        t = t - t_max.unsqueeze(-1)
        t_sum = _all_reduce(t.exp().sum(dim=-1), dist.ReduceOp.SUM, group, size)
        log_p = t - t_sum.log().unsqueeze(-1)
        del t
        p = log_p.exp()
        # all logits are finite here (padding is sliced off), so p * log(.) never hits 0 * inf
        integrand = p * (log_p - log_q) if with_entropy else -(p * log_q)
        value = _all_reduce(integrand.sum(dim=-1), dist.ReduceOp.SUM, group, size)
        grad = log_q.exp_().sub_(p)  # d value / d (s / tau) = q - p
        ctx.save_for_backward(grad)
        ctx.width = width
        ctx.temperature = temperature
        ctx.dtype = student.dtype
        return value * temperature**2

    @staticmethod
    def backward(ctx, grad_out):
        (grad,) = ctx.saved_tensors
        # d(tau^2 D)/ds = tau^2 * (q - p) / tau = tau * (q - p)
        g = grad * (grad_out.unsqueeze(-1) * ctx.temperature)
        if g.shape[-1] < ctx.width:
            g = torch.nn.functional.pad(g, (0, ctx.width - g.shape[-1]))
        return g.to(ctx.dtype), None, None, None, None, None, None


def vocab_parallel_divergence(student: torch.Tensor, teacher: torch.Tensor, *, vocab_size: int | None = None,
                              temperature: float = 1.0, kind: str = "kl") -> torch.Tensor:
    """Per-row divergence of the student from the teacher over a vocab-parallel vocabulary.

    ``kind="kl"``: ``tau^2 KL(p_t || p_s)``; ``kind="soft_ce"``: ``-tau^2 sum_v p_t log p_s``, where
    ``p_t = softmax(teacher / tau)`` and ``p_s = softmax(student / tau)`` over the **full** vocabulary
    (max and sum-exp all-reduced over the TP group, padding columns ``>= vocab_size`` excluded).
    The teacher receives no gradient (stop-gradient, paper Eq. 8).

    Args:
        student: float ``[C, V_local]`` vocab-parallel logits (any float dtype; computed in fp32).
        teacher: float ``[C, V_local]`` logits; detached internally.
        vocab_size: the real vocabulary size (``None``: no padding).
        temperature: ``tau > 0``.
        kind: ``"kl"`` or ``"soft_ce"``.

    Returns:
        float32 ``[C]``, identical on every TP rank.

    Raises:
        ValueError: shape mismatch, unknown kind, or a shard holding only padding.
    """
    if student.shape != teacher.shape or student.dim() != 2:
        raise ValueError(f"student {tuple(student.shape)} and teacher {tuple(teacher.shape)} must both be [C, V_local]")
    if kind not in ("kl", "soft_ce"):
        raise ValueError(f"kind must be 'kl' or 'soft_ce', got {kind!r}")
    group, _, size = _tp()
    _, n_valid = vocab_shard_range(student.shape[-1], vocab_size)
    if student.shape[0] == 0:
        return student.new_zeros(0, dtype=torch.float32) + 0.0 * student.sum()
    return _VocabParallelDivergence.apply(student, teacher.detach(), n_valid, float(temperature), kind == "kl",
                                          group, size)


def vocab_parallel_ce(logits: torch.Tensor, targets: torch.Tensor, *, vocab_size: int | None = None) -> torch.Tensor:
    """Per-row cross-entropy ``[M]`` (fp32) of vocab-parallel ``logits [M, V_local]`` against global
    token ids ``targets [M]`` (int64), via megatron-core's ``vocab_parallel_cross_entropy``; padding
    columns are masked to ``-inf`` first.

    Raises:
        ValueError: a target outside ``[0, vocab_size)`` or a shape mismatch.
    """
    from megatron.core import tensor_parallel

    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(f"logits {tuple(logits.shape)} must be [M, V_local] and targets {tuple(targets.shape)} [M]")
    if targets.numel() == 0:
        return logits.new_zeros(0, dtype=torch.float32) + 0.0 * logits.sum()
    return tensor_parallel.vocab_parallel_cross_entropy(mask_vocab_padding(logits, vocab_size), targets)


@torch.no_grad()
def vocab_parallel_argmax(logits: torch.Tensor, *, vocab_size: int | None = None) -> torch.Tensor:
    """Global argmax ids ``[C]`` (int64) of vocab-parallel ``logits [C, V_local]`` (padding excluded;
    ties go to the smallest id, as ``torch.argmax``)."""
    group, _, size = _tp()
    start, n_valid = vocab_shard_range(logits.shape[-1], vocab_size)
    vals, idx = logits[..., :n_valid].float().max(dim=-1)
    if size == 1 or logits.shape[0] == 0:
        return idx + start
    gmax = _all_reduce(vals.clone(), dist.ReduceOp.MAX, group, size)
    big = torch.iinfo(torch.int64).max
    cand = torch.where(vals == gmax, idx + start, torch.full_like(idx, big))
    return _all_reduce(cand, dist.ReduceOp.MIN, group, size)


# ----------------------------------------------------------------------------- JF loss
@dataclass
class JFLossInputs:
    """Logits gathered at the loss positions of one microbatch (built by
    :func:`megatron_jf.training.attention_paths.gather_jf_logits`).

    Shapes: ``C`` consistency pairs, ``M`` AR positions, ``B`` samples, ``V_local`` vocab shard width.

    Attributes:
        student_logits: float ``[C, V_local]``: logits at the noisy positions (gradient flows).
        teacher_logits: float ``[C, V_local]``: logits at the paired clean positions, detached.
        pc_targets: int64 ``[C]``: the fixed-point token both positions predict (for ``"hard"`` and accuracy).
        pair_sample: int64 ``[C]``: sample index in ``[0, B)`` of each pair.
        pair_block: int64 ``[C]``: block index within its sample.
        ar_logits: float ``[M, V_local]``: logits at clean-stream positions that have an AR target.
        ar_targets: int64 ``[M]``: the next fixed-point token.
        ar_sample: int64 ``[M]``: sample index of each AR position.
        num_blocks: int64 ``[B]``: blocks per sample (``N`` of paper Eq. 8), each >= 1.
        vocab_size: real vocabulary size (columns beyond it are padding).
        max_blocks: ``max(num_blocks)`` if known on the host (avoids a device sync); else computed.
    """

    student_logits: torch.Tensor
    teacher_logits: torch.Tensor
    pc_targets: torch.Tensor
    pair_sample: torch.Tensor
    pair_block: torch.Tensor
    ar_logits: torch.Tensor
    ar_targets: torch.Tensor
    ar_sample: torch.Tensor
    num_blocks: torch.Tensor
    vocab_size: int | None = None
    max_blocks: int | None = None

    @property
    def num_samples(self) -> int:
        return int(self.num_blocks.shape[0])


def _metric(total: torch.Tensor, count) -> torch.Tensor:
    t = total.detach().double().reshape(())
    return torch.stack([t, torch.as_tensor(count, dtype=torch.float64, device=t.device).reshape(())])


def jf_loss(inp: JFLossInputs, cfg: JFObjective) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Jacobi Forcing loss of one microbatch (paper Eq. 8-9; see the module docstring).

    Returns:
        ``(loss_sum, report)``: ``loss_sum`` is a float32 scalar, the **sum over samples** of
        ``pc_weight * L_pc + ar_weight * L_AR`` (differentiable w.r.t. student and AR logits only);
        ``report`` maps each of :data:`METRIC_KEYS` to a float64 ``[2]`` tensor ``(sum, count)``:
        ``loss``/``pc loss``/``ar loss`` summed over samples with count ``B``, and ``noisy acc`` =
        (number of noisy positions whose argmax equals the fixed-point token, number of pairs).

    Raises:
        ValueError: inconsistent shapes or out-of-range sample/block indices.
    """
    B = inp.num_samples
    C = int(inp.pc_targets.shape[0])
    M = int(inp.ar_targets.shape[0])
    dev = inp.ar_logits.device
    if inp.student_logits.shape[0] != C or inp.pair_sample.shape[0] != C or inp.pair_block.shape[0] != C:
        raise ValueError("student/teacher logits, pc_targets, pair_sample and pair_block must all have C rows")
    if inp.ar_logits.shape[0] != M or inp.ar_sample.shape[0] != M:
        raise ValueError("ar_logits, ar_targets and ar_sample must all have M rows")
    nb = inp.num_blocks.to(dev)
    if B == 0:
        raise ValueError("empty microbatch (no samples)")

    # ---- consistency term (paper Eq. 8)
    if cfg.consistency_loss == "hard":
        per_pair = vocab_parallel_ce(inp.student_logits, inp.pc_targets, vocab_size=inp.vocab_size)
    else:
        per_pair = vocab_parallel_divergence(inp.student_logits, inp.teacher_logits, vocab_size=inp.vocab_size,
                                             temperature=cfg.kl_temperature, kind=cfg.consistency_loss)
    zeros_b = torch.zeros(B, dtype=torch.float32, device=dev)
    if C:
        if cfg.pc_normalization == "paper":
            max_n = inp.max_blocks if inp.max_blocks is not None else int(nb.max())
            key = inp.pair_sample * max_n + inp.pair_block
            blk_sum = torch.zeros(B * max_n, dtype=torch.float32, device=dev).index_add(0, key, per_pair)
            blk_cnt = torch.zeros(B * max_n, dtype=torch.float32, device=dev).index_add(
                0, key, torch.ones_like(per_pair))
            blk_mean = blk_sum / blk_cnt.clamp(min=1)
            pc_sample = blk_mean.view(B, max_n).sum(dim=1) / nb
        else:  # reference: mean over kept positions, then / number of blocks
            s_sum = zeros_b.index_add(0, inp.pair_sample, per_pair)
            s_cnt = zeros_b.index_add(0, inp.pair_sample, torch.ones_like(per_pair))
            pc_sample = s_sum / s_cnt.clamp(min=1) / nb
    else:
        pc_sample = zeros_b + 0.0 * per_pair.sum()

    # ---- AR term
    per_tok = vocab_parallel_ce(inp.ar_logits, inp.ar_targets, vocab_size=inp.vocab_size)
    if M:
        a_sum = zeros_b.index_add(0, inp.ar_sample, per_tok)
        a_cnt = zeros_b.index_add(0, inp.ar_sample, torch.ones_like(per_tok))
        ar_sample = a_sum / a_cnt.clamp(min=1)
    else:
        ar_sample = zeros_b + 0.0 * per_tok.sum()

    total = cfg.pc_weight * pc_sample + cfg.ar_weight * ar_sample
    loss_sum = total.sum()
    correct = (vocab_parallel_argmax(inp.student_logits, vocab_size=inp.vocab_size) == inp.pc_targets).sum()
    report = {
        "loss": _metric(loss_sum, B),
        "pc loss": _metric(pc_sample.sum(), B),
        "ar loss": _metric(ar_sample.sum(), B),
        "noisy acc": _metric(correct, C),
    }
    return loss_sum, report


def ar_loss(logits: torch.Tensor, labels: torch.Tensor, *, vocab_size: int | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Plain next-token loss (``--objective ar``): cross-entropy summed over labelled tokens.

    Args:
        logits: float ``[b, s, V_local]`` vocab-parallel logits.
        labels: int64 ``[b, s]`` next-token ids, :data:`IGNORE_INDEX` where unlabelled.

    Returns:
        ``(loss_sum, num_tokens, report)`` -- megatron-core's loss-function contract (the schedule
        divides by ``num_tokens``); ``report`` has the keys of :data:`METRIC_KEYS` (``pc loss`` and
        ``noisy acc`` are zero with zero count).
    """
    if logits.shape[:2] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree")
    flat = logits.reshape(-1, logits.shape[-1])
    lab = labels.reshape(-1)
    keep = torch.nonzero(lab != IGNORE_INDEX).flatten()
    per_tok = vocab_parallel_ce(flat[keep], lab[keep], vocab_size=vocab_size)
    loss_sum = per_tok.sum()
    n = int(keep.numel())
    zero = torch.zeros((), dtype=torch.float64)
    report = {
        "loss": _metric(loss_sum, n),
        "pc loss": _metric(zero, 0),
        "ar loss": _metric(loss_sum, n),
        "noisy acc": _metric(zero, 0),
    }
    return loss_sum, torch.tensor(n, dtype=torch.int), report


def anchor_term(anchor_logits: torch.Tensor, anchor_targets: torch.Tensor, num_samples: int, *, weight: float,
                vocab_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The anchor term of one JF microbatch: next-token CE on real-text rows.

    ``L_anchor`` is the mean (nats per token) of the vocab-parallel cross-entropy over the microbatch's
    ``K`` anchor tokens. Since a JF microbatch's loss is a **sum over its ``B`` samples** (the schedule
    divides by ``B``), the term is added as ``weight * B * L_anchor``, so the step minimises
    ``mean_b(pc_weight L_pc + ar_weight L_AR) + weight * L_anchor``.

    Args:
        anchor_logits: float ``[K, V_local]`` vocab-parallel logits at the anchor positions (gradient flows).
        anchor_targets: int64 ``[K]`` next-token ids.
        num_samples: ``B``, the JF samples of the microbatch (>= 1).
        weight: ``anchor_weight`` (>= 0).
        vocab_size: real vocabulary size (padding columns excluded).

    Returns:
        ``(loss_add, metric)``: the float32 scalar ``weight * B * L_anchor`` to add to the JF loss sum,
        and the report value ``(B * L_anchor, B)`` (float64 ``[2]``) for :data:`ANCHOR_METRIC`, so that
        the reduced report gives ``loss = pc_weight L_pc + ar_weight L_AR + weight L_anchor`` exactly.

    Raises:
        ValueError: ``K == 0``, ``B < 1``, negative weight, or shape / target errors of :func:`vocab_parallel_ce`.
    """
    if anchor_targets.numel() == 0:
        raise ValueError("the anchor rows have no labelled token")
    if num_samples < 1 or weight < 0:
        raise ValueError(f"need num_samples >= 1 and weight >= 0, got {num_samples}, {weight}")
    mean = vocab_parallel_ce(anchor_logits, anchor_targets, vocab_size=vocab_size).mean()
    return (weight * num_samples) * mean, _metric(mean * num_samples, num_samples)



# ----------------------------------------------------------------------------- output layer + loss, chunked
#: Default ``--loss-chunk-size`` (:attr:`JFObjective.loss_chunk_size`): loss rows per chunk of the fused output
#: layer + loss.
DEFAULT_LOSS_CHUNK = JFObjective.loss_chunk_size

#: Upper bound of the fp32 ``[chunk, V_local]`` buffers alive at the peak of one chunk of :func:`fused_head_loss`
#: (student and teacher logits, the teacher distribution ``p``, one ``exp`` temporary; the gradient reuses
#: the student buffer). Measured with torch's profiler (:mod:`megatron_jf.training.memstats`), CPU fp32:
#: 2.5 (``kl``), 3.5 (``soft_ce``), 1.5 (``hard``); bf16 logits add half a buffer before the fp32 cast.
#: Checked in ``tests/test_loss_rows.py``.
LOSS_CHUNK_BUFFERS = 4


def loss_temporary_bytes(rows: int, v_local: int, chunk: int | None = DEFAULT_LOSS_CHUNK, *,
                         hidden: int = 0, dtype_bytes: int = 4) -> int:
    """Peak temporary bytes of the fused output layer + JF loss (:func:`fused_head_loss`) on one rank.

    Each chunk holds at most :data:`LOSS_CHUNK_BUFFERS` fp32 ``[min(rows, chunk), v_local]`` buffers; on
    top of them the function keeps, from its forward to its backward, the gradient of the output weight
    (fp32 ``[v_local, hidden]``) and of the loss rows (``[rows, hidden]``). The gathered loss rows
    themselves (``[rows, hidden]``, model dtype) are the model's output.

    Args:
        rows: loss rows of one microbatch (``2C + M + K``: student, teacher, AR and anchor positions).
        v_local: vocabulary columns on this TP rank (``V_pad / tp``).
        chunk: rows per chunk (``--loss-chunk-size``); ``None`` or ``0``: one chunk of all rows.
        hidden: the hidden size ``h`` (0 counts the ``[chunk, V_local]`` buffers only).
        dtype_bytes: bytes per element of the model dtype (2 for bf16).

    Returns:
        bytes (int).

    Example: Qwen2.5-7B at TP=2 (``v_local = 76032``, ``h = 3584``), chunk 1024:
    ``4 * 1024 * 76032 * 4`` = 1.25 GB of chunk buffers + 1.09 GB weight gradient, whatever the length
    (the full-row path held ~6 ``[rows, V_local]`` fp32 tensors: ~5 GB each at 16k loss rows).
    """
    c = rows if not chunk else min(rows, chunk)
    return (LOSS_CHUNK_BUFFERS * c * v_local * 4 + (v_local * hidden * 4 if hidden else 0)
            + rows * hidden * dtype_bytes)


def _chunk_lse(z: torch.Tensor, group, size: int) -> torch.Tensor:
    """In place: ``z -= max`` (TP max); returns the TP log-sum-exp ``[c]`` of the shifted ``z``."""
    m = _all_reduce(z.amax(dim=-1), dist.ReduceOp.MAX, group, size)
    z.sub_(m.unsqueeze(-1))
    return _all_reduce(torch.exp(z).sum(dim=-1), dist.ReduceOp.SUM, group, size).log_()


def _chunk_ce(z: torch.Tensor, targets: torch.Tensor, start: int, group, size: int, want_grad: bool):
    """Vocab-parallel CE of fp32 logits ``z [c, n_valid]`` (consumed) against global ids ``targets [c]``.

    Returns ``(ce [c], grad [c, n_valid] = softmax - onehot or None)``."""
    lse = _chunk_lse(z, group, size)
    local = targets - start
    inside = (local >= 0) & (local < z.shape[-1])
    local = local.clamp(0, z.shape[-1] - 1)
    picked = torch.where(inside, z.gather(1, local.unsqueeze(1)).squeeze(1), torch.zeros_like(lse))
    picked = _all_reduce(picked, dist.ReduceOp.SUM, group, size)
    ce = lse - picked
    if not want_grad:
        return ce, None
    grad = z.sub_(lse.unsqueeze(-1)).exp_()
    rows = torch.nonzero(inside).flatten()
    grad[rows, local[rows]] -= 1.0
    return ce, grad


class _FusedHeadLoss(torch.autograd.Function):
    """Output layer + JF loss over row chunks; the gradients are formed chunk by chunk in the forward
    (the loss is linear in the per-row values, with coefficients known in the forward), so no
    ``[rows, V_local]`` tensor ever exists and the backward is two scalings. See :func:`fused_head_loss`."""

    @staticmethod
    def forward(ctx, hidden, weight, pc_coef, ce_coef, pc_targets, ce_targets, num_pairs, kind, temperature,
                start, n_valid, chunk, want_grad, group, size):
        C = num_pairs
        M = ce_targets.shape[0]
        dt = weight.dtype
        w_valid = weight[:n_valid]
        grad_h = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if want_grad else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_grad else None
        pc_vals = hidden.new_zeros(C, dtype=torch.float32)
        ce_vals = hidden.new_zeros(M, dtype=torch.float32)
        correct = torch.zeros(C, dtype=torch.bool, device=hidden.device)
        total = hidden.new_zeros((), dtype=torch.float32)
        tau = temperature

        def accumulate(g, rows_lo, rows_hi, coef):
            # g: fp32 [c, n_valid] d value / d logits per row; scaled by the rows' loss coefficients
            g.mul_(coef.unsqueeze(-1))
            h = hidden[rows_lo:rows_hi]
            grad_h[rows_lo:rows_hi] += (g.to(dt) @ w_valid).float()
            grad_w[:n_valid].addmm_(g.t(), h.float())

        for lo in range(0, C, chunk):
            hi = min(C, lo + chunk)
            zs = (hidden[lo:hi] @ w_valid.t()).float()
            correct[lo:hi] = _argmax_shifted(zs, start, group, size) == pc_targets[lo:hi]
            if kind == "hard":
                vals, g = _chunk_ce(zs, pc_targets[lo:hi], start, group, size, want_grad)
            else:
                zt = (hidden[C + lo:C + hi] @ w_valid.t()).float()
                if tau != 1.0:
                    zs.div_(tau)
                    zt.div_(tau)
                zs.sub_(_chunk_lse(zs, group, size).unsqueeze(-1))  # log q
                zt.sub_(_chunk_lse(zt, group, size).unsqueeze(-1))  # log p
                p = torch.exp(zt)
                integrand = zt.sub_(zs).mul_(p) if kind == "kl" else zs.mul(p).neg_()  # zt reused
                vals = _all_reduce(integrand.sum(dim=-1), dist.ReduceOp.SUM, group, size) * tau**2
                del integrand, zt
                g = zs.exp_().sub_(p).mul_(tau) if want_grad else None  # d(tau^2 D)/dz = tau (q - p)
                del p
            pc_vals[lo:hi] = vals
            total = total + (vals * pc_coef[lo:hi]).sum()
            if want_grad:
                accumulate(g, lo, hi, pc_coef[lo:hi])
            del zs, g
        base = C if kind == "hard" else 2 * C
        for lo in range(0, M, chunk):
            hi = min(M, lo + chunk)
            z = (hidden[base + lo:base + hi] @ w_valid.t()).float()
            vals, g = _chunk_ce(z, ce_targets[lo:hi], start, group, size, want_grad)
            ce_vals[lo:hi] = vals
            total = total + (vals * ce_coef[lo:hi]).sum()
            if want_grad:
                accumulate(g, base + lo, base + hi, ce_coef[lo:hi])
            del z, g
        if want_grad:
            ctx.save_for_backward(grad_h, grad_w)
        ctx.dtypes = (hidden.dtype, weight.dtype)
        ctx.mark_non_differentiable(pc_vals, ce_vals, correct)
        return total, pc_vals, ce_vals, correct

    @staticmethod
    def backward(ctx, grad_total, *_):
        grad_h, grad_w = ctx.saved_tensors
        return ((grad_h * grad_total).to(ctx.dtypes[0]), (grad_w * grad_total).to(ctx.dtypes[1]),
                None, None, None, None, None, None, None, None, None, None, None, None, None)


def _argmax_shifted(z: torch.Tensor, start: int, group, size: int) -> torch.Tensor:
    """Global argmax ids of fp32 logits ``z [c, n_valid]`` of the shard starting at ``start``."""
    vals, idx = z.max(dim=-1)
    if size == 1 or z.shape[0] == 0:
        return idx + start
    gmax = _all_reduce(vals.clone(), dist.ReduceOp.MAX, group, size)
    cand = torch.where(vals == gmax, idx + start, torch.full_like(idx, torch.iinfo(torch.int64).max))
    return _all_reduce(cand, dist.ReduceOp.MIN, group, size)


def fused_head_loss(hidden: torch.Tensor, weight: torch.Tensor, *, num_pairs: int, pc_coef: torch.Tensor,
                    ce_coef: torch.Tensor, pc_targets: torch.Tensor, ce_targets: torch.Tensor, kind: str = "kl",
                    temperature: float = 1.0, vocab_size: int | None = None,
                    chunk_size: int | None = DEFAULT_LOSS_CHUNK):
    """The vocab-parallel output layer and the JF loss terms over the loss rows, in row chunks.

    ``hidden`` holds the final-norm hidden states of the loss rows in a fixed order: the ``C`` student
    (noisy) rows, then (``kind != "hard"``) the ``C`` teacher (clean) rows of the same pairs, then the
    ``M`` cross-entropy rows (AR positions, then anchor positions). Chunk by chunk (``chunk_size`` rows)
    the logits ``hidden @ weight.T`` of this TP rank's vocabulary shard are formed, the per-row values
    computed (max / sum-exp / target logit all-reduced over the TP group, padding columns ``>= vocab_size``
    excluded) and, when a gradient is needed, the gradient of ``sum(coef * value)`` w.r.t. ``hidden`` and
    ``weight`` accumulated -- so peak temporary memory is ``O(chunk x V_local)``
    (:func:`loss_temporary_bytes`) instead of ``O(rows x V_local)``, and the logits are formed once.

    Per-row values: ``"kl"``/``"soft_ce"``: ``tau^2 D(p_teacher || p_student)`` (paper Eq. 8, teacher
    stop-gradient, as :func:`vocab_parallel_divergence`); ``"hard"``: CE of the student against
    ``pc_targets``; CE rows: next-token CE against ``ce_targets`` (as :func:`vocab_parallel_ce`).

    Args:
        hidden: float ``[2C + M, h]`` (``[C + M, h]`` for ``"hard"``), identical on every TP rank.
        weight: float ``[V_local, h]``, the output layer's (or tied embedding's) weight shard.
        num_pairs: ``C``.
        pc_coef: float32 ``[C]`` loss coefficient of each pair's value; ce_coef: float32 ``[M]``.
        pc_targets: int64 ``[C]`` fixed-point ids (``"hard"`` targets and accuracy); ce_targets: int64 ``[M]``.
        kind: ``"kl"`` | ``"soft_ce"`` | ``"hard"``; temperature: ``tau > 0``.
        vocab_size: the real vocabulary size; chunk_size: rows per chunk (``None``/``0``: one chunk).

    Returns:
        ``(loss, pc_values, ce_values, correct)``: float32 scalar ``sum(pc_coef * pc_values) +
        sum(ce_coef * ce_values)`` (differentiable w.r.t. ``hidden`` and ``weight``; the gradient is
        exact for any scalar upstream gradient), float32 ``[C]`` and ``[M]`` per-row values and bool
        ``[C]`` (student argmax == ``pc_targets``), all three detached.

    Raises:
        ValueError: shapes that do not match, an unknown kind, a chunk size < 0, a shard of padding only.
    """
    if kind not in CONSISTENCY_LOSSES:
        raise ValueError(f"unknown consistency loss {kind!r}; expected one of {CONSISTENCY_LOSSES}")
    C, M = int(num_pairs), int(ce_targets.shape[0])
    need = (C if kind == "hard" else 2 * C) + M
    if hidden.dim() != 2 or hidden.shape[0] != need or weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"hidden {tuple(hidden.shape)} must be [{need}, h] for {C} pairs ({kind}) and {M} CE rows, "
                         f"weight {tuple(weight.shape)} [V_local, h]")
    if pc_coef.shape != (C,) or pc_targets.shape != (C,) or ce_coef.shape != (M,):
        raise ValueError("pc_coef / pc_targets must be [C] and ce_coef [M]")
    if chunk_size is not None and chunk_size < 0:
        raise ValueError(f"chunk size must be >= 0, got {chunk_size}")
    group, _, size = _tp()
    start, n_valid = vocab_shard_range(weight.shape[0], vocab_size)
    chunk = max(1, chunk_size or max(C, M, 1))
    want_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return _FusedHeadLoss.apply(hidden, weight, pc_coef.float(), ce_coef.float(), pc_targets, ce_targets, C, kind,
                                float(temperature), start, n_valid, chunk, want_grad, group, size)


def jf_head_loss(hidden: torch.Tensor, weight: torch.Tensor, *, pc_targets: torch.Tensor, pair_sample: torch.Tensor,
                 pair_block: torch.Tensor, ar_targets: torch.Tensor, ar_sample: torch.Tensor,
                 num_blocks: torch.Tensor, cfg: JFObjective, vocab_size: int | None = None,
                 max_blocks: int | None = None, anchor_targets: torch.Tensor | None = None,
                 chunk_size: int | None = DEFAULT_LOSS_CHUNK) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`jf_loss` (plus :func:`anchor_term` when anchor rows are given) computed from the hidden
    states of the loss rows through :func:`fused_head_loss` -- same value, same gradients, bounded memory.

    The normalisation of paper Eq. 8 (per block / per sample means, ``1/N``) and the AR / anchor means
    are linear in the per-row values, so each row gets its coefficient up front (from the indices only).

    Args:
        hidden: float ``[2C + M + K, h]`` (``[C + M + K, h]`` for ``"hard"``): student rows, teacher rows,
            AR rows, anchor rows (the order of :func:`megatron_jf.training.output_head.loss_row_index`).
        weight: float ``[V_local, h]`` output weight shard.
        pc_targets, pair_sample, pair_block: int64 ``[C]``; ar_targets, ar_sample: int64 ``[M]``;
        num_blocks: int64 ``[B]``; anchor_targets: int64 ``[K]`` or ``None`` -- as in :class:`JFLossInputs`.
        cfg: the loss configuration; vocab_size, max_blocks: as in :class:`JFLossInputs`.
        chunk_size: rows per chunk (``--loss-chunk-size``).

    Returns:
        ``(loss_sum, report)`` as :func:`jf_loss`; with anchor rows ``loss_sum`` includes
        ``anchor_weight * B * L_anchor`` and ``report`` has :data:`ANCHOR_METRIC` (as ``pretrain_jf.loss_func``).

    Raises:
        ValueError: inconsistent shapes, an empty microbatch, anchor rows without labelled tokens.
    """
    B = int(num_blocks.shape[0])
    C, M = int(pc_targets.shape[0]), int(ar_targets.shape[0])
    if B == 0:
        raise ValueError("empty microbatch (no samples)")
    if pair_sample.shape[0] != C or pair_block.shape[0] != C or ar_sample.shape[0] != M:
        raise ValueError("pc_targets, pair_sample and pair_block must have C rows; ar_targets and ar_sample M rows")
    dev = hidden.device
    nb = num_blocks.to(dev).float()
    ones_c = torch.ones(C, dtype=torch.float32, device=dev)
    if cfg.pc_normalization == "paper":
        max_n = max_blocks if max_blocks is not None else int(num_blocks.max())
        key = pair_sample * max_n + pair_block
        blk_cnt = torch.zeros(B * max_n, dtype=torch.float32, device=dev).index_add(0, key, ones_c)
        pc_unit = 1.0 / (blk_cnt[key] * nb[pair_sample])
    else:
        s_cnt = torch.zeros(B, dtype=torch.float32, device=dev).index_add(0, pair_sample, ones_c)
        pc_unit = 1.0 / (s_cnt[pair_sample] * nb[pair_sample])
    a_cnt = torch.zeros(B, dtype=torch.float32, device=dev).index_add(0, ar_sample, torch.ones(M, device=dev))
    ar_unit = 1.0 / a_cnt[ar_sample]
    ce_targets, ce_coef = ar_targets, cfg.ar_weight * ar_unit
    K = 0
    if anchor_targets is not None:
        K = int(anchor_targets.shape[0])
        if K == 0:
            raise ValueError("the anchor rows have no labelled token")
        ce_targets = torch.cat([ar_targets, anchor_targets])
        ce_coef = torch.cat([ce_coef, torch.full((K,), cfg.anchor_weight * B / K, device=dev)])
    loss_sum, pc_vals, ce_vals, correct = fused_head_loss(
        hidden, weight, num_pairs=C, pc_coef=cfg.pc_weight * pc_unit, ce_coef=ce_coef, pc_targets=pc_targets,
        ce_targets=ce_targets, kind=cfg.consistency_loss, temperature=cfg.kl_temperature, vocab_size=vocab_size,
        chunk_size=chunk_size)
    zeros_b = torch.zeros(B, dtype=torch.float32, device=dev)
    pc_sample = zeros_b.index_add(0, pair_sample, pc_vals * pc_unit)
    ar_sample_v = zeros_b.index_add(0, ar_sample, ce_vals[:M] * ar_unit)
    report = {
        "loss": _metric(loss_sum, B),
        "pc loss": _metric(pc_sample.sum(), B),
        "ar loss": _metric(ar_sample_v.sum(), B),
        "noisy acc": _metric(correct.sum(), C),
    }
    if K:
        mean = ce_vals[M:].mean()
        report[ANCHOR_METRIC] = _metric(mean * B, B)
    return loss_sum, report
