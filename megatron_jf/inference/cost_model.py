"""What one decode forward costs on this machine: seconds by rows x tokens per row, measured at start-up
and kept on disk, for the draft-width choice (:mod:`megatron_jf.decoding.width`).

:func:`ensure_cost` times the engine's own decode forward (the runner's ``decode``: the lean forward, its static /
CUDA-graph path, or megatron-core's, whichever the engine runs) on a scratch KV cache of :data:`CONTEXT` committed
tokens per row, for the row counts of :data:`ROWS` below the batch and the batch's own (at most 64; more rows are
extrapolated proportionally), and tokens per row from :data:`TOKENS` up to the widest forward. A row count's curve
stops once a forward costs :data:`STOP_RATIO` times its one-token forward or :data:`BUDGET_S` is spent; past the
last point the cost grows in proportion to the tokens (or with the last slope, if steeper). Each point is the fastest
of :data:`REPS` passes after a warm-up (on a shared machine the slower ones waited for a core), and the one-token
forward, which every ratio is taken against, is timed next to every point (a burst of load while it alone was timed
would make every wider forward look cheap). On this project's CPU (SmolLM2-135M, one thread)
a row count takes a few seconds, once: later starts read the file.

Before the first table of a model is measured on a CPU, :func:`calibrate_packing` measures where the lean
forward's fp32 products pay for oneDNN's packed weights (one-row products through large weights, and from how many
rows multi-row ones: choices that differ by CPU and model shape), sets them on the lean forward and keeps them with
the table (``about["packed_one_row_min"]``, ``about["packed_min_rows"]``); later starts apply the cached values.
The table then times the forward as it will run.

The table is written atomically to ``<cache dir>/forward_cost/<key>.json``, the key a hash of everything the cost
depends on -- the model's shape, parameter dtype, device (CPU model or GPU name), torch threads, forward
implementation, tensor-parallel size and the measured context -- so a later start on the same machine reads it
instead of measuring (``MEGATRON_JF_COST_CACHE``: the directory, or ``0`` for no file;
:func:`megatron_jf.env.cost_cache_dir`). Under tensor parallelism every rank times the same forwards
and the slowest rank's time is kept, so all ranks choose the same widths.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import time

import torch

from megatron_jf import env
from megatron_jf.decoding.width import ForwardCost
from megatron_jf.inference.runner import ModelRunner, synchronize
from megatron_jf.models.gpt import unwrap

#: Tokens per row measured (up to the widest forward the session allows, which is always measured).
TOKENS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
#: Row counts measured below the batch (the batch's own count, at most 64, is measured too); past the largest the
#: cost is extrapolated proportionally, between two linearly.
ROWS = (1, 4, 16, 64)
#: Committed tokens per row while timing (attention reads them).
CONTEXT = 128
#: A row count's curve stops at a forward this many times its one-token forward.
STOP_RATIO = 8.0
#: Seconds one row count's measurement may take at most (a machine slowed by other jobs stops the curve early).
BUDGET_S = 4.0
#: Passes over the points; each point's fastest time is kept (the machine's own cost: slower runs waited for a
#: shared core).
REPS = 3
#: Tokens of the one-row forwards that weigh the lean forward's packed fp32 products against its transposed copies
#: (:func:`calibrate_packing`): product row counts 2-32, the drafts of batch 1 and AR steps of small batches.
PACKING_TOKENS = (2, 4, 8, 16, 32)
#: A packing crossover other than the default is taken only when it saves more than this share of the measured time
#: (noise on a shared machine must not move a forward off the path that was measured best on other CPUs).
PACKING_MIN_SAVING = 0.02
#: Bump when the measurement or the forward it times changes (old cache files are then ignored). 6: bf16 one-row
#: products through oneDNN's packed weights (lean forward); 7: large fp32 one-row products too; 8: every bf16 product;
#: 9: the fp32 packing choices measured (``about["packed_one_row_min"]``, ``about["packed_min_rows"]``).
VERSION = 9


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:
        pass
    return f"cpu:{name}"


def cost_key(model, impl: str) -> dict:
    """What the cost of ``model``'s decode forward depends on (the cache key): model shape, parameter dtype, device,
    torch threads, forward implementation ``impl`` (with the lean forward's CPU weight copies), tensor-parallel
    size, measured context, measurement version."""
    from megatron.core import parallel_state as ps

    m = unwrap(model)
    p = next(m.parameters())
    shape = dataclasses.asdict(m.model_args)
    for k in ("eos_token_ids", "bos_token_id", "pad_token_id", "extra", "rms_norm_eps", "rope_theta"):
        shape.pop(k, None)
    tp = ps.get_tensor_model_parallel_world_size() if ps.model_parallel_is_initialized() else 1
    lean = getattr(m, "_jf_lean_forward", None)
    if impl != "megatron" and lean is not None:
        impl = f"{impl} (weight copies for {len(lean.gemv_transposed)} products, packed: {lean.packed})"
    return {"model": shape, "dtype": str(p.dtype).replace("torch.", ""), "device": _device_name(p.device),
            "threads": torch.get_num_threads(), "impl": impl, "tp": tp, "context": CONTEXT, "version": VERSION}


def cache_file(key: dict) -> str | None:
    """The cache file of ``key`` (None when caching is off)."""
    root = env.cost_cache_dir()
    if root is None:
        return None
    h = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return os.path.join(root, "forward_cost", f"{h}.json")


def _load(path: str | None, key: dict) -> ForwardCost | None:
    if path is None:
        return None
    try:
        with open(path) as f:
            d = json.load(f)
        if d.get("about", {}).get("key") != key:
            return None
        return ForwardCost.from_dict(d)
    except (OSError, ValueError):
        return None


def _store(path: str | None, cost: ForwardCost) -> None:
    if path is None:
        return
    from megatron_jf.fileio import atomic_write_json

    try:
        atomic_write_json(path, cost.to_dict())
    except OSError:  # a read-only cache directory: keep the table in memory only
        pass


def _tp_group():
    """The tensor-parallel group when TP > 1, else None."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized() or ps.get_tensor_model_parallel_world_size() == 1:
        return None
    return ps.get_tensor_model_parallel_group()


def agreed_seconds(seconds: float) -> float:
    """The slowest tensor-parallel rank's time (every rank then takes the same decisions: the cost table here, each
    step's calibration in :class:`~megatron_jf.inference.session.BatchSession`); the time itself at TP=1. One
    all-reduce over the TP group (on the current CUDA device where the group is NCCL's)."""
    group = _tp_group()
    if group is None:
        return seconds
    nccl = torch.distributed.get_backend(group) == "nccl"
    t = torch.tensor([seconds], dtype=torch.float64, device=torch.cuda.current_device() if nccl else "cpu")
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=group)
    return float(t)


def _from_first_rank(obj):
    """``obj`` as the tensor-parallel group's first rank has it (so every rank measures the same row counts and
    ends with the same table, whatever each rank's cache file said); ``obj`` itself at TP=1."""
    group = _tp_group()
    if group is None:
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=torch.distributed.get_global_rank(group, 0), group=group)
    return box[0]


def _forward_seconds(runner, rows: int, s: int, gen: torch.Generator, context: int) -> float:
    """Seconds of one decode forward of ``rows`` rows x ``s`` random tokens after ``context`` committed ones (the
    slowest tensor-parallel rank's)."""
    vocab = unwrap(runner.model).vocab_size_unpadded
    seqs = torch.randint(0, vocab, (rows, s), generator=gen).tolist()
    runner.cache.lengths[:rows] = context
    t0 = time.perf_counter()
    runner.decode(0, rows, seqs, [context - 1] * rows, [s] * rows, [[]] * rows, tree=False)
    synchronize(runner.device)
    return agreed_seconds(time.perf_counter() - t0)


def choose_packed_min_rows(packed: dict[int, float], transposed: dict[int, float],
                           min_saving: float = PACKING_MIN_SAVING) -> int:
    """The crossover ``LeanForward.packed_min_rows`` that makes the measured forwards fastest.

    Args:
        packed: seconds of a forward by product rows with every multi-row product past the MAC threshold packed.
        transposed: the same forwards with every fp32 multi-row product through the transposed copies.
        min_saving: a crossover other than the default (2: pack from two rows up) must save more than this share
            of the total measured time.

    Returns:
        the smallest row count packed from (one of the measured counts), or
        :data:`~megatron_jf.inference.lean_forward.NEVER_PACKED`.

    Raises:
        ValueError: the two dicts measure different row counts, or none.
    """
    from megatron_jf.inference.lean_forward import NEVER_PACKED

    if not packed or set(packed) != set(transposed):
        raise ValueError(f"packed and transposed must time the same row counts, got {sorted(packed)} and "
                         f"{sorted(transposed)}")
    counts = sorted(packed)

    def total(threshold: int) -> float:
        return sum(packed[r] if r >= threshold else transposed[r] for r in counts)

    default = total(2)
    best = min([*counts, NEVER_PACKED], key=total)
    return best if total(best) < (1.0 - min_saving) * default else 2


def calibrate_packing(runner, max_tokens: int, *, context: int = CONTEXT, reps: int = REPS) -> dict | None:
    """Measure where the lean forward's fp32 products pay for oneDNN's packed weights on this machine, and set it
    on the runner's lean forward: ``packed_one_row_min`` (one-row products through large weights packed or not)
    and ``packed_min_rows`` (from how many rows multi-row products are packed).

    One-token forwards are timed with the large one-row products packed and not (where the model has such
    weights), then one-row forwards of :data:`PACKING_TOKENS` tokens (up to ``max_tokens``) with multi-row products
    packed and not; the two ways interleaved, each point the fastest of ``reps`` passes after a warm-up. A choice
    other than the default is taken only where it saves more than :data:`PACKING_MIN_SAVING`
    (:func:`choose_packed_min_rows`). On an AVX-512 EPYC the defaults were measured best; on an Intel Xeon with
    AMX a 256-hidden model's forwards of 2-32 tokens were 20-25 % faster with none packed, SmolLM2-135M's 15-30 %
    slower, and SmolLM2's one-token forward faster with nothing packed.

    Returns:
        ``{"packed_one_row_min": elements, "packed_min_rows": rows}`` as set, or None where there is nothing to
        choose (not the lean forward on a CPU, weights not fp32, or oneDNN packing unavailable).

    Raises:
        nothing of its own; an error of the forward itself propagates, with the lean forward's choices and the
        runner's cache lengths restored.
    """
    from megatron_jf.inference.lean_forward import NEVER_PACKED, PACKED_ONE_ROW_MIN

    lean = runner.lean
    if (runner.impl != "lean" or lean is None or not lean.packed or runner.device.type != "cpu"
            or lean.emb.weight.dtype != torch.float32):
        return None
    widths = [s for s in PACKING_TOKENS if s <= max_tokens]
    large = any(p.numel() >= PACKED_ONE_ROW_MIN for p in unwrap(runner.model).parameters())
    gen = torch.Generator().manual_seed(0)
    before = lean.packed_one_row_min, lean.packed_min_rows
    one = {PACKED_ONE_ROW_MIN: float("inf"), NEVER_PACKED: float("inf")}
    multi: dict[int, dict[int, float]] = {2: {}, NEVER_PACKED: {}}
    try:
        if large:
            for policy in one:  # warm-ups: the weight copies are made on first use
                lean.packed_one_row_min = policy
                _forward_seconds(runner, 1, 1, gen, context)
            for _ in range(reps):
                for policy in one:
                    lean.packed_one_row_min = policy
                    one[policy] = min(one[policy], _forward_seconds(runner, 1, 1, gen, context))
        if widths:
            for policy in multi:
                lean.packed_min_rows = policy
                _forward_seconds(runner, 1, widths[-1], gen, context)
            for _ in range(reps):
                for s in widths:
                    for policy, got in multi.items():
                        lean.packed_min_rows = policy
                        got[s] = min(got.get(s, float("inf")), _forward_seconds(runner, 1, s, gen, context))
    finally:
        runner.cache.lengths.zero_()
        lean.packed_one_row_min, lean.packed_min_rows = before
    if large and one[NEVER_PACKED] < (1.0 - PACKING_MIN_SAVING) * one[PACKED_ONE_ROW_MIN]:
        lean.packed_one_row_min = NEVER_PACKED
    if widths:
        lean.packed_min_rows = choose_packed_min_rows(multi[2], multi[NEVER_PACKED])
    return {"packed_one_row_min": lean.packed_one_row_min, "packed_min_rows": lean.packed_min_rows}


#: The lean forward's packing choices :func:`calibrate_packing` makes (kept in a cost table's ``about``).
PACKING_KNOBS = ("packed_one_row_min", "packed_min_rows")


def packing_summary(about: dict) -> str | None:
    """One line saying what :func:`calibrate_packing` chose (from a cost table's ``about``), or None when it did
    not run (not the lean forward on a CPU with fp32 weights). Raises nothing: a table without the choices gives
    None."""
    from megatron_jf.inference.lean_forward import NEVER_PACKED, PACKED_ONE_ROW_MIN

    if not all(k in about for k in PACKING_KNOBS):
        return None
    one = int(about["packed_one_row_min"])
    multi = int(about["packed_min_rows"])
    one_s = "none" if one >= NEVER_PACKED else f"through weights of >= {one:,} elements" + (
        " (the default)" if one == PACKED_ONE_ROW_MIN else "")
    multi_s = "none" if multi >= NEVER_PACKED else f"from {multi} rows" + (" (the default)" if multi == 2 else "")
    return f"oneDNN-packed fp32 products, as measured on this machine: one-row {one_s}; multi-row {multi_s}"


def _apply_packing(runner, about: dict) -> None:
    if runner.lean is not None:
        for knob in PACKING_KNOBS:
            if knob in about:
                setattr(runner.lean, knob, int(about[knob]))


def measure_rows(runner, rows: int, max_tokens: int, *, context: int = CONTEXT, budget_s: float = BUDGET_S,
                 reps: int = REPS) -> dict[int, float]:
    """Seconds of one decode forward of ``rows`` rows x ``s`` tokens (the fastest of ``reps``) for ``s`` in
    :data:`TOKENS` up to ``max_tokens`` (and ``max_tokens``), until :data:`STOP_RATIO` or ``budget_s``.

    Args:
        runner: a :class:`~megatron_jf.inference.runner.ModelRunner` with at least ``rows`` rows of
            ``context + max_tokens`` slots; its cache rows are used as scratch (lengths set to ``context``, then 0).
    """
    gen = torch.Generator().manual_seed(0)
    cache = runner.cache
    grid = sorted({s for s in TOKENS if s < max_tokens} | {max_tokens})

    def once(s: int) -> float:
        return _forward_seconds(runner, rows, s, gen, context)

    try:
        once(1)  # warm-ups: first-call allocations, the lean forward's weight copies, CUDA graph capture
        once(2)
        start = time.perf_counter()
        times: dict[int, float] = {1: once(1)}

        def point(s: int) -> None:  # the one-token forward is the reference: timed next to every point
            times[1] = min(times[1], once(1))
            if s != 1:
                times[s] = min(times.get(s, float("inf")), once(s))

        for s in grid:  # the first pass decides how far the curve goes
            point(s)
            spent = agreed_seconds(time.perf_counter() - start)
            if len(times) >= 4 and (times[s] > STOP_RATIO * times[1] or spent > budget_s):
                break
        for _ in range(reps - 1):  # then whole passes again, each point's fastest time kept
            for s in list(times):
                point(s)
    finally:
        cache.lengths.zero_()
    return times


def ensure_cost(model, cost: ForwardCost | None, rows: int, max_tokens: int, options) -> ForwardCost:
    """A cost table covering ``rows`` rows (up to the largest of :data:`ROWS`): ``cost`` if it does, else the cached
    table merged with it, measured now (and cached) for the row counts of :data:`ROWS` below ``rows`` and ``rows``
    itself that lie above the largest row count known (those below it are interpolated).

    Args:
        cost: the table the engine holds (or None; one measured at another torch thread count is not used: the
            table of this thread count is read from the cache or measured).
        rows: rows of the batch about to decode; max_tokens: the widest forward per row it allows.
        options: the engine's :class:`~megatron_jf.inference.options.InferenceOptions`.
    """
    want = sorted({b for b in ROWS if b < rows} | {min(rows, ROWS[-1])})
    threads = torch.get_num_threads()
    if cost is not None and cost.about.get("key", {}).get("threads", threads) != threads:
        cost = None  # measured at another torch thread count (a timing run at 1 thread after a batched one at 2)
    if cost is not None and max(cost.rows) >= want[-1]:
        return cost
    probe = ModelRunner(model, 1, 2, options=options)  # resolves the forward implementation
    key = cost_key(model, probe.impl)
    path = cache_file(key)
    cached = _load(path, key)
    points = {} if cached is None else cached.points()
    about = {"key": key}
    for known_table in (cached, cost):  # the packing choices measured with the points
        if known_table is not None:
            about.update({k: known_table.about[k] for k in PACKING_KNOBS if k in known_table.about})
    if cost is not None:
        points.update(cost.points())
    points, about = _from_first_rank((points, about))
    known = max(points, default=0)
    missing = [b for b in want if b > known]  # row counts below the largest known are interpolated
    if not missing:
        _apply_packing(probe, about)
        out = ForwardCost(points, about)
        if cached is None or set(points) != set(cached.rows) or cached.about != about:
            _store(path, out)
        return out
    runner = ModelRunner(model, max(missing), CONTEXT + max_tokens + 1, options=options)
    if not points:  # the packing choices are measured before the table: the table times the forward as it runs
        about.update(calibrate_packing(runner, max_tokens) or {})
    _apply_packing(runner, about)
    for b in missing:
        points[b] = measure_rows(runner, b, max_tokens)
    del runner
    out = ForwardCost(points, about)
    _store(path, out)
    return out
