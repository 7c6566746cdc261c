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
  is used, as in our tiny prototype (``shared/research/jf_tiny_proto.md``).
* The reference code uses ``ar_weight = 10`` and divides the consistency loss by ``T`` (the number of
  blocks) after a mean over positions: ``--ar-weight 10 --pc-normalization reference
  --consistency-loss soft_ce`` reproduces it (``shared/research/jf_reference.md`` Sec. 6.3).

Tensor parallelism: logits are vocab-parallel (``[..., V_pad / tp]`` on each TP rank, rank ``r`` holding
columns ``[r V_local, (r+1) V_local)``). Softmax statistics (max, sum of exp) and the per-row sums are
all-reduced over the TP group; the columns ``>= vocab_size`` (padding of the vocabulary to a multiple
of ``tp``) are excluded. Every TP rank returns the same loss value and the gradient of its own shard.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = [
    "IGNORE_INDEX",
    "CONSISTENCY_LOSSES",
    "PC_NORMALIZATIONS",
    "LossConfig",
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
]

IGNORE_INDEX = -100
CONSISTENCY_LOSSES = ("kl", "soft_ce", "hard")
PC_NORMALIZATIONS = ("paper", "reference")
#: Keys of the report dict returned by :func:`jf_loss` / :func:`ar_loss`; each value is a float64
#: tensor ``[2] = (sum, count)`` so that microbatches and data-parallel ranks reduce by summing.
METRIC_KEYS = ("loss", "pc loss", "ar loss", "noisy acc")
#: Report key of the anchor term (present only in reports of microbatches that carry anchor rows).
ANCHOR_METRIC = "anchor loss"


@dataclass(frozen=True)
class LossConfig:
    """Loss hyper-parameters (see the module docstring for the sources of the defaults).

    Attributes:
        consistency_loss: ``"kl"`` | ``"soft_ce"`` | ``"hard"``.
        temperature: softmax temperature ``tau > 0`` for ``"kl"``/``"soft_ce"``.
        pc_weight: weight of L_pc (>= 0).
        ar_weight: weight ``w`` of L_AR (>= 0).
        pc_normalization: ``"paper"`` | ``"reference"``.
        anchor_weight: weight ``lambda`` of the anchor term L_anchor (>= 0; 0 = off).

    Raises:
        ValueError: unknown loss kind or normalisation, non-positive temperature, negative weights.
    """

    consistency_loss: str = "kl"
    temperature: float = 1.0
    pc_weight: float = 1.0
    ar_weight: float = 1.0
    pc_normalization: str = "paper"
    anchor_weight: float = 0.0

    def __post_init__(self):
        if self.consistency_loss not in CONSISTENCY_LOSSES:
            raise ValueError(f"unknown consistency loss {self.consistency_loss!r}; expected one of {CONSISTENCY_LOSSES}")
        if self.pc_normalization not in PC_NORMALIZATIONS:
            raise ValueError(f"unknown pc normalization {self.pc_normalization!r}; expected one of {PC_NORMALIZATIONS}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.pc_weight < 0 or self.ar_weight < 0 or self.anchor_weight < 0:
            raise ValueError(f"loss weights must be >= 0, got pc_weight={self.pc_weight}, ar_weight={self.ar_weight}, "
                             f"anchor_weight={self.anchor_weight}")


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


def jf_loss(inp: JFLossInputs, cfg: LossConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
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
                                             temperature=cfg.temperature, kind=cfg.consistency_loss)
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
