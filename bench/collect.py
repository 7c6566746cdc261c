#!/usr/bin/env python
"""Trajectory-collection benchmark (megatron_jf.data.collect, the loop of tools/generate_trajectories.py).

Measured in one run on a tiny random model (CPU)::

    python bench/collect.py                       # ~2 minutes on one core
    python bench/collect.py --num-prompts 512 --max-new-tokens 256 --json out.json

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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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
    from megatron_jf.testing import tiny_hf_model

    hf = tiny_hf_model("qwen2", seed=seed, vocab=vocab, hidden=hidden, layers=layers, heads=4, kv_heads=2,
                       ffn=hidden * 3, max_pos=4096)
    args = ModelArgs.from_hf_dict(hf.config.to_dict())
    m = build_model(args).eval()
    m.load_state_dict(hf_to_mcore(hf.state_dict(), args), strict=False)
    return m


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--speed-prompts", type=int, default=16, help="prompts timed at batch 1 and batch 8")
    p.add_argument("--repeats", type=int, default=2, help="timed repeats of each batch size (fastest kept)")
    p.add_argument("--num-prompts", type=int, default=256, help="prompts of the memory runs")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None, help="also write the results here")
    a = p.parse_args(argv)

    import torch

    torch.set_num_threads(a.threads)
    from megatron_jf import parallel
    from megatron_jf.data import collect as C
    from megatron_jf.data.shards import TrajectoryShardWriter, read_shard
    from megatron_jf.inference.engine import DecodeConfig, Engine

    parallel.initialize(1, 1)
    parallel.set_seed(0)
    engine = Engine(_model(a.hidden, a.layers, a.vocab, seed=0))
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
