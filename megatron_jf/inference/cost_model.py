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

Before the first table of a model is measured on a CPU, :func:`calibrate_products` measures which way each of the
lean forward's fp32 products runs fastest by weight shape and row count (MKL on a transposed copy, oneDNN on a
packed copy, ``F.linear`` on the weight: the fastest differs by CPU and shape), sets it on the lean forward and keeps
it with the table (``about["products"]``); later starts apply the cached choice. The table then times the forward
as it will run.

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
#: More passes while a row count's measurement has taken less than this (seconds): a fast forward's points are
#: then the fastest of many. The quickstart's 1 ms model at 3 passes: its 3-4 token points came out at 1.3-1.4 ms in
#: one measurement, 1.2 in another (the auto width drafted 2.0 tokens a step against 3.0, 1.20x AR against 1.27x).
REFINE_S = 0.5
#: Product rows (rows x tokens per row) at which :func:`calibrate_products` times each fp32 kernel: the drafts of
#: batch 1 and the AR steps and small drafts of batches; larger products take the choice of the largest.
PRODUCT_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)
#: A kernel other than :meth:`~megatron_jf.inference.lean_forward.LeanForward.default_kernel` is taken only where it
#: was measured faster by more than this share (noise on a shared machine must not move a product off the path that
#: was measured best on other CPUs).
PACKING_MIN_SAVING = 0.02
#: Products of up to this many rows -- every decode step of batch 1, AR (one row) and drafts alike, and the AR steps
#: of batches up to 16 -- take one kernel per weight shape, the one whose times over these row counts sum lowest
#: relative to each row count's fastest: one copy of each weight serves them all. A copy that only some steps read
#: is found out of cache when they come (on this shared host at least), while the copy every step reads stays in
#: it: the quickstart JF model (Intel Xeon, one thread), whose kernels had come out ``F.linear`` at 1-3
#: rows and the transposed copies from 4 (a pick per row count, timed warm), forwarded 8 tokens in 2.0-2.1 ms inside
#: the decode loop (table: 1.1) against 1.4 with the transposed copies at every row count; SmolLM2-135M's
#: 3,072 x 576 and 49,152 x 576 products measured ``transposed`` at one row and ``skinny`` at 2-8, ``skinny`` at one
#: row too: default decoder 35.8-35.9 -> 36.6-36.7 tok/s, AR 23.3 -> 23.4-23.9, same run. Row counts timed apart,
#: a decode range's picks also hung on one noisy timing each (the five weight shapes of two calibrations: seven patterns
#: in ten; summed over the range, nine of ten the transposed copies).
DECODE_ROWS = 16
#: Bump when the measurement or the forward it times changes (old cache files are then ignored). 6: bf16 one-row
#: products through oneDNN's packed weights (lean forward); 7: large fp32 one-row products too; 8: every bf16 product;
#: 9: the fp32 packing choices measured; 10: the fp32 kernel measured per weight shape and rows
#: (``about["products"]``); 11: the lean forward's C glue and its ``skinny`` product kernel; 12: the KV cache's
#: additive masks made once per forward, the final norm in the glue; 13: ``skinny`` timed up to the rows of one pass
#: (8), taking 5-8 rows in one pass. (The C glue's build is part of the key too.) 14: passes repeated for
#: :data:`REFINE_S`. 15: ``skinny`` up to 16 rows a pass, fused multiply-adds. 16: one row shares the two-row
#: kernel within 5 %. 17: the one-token point kept once a pass, like the others. 18: decode steps
#: attend in the C glue. 19: one kernel per weight up to :data:`DECODE_ROWS` rows.
VERSION = 19


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
        if p.device.type == "cpu" and p.dtype == torch.float32:
            from megatron_jf.inference import cpu_glue

            glue = cpu_glue.load()  # named by its build (source, flags, compiler, CPU): a changed kernel is measured anew
            impl += f", C glue: {os.path.basename(glue.path) if glue is not None else 'off'}"
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


def choose_kernels(timings: dict[int, dict[str, float]], default: dict[int, str],
                   min_saving: float = PACKING_MIN_SAVING,
                   decode_rows: int = DECODE_ROWS) -> tuple[tuple[int, str], ...]:
    """One weight shape's kernel by product rows, from the measured seconds.

    Row counts up to ``decode_rows`` share one kernel (one copy of the weight for every decode step,
    :data:`DECODE_ROWS`): of the kernels timed at each of them, the one whose times divided by each row count's
    fastest sum lowest, unless that sum is within ``min_saving`` of the one-row default's. Each larger row count
    takes its fastest kernel where that saves more than ``min_saving`` of its default's time, else the default (the
    first of them from ``decode_rows + 1`` rows on); where no kernel was timed at every row count of the range, so do
    they.
    Not from the paper: the CPU engine's product kernels.

    Args:
        timings: ``{rows: {kernel: seconds}}`` for the kernels timed at each row count.
        default: ``{rows: kernel}``, the kernel :meth:`LeanForward.default_kernel` picks at each row count.
        min_saving: the share of the default's time another kernel must save.
        decode_rows: the most rows the shared kernel serves.

    Returns:
        ``((from_rows, kernel), ...)`` ascending, consecutive row counts with one kernel merged.

    Raises:
        ValueError: no timings, or a default kernel that was not timed.
    """
    if not timings:
        raise ValueError("choose_kernels needs timings at one row count at least")
    for rows, t in timings.items():
        if default[rows] not in t:
            raise ValueError(f"the default kernel {default[rows]!r} was not timed at {rows} rows (timed: {sorted(t)})")
    picks = {}
    small = sorted(r for r in timings if r <= decode_rows)
    shared = set.intersection(*(set(timings[r]) for r in small)) if small else set()
    if shared:
        score = {k: sum(timings[r][k] / max(min(timings[r].values()), 1e-12) for r in small) for k in shared}
        d = default[small[0]]
        best = min(sorted(score), key=score.get)  # (sorted: a tie goes the same way on every rank and run)
        pick = best if d not in score or score[best] < (1.0 - min_saving) * score[d] else d
        picks = dict.fromkeys(small, pick)
    for rows in sorted(r for r in timings if r not in picks):  # (no kernel timed at every row count: each its own)
        t, d = timings[rows], default[rows]
        best = min(t, key=t.get)
        picks[rows] = best if t[best] < (1.0 - min_saving) * t[d] else d
    first_past = min((r for r in timings if r > decode_rows), default=None)
    out: list[tuple[int, str]] = []
    for rows, pick in picks.items():
        if not out or out[-1][1] != pick:
            # (just past the shared range a product takes the first larger row count's kernel: 17-23 rows 24's)
            out.append((decode_rows + 1 if shared and rows == first_past else rows, pick))
    return tuple(out)


def calibrate_products(lean, *, rows: tuple[int, ...] = PRODUCT_ROWS, reps: int = REPS) -> dict | None:
    """Measure which way each fp32 product of the lean forward runs fastest on this machine, per weight shape and
    product row count, set it (``lean.kernels``) and free the weight copies no choice uses.

    For each weight shape with CPU copies, a product of ``r`` random rows (``r`` in ``rows``) is run through every
    weight of that shape in turn -- as a forward reads them, so the weights come from memory as they do there --
    by each kernel (``transposed``; ``packed`` where oneDNN packing is on; ``linear``; ``skinny`` where the C glue
    is built), the kernels interleaved,
    the fastest of ``reps`` passes after a warm-up; :func:`choose_kernels` then takes one kernel for the row counts
    up to :data:`DECODE_ROWS` (one copy of each weight for every decode step) and past them the fastest by row
    count, keeping the default unless another saves more than :data:`PACKING_MIN_SAVING`.

    Returns:
        ``{"products": {"OUTxIN": [[from_rows, kernel], ...]}}`` as set, or None where there is nothing to choose
        (no lean forward, weights not fp32 on a CPU, no CPU weight copies).

    Raises:
        nothing of its own; an error of a product propagates (nothing is set then).
    """
    from megatron_jf.inference.lean_forward import SKINNY_MAX_ROWS

    if lean is None or lean.emb.weight.device.type != "cpu" or lean.emb.weight.dtype != torch.float32:
        return None
    shapes = lean.products()
    if not shapes:
        return None
    kinds = ["transposed", "linear"] + (["packed"] if lean.packed else [])
    with torch.no_grad():
        if lean._glue_for(lean.emb.weight.new_empty(1)) is not None:
            kinds.append("skinny")
    gen = torch.Generator().manual_seed(0)
    chosen = {}
    with torch.no_grad():
        for shape, named in shapes.items():
            timings: dict[int, dict[str, float]] = {}
            default = {}
            for r in rows:
                x = torch.randn(r, shape[1], generator=gen)
                here = [k for k in kinds if k != "skinny" or r <= SKINNY_MAX_ROWS]  # (one pass of the weight)
                for k in here:  # warm-up: the copies are made on first use
                    lean._linear(x, named[0][1], named[0][0], kind=k)
                t = {k: float("inf") for k in here}
                for _ in range(reps):
                    for k in here:
                        t0 = time.perf_counter()
                        for n, w in named:
                            lean._linear(x, w, n, kind=k)
                        t[k] = min(t[k], time.perf_counter() - t0)
                timings[r] = t
                d = lean.default_kernel(named[0][1], r)
                default[r] = d if d in t else "transposed"
            chosen[shape] = choose_kernels(timings, default)
    chosen = _from_first_rank(chosen)
    lean.kernels = dict(chosen)
    lean.drop_unused_copies()
    return {"products": {f"{a}x{b}": [list(p) for p in picks] for (a, b), picks in chosen.items()}}


#: What :func:`calibrate_products` chose, as kept in a cost table's ``about``.
PACKING_KNOBS = ("products",)


def products_from_about(about: dict) -> dict[tuple[int, int], tuple[tuple[int, str], ...]] | None:
    """``LeanForward.kernels`` from a cost table's ``about["products"]`` (None when it has none or it is malformed:
    the choice is then measured again)."""
    from megatron_jf.inference.lean_forward import PRODUCT_KERNELS

    try:
        out = {}
        for shape, picks in about["products"].items():
            a, b = (int(x) for x in shape.split("x"))
            table = tuple((int(r), str(k)) for r, k in picks)
            if not table or table[0][0] != min(PRODUCT_ROWS) or any(k not in PRODUCT_KERNELS for _, k in table):
                return None
            out[(a, b)] = table
        return out
    except (KeyError, TypeError, ValueError, AttributeError):
        return None


def packing_summary(about: dict) -> str | None:
    """One line saying which way the fp32 products run, as :func:`calibrate_products` measured (from a cost table's
    ``about``), e.g. ``"fp32 products by rows, as measured on this machine: 576x1536 linear 1-3, packed 4+; ..."``;
    None when it did not run (not the lean forward on a CPU with fp32 weights). Raises nothing."""
    from megatron_jf.inference.lean_forward import SKINNY_MAX_ROWS, LeanForward, measured_kernel

    kernels = products_from_about(about) if "products" in about else None
    if not kernels:
        return None
    parts = []
    for (a, b), table in kernels.items():
        w = torch.empty(a, b, device="meta")  # (the default kernel goes by the weight's size)
        picks = []  # what runs, row count by row count up to past the table and one skinny pass, as runs
        for r in range(1, max(table[-1][0], SKINNY_MAX_ROWS) + 2):
            k = measured_kernel(table, r, lambda: LeanForward.default_kernel(w, SKINNY_MAX_ROWS + 1))
            if not picks or picks[-1][1] != k:
                picks.append((r, k))
        spans = []
        for i, (r, k) in enumerate(picks):
            end = picks[i + 1][0] - 1 if i + 1 < len(picks) else None
            spans.append(f"{k} {r}+" if end is None else (f"{k} {r}" if end == r else f"{k} {r}-{end}"))
        parts.append(f"{a}x{b} {', '.join(spans)}")
    return "fp32 products by rows, as measured on this machine: " + "; ".join(parts)


def _apply_packing(runner, about: dict) -> None:
    kernels = products_from_about(about) if "products" in about else None
    if runner.lean is not None and kernels:
        runner.lean.kernels = kernels
        runner.lean.make_copies()


def measure_rows(runner, rows: int, max_tokens: int, *, context: int = CONTEXT, budget_s: float = BUDGET_S,
                 reps: int = REPS) -> dict[int, float]:
    """Seconds of one decode forward of ``rows`` rows x ``s`` tokens (the fastest of ``reps`` passes, more while the
    measurement has taken under :data:`REFINE_S`) for ``s`` in :data:`TOKENS` up to ``max_tokens`` (and
    ``max_tokens``), until :data:`STOP_RATIO` or ``budget_s``.

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

        # the one-token forward is the reference: timed next to every point, but kept once a pass like every
        # other point -- the fastest of a dozen times more timings priced it below the others by the luck of the
        # draw (the quickstart JF model's tables had 2 tokens at 1.00-1.38x one token in eight processes, its
        # decode loop 1.07x; kept once a pass, 1.00-1.04x in five)
        def point(s: int) -> None:
            t1 = once(1)
            if s == 1:
                times[1] = min(times[1], t1)
            else:
                times[s] = min(times.get(s, float("inf")), once(s))

        for s in grid:  # the first pass decides how far the curve goes
            point(s)
            spent = agreed_seconds(time.perf_counter() - start)
            if len(times) >= 4 and (times[s] > STOP_RATIO * times[1] or spent > budget_s):
                break
        passes = 1
        while passes < reps or agreed_seconds(time.perf_counter() - start) < REFINE_S:
            for s in list(times):  # then whole passes again, each point's fastest time kept
                point(s)
            passes += 1
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
    if not points or products_from_about(about) is None:  # the kernels are measured before the table, which then
        about.update(calibrate_products(runner.lean if runner.impl == "lean" else None) or {})  # times them
    _apply_packing(runner, about)
    for b in missing:
        points[b] = measure_rows(runner, b, max_tokens)
    del runner
    out = ForwardCost(points, about)
    _store(path, out)
    return out
