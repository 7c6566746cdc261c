"""Static-shape decode forwards over the preallocated :class:`~megatron_jf.models.kv_cache.KVCache`, captured
as CUDA graphs per block size.

On a GPU a batch-1 decode forward of a 7B model is a few milliseconds of kernels and, eagerly, as long again
of kernel launches and Python. CUDA graphs remove both, but need every shape and address fixed. This module
gives a decode forward that has them fixed:

* **one bucket per block size**: a forward of ``s`` new tokens runs at the smallest bucket ``S >= s`` (the
  widths the decoders use: ``1`` for AR, ``1+n`` for Jacobi, ``1+K*n+(v-1)*n`` for MR); rows ``s..S-1`` are
  padding;
* **attention over the whole cache**: keys/values are read from all ``max_len`` slots of the preallocated
  buffers, with a boolean mask ``[B, 1, S, max_len]`` built on the host from the committed lengths
  (committed slots visible, new tokens per ``new_mask``, padding rows see only their own slot so no row is
  empty);
* **writes by index**: new token ``i`` of row ``b`` is scattered to slot ``lengths[b] + i`` (padding rows
  too: those slots are past every committed length, so nothing reads them and the next forward overwrites
  them), exactly where :meth:`KVCache.begin` / :meth:`KVCache.update` put it; so ``commit`` (slot reuse,
  compaction of kept tokens), ``trim`` (rollback) and ``copy_row`` work unchanged;
* **RoPE by table lookup**: the cos/sin tables are grown to ``max_len`` positions before any capture.

The host-side bookkeeping (:func:`plan_static_step`: bucket choice, padding, masks, write slots) is plain
tensor code that runs and is tested on CPU, where :class:`StaticDecoder` runs the same static-shape forward
eagerly. With CUDA each bucket is captured once (after a warm-up replay) and replayed afterwards; shapes
beyond the largest bucket, or a cache row near its capacity, fall back to the eager path (same function).

Switch: on by default with CUDA (``MEGATRON_JF_CUDA_GRAPHS=0`` keeps the static path eager,
``MEGATRON_JF_STATIC_DECODE=0`` turns it off, ``=force`` runs it eagerly on CPU too; read in
:mod:`megatron_jf.inference.options`); see :func:`megatron_jf.inference.forward.forward_logits`.

Lifetime: a decoder (its captured graphs and their memory pools) belongs to one cache. The engine's
:class:`~megatron_jf.inference.runner.ModelRunner` owns the decoders of its cache's row views (a bounded number)
and drops them with the cache; :func:`static_decoder_for` keeps a bare cache's decoder on that cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megatron_jf.inference import options
from megatron_jf.models.kv_cache import KVCache


@dataclass
class StaticStep:
    """Host-side plan of one static-shape forward (all tensors on the host, shapes fixed by the bucket).

    Attributes:
        s: real new tokens per row; bucket: ``S >= s`` rows computed.
        tokens, positions: int64 ``[B, S]`` (padding repeats the last real token/position).
        write_slots: int64 ``[B, S]``: cache slot of each new token (``lengths[b] + i``).
        mask: bool ``[B, 1, S, max_len]``, True = may attend.
    """

    s: int
    bucket: int
    tokens: torch.Tensor
    positions: torch.Tensor
    write_slots: torch.Tensor
    mask: torch.Tensor


def choose_bucket(s: int, buckets) -> int | None:
    """Smallest bucket ``>= s`` (None when ``s`` is larger than every bucket)."""
    fit = [b for b in buckets if b >= s]
    return min(fit) if fit else None


def plan_static_step(lengths: torch.Tensor, max_len: int, tokens: torch.Tensor, positions: torch.Tensor,
                     new_mask: torch.Tensor | None, bucket: int) -> StaticStep:
    """Pad a forward of ``s`` new tokens per row to ``bucket`` rows and build its full-cache mask.

    Args:
        lengths: int64 ``[B]`` committed tokens per row (host).
        max_len: cache slots per row.
        tokens, positions: int64 ``[B, s]``.
        new_mask: bool ``[B|1, s, s]`` or ``[s, s]`` visibility among the new tokens (None: causal).
        bucket: ``S >= s``.

    Raises:
        ValueError: ``bucket < s``, bad mask shape, or a row whose ``lengths[b] + bucket`` exceeds ``max_len``
            (the caller then runs the exact-shape path).
    """
    B, s = tokens.shape
    S = bucket
    if S < s:
        raise ValueError(f"bucket {S} < {s} new tokens")
    lengths = lengths.to(torch.long).cpu()
    if int(lengths.max()) + S > max_len:
        raise ValueError(f"static step needs {int(lengths.max()) + S} slots, cache holds {max_len}")
    if new_mask is None:
        nm = torch.ones(s, s, dtype=torch.bool).tril_().expand(B, s, s)
    else:
        if new_mask.dtype != torch.bool or new_mask.shape[-2:] != (s, s):
            raise ValueError(f"new_mask must be bool [B, {s}, {s}] or [{s}, {s}], got {tuple(new_mask.shape)}")
        nm = (new_mask if new_mask.dim() == 3 else new_mask.unsqueeze(0)).cpu().expand(B, s, s)
    i = torch.arange(S)
    write = lengths[:, None] + i[None, :]  # [B, S]
    j = torch.arange(max_len)
    rel = j[None, :] - lengths[:, None]  # [B, max_len]: slot relative to the row's new block
    committed = rel < 0
    real = torch.zeros(B, S, S, dtype=torch.bool)
    real[:, :s, :s] = nm
    real[:, torch.arange(s, S), torch.arange(s, S)] = True  # padding rows: only their own slot
    in_block = (rel >= 0) & (rel < S)
    gathered = torch.gather(real, 2, rel.clamp(0, S - 1)[:, None, :].expand(B, S, max_len))
    mask = (committed[:, None, :] | (in_block[:, None, :] & gathered))
    mask[:, s:, :] &= ~committed[:, None, :]  # padding rows see nothing committed either
    toks = torch.empty(B, S, dtype=torch.long)
    pos = torch.empty(B, S, dtype=torch.long)
    toks[:, :s], pos[:, :s] = tokens.cpu(), positions.cpu()
    toks[:, s:], pos[:, s:] = toks[:, s - 1: s], pos[:, s - 1: s]
    return StaticStep(s, S, toks, pos, write, mask.unsqueeze(1))


class StaticDecoder:
    """Static-shape cached forwards for one model and one KV cache (see module docstring).

    Args:
        lean: the model's :class:`~megatron_jf.inference.lean_forward.LeanForward`.
        cache: the :class:`KVCache` whose buffers the forwards read and write.
        buckets: block sizes to run at fixed shape (default: learned from the widths seen).
        use_graphs: capture CUDA graphs (default: on a CUDA device and ``MEGATRON_JF_CUDA_GRAPHS`` not 0).
        max_buckets: at most this many learned buckets.
    """

    def __init__(self, lean, cache: KVCache, buckets=None, use_graphs: bool | None = None, max_buckets: int = 8):
        self.lean = lean
        self.cache = cache
        self.device = cache.k.device
        self.buckets = sorted(set(buckets)) if buckets else []
        self.learn = not buckets
        self.max_buckets = max_buckets
        self.use_graphs = options.cuda_graphs_on(self.device, use_graphs)
        self._graphs: dict[int, tuple] = {}
        self._seen: dict[int, int] = {}
        self.replays = 0
        self.eager_static = 0
        self.fallbacks = 0
        self._cos, self._sin = lean.rope_table(cache.max_len + 1, cache.k.dtype)

    # ------------------------------------------------------------------ the static-shape forward
    def _run(self, tokens, positions, write_slots, mask):
        """Logits ``[B, S, V_padded]``; every shape fixed by the bucket, no host sync (capturable)."""
        cache = self.cache
        lean = self.lean
        cos = self._cos[positions].unsqueeze(1)
        sin = self._sin[positions].unsqueeze(1)
        gqa = lean.ng != lean.nh

        def attend(slot, q, k, v):
            idx = write_slots[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
            cache.k[slot].scatter_(2, idx, k.to(cache.k.dtype))
            cache.v[slot].scatter_(2, idx, v.to(cache.v.dtype))
            return F.scaled_dot_product_attention(q, cache.k[slot], cache.v[slot], attn_mask=mask,
                                                  scale=lean.scale, enable_gqa=gqa)

        return lean.head(lean.hidden(tokens, positions, attend=attend, rope=(cos, sin)))

    def _to_dev(self, step: StaticStep):
        d = self.device
        return (step.tokens.to(d, non_blocking=True), step.positions.to(d, non_blocking=True),
                step.write_slots.to(d, non_blocking=True), step.mask.to(d, non_blocking=True))

    def _capture(self, S: int, args):
        static = tuple(a.clone() for a in args)
        side = _capture_stream(self.device)
        side.wait_stream(torch.cuda.current_stream())
        # warm-up runs write only the uncommitted slots of this step, which the replay below writes again
        with torch.cuda.stream(side):
            for _ in range(2):
                self._run(*static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            out = self._run(*static)
        self._graphs[S] = (graph, static, out)

    # ------------------------------------------------------------------ public
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, new_mask: torch.Tensor | None = None):
        """Cached forward of ``tokens`` ``[B, s]`` after each row's committed tokens; logits ``[B, s, V_padded]``
        (new tokens stay uncommitted until ``cache.commit``, as with :func:`~megatron_jf.inference.forward.forward_logits`).
        Returns None when this shape takes the exact-shape path (the caller runs it)."""
        s = tokens.shape[1]
        if self.learn and s not in self.buckets:
            self._seen[s] = self._seen.get(s, 0) + 1
            if self._seen[s] >= 2 and len(self.buckets) < self.max_buckets:  # a width in use: give it a bucket
                self.buckets = sorted(self.buckets + [s])
        S = choose_bucket(s, self.buckets)
        if S is None:
            self.fallbacks += 1
            return None
        try:
            step = plan_static_step(self.cache.lengths, self.cache.max_len, tokens, positions, new_mask, S)
        except ValueError:  # a row near capacity: exact shapes
            self.fallbacks += 1
            return None
        args = self._to_dev(step)
        if not self.use_graphs:
            self.eager_static += 1
            return self._run(*args)[:, :s]
        if S not in self._graphs:
            self._capture(S, args)
        graph, static, out = self._graphs[S]
        for dst, src in zip(static, args):
            dst.copy_(src)
        graph.replay()
        self.replays += 1
        return out[:, :s].clone()


_CAPTURE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _capture_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per device for every warm-up and capture. torch keeps a cuBLAS workspace (32 MiB + 1 MiB on
    Hopper) per stream for the life of the process, so a new stream per capture leaked 33 MiB per ``generate()``
    (measured on the H200 by ``bench/gpu_check.sh``)."""
    st = _CAPTURE_STREAMS.get(device)
    if st is None:
        st = _CAPTURE_STREAMS[device] = torch.cuda.Stream(device=device)
    return st


def static_decoder_for(lean, cache: KVCache) -> StaticDecoder:
    """The :class:`StaticDecoder` of ``cache``, kept on the cache itself: it lives exactly as long as the cache (a
    new cache gets a new decoder; nothing outlives the cache that its graphs were captured on)."""
    dec = cache.__dict__.get("_static_decoder")
    if dec is None or dec.lean is not lean:
        dec = cache._static_decoder = StaticDecoder(lean, cache)
    return dec
