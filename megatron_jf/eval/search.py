"""The inference-configuration grid search of the paper's Appendix E (Figure 5): every point of block size n x
verification size v (x blocks K x spawn threshold r) measured greedy on a prompt set, a quadratic surface of TPS over
(log2 n, v) fitted through the best point's slice, and its contour plot. The command is ``jf search``
(``tools/search_inference_config.py``, :mod:`megatron_jf.commands.search`)."""

from __future__ import annotations

import itertools
import math
import sys
from typing import Any, Optional, Sequence

__all__ = ["search", "fit_quadratic_surface", "eval_surface", "plot_surface"]


def _measure(engine, prompts, cfg, reference, *, max_new_tokens: int, eos_ids, batch_size: int) -> dict[str, Any]:
    """One grid point through :func:`megatron_jf.eval.speed.measure` (``reference``: AR's tokens per prompt, None
    for AR itself): ``{"tpf", "tps", "tokens", "forwards", "decode_s", "outputs", "lossless"}``; TPF and TPS are ratios
    of sums, TPS decode-only tokens per second; ``lossless``: every output equal to the reference's."""
    from megatron_jf.eval.speed import measure

    name = "AR" if reference is None else "point"  # AR is its own reference
    m = measure(engine, [list(p) for p in prompts], {name: cfg}, max_new_tokens=max_new_tokens,
                batch_size=batch_size, eos_ids=eos_ids, strict=False, reference=reference).methods[name]
    return {"tpf": m.tpf, "tps": m.tps, "tokens": m.tokens, "forwards": m.forwards, "decode_s": m.decode_s,
            "outputs": m.outputs, "lossless": reference is None or m.outputs == reference}


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

    from megatron_jf.fileio import atomic_write_bytes as _atomic_bytes

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
    ar = _measure(engine, prompts, decode_config_from("ar"), None, max_new_tokens=max_new_tokens, eos_ids=eos_ids,
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
        m = _measure(engine, prompts, cfg, ar["outputs"], max_new_tokens=max_new_tokens, eos_ids=eos_ids,
                     batch_size=batch_size)
        points.append({"decoder": decoder, "block_size": cfg.block_size, "verification_size": cfg.verification_size,
                       "num_blocks": cfg.num_blocks, "spawn_threshold": cfg.spawn_threshold, "tpf": m["tpf"],
                       "tps": m["tps"], "speedup_tps": m["tps"] / ar["tps"], "lossless": m["lossless"]})
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
