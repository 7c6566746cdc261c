"""Sequence packing of Jacobi trajectories into training samples (paper Sec. 4.1, Eq. 7).

A record with prompt ``x`` (length ``P``) and blocks ``B_1..B_N`` (lengths ``n_i``, ``R = sum n_i``)
is packed into ::

    [x, noisy B_1, clean B_1, noisy B_2, clean B_2, ..., noisy B_N, clean B_N]      (length L = P + 2R)

where ``clean B_i`` is the block's fixed point and ``noisy B_i`` is the recorded draft of block
``i`` whose unconverged fraction is nearest to the schedule's target ``t_i``
(:mod:`megatron_jf.data.schedule`).

Label alignment (a frequent source of off-by-one bugs):

* ``ar_targets[j]`` is the target of the logit *at* packed position ``j`` (already shifted). The
  prompt's last token predicts ``response[0]``; the clean copy of response token ``r`` predicts
  ``response[r+1]``. The last response token (EOS if reached) has no target. Prompt tokens before
  the last and all noisy tokens have :data:`IGNORE_INDEX`.
* The consistency loss compares the logit at noisy ``(block i, offset k)`` (student) with the logit
  at clean ``(block i, offset k)`` (teacher, stop-grad) -- the *same* offset, not shifted: both predict
  response token ``ctx_i + k + 1``.
* Both copies of block ``i`` use position ids ``context_len_i + (0..n_i-1)``.

Under the noise-conditioned (``nc``) mask the packed sequence is exactly two ordinary causal
sequences sharing position ids (reference report Sec. 5.5); :func:`to_two_stream` builds that form.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .schedule import _select_from_fractions, noise_targets
from .trajectory import TrajectoryRecord

__all__ = [
    "ROLE_PROMPT",
    "ROLE_NOISY",
    "ROLE_CLEAN",
    "ROLE_PAD",
    "IGNORE_INDEX",
    "CONSISTENCY_MODES",
    "PackedSample",
    "TwoStreamSample",
    "pack_record",
    "to_two_stream",
    "from_two_stream",
    "check_packed",
    "packed_equal",
]

ROLE_PROMPT, ROLE_NOISY, ROLE_CLEAN = 0, 1, 2
#: Role of padding positions added by the collators (never produced by :func:`pack_record`).
ROLE_PAD = -1
IGNORE_INDEX = -100
CONSISTENCY_MODES = ("all", "from_first_diff")


@dataclass
class PackedSample:
    """One packed Jacobi Forcing training sequence (paper Sec. 4.1).

    Shapes: ``L = P + 2R`` packed tokens, ``N`` blocks, ``C`` consistency pairs.

    Attributes:
        tokens: int64 ``[L]``: ``[prompt, noisy B_1, clean B_1, ...]``.
        position_ids: int64 ``[L]``: prompt ``0..P-1``; both copies of block ``i`` use ``context_len_i + (0..n_i-1)``.
        roles: int64 ``[L]``: :data:`ROLE_PROMPT` / :data:`ROLE_NOISY` / :data:`ROLE_CLEAN`.
        block_ids: int64 ``[L]``: block index for noisy/clean tokens, -1 for the prompt.
        ar_targets: int64 ``[L]``: next fixed-point token at the prompt's last token and at each clean token
            that has one (EOS is a target; nothing after it); :data:`IGNORE_INDEX` elsewhere.
        consistency_pairs: int64 ``[C, 2]``: (noisy index, clean index) into ``tokens``, same block and offset,
            only where the clean position has an AR target; ordered by response position.
        noise_ratios: float32 ``[N]``: achieved unconverged fraction of each selected noisy block.
        target_ratios: float32 ``[N]``: the schedule's targets ``t_i``.
        prompt_len: ``P``.
        sample_id: the record's id.
        state_indices: int64 ``[N]``: index into each block's ``drafts`` of the selected noisy state.
    """

    tokens: torch.Tensor
    position_ids: torch.Tensor
    roles: torch.Tensor
    block_ids: torch.Tensor
    ar_targets: torch.Tensor
    consistency_pairs: torch.Tensor
    noise_ratios: torch.Tensor
    target_ratios: torch.Tensor
    prompt_len: int
    sample_id: str
    state_indices: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_blocks(self) -> int:
        """``N``."""
        return int(self.noise_ratios.shape[0])


@dataclass
class TwoStreamSample:
    """The packed sample as two causal streams sharing position ids (valid for the ``nc`` mask only).

    Shapes: ``T = P + R``.

    Attributes:
        noisy_stream: int64 ``[T]``: prompt + noisy blocks.
        clean_stream: int64 ``[T]``: prompt + clean blocks (= prompt + greedy response).
        position_ids: int64 ``[T]`` (shared by both streams).
        ar_targets: int64 ``[T]``: AR targets for the clean stream's logits (IGNORE_INDEX where none).
        consistency_mask: bool ``[T]``: student logit at ``noisy_stream[j]``, teacher at ``clean_stream[j]``.
        block_ids: int64 ``[T]``: block index, -1 for prompt positions.
        noisy_index: int64 ``[T]``: packed index of each noisy-stream position.
        clean_index: int64 ``[T]``: packed index of each clean-stream position (prompt shared with ``noisy_index``).
        noise_ratios, target_ratios: float32 ``[N]`` (copied from the packed sample).
        prompt_len: ``P``; sample_id: the record's id.
        state_indices: int64 ``[N]`` (copied).
    """

    noisy_stream: torch.Tensor
    clean_stream: torch.Tensor
    position_ids: torch.Tensor
    ar_targets: torch.Tensor
    consistency_mask: torch.Tensor
    block_ids: torch.Tensor
    noisy_index: torch.Tensor
    clean_index: torch.Tensor
    noise_ratios: torch.Tensor
    target_ratios: torch.Tensor
    prompt_len: int
    sample_id: str
    state_indices: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))

    def __len__(self) -> int:
        return int(self.clean_stream.shape[0])


def pack_record(
    record: TrajectoryRecord,
    schedule: str | torch.Tensor = "progressive",
    window_size: int = 16,
    seed: int = 0,
    consistency: str = "all",
    *,
    validate: bool = True,
    phase: int = 0,
) -> PackedSample:
    """Pack one trajectory record into ``[prompt, noisy B_1, clean B_1, ...]`` (paper Sec. 4.1, Eq. 7).

    Args:
        record: the trajectory (validated first unless ``validate=False``).
        schedule: a name from :data:`megatron_jf.data.schedule.SCHEDULES`, or an explicit float
            tensor ``[N]`` of target levels.
        window_size: ``w`` of the schedule (ignored when ``schedule`` is a tensor).
        seed: seed of the ``random`` schedule (combined with ``record.sample_id``).
        consistency: ``"all"`` -- pair every (block, offset) whose clean position has an AR target;
            ``"from_first_diff"`` -- additionally keep only offsets ``>= d_i``, the first offset where
            the noisy and clean copies of block ``i`` differ (the reference code's choice; a block whose
            noisy copy equals its fixed point then contributes no pairs).
        validate: run ``record.validate()`` first.
        phase: shift of the ``progressive`` / ``reverse`` ramp (:func:`~megatron_jf.data.schedule.noise_targets`;
            0: Eq. 7 as written).

    Returns:
        A :class:`PackedSample` (all tensors on CPU).

    Raises:
        ValueError: invalid record (see :meth:`TrajectoryRecord.validate`), unknown schedule or
            consistency mode, or a target tensor of the wrong length.
    """
    if consistency not in CONSISTENCY_MODES:
        raise ValueError(f"unknown consistency mode {consistency!r}; expected one of {CONSISTENCY_MODES}")
    if validate:
        record.validate()
    blocks = record.blocks
    N = len(blocks)
    P = record.prompt_len
    n = record.block_size
    sid = record.sample_id
    if P < 1 or N == 0:  # cheap guard for validate=False: the layout below needs both
        raise ValueError(f"sample {sid!r}: cannot pack a record with prompt length {P} and {N} blocks")

    if isinstance(schedule, torch.Tensor):
        if schedule.dim() != 1 or schedule.shape[0] != N:
            raise ValueError(f"sample {sid!r}: explicit targets have shape {tuple(schedule.shape)}, expected [{N}]")
        targets = schedule.to(torch.float64)
    else:
        targets = noise_targets(schedule, N, window_size, seed=seed, sample_id=sid, phase=phase)

    lens = torch.tensor([b.length for b in blocks], dtype=torch.int64)  # [N]
    states = torch.tensor([b.num_states for b in blocks], dtype=torch.int64)  # [N]
    R = int(lens.sum())

    # --- unconverged fraction of every recorded state, in one vectorized pass -------------------
    # Blocks shorter than n (only the last) are right-padded with -1 in both the drafts and the
    # fixed point, so padded columns never count as mismatches.
    def padded(x: torch.Tensor) -> torch.Tensor:
        return x if x.shape[-1] == n else F.pad(x, (0, n - x.shape[-1]), value=-1)

    drafts_all = torch.cat([padded(b.drafts) for b in blocks])  # [S_tot, n]
    fps = torch.stack([padded(b.fixed_point) for b in blocks])  # [N, n]
    fp_rep = fps.repeat_interleave(states, dim=0)  # [S_tot, n]
    nb_rep = lens.repeat_interleave(states)  # [S_tot]
    mism = drafts_all != fp_rep
    first = torch.where(mism.any(dim=1), mism.to(torch.uint8).argmax(dim=1), nb_rep)  # [S_tot]
    fracs = (nb_rep - first).to(torch.float64) / nb_rep.to(torch.float64)

    # --- per-block nearest-level selection (tiny Python loop over states, not tokens) ------------
    fr_list = fracs.tolist()
    t_list = targets.tolist()
    state_starts = (torch.cumsum(states, 0) - states).tolist()
    sel_local: list[int] = []
    for i in range(N):
        s0 = state_starts[i]
        sel_local.append(_select_from_fractions(fr_list[s0 : s0 + blocks[i].num_states], t_list[i]))
    sel_local_t = torch.tensor(sel_local, dtype=torch.int64)
    sel_global = torch.tensor(state_starts, dtype=torch.int64) + sel_local_t
    noise_ratios = fracs[sel_global].to(torch.float32)
    first_diff = first[sel_global]  # [N] first offset where noisy != clean (n_i if identical)

    # --- layout by index arithmetic -------------------------------------------------------------
    response = torch.cat([b.fixed_point for b in blocks])  # [R]
    noisy_tokens = torch.cat([b.drafts[k] for b, k in zip(blocks, sel_local)])  # [R]
    ctx_off = torch.cumsum(lens, 0) - lens  # [N] response offset of each block (= context_len_i - P)
    r = torch.arange(R, dtype=torch.int64)
    blk = torch.repeat_interleave(torch.arange(N, dtype=torch.int64), lens)  # [R] block of token r
    off = r - ctx_off[blk]  # [R] offset within block
    noisy_idx = P + ctx_off[blk] + r  # packed index of noisy copy of token r
    clean_idx = noisy_idx + lens[blk]  # packed index of clean copy of token r

    L = P + 2 * R
    tokens = torch.empty(L, dtype=torch.int64)
    tokens[:P] = record.prompt_ids
    tokens[noisy_idx] = noisy_tokens
    tokens[clean_idx] = response

    position_ids = torch.empty(L, dtype=torch.int64)
    position_ids[:P] = torch.arange(P, dtype=torch.int64)
    position_ids[noisy_idx] = P + r
    position_ids[clean_idx] = P + r

    roles = torch.full((L,), ROLE_NOISY, dtype=torch.int64)
    roles[:P] = ROLE_PROMPT
    roles[clean_idx] = ROLE_CLEAN

    block_ids = torch.full((L,), -1, dtype=torch.int64)
    block_ids[noisy_idx] = blk
    block_ids[clean_idx] = blk

    ar_targets = torch.full((L,), IGNORE_INDEX, dtype=torch.int64)
    ar_targets[P - 1] = response[0]
    ar_targets[clean_idx[:-1]] = response[1:]

    has_target = r < R - 1
    if consistency == "from_first_diff":
        has_target = has_target & (off >= first_diff[blk])
    consistency_pairs = torch.stack([noisy_idx[has_target], clean_idx[has_target]], dim=1)

    return PackedSample(
        tokens=tokens,
        position_ids=position_ids,
        roles=roles,
        block_ids=block_ids,
        ar_targets=ar_targets,
        consistency_pairs=consistency_pairs,
        noise_ratios=noise_ratios,
        target_ratios=targets.to(torch.float32),
        prompt_len=P,
        sample_id=sid,
        state_indices=sel_local_t,
    )


def to_two_stream(packed: PackedSample) -> TwoStreamSample:
    """Split a packed sample into the noisy and clean causal streams (reference report Sec. 5.5).

    Under the ``nc`` mask, attention in the packed layout equals plain causal attention within
    ``noisy_stream = prompt + noisy blocks`` and within ``clean_stream = prompt + clean blocks``,
    both with ``position_ids`` ``[T]``; the prompt is computed twice (identically).

    Raises:
        ValueError: if the consistency pairs do not connect the same stream position in both streams.
    """
    P = packed.prompt_len
    L = len(packed)
    prompt_idx = torch.arange(P, dtype=torch.int64)
    noisy_index = torch.cat([prompt_idx, torch.nonzero(packed.roles == ROLE_NOISY).flatten()])
    clean_index = torch.cat([prompt_idx, torch.nonzero(packed.roles == ROLE_CLEAN).flatten()])
    if noisy_index.shape[0] != clean_index.shape[0]:
        raise ValueError(
            f"sample {packed.sample_id!r}: {noisy_index.shape[0] - P} noisy vs {clean_index.shape[0] - P} clean tokens"
        )
    T = clean_index.shape[0]
    stream_pos = torch.arange(T, dtype=torch.int64)
    inv_noisy = torch.full((L,), -1, dtype=torch.int64)
    inv_noisy[noisy_index] = stream_pos
    inv_clean = torch.full((L,), -1, dtype=torch.int64)
    inv_clean[clean_index] = stream_pos
    j_student = inv_noisy[packed.consistency_pairs[:, 0]]
    j_teacher = inv_clean[packed.consistency_pairs[:, 1]]
    if bool((j_student != j_teacher).any()) or bool((j_student < P).any()):
        raise ValueError(f"sample {packed.sample_id!r}: consistency pairs are not aligned noisy/clean (block, offset) pairs")
    consistency_mask = torch.zeros(T, dtype=torch.bool)
    consistency_mask[j_teacher] = True
    return TwoStreamSample(
        noisy_stream=packed.tokens[noisy_index],
        clean_stream=packed.tokens[clean_index],
        position_ids=packed.position_ids[clean_index],
        ar_targets=packed.ar_targets[clean_index],
        consistency_mask=consistency_mask,
        block_ids=packed.block_ids[clean_index],
        noisy_index=noisy_index,
        clean_index=clean_index,
        noise_ratios=packed.noise_ratios.clone(),
        target_ratios=packed.target_ratios.clone(),
        prompt_len=P,
        sample_id=packed.sample_id,
        state_indices=packed.state_indices.clone(),
    )


def from_two_stream(two: TwoStreamSample) -> PackedSample:
    """Inverse of :func:`to_two_stream`: rebuild the packed layout from the two streams and index maps.

    Raises:
        ValueError: if the two streams disagree on the prompt or the index maps are inconsistent.
    """
    P = two.prompt_len
    T = len(two)
    if two.noisy_stream.shape[0] != T or two.noisy_index.shape[0] != T or two.clean_index.shape[0] != T:
        raise ValueError(f"sample {two.sample_id!r}: stream/index lengths differ")
    if not torch.equal(two.noisy_stream[:P], two.clean_stream[:P]) or not torch.equal(
        two.noisy_index[:P], two.clean_index[:P]
    ):
        raise ValueError(f"sample {two.sample_id!r}: noisy and clean streams disagree on the prompt")
    L = P + 2 * (T - P)
    tokens = torch.full((L,), -1, dtype=torch.int64)
    tokens[two.noisy_index] = two.noisy_stream
    tokens[two.clean_index] = two.clean_stream
    if bool((tokens < 0).any()):
        raise ValueError(f"sample {two.sample_id!r}: index maps do not cover the packed layout")
    position_ids = torch.empty(L, dtype=torch.int64)
    position_ids[two.noisy_index] = two.position_ids
    position_ids[two.clean_index] = two.position_ids
    roles = torch.full((L,), ROLE_NOISY, dtype=torch.int64)
    roles[two.clean_index] = ROLE_CLEAN
    roles[two.clean_index[:P]] = ROLE_PROMPT
    block_ids = torch.empty(L, dtype=torch.int64)
    block_ids[two.noisy_index] = two.block_ids
    block_ids[two.clean_index] = two.block_ids
    ar_targets = torch.full((L,), IGNORE_INDEX, dtype=torch.int64)
    ar_targets[two.clean_index] = two.ar_targets
    j = torch.nonzero(two.consistency_mask).flatten()
    pairs = torch.stack([two.noisy_index[j], two.clean_index[j]], dim=1)
    return PackedSample(
        tokens=tokens,
        position_ids=position_ids,
        roles=roles,
        block_ids=block_ids,
        ar_targets=ar_targets,
        consistency_pairs=pairs,
        noise_ratios=two.noise_ratios.clone(),
        target_ratios=two.target_ratios.clone(),
        prompt_len=P,
        sample_id=two.sample_id,
        state_indices=two.state_indices.clone(),
    )


def packed_equal(a: PackedSample, b: PackedSample) -> bool:
    """Exact equality of two packed samples (every tensor's dtype, shape and values, and the scalars)."""
    if a.prompt_len != b.prompt_len or a.sample_id != b.sample_id:
        return False
    for name in (
        "tokens",
        "position_ids",
        "roles",
        "block_ids",
        "ar_targets",
        "consistency_pairs",
        "noise_ratios",
        "target_ratios",
        "state_indices",
    ):
        x, y = getattr(a, name), getattr(b, name)
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x, y):
            return False
    return True


def check_packed(packed: PackedSample) -> None:
    """Check the layout invariants of a packed sample (used by tests and for debugging data).

    Checks: dtypes and shapes; the prompt comes first with roles PROMPT, block ids -1 and positions
    ``0..P-1``; then per block a noisy run followed by a clean run of the same length and block id,
    blocks in increasing order; both copies share positions and the positions continue the prompt
    contiguously; ``ar_targets`` hold the next clean token at the prompt's last token and every
    clean token but the last, IGNORE_INDEX elsewhere; consistency pairs join the noisy and clean
    copies of the same (block, offset) and only where the clean position has a target.

    Raises:
        ValueError: naming the sample and the first violated invariant.
    """
    sid = packed.sample_id
    L = len(packed)
    P = packed.prompt_len

    def fail(msg: str) -> None:
        raise ValueError(f"sample {sid!r}: {msg}")

    for name in ("tokens", "position_ids", "roles", "block_ids", "ar_targets"):
        x = getattr(packed, name)
        if x.dtype != torch.int64 or x.shape != (L,):
            fail(f"{name} must be int64 [{L}], got {x.dtype} {tuple(x.shape)}")
    if P < 1 or (L - P) % 2 != 0 or L <= P:
        fail(f"length {L} is not P + 2R with P={P}, R>=1")
    R = (L - P) // 2
    roles, bids, pos = packed.roles, packed.block_ids, packed.position_ids
    if not torch.equal(roles[:P], torch.full((P,), ROLE_PROMPT)) or not torch.equal(bids[:P], torch.full((P,), -1)):
        fail("prompt roles / block ids wrong")
    if not torch.equal(pos[:P], torch.arange(P)):
        fail("prompt position ids are not 0..P-1")
    noisy = torch.nonzero(roles == ROLE_NOISY).flatten()
    clean = torch.nonzero(roles == ROLE_CLEAN).flatten()
    if noisy.numel() != R or clean.numel() != R:
        fail(f"expected {R} noisy and {R} clean tokens, got {noisy.numel()} and {clean.numel()}")
    if not torch.equal(pos[noisy], torch.arange(P, P + R)) or not torch.equal(pos[clean], torch.arange(P, P + R)):
        fail("noisy/clean position ids are not P..P+R-1 in order")
    if not torch.equal(bids[noisy], bids[clean]):
        fail("noisy and clean copies have different block ids")
    blk = bids[clean]
    if int(blk[0]) != 0 or bool((blk.diff() < 0).any()) or bool((blk.diff() > 1).any()):
        fail("block ids are not 0,1,... in order")
    lens = torch.bincount(blk)
    ctx_off = torch.cumsum(lens, 0) - lens
    r = torch.arange(R)
    exp_noisy = P + ctx_off[blk] + r
    if not torch.equal(noisy, exp_noisy) or not torch.equal(clean, exp_noisy + lens[blk]):
        fail("tokens are not laid out as [noisy B_i, clean B_i] runs")
    exp_t = torch.full((L,), IGNORE_INDEX, dtype=torch.int64)
    resp = packed.tokens[clean]
    exp_t[P - 1] = resp[0]
    exp_t[clean[:-1]] = resp[1:]
    if not torch.equal(packed.ar_targets, exp_t):
        bad = int(torch.nonzero(packed.ar_targets != exp_t).flatten()[0])
        fail(f"ar_targets wrong at packed index {bad}")
    cp = packed.consistency_pairs
    if cp.dtype != torch.int64 or cp.dim() != 2 or cp.shape[1] != 2:
        fail(f"consistency_pairs must be int64 [C, 2], got {cp.dtype} {tuple(cp.shape)}")
    if cp.numel():
        if bool(((cp < 0) | (cp >= L)).any()):
            fail("consistency pair index out of range")
        if bool((roles[cp[:, 0]] != ROLE_NOISY).any()) or bool((roles[cp[:, 1]] != ROLE_CLEAN).any()):
            fail("consistency pairs must be (noisy, clean)")
        if not torch.equal(pos[cp[:, 0]], pos[cp[:, 1]]) or not torch.equal(bids[cp[:, 0]], bids[cp[:, 1]]):
            fail("consistency pairs join different (block, offset)")
        if bool((packed.ar_targets[cp[:, 1]] == IGNORE_INDEX).any()):
            fail("consistency pair at a clean position without an AR target")
    N = int(lens.numel())
    for name in ("noise_ratios", "target_ratios"):
        x = getattr(packed, name)
        if x.dtype != torch.float32 or x.shape != (N,):
            fail(f"{name} must be float32 [{N}], got {x.dtype} {tuple(x.shape)}")
