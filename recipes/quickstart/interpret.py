"""The report's "what the numbers mean" section and its warnings: base vs final Jacobi Forcing model, per
decoder, against the targets of the quickstart (code and model B: Jacobi TPF > 1.13 at held-out NLL drift <= 0.1
nat/token, pass@1 at most 2 problems below base: one-sided, a gain always meets it; math: :func:`math_targets`), and
the caveats of measuring on a small shared CPU.

A model flagged by the report (degenerate output or ``L_pc`` identically zero, :mod:`megatron_jf.eval.degenerate`;
``summary["warnings"]``) is warned about once, above the tables (:func:`warning_lines`); its table rows carry a
short tag (:func:`row_check`), and a target that involves it reads "not meaningful (...)" instead of met / missed:
the figures of a degenerate model say nothing about Jacobi Forcing."""

from __future__ import annotations

__all__ = ["TARGET_TPF", "TARGET_NLL_DRIFT", "TARGET_PASS_DELTA", "TARGET_TPF_GAIN", "TARGET_ACCURACY_DELTA",
           "TARGET_DISTINCT4_DROP", "TARGET_BASE_ACCURACY", "TARGET_BASE_STEPS", "PAPER_EVAL_BLOCK_SIZE", "math_targets",
           "headline_n",
           "headline_tpf", "compare_rows",
           "flag_tags", "row_check", "warning_lines", "target_verdict", "interpretation_markdown"]

#: Model B (issue 31): the Jacobi TPF to pass with held-out NLL drift <= TARGET_NLL_DRIFT -- the best measured earlier
#: at kept quality (round 2 with the anchor term: 1.13); the earlier ">= 1.5" target is retired
TARGET_TPF = 1.13
TARGET_NLL_DRIFT = 0.1  #: nats/token of held-out NLL increase allowed
TARGET_PASS_DELTA = 2  #: problems of pass@1 the final model may lose against base (gains always meet the target)
TARGET_TPF_GAIN = 0.5  #: math domain: held-out Jacobi TPF gain of the final model over the base model
#: the block size the paper evaluates Jacobi decoding at (Sec. 4.2: "we run all evaluations with a block size of 128")
PAPER_EVAL_BLOCK_SIZE = 128
TARGET_ACCURACY_DELTA = 0.02  #: math domain: exact answers / right steps the final model may lose (fraction)
TARGET_DISTINCT4_DROP = 0.15  #: math domain: relative drop of distinct-4 allowed
#: math domain: the base's own quality, exact answers or right steps (fractions; either meets it) -- below both the
#: accuracy targets have little to lose, so keeping them says little
TARGET_BASE_ACCURACY, TARGET_BASE_STEPS = 0.10, 0.50

#: short tags of the report's warnings (:func:`recipes.quickstart.report._output_warnings` text -> tag)
_TAGS = (("DEGENERATE OUTPUT", "degenerate output"), ("L_pc IDENTICALLY ZERO", "L_pc identically zero"))


def flag_tags(warning: str | None) -> list[str]:
    """Short names of what a model's warning says (``[]`` for none), e.g. ``["degenerate output"]``."""
    if not warning:
        return []
    return [tag for key, tag in _TAGS if key in warning] or ["flagged"]


def row_check(row: dict) -> str:
    """The "output check" cell of a report row: ``ok``, or ``⚠`` and the short tags (the full warning is printed
    once per model above the table by :func:`warning_lines`)."""
    tags = flag_tags(row.get("output_warning"))
    return "⚠ " + ", ".join(tags) if tags else "ok"


def warning_lines(warnings: dict | None) -> list[str]:
    """One Markdown line per flagged model: ``**WARNING (model)**: full warning.``"""
    return [f"**WARNING ({m})**: {w}." for m, w in (warnings or {}).items() if w]


def target_verdict(met: bool, flagged: dict, models=()) -> str:
    """``met`` / ``missed`` -- or, when any of ``models`` is flagged in ``flagged`` (model -> warning),
    ``not meaningful (model: tags)``: a flagged model's figures never meet or miss a target."""
    why = [f"{m}: {', '.join(flag_tags(flagged[m]))}" for m in models if flagged.get(m)]
    if why:
        return f"not meaningful ({'; '.join(why)})"
    return "met" if met else "missed"


def compare_rows(rows: list[dict], base: str, final: str) -> list[dict]:
    """``[{"decoder", "base", "final"}]`` for every decoder both models have (rows of ``report.json``)."""
    by = {(r["model"], r["decoder"]): r for r in rows}
    decs = [r["decoder"] for r in rows if r["model"] == base]
    return [{"decoder": d, "base": by[(base, d)], "final": by[(final, d)]} for d in decs if (final, d) in by]


def _pct(x):
    return "-" if x is None else f"{100 * x:.1f}%"


def _at_least(x: float, bound: float) -> bool:
    """``x >= bound`` for measured fractions and differences of them: a value equal to the bound up to rounding meets
    it (19/200 - 23/200 is -0.020000000000000004 in floating point, exactly the 2 points allowed)."""
    return x >= bound - 1e-9


def headline_n(summary: dict) -> int | None:
    """The block size of the report's headline held-out Jacobi TPF (``summary["headline_n"]``; reports written
    before it: the decoders' block size ``summary["n"]``)."""
    return summary.get("headline_n") or summary.get("n")


def headline_tpf(summary: dict, model: str) -> float:
    """``model``'s held-out Jacobi TPF at :func:`headline_n` (from ``tpf_by_block_size``, whose keys are ints in
    memory and strings once read back from ``report.json``; the Jacobi row's TPF at the decoders' block size).

    Raises:
        KeyError: the report has no Jacobi TPF of ``model`` at that block size."""
    n = headline_n(summary)
    if n is None or n == summary.get("n"):
        tpf = next((r["tpf"] for r in summary["rows"] if r["model"] == model and r["decoder"].startswith("Jacobi")), None)
        if tpf is None:
            raise KeyError(f"the report has no Jacobi row of {model!r}")
        return tpf
    curve = summary["tpf_by_block_size"][model]
    return curve[n] if n in curve else curve[str(n)]


def math_targets(summary: dict, base: str, final: str, flagged: dict | None = None) -> list[str]:
    """The math domain's targets, base vs final model, one sentence each: held-out Jacobi TPF gain >= 0.5, the base's
    own quality (>= 10 % exact answers or >= 50 % right steps), exact answers and right steps at most 2 points below
    base, in-domain held-out NLL drift <= 0.1 nat/token, distinct-4 at most 15 % below base; each met / missed, or
    not meaningful when a model is flagged."""
    flagged, pair = flagged or {}, (base, final)
    rows = {(r["model"], r["decoder"].split(" ")[0]): r for r in summary["rows"]}
    b, f = rows[(base, "Jacobi")], rows[(final, "Jacobi")]
    q = summary["math_quality"]
    drift = f["nll"] - b["nll"]
    d4 = f["distinct4"] / b["distinct4"] - 1 if b["distinct4"] else float("nan")
    hn, (tb, tf) = headline_n(summary), (headline_tpf(summary, m) for m in pair)
    gain = tf - tb
    where = "" if hn == summary.get("n", hn) else (
        f" at n={hn} ({'the paper' if hn == PAPER_EVAL_BLOCK_SIZE else 'the preset'}'s evaluation block size)")
    line = (f"Held-out Jacobi TPF{where} {tb:.2f} -> {tf:.2f} ({gain:+.2f}): target a gain >= {TARGET_TPF_GAIN} "
            f"{target_verdict(_at_least(gain, TARGET_TPF_GAIN), flagged, pair)}")
    if where:
        line += (f"; at the training block size n={summary['n']}: {b['tpf']:.2f} -> {f['tpf']:.2f} "
                 f"({f['tpf'] - b['tpf']:+.2f})")
    out = [line + "."]
    tt = summary.get("template_tpf") or {}
    td = summary.get("template_distinct4") or {}
    if base in tt and final in tt:
        line = (f"On held-out templates (never trained on): {tt[base]:.2f} -> {tt[final]:.2f} "
                f"({tt[final] - tt[base]:+.2f})")
        if td.get(base) and final in td:
            drop = td[final] / td[base] - 1
            line += f"; distinct-4 there {td[base]:.3f} -> {td[final]:.3f} ({100 * drop:+.1f} %)"
            if drop < -TARGET_DISTINCT4_DROP:
                line += (f", more than {100 * TARGET_DISTINCT4_DROP:.0f} % below base: the output there turned "
                         "repetitive, so that TPF is not a decoding gain")
        out.append(line + ".")
    qb, b_steps = q[base], q[base].get("step_accuracy") if q[base].get("steps") else None
    base_ok = _at_least(qb["accuracy"], TARGET_BASE_ACCURACY) or (b_steps is not None
                                                                   and _at_least(b_steps, TARGET_BASE_STEPS))
    out.append(f"Base quality {100 * qb['accuracy']:.1f}% exact answers, {_pct(b_steps)} right steps: target >= "
               f"{100 * TARGET_BASE_ACCURACY:.0f}% exact or >= {100 * TARGET_BASE_STEPS:.0f}% right steps "
               f"{target_verdict(base_ok, flagged, (base,))}"
               + ("." if base_ok else " (the accuracy targets below have little to lose)."))
    for key, what in (("accuracy", "Exact answers"), ("step_accuracy", "Arithmetically right steps")):
        if key == "step_accuracy" and not (q[base].get("steps") and q[final].get("steps")):
            out.append(f"{what}: not scored (no `a op b = c` step in the greedy answers of "
                       f"{' and '.join(m for m in pair if not q[m].get('steps'))}).")
            continue
        d = q[final][key] - q[base][key]
        out.append(f"{what} {100 * q[base][key]:.1f}% -> {100 * q[final][key]:.1f}% ({100 * d:+.1f} points): target "
                   f"at most {100 * TARGET_ACCURACY_DELTA:.0f} points below base "
                   f"{target_verdict(_at_least(d, -TARGET_ACCURACY_DELTA), flagged, pair)}.")
    drift_ok = _at_least(-drift, -TARGET_NLL_DRIFT)
    out.append(f"In-domain held-out NLL drift {drift:+.3f} nat/token: target <= {TARGET_NLL_DRIFT} "
               f"{target_verdict(drift_ok, flagged, pair)} (teacher forced on the held-out problems' "
               "ground-truth answers).")
    out.append(f"Distinct-4 {b['distinct4']:.3f} -> {f['distinct4']:.3f} ({100 * d4:+.1f} %): target at most "
               f"{100 * TARGET_DISTINCT4_DROP:.0f} % below base "
               f"{target_verdict(_at_least(d4, -TARGET_DISTINCT4_DROP), flagged, pair)}.")
    return out


def interpretation_markdown(summary: dict) -> str:
    """Markdown for ``summary`` (the report's ``report.json`` content; uses ``rows`` and, when present,
    ``warnings`` and ``learning_curve``)."""
    models = list(dict.fromkeys(r["model"] for r in summary["rows"]))
    if len(models) < 2:
        return ""
    base, final = models[0], models[-1]
    flagged = summary.get("warnings") or {}
    pair = (base, final)
    lines = ["", f"## What the numbers mean ({base} vs {final})", "",
             "| Method | TPF base -> JF | speedup base -> JF | pass@1 base -> JF | NLL base -> JF (drift) "
             "| top-1 agree w/ base | distinct-4 base -> JF |", "|---|---|---|---|---|---|---|"]
    cmp = compare_rows(summary["rows"], base, final)
    for c in cmp:
        if c["decoder"] == "transformers greedy":
            continue
        b, f = c["base"], c["final"]
        lines.append(f"| {c['decoder']} | {b['tpf']:.2f} -> {f['tpf']:.2f} | {b['speedup']:.2f}x -> "
                     f"{f['speedup']:.2f}x | {_pct(b.get('pass@1'))} -> {_pct(f.get('pass@1'))} | {b['nll']:.3f} -> "
                     f"{f['nll']:.3f} ({f['nll'] - b['nll']:+.3f}) | {100 * f['tf_agreement_with_base']:.1f}% | "
                     f"{b['distinct4']:.3f} -> {f['distinct4']:.3f} |")
    jac = next((c for c in cmp if c["decoder"].startswith("Jacobi")), None)
    if jac is not None and summary.get("math_quality"):
        lines += [""] + [f"- {t}" for t in math_targets(summary, base, final, flagged)]
    elif jac is not None:
        t, drift = jac["final"]["tpf"], jac["final"]["nll"] - jac["base"]["nll"]
        tpf_v = target_verdict(t > TARGET_TPF and drift <= TARGET_NLL_DRIFT, flagged, pair)
        nll_v = target_verdict(drift <= TARGET_NLL_DRIFT, flagged, pair)
        if tpf_v == "missed":  # say which half missed, to the precision that shows it (1.4997 is not 1.50)
            short = [f"TPF {t:.3f} <= {TARGET_TPF}"] if t <= TARGET_TPF else []
            tpf_v += f" ({', '.join(short + ([f'drift {drift:+.3f}'] if drift > TARGET_NLL_DRIFT else []))})"
        lines += ["", f"- Jacobi TPF {jac['base']['tpf']:.2f} -> {t:.2f} at held-out NLL drift {drift:+.3f}: target "
                      f"TPF > {TARGET_TPF} at drift <= {TARGET_NLL_DRIFT} {tpf_v}. TPF counts tokens per "
                      "forward pass and does not depend on the machine; speedup is wall-clock and does.",
                  f"- Held-out NLL drift {drift:+.3f} nat/token: target <= {TARGET_NLL_DRIFT} {nll_v} "
                  "(teacher-forced on held-out text, which no training prompt comes from)."]
    curve = summary.get("learning_curve") or []
    if len(curve) > 1 and curve[0].get("pass@1") is not None:
        m = curve[0]["pass_prompts"]
        d = round(curve[-1]["pass@1"] * m) - round(curve[0]["pass@1"] * m)
        v = target_verdict(d >= -TARGET_PASS_DELTA, flagged, pair)
        lines.append(f"- pass@1 on {m} HumanEval problems (learning curve, first vs last point): {d:+d} problems, "
                     f"target within {TARGET_PASS_DELTA}: {v} (one-sided: at most {TARGET_PASS_DELTA} problems below "
                     "base; a gain always meets it).")
    lines += [
        "",
        "Caveats: speedup is timed at batch 1 on the first few prompts of a shared CPU, against the faster of this "
        "project's AR and transformers greedy on the same weights; on a CPU a Jacobi forward over n=32 tokens costs "
        "far more than an AR forward, so TPF gains show as wall-clock speedup only where the forward is "
        "memory-bound (a GPU). pass@1 on a dozen problems moves in steps of ~8 points; the learning curve's "
        "larger set is the one to compare. Every decoder's output equals the same model's greedy AR output "
        "(asserted), so pass@1 and distinct-4 are the same for every decoder of one model; they change only "
        "because training changed the model. Greedy-output agreement drops with one early different token, "
        "top-1 agreement (teacher forced) does not.",
    ]
    return "\n".join(lines) + "\n"
