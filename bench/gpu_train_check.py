#!/usr/bin/env python
"""GPU training check (issue 12): a few bf16 steps of a Qwen2.5-1.5B-shaped random model through
``pretrain_jf.py`` with the megatron optimizer and distributed optimizer, for each attention path
(two_stream, packed, dense) with and without activation recomputation; prints peak GPU memory, step
time and the first steps' losses next to the CPU fp32 loss of the same seed and batch.

How to run on one H200 (<= 8 minutes; nothing is downloaded there). megatron-core and the packages the
device image lacks travel as wheels in ``.whl/`` (git-ignored), fetched once on a machine with PyPI::

    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl \\
        megatron-core==0.16.1 webdataset==1.0.2 braceexpand==0.1.7
    bash bench/gpu_train_check.sh                 # installs .whl/*.whl into /tmp/jf_site, then runs this
    bash bench/gpu_train_check.sh --dry-run       # CPU, tiny shape, fp32, torch optimizer: checks the plumbing

What it does:

0. ``--mask nc`` rows estimate one number (and the CPU reference); the ``nc_ic`` rows (window 16) another:
   packed (gathered-key THD segments) vs dense (boolean mask);
1. writes a random Qwen2.5-1.5B config (h 1536, 28 layers, 12/2 heads x 128, FFN 8960, vocab 151936, tied)
   and synthetic Jacobi trajectory shards (prompt 192, 24 blocks of n=32, 4 states per block);
2. starts the CPU fp32 reference in the background (``CUDA_VISIBLE_DEVICES=`` so megatron_jf picks CPU,
   fp32 and the torch optimizer; one step of the same batch: its loss is the loss before any update);
3. runs each configuration as its own ``pretrain_jf.main`` process (an OOM stays in its row), with
   ``--precision bf16 --use-megatron-optimizer --use-distributed-optimizer``, ``--log-interval 1``, and reads
   the per-step loss and step time from ``--log-file`` and the peak ``torch.cuda.max_memory_allocated``;
4. prints one table; a configuration that would start after ``--budget-s`` is reported as skipped.

Every configuration trains on the same batches from the same initial weights (``--seed``), so their
step-1 losses all estimate the same number: bf16 rounding explains differences of ~1e-2 relative.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests", "dist"))

QWEN25_15B = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 151936, "hidden_size": 1536,
    "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
    "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 32768,
    "tie_word_embeddings": True, "bos_token_id": 151643, "eos_token_id": 151643, "torch_dtype": "bfloat16",
}
TINY = dict(QWEN25_15B, vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
            bos_token_id=255, eos_token_id=255)

RECOMPUTE = {
    "none": [],
    "full": ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"],
    "selective": ["--recompute-granularity", "selective"],
}
#: (attention path, mask, recompute), most important first (the budget cuts from the end).
CONFIGS = [("two_stream", "nc", "none"), ("two_stream", "nc", "full"), ("packed", "nc", "none"),
           ("dense", "nc", "none"), ("two_stream", "nc", "selective"), ("packed", "nc", "full"),
           ("dense", "nc", "full"), ("packed", "nc_ic", "none"), ("dense", "nc_ic", "none")]


def write_inputs(work: str, *, dry_run: bool, records: int, prompt_len: int, block_size: int,
                 num_blocks: int) -> tuple[str, str]:
    """The random model's config directory and the trajectory shard directory under ``work``."""
    from train_fixtures import make_record, write_shards

    cfg = TINY if dry_run else QWEN25_15B
    hf = os.path.join(work, "hf")
    os.makedirs(hf, exist_ok=True)
    with open(os.path.join(hf, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    data = os.path.join(work, "train")
    if not os.path.isdir(data):
        recs = [make_record(1000 + i, prompt_len=prompt_len, block_size=block_size, num_blocks=num_blocks,
                            vocab=min(cfg["vocab_size"], 32000), sample_id=f"gpu{i}") for i in range(records)]
        write_shards(data, recs, per_shard=8)
    return hf, data


def pretrain_args(hf: str, data: str, log: str, *, path: str, mask: str, recompute: str, steps: int, mbs: int,
                  gbs: int, seq: int, block_size: int, window: int, gpu: bool, threads: int) -> list[str]:
    if path == "dense" or (path == "packed" and mask != "nc"):
        seq = 2 * seq  # one sample is prompt + noisy + clean (P + 2R)
    a = ["--hf-config", hf, "--data", data, "--objective", "jf", "--block-size", str(block_size),
         "--window-size", str(window), "--noise-schedule", "progressive", "--attention-path", path, "--mask", mask,
         "--seq-length", str(seq), "--micro-batch-size", str(mbs), "--global-batch-size", str(gbs),
         "--train-steps", str(steps), "--lr", "1e-5", "--warmup-steps", "0", "--clip-grad", "1.0", "--seed", "1234",
         "--log-interval", "1", "--log-file", log, "--no-progress", "--threads", str(threads), "--num-workers", "0"]
    a += RECOMPUTE[recompute]
    if gpu:
        a += ["--precision", "bf16", "--use-megatron-optimizer", "--use-distributed-optimizer"]
    else:
        a += ["--precision", "fp32"]
    return a


def child(out: str, argv: list[str]) -> int:
    """Run ``pretrain_jf.main(argv)`` and write ``{"rc", "peak_allocated", "peak_reserved"}`` to ``out``."""
    import torch

    import pretrain_jf

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    rc = pretrain_jf.main(argv)
    res = {"rc": rc, "cuda": cuda,
           "peak_allocated": torch.cuda.max_memory_allocated() if cuda else None,
           "peak_reserved": torch.cuda.max_memory_reserved() if cuda else None,
           "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__}
    with open(out, "w") as f:
        json.dump(res, f)
    return rc


def _spawn(work: str, name: str, argv: list[str], env_extra: dict, log_dir: str) -> tuple[subprocess.Popen, str, str]:
    res = os.path.join(work, f"{name}.result.json")
    out = os.path.join(log_dir, f"{name}.log")
    env = dict(os.environ, PYTHONUNBUFFERED="1", **env_extra)
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    f = open(out, "w")
    p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", res, "--", *argv],
                         stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    return p, res, out


def _read(res: str, metrics: str, out: str) -> dict:
    r = {}
    if os.path.exists(res):
        with open(res) as f:
            r = json.load(f)
    steps = []
    if os.path.exists(metrics):
        with open(metrics) as f:
            steps = [json.loads(line) for line in f if line.strip()]
        steps = [s for s in steps if s.get("split") == "train"]
    r["losses"] = [s["loss"] for s in steps]
    r["step_times"] = [s["step_time"] for s in steps]
    r["tokens_per_s"] = [s["tokens_per_s"] for s in steps]
    if os.path.exists(out):
        with open(out) as f:
            tail = [ln.rstrip() for ln in f if ln.strip()]
        errs = [ln for ln in tail if "error" in ln.lower() or "Error" in ln]
        r["error"] = (errs[-1] if errs else (tail[-1] if tail else ""))[:200]
    return r


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--child":
        return child(argv[1], argv[3:] if len(argv) > 2 and argv[2] == "--" else argv[2:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shape, fp32, torch optimizer (no GPU needed)")
    p.add_argument("--work", default=None, help="scratch directory (default: $OUT/jf_gpu_check or /tmp)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per configuration (default 6; dry 3)")
    p.add_argument("--budget-s", type=float, default=450.0, help="start no configuration after this many seconds")
    p.add_argument("--configs", default=None,
                   help="comma list of path:recompute[:mask] (e.g. two_stream:none,dense:full,packed:none:nc_ic)")
    p.add_argument("--no-cpu-reference", action="store_true", help="skip the CPU fp32 step-1 reference")
    a = p.parse_args(argv)

    t_start = time.time()
    import torch

    gpu = torch.cuda.is_available() and not a.dry_run
    if not gpu and not a.dry_run:
        print("gpu_train_check: no CUDA device; run with --dry-run on CPU", file=sys.stderr)
        return 1
    out_dir = os.environ.get("OUT") or "/tmp"
    work = a.work or os.path.join(out_dir if gpu else "/tmp", "jf_gpu_check" + ("_dry" if a.dry_run else ""))
    os.makedirs(work, exist_ok=True)
    if a.dry_run:
        shape = dict(records=8, prompt_len=6, block_size=4, num_blocks=4)
        mbs, gbs, seq, steps = 2, 4, 32, a.steps or 3
    else:
        shape = dict(records=64, prompt_len=192, block_size=32, num_blocks=24)
        mbs, gbs, seq, steps = 2, 4, 1024, a.steps or 6
    hf, data = write_inputs(work, dry_run=a.dry_run, **shape)
    configs = CONFIGS
    if a.configs:
        want = [c.split(":") for c in a.configs.split(",")]
        configs = [(w[0], w[2] if len(w) > 2 else "nc", w[1]) for w in want]
    ncpu = os.cpu_count() or 2
    common = dict(steps=steps, mbs=mbs, gbs=gbs, seq=seq, block_size=shape["block_size"],
                  window=2 if a.dry_run else 16)
    print(f"gpu_train_check: {'DRY RUN (CPU, tiny, fp32)' if a.dry_run else 'GPU bf16'}; torch {torch.__version__}"
          f"{'; ' + torch.cuda.get_device_name() if gpu else ''}; model {'tiny' if a.dry_run else 'Qwen2.5-1.5B-shaped'}"
          f" random init; {gbs} samples/step in {gbs // mbs} microbatches of {mbs}; prompt {shape['prompt_len']} + "
          f"{shape['num_blocks']} x n={shape['block_size']} response tokens per sample; {steps} steps per config",
          flush=True)
    from megatron_jf import platform

    print(f"Transformer Engine: {'present (packed path: TE fused THD attention)' if platform.HAVE_TE else 'absent (packed path: one SDPA per segment; linear layers: local spec)'}",
          flush=True)

    # CPU fp32 reference of step 1 (background; it uses most cores while the GPU runs go)
    ref = None
    if not a.no_cpu_reference:
        rlog = os.path.join(work, "cpu_ref.metrics.jsonl")
        if os.path.exists(rlog):
            os.remove(rlog)
        rargs = pretrain_args(hf, data, rlog, path="two_stream", mask="nc", recompute="none", gpu=False,
                              threads=max(1, ncpu - 2 if gpu else 1), **dict(common, steps=1))
        ref = (*_spawn(work, "cpu_ref", rargs, {"CUDA_VISIBLE_DEVICES": "", "MEGATRON_JF_DISABLE_TE": "1"}, work),
               rlog)

    rows = []
    longest = 0.0
    for path, mask, rc in configs:
        name = f"{path}-{rc}" + ("" if mask == "nc" else f"-{mask}")
        elapsed = time.time() - t_start
        if elapsed + longest > a.budget_s:
            rows.append((name, {"skipped": f"time budget ({elapsed:.0f} s used of {a.budget_s:.0f})"}))
            continue
        mlog = os.path.join(work, f"{name}.metrics.jsonl")
        if os.path.exists(mlog):
            os.remove(mlog)
        args = pretrain_args(hf, data, mlog, path=path, mask=mask, recompute=rc, gpu=gpu, threads=2, **common)
        t0 = time.time()
        proc, res, out = _spawn(work, name, args, {}, work)
        try:
            proc.wait(timeout=max(30.0, a.budget_s + 60 - (time.time() - t_start)))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        dur = time.time() - t0
        longest = max(longest, dur)
        r = _read(res, mlog, out)
        r["wall_s"] = dur
        r["returncode"] = proc.returncode
        rows.append((name, r))
        print(f"  {name}: rc {proc.returncode}, {dur:.0f} s, losses {[round(x, 4) for x in r['losses']]}", flush=True)

    ref_loss = None
    if ref is not None:
        proc, res, out, rlog = ref
        left = max(10.0, a.budget_s + 90 - (time.time() - t_start))
        try:
            proc.wait(timeout=left)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            print(f"  cpu fp32 reference: not finished within the budget (killed)")
        rr = _read(res, rlog, out)
        ref_loss = rr["losses"][0] if rr["losses"] else None
        if ref_loss is None:
            print(f"  cpu fp32 reference failed: {rr.get('error', '')}")

    print()
    print(f"{'config':<22}{'peak alloc GiB':>15}{'peak resv GiB':>14}{'step s (med)':>13}{'tok/s':>9}  "
          f"{'loss step 1':>11}{'rel. to CPU fp32':>17}  losses")
    for name, r in rows:
        if "skipped" in r:
            print(f"{name:<22}  skipped: {r['skipped']}")
            continue
        if r.get("returncode") != 0 or not r["losses"]:
            print(f"{name:<22}  FAILED (rc {r.get('returncode')}): {r.get('error', '')}")
            continue
        st = r["step_times"][2:] or r["step_times"]
        tps = r["tokens_per_s"][2:] or r["tokens_per_s"]
        pa = f"{r['peak_allocated'] / 2**30:.2f}" if r.get("peak_allocated") else "-"
        pr = f"{r['peak_reserved'] / 2**30:.2f}" if r.get("peak_reserved") else "-"
        l1 = r["losses"][0]
        rel = f"{(l1 - ref_loss) / abs(ref_loss):+.2e}" if ref_loss and not name.endswith("nc_ic") else "-"
        print(f"{name:<22}{pa:>15}{pr:>14}{statistics.median(st):>13.3f}{statistics.median(tps):>9.0f}  "
              f"{l1:>11.5f}{rel:>17}  {[round(x, 4) for x in r['losses']]}")
    print(f"CPU fp32 reference, step 1 (same seed and batch, two_stream): "
          f"{ref_loss if ref_loss is not None else 'not available'}")
    print(f"total wall time {time.time() - t_start:.0f} s")
    ok = all("skipped" in r or (r.get("returncode") == 0 and r["losses"]) for _, r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
