"""Attention paths for the packed Jacobi Forcing sequence (paper Sec. 3.1 / 4.1, Table 5).

A packed sample is ``[prompt, noisy B_1, clean B_1, ..., noisy B_N, clean B_N]`` with both copies of a
block at the same position ids (:mod:`megatron_jf.data.packing`). Which keys a query may see is set by
the mask kind (:mod:`megatron_jf.data.masks`): ``nc`` (noise-conditioned, the paper's), ``nc_ic``
(NC with intra-window clean context, Table 5) or ``clean`` (CLLM clean context).

Paths (``--attention-path``):

* ``two_stream`` (default; ``nc`` only): under the ``nc`` mask the packed sequence is *exactly* two
  ordinary causal sequences that share position ids -- ``prompt + noisy blocks`` and ``prompt + clean
  blocks`` (reference report Sec. 5.5). They run as ``2B`` rows of a plain causal batch
  (``attention_mask=None``, stock causal kernels; the prompt is computed twice). Rows ``0..B-1`` are the
  noisy streams, rows ``B..2B-1`` the clean streams.
* ``dense``: the packed sequence itself with an explicit ``[B, 1, L, L]`` boolean mask from
  :func:`megatron_jf.data.masks.dense_mask_from_layout`, converted to megatron's convention
  (**True = masked out**). Works for every mask kind (``nc`` as a reference for the two-stream path);
  memory ``O(B L^2)`` bytes for the mask plus ``O(B h L^2)`` scores in SDPA's math path.
* ``packed`` (TE's varlen kernels on GPU): ``nc`` -- the noisy and clean streams of every sample packed
  back to back, ``[noisy_0, clean_0, noisy_1, clean_1, ...]``, as ONE THD row ``[1, T]`` without
  padding between them, delimited by megatron-core ``PackedSeqParams`` (``qkv_format="thd"``,
  ``cu_seqlens`` int32 ``[2B + 1]``, or ``[2B + 2]`` when a trailing padding segment rounds ``T`` up to
  ``pad_to_multiple_of``). The core attention (:mod:`megatron_jf.models.attention`) runs each segment
  causally: Transformer Engine's fused ``padding_causal`` attention when present, one SDPA per segment on
  CPU. Logits equal ``two_stream`` (tests); no compute on row padding. ``nc_ic`` / ``clean``: ONE THD row
  of every sample's packed tokens in query order (``[x, clean blocks, noisy window 0, ...]``,
  :mod:`megatron_jf.data.thd`), each noisy window a segment attending bottom-right-causally to its
  gathered keys (prompt + earlier clean blocks + itself), carried by
  :class:`~megatron_jf.models.attention.GatheredKVPackedSeqParams`: TE's ``padding_causal_bottom_right``
  THD attention on GPU, no ``[L, L]`` mask. Logits equal ``dense`` (tests).
* ``flex``: not implemented. On CPU FlexAttention is slower than SDPA with a dense boolean mask
  (measured, torch 2.13, ``[4, 8, 320, 32]``, 1 thread: eager 84 ms, ``torch.compile`` 12 ms, SDPA with
  the dense mask 5.5 ms), and the core attention (``megatron_jf.models.attention``) has no ``BlockMask``
  mode. TE's arbitrary-mask attention (``AttnMaskType.arbitrary``) is available in the core attention
  (opt-in, ``MEGATRON_JF_TE_ARBITRARY_MASK=1``); TE serves it only with its unfused backend.

Everything that depends on the data (gather indices of the consistency pairs and AR positions) is
computed on the CPU in :func:`build_jf_batch`, so the training step only does index gathers -- no
per-token Python loops and no host synchronisation.

Output layer: :func:`forward_model` returns logits over every row (the reference, and the path
:func:`gather_jf_logits` / :func:`jf_forward` read). The trainer instead runs every path through
:func:`megatron_jf.training.output_head.forward_loss_rows`, which returns the hidden states of the loss
rows only (the same gather indices), and the output layer + loss run on them in chunks
(``--loss-chunk-size``); with ``--sequence-parallel`` the rows are gathered from the sequence shards.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from typing import Sequence

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_jf.data.dataset import collate_packed, collate_two_stream
from megatron_jf.data.masks import MASK_KINDS, dense_mask_from_layout
from megatron_jf.data.packing import IGNORE_INDEX, PackedSample
from megatron_jf.training.config import ATTENTION_PATHS
from megatron_jf.training.losses import JFLossInputs

__all__ = ["PATHS", "JFBatch", "build_jf_batch", "append_anchor_rows", "forward_model", "gather_jf_logits",
           "gather_anchor_logits", "jf_forward"]

#: The command line's ``--attention-path`` values, and ``flex``: known here and refused (NotImplementedError), not
#: offered by the command line.
PATHS = ATTENTION_PATHS + ("flex",)


@dataclass
class JFBatch:
    """One collated microbatch, ready for the model and the loss.

    Shapes: ``R`` model rows (``2B`` for two-stream, ``B`` for dense, ``1`` for packed), ``S`` padded
    row length (packed: the total packed length ``T``),
    ``C`` consistency pairs, ``M`` AR positions, ``B`` samples. Flat indices index the model output
    viewed as ``[R * S, V_local]``.

    Attributes:
        tokens: int64 ``[R, S]`` model input.
        position_ids: int64 ``[R, S]`` RoPE positions.
        attention_mask: ``None`` (causal) or bool ``[R, 1, S, S]``, True = masked out (megatron).
        student_index: int64 ``[C]`` flat index of each noisy (student) position.
        teacher_index: int64 ``[C]`` flat index of the paired clean (teacher) position.
        pc_targets: int64 ``[C]`` fixed-point token predicted at both positions.
        pair_sample: int64 ``[C]``; pair_block: int64 ``[C]`` (sample, block) of each pair.
        ar_index: int64 ``[M]`` flat index of clean positions with an AR target.
        ar_targets: int64 ``[M]``; ar_sample: int64 ``[M]``.
        num_blocks: int64 ``[B]`` (each >= 1).
        num_tokens: real (non-padding) model-input tokens.
        max_blocks: ``max(num_blocks)`` (host int, so the loss needs no device sync).
        path, mask: the attention path and mask kind.
        sample_ids: the samples' ids.
        anchor_index: int64 ``[K]`` flat index of the labelled positions of the anchor rows (real-text
            next-token rows appended after the JF rows by :func:`append_anchor_rows`), or ``None``
            when the batch carries no anchor rows.
        anchor_targets: int64 ``[K]`` next-token ids at ``anchor_index`` (``None`` without anchor rows).
        num_anchor_rows: ``A``, the anchor rows appended (rows ``R - A .. R - 1``; 0 without).
        packed_seq_params: megatron-core ``PackedSeqParams`` (``qkv_format="thd"``, int32 ``cu_seqlens_q`` =
            ``cu_seqlens_kv`` ``[segments + 1]``, ``max_seqlen_q/kv``) on the packed path, else ``None``; for
            ``nc_ic`` / ``clean`` a :class:`~megatron_jf.models.attention.GatheredKVPackedSeqParams`.
    """

    tokens: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    student_index: torch.Tensor
    teacher_index: torch.Tensor
    pc_targets: torch.Tensor
    pair_sample: torch.Tensor
    pair_block: torch.Tensor
    ar_index: torch.Tensor
    ar_targets: torch.Tensor
    ar_sample: torch.Tensor
    num_blocks: torch.Tensor
    num_tokens: int
    max_blocks: int
    path: str
    mask: str
    sample_ids: list[str] = field(default_factory=list)
    anchor_index: torch.Tensor | None = None
    anchor_targets: torch.Tensor | None = None
    num_anchor_rows: int = 0
    packed_seq_params: PackedSeqParams | None = None

    @property
    def num_samples(self) -> int:
        return int(self.num_blocks.shape[0])

    @property
    def has_anchor(self) -> bool:
        return self.anchor_index is not None

    def to(self, device) -> "JFBatch":
        """A copy with every tensor on ``device`` (non-blocking)."""
        kw = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, PackedSeqParams):
                v = dataclasses.replace(v, **{g.name: getattr(v, g.name).to(device, non_blocking=True)
                                              for g in fields(v) if isinstance(getattr(v, g.name), torch.Tensor)})
            kw[f.name] = v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
        return JFBatch(**kw)


def _check_args(path: str, mask: str) -> None:
    if path not in PATHS:
        raise ValueError(f"unknown attention path {path!r}; expected one of {PATHS}")
    if mask not in MASK_KINDS:
        raise ValueError(f"unknown mask {mask!r}; expected one of {MASK_KINDS}")
    if path == "flex":
        raise NotImplementedError(
            "attention path 'flex' is not implemented: use 'dense' (any mask), 'packed' or 'two_stream' (nc)")
    if path == "two_stream" and mask != "nc":
        raise ValueError(f"the two-stream path is exact only for the 'nc' mask, not {mask!r}; "
                         "use --attention-path dense for nc_ic / clean")


def build_jf_batch(samples: Sequence[PackedSample], *, path: str = "two_stream", mask: str = "nc",
                   window_size: int | None = None, pad_id: int = 0, pad_to: int | None = None,
                   max_len: int | None = None, pad_to_multiple_of: int = 1, max_position: int | None = None,
                   vocab_size: int | None = None) -> JFBatch:
    """Collate packed samples for ``path``/``mask`` and precompute all loss gather indices (CPU).

    Args:
        samples: packed samples (:func:`megatron_jf.data.packing.pack_record`).
        path: ``"two_stream"`` | ``"dense"`` | ``"packed"`` (``"flex"`` raises NotImplementedError).
        mask: ``"nc"`` | ``"nc_ic"`` | ``"clean"``.
        window_size: ``w`` for ``nc_ic`` (the noise-schedule window).
        pad_id: token id used for padding (never attended by real tokens, never a target).
        pad_to: pad every row to exactly this length (required for pipeline parallelism, whose
            p2p buffers have a fixed shape). Packed ``nc``: the total packed length ``T``.
        max_len: longest allowed model-input row (two-stream and packed ``nc``: ``P + R`` per stream;
            dense: ``P + 2R``).
        pad_to_multiple_of: round the row length up (when ``pad_to`` is None).
        max_position: the model's context (max_position_embeddings); positions must stay below it.
        vocab_size: if given, every token id must be below it.

    Returns:
        :class:`JFBatch` on CPU.

    Raises:
        ValueError: empty batch, unknown path/mask, ``two_stream`` with a mask other than ``nc``,
            a sample longer than ``max_len``/``pad_to`` or than the model's context, or token ids
            outside the vocabulary (each naming the sample).
        NotImplementedError: ``path="flex"``.
    """
    _check_args(path, mask)
    if not samples:
        raise ValueError("cannot build a batch from zero samples")
    thd = path == "packed" and mask == "nc"
    for s in samples:
        P, L = s.prompt_len, len(s)
        row = (L + P) // 2 if path == "two_stream" or thd else L
        if max_position is not None and int(s.position_ids.max()) >= max_position:
            raise ValueError(f"sample {s.sample_id!r}: prompt + response = {int(s.position_ids.max()) + 1} tokens "
                             f"exceeds the model's context of {max_position} positions")
        limit = pad_to if pad_to is not None and path != "packed" else max_len  # packed: pad_to bounds the row
        if limit is not None and row > limit:
            raise ValueError(f"sample {s.sample_id!r}: model-input length {row} ({path} path; prompt {P}, "
                             f"response {(L - P) // 2}) exceeds the sequence length {limit}")
        if vocab_size is not None and int(s.tokens.max()) >= vocab_size:
            raise ValueError(f"sample {s.sample_id!r}: token id {int(s.tokens.max())} >= vocabulary size {vocab_size}")
        if int(s.tokens.min()) < 0:
            raise ValueError(f"sample {s.sample_id!r}: negative token id {int(s.tokens.min())}")
    if path == "packed" and mask != "nc":
        return _build_gathered_thd(samples, mask, window_size=window_size, pad_id=pad_id, pad_to=pad_to,
                                   pad_to_multiple_of=pad_to_multiple_of)
    mult = 1 if pad_to is not None else pad_to_multiple_of
    B = len(samples)
    psp = None
    if thd:
        col = collate_two_stream(samples, pad_id, mode="pack", max_len=pad_to, pad_to_multiple_of=mult)
        R, S = col["tokens"].shape  # R = 1, S = T (total packed length incl. a trailing pad segment)
        cu = col["cu_seqlens"]
        if int(cu[-1]) < S:  # the padding is one more causal segment, so cu_seqlens cover the whole row
            cu = torch.cat([cu, torch.tensor([S], dtype=cu.dtype)])
        seg_len = cu.diff()
        psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                              max_seqlen_q=int(seg_len.max()), max_seqlen_kv=int(seg_len.max()))
        cp = col["consistency_pairs"]  # [C, 2] (student column, teacher column) in the one row
        student, teacher = cp[:, 0], cp[:, 1]
        ar = col["ar_targets"][0]
        pc_targets = ar[teacher]
        pair_block = col["block_ids"][0, teacher]
        seg = col["segment_ids"][0]
        pair_sample = torch.div(seg[teacher], 2, rounding_mode="floor")
        ar_index = torch.nonzero(ar != IGNORE_INDEX).flatten()  # ordered by (sample, position)
        ar_targets = ar[ar_index]
        ar_b = torch.div(seg[ar_index], 2, rounding_mode="floor")
        attn = None
    elif path == "two_stream":
        col = collate_two_stream(samples, pad_id, mode="pad", max_len=pad_to, pad_to_multiple_of=mult)
        R, S = col["tokens"].shape
        b, j = torch.nonzero(col["consistency_mask"], as_tuple=True)  # ordered by (sample, position)
        student = b * S + j
        teacher = (b + B) * S + j
        clean_ar = col["ar_targets"][B:]
        pc_targets = clean_ar[b, j]
        pair_block = col["block_ids"][B:][b, j]
        ar_b, ar_j = torch.nonzero(clean_ar != IGNORE_INDEX, as_tuple=True)
        ar_index = (ar_b + B) * S + ar_j
        ar_targets = clean_ar[ar_b, ar_j]
        attn = None
        pair_sample = b
    else:
        col = collate_packed(samples, pad_id, mode="pad", max_len=pad_to, pad_to_multiple_of=mult)
        R, S = col["tokens"].shape
        cp = col["consistency_pairs"]  # [C, 3] (row, noisy col, clean col)
        pair_sample = cp[:, 0]
        student = cp[:, 0] * S + cp[:, 1]
        teacher = cp[:, 0] * S + cp[:, 2]
        pc_targets = col["ar_targets"][cp[:, 0], cp[:, 2]]
        pair_block = col["block_ids"][cp[:, 0], cp[:, 2]]
        ar_b, ar_j = torch.nonzero(col["ar_targets"] != IGNORE_INDEX, as_tuple=True)
        ar_index = ar_b * S + ar_j
        ar_targets = col["ar_targets"][ar_b, ar_j]
        allowed = dense_mask_from_layout(mask, col["roles"], col["block_ids"],
                                         window_size=window_size if mask == "nc_ic" else None)
        attn = (~allowed).unsqueeze(1)  # [B, 1, L, L], True = masked out
    if bool((pc_targets == IGNORE_INDEX).any()):
        raise ValueError("a consistency pair sits at a clean position without an AR target (corrupt packing)")
    return JFBatch(
        tokens=col["tokens"], position_ids=col["position_ids"], attention_mask=attn,
        student_index=student, teacher_index=teacher, pc_targets=pc_targets, pair_sample=pair_sample,
        pair_block=pair_block, ar_index=ar_index, ar_targets=ar_targets, ar_sample=ar_b,
        num_blocks=col["num_blocks"], num_tokens=int(col["valid"].sum()),
        max_blocks=int(col["num_blocks"].max()), path=path, mask=mask,
        sample_ids=list(col["sample_ids"]), packed_seq_params=psp,
    )


def _build_gathered_thd(samples, mask, *, window_size, pad_id, pad_to, pad_to_multiple_of) -> JFBatch:
    """``build_jf_batch`` for the packed path with the ``nc_ic`` / ``clean`` masks (query-ordered THD;
    the samples are already checked)."""
    from megatron_jf.data.thd import thd_layout
    from megatron_jf.models.attention import GatheredKVPackedSeqParams

    lay = thd_layout(samples, mask, window_size=window_size if mask == "nc_ic" else None, pad_id=pad_id,
                     pad_to_multiple_of=1 if pad_to is not None else pad_to_multiple_of, pad_to=pad_to)
    student, teacher, pc_t, p_s, p_b, ar_i, ar_t, ar_s = ([] for _ in range(8))
    for b, (s, mp) in enumerate(zip(samples, lay.model_pos)):
        cp = s.consistency_pairs
        student.append(mp[cp[:, 0]])
        teacher.append(mp[cp[:, 1]])
        pc_t.append(s.ar_targets[cp[:, 1]])
        p_s.append(torch.full((cp.shape[0],), b, dtype=torch.int64))
        p_b.append(s.block_ids[cp[:, 1]])
        j = torch.nonzero(s.ar_targets != IGNORE_INDEX).flatten()
        ar_i.append(mp[j])
        ar_t.append(s.ar_targets[j])
        ar_s.append(torch.full((j.numel(),), b, dtype=torch.int64))
    pc_targets = torch.cat(pc_t)
    if bool((pc_targets == IGNORE_INDEX).any()):
        raise ValueError("a consistency pair sits at a clean position without an AR target (corrupt packing)")
    cu = lay.cu_seqlens_q
    psp = GatheredKVPackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                    max_seqlen_q=lay.max_seqlen_q, max_seqlen_kv=lay.max_seqlen_q,
                                    kv_index=lay.kv_index, cu_seqlens_kv_gathered=lay.cu_seqlens_kv,
                                    max_seqlen_kv_gathered=lay.max_seqlen_kv)
    num_blocks = torch.tensor([s.num_blocks for s in samples], dtype=torch.int64)
    return JFBatch(
        tokens=lay.tokens[None], position_ids=lay.position_ids[None], attention_mask=None,
        student_index=torch.cat(student), teacher_index=torch.cat(teacher), pc_targets=pc_targets,
        pair_sample=torch.cat(p_s), pair_block=torch.cat(p_b), ar_index=torch.cat(ar_i), ar_targets=torch.cat(ar_t),
        ar_sample=torch.cat(ar_s), num_blocks=num_blocks, num_tokens=lay.num_real, max_blocks=int(num_blocks.max()),
        path="packed", mask=mask, sample_ids=[s.sample_id for s in samples], packed_seq_params=psp)


def append_anchor_rows(batch: JFBatch, text, *, pad_id: int = 0, pad_to: int | None = None) -> JFBatch:
    """Append real-text next-token rows (the *anchor* term) to a JF microbatch as extra causal rows (CPU).

    The JF rows keep their tokens, positions and attention exactly: if the common row length grows,
    they are right-padded (token ``pad_id``, position 0), and on the dense path the mask is extended so
    that no JF query sees a new key (new padding queries see only themselves, as existing padding does).
    Anchor rows are ordinary causal sequences: two-stream keeps ``attention_mask=None``; the dense path
    gives them a causal block (their padding queries see only themselves). The JF gather indices
    (``student_index``, ``teacher_index``, ``ar_index``) are re-based to the new row length, so the
    gathered JF logits are the same positions as before.

    Args:
        batch: a :class:`JFBatch` without anchor rows, ``R`` rows of length ``S``.
        text: a :class:`~megatron_jf.data.text.TextBatch` (int64 ``tokens``/``labels``/``position_ids``
            ``[A, S_a]``; labels :data:`~megatron_jf.data.packing.IGNORE_INDEX` where unlabelled).
        pad_id: padding token id.
        pad_to: the fixed row length (pipeline parallelism): ``S`` must equal it and ``S_a <= pad_to``.
            ``None``: the common length is ``max(S, S_a)``.

    Returns:
        A new :class:`JFBatch` with ``R + A`` rows of length ``S' = pad_to or max(S, S_a)``,
        ``anchor_index [K]`` (flat indices into ``[(R + A) * S']``, ordered by (row, position)),
        ``anchor_targets [K]``, ``num_anchor_rows = A``; ``num_tokens`` grows by ``A * S_a``.

    Raises:
        ValueError: the batch already has anchor rows, an empty text batch, or rows longer than ``pad_to``.
    """
    if batch.has_anchor:
        raise ValueError("the batch already carries anchor rows")
    if batch.packed_seq_params is not None:
        raise ValueError("anchor rows (--anchor-data) are not supported on the packed THD path yet; "
                         "use --attention-path two_stream or dense")
    a_tok, a_lab, a_pos = text.tokens, text.labels, text.position_ids
    if a_tok.dim() != 2 or a_tok.shape[0] == 0 or a_lab.shape != a_tok.shape or a_pos.shape != a_tok.shape:
        raise ValueError(f"anchor text batch must be non-empty [A, S_a] tokens/labels/positions, got "
                         f"{tuple(a_tok.shape)}, {tuple(a_lab.shape)}, {tuple(a_pos.shape)}")
    R, S = batch.tokens.shape
    A, Sa = a_tok.shape
    if pad_to is not None:
        if S != pad_to or Sa > pad_to:
            raise ValueError(f"with a fixed row length {pad_to} (pipeline parallelism) the JF rows ({S}) must have "
                             f"it and the anchor rows ({Sa}) must fit it (--anchor-seq-length <= --seq-length)")
        S2 = pad_to
    else:
        S2 = max(S, Sa)

    def widen(t: torch.Tensor, fill: int) -> torch.Tensor:
        if t.shape[1] == S2:
            return t
        out = torch.full((t.shape[0], S2), fill, dtype=t.dtype)
        out[:, : t.shape[1]] = t
        return out

    tokens = torch.cat([widen(batch.tokens, pad_id), widen(a_tok.to(batch.tokens.dtype), pad_id)])
    positions = torch.cat([widen(batch.position_ids, 0), widen(a_pos.to(batch.position_ids.dtype), 0)])
    attn = None
    if batch.attention_mask is not None:
        q = torch.arange(S2)
        eye = (q[:, None] == q[None, :])
        jf = eye.expand(R, S2, S2).clone()  # new padding queries: only themselves (as masks.py pads)
        jf[:, :S, :S] = ~batch.attention_mask[:, 0].cpu()  # allowed = not masked out
        causal = (q[None, :] <= q[:, None]) & (q[:, None] < Sa)
        an = (causal | eye).expand(A, S2, S2)
        attn = ~torch.cat([jf, an]).unsqueeze(1)  # [R + A, 1, S2, S2], True = masked out

    def rebase(idx: torch.Tensor) -> torch.Tensor:
        return idx if S2 == S else torch.div(idx, S, rounding_mode="floor") * S2 + idx % S

    a_r, a_j = torch.nonzero(a_lab != IGNORE_INDEX, as_tuple=True)
    return dataclasses.replace(
        batch, tokens=tokens, position_ids=positions, attention_mask=attn,
        student_index=rebase(batch.student_index), teacher_index=rebase(batch.teacher_index),
        ar_index=rebase(batch.ar_index), num_tokens=batch.num_tokens + A * Sa,
        anchor_index=(a_r + R) * S2 + a_j, anchor_targets=a_lab[a_r, a_j].to(torch.int64), num_anchor_rows=A)


def forward_model(model, batch: JFBatch) -> torch.Tensor:
    """Run ``model`` (any wrapper of :class:`~megatron_jf.models.gpt.JFGPTModel`) on the batch.

    Returns:
        On the last pipeline stage, vocab-parallel logits ``[R, S, V_local]``; on other stages the
        hidden states for the next stage.
    """
    if batch.packed_seq_params is not None:
        return model(batch.tokens, batch.position_ids, None, runtime_gather_output=False,
                     packed_seq_params=batch.packed_seq_params)
    return model(batch.tokens, batch.position_ids, batch.attention_mask, runtime_gather_output=False)


def gather_jf_logits(logits: torch.Tensor, batch: JFBatch, vocab_size: int | None) -> JFLossInputs:
    """Pick the loss positions out of the model output (index gathers, no loops).

    Args:
        logits: ``[R, S, V_local]`` from :func:`forward_model` on the last stage.

    Returns:
        :class:`~megatron_jf.training.losses.JFLossInputs` with the teacher logits detached.
    """
    flat = logits.reshape(-1, logits.shape[-1])
    return JFLossInputs(
        student_logits=flat.index_select(0, batch.student_index),
        teacher_logits=flat.index_select(0, batch.teacher_index).detach(),
        pc_targets=batch.pc_targets,
        pair_sample=batch.pair_sample,
        pair_block=batch.pair_block,
        ar_logits=flat.index_select(0, batch.ar_index),
        ar_targets=batch.ar_targets,
        ar_sample=batch.ar_sample,
        num_blocks=batch.num_blocks,
        vocab_size=vocab_size,
        max_blocks=batch.max_blocks,
    )


def gather_anchor_logits(logits: torch.Tensor, batch: JFBatch) -> torch.Tensor:
    """Logits ``[K, V_local]`` at the anchor rows' labelled positions (one index gather; gradient flows).

    Args:
        logits: ``[R, S, V_local]`` from :func:`forward_model` on a batch built by :func:`append_anchor_rows`.

    Raises:
        ValueError: the batch carries no anchor rows.
    """
    if not batch.has_anchor:
        raise ValueError("the batch carries no anchor rows")
    return logits.reshape(-1, logits.shape[-1]).index_select(0, batch.anchor_index)


def jf_forward(model, batch: JFBatch) -> JFLossInputs:
    """Forward ``batch`` through ``model`` (single pipeline stage) and return the loss inputs:
    student logits at the consistency positions, detached teacher logits, AR logits and targets."""
    from megatron_jf.models.gpt import unwrap

    return gather_jf_logits(forward_model(model, batch), batch, unwrap(model).vocab_size_unpadded)
