"""Trajectory collection: prompts -> greedy Jacobi trajectories -> WebDataset shards (paper Sec. 3.1, 4.1).

This module holds the reusable part of ``tools/generate_trajectories.py``: reading and checking
prompt files, tokenising, data-parallel slicing and batching, turning the engine's recorded
trajectories into :class:`~megatron_jf.data.trajectory.TrajectoryRecord`\\ s, the repetition filter,
and the resume logic (which prompts are already collected). The tool only parses arguments, sets up
``torch.distributed``, loads the model and reports progress.

Prompt files (JSONL, UTF-8, one object per line; blank lines are skipped)
---------------------------------------------------------------------------
Each object has an ``id`` (a non-empty string, or an integer that becomes its decimal string;
unique in the file) and exactly one of

* ``prompt``: raw text, tokenised as is (no chat template, no BOS, whitespace and newlines kept
  byte for byte -- the reference collector collapsed whitespace);
* ``messages``: chat turns ``[{"role", "content"}, ...]`` rendered with the tokenizer's own chat
  template (generation prompt appended) and then tokenised;
* ``prompt_ids``: already tokenised ids (no tokenizer needed).

Any other key is an error. Every error names the file and the 1-based line.

Recorded trajectories (what improves on the reference collector, report Sec. 3.1)
---------------------------------------------------------------------------------
Every block stores its context length, *every* iterate fed to the model -- ``drafts[0]`` is the
true initial draft (a fresh tensor, never an alias), known tokens at the block start
included -- and its fixed point, which is the greedy AR output for that context. Prompts are
batched (the reference collector: batch 1 only); draft initialisation never sees padding.

End of a sample: decoding stops at the first EOS (any of ``eos_ids``) or after ``max_new_tokens``.
The last block is then cut right after the EOS (or at the length limit): its fixed point and all of
its drafts keep only the columns up to and including the EOS, and ``eos_reached`` is True iff the
response ends with an EOS. A final block may therefore be shorter than ``n``. (The engine drops a
token emitted *past* the end of a block in the very forward that finished the request; such a
token -- at most ``n`` of them, in practice one -- is stored as one more block whose only draft is
the token itself, which is what the engine records for a known token at a block start.)

Output directory layout (``--out``)
-----------------------------------
* ``traj-dpRRRRR-IIIIII.tar`` -- shards of data-parallel rank ``RRRRR``, index ``IIIIII``
  (written by :class:`~megatron_jf.data.shards.TrajectoryShardWriter`: temporary name, renamed when
  complete; a kill leaves only hidden ``.traj-...tar.partial-PID`` files, which a re-run deletes);
* ``traj-dpRRRRR.skipped.jsonl`` -- prompts that produced no record (``{"id", "reason",
  "category"}`` per line): degenerate responses (repetition filter) and prompts too long for the
  context window;
* ``collect_config.json`` -- the settings a resumed run must repeat (model, block size, ...);
* ``manifest.json`` -- written last, after every rank finished: shard list and counts.

Resume: a prompt whose id is in a complete shard or in a skip ledger is not collected again, so a
killed run re-run with the same command ends with every prompt exactly once. Two runs must never
write to the same directory at the same time.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import time
import zlib
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch

from .filters import degeneracy_reason
from .shards import ShardEntry, index_shard, write_manifest
from .trajectory import BlockTrajectory, TrajectoryRecord

__all__ = [
    "PROMPT_KINDS",
    "PromptSpec",
    "TokenizedPrompt",
    "read_prompts",
    "tokenize_prompt",
    "tokenize_prompts",
    "split_too_long",
    "rank_slice",
    "iter_batches",
    "batch_seed",
    "build_record",
    "filter_reason",
    "filter_category",
    "CollectConfig",
    "CollectStats",
    "collect",
    "keep_result",
    "SkipLedger",
    "shard_prefix",
    "ShardSummary",
    "ResumeState",
    "prepare_output_dir",
    "scan_output_dir",
    "next_shard_index",
    "write_collection_manifest",
    "find_shards",
    "CONFIG_NAME",
    "MANIFEST_NAME",
]

PROMPT_KINDS = ("prompt", "messages", "prompt_ids")
_ALLOWED_KEYS = ("id",) + PROMPT_KINDS
CONFIG_NAME = "collect_config.json"
MANIFEST_NAME = "manifest.json"
_SHARD_RE = re.compile(r"^(traj-dp(\d{5}))-(\d{6})\.tar$")
_LEDGER_RE = re.compile(r"^traj-dp(\d{5})\.skipped\.jsonl$")
_PARTIAL_RE = re.compile(r"^\..+\.partial-\d+$")
_CONFIG_FORMAT = "megatron-jf-collect-config"


# ============================================================================ prompts
@dataclass(frozen=True)
class PromptSpec:
    """One prompt as read from the JSONL file (not yet tokenised).

    Attributes:
        sample_id: the prompt's id (a string; integer ids are converted to their decimal string).
        kind: ``"prompt"`` (raw text), ``"messages"`` (chat turns) or ``"prompt_ids"`` (token ids).
        value: the text, the list of ``{"role", "content"}`` dicts, or the list of ids.
        where: ``"<file>:<line>"`` for error messages.
    """

    sample_id: str
    kind: str
    value: Any
    where: str


@dataclass(frozen=True)
class TokenizedPrompt:
    """A prompt ready for decoding: ``ids`` is its token ids (``list[int]``, non-empty)."""

    sample_id: str
    ids: list
    where: str


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _parse_line(obj: Any, where: str) -> PromptSpec:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    unknown = sorted(k for k in obj if k not in _ALLOWED_KEYS)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; allowed keys are {list(_ALLOWED_KEYS)}")
    if "id" not in obj:
        raise ValueError(f"{where}: missing 'id'")
    sid = obj["id"]
    if _is_int(sid):
        sid = str(sid)
    if not isinstance(sid, str) or not sid:
        raise ValueError(f"{where}: 'id' must be a non-empty string or an integer, got {obj['id']!r}")
    kinds = [k for k in PROMPT_KINDS if k in obj]
    if len(kinds) != 1:
        raise ValueError(f"{where}: id {sid!r} needs exactly one of {list(PROMPT_KINDS)}, got {kinds or 'none'}")
    kind = kinds[0]
    v = obj[kind]
    if kind == "prompt":
        if not isinstance(v, str):
            raise ValueError(f"{where}: id {sid!r}: 'prompt' must be a string, got {type(v).__name__}")
        if v == "":
            raise ValueError(f"{where}: id {sid!r}: empty 'prompt'")
    elif kind == "messages":
        if not isinstance(v, list) or not v:
            raise ValueError(f"{where}: id {sid!r}: 'messages' must be a non-empty list of "
                             f"{{'role', 'content'}} objects")
        for k, m in enumerate(v):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError(f"{where}: id {sid!r}: messages[{k}] must be an object with string 'role' and "
                                 f"'content', got {m!r}")
    else:
        if not isinstance(v, list) or not v:
            raise ValueError(f"{where}: id {sid!r}: 'prompt_ids' must be a non-empty list of token ids")
        for k, t in enumerate(v):
            if not _is_int(t) or t < 0:
                raise ValueError(f"{where}: id {sid!r}: prompt_ids[{k}] = {t!r} is not a non-negative integer")
    return PromptSpec(sample_id=sid, kind=kind, value=v, where=where)


def read_prompts(path: str) -> list[PromptSpec]:
    """Read and check a prompt JSONL file (format in the module docstring).

    Args:
        path: the ``.jsonl`` file.

    Returns:
        The prompts in file order.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: naming ``<path>:<line>``: invalid UTF-8 or JSON, not an object, unknown keys, a missing
            or bad ``id``, not exactly one prompt field, an empty/ill-typed prompt, a duplicate id
            (both lines named); or a file with no prompt at all.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"prompt file not found: {path}")
    with open(path, "rb") as f:
        data = f.read()
    out: list[PromptSpec] = []
    first_line: dict[str, str] = {}
    # split on "\n" only: JSON strings may legally contain raw U+2028/U+2029, which str.splitlines splits on
    for lineno, raw in enumerate(data.split(b"\n"), start=1):
        where = f"{path}:{lineno}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{where}: invalid UTF-8 ({e})") from None
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
        spec = _parse_line(obj, where)
        if spec.sample_id in first_line:
            raise ValueError(f"{where}: duplicate id {spec.sample_id!r} (first at {first_line[spec.sample_id]})")
        first_line[spec.sample_id] = where
        out.append(spec)
    if not out:
        raise ValueError(f"prompt file {path} has no prompts (empty or only blank lines)")
    return out


def tokenize_prompt(spec: PromptSpec, tokenizer, vocab_size: int) -> list[int]:
    """Token ids of one prompt.

    ``prompt`` text is encoded as is (``tokenizer.encode``: no BOS/EOS added, whitespace kept);
    ``messages`` are rendered with ``tokenizer.apply_chat_template(messages, add_generation_prompt=True)``
    and the text encoded (special tokens in the rendered text are recognised as such);
    ``prompt_ids`` are checked and returned.

    Args:
        spec: the prompt.
        tokenizer: a :class:`megatron_jf.tokenizer.Tokenizer`, or None (only ``prompt_ids`` then).
        vocab_size: the model's vocabulary size; every id must be below it.

    Raises:
        ValueError: naming ``spec.where`` and the id: text without a tokenizer, a template/tokenizer
            error, an empty encoding, or an id outside ``[0, vocab_size)``.
    """
    head = f"{spec.where}: id {spec.sample_id!r}"
    if spec.kind == "prompt_ids":
        ids = list(spec.value)
    else:
        if tokenizer is None:
            raise ValueError(f"{head}: a '{spec.kind}' prompt needs a tokenizer (the checkpoint has no tokenizer/ "
                             f"directory; pass --tokenizer)")
        try:
            text = spec.value if spec.kind == "prompt" else tokenizer.apply_chat_template(spec.value)
            ids = list(tokenizer.encode(text))
        except (ValueError, TypeError) as e:
            raise ValueError(f"{head}: cannot tokenize: {e}") from None
    if not ids:
        raise ValueError(f"{head}: the prompt encodes to no tokens")
    bad = next((t for t in ids if t >= vocab_size), None)
    if bad is not None:
        raise ValueError(f"{head}: token id {bad} is outside the model vocabulary [0, {vocab_size})")
    return ids


def tokenize_prompts(specs: Sequence[PromptSpec], tokenizer, vocab_size: int) -> list[TokenizedPrompt]:
    """:func:`tokenize_prompt` for each spec, in order. Raises as it does."""
    return [TokenizedPrompt(s.sample_id, tokenize_prompt(s, tokenizer, vocab_size), s.where) for s in specs]


def split_too_long(prompts: Sequence[TokenizedPrompt], max_context: int, max_new_tokens: int,
                   policy: str = "skip") -> tuple[list[TokenizedPrompt], list[TokenizedPrompt]]:
    """Separate prompts that leave no room for ``max_new_tokens`` in the context window.

    A prompt of ``P`` tokens fits iff ``P + max_new_tokens <= max_context`` (the engine's rule).

    Args:
        policy: ``"skip"`` (return them; the collector records them as ``prompt_too_long``) or
            ``"error"`` (raise on the first one).

    Returns:
        ``(fitting, too_long)``, each in input order.

    Raises:
        ValueError: ``policy == "error"`` and a prompt does not fit (names it, its length and the limit);
            an unknown policy.
    """
    if policy not in ("skip", "error"):
        raise ValueError(f"unknown long-prompt policy {policy!r}; choose 'skip' or 'error'")
    ok, long = [], []
    for p in prompts:
        if len(p.ids) + max_new_tokens <= max_context:
            ok.append(p)
        elif policy == "error":
            raise ValueError(f"{p.where}: id {p.sample_id!r}: prompt has {len(p.ids)} tokens; with --max-new-tokens "
                             f"{max_new_tokens} it exceeds the context window of {max_context} tokens "
                             f"(use --long-prompts skip to skip such prompts)")
        else:
            long.append(p)
    return ok, long


def rank_slice(items: Sequence, rank: int, world: int) -> list:
    """The data-parallel share of ``rank`` among ``world`` ranks: ``items[rank::world]`` (disjoint, covering).

    Raises:
        ValueError: ``world < 1`` or ``rank`` outside ``[0, world)``.
    """
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"bad data-parallel rank {rank} of {world}")
    return list(items[rank::world])


def iter_batches(items: Sequence, batch_size: int) -> Iterator[list]:
    """Consecutive batches of at most ``batch_size`` items. Raises ValueError if ``batch_size < 1``."""
    if batch_size < 1:
        raise ValueError(f"batch size must be >= 1, got {batch_size}")
    for i in range(0, len(items), batch_size):
        yield list(items[i:i + batch_size])


def batch_seed(seed: int, first_id: str) -> int:
    """Seed of the draft-initialisation RNG for a batch: a hash of the run seed and the batch's first id.

    The engine seeds row ``i``'s RNG with ``seed * 1000003 + i``; a per-batch seed keeps the random
    initial drafts of different batches independent instead of repeating the same index pattern.
    """
    return zlib.crc32(f"{seed}\0{first_id}".encode("utf-8"))


# ============================================================================ records
def build_record(sample_id: str, prompt_ids: Sequence[int], result, block_size: int,
                 eos_ids: frozenset | set) -> TrajectoryRecord:
    """Turn one :class:`~megatron_jf.inference.engine.GenerationResult` (with a recorded ``jacobi``
    trajectory) into a :class:`TrajectoryRecord` (paper Sec. 3.1).

    Every draft is copied into a new int64 tensor ``[S, n_b]`` (never aliasing another state or the
    fixed point). The concatenated fixed points equal ``result.tokens`` exactly; tokens the engine's
    trajectory is missing at the end (emitted past the last recorded block) become a final block
    whose only draft is those tokens (see the module docstring). ``eos_reached`` is True iff the
    request finished on an EOS, which is then the response's last token.

    Args:
        sample_id: the prompt id.
        prompt_ids: the prompt's token ids ``[P]``.
        result: the engine result; ``result.trajectory`` as documented in ``Engine.generate``.
        block_size: ``n``.
        eos_ids: the stop ids given to the engine.

    Raises:
        ValueError: no trajectory; a block whose context length, draft widths or size is inconsistent;
            fixed points that disagree with ``result.tokens``; the record fails ``validate``.
    """
    traj = result.trajectory
    if not traj:
        raise ValueError(f"sample {sample_id!r}: the engine recorded no trajectory (record_trajectory=True, "
                         f"decoder 'jacobi' needed)")
    P = len(prompt_ids)
    ctx = P
    blocks: list[BlockTrajectory] = []
    response: list[int] = []
    for i, b in enumerate(traj):
        fp = list(b["fixed_point"])
        drafts = b["drafts"]
        if b["context_len"] != ctx:
            raise ValueError(f"sample {sample_id!r}: block {i} has context_len {b['context_len']}, expected {ctx}")
        if not fp or len(fp) > block_size or not drafts or any(len(d) != len(fp) for d in drafts):
            raise ValueError(f"sample {sample_id!r}: block {i} is malformed (fixed point of {len(fp)} tokens, "
                             f"draft widths {sorted({len(d) for d in drafts})}, n={block_size})")
        blocks.append(BlockTrajectory(context_len=ctx,
                                      drafts=torch.tensor([list(d) for d in drafts], dtype=torch.int64),
                                      fixed_point=torch.tensor(fp, dtype=torch.int64)))
        response += fp
        ctx += len(fp)
    tokens = list(result.tokens)
    if tokens[:len(response)] != response:
        raise ValueError(f"sample {sample_id!r}: the trajectory's fixed points differ from the generated tokens")
    rest = tokens[len(response):]
    if rest:
        if blocks[-1].length != block_size or len(rest) > block_size:
            raise ValueError(f"sample {sample_id!r}: {len(rest)} generated tokens are missing from the trajectory "
                             f"after a partial block")
        t = torch.tensor(rest, dtype=torch.int64)
        blocks.append(BlockTrajectory(context_len=ctx, drafts=t.clone()[None], fixed_point=t))
    eos_reached = bool(tokens) and tokens[-1] in eos_ids and result.finish_reason == "eos"
    rec = TrajectoryRecord(sample_id=sample_id, prompt_ids=torch.tensor(list(prompt_ids), dtype=torch.int64),
                           blocks=blocks, block_size=block_size, eos_reached=eos_reached)
    rec.validate()
    hits = [j for j, t in enumerate(tokens) if t in eos_ids]
    if hits and (not eos_reached or hits != [len(tokens) - 1]):
        raise ValueError(f"sample {sample_id!r}: EOS at response index {hits[0]} is not the end of the response")
    return rec


def filter_reason(record: TrajectoryRecord, eos_ids: frozenset | set, **thresholds) -> str | None:
    """Why the record's response is degenerate (repetition filter,
    :func:`~megatron_jf.data.filters.degeneracy_reason`; a trailing EOS is stripped first), or None."""
    resp = record.response_ids()
    if record.eos_reached and resp.numel() and int(resp[-1]) in eos_ids:
        resp = resp[:-1]
    return degeneracy_reason(resp, **thresholds)


def filter_category(reason: str) -> str:
    """The category a :func:`filter_reason` counts under (``CollectStats.filtered``, the skip ledger):
    ``"periodic_tail(p=1, ...)"`` -> ``"degenerate/periodic_tail"``; ``"distinct_4gram=..."`` ->
    ``"degenerate/distinct_4gram"``."""
    return "degenerate/" + re.split(r"[(=]", reason, maxsplit=1)[0]


# ============================================================================ collection loop
@dataclass(frozen=True)
class CollectConfig:
    """Decoding and filtering settings of a collection run.

    Attributes:
        block_size: ``n``, tokens per Jacobi block (>= 1).
        max_new_tokens: cap on response tokens per prompt (>= 1).
        draft_init: ``"context"`` (tokens drawn from prompt + output, the paper's initialisation) or
            ``"repeat"`` (the last token repeated).
        seed: run seed (draft initialisation RNG, see :func:`batch_seed`).
        batch_size: prompts decoded together (>= 1).
        filter: drop degenerate responses (:func:`filter_reason`).
        eos_ids: stop token ids.
    """

    block_size: int = 32
    max_new_tokens: int = 1024
    draft_init: str = "context"
    seed: int = 0
    batch_size: int = 8
    filter: bool = True
    eos_ids: frozenset = frozenset()

    def __post_init__(self):
        if self.block_size < 1:
            raise ValueError(f"block size must be >= 1, got {self.block_size}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.batch_size < 1:
            raise ValueError(f"batch size must be >= 1, got {self.batch_size}")
        if self.draft_init not in ("context", "repeat"):
            raise ValueError(f"unknown draft init {self.draft_init!r}; choose 'context' or 'repeat'")


@dataclass
class CollectStats:
    """Counters of one rank's collection run (summed across ranks with :meth:`merge`).

    Attributes:
        prompts: prompts decoded; records: records written; filtered: dropped, by category;
        tokens: response tokens generated (filtered samples included); forwards: decode forwards;
        blocks / states: blocks and recorded drafts of written records; eos: records ending in EOS;
        seconds: wall time spent in the loop.
    """

    prompts: int = 0
    records: int = 0
    filtered: dict = field(default_factory=dict)
    tokens: int = 0
    forwards: int = 0
    blocks: int = 0
    states: int = 0
    eos: int = 0
    seconds: float = 0.0

    @property
    def tpf(self) -> float:
        """Tokens per forward over everything decoded."""
        return self.tokens / self.forwards if self.forwards else float("nan")

    def merge(self, other: "CollectStats") -> "CollectStats":
        """Sum of two stats (``seconds`` is the max: ranks run in parallel)."""
        f = dict(self.filtered)
        for k, v in other.filtered.items():
            f[k] = f.get(k, 0) + v
        return CollectStats(self.prompts + other.prompts, self.records + other.records, f,
                            self.tokens + other.tokens, self.forwards + other.forwards, self.blocks + other.blocks,
                            self.states + other.states, self.eos + other.eos, max(self.seconds, other.seconds))

    def to_dict(self) -> dict:
        return asdict(self)


def collect(engine, prompts: Sequence[TokenizedPrompt], config: CollectConfig, *, writer=None,
            ledger: "SkipLedger | None" = None, on_batch: Callable[[CollectStats, int], None] | None = None
            ) -> CollectStats:
    """Decode ``prompts`` in batches with the ``jacobi`` decoder and write one record per prompt.

    Records stream to ``writer`` batch by batch (nothing accumulates in memory). Under tensor
    parallelism every rank of a TP group calls this with the same prompts; only one passes a writer.

    Args:
        engine: a :class:`~megatron_jf.inference.engine.Engine`.
        prompts: tokenised prompts that fit the context window (see :func:`split_too_long`).
        config: decoding settings.
        writer: a :class:`~megatron_jf.data.shards.TrajectoryShardWriter`, or None (nothing written).
        ledger: where dropped prompts are recorded (:class:`SkipLedger`), or None.
        on_batch: called after each batch with ``(this batch's stats, prompts in the batch)``.

    Returns:
        The stats of this call.

    Raises:
        ValueError: as the engine (bad prompts) or :func:`build_record`.
    """
    from megatron_jf.inference.engine import DecodeConfig
    from megatron_jf.inference.sampling import SamplingParams

    dec = DecodeConfig("jacobi", block_size=config.block_size, draft_init=config.draft_init)
    eos_ids = frozenset(config.eos_ids)
    total = CollectStats()
    t_start = time.perf_counter()
    for batch in iter_batches(list(prompts), config.batch_size):
        t0 = time.perf_counter()
        results = engine.generate([p.ids for p in batch], dec, max_new_tokens=config.max_new_tokens,
                                  sampling=SamplingParams(seed=batch_seed(config.seed, batch[0].sample_id)),
                                  eos_ids=eos_ids, record_trajectory=True)
        st = CollectStats(prompts=len(batch))
        for p, res in zip(batch, results):
            keep_result(p, res, config, st, writer=writer, ledger=ledger)
        del results
        st.seconds = time.perf_counter() - t0
        total = total.merge(st)
        if on_batch is not None:
            on_batch(st, len(batch))
    total.seconds = time.perf_counter() - t_start
    return total


def keep_result(prompt: TokenizedPrompt, result, config: CollectConfig, stats: CollectStats, *, writer=None,
                ledger: "SkipLedger | None" = None) -> None:
    """One decoded prompt into the data set: build its record (:func:`build_record`), drop it to the ledger if the
    repetition filter says so, else write it; count it in ``stats`` (tokens, forwards, records, filtered, ...).
    The part of :func:`collect` every engine's collector shares.

    Args:
        prompt: the tokenised prompt.
        result: what the engine decoded: ``tokens``, ``forwards``, ``finish_reason`` and ``trajectory`` as in
            :func:`build_record`.
        config: the collection settings (block size, stop ids, filter).
        stats: counters updated in place (``prompts`` is the caller's).
        writer, ledger: as in :func:`collect`.

    Raises:
        ValueError: see :func:`build_record`.
    """
    eos_ids = frozenset(config.eos_ids)
    rec = build_record(prompt.sample_id, prompt.ids, result, config.block_size, eos_ids)
    stats.tokens += len(result.tokens)
    stats.forwards += result.forwards
    reason = filter_reason(rec, eos_ids) if config.filter else None
    if reason is not None:
        cat = filter_category(reason)
        stats.filtered[cat] = stats.filtered.get(cat, 0) + 1
        if ledger is not None:
            ledger.add(prompt.sample_id, reason, cat)
        return
    if writer is not None:
        writer.write(rec)
    stats.records += 1
    stats.blocks += rec.num_blocks
    stats.states += sum(b.num_states for b in rec.blocks)
    stats.eos += int(rec.eos_reached)


# ============================================================================ output directory / resume
def shard_prefix(dp_rank: int) -> str:
    """Shard name prefix of a data-parallel rank: ``traj-dp00003`` (shards ``traj-dp00003-000000.tar``, ...)."""
    return f"traj-dp{dp_rank:05d}"


class SkipLedger:
    """Append-only JSONL list of prompts that produced no record (``traj-dpRRRRR.skipped.jsonl``).

    Each line is ``{"id", "reason", "category"}``, written and flushed (and fsynced) at once, so a
    kill loses at most the line being written; :func:`prepare_output_dir` trims such a partial line.
    """

    def __init__(self, out_dir: str, dp_rank: int):
        self.path = os.path.join(out_dir, f"{shard_prefix(dp_rank)}.skipped.jsonl")
        self._fh = None

    def add(self, sample_id: str, reason: str, category: str) -> None:
        """Record one dropped prompt."""
        if self._fh is None:
            self._fh = open(self.path, "a", encoding="utf-8")
        self._fh.write(json.dumps({"id": sample_id, "reason": reason, "category": category}) + "\n")
        self._fh.flush()
        os.fsync(self._fh.fileno())

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


@dataclass
class ShardSummary:
    """What a complete shard holds (read from its headers and per-sample json, checksums verified)."""

    path: str
    num_records: int
    num_bytes: int
    ids: list
    blocks: int
    response_tokens: int
    states: int
    eos: int
    block_size: int | None


@dataclass
class ResumeState:
    """Contents of an output directory.

    Attributes:
        shards: complete shards of this collector, by name order.
        skipped: id -> ``{"reason", "category"}`` from the skip ledgers.
        removed_partials: temporary files of killed runs that :func:`prepare_output_dir` deleted.
    """

    shards: list = field(default_factory=list)
    skipped: dict = field(default_factory=dict)
    removed_partials: list = field(default_factory=list)

    @property
    def shard_ids(self) -> set:
        """Ids present in complete shards."""
        return {i for s in self.shards for i in s.ids}

    @property
    def done_ids(self) -> set:
        """Ids not to collect again: in a complete shard or in a skip ledger."""
        return self.shard_ids | set(self.skipped)


def _check_config(out_dir: str, settings: dict) -> None:
    path = os.path.join(out_dir, CONFIG_NAME)
    doc = {"format": _CONFIG_FORMAT, **settings}
    if os.path.exists(path):
        try:
            with open(path, encoding="utf-8") as f:
                old = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot read {path}: {e}") from None
        if old.get("format") != _CONFIG_FORMAT:
            raise ValueError(f"{path} is not a collector config")
        diff = [f"{k}: {old.get(k)!r} (existing) vs {v!r} (now)" for k, v in doc.items() if old.get(k) != v]
        has_data = any(_SHARD_RE.match(n) or (_LEDGER_RE.match(n) and os.path.getsize(os.path.join(out_dir, n)) > 0)
                       for n in os.listdir(out_dir))
        if diff and has_data:
            raise ValueError(f"output directory {out_dir} holds trajectories collected with other settings; use a new "
                             f"--out or the same settings. Differences: " + "; ".join(diff))
        if not diff:
            return
        # no data yet (an earlier run failed before writing anything): adopt the new settings
    tmp = os.path.join(out_dir, f".{CONFIG_NAME}.partial-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def prepare_output_dir(out_dir: str, settings: dict) -> list[str]:
    """Make ``out_dir`` ready for a (resumed) run. Call on one process only, before any rank writes.

    Creates the directory; checks ``settings`` (JSON-serialisable: model, block size, ...) against the
    ``collect_config.json`` of an earlier run that left data (shards or skipped prompts), or writes it;
    deletes temporary shard/manifest files left by killed runs (``.NAME.partial-PID``); trims a partial last line of each skip ledger; removes
    a stale ``manifest.json`` (it is rewritten when the run completes).

    Returns:
        The deleted temporary files.

    Raises:
        ValueError: the directory was used with different settings (lists the differences) or its
            config file is corrupt.
    """
    os.makedirs(out_dir, exist_ok=True)
    _check_config(out_dir, settings)
    removed = []
    for name in sorted(os.listdir(out_dir)):
        p = os.path.join(out_dir, name)
        if _PARTIAL_RE.match(name) and os.path.isfile(p):
            os.remove(p)
            removed.append(name)
        elif _LEDGER_RE.match(name):
            with open(p, "rb") as f:
                data = f.read()
            if data and not data.endswith(b"\n"):
                with open(p, "r+b") as f:
                    f.truncate(data.rfind(b"\n") + 1)
                    f.flush()
                    os.fsync(f.fileno())
    m = os.path.join(out_dir, MANIFEST_NAME)
    if os.path.exists(m):
        os.remove(m)
    return removed


def _summarize_shard(path: str) -> ShardSummary:
    entries: list[ShardEntry] = index_shard(path)
    ids, blocks, tokens, states, eos, bs = [], 0, 0, 0, 0, None
    with open(path, "rb") as fh:
        for e in entries:
            parts = []
            for off, size in (e.json, e.npz, e.sha256):
                fh.seek(off)
                b = fh.read(size)
                if len(b) != size:
                    raise ValueError(f"shard {path}, key {e.key}: truncated member data")
                parts.append(b)
            j, z, s = parts
            if hashlib.sha256(j + z).hexdigest().encode("ascii") != s.strip():
                raise ValueError(f"shard {path}, key {e.key}: checksum mismatch (corrupt sample)")
            try:
                meta = json.loads(j.decode("utf-8"))
                ids.append(str(meta["sample_id"]))
                blocks += len(meta["block_lens"])
                tokens += sum(int(v) for v in meta["block_lens"])
                states += sum(int(v) for v in meta["num_states"])
                eos += int(bool(meta["eos_reached"]))
                bs = int(meta["block_size"])
            except (ValueError, KeyError, TypeError) as err:
                raise ValueError(f"shard {path}, key {e.key}: bad metadata ({err})") from None
    return ShardSummary(path=path, num_records=len(entries), num_bytes=os.path.getsize(path), ids=ids, blocks=blocks,
                        response_tokens=tokens, states=states, eos=eos, block_size=bs)


def scan_output_dir(out_dir: str) -> ResumeState:
    """Read what an output directory already holds: the ids of every complete shard (headers and
    per-sample json only; checksums verified, arrays not decoded) and the skip ledgers.

    Temporary ``.partial`` files are never read (their prompts are collected again).

    Raises:
        ValueError: a complete shard is corrupt (names it), or an id appears twice across shards.
    """
    st = ResumeState()
    if not os.path.isdir(out_dir):
        return st
    names = sorted(os.listdir(out_dir))
    seen: dict[str, str] = {}
    for name in names:
        if _SHARD_RE.match(name):
            s = _summarize_shard(os.path.join(out_dir, name))
            for i in s.ids:
                if i in seen:
                    raise ValueError(f"id {i!r} is in two shards: {seen[i]} and {name}")
                seen[i] = name
            st.shards.append(s)
    for name in names:
        if _LEDGER_RE.match(name):
            with open(os.path.join(out_dir, name), encoding="utf-8") as f:
                for line in f:
                    try:
                        d = json.loads(line)
                        st.skipped.setdefault(str(d["id"]), {"reason": d["reason"], "category": d["category"]})
                    except (ValueError, KeyError, TypeError):
                        continue  # a partial line of a killed run: the prompt is simply collected again
    return st


def next_shard_index(state: ResumeState, prefix: str) -> int:
    """First free shard index for ``prefix``: one past the highest complete shard of that prefix (0 if none)."""
    idx = [int(m.group(3)) for s in state.shards
           if (m := _SHARD_RE.match(os.path.basename(s.path))) and m.group(1) == prefix]
    return max(idx) + 1 if idx else 0


def write_collection_manifest(out_dir: str, *, model: str, tokenizer: str, block_size: int,
                              prompt_ids: Sequence[str] | None = None, extra: dict | None = None) -> tuple[str, dict]:
    """Scan ``out_dir`` and atomically write ``manifest.json`` covering every complete shard (all ranks,
    all resumed runs) -- the schema of :func:`megatron_jf.data.shards.write_manifest`.

    ``counts`` holds ``records``, ``blocks``, ``response_tokens``, ``states``, ``eos_reached``, ``shards``
    and, with ``prompt_ids`` (the ids of the prompt file), ``prompts`` (in the file), ``missing``
    (neither in a shard nor skipped) and ``not_in_prompt_file``. ``filtered`` counts the dropped prompts by
    category (``degenerate/<rule>``, ``prompt_too_long``), ignoring ids that also sit in a shard.

    Returns:
        ``(manifest path, the counts dict)``.
    """
    st = scan_output_dir(out_dir)
    shard_ids = st.shard_ids
    counts = {
        "records": sum(s.num_records for s in st.shards),
        "blocks": sum(s.blocks for s in st.shards),
        "response_tokens": sum(s.response_tokens for s in st.shards),
        "states": sum(s.states for s in st.shards),
        "eos_reached": sum(s.eos for s in st.shards),
        "shards": len(st.shards),
    }
    filtered: dict[str, int] = {}
    for i, d in st.skipped.items():
        if i not in shard_ids:
            filtered[d["category"]] = filtered.get(d["category"], 0) + 1
    if prompt_ids is not None:
        ids = set(prompt_ids)
        done = shard_ids | set(st.skipped)
        counts["prompts"] = len(ids)
        counts["missing"] = len(ids - done)
        counts["not_in_prompt_file"] = len(shard_ids - ids)
    path = os.path.join(out_dir, MANIFEST_NAME)
    write_manifest(path, model=model, tokenizer=tokenizer, block_size=block_size,
                   shards=[{"path": os.path.basename(s.path), "num_records": s.num_records, "num_bytes": s.num_bytes}
                           for s in st.shards],
                   counts=counts, filtered=filtered, extra=extra, shard_dir=out_dir)
    return path, counts


def find_shards(out_dir: str) -> list[str]:
    """Paths of this collector's complete shards in ``out_dir``, sorted."""
    return sorted(p for p in glob.glob(os.path.join(out_dir, "traj-dp*.tar")) if _SHARD_RE.match(os.path.basename(p)))
