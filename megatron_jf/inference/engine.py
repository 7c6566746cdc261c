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
                    verified in the same forward next to the Jacobi draft (as extra branches of one
                    row under a tree mask, sharing the prefix KV instead of copying it per candidate);
                    the candidate with the most greedily-matching tokens is verified and wins.

Stopping: any of ``eos_ids`` (kept in the output, nothing after it emitted, counted or cached),
stop strings (needs ``detokenize``; output cut before the string), and ``max_new_tokens`` exactly.
"""

from __future__ import annotations

import math
import random
import struct
import zlib
import time
from dataclasses import dataclass, field

import torch

from megatron_jf.inference.ngram_pool import NGramPool
from megatron_jf.inference.sampling import SamplingParams, verify
from megatron_jf.models.gpt import forward_logits, new_kv_cache, unwrap

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


@dataclass
class GenerationResult:
    """Output and metrics of one request.

    Attributes:
        tokens: emitted token ids (EOS included when it ended the output).
        finish_reason: ``eos``, ``stop`` (a stop string) or ``length``.
        forwards: decode forward passes (prefill not counted).
        accepted: tokens emitted by each decode forward.
        prefill_s, decode_s: wall seconds.
        trajectory: per block (when recorded): ``{"context_len", "drafts": [[n tokens]...], "fixed_point"}``.
    """

    tokens: list[int]
    finish_reason: str
    forwards: int
    accepted: list[int]
    prefill_s: float
    decode_s: float
    prompt_len: int
    trajectory: list[dict] | None = None

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
    idx: int
    prompt: list[int]
    out: list[int] = field(default_factory=list)
    last: int = 0
    draft: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)   # mr: end offsets (output index) of blocks in flight
    block_end: int = 0                                # jacobi: output index where the current block ends
    done: bool = False
    finish: str = ""
    forwards: int = 0
    accepted: list[int] = field(default_factory=list)
    rng: random.Random | None = None
    gen: torch.Generator | None = None
    pool: NGramPool | None = None
    spare: int | None = None                          # prediction just past the draft (mr spawn seed)
    traj: list[dict] | None = None
    decode_s: float = 0.0
    # per-forward layout, filled by _plan
    n_main: int = 0
    cands: list[list[int]] = field(default_factory=list)


class Engine:
    """Greedy/sampled generation with the decoders above.

    Args:
        model: a :class:`~megatron_jf.models.gpt.JFGPTModel` (eval mode), pipeline size 1. Under tensor
            parallelism every rank runs the same calls (same prompts and seeds): logits are gathered,
            so all ranks make the same decisions.
        max_context: the model's context window (prompt + output), tokens.
    """

    def __init__(self, model, max_context: int | None = None, check_invariants: bool = False):
        self.model = model
        self.check_invariants = check_invariants  # tests: assert the KV-cache length after every step
        m = unwrap(model)
        self.max_context = max_context or m.model_args.max_position_embeddings
        self.vocab_size = m.vocab_size_unpadded

    # ------------------------------------------------------------------ public API
    @torch.no_grad()
    def generate(self, prompts: list[list[int]], config: DecodeConfig = DecodeConfig(), *,
                 max_new_tokens: int = 128, sampling: SamplingParams = SamplingParams(),
                 eos_ids: frozenset[int] | set[int] = frozenset(), stop_strings: tuple[str, ...] = (),
                 detokenize=None, record_trajectory: bool = False, on_tokens=None) -> list[GenerationResult]:
        """Generate for a batch of prompts (rows decode independently; shapes are padded per forward).

        Args:
            prompts: token ids per request (each non-empty).
            config: decoder and its parameters.
            max_new_tokens: exact cap on emitted tokens per request (>= 1).
            sampling: greedy (default) or sampling parameters; request ``i`` uses seed ``seed + i``.
            eos_ids: tokens that end a request (kept as its last token).
            stop_strings: strings that end a request (needs ``detokenize(ids) -> str``); the output is
                cut before the string.
            record_trajectory: keep every block's intermediate drafts (``jacobi`` decoder only).
            on_tokens: optional callback ``(row_index, new_token_ids)`` called as tokens are committed.

        Returns:
            one :class:`GenerationResult` per prompt, in order.

        Raises:
            ValueError: an empty prompt, a prompt that leaves no room in the context window for
                ``max_new_tokens``, ``max_new_tokens < 1``, stop strings without ``detokenize``, or
                trajectory recording with a decoder other than ``jacobi``.
        """
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if stop_strings and detokenize is None:
            raise ValueError("stop strings need a detokenize function")
        if record_trajectory and config.decoder != "jacobi":
            raise ValueError("trajectories are recorded by the 'jacobi' decoder")
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty")
            if len(p) + max_new_tokens > self.max_context:
                raise ValueError(f"prompt {i} has {len(p)} tokens; with max_new_tokens={max_new_tokens} it exceeds "
                                 f"the context window of {self.max_context} tokens")
        cfg = config
        n = cfg.block_size
        width = {"ar": 1, "jacobi": n + 1, "running-window": n + 1,
                 "mr": 1 + cfg.num_blocks * n + (cfg.verification_size - 1) * n}[cfg.decoder]
        B = len(prompts)
        max_len = max(len(p) for p in prompts) + max_new_tokens + width + 1
        cache = new_kv_cache(self.model, B, max_len)
        rows = [self._new_row(i, p, cfg, sampling, record_trajectory) for i, p in enumerate(prompts)]

        # prefill: everything but the last prompt token (which is `last`, forwarded with the first draft)
        t0 = time.perf_counter()
        P = max(len(p) for p in prompts)
        if P > 1:
            toks = torch.zeros(B, P - 1, dtype=torch.long)
            for r in rows:
                toks[r.idx, : len(r.prompt) - 1] = torch.tensor(r.prompt[:-1])
            forward_logits(self.model, toks, torch.arange(P - 1).expand(B, P - 1), kv_cache=cache)
            cache.commit([len(r.prompt) - 1 for r in rows])
        prefill_s = time.perf_counter() - t0

        while True:
            active = [r for r in rows if not r.done]
            if not active:
                break
            t1 = time.perf_counter()
            self._step(rows, active, cfg, cache, sampling, eos_ids, max_new_tokens, stop_strings, detokenize, on_tokens)
            dt = time.perf_counter() - t1
            for r in active:
                r.decode_s += dt
            if self.check_invariants:
                for r in rows:  # the cache holds prompt + emitted tokens, all but the newest one
                    want = len(r.prompt) + len(r.out) - 1
                    if int(cache.lengths[r.idx]) != want:
                        raise AssertionError(f"row {r.idx}: cache length {int(cache.lengths[r.idx])} != {want}")
        for r in rows:
            if r.traj is not None:
                _close_trajectory(r, cfg.block_size)
        return [GenerationResult(tokens=r.out, finish_reason=r.finish, forwards=r.forwards, accepted=r.accepted,
                                 prefill_s=prefill_s, decode_s=r.decode_s, prompt_len=len(r.prompt),
                                 trajectory=r.traj) for r in rows]

    # ------------------------------------------------------------------ rows
    def _new_row(self, i, prompt, cfg, sampling, record):
        r = _Row(idx=i, prompt=list(prompt), last=prompt[-1])
        # draft initialisation depends on the prompt and seed only, not on the batch it runs in
        r.rng = random.Random(zlib.crc32(struct.pack(f"<q{len(prompt)}q", sampling.seed, *prompt)))
        if not sampling.greedy:
            r.gen = torch.Generator().manual_seed(sampling.seed + i)
        n = cfg.block_size
        if cfg.decoder == "jacobi":
            r.block_end = n
            r.draft = self._init(r, n, cfg)
            if record:
                r.traj = [{"context_len": len(r.prompt), "drafts": [list(r.draft)]}]
        elif cfg.decoder == "running-window":
            r.draft = self._init(r, n, cfg)
        elif cfg.decoder == "mr":
            r.blocks = [n]
            r.draft = self._init(r, n, cfg)
            r.pool = NGramPool(ngram_len=n, max_per_key=cfg.ngram_pool_size)
        return r

    def _init(self, r: _Row, k: int, cfg: DecodeConfig) -> list[int]:
        """``k`` initial draft tokens: drawn uniformly from prompt + output, or the last token repeated."""
        if k <= 0:
            return []
        if cfg.draft_init == "repeat":
            return [r.last] * k
        ctx_len = len(r.prompt) + len(r.out)
        picks = [r.rng.randrange(ctx_len) for _ in range(k)]
        P = len(r.prompt)
        return [r.prompt[j] if j < P else r.out[j - P] for j in picks]

    # ------------------------------------------------------------------ one iteration for all active rows
    def _step(self, rows, active, cfg, cache, sampling, eos_ids, max_new, stop_strings, detokenize, on_tokens):
        B = len(rows)
        seqs, masks, poss = {}, {}, {}
        for r in active:
            if cfg.decoder == "mr":
                self._mr_candidates(r, cfg)
            r.n_main = 1 + len(r.draft)
            seq = [r.last] + r.draft
            for c in r.cands:
                seq = seq + c
            seqs[r.idx] = seq
        s = max(len(x) for x in seqs.values())
        toks = torch.zeros(B, s, dtype=torch.long)
        pos = torch.zeros(B, s, dtype=torch.long)
        tree = None
        if any(r.cands for r in active):
            tree = torch.ones(B, s, s, dtype=torch.bool).tril_()
        for r in active:
            seq = seqs[r.idx]
            base = len(r.prompt) + len(r.out) - 1  # position of `last`
            toks[r.idx, : len(seq)] = torch.tensor(seq)
            p = list(range(base, base + r.n_main))
            off = r.n_main
            for c in r.cands:
                p += list(range(base + 1, base + 1 + len(c)))
                # a candidate sees `last` and itself, not the main chain or other candidates
                tree[r.idx, off:off + len(c), 1:off] = False
                tree[r.idx, off:, off:off + len(c)] &= False
                tree[r.idx, off:off + len(c), off:off + len(c)] = torch.ones(len(c), len(c), dtype=torch.bool).tril_()
                off += len(c)
            pos[r.idx, : len(p)] = torch.tensor(p)
            pos[r.idx, len(p):] = base + r.n_main  # padding: causal tail, never committed
        for r in rows:
            if r.done:  # finished rows forward padding; their cache length does not move
                pos[r.idx] = len(r.prompt) + len(r.out)
        logits = forward_logits(self.model, toks, pos, kv_cache=cache, new_mask=tree)
        keep = []
        for r in rows:
            if r.done:
                keep.append(0)
                continue
            keep.append(self._update(r, logits[r.idx], cfg, sampling, eos_ids, max_new, stop_strings, detokenize,
                                     on_tokens))
        cache.commit(keep)

    def _update(self, r: _Row, logits: torch.Tensor, cfg, sampling, eos_ids, max_new, stop_strings, detokenize,
                on_tokens):
        """Verify this row's drafts, emit tokens, choose the KV slots to keep, build the next draft.

        Returns the row's ``KVCache.commit`` entry: a count (prefix of this forward's tokens) or slot indices.
        """
        n = cfg.block_size
        main = logits[: r.n_main]  # row j predicts draft[j]; the last row predicts past the draft
        g = main.argmax(-1).tolist()
        k_main = _matches(r.draft, g)
        best = None
        if r.cands:
            # pick the branch by greedy match length: a function of the logits only, so the stochastic
            # verification below stays lossless when sampling
            best_k, off = k_main, r.n_main
            for c in r.cands:
                lg = torch.cat([main[:1], logits[off: off + len(c)]], 0)
                k = _matches(c, lg.argmax(-1).tolist())
                if k > best_k:
                    best_k, best = k, (c, lg, off)
                off += len(c)
        if best is None:
            emitted = verify(r.draft, main, sampling, r.gen)
            slots = None
        else:
            c, lg, off = best
            emitted = verify(c, lg, sampling, r.gen)
            slots = [0] + list(range(off, off + len(emitted) - 1))
        from_draft = len(emitted) - 1
        finish = ""
        for j, t in enumerate(emitted):
            if t in eos_ids:
                emitted, finish = emitted[: j + 1], "eos"
                break
        room = max_new - len(r.out)
        if len(emitted) > room:
            emitted = emitted[:room]
            finish = "eos" if emitted and emitted[-1] in eos_ids else "length"
        elif len(emitted) == room and not finish:
            finish = "length"
        prev_len = len(r.out)
        r.out.extend(emitted)
        if stop_strings and finish != "eos":
            cut = _find_stop(r.out, prev_len, stop_strings, detokenize)
            if cut is not None:
                del r.out[cut:]
                emitted, finish = r.out[prev_len:], "stop"
        r.forwards += 1
        r.accepted.append(len(emitted))
        if on_tokens is not None and emitted:
            on_tokens(r.idx, list(emitted))
        # keep `last` and the emitted tokens before the new `last` (which is forwarded next time)
        keep = len(emitted) if slots is None else slots[: len(emitted)]
        if finish:
            r.done, r.finish = True, finish
            return keep
        old_e = prev_len
        r.last = r.out[-1]
        if cfg.decoder == "ar":
            r.draft = []
        elif cfg.decoder == "jacobi":
            self._jacobi_next(r, g, from_draft, cfg)
        elif cfg.decoder == "running-window":
            nxt = g[from_draft + 1:] if best is None else []
            r.draft = (nxt + self._init(r, n - len(nxt), cfg))[:n]
        else:
            self._mr_next(r, g, k_main, old_e, cfg)
        return keep

    def _jacobi_next(self, r: _Row, g, k, cfg):
        n = cfg.block_size
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
        r.draft = self._init(r, r.block_end - e, cfg)
        if r.traj is not None:
            start = r.block_end - n
            r.traj.append({"context_len": len(r.prompt) + start, "drafts": [r.out[start:] + r.draft]})

    # ------------------------------------------------------------------ MR
    def _mr_candidates(self, r: _Row, cfg):
        """Recycled candidates for the RA part of the draft, from the n-gram pool (suffix match on the context)."""
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

    def _mr_next(self, r: _Row, g: list[int], k_main: int, old_e: int, cfg):
        """Jacobi-update the blocks in flight, retire completed ones, recycle rejections, maybe spawn."""
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
        r.draft = nxt + self._init(r, total - len(nxt), cfg)
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
            r.draft = r.draft + (head + self._init(r, n - len(head), cfg))[:n]
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


def _matches(draft: list[int], g: list[int]) -> int:
    """Length of the longest prefix of ``draft`` equal to the greedy predictions ``g`` (``g[j]`` predicts ``draft[j]``)."""
    k = 0
    while k < len(draft) and draft[k] == g[k]:
        k += 1
    return k


def _find_stop(out: list[int], new_from: int, stops: tuple[str, ...], detokenize) -> int | None:
    """Smallest token count ``c >= new_from`` such that ``detokenize(out[:c])`` contains a stop string; the
    output is then cut to the tokens before the one completing it."""
    text = detokenize(out)
    if not any(s in text for s in stops):
        return None
    for c in range(new_from + 1, len(out) + 1):
        t = detokenize(out[:c])
        if any(s in t for s in stops):
            return c - 1
    return None
