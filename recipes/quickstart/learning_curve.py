"""The quickstart's learning curve: Jacobi TPF and HumanEval pass@1 against training samples seen.

The Jacobi Forcing rounds save checkpoints at evenly spaced steps (``pretrain_jf.py --save-interval``, kept:
no ``--keep-last``); every saved iteration of every round is one point, plus the base model at 0 samples.
A point is the greedy AR output on the pass@1 prompts (``prompts_pass.jsonl`` when the prompts stage wrote
one — the first ``preset.n_pass_prompts`` HumanEval problems —, else the report's evaluation prompts) and the
vanilla Jacobi output at block size ``n = preset.n2`` on the first ``preset.curve_tpf_prompts`` of them (0: all),
both batched. The Jacobi output is asserted equal to AR (lossless), TPF is tokens emitted / forwards over those
prompts, pass@1 is scored on the greedy output (HumanEval prompts only). Jacobi at n=32 costs ~32x the tokens
of AR per forward on a CPU, hence the smaller TPF subset.

Samples at a point: ``iteration x micro-batch size`` (one data-parallel rank, no gradient accumulation in the
quickstart), plus every earlier round's samples. Each point is cached in ``report/curve_<ckpt>_<iter>.json``
(keyed by the checkpoint's mtime and the settings), so a killed report resumes after the last finished point.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from megatron_jf.fileio import atomic_write_json

__all__ = ["saved_iterations", "curve_points", "evaluate_curve", "curve_markdown", "plot_curve"]


def saved_iterations(ckpt_dir: str | os.PathLike) -> list[int]:
    """The complete saved iterations of a checkpoint directory, ascending (``iter_NNNNNNN`` folders that
    :func:`megatron_jf.checkpointing.checkpoint_path` accepts)."""
    from megatron_jf.checkpointing import checkpoint_path

    d = Path(ckpt_dir)
    out = []
    for name in sorted(os.listdir(d)) if d.is_dir() else []:
        if name.startswith("iter_") and name[5:].isdigit():
            try:
                checkpoint_path(str(d), int(name[5:]))
            except (FileNotFoundError, ValueError):
                continue
            out.append(int(name[5:]))
    return out


def curve_points(pipe) -> list[dict]:
    """``[{"ckpt", "iteration", "samples", "label"}]``: the base model, then every saved iteration of each JF
    round in :attr:`Preset.report_models` order (samples accumulate across rounds)."""
    p = pipe.p
    points = [{"ckpt": "base", "iteration": None, "samples": 0, "label": "base"}]
    offset = 0
    for ck, steps in (("jf1", p.jf1_steps), ("jf2", p.jf2_steps)):
        for it in saved_iterations(pipe.path(ck)):
            points.append({"ckpt": ck, "iteration": it, "samples": offset + it * p.jf_mbs,
                           "label": f"{ck} step {it}"})
        offset += steps * p.jf_mbs
    return points


def _evaluate_point(pipe, point, prompts, n_tpf, eos) -> dict:
    from megatron_jf.checkpointing import load_model
    from megatron_jf.decoding import PAPER
    from megatron_jf.inference.engine import DecodeConfig
    from megatron_jf.inference.llm import LLM

    p = pipe.p
    model, _, _ = load_model(str(pipe.path(point["ckpt"])), iteration=point["iteration"])
    eng = LLM.from_model(model).engine
    R = p.response_tokens
    ar = eng.generate(prompts, DecodeConfig("ar"), max_new_tokens=R, eos_ids=eos)
    jac = eng.generate(prompts[:n_tpf], DecodeConfig("jacobi", block_size=p.n2, **PAPER), max_new_tokens=R,
                       eos_ids=eos)
    ref = [r.tokens for r in ar]
    if [r.tokens for r in jac] != ref[:n_tpf]:
        raise AssertionError(f"{point['label']}: Jacobi n={p.n2} output differs from greedy AR (not lossless)")
    return {"tpf": sum(len(r.tokens) for r in jac) / sum(r.forwards for r in jac), "outputs": ref}


def evaluate_curve(pipe, prompt_rows: list[dict], eos) -> list[dict]:
    """Evaluate every :func:`curve_points` point (cached per point); returns the points with ``tpf`` and
    ``pass@1`` (None without HumanEval task ids) added.

    Raises:
        AssertionError: a Jacobi output differs from greedy AR.
    """
    from megatron_jf.tokenizer import load_tokenizer

    from megatron_jf.eval.quality import humaneval_pass1

    if pipe.path("prompts_pass.jsonl").is_file():
        prompt_rows = [json.loads(line) for line in open(pipe.path("prompts_pass.jsonl"))]
    humaneval = bool(prompt_rows) and "task_id" in prompt_rows[0]
    tok = load_tokenizer(pipe.path("base", "tokenizer")) if humaneval else None
    prompts = [r["prompt_ids"] for r in prompt_rows]
    n_tpf = getattr(pipe.p, "curve_tpf_prompts", 0) or len(prompts)
    out_dir = pipe.path("report")
    out_dir.mkdir(exist_ok=True)
    res = []
    for pt in curve_points(pipe):
        it = pt["iteration"]
        ckdir = pipe.path(pt["ckpt"])
        stamp = os.stat(ckdir / (f"iter_{it:07d}" if it is not None else "latest_checkpointed_iteration.txt"))
        key = {"ckpt": pt["ckpt"], "iteration": it, "mtime": stamp.st_mtime_ns, "prompts": prompts,
               "response_tokens": pipe.p.response_tokens, "block_size": pipe.p.n2, "tpf_prompts": n_tpf}
        cache = out_dir / f"curve_{pt['ckpt']}_{'latest' if it is None else it}.json"
        try:
            got = json.loads(cache.read_text())
        except (OSError, ValueError):
            got = None
        if not (isinstance(got, dict) and got.get("key") == key):
            pipe.log(f"[report] learning curve: {pt['label']} ({pt['samples']} samples)")
            got = dict(_evaluate_point(pipe, pt, prompts, n_tpf, eos), key=key)
            atomic_write_json(cache, got, indent=None)
        pass1 = humaneval_pass1(prompt_rows, {"m": got["outputs"]}, tok)["m"] if humaneval else None
        res.append(dict(pt, tpf=got["tpf"], tpf_prompts=n_tpf, pass_prompts=len(prompts), **{"pass@1": pass1}))
    return res


def curve_markdown(points: list[dict], n: int) -> str:
    """The report's learning-curve section (a table, the base-vs-final pass@1 comparison; the plot is
    ``learning_curve.png``)."""
    k, m = points[0]["tpf_prompts"], points[0]["pass_prompts"]
    lines = ["", f"Learning curve: vanilla Jacobi TPF at n={n} on the first {k} and greedy pass@1 on {m} evaluation "
             "prompts at each saved checkpoint (Jacobi output asserted equal to greedy AR at every point):", "",
             "| Checkpoint | training samples | Jacobi TPF | pass@1 |", "|---|---|---|---|"]
    for pt in points:
        p1 = "-" if pt["pass@1"] is None else f"{round(pt['pass@1'] * m)}/{m} ({100 * pt['pass@1']:.1f}%)"
        lines.append(f"| {pt['label']} | {pt['samples']} | {pt['tpf']:.3f} | {p1} |")
    if points[0]["pass@1"] is not None and len(points) > 1:
        from recipes.quickstart.interpret import TARGET_PASS_DELTA

        d = round(points[-1]["pass@1"] * m) - round(points[0]["pass@1"] * m)
        lines += ["", f"pass@1 on {m} problems, final checkpoint vs base: {d:+d} problems "
                      f"({'within' if d >= -TARGET_PASS_DELTA else 'outside'} the target: at most "
                      f"{TARGET_PASS_DELTA} below base)."]
    return "\n".join(lines) + "\n\n![learning curve](learning_curve.png)\n"


def plot_curve(out_dir, points: list[dict], n: int) -> Path | None:
    """``learning_curve.png``: TPF (left axis) and pass@1 (right axis) against training samples; None when
    matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    xs = [pt["samples"] for pt in points]
    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    ax.plot(xs, [pt["tpf"] for pt in points], marker="o", color="tab:blue", label=f"Jacobi TPF (n={n})")
    ax.set_xlabel("training samples (Jacobi Forcing, all rounds)")
    ax.set_ylabel("tokens per forward", color="tab:blue")
    if all(pt["pass@1"] is not None for pt in points):
        ax2 = ax.twinx()
        ax2.plot(xs, [100 * pt["pass@1"] for pt in points], marker="s", color="tab:red", label="pass@1")
        ax2.set_ylabel("HumanEval pass@1 (%)", color="tab:red")
    ax.set_title("Learning curve")
    fig.tight_layout()
    path = Path(out_dir) / "learning_curve.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
