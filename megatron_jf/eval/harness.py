"""Speed + accuracy evaluation harness (Jacobi Forcing, arXiv 2512.14681, Tables 1-3 and Appendix E).

One call of :func:`run_evaluation` loads a megatron checkpoint, renders a benchmark's prompts, and for every batch
of prompts runs **greedy AR and the chosen decoder back to back in the same process on the same token ids**
(:func:`megatron_jf.eval.speed.run_batch`, the measurement loop the quickstart report and ``bench/decode.py`` use
too), so the reported speedup is a same-run wall-clock ratio. Because every decoder of
:mod:`megatron_jf.inference.engine` is lossless, the greedy outputs must be identical; this is checked per sample
(``lossless`` field) and summarised (a violation raises :class:`LosslessViolation` after everything is written,
unless ``strict_lossless=False``). Both completions are scored (code in the sandbox of
:mod:`megatron_jf.eval.code_exec`, math with :mod:`megatron_jf.eval.math_grading`).

Metrics (paper Sec. 4.1):

* **TPF** (tokens per forward) = emitted tokens / decode forward passes, summed over samples (ratio of sums);
  AR's TPF is exactly 1.0 unless a stop *string* cut the output (the forward completing it emits nothing).
* **TPS** (tokens per second): ``tps_decode`` = tokens / decode seconds; ``tps_e2e`` = tokens / (prefill + decode
  seconds) (ratio of sums).
* **latency**: per-sample prefill + decode seconds, p50 and p95.
* **speedup** = sum of AR wall seconds / sum of decoder wall seconds, where a sample's wall time is its batch's
  ``generate`` wall-clock time divided by the batch size (with ``batch_size=1`` it is the sample's own time).

Outputs in ``out_dir`` (name stem ``{benchmark}_{decoder}``): per-sample JSONL (resumable: re-running skips the
task ids already present; a run with another configuration refuses to mix into it), ``.summary.json`` and ``.md``
(a table in the paper's format ``| Task | Method | Speedup | TPF | TPS | Acc |``). All files are written
atomically (temporary file + ``os.replace``).
"""

from __future__ import annotations

from megatron_jf.decoding import DecodeConfig
from megatron_jf.fileio import atomic_write_text
from megatron_jf.inference.llm import LLM
from megatron_jf.inference.metrics import percentile
from megatron_jf.inference.options import InferenceOptions

import hashlib
import json
import os
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional, Sequence

from .benchmarks import BENCHMARKS, CODE_BENCHMARKS, load_benchmark
from .degenerate import degeneracy_from_stats, token_stats
from .math_grading import DEFAULT_SYMBOLIC_CPU_S
from .prompts import prompt_info, render_prompt, stop_sequences
from .sandbox import ISOLATIONS, SandboxUnavailable, check_isolation
from .scoring import ResultsWriter, aggregate, make_record, score_many
from .speed import run_batch, warm_up

__all__ = [
    "ChatTemplateAdapter",
    "EvalConfig",
    "HarnessError",
    "LosslessViolation",
    "ResumeMismatch",
    "decode_config_from",
    "markdown_table",
    "run_evaluation",
    "summarize_records",
]

TASK_NAMES = {"humaneval": "HumanEval", "mbpp": "MBPP", "gsm8k": "GSM8K", "math": "MATH", "math500": "MATH500"}


class HarnessError(ValueError):
    """Base class of the harness's input errors (bad benchmark/decoder/flags)."""


class ResumeMismatch(ValueError):
    """The output file holds records from a run with a different configuration."""


class LosslessViolation(AssertionError):
    """Greedy output of the decoder differs from greedy AR on some samples (the decoders must be lossless)."""


# ---------------------------------------------------------------------------------------------------------------
# small utilities


def decode_config_from(decoder: str, **kw: Any):
    """Build a :class:`~megatron_jf.inference.engine.DecodeConfig`, turning its ``ValueError`` into
    :class:`HarnessError` with the same message (unknown decoder, n < 1, r outside (0, 1], ...).

    ``None`` values in ``kw`` are dropped (the config's defaults apply).
    """
    from megatron_jf.decoding import DecodeConfig  # torch-free: flags are checked before the model is loaded

    try:
        return DecodeConfig(decoder, **{k: v for k, v in kw.items() if v is not None})
    except ValueError as e:
        raise HarnessError(str(e)) from e


# ---------------------------------------------------------------------------------------------------------------
# evaluation


@dataclass
class EvalConfig:
    """Everything that defines one evaluation run.

    Attributes:
        load: checkpoint directory.
        benchmark: one of :data:`~megatron_jf.eval.benchmarks.BENCHMARKS` (with ``data``: the default benchmark of
            its lines).
        decode: the decoder's :class:`~megatron_jf.decoding.DecodeConfig` (``jacobi``, ``running-window``, ``mr``;
            or ``ar``: then only AR runs, speedup 1); :attr:`decoder` is its name.
        data: local JSONL problems (``--data``) instead of the packaged benchmark.
        limit: first ``limit`` problems (None: all).
        max_new_tokens: generation cap per sample, tokens.
        batch_size: prompts per ``generate`` call.
        prompt_mode: ``chat`` or ``raw``.
        prompt_set: prompt-set name (default ``jf-paper-v1``).
        out_dir: output directory.
        tokenizer: tokenizer override.
        threads: torch CPU threads.
        tp: tensor-parallel size.
        seed: RNG seed (draft initialisation).
        strict_lossless: raise :class:`LosslessViolation` at the end if AR and the decoder disagree.
        score_timeout_s: sandbox limit per program, seconds.
        math_cpu_s: CPU-time limit of each symbolic step of math grading, CPU seconds (a timeout is *ungraded*).
        isolation: ``"os"`` (bubblewrap namespaces; refuses to run generated code where they do not work) or
            ``"none"`` (``--unisolated``: no OS isolation, flagged in the summary and the table).
        warmup: run one short untimed generate per method first (so one-off costs do not skew the speedup).
        progress: show a tqdm progress bar.
        hf_baseline: also time ``transformers`` greedy on the same weights (TP=1; exactly AR's tokens per
            sample) and report ``speedup_vs_fastest_ar``, against the faster of the two ARs
            (:mod:`megatron_jf.eval.hf_baseline`).
        params_dtype: ``"bf16"`` / ``"fp16"`` weights (``--bf16``: outputs differ from fp32 ones; lossless means
            equal to greedy AR in the same precision); None: the platform default (fp32 on CPU).
        inference: the inference forward's :class:`~megatron_jf.inference.options.InferenceOptions`
            (:func:`megatron_jf.cli.inference_options`); None: every field auto.
            They change how the forward runs, not the results (not part of the resume key).
    """

    load: str
    benchmark: Optional[str]
    decode: DecodeConfig = field(default_factory=lambda: DecodeConfig("jacobi"))
    data: Optional[str] = None
    limit: Optional[int] = None
    max_new_tokens: int = 256
    batch_size: int = 1
    prompt_mode: str = "chat"
    prompt_set: Optional[str] = None
    out_dir: str = "eval_out"
    tokenizer: Optional[str] = None
    threads: Optional[int] = None
    tp: int = 1
    seed: int = 1234
    strict_lossless: bool = True
    score_timeout_s: float = 10.0
    math_cpu_s: float = DEFAULT_SYMBOLIC_CPU_S
    isolation: str = "os"
    warmup: bool = True
    progress: bool = True
    hf_baseline: bool = True
    params_dtype: Optional[str] = None
    inference: Optional[InferenceOptions] = None

    def validate(self) -> None:
        """Check names and ranges before anything heavy is loaded.

        Raises:
            HarnessError: unknown benchmark/decoder/prompt mode, or a non-positive size.
            FileNotFoundError: ``data`` does not exist.
        """
        if self.benchmark is None and self.data is None:
            raise HarnessError("give --benchmark (or --data with a 'benchmark' field on every line)")
        if self.benchmark is not None and self.benchmark not in BENCHMARKS:
            raise HarnessError(f"unknown benchmark {self.benchmark!r}; choose one of {', '.join(BENCHMARKS)}")
        if self.data is not None and not os.path.isfile(self.data):
            raise FileNotFoundError(f"--data file does not exist: {self.data}")
        if self.prompt_mode not in ("chat", "raw"):
            raise HarnessError(f"prompt mode must be 'chat' or 'raw', got {self.prompt_mode!r}")
        for name in ("max_new_tokens", "batch_size", "tp"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise HarnessError(f"{name} must be an int >= 1, got {v!r}")
        if self.limit is not None and (not isinstance(self.limit, int) or self.limit < 0):
            raise HarnessError(f"limit must be an int >= 0, got {self.limit!r}")
        if self.isolation not in ISOLATIONS:
            raise HarnessError(f"isolation must be one of {ISOLATIONS}, got {self.isolation!r}")
        if not (self.math_cpu_s > 0):
            raise HarnessError(f"math CPU-time limit must be > 0 s, got {self.math_cpu_s!r}")
        if self.params_dtype not in (None, "bf16", "fp16", "fp32"):
            raise HarnessError(f"params_dtype must be None, 'bf16', 'fp16' or 'fp32', got {self.params_dtype!r}")
        if self.params_dtype == "bf16":  # on a CPU without native bf16: refused before loading (imports torch)
            from megatron_jf.cli import params_dtype

            try:
                params_dtype(self.params_dtype)
            except ValueError as e:
                raise HarnessError(str(e)) from None

    @property
    def decoder(self) -> str:
        """The decoder's name (``decode.decoder``)."""
        return self.decode.decoder

    @property
    def stem(self) -> str:
        """Output file stem, ``{benchmark or data file name}_{decoder}``."""
        b = self.benchmark or os.path.splitext(os.path.basename(self.data or "data"))[0]
        return f"{b}_{self.decoder}"


def _run_key(cfg: EvalConfig, dec_cfg, ckpt_meta: dict, pinfo: dict) -> str:
    """Hash of everything that changes the per-sample results (resuming into another config is refused)."""
    key = {
        "load": os.path.abspath(cfg.load), "iteration": ckpt_meta.get("iteration"),
        "decode": asdict(dec_cfg), "max_new_tokens": cfg.max_new_tokens, "prompt": pinfo,
        "data": os.path.abspath(cfg.data) if cfg.data else None, "benchmark": cfg.benchmark, "seed": cfg.seed,
    }
    if cfg.params_dtype:  # absent when unset: results written before the option existed keep their key
        key["params_dtype"] = cfg.params_dtype
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def _gen_stats(res, wall_s: float) -> dict[str, Any]:
    return {
        "new_tokens": len(res.tokens), "forwards": res.forwards, "finish_reason": res.finish_reason,
        "prefill_s": res.prefill_s, "decode_s": res.decode_s, "latency_s": res.prefill_s + res.decode_s,
        "wall_s": wall_s, "tpf": res.tpf, "token_stats": token_stats(res.tokens),
    }


def _method_summary(stats: list[dict], scores: list[bool], statuses: Sequence[str] = ()) -> dict[str, Any]:
    tok = sum(s["new_tokens"] for s in stats)
    fwd = sum(s["forwards"] for s in stats)
    dec = sum(s["decode_s"] for s in stats)
    e2e = sum(s["latency_s"] for s in stats)
    lat = [s["latency_s"] for s in stats]
    n = len(stats)
    graded = n - sum(1 for st in statuses if st == "ungraded")  # a grading timeout is neither right nor wrong
    return {
        "n": n, "new_tokens": tok, "forwards": fwd,
        "tpf": tok / fwd if fwd else float("nan"),
        "tps_decode": tok / dec if dec > 0 else float("nan"),
        "tps_e2e": tok / e2e if e2e > 0 else float("nan"),
        "latency_p50_s": percentile(lat, 50), "latency_p95_s": percentile(lat, 95),
        "wall_s": sum(s["wall_s"] for s in stats), "decode_s": dec,
        "correct": sum(bool(c) for c in scores), "accuracy": (sum(bool(c) for c in scores) / graded) if graded
        else float("nan"), "ungraded": n - graded,
        "degeneracy": degeneracy_from_stats(s.get("token_stats") for s in stats),
    }


def summarize_records(records: Sequence[dict]) -> dict[str, Any]:
    """Aggregate per-sample records (as written by :func:`run_evaluation`) into the run summary.

    Returns:
        ``{"n", "ar": {...}, "decoder": {...}, "speedup", "lossless": {"checked", "identical", "mismatched",
        "near_ties"}}`` (``mismatched``: task ids whose decoder output differs from AR's beyond a floating-point near
        tie; ``near_ties``: those that left it at one, :func:`megatron_jf.eval.speed.divergence`)
        where each method block has ``tpf``, ``tps_decode``, ``tps_e2e``, ``latency_p50_s``, ``latency_p95_s``,
        ``wall_s``, ``accuracy`` (fraction), ``correct``, ``n``, ``new_tokens``, ``forwards``.
    """
    ar = _method_summary([r["ar"] for r in records], [r["ar"]["correct"] for r in records],
                         [r["ar"].get("status", "") for r in records])
    dec = _method_summary([r["gen"] for r in records], [r["correct"] for r in records],
                          [r.get("status", "") for r in records])
    mism = [r["task_id"] for r in records if not r["lossless"] and not r.get("near_tie")]
    ties = [r["task_id"] for r in records if not r["lossless"] and r.get("near_tie")]
    from megatron_jf.eval.hf_baseline import fastest_ar

    hf = None
    if records and all(r.get("hf") for r in records):  # transformers greedy timed on every sample
        wall = sum(r["hf"]["wall_s"] for r in records)
        toks = sum(r["hf"]["new_tokens"] for r in records)
        hf = {"wall_s": wall, "new_tokens": toks, "tps_e2e": toks / wall if wall > 0 else float("nan"),
              "identical_to_ar": sum(bool(r["hf"]["equal"]) for r in records)}
    base, base_wall = fastest_ar(ar["wall_s"], hf["wall_s"] if hf else None)
    return {
        "n": len(records), "ar": ar, "decoder": dec,
        "speedup": ar["wall_s"] / dec["wall_s"] if dec["wall_s"] > 0 else float("nan"),
        "hf_greedy": hf, "fastest_ar": base,
        "speedup_vs_fastest_ar": base_wall / dec["wall_s"] if dec["wall_s"] > 0 else float("nan"),
        "lossless": {"checked": len(records), "identical": sum(bool(r["lossless"]) for r in records),
                     "mismatched": mism, "near_ties": ties},
    }


def markdown_table(task: str, method: str, summary: dict[str, Any]) -> str:
    """Paper-format table (Tables 1-3): ``| Task | Method | Speedup | TPF | TPS | Acc |``; AR row first.

    TPS is decode-only tokens/s; Acc is percent (pass@1 for code, over graded samples). Warning rows follow the
    method rows: degenerate output (:mod:`megatron_jf.eval.degenerate`; TPF and speedup not meaningful), code run
    without OS isolation, ungraded math samples. A footer line adds end-to-end TPS, latency percentiles and the
    lossless check.
    """
    ar, dec = summary["ar"], summary["decoder"]

    def row(name: str, m: dict, sp: float) -> str:
        return f"| {task} | {name} | {sp:.2f}× | {m['tpf']:.2f} | {m['tps_decode']:.1f} | {100 * m['accuracy']:.1f} |"

    ll = summary["lossless"]
    lines = ["| Task | Method | Speedup | TPF | TPS | Acc |", "|---|---|---|---|---|---|", row("AR", ar, 1.0)]
    if method != "AR":
        lines.append(row(method, dec, summary["speedup"]))
    for name, m in [("AR", ar)] + ([(method, dec)] if method != "AR" else []):
        w = (m.get("degeneracy") or {}).get("warning")
        if w:
            lines.append(f"| {task} | {name} | ⚠ | ⚠ | | {w} |")
    if summary.get("isolation") == "none" or any(a.get("unisolated") for a in
                                                 (summary.get("accuracy_by_benchmark") or {}).values()):
        lines.append(f"| {task} | {method} | | | | ⚠ UNISOLATED: generated code ran WITHOUT OS isolation |")
    acc = summary.get("accuracy_by_benchmark") or {}
    for b, a in acc.items():
        if a.get("ungraded"):
            ids = ", ".join(a["ungraded_ids"][:10])
            lines.append(f"| {task} | {method} | | | | ⚠ {a['ungraded']} UNGRADED ({b}, grading CPU limit): {ids} |")
    lines += ["", f"n={summary['n']}; end-to-end TPS (incl. prefill): AR {ar['tps_e2e']:.1f}, {method} "
              f"{dec['tps_e2e']:.1f}; latency p50/p95 (s): AR {ar['latency_p50_s']:.3f}/{ar['latency_p95_s']:.3f}, "
              f"{method} {dec['latency_p50_s']:.3f}/{dec['latency_p95_s']:.3f}; lossless (greedy output == AR): "
              f"{ll['identical']}/{ll['checked']}"
              + (f", {len(ll['near_ties'])} left it at a floating-point near tie" if ll.get("near_ties") else "")]
    hf = summary.get("hf_greedy")
    if "speedup_vs_fastest_ar" in summary:
        hf_txt = (f"transformers greedy {hf['tps_e2e']:.1f} tok/s end-to-end (same weights, identical to AR on "
                  f"{hf['identical_to_ar']}/{summary['n']})" if hf else "transformers greedy not timed")
        lines.append(f"{method} speedup against the faster AR ({summary['fastest_ar']}): "
                     f"{summary['speedup_vs_fastest_ar']:.2f}×; {hf_txt}")
    return "\n".join(lines) + "\n"


class ChatTemplateAdapter:
    """Give a :class:`megatron_jf.tokenizer.Tokenizer` the ``transformers``-style
    ``apply_chat_template(messages, tokenize=False, add_generation_prompt=True)`` signature that
    :func:`megatron_jf.eval.prompts.render_chat` calls (the project tokenizer takes no ``tokenize`` argument).

    Raises (from ``apply_chat_template``):
        ValueError: ``tokenize=True`` requested, or the tokenizer has no chat template.
    """

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.chat_template = getattr(tokenizer, "chat_template", None)

    def apply_chat_template(self, messages, tokenize: bool = False, add_generation_prompt: bool = True) -> str:
        if tokenize:
            raise ValueError("ChatTemplateAdapter renders text only (tokenize=False)")
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)


def run_evaluation(cfg: EvalConfig, *, loaded: Optional[LLM] = None,
                   log: Callable[[str], None] = lambda s: print(s, file=sys.stderr)) -> dict[str, Any]:
    """Run AR and ``cfg.decoder`` on the same prompts, score both, write JSONL/summary/table (Tables 1-3).

    Args:
        cfg: the run (validated here before loading anything).
        loaded: an already loaded checkpoint (reuse across runs); default: :meth:`LLM.from_checkpoint
            <megatron_jf.inference.llm.LLM.from_checkpoint>` of ``cfg.load``.
        log: where progress text goes.

    Returns:
        The summary dict (also written to ``{out_dir}/{stem}.summary.json``) with ``paths`` to the outputs.

    Raises:
        HarnessError, FileNotFoundError (CheckpointNotFound, TokenizerNotFound of :mod:`megatron_jf.load_errors`):
            bad inputs (before any work).
        ResumeMismatch: the output JSONL holds records of a different configuration.
        LosslessViolation: (``strict_lossless``) some greedy decoder output differs from AR; raised after all
            outputs are written.
    """
    cfg.validate()
    dec_cfg = cfg.decode
    ar_cfg = decode_config_from("ar")
    if loaded is None:
        loaded = LLM.from_checkpoint(cfg.load, tokenizer=cfg.tokenizer, tp=cfg.tp, seed=cfg.seed,
                                     threads=cfg.threads, params_dtype=cfg.params_dtype, options=cfg.inference)
    elif cfg.threads:
        import torch

        torch.set_num_threads(int(cfg.threads))
    tok = loaded.tokenizer
    problems = load_benchmark(cfg.benchmark, limit=cfg.limit, data_path=cfg.data)
    if not problems:
        raise HarnessError("no problems selected (limit 0 or empty data file)")
    if any(p.benchmark in CODE_BENCHMARKS for p in problems):
        try:
            check_isolation(cfg.isolation)
        except SandboxUnavailable as e:
            raise HarnessError(str(e)) from None
        if cfg.isolation == "none":
            log("[evaluate] WARNING: UNISOLATED - generated code runs WITHOUT OS isolation (--unisolated)")
    chat = ChatTemplateAdapter(tok)
    pinfo = prompt_info(cfg.prompt_set, mode=cfg.prompt_mode, tokenizer=chat)
    run_key = _run_key(cfg, dec_cfg, loaded.meta, pinfo)
    os.makedirs(cfg.out_dir, exist_ok=True)
    jsonl = os.path.join(cfg.out_dir, cfg.stem + ".jsonl")
    writer = ResultsWriter(jsonl, flush_every=1)
    other = {r.get("run_key") for r in writer.records} - {run_key}
    if other:
        raise ResumeMismatch(f"{jsonl} holds results of another configuration (run_key {sorted(map(str, other))} "
                             f"!= {run_key}); use another --out directory or delete the file")
    pending = writer.pending(problems)
    log(f"[evaluate] {cfg.stem}: {len(problems)} problems, {len(problems) - len(pending)} already done "
        f"(resumed from {jsonl}), prompt set {pinfo['prompt_set']} ({cfg.prompt_mode})")

    detok = tok.decode
    texts = {p.task_id: render_prompt(p, chat, mode=cfg.prompt_mode, prompt_set=cfg.prompt_set) for p in pending}
    ids = {k: tok.encode(v) for k, v in texts.items()}
    too_long = [(k, len(v)) for k, v in ids.items() if len(v) + cfg.max_new_tokens > loaded.engine.max_context]
    if too_long:
        raise HarnessError(f"{len(too_long)} prompt(s) do not fit the context window of {loaded.engine.max_context} "
                           f"tokens with max_new_tokens={cfg.max_new_tokens}, e.g. {too_long[0][0]} "
                           f"({too_long[0][1]} prompt tokens)")
    hf = None
    if pending and cfg.hf_baseline:
        from megatron_jf.eval.hf_baseline import hf_twin

        hf = hf_twin(loaded.engine.model)  # None under TP > 1
        if hf is None:
            log("[evaluate] transformers greedy baseline skipped (needs TP=1)")
    # AR and the decoder back to back on every batch (the one measurement loop, megatron_jf/eval/speed.py)
    methods = {"ar": ar_cfg} if cfg.decoder == "ar" else {"ar": ar_cfg, cfg.decoder: dec_cfg}
    if pending and cfg.warmup:
        warm_up(loaded.engine, ids[pending[0].task_id], methods, max_new_tokens=min(4, cfg.max_new_tokens),
                eos_ids=loaded.eos_ids, hf=hf)

    bar = None
    if cfg.progress:
        try:
            from tqdm import tqdm

            bar = tqdm(total=len(problems), initial=len(problems) - len(pending), desc=cfg.stem, unit="sample",
                       file=sys.stderr, dynamic_ncols=True)
        except ImportError:  # pragma: no cover - tqdm is a dependency
            bar = None
    try:
        for b0 in range(0, len(pending), cfg.batch_size):
            batch = pending[b0: b0 + cfg.batch_size]
            # group by stop strings: they are per-request in raw mode but one list per generate call
            stops = stop_sequences(batch[0], cfg.prompt_mode)
            bids = [ids[p.task_id] for p in batch]
            run = run_batch(loaded.engine, bids, methods, max_new_tokens=cfg.max_new_tokens, eos_ids=loaded.eos_ids,
                            stop_strings=tuple(stops), detokenize=detok, hf=hf)
            ar_out, ar_wall = run.results["ar"], run.wall_s["ar"]
            dec_out, dec_wall = run.results[cfg.decoder], run.wall_s[cfg.decoder]
            ar_text = [detok(r.tokens) for r in ar_out]
            dec_text = [detok(r.tokens) for r in dec_out]
            kw = dict(timeout_s=cfg.score_timeout_s, math_timeout_s=cfg.math_cpu_s, isolation=cfg.isolation)
            ar_scores = score_many(batch, ar_text, **kw)
            dec_scores = ar_scores if cfg.decoder == "ar" else score_many(batch, dec_text, **kw)
            for j, p in enumerate(batch):
                lossless = run.lossless[cfg.decoder][j]
                tie = run.near_ties.get(cfg.decoder, {}).get(j)
                if not lossless and tie is None:
                    log(f"[evaluate] LOSSLESS CHECK FAILED for {p.task_id}: decoder output differs from AR")
                elif not lossless:
                    log(f"[evaluate] {p.task_id}: decoder output left AR's at a floating-point near tie (response "
                        f"token {tie.position}, logit gap {tie.gap:.1e}); counted, not an error")
                ar_rec = {"completion": ar_text[j], "correct": ar_scores[j].correct, "status": ar_scores[j].status,
                          **_gen_stats(ar_out[j], ar_wall / len(batch))}
                extra = {"run_key": run_key, "method": dec_cfg.label, "decoder": cfg.decoder,
                         "lossless": lossless, "gen": _gen_stats(dec_out[j], dec_wall / len(batch)), "ar": ar_rec,
                         "prompt_tokens": len(bids[j]), "accepted": dec_out[j].accepted}
                if tie is not None:
                    extra["near_tie"] = asdict(tie)
                if run.hf is not None:  # transformers greedy producing exactly AR's tokens (batch 1)
                    _, hf_wall, hf_toks = run.hf[j]
                    extra["hf"] = {"wall_s": hf_wall, "new_tokens": len(hf_toks), "equal": hf_toks == ar_out[j].tokens}
                writer.add(make_record(p, dec_text[j], dec_scores[j], prompt=texts[p.task_id], prompt_meta=pinfo,
                                       extra=extra))
            if bar is not None:
                bar.update(len(batch))
    finally:
        if bar is not None:
            bar.close()
        writer.flush()

    wanted = {p.task_id for p in problems}
    records = [r for r in writer.records if r["task_id"] in wanted]
    summary = summarize_records(records)
    task = TASK_NAMES.get(cfg.benchmark or "", cfg.stem.rsplit("_", 1)[0])
    method = dec_cfg.label
    paths = {"jsonl": jsonl, "summary": os.path.join(cfg.out_dir, cfg.stem + ".summary.json"),
             "table": os.path.join(cfg.out_dir, cfg.stem + ".md")}
    summary.update({
        "task": task, "method": method, "benchmark": cfg.benchmark, "data": cfg.data, "checkpoint": loaded.ckpt_dir,
        "iteration": loaded.meta.get("iteration"), "decode_config": asdict(dec_cfg),
        "max_new_tokens": cfg.max_new_tokens, "batch_size": cfg.batch_size, "prompt": pinfo, "run_key": run_key,
        "accuracy_by_benchmark": aggregate(_scores_of(records)), "paths": paths, "isolation": cfg.isolation,
        "resumed": len(problems) - len(pending), "generated": len(pending),
    })
    table = markdown_table(task, method, summary)
    atomic_write_text(paths["summary"], json.dumps(summary, indent=2, default=_json_default) + "\n")
    atomic_write_text(paths["table"], table)
    log("\n" + table)
    ll = summary["lossless"]
    ties = f" ({len(ll['near_ties'])} near ties)" if ll["near_ties"] else ""
    log(f"[evaluate] speedup {summary['speedup']:.2f}x vs this project's AR, {summary['speedup_vs_fastest_ar']:.2f}x vs "
        f"the faster AR ({summary['fastest_ar']})  TPF {summary['decoder']['tpf']:.2f} (AR "
        f"{summary['ar']['tpf']:.2f})  acc {100 * summary['decoder']['accuracy']:.1f}% (AR "
        f"{100 * summary['ar']['accuracy']:.1f}%)  lossless {ll['identical']}/{ll['checked']}{ties}  -> {cfg.out_dir}")
    if ll["mismatched"] and cfg.strict_lossless:
        raise LosslessViolation(f"{len(ll['mismatched'])} sample(s) where {method} greedy output != AR: "
                                f"{ll['mismatched'][:10]} (see {jsonl})")
    return summary


def _scores_of(records: Sequence[dict]):
    from .scoring import Score

    return [Score(r["task_id"], r["benchmark"], bool(r["correct"]), r["status"], verdict=r.get("verdict") or "",
                  isolation=r.get("isolation") or "") for r in records]


def _json_default(o: Any) -> Any:
    if isinstance(o, (set, frozenset)):
        return sorted(o)
    raise TypeError(f"not JSON-serialisable: {type(o).__name__}")
