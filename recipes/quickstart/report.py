"""The quickstart's Table-1-style report: speed (TPF, TPS, speedup vs AR in the same run) and quality
(held-out NLL, greedy agreement with the base model) for the base and Jacobi Forcing models.

Every decoder's output is checked against the same model's greedy AR output; a mismatch aborts the
report (the decoders are lossless by construction, so a mismatch is a bug), except one at a floating-point near tie
(:func:`megatron_jf.eval.speed.divergence`), which the report lists with its position and logit gap.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict

import numpy as np
import torch

from megatron_jf.eval.hf_baseline import HF as HF_ROW  # "transformers greedy"
from megatron_jf.fileio import atomic_write_json, atomic_write_text


from megatron_jf.eval.quality import answer_nll, distinct4, heldout_nll, humaneval_pass1, math_accuracy


def _load(path):
    from megatron_jf.checkpointing import load_model

    model, args, meta = load_model(str(path))
    return model


def build_report(pipe) -> dict:
    """Evaluate base and JF models on the held-out prompts; write ``report/report.{json,md}`` and plots."""
    from megatron_jf import parallel
    from megatron_jf.cli import DEFAULT_DECODER
    from megatron_jf.decoding import PAPER
    from megatron_jf.inference.engine import DecodeConfig
    from megatron_jf.tokenizer import load_tokenizer

    p = pipe.p
    torch.set_num_threads(p.threads)
    parallel.initialize(1, 1)
    parallel.set_seed(0)
    out_dir = pipe.path("report")
    out_dir.mkdir(exist_ok=True)
    tok = load_tokenizer(pipe.path("base", "tokenizer"))
    eos = set(tok.eos_ids)
    prompt_rows = [json.loads(l) for l in open(pipe.path("prompts_eval.jsonl"))]
    prompts = [r["prompt_ids"] for r in prompt_rows]
    fit = [json.loads(l)["prompt_ids"] for l in open(pipe.path("prompts_train.jsonl"))][: p.fit_prompts]
    held = np.load(pipe.path("tokens_heldout.npy")) if pipe.path("tokens_heldout.npy").exists() else None
    if p.math:  # in-domain held-out NLL: answers given questions (answer_nll)
        held = [json.loads(l) for l in open(pipe.path("nll_eval.jsonl"))]
    quality_rows = prompt_rows  # math domain: every held-out problem scored (the first ones are ``prompts``)
    if p.math and pipe.path("prompts_quality.jsonl").exists():
        quality_rows = [json.loads(l) for l in open(pipe.path("prompts_quality.jsonl"))]
        if [r["id"] for r in quality_rows[: len(prompt_rows)]] != [r["id"] for r in prompt_rows]:
            raise ValueError(f"{pipe.path('prompts_quality.jsonl')} does not start with the problems of "
                             f"{pipe.path('prompts_eval.jsonl')}: run the prompts stage again")
    quality_prompts = [r["prompt_ids"] for r in quality_rows[len(prompt_rows):]]
    n = p.report_n
    template = []  # math domain: problems of templates held out from everything (Jacobi TPF there too)
    noisy_records = None  # math domain: the base model's trajectories on held-out problems (noisy-token accuracy)
    if p.math:
        template = [json.loads(l)["prompt_ids"] for l in open(pipe.path("prompts_eval_template.jsonl"))]
        if p.noisy_prompts:
            noisy_records = _base_heldout_trajectories(pipe, prompt_rows[: p.noisy_prompts])
    # the method's TPF: Jacobi and MR drafting the whole block every step, as the paper runs them; the speed a user
    # gets: the tools' default decoder, whose width follows the measured forward cost and the acceptance (issue 33)
    decoders = {"AR": DecodeConfig("ar"), f"Jacobi (n={n})": DecodeConfig("jacobi", block_size=n, **PAPER),
                f"MR (n={n}, K=2, r=0.85, v=4)": DecodeConfig("mr", block_size=n, num_blocks=2, spawn_threshold=0.85,
                                                           verification_size=4, **PAPER),
                f"default ({DEFAULT_DECODER} n<={n}, K=2, auto width)": DecodeConfig(DEFAULT_DECODER, block_size=n,
                                                                                    num_blocks=2)}
    labels = {"base": "base", "jf1": "JF round 1", "jf2": "JF round 2"}
    models = {labels[ck]: ck for ck in p.report_models}
    rows, curves, outputs, tf_argmax, jacobi_tpf, fit_tpf, extras = [], {}, {}, {}, {}, {}, {}
    quality_outputs, near_ties = {}, []
    R = p.response_tokens
    for label, ck in models.items():
        # one model's results are kept in report/eval_<ckpt>.json, so a report stage killed (or failing) after a
        # model finished resumes after it; the key makes a retrained checkpoint or changed settings re-evaluate
        saved = os.stat(pipe.path(ck, "latest_checkpointed_iteration.txt")).st_mtime_ns
        key = {"checkpoint": ck, "checkpoint_time": saved, "prompts": prompts, "response_tokens": R,
               "decoders": list(decoders), "block_sizes": list(p.eval_block_sizes),
               "timing_prompts": p.timing_prompts, "timing_rounds": p.timing_rounds,
               "timing_threads": p.timing_threads, "nll_chunks": p.nll_chunks, "fit_prompts": fit,
               "template_prompts": template, "noisy_prompts": p.noisy_prompts,
               "quality_prompts": quality_prompts}
        cache = out_dir / f"eval_{ck}.json"
        try:
            res = json.loads(cache.read_text())
        except (OSError, ValueError):  # none yet, or unreadable: evaluate again
            res = None
        if isinstance(res, dict) and res.get("key") == key:
            pipe.log(f"[report] {label}: evaluated earlier ({cache})")
        else:
            pipe.log(f"[report] evaluating {label}")
            res = _evaluate_model(pipe.path(ck), label, prompts, held, decoders, p, eos, fit, template,
                                  noisy_records, quality_prompts)
            atomic_write_json(cache, dict(res, key=key), indent=None)
        rows += res["rows"]
        curves[label] = {int(k): v for k, v in res["curve"].items()}
        outputs[label] = res["outputs"]
        quality_outputs[label] = res.get("quality_outputs") or []
        tf_argmax[label] = None if res["tf_argmax"] is None else torch.tensor(res["tf_argmax"])
        jacobi_tpf[label] = res["jacobi_tpf"]
        if res.get("fit_tpf") is not None:
            fit_tpf[label] = res["fit_tpf"]
        near_ties += [dict(t, model=label) for t in res.get("near_ties") or ()]
        for key in ("template_tpf", "template_distinct4", "noisy_accuracy"):
            if res.get(key) is not None:
                extras.setdefault(key, {})[label] = res[key]
    # speedup vs the faster AR of the same model (this project's or transformers greedy), measured in the same run
    for r in rows:
        ars = [x for x in rows if x["model"] == r["model"] and x["decoder"] in ("AR", HF_ROW)]
        fastest = max(ars, key=lambda x: x["tps"])
        r["speedup"] = r["tps"] / fastest["tps"]
        r["fastest_ar"] = fastest["decoder"]
    pass1 = humaneval_pass1(prompt_rows, outputs, tok) if "task_id" in prompt_rows[0] else {}
    math_quality = None
    if p.math:  # exact answers and arithmetically right steps of the greedy outputs (every decoder's: lossless)
        from recipes.quickstart.math_domain import load_problems

        answer = {r["id"]: r["answer"] for r in load_problems(pipe.out, "heldout")}
        math_quality = math_accuracy({m: o + quality_outputs[m] for m, o in outputs.items()},
                                     [answer[r["id"]] for r in quality_rows],
                                     lambda t: tok.decode([x for x in t if x not in eos]))
        for r in rows:
            r.update({k: math_quality[r["model"]][k] for k in ("accuracy", "step_accuracy")})
    for r in rows:
        r["pass@1"] = pass1.get(r["model"])
    base_out = outputs["base"]
    for r in rows:
        o = outputs[r["model"]]
        same = sum(sum(a == b for a, b in zip(x, y)) for x, y in zip(o, base_out))
        r["agreement_with_base"] = same / max(sum(len(y) for y in base_out), 1)
        a, b = tf_argmax[r["model"]], tf_argmax["base"]
        r["tf_agreement_with_base"] = float((a == b).float().mean()) if a is not None else float("nan")
        r["distinct4"] = distinct4(o)
    warnings, stats = _output_warnings(pipe, models, outputs, tok)
    for r in rows:
        r["output_warning"] = warnings.get(r["model"])
    summary = {"preset": p.name, "rows": rows, "tpf_by_block_size": curves, "eval_prompts": len(prompts),
               "timing_prompts": min(p.timing_prompts, len(prompts)), "timing_rounds": p.timing_rounds,
               "response_tokens": R, "warnings": {m: w for m, w in warnings.items() if w}, "output_stats": stats,
               "fit_tpf": fit_tpf, "fit_prompts": len(fit), "n": n, "headline_n": p.headline_n,
               "math_quality": math_quality,
               "template_tpf": extras.get("template_tpf"), "template_distinct4": extras.get("template_distinct4"),
               "template_prompts": len(template),
               "noisy_accuracy": extras.get("noisy_accuracy"), "noisy_prompts": p.noisy_prompts if noisy_records else 0,
               "quality_problems": len(quality_rows) if p.math else 0, "near_ties": near_ties}
    if getattr(p, "learning_curve", False):  # TPF and pass@1 at every saved checkpoint (learning_curve.py)
        from recipes.quickstart.learning_curve import evaluate_curve, plot_curve

        summary["learning_curve"] = evaluate_curve(pipe, prompt_rows, eos)
        plot_curve(out_dir, summary["learning_curve"], p.report_n)
    from recipes.quickstart.costs import stage_costs, stage_cpu_seconds  # time per stage

    summary["stage_costs"] = stage_costs(pipe)
    summary["stage_cpu_seconds"] = stage_cpu_seconds(pipe)
    atomic_write_json(out_dir / "report.json", summary)
    md = report_markdown(summary)
    atomic_write_text(out_dir / "report.md", md)
    _plots(out_dir, curves)
    # the Figure-4 picture on a typical prompt: the final model's Jacobi TPF there is closest to its mean
    per = jacobi_tpf[list(models)[-1]]
    typical = min(range(len(per)), key=lambda i: (abs(per[i] - sum(per) / len(per)), i))
    _trajectory_picture(pipe, out_dir, prompts[typical], tok)
    pipe.log("\n" + md)
    return {"report": str(out_dir / "report.md")}


def _evaluate_model(ckpt, label, prompts, held, decoders, p, eos, fit=(), template=(), noisy_records=None,
                    quality_prompts=()) -> dict:
    """One model: held-out NLL and argmax, then every decoder batched over all prompts (TPF; output asserted equal
    to greedy AR; :func:`megatron_jf.eval.speed.measure`), then at batch 1 on the first ``p.timing_prompts`` prompts
    next to ``transformers`` greedy, warm-up call each and interleaved rounds at ``p.timing_threads`` threads,
    fastest round kept (TPS; :func:`recipes.quickstart.timing.time_interleaved`), then the Jacobi block-size
    sweep, and the Jacobi TPF at ``n = p.report_n`` on ``fit`` (training prompts: what Jacobi Forcing fit, next to
    the held-out TPF) and on ``template`` (math domain: problems of held-out templates), and the noisy-token accuracy
    by distance on ``noisy_records`` (:mod:`megatron_jf.eval.noisy_accuracy`), and greedy AR on ``quality_prompts``
    (math domain: the held-out problems scored for accuracy beyond ``prompts``; batches of 128).

    Returns:
        JSON-ready ``{"rows", "curve", "outputs", "tf_argmax", "jacobi_tpf", "fit_tpf", "quality_outputs", ...}``
        (``fit_tpf`` None without ``fit``; ``quality_outputs``: token ids per ``quality_prompts`` entry).

    Returns ``near_ties`` too: ``{"prompts", "decoder", "prompt", "position", "gap", "tolerance"}`` per output that
    left greedy AR's at a floating-point near tie (:func:`megatron_jf.eval.speed.divergence`; reported, not an error).

    Raises:
        LosslessError: a decoder's output differs from greedy AR beyond a floating-point near tie (a losslessness
            bug).
    """
    from megatron_jf.eval.hf_baseline import hf_twin, time_hf_greedy_decode
    from megatron_jf.decoding import PAPER
    from megatron_jf.eval.speed import LosslessError, divergence, measure
    from megatron_jf.inference.engine import DecodeConfig
    from megatron_jf.inference.llm import LLM
    from recipes.quickstart.timing import time_interleaved, torch_threads

    model = _load(ckpt)
    eng = LLM.from_model(model).engine
    R = p.response_tokens
    if isinstance(held, list):  # math domain: the held-out problems' ground-truth answers given their questions
        nll, argmax = answer_nll(model, held, min(eos))
    else:
        nll, argmax = heldout_nll(model, held, p.nll_chunks) if held is not None else (float("nan"), None)
    kw = dict(max_new_tokens=R, eos_ids=eos, label=label)
    near_ties = []  # outputs that left greedy AR's at a floating-point near tie (megatron_jf.eval.speed.divergence)

    def ties_of(speed, where):
        for name, st in speed.methods.items():
            near_ties.extend({"prompts": where, "decoder": name, "prompt": i, **asdict(t)}
                             for i, t in sorted(st.near_ties.items()))
        return speed

    batched = ties_of(measure(eng, prompts, decoders, batch_size=len(prompts), **kw), "held-out")  # TPF, losslessness
    ref = batched.outputs
    rows, curve, jacobi_tpf = [], {}, None
    for name, cfg in decoders.items():
        b = batched.methods[name]
        if cfg.decoder == "jacobi":
            jacobi_tpf = [r.tpf for r in b.results]
            curve[cfg.block_size] = b.tpf
        rows.append({"model": label, "decoder": name, "tpf": b.tpf, "tokens": b.tokens, "forwards": b.forwards,
                     "nll": nll, "lossless": True, "near_ties": len(b.near_ties)})
    # wall clock at batch 1 on the same prompts for every decoder, warm-up + interleaved rounds
    # (recipes/quickstart/timing.py): speedup is a same-run ratio
    timing = prompts[: p.timing_prompts]

    def engine_runner(cfg, prs):
        def run():
            t0 = time.perf_counter()
            res = [eng.generate([pr], cfg, max_new_tokens=R, eos_ids=eos)[0] for pr in prs]
            return sum(r.decode_s for r in res), time.perf_counter() - t0, sum(len(r.tokens) for r in res)
        return run

    runners = {name: engine_runner(cfg, timing) for name, cfg in decoders.items()}
    warmup = {name: engine_runner(cfg, timing[:1]) for name, cfg in decoders.items()}  # first-call work untimed
    hf = hf_twin(model)  # transformers greedy on the same weights, same timing prompts, exactly AR's tokens
    if hf is not None:
        def hf_runner(n_prompts):
            def run():
                dec_s = e2e = 0.0
                for pr, want in zip(timing[:n_prompts], ref):
                    d, w, toks = time_hf_greedy_decode(hf, pr, len(want))
                    if toks != want and divergence(eng, pr, want, toks) is None:
                        raise LosslessError(f"{label}: transformers greedy differs from this project's greedy AR "
                                            "beyond a floating-point near tie")
                    dec_s, e2e = dec_s + d, e2e + w
                return dec_s, e2e, sum(len(t) for t in ref[:n_prompts])
            return run

        runners[HF_ROW], warmup[HF_ROW] = hf_runner(len(timing)), hf_runner(1)
        rows.append({"model": label, "decoder": HF_ROW, "tpf": 1.0, "tokens": sum(len(t) for t in ref),
                     "forwards": sum(len(t) for t in ref), "nll": nll, "lossless": True})
    with torch_threads(p.timing_threads):
        timed = time_interleaved(runners, rounds=p.timing_rounds, warmup=warmup)
    del hf
    for r in rows:
        t = timed[r["decoder"]]
        r.update(tps=t["tps"], tps_e2e=t["tps_e2e"], timing_spread=t["spread"])
    for nb in p.eval_block_sizes:
        if nb not in curve:
            name = f"jacobi n={nb}"
            sweep = ties_of(measure(eng, prompts, {name: DecodeConfig("jacobi", block_size=nb, **PAPER)},
                                    batch_size=len(prompts), reference=ref, **kw), "held-out")
            curve[nb] = sweep.methods[name].tpf
    curve = {nb: curve[nb] for nb in p.eval_block_sizes}
    fit_tpf = template_tpf = template_d4 = noisy = None
    if fit:  # measure() adds the AR reference run and checks the Jacobi output against it
        name = f"jacobi n={p.report_n} (training prompts)"
        fit_tpf = ties_of(measure(eng, fit, {name: DecodeConfig("jacobi", block_size=p.report_n, **PAPER)},
                                  batch_size=len(fit), **kw), "training").methods[name].tpf
    if template:
        name = f"jacobi n={p.report_n} (held-out templates)"
        tmpl = ties_of(measure(eng, template, {name: DecodeConfig("jacobi", block_size=p.report_n, **PAPER)},
                               batch_size=len(template), **kw), "held-out templates")
        # with the output's distinct-4: a model repeating itself on templates it never saw decodes at a high TPF
        template_tpf, template_d4 = tmpl.methods[name].tpf, distinct4(tmpl.outputs)
    if noisy_records:
        from megatron_jf.eval.noisy_accuracy import noisy_accuracy

        noisy = noisy_accuracy(model, noisy_records, max_states_per_block=3).summary()
    quality_outputs = []
    if quality_prompts:  # greedy AR: every lossless decoder's answers are these
        quality_outputs = measure(eng, list(quality_prompts), {"AR": DecodeConfig("ar")}, batch_size=128,
                                  **kw).outputs
    return {"quality_outputs": quality_outputs, "rows": rows, "curve": curve, "outputs": ref, "jacobi_tpf": jacobi_tpf, "fit_tpf": fit_tpf,
            "template_tpf": template_tpf, "template_distinct4": template_d4, "noisy_accuracy": noisy,
            "near_ties": near_ties,
            "tf_argmax": None if argmax is None else argmax.tolist()}


def _base_heldout_trajectories(pipe, prompt_rows) -> list:
    """The base model's Jacobi trajectories (block ``n1``, unfiltered) on ``prompt_rows`` (held-out problems), collected
    once into ``report/traj_base_heldout`` (``tools/generate_trajectories.py``; resumable) and read back."""
    from megatron_jf.data.shards import expand_sources, iter_shard

    out = pipe.path("report", "traj_base_heldout")
    if not (out / "manifest.json").is_file():
        prompts = pipe.path("report", "prompts_noisy.jsonl")
        atomic_write_text(prompts, "".join(json.dumps({"id": r["id"], "prompt_ids": r["prompt_ids"]}) + "\n"
                                           for r in prompt_rows))
        pipe.run(["tools/generate_trajectories.py", "--prompts", prompts, "--load", pipe.path("base"), "--out", out,
                  "--block-size", pipe.p.n1, "--max-new-tokens", pipe.p.traj_response_tokens or pipe.p.response_tokens,
                  "--batch-size", len(prompt_rows), "--no-filter", "--threads", pipe.p.threads, "--no-progress"],
                 "report")
    return [rec for path, _, _ in expand_sources(str(out)) for rec in iter_shard(path)]


def _output_warnings(pipe, models: dict, outputs: dict, tok) -> tuple[dict, dict]:
    """``({model label: warning or None}, {model label: {"distinct_2", "top_token_share"}})``: degenerate
    completions (mostly one repeated token, or distinct-2 below its threshold; :mod:`megatron_jf.eval.degenerate`)
    and, for JF rounds, ``pc_loss`` zero at every logged step of ``{ckpt}_log.jsonl``; and the greedy outputs'
    degeneracy statistics."""
    from megatron_jf.eval.degenerate import degeneracy, pc_loss_identically_zero

    out, stats = {}, {}
    for label, ck in models.items():
        parts = []
        deg = degeneracy(outputs[label], decode=tok.decode)
        stats[label] = {"distinct_2": deg["distinct_2"], "top_token_share": deg["top_token_share"]}
        if deg["warning"]:
            parts.append(deg["warning"])
        if ck != "base" and pc_loss_identically_zero(str(pipe.path(f"{ck}_log.jsonl"))):
            parts.append("L_pc IDENTICALLY ZERO during JF training (pc_loss = 0 at every logged step)")
        out[label] = "; ".join(parts) or None
    return out, stats


def report_markdown(summary: dict) -> str:
    """``report.md`` from ``report.json``'s summary: the tables, the learning curve (when the summary has one), what
    the numbers mean against the targets (:mod:`~recipes.quickstart.interpret`) and where the time went. A pure
    function of the summary, so a report re-renders after a change of its text (``report_markdown(json.load(...))``).

    Raises:
        KeyError: a summary without a field the sections read (e.g. ``n`` with a learning curve: report.json files
            written before 2026-12 lack it)."""
    from recipes.quickstart.costs import costs_markdown
    from recipes.quickstart.interpret import interpretation_markdown

    md = _markdown(summary)
    if summary.get("learning_curve"):
        from recipes.quickstart.learning_curve import curve_markdown

        md += curve_markdown(summary["learning_curve"], summary["n"])
    md += interpretation_markdown(summary)
    if "stage_costs" in summary:
        md += costs_markdown(summary["stage_costs"], cpu=summary.get("stage_cpu_seconds"))
    return md


def near_tie_sentence(ties: list[dict]) -> str:
    """The report's words for outputs that left greedy AR's at floating-point near ties (``summary["near_ties"]``)."""
    where = "; ".join(f"{t['model']}, {t['decoder']} on {t['prompts']} prompt {t['prompt']}: response token "
                      f"{t['position']}, logit gap {t['gap']:.1e}" for t in ties[:5])
    more = f" and {len(ties) - 5} more" if len(ties) > 5 else ""
    return (f", except {len(ties)} output(s) that left it at a floating-point near tie, where the two best logits "
            "are within rounding of each other and a wider forward's rounding picks the other token (" + where
            + more + "; megatron_jf/eval/speed.py, a gap above 1e-4 of the logits would have stopped the report). ")


def _markdown(s) -> str:
    lines = [f"# Jacobi Forcing quickstart ({s['preset']})", "",
             f"{s['eval_prompts']} held-out prompts, up to {s['response_tokens']} new tokens, greedy. "
             f"TPF is over all prompts (batched); TPS is timed at batch 1 on the first {s['timing_prompts']} "
             f"prompts (one thread, after a warm-up call, fastest of {s.get('timing_rounds', 1)} interleaved "
             "rounds), and speedup = decode TPS / decode TPS of the faster AR of the same model in the same run "
             f"(this project's AR or {HF_ROW} on the same weights; the fastest AR per model: "
             + ", ".join(sorted({f"{r['model']}: {r['fastest_ar']}" for r in s['rows'] if 'fastest_ar' in r}))
             + "). "
             "Every decoder's output was checked equal to the same model's greedy AR output"
             + (near_tie_sentence(s["near_ties"]) if s.get("near_ties") else ". ") +
             "Top-1 agreement: the model's next-token argmax equals the base model's on held-out text (teacher "
             "forced); greedy-output agreement: position-wise match of the free-running greedy continuations "
             "(one early difference changes everything after it).", "",
             "| Model | Method | Speedup | TPF | output check | TPS | held-out NLL | top-1 agree w/ base (held-out) "
             "| greedy-output agree w/ base | distinct-4 | pass@1 |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    from recipes.quickstart.interpret import row_check, warning_lines  # one warning line per model

    warned = warning_lines(s.get("warnings"))
    if warned:
        lines[2:2] = warned + [""]
    for r in s["rows"]:
        p1 = "-" if r.get("pass@1") is None else f"{100 * r['pass@1']:.1f}%"
        check = row_check(r)
        lines.append(f"| {r['model']} | {r['decoder']} | {r['speedup']:.2f}x | {r['tpf']:.2f} | {check} | "
                     f"{r['tps']:.1f} | {r['nll']:.3f} | {100 * r['tf_agreement_with_base']:.1f}% | "
                     f"{100 * r['agreement_with_base']:.1f}% | {r['distinct4']:.3f} | {p1} |")
    stats = s.get("output_stats") or {}
    lines += ["", "TPF of vanilla Jacobi by block size n (held-out prompts), and each model's greedy distinct-2 "
              "(mean per completion; below 0.1 flags the output as degenerate):", "",
              "| Model | " + " | ".join(f"n={k}" for k in next(iter(s["tpf_by_block_size"].values())))
              + " | greedy distinct-2 |",
              "|---|" + "---|" * (len(next(iter(s["tpf_by_block_size"].values()))) + 1)]
    for m, c in s["tpf_by_block_size"].items():
        d2 = (stats.get(m) or {}).get("distinct_2")
        lines.append(f"| {m} | " + " | ".join(f"{v:.2f}" for v in c.values())
                     + f" | {'-' if d2 is None else f'{d2:.3f}'} |")
    if s.get("fit_tpf"):
        lines += ["", f"Jacobi TPF (n={s.get('n')}) on the first {s['fit_prompts']} training prompts (what Jacobi "
                  "Forcing fit; everything above is on held-out prompts): "
                  + ", ".join(f"{m} {v:.2f}" for m, v in s["fit_tpf"].items()) + "."]
    if s.get("math_quality"):
        lines += _math_markdown(s)
    return "\n".join(lines) + "\n"


def _math_markdown(s) -> list[str]:
    """The math domain's table: quality (exact answers, arithmetically right steps) next to Jacobi TPF on held-out
    problems and on held-out templates, and the noisy-token accuracy by distance on the base model's held-out
    trajectories (what Jacobi Forcing teaches, on data a change of the model's own output cannot simplify)."""
    mq, tt, na = s["math_quality"], s.get("template_tpf") or {}, s.get("noisy_accuracy") or {}
    td = s.get("template_distinct4") or {}
    from recipes.quickstart.interpret import headline_n, headline_tpf

    jac = {r["model"]: r["tpf"] for r in s["rows"] if r["decoder"].startswith("Jacobi")}
    mr = {r["model"]: r["tpf"] for r in s["rows"] if r["decoder"].startswith("MR")}
    hn = headline_n(s)
    wide = {m: headline_tpf(s, m) for m in jac} if hn != s["n"] else {}  # the paper's evaluation block size
    keys = next((list(v) for v in na.values()), [])
    ks = [k for k in keys if k.startswith("acc_k")]
    nq = s.get("quality_problems") or s["eval_prompts"]
    scored = (f"the {nq} held-out problems (the first {s['eval_prompts']} are the prompts above; all by greedy AR, "
              "the answers every lossless decoder gives)" if nq > s["eval_prompts"] else f"the {nq} held-out problems")
    out = ["", f"Math domain: exact answers (`#### N`) and arithmetically right `a op b = c` steps of the greedy answers "
           f"to {scored}; Jacobi / MR TPF (n={s['n']}) on "
           + ("them" if nq <= s["eval_prompts"] else f"the first {s['eval_prompts']}") + " and Jacobi TPF on "
           f"{s.get('template_prompts', 0)} problems of templates held out from everything (with the distinct-4 of the "
           f"greedy answers there); noisy-token accuracy: "
           f"argmax right at distance k after the first wrong draft token, on the base model's Jacobi trajectories of "
           f"{s.get('noisy_prompts', 0)} held-out problems (mean run: right tokens in a row from k=1).", "",
           "| Model | exact answers | steps right | Jacobi TPF | " + (f"Jacobi TPF n={hn} | " if wide else "")
           + "MR TPF | held-out templates TPF (distinct-4) | "
           + " | ".join(k.replace("acc_k", "k=") for k in ks) + " | mean run |",
           "|---|---|---|---|---|---|" + "---|" * (len(ks) + 1 + bool(wide))]
    for m, q in mq.items():
        n = na.get(m) or {}
        out.append(f"| {m} | {q['correct']}/{q['problems']} ({100 * q['accuracy']:.1f}%) | "
                   + (f"{100 * q['step_accuracy']:.1f}% of {q['steps']}" if q["steps"] else "- (no step)")
                   + f" | {jac.get(m, float('nan')):.2f} | "
                   + (f"{wide.get(m, float('nan')):.2f} | " if wide else "")
                   + f"{mr.get(m, float('nan')):.2f} | "
                   + (f"{tt[m]:.2f}" if m in tt else "-") + (f" ({td[m]:.3f})" if m in td else "") + " | "
                   + " | ".join(f"{n[k]:.3f}" if k in n else "-" for k in ks)
                   + f" | {n.get('mean_run', float('nan')):.2f} |")
    return out


def _plots(out_dir, curves) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for m, c in curves.items():
        ax.plot(list(c.keys()), list(c.values()), marker="o", label=m)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("block size n")
    ax.set_ylabel("tokens per forward")
    ax.set_title("Vanilla Jacobi TPF by block size")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "tpf_by_block_size.png", dpi=120)
    plt.close(fig)


def _trajectory_picture(pipe, out_dir, prompt, tok) -> None:
    """Figure-4-style pictures of one live Jacobi trajectory, base vs final JF model (tools/visualize_trajectory.py)."""
    text = tok.decode(prompt)
    for label, ck in (("base", "base"), ("jf", pipe.p.report_models[-1])):
        pipe.run(["tools/visualize_trajectory.py", "--load", pipe.path(ck), "--prompt", text, "--block-size",
                  pipe.p.report_n, "--max-new-tokens", min(pipe.p.response_tokens, 96),
                  "--out", out_dir / f"trajectory_{label}"], "report")
