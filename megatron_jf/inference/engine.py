"""The decoding engine: AR, Jacobi, running-window and MR decoding over the megatron-core model.

Every decoder shares one loop (paper Sec. 2.1, 3.2, Algorithm 1). Per request (a batch row):

* the KV cache holds the prompt and the emitted tokens *except the newest one*, ``last``;
* ``draft`` holds guesses for the next ``m`` positions;
* one forward over ``[last] + draft`` (plus recycled candidates for MR) gives, at every position,
  the distribution of the next token. :func:`~megatron_jf.inference.sampling.verify` accepts the
  longest verified prefix and one more token, so each forward emits >= 1 token and the output is
  exactly greedy AR (or, when sampling, exactly AR's distribution);
* the cache keeps ``[last] + accepted``; the tail is rolled back (slots are reused);
* the draft for the next forward is the Jacobi update (each unverified position takes the model's
  prediction from this forward), refilled by the decoder's rule.

Decoders differ only in the draft they keep:

``ar``              no draft: one token per forward (the baseline; TPF is exactly 1).
``jacobi``          block-wise Jacobi: the draft covers the rest of the current block of ``n`` tokens;
                    when the block reaches its fixed point, the next block starts from a fresh draft.
``running-window``  the draft always has ``n`` guesses, refilled as tokens are committed.
``mr``              multi-block decoding + rejection recycling: up to ``K`` blocks of ``n`` in flight,
                    one real-active (RA) block and pseudo-active blocks that follow it on unverified
                    context. A pseudo-active block is spawned when the newest block has at least
                    ``ceil(r*n)`` stable tokens (RA: accepted; pseudo: leading tokens equal to the
                    model's prediction). Its draft and stable tokens carry over and are verified when
                    it is reached. Rejected draft n-grams go to an n-gram pool that persists for the
                    request; up to ``verification_size - 1`` pool candidates for the RA block are
                    verified next to the Jacobi draft, sharing its prefix KV: in the same forward as
                    tree branches, or in a second pass over only the candidates that can still win
                    (:mod:`~megatron_jf.inference.mr_verify`); the branch with the most
                    greedily-matching tokens is verified and wins.

Stopping: any of ``eos_ids`` (kept in the output, nothing after it emitted, counted or cached),
stop strings (needs ``detokenize``; the output ends right before the first occurrence of any of them,
see :class:`GenerationResult`), and ``max_new_tokens`` exactly.

Batching: :class:`BatchSession` (``Engine.open_batch``) is the step-level API -- rows carry their own
decode config, sampling parameters, ``max_new_tokens``, EOS ids and stop strings, join between steps and
leave when finished or removed; :meth:`Engine.generate` is one session stepped to the end.
"""

from __future__ import annotations

import itertools
import math
import random
import struct
import zlib
import time
from dataclasses import dataclass, field

import torch

from megatron_jf.inference import mr_verify as mr_verify_mod
from megatron_jf.inference.ngram_pool import NGramPool
from megatron_jf.inference.sampling import SamplingParams, argmax_list, verify
from megatron_jf.inference.forward import forward_logits
from megatron_jf.models.gpt import new_kv_cache, unwrap

DECODERS = ("ar", "jacobi", "running-window", "mr")
DRAFT_INITS = ("context", "repeat")


@dataclass(frozen=True)
class DecodeConfig:
    """Decoder choice and its parameters.

    Attributes:
        decoder: one of ``DECODERS``.
        block_size: n, draft tokens per block (jacobi, running-window, mr).
        num_blocks: K, blocks in flight (mr; 1 = rejection recycling only).
        spawn_threshold: r in (0, 1]; a pseudo-active block spawns at ``ceil(r*n)`` stable tokens (mr).
        verification_size: drafts verified per forward for the RA block, the Jacobi draft included (mr).
        ngram_pool_size: n-grams kept per first token in the pool (mr).
        draft_init: ``context`` (tokens drawn uniformly from prompt + output, as the paper's
            trajectories are initialised) or ``repeat`` (the last token repeated).

    Raises:
        ValueError: unknown decoder or draft init, n < 1, K < 1, r outside (0, 1], verification size < 1.
    """

    decoder: str = "ar"
    block_size: int = 16
    num_blocks: int = 2
    spawn_threshold: float = 0.85
    verification_size: int = 4
    ngram_pool_size: int = 8
    draft_init: str = "context"

    def __post_init__(self):
        if self.decoder not in DECODERS:
            raise ValueError(f"unknown decoder {self.decoder!r}; choose one of {', '.join(DECODERS)}")
        if self.block_size < 1:
            raise ValueError(f"block size n must be >= 1, got {self.block_size}")
        if self.num_blocks < 1:
            raise ValueError(f"number of blocks K must be >= 1, got {self.num_blocks}")
        if not 0 < self.spawn_threshold <= 1:
            raise ValueError(f"spawn threshold r must be in (0, 1], got {self.spawn_threshold}")
        if self.verification_size < 1:
            raise ValueError(f"verification size must be >= 1, got {self.verification_size}")
        if self.draft_init not in DRAFT_INITS:
            raise ValueError(f"unknown draft init {self.draft_init!r}; choose one of {', '.join(DRAFT_INITS)}")
        if self.decoder == "mr" and self.num_blocks > 1 and math.ceil(self.spawn_threshold * self.block_size) >= self.block_size:
            # the RA block has at most n-1 accepted tokens while in flight (it retires at n), so a pseudo-active
            # block needs ceil(r*n) <= n-1 to ever spawn
            import warnings

            warnings.warn(f"mr with K={self.num_blocks} never spawns a second block: r={self.spawn_threshold} needs "
                          f"ceil(r*n)={math.ceil(self.spawn_threshold * self.block_size)} stable tokens in a block of "
                          f"n={self.block_size}, which retires at n; this runs as K=1 (use r <= "
                          f"{(self.block_size - 1) / self.block_size:.3g})", UserWarning, stacklevel=3)


@dataclass
class GenerationResult:
    """Output and metrics of one request.

    Attributes:
        tokens: emitted token ids (EOS included when it ended the output). With a stop string: the tokens
            whose text lies entirely before its first occurrence.
        finish_reason: ``eos``, ``stop`` (a stop string) or ``length``.
        tail_text: with a stop string, the text between ``detokenize(tokens)`` and the stop string (the
            start of a token that straddles it; usually ``""``). The output text is
            ``detokenize(tokens) + tail_text``.
        forwards: decode forward passes (prefill not counted).
        accepted: tokens emitted by each decode forward.
        prefill_s, decode_s: wall seconds.
        trajectory: per block (when recorded): ``{"context_len", "drafts": [[n tokens]...], "fixed_point"}``.
        draft_lens: per decode forward, draft tokens verified (the winning branch; 0 for AR).
        draft_accepted: per decode forward, how many of them were accepted and emitted (the leading ones;
            the correction/bonus token is not a draft token). Speculative-decoding counters in vLLM's
            sense: drafts = forwards with ``draft_lens > 0``.
    """

    tokens: list[int]
    finish_reason: str
    forwards: int
    accepted: list[int]
    prefill_s: float
    decode_s: float
    prompt_len: int
    trajectory: list[dict] | None = None
    tail_text: str = ""
    draft_lens: list[int] = field(default_factory=list)
    draft_accepted: list[int] = field(default_factory=list)

    @property
    def tpf(self) -> float:
        """Tokens per forward: emitted tokens / decode forwards (after EOS truncation)."""
        return len(self.tokens) / max(self.forwards, 1)

    @property
    def tps(self) -> float:
        """Emitted tokens per second of decode time."""
        return len(self.tokens) / self.decode_s if self.decode_s > 0 else float("nan")


@dataclass
class _Row:
    key: int
    prompt: list[int]
    cfg: DecodeConfig
    sampling: SamplingParams
    max_new: int
    eos_ids: frozenset
    stops: tuple[str, ...]
    slot: int = -1
    out: list[int] = field(default_factory=list)
    sent: int = 0                                     # tokens of `out` passed to on_tokens so far
    last: int = 0
    draft: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)   # mr: end offsets (output index) of blocks in flight
    block_end: int = 0                                # jacobi: output index where the current block ends
    done: bool = False
    finish: str = ""
    tail: str = ""
    forwards: int = 0
    accepted: list[int] = field(default_factory=list)
    draft_lens: list[int] = field(default_factory=list)
    draft_accepted: list[int] = field(default_factory=list)
    rng: random.Random | None = None
    gen: torch.Generator | None = None
    pool: NGramPool | None = None
    spare: int | None = None                          # prediction just past the draft (mr spawn seed)
    traj: list[dict] | None = None
    prefill_s: float = 0.0
    decode_s: float = 0.0
    # per-forward layout, filled before each forward
    n_main: int = 0
    cands: list[list[int]] = field(default_factory=list)


def forward_width(cfg: DecodeConfig) -> int:
    """Tokens one row forwards per decode step under ``cfg`` (``last`` + drafts + recycled candidates):
    AR 1, Jacobi / running window ``n + 1``, MR ``1 + K*n + (v-1)*n``."""
    n = cfg.block_size
    return {"ar": 1, "jacobi": n + 1, "running-window": n + 1,
            "mr": 1 + cfg.num_blocks * n + (cfg.verification_size - 1) * n}[cfg.decoder]


class Engine:
    """Greedy/sampled generation with the decoders above.

    Args:
        model: a :class:`~megatron_jf.models.gpt.JFGPTModel` (eval mode), pipeline size 1. Under tensor
            parallelism every rank runs the same calls (same prompts and seeds): logits are gathered,
            so all ranks make the same decisions.
        max_context: the model's context window (prompt + output), tokens.
        mr_verify: how MR verifies recycled candidates: ``tree`` (one forward), ``pruned`` (main chain, then
            only the candidates that can still win) or ``auto`` (``MEGATRON_JF_MR_VERIFY``, else pruned on CPU,
            tree on CUDA); see :mod:`megatron_jf.inference.mr_verify`. Output is the same either way.

    Raises:
        ValueError: an unknown ``mr_verify``.
    """

    def __init__(self, model, max_context: int | None = None, check_invariants: bool = False,
                 mr_verify: str = "auto"):
        self.model = model
        self.check_invariants = check_invariants  # tests: assert the KV-cache length after every step
        m = unwrap(model)
        self.max_context = max_context or m.model_args.max_position_embeddings
        self.vocab_size = m.vocab_size_unpadded
        self.mr_verify = mr_verify_mod.resolve_mode(mr_verify, next(m.parameters()).device)

    # ------------------------------------------------------------------ public API
    def open_batch(self, capacity: int, *, max_width: int = 256, max_len: int | None = None,
                   detokenize=None, split_min_saving: int | None = 256) -> "BatchSession":
        """A step-level decoding session of at most ``capacity`` rows (continuous batching).

        Args:
            capacity: most rows decoding at once (KV-cache rows, reused as rows finish).
            max_width: most tokens one row may forward per step (see :func:`forward_width`); rows whose
                config needs more are refused by :meth:`BatchSession.add`.
            max_len: KV slots per row (default ``max_context + max_width + 1``).
            detokenize: ``ids -> str``, needed by rows with stop strings.
            split_min_saving: a step runs as two forwards (wide rows, then narrow ones such as AR next to
                MR) when that saves at least this many padded tokens; None: always one forward.
        """
        return BatchSession(self, capacity, max_width=max_width, max_len=max_len, detokenize=detokenize,
                            split_min_saving=split_min_saving)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], config: DecodeConfig = DecodeConfig(), *,
                 max_new_tokens: int = 128, sampling: SamplingParams = SamplingParams(),
                 eos_ids: frozenset[int] | set[int] = frozenset(), stop_strings: tuple[str, ...] = (),
                 detokenize=None, record_trajectory: bool = False, on_tokens=None) -> list[GenerationResult]:
        """Generate for a batch of prompts (rows decode independently; shapes are padded per forward).

        One :class:`BatchSession` with every prompt added up front, stepped until all rows finish.

        Args:
            prompts: token ids per request (each non-empty).
            config: decoder and its parameters.
            max_new_tokens: exact cap on emitted tokens per request (>= 1).
            sampling: greedy (default) or sampling parameters; request ``i`` uses seed ``seed + i``.
            eos_ids: tokens that end a request (kept as its last token).
            stop_strings: strings that end a request (needs ``detokenize(ids) -> str``): the output
                ends right before the first occurrence of any of them (see :class:`GenerationResult`).
            record_trajectory: keep every block's intermediate drafts (``jacobi`` decoder only).
            on_tokens: optional callback ``(row_index, new_token_ids)`` called as tokens are final
                (with stop strings, tokens that may start a stop string are held back until decided).

        Returns:
            one :class:`GenerationResult` per prompt, in order.

        Raises:
            ValueError: an empty prompt, a prompt that leaves no room in the context window for
                ``max_new_tokens``, ``max_new_tokens < 1``, stop strings without ``detokenize``, or
                trajectory recording with a decoder other than ``jacobi``.
        """
        if not prompts:
            return []
        width = forward_width(config)
        max_len = max(len(p) for p in prompts) + max_new_tokens + width + 1
        sess = BatchSession(self, len(prompts), max_width=width, max_len=max_len, detokenize=detokenize)
        for i, p in enumerate(prompts):
            sess.add(p, config, max_new_tokens=max_new_tokens, sampling=sampling, seed=sampling.seed + i,
                     eos_ids=eos_ids, stop_strings=stop_strings, record_trajectory=record_trajectory,
                     name=f"prompt {i}")
        results: dict[int, GenerationResult] = {}
        while sess.num_rows:
            for key, res in sess.step(on_tokens):
                results[key] = res
        return [results[i] for i in range(len(prompts))]


class BatchSession:
    """Continuous batching: rows with their own decode config, sampling parameters, ``max_new_tokens``,
    EOS ids and stop strings decode together, one forward per :meth:`step` for every row.

    A row :meth:`add`-ed between steps is prefilled at the start of the next step and then joins that
    step's decode forward; a row :meth:`remove`-d (e.g. its client disconnected) leaves before the next
    forward. Rows occupy a compact prefix of the KV-cache rows (a finishing row's slot is filled by the
    last row), so a forward covers only the live rows. When rows forward very different numbers of tokens
    (AR next to MR), the step runs as two forwards -- wide rows, then narrow ones -- rather than padding
    every row to the widest (``split_min_saving``). A row's output does not depend on the other rows
    (shapes are padded per forward), so greedy output equals offline :meth:`Engine.generate`, and sampled
    rows draw from their own seeded generator.

    Create with :meth:`Engine.open_batch`. Not thread-safe: one thread calls add/remove/step.
    """

    def __init__(self, engine: Engine, capacity: int, *, max_width: int, max_len: int | None, detokenize,
                 split_min_saving: int | None = 256):
        if capacity < 1 or max_width < 1:
            raise ValueError(f"capacity and max_width must be >= 1, got {capacity}, {max_width}")
        self.engine = engine
        self.model = engine.model
        self.max_context = engine.max_context
        self.capacity = capacity
        self.max_width = max_width
        self.max_len = max_len or (engine.max_context + max_width + 1)
        self.detokenize = detokenize
        self.split_min_saving = split_min_saving
        self.cache = new_kv_cache(self.model, capacity, self.max_len)
        self._rows: list[_Row] = []        # live rows; row i sits in cache slot i
        self._pending: list[_Row] = []     # added, not prefilled yet
        self._keys = itertools.count()

    # ------------------------------------------------------------------ rows in and out
    @property
    def num_rows(self) -> int:
        """Rows decoding or waiting for their prefill."""
        return len(self._rows) + len(self._pending)

    @property
    def free(self) -> int:
        """Rows that can still be added."""
        return self.capacity - self.num_rows

    def add(self, prompt: list[int], config: DecodeConfig = DecodeConfig(), *, max_new_tokens: int = 128,
            sampling: SamplingParams = SamplingParams(), seed: int | None = None,
            eos_ids: frozenset[int] | set[int] = frozenset(), stop_strings: tuple[str, ...] = (),
            record_trajectory: bool = False, name: str = "prompt") -> int:
        """Queue one request; it joins at the next :meth:`step`. Returns its key (for results and on_tokens).

        Args:
            prompt: token ids (non-empty).
            config, max_new_tokens, eos_ids, stop_strings, record_trajectory: as in :meth:`Engine.generate`.
            sampling: greedy or sampled; ``seed`` (default ``sampling.seed``) seeds this row's sampling
                generator. The draft initialisation is seeded by ``sampling.seed`` and the prompt.

        Raises:
            ValueError: no free row, an empty prompt, prompt + ``max_new_tokens`` past the context window,
                ``max_new_tokens < 1``, a config wider than ``max_width`` tokens per forward, stop strings
                without a detokenize function, trajectories with a decoder other than ``jacobi``.
        """
        if self.free <= 0:
            raise ValueError(f"the batch is full ({self.capacity} rows)")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if stop_strings and self.detokenize is None:
            raise ValueError("stop strings need a detokenize function")
        if record_trajectory and config.decoder != "jacobi":
            raise ValueError("trajectories are recorded by the 'jacobi' decoder")
        if len(prompt) == 0:
            raise ValueError(f"{name} is empty")
        if len(prompt) + max_new_tokens > self.max_context:
            raise ValueError(f"{name} has {len(prompt)} tokens; with max_new_tokens={max_new_tokens} it exceeds "
                             f"the context window of {self.max_context} tokens")
        w = forward_width(config)
        if w > self.max_width:
            raise ValueError(f"decode config forwards {w} tokens per step; this batch allows at most {self.max_width}")
        if len(prompt) + max_new_tokens + w + 1 > self.max_len:
            raise ValueError(f"{name}: prompt + max_new_tokens + {w} draft tokens exceed the KV cache "
                             f"({self.max_len} slots)")
        r = _Row(key=next(self._keys), prompt=list(prompt), cfg=config, sampling=sampling, max_new=max_new_tokens,
                 eos_ids=frozenset(eos_ids), stops=tuple(stop_strings), last=prompt[-1])
        # draft initialisation depends on the prompt and seed only, not on the batch it runs in
        r.rng = random.Random(zlib.crc32(struct.pack(f"<q{len(prompt)}q", sampling.seed, *prompt)))
        if not sampling.greedy:
            r.gen = torch.Generator().manual_seed(sampling.seed if seed is None else seed)
        n = config.block_size
        if config.decoder == "jacobi":
            r.block_end = n
            r.draft = self._init(r, n)
            if record_trajectory:
                r.traj = [{"context_len": len(r.prompt), "drafts": [list(r.draft)]}]
        elif config.decoder == "running-window":
            r.draft = self._init(r, n)
        elif config.decoder == "mr":
            r.blocks = [n]
            r.draft = self._init(r, n)
            r.pool = NGramPool(ngram_len=n, max_per_key=config.ngram_pool_size)
        self._pending.append(r)
        return r.key

    def remove(self, key: int) -> bool:
        """Drop a row (waiting or decoding) now: it takes no further forward and yields no result.
        Returns False when ``key`` is not in the batch (already finished or removed)."""
        for lst in (self._pending, self._rows):
            for i, r in enumerate(lst):
                if r.key == key:
                    if lst is self._rows:
                        self._release(i)
                    else:
                        del lst[i]
                    return True
        return False

    def _release(self, i: int) -> None:
        """Free cache slot ``i``: the last live row moves into it, so live rows stay a prefix."""
        last = len(self._rows) - 1
        if i != last:
            moved = self._rows[last]
            self.cache.copy_row(last, i)
            moved.slot = i
            self._rows[i] = moved
        self.cache.lengths[last] = 0
        self._rows.pop()

    # ------------------------------------------------------------------ one step
    @torch.no_grad()
    def step(self, on_tokens=None) -> list[tuple[int, GenerationResult]]:
        """Prefill rows added since the last step, then one decode forward for every live row.

        Args:
            on_tokens: optional ``(key, new_token_ids)`` callback for tokens that became final.

        Returns:
            ``(key, GenerationResult)`` for each row that finished in this step (its slot is freed).
        """
        if self._pending:
            self._prefill()
        if not self._rows:
            return []
        t1 = time.perf_counter()
        rows = self._rows
        m = len(rows)
        seqs = []
        for r in rows:
            if r.cfg.decoder == "mr":
                self._mr_candidates(r)
            else:
                r.cands = []
            r.n_main = 1 + len(r.draft)
            seq = [r.last] + r.draft
            for c in r.cands:
                seq = seq + c
            seqs.append(seq)
        a = self._arrange(seqs)
        seqs = [[r.last] + r.draft + [t for c in r.cands for t in c] for r in rows]  # rows may have moved
        groups = [(0, a), (a, m)] if a else [(0, m)]
        for lo, hi in groups:
            self._forward(lo, hi, seqs[lo:hi], on_tokens)
        dt = time.perf_counter() - t1
        for r in rows:
            r.decode_s += dt
        if self.engine.check_invariants:
            for i, r in enumerate(rows):  # the cache holds prompt + emitted tokens, all but the newest one
                want = len(r.prompt) + len(r.out) - 1
                if int(self.cache.lengths[i]) != want and not r.done:
                    raise AssertionError(f"row {r.key}: cache length {int(self.cache.lengths[i])} != {want}")
        finished = []
        for i in range(len(rows) - 1, -1, -1):
            r = rows[i]
            if r.done:
                if r.traj is not None:
                    _close_trajectory(r, r.cfg.block_size)
                finished.append((r.key, GenerationResult(
                    tokens=r.out, finish_reason=r.finish, forwards=r.forwards, accepted=r.accepted,
                    prefill_s=r.prefill_s, decode_s=r.decode_s, prompt_len=len(r.prompt), trajectory=r.traj,
                    tail_text=r.tail, draft_lens=r.draft_lens, draft_accepted=r.draft_accepted)))
                self._release(i)
        finished.reverse()
        return finished

    def _arrange(self, seqs: list[list[int]]) -> int:
        """Split the step into two forwards when rows forward very different numbers of tokens (e.g. AR
        next to MR): rows are reordered (KV rows swapped) so the wide ones come first. Returns the number
        of wide rows, or 0 for one forward. A row is narrow when its config's width (tokens per forward)
        is at most a quarter of the widest live config's; the split is taken when it saves at least
        ``split_min_saving`` padded tokens."""
        m = len(self._rows)
        if self.split_min_saving is None or m < 2:
            return 0
        ws = [forward_width(r.cfg) for r in self._rows]
        wmax = max(ws)
        narrow = [4 * w <= wmax for w in ws]
        n_wide = m - sum(narrow)
        if n_wide in (0, m):
            return 0
        lens = [len(x) for x in seqs]
        s_w = max(n for n, nr in zip(lens, narrow) if not nr)
        s_n = max(n for n, nr in zip(lens, narrow) if nr)
        if m * max(s_w, s_n) - (n_wide * s_w + (m - n_wide) * s_n) < self.split_min_saving:
            return 0
        i, j = 0, m - 1
        while True:  # partition: wide rows to the front
            while i < m and not narrow[i]:
                i += 1
            while j >= 0 and narrow[j]:
                j -= 1
            if i >= j:
                break
            self._swap(i, j)
            narrow[i], narrow[j] = narrow[j], narrow[i]
        return n_wide

    def _swap(self, i: int, j: int) -> None:
        """Exchange rows ``i`` and ``j`` (their committed keys/values, lengths and slots)."""
        c = self.cache
        li, lj = int(c.lengths[i]), int(c.lengths[j])
        ki, vi = c.k[:, i, :, :li].clone(), c.v[:, i, :, :li].clone()
        c.k[:, i, :, :lj] = c.k[:, j, :, :lj]
        c.v[:, i, :, :lj] = c.v[:, j, :, :lj]
        c.k[:, j, :, :li] = ki
        c.v[:, j, :, :li] = vi
        c.lengths[i], c.lengths[j] = lj, li
        rows = self._rows
        rows[i], rows[j] = rows[j], rows[i]
        rows[i].slot, rows[j].slot = i, j

    def _forward(self, lo: int, hi: int, seqs: list[list[int]], on_tokens) -> None:
        """One decode forward for rows ``[lo, hi)`` (their drafts and candidates in ``seqs``), then
        verification and the KV commit of each. MR candidates are verified as :mod:`mr_verify` says:
        in the same forward (``tree``) or, after the main chains, in a second pass over only the
        candidates that can still win (``pruned``)."""
        rows = self._rows[lo:hi]
        m = hi - lo
        cache = _rows_view(self.cache, lo, hi)
        pruned = self.engine.mr_verify == "pruned" and any(r.cands for r in rows)
        if pruned:
            seqs = [x[: r.n_main] for r, x in zip(rows, seqs)]  # pass 1: the main chains
        s = max(len(x) for x in seqs)
        tree = None
        if not pruned and any(r.cands for r in rows):
            tree = torch.ones(m, s, s, dtype=torch.bool).tril_()
        if m == 1 and tree is None:  # one row, one causal chain: no padding (the common batch-1 step)
            base = len(rows[0].prompt) + len(rows[0].out) - 1  # position of `last`
            toks = torch.tensor(seqs)
            pos = torch.arange(base, base + s).unsqueeze(0)
        else:
            toks = torch.zeros(m, s, dtype=torch.long)
            pos = torch.zeros(m, s, dtype=torch.long)
            for i, (r, seq) in enumerate(zip(rows, seqs)):
                base = len(r.prompt) + len(r.out) - 1
                toks[i, : len(seq)] = torch.tensor(seq)
                p = list(range(base, base + r.n_main))
                if tree is not None and r.cands:
                    for c in r.cands:
                        p += range(base + 1, base + 1 + len(c))
                    tree[i] = mr_verify_mod.tree_mask(r.n_main, [len(c) for c in r.cands], s)
                pos[i, : len(p)] = torch.tensor(p)
                pos[i, len(p):] = base + r.n_main  # padding: causal tail, never committed
        logits = forward_logits(self.model, toks, pos, kv_cache=cache, new_mask=tree)
        keep = []
        for i, r in enumerate(rows):
            main = logits[i, : r.n_main]  # row j predicts draft[j]; the last row predicts past the draft
            g = argmax_list(main)
            k_main = _matches(r.draft, g)
            best = None
            if r.cands and not pruned:
                best = mr_verify_mod.best_in_tree(main, g, k_main, logits[i], r.cands, r.n_main)
            elif r.cands:
                live = mr_verify_mod.live_candidates(r.draft, g, k_main, r.cands)
                if live:
                    best, _ = mr_verify_mod.pruned_second_pass(
                        self.model, _rows_view(cache, i, i + 1), base=len(r.prompt) + len(r.out) - 1, block=s,
                        main_logits=main, g=g, k_main=k_main, live=live)
            keep.append(self._update(r, main, g, k_main, best, on_tokens))
        cache.commit(keep)

    def _prefill(self) -> None:
        """Forward every pending row's prompt but its last token (which is ``last``, forwarded with the
        first draft) in a scratch cache and move the keys/values into free slots."""
        new, self._pending = self._pending, []
        t0 = time.perf_counter()
        P = max(len(r.prompt) for r in new)
        base = len(self._rows)
        if P > 1:
            tmp = new_kv_cache(self.model, len(new), P - 1)
            toks = torch.zeros(len(new), P - 1, dtype=torch.long)
            for i, r in enumerate(new):
                toks[i, : len(r.prompt) - 1] = torch.tensor(r.prompt[:-1])
            forward_logits(self.model, toks, torch.arange(P - 1).expand(len(new), P - 1), kv_cache=tmp,
                           return_logits=False)  # nobody reads prefill logits
            for i, r in enumerate(new):
                L = len(r.prompt) - 1
                self.cache.k[:, base + i, :, :L] = tmp.k[:, i, :, :L]
                self.cache.v[:, base + i, :, :L] = tmp.v[:, i, :, :L]
        dt = time.perf_counter() - t0
        for i, r in enumerate(new):
            r.slot = base + i
            self.cache.lengths[base + i] = len(r.prompt) - 1
            r.prefill_s = dt
            self._rows.append(r)

    def _init(self, r: _Row, k: int) -> list[int]:
        """``k`` initial draft tokens: drawn uniformly from prompt + output, or the last token repeated."""
        if k <= 0:
            return []
        if r.cfg.draft_init == "repeat":
            return [r.last] * k
        ctx_len = len(r.prompt) + len(r.out)
        picks = [r.rng.randrange(ctx_len) for _ in range(k)]
        P = len(r.prompt)
        return [r.prompt[j] if j < P else r.out[j - P] for j in picks]

    def _update(self, r: _Row, main: torch.Tensor, g: list[int], k_main: int, best, on_tokens):
        """Verify this row's winning branch, emit tokens, choose the KV slots to keep, build the next draft.

        ``main``: logits ``[n_main, V]`` of ``[last] + draft`` (``g`` their argmax, ``k_main`` the draft's greedy
        match); ``best``: the winning recycled candidate (:class:`~megatron_jf.inference.mr_verify.Branch`) or
        None for the Jacobi draft. Returns the row's ``KVCache.commit`` entry: a count (prefix of this forward's
        tokens) or slot indices.
        """
        cfg = r.cfg
        n = cfg.block_size
        greedy = r.sampling.greedy  # greedy verification needs only the argmax, computed once already
        if best is None:
            emitted = r.draft[:k_main] + [g[k_main]] if greedy else verify(r.draft, main, r.sampling, r.gen)
            slots = None
        else:
            emitted = (best.tokens[:best.matched] + [best.next_token] if greedy
                       else verify(best.tokens, best.logits, r.sampling, r.gen))
            slots = best.slots
        from_draft = len(emitted) - 1
        finish = ""
        for j, t in enumerate(emitted):
            if t in r.eos_ids:
                emitted, finish = emitted[: j + 1], "eos"
                break
        room = r.max_new - len(r.out)
        if len(emitted) > room:
            emitted = emitted[:room]
            finish = "eos" if emitted and emitted[-1] in r.eos_ids else "length"
        elif len(emitted) == room and not finish:
            finish = "length"
        prev_len = len(r.out)
        r.out.extend(emitted)
        safe = len(r.out)
        if r.stops:
            cut, tail, safe = _find_stop(r.out, r.sent, r.stops, self.detokenize)
            if cut is not None:
                del r.out[cut:]
                r.tail, finish, safe = tail, "stop", cut
                emitted = r.out[prev_len:]
                if cut < prev_len:  # the stop string began in an earlier forward's tokens: uncount them
                    total = 0
                    for j, a in enumerate(r.accepted):
                        r.accepted[j] = min(a, cut - total)
                        total += r.accepted[j]
            elif finish:
                safe = len(r.out)  # nothing can follow: whatever was held back is final
        r.forwards += 1
        r.accepted.append(len(emitted))
        r.draft_lens.append(len(r.draft) if best is None else len(best.tokens))
        r.draft_accepted.append(min(from_draft, len(emitted)))
        if on_tokens is not None and safe > r.sent:
            on_tokens(r.key, r.out[r.sent:safe])
        r.sent = max(r.sent, safe)
        # keep `last` and the emitted tokens before the new `last` (which is forwarded next time)
        keep = max(len(emitted), 0) if slots is None else slots[: len(emitted)]
        if finish:
            r.done, r.finish = True, finish
            return keep
        old_e = prev_len
        r.last = r.out[-1]
        if cfg.decoder == "ar":
            r.draft = []
        elif cfg.decoder == "jacobi":
            self._jacobi_next(r, g, from_draft)
        elif cfg.decoder == "running-window":
            nxt = g[from_draft + 1:] if best is None else []
            r.draft = (nxt + self._init(r, n - len(nxt)))[:n]
        else:
            self._mr_next(r, g, k_main, old_e)
        return keep

    def _jacobi_next(self, r: _Row, g, k):
        n = r.cfg.block_size
        e = len(r.out)
        rest = r.block_end - e  # unknown positions left in this block
        if r.traj is not None:
            blk = r.traj[-1]
        if rest > 0:
            r.draft = g[k + 1: k + 1 + rest]
            if r.traj is not None:
                start = r.block_end - n
                blk["drafts"].append(r.out[start:] + r.draft)
            return
        # the block reached its fixed point
        if r.traj is not None:
            start = r.block_end - n
            blk["fixed_point"] = r.out[start: r.block_end]
        while r.block_end <= e:
            r.block_end += n
        r.draft = self._init(r, r.block_end - e)
        if r.traj is not None:
            start = r.block_end - n
            r.traj.append({"context_len": len(r.prompt) + start, "drafts": [r.out[start:] + r.draft]})

    # ------------------------------------------------------------------ MR
    def _mr_candidates(self, r: _Row):
        """Recycled candidates for the RA part of the draft, from the n-gram pool (suffix match on the context)."""
        cfg = r.cfg
        r.cands = []
        if cfg.verification_size <= 1 or not r.draft:
            return
        ra_len = min(len(r.draft), r.blocks[0] - len(r.out))
        if ra_len <= 0:
            return
        ctx_len = len(r.prompt) + len(r.out)
        prev = (r.out[-2] if len(r.out) >= 2 else r.prompt[ctx_len - 2]) if ctx_len >= 2 else -1
        for c in r.pool.candidates(prev, r.last, cfg.verification_size - 1, exclude=tuple(r.draft[:ra_len])):
            c = c[:ra_len]
            r.cands.append(c + r.draft[len(c):ra_len])

    def _mr_next(self, r: _Row, g: list[int], k_main: int, old_e: int):
        """Jacobi-update the blocks in flight, retire completed ones, recycle rejections, maybe spawn."""
        cfg = r.cfg
        n = cfg.block_size
        e = len(r.out)
        old_draft = r.draft  # old_draft[j] guessed output index old_e + j; g[j] is this forward's prediction
        if k_main < len(old_draft):
            r.pool.add_rejected(old_draft[k_main - 1] if k_main else r.prompt[-1] if not old_e else r.out[old_e - 1],
                                old_draft[k_main:])
        shift = e - old_e
        blocks = [b for b in r.blocks if b > e]
        spare = g[len(old_draft)] if blocks and blocks[-1] == r.blocks[-1] and len(g) > len(old_draft) else None
        if not blocks:
            blocks = [(e // n + 1) * n]
        total = blocks[-1] - e
        nxt = g[shift: len(old_draft)][:total]
        r.draft = nxt + self._init(r, total - len(nxt))
        r.blocks = blocks
        if len(blocks) >= cfg.num_blocks:
            return
        start = blocks[-1] - n
        if len(blocks) == 1:
            stable = e - start  # RA block: tokens already accepted
        else:  # pseudo-active block: leading tokens the model reproduced this forward
            lo = start - old_e
            stable = 0
            while lo + stable < len(old_draft) and old_draft[lo + stable] == g[lo + stable]:
                stable += 1
        if stable >= math.ceil(cfg.spawn_threshold * n):
            head = [spare] if spare is not None else []
            r.draft = r.draft + (head + self._init(r, n - len(head)))[:n]
            r.blocks.append(blocks[-1] + n)


def _close_trajectory(r: _Row, n: int) -> None:
    """Give the last (possibly partial) block its fixed point (drafts cut to the same columns); tokens emitted
    past it by the final forward (a bonus token crossing the block end) become one more block whose only
    draft is those known tokens."""
    blk = r.traj[-1]
    if "fixed_point" not in blk:
        start = blk["context_len"] - len(r.prompt)
        fp = r.out[start: start + n]
        if fp:
            blk["fixed_point"] = fp
            blk["drafts"] = [d[: len(fp)] for d in blk["drafts"]]
        else:
            r.traj.pop()
    covered = (r.traj[-1]["context_len"] - len(r.prompt) + len(r.traj[-1]["fixed_point"])) if r.traj else 0
    if covered < len(r.out):
        extra = r.out[covered:covered + n]
        r.traj.append({"context_len": len(r.prompt) + covered, "drafts": [list(extra)], "fixed_point": list(extra)})


_matches = mr_verify_mod.matches


def _rows_view(cache, lo: int, hi: int):
    """A :class:`~megatron_jf.models.kv_cache.KVCache` over rows ``[lo, hi)`` of ``cache``, sharing its buffers
    and lengths (a forward and commit on the view act on those rows only)."""
    if lo == 0 and hi == cache.batch_size:
        return cache
    v = object.__new__(type(cache))
    v.__dict__.update(cache.__dict__)
    v.__dict__.pop("_static_decoder", None)  # a view runs its own static shapes
    v.k, v.v, v.lengths = cache.k[:, lo:hi], cache.v[:, lo:hi], cache.lengths[lo:hi]
    v.batch_size, v._step = hi - lo, None
    return v


def _find_stop(out: list[int], sent: int, stops: tuple[str, ...], detokenize) -> tuple[int | None, str, int]:
    """Stop-string search on ``text = detokenize(out)``.

    Returns ``(cut, tail, safe)``:

    * ``cut``: when ``text`` contains a stop string, the most tokens whose text is a prefix of
      ``text[:i]`` (``i``: the first index where any stop string starts), else ``None``;
    * ``tail``: the rest of ``text[:i]`` -- the part before the stop string of a token that straddles it;
    * ``safe``: without a stop, the most tokens that can be released (their text ends before any suffix of
      ``text`` that is a proper prefix of a stop string, i.e. could still become one), at least ``sent``.
    """
    text = detokenize(out)
    first = min((i for i in (text.find(s) for s in stops) if i >= 0), default=None)
    if first is not None:
        want = text[:first]
        c = max(_prefix_tokens(out, want, 0, detokenize), sent)
        return c, want[len(detokenize(out[:c])):], c
    hold = len(text.rstrip("\ufffd"))  # an incomplete character may still complete to a stop string
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                hold = min(hold, len(text) - k)
                break
    if hold == len(text):
        return None, "", len(out)
    return None, "", _prefix_tokens(out, text[:hold], sent, detokenize)


def _prefix_tokens(out: list[int], want: str, lo: int, detokenize) -> int:
    """The largest ``c >= lo`` (``c <= len(out)``) with ``detokenize(out[:c])`` a prefix of ``want``
    (``lo`` itself when none is larger)."""
    for c in range(len(out), lo, -1):
        t = detokenize(out[:c])
        if want.startswith(t) and not (t.endswith("\ufffd") and not want[:len(t)].endswith("\ufffd")):
            return c
    return lo
