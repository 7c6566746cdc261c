#!/usr/bin/env python
"""The GPU check (issue 21): one run on one GPU that settles what the CPU test-suite cannot, with one summary table.

Run it through ``bash bench/gpu/check.sh`` (installs the carried wheels first; see there for the device command);
``--dry-run`` runs the same script on CPU at tiny sizes (CI: tests/test_gpu_check.py). Rows of the summary:

``versions``
    torch, CUDA, cuDNN, NCCL, megatron-core, Transformer Engine (absent on the bare device image), the GPU.
``sdpa bool mask + GQA``
    the torch SDPA backend chosen (``torch._fused_sdp_choice``) for a boolean mask with grouped-query attention, the
    dense training path and the decode steps' shape, against the same call with K/V expanded to all heads; on GPU
    also the time and extra memory of both, and for training the time of the causal call without a mask (issue
    item 9: flash rejects masks, and before torch's July 2026 change memory-efficient attention rejects GQA, so
    such a call may fall to the math kernel; on the H200 the masked GQA call was 4-8x slower than expanded K/V).
``dist-opt overlap``
    a small untied model, 3 steps with megatron's distributed optimizer and ``--overlap-grad-reduce
    --overlap-param-gather`` (small buckets: the output layer in its own), losses equal to the same run without
    overlaps (item 1).
``train <path>/<recompute>``
    each attention path (two_stream, packed, dense; ``nc``, and ``nc_ic`` for packed and dense) x recompute mode (none,
    full, selective) on a Qwen2.5-0.5B-shaped random model: a few bf16 steps with the users' flags (megatron
    distributed optimizer, both overlaps), step-1 loss against the CPU fp32 reference of the same weights and batch,
    peak allocated GPU memory, median step time and tokens/s (after the first step); FAIL if the run left over
    256 MiB allocated after ``pretrain`` returned (the row then names who holds it).
``cpu fp32 reference``
    that reference (``CUDA_VISIBLE_DEVICES=`` so it builds exactly what a CPU run builds).
``decode 7B <decoder>``
    a Qwen2.5-7B-shaped random local-spec model (bf16, untied, QKV bias; output layer drawn 10x wider so logits are
    peaked) through the engine: AR, Jacobi and MR (tree verification) with CUDA graphs, static shapes without graphs,
    and the eager lean forward: steady-state tokens/s per mode (the second request of a batch session, so graphs are
    captured before it), and whether the tokens equal eager AR's. In bf16 a different forward width or kernel rounds
    differently, so a greedy near-tie may flip: the row then says where and AR's top-2 logit gap there (``info``).
``decode 7B <decoder> fp32``
    the exactness check: the same shape and prompt in fp32 (no TF32), tokens equal across the three modes and to
    eager AR.
``decode 7B logits``
    max |logit difference| of one Jacobi-width cached forward, CUDA-graph replay against the eager lean forward.
``decode 7B memory``
    allocated GPU memory after each of 5 ``generate()`` calls (item 4: it must not grow).
``save -> resume``
    the small model, distributed optimizer and both overlaps: 2 steps, save, resume, step 3; its loss against an
    uninterrupted 3-step run (megatron's optimizer state through a torch_dist checkpoint).

Training runs are ``pretrain_jf.main`` calls in a child process (one per CPU/GPU side; a child that dies is
restarted for the jobs left, the dead job's row says so); the GPU child runs them one after another so timings and
peak memory are its own. Time: jobs that would start after ``--budget-s`` are reported as skipped. Every figure in
the table is measured in this run; on the dry run the figures are CPU ones of tiny models (plumbing only).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import statistics
import subprocess
import sys
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

def _shape_config(args, **extra) -> dict:
    """The HF ``config.json`` of a :class:`~megatron_jf.models.hf_config.ModelArgs` (plus ``extra`` keys)."""
    return dict(args.to_hf_dict(), **extra)


def _training_shapes():
    """``(Qwen2.5-0.5B, small, small untied)`` HF configs of the training rows (:mod:`megatron_jf.models.shapes`):
    the GPU matrix's model, and the dry run's / the overlap and resume rows' 2-layer model of the same family."""
    import dataclasses

    from megatron_jf.models import shapes

    qwen = dataclasses.replace(shapes.get("qwen2.5-0.5b"), eos_token_ids=[151643], bos_token_id=151643)
    small = dataclasses.replace(qwen, vocab_size=256, hidden_size=64, intermediate_size=160, num_layers=2,
                                num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=1024,
                                eos_token_ids=[255], bos_token_id=255)
    return (_shape_config(qwen, torch_dtype="bfloat16"), _shape_config(small, torch_dtype="bfloat16"),
            _shape_config(dataclasses.replace(small, tie_word_embeddings=False), torch_dtype="bfloat16"))


RECOMPUTE = {
    "none": {},
    "full": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
    "selective": {"recompute_granularity": "selective"},
}
#: (attention path, mask, recompute) of the training matrix, most important first (the time budget cuts the end).
MATRIX = [("two_stream", "nc", "none"), ("two_stream", "nc", "full"), ("packed", "nc", "none"),
          ("dense", "nc", "none"), ("two_stream", "nc", "selective"), ("packed", "nc", "full"),
          ("dense", "nc", "full"), ("packed", "nc", "selective"), ("dense", "nc", "selective"),
          ("packed", "nc_ic", "none"), ("dense", "nc_ic", "none")]
DECODERS = ("ar", "jacobi", "mr")
#: Megatron-LM's GPU flags the users' launch script trains with (examples/train_jf_qwen7b_h200.sh).
USERS_GPU_FLAGS = ["--precision", "bf16", "--use-megatron-optimizer", "--use-distributed-optimizer",
                   "--overlap-grad-reduce", "--overlap-param-gather"]


#: the parts of the check ``--sections`` selects from
SECTIONS = ("sdpa", "overlap", "resume", "matrix", "decode")


def row_names() -> list[str]:
    """Every row of the summary table, in order (the dry-run test checks each is printed)."""
    return (["versions", "sdpa bool mask + GQA", "dist-opt overlap"]
            + [f"train {p}/{r}" + ("" if m == "nc" else f"/{m}") for p, m, r in MATRIX]
            + ["cpu fp32 reference"] + [f"decode 7B {d}" for d in DECODERS]
            + [f"decode 7B {d} fp32" for d in DECODERS]
            + ["decode 7B logits", "decode 7B memory", "save -> resume"])


# ----------------------------------------------------------------------------------------------- inputs
def write_inputs(work: str, name: str, cfg: dict, *, records: int, prompt_len: int, block_size: int,
                 num_blocks: int) -> tuple[str, str]:
    """A random model's HF config directory and synthetic trajectory shards under ``work/name``."""
    from tests.dist.train_fixtures import make_record, write_shards

    hf = os.path.join(work, name, "hf")
    os.makedirs(hf, exist_ok=True)
    with open(os.path.join(hf, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    data = os.path.join(work, name, "train")
    if not os.path.isdir(data):
        recs = [make_record(1000 + i, prompt_len=prompt_len, block_size=block_size, num_blocks=num_blocks,
                            vocab=min(cfg["vocab_size"], 32000), sample_id=f"{name}{i}") for i in range(records)]
        write_shards(data, recs, per_shard=8)
    return hf, data


def pretrain_args(hf: str, data: str, log: str, *, path: str = "two_stream", mask: str = "nc", recompute: str = "none",
                  steps: int, mbs: int, gbs: int, seq: int, block_size: int, window: int, threads: int) -> list[str]:
    """``pretrain_jf.py`` arguments of one run (``seq`` is one stream's length; doubled where a row holds both)."""
    if path == "dense" or (path == "packed" and mask != "nc"):
        seq = 2 * seq
    from megatron_jf import cli
    from megatron_jf.training.config import TrainConfig

    return cli.to_argv(TrainConfig.from_flat(
        hf_config=hf, data=[data], objective="jf", block_size=block_size, window_size=window,
        noise_schedule="progressive", attention_path=path, mask=mask, seq_length=seq, micro_batch_size=mbs,
        global_batch_size=gbs, train_steps=steps, lr=1e-4, warmup_steps=0, clip_grad=1.0, seed=1234, log_interval=1,
        log_file=log, progress=False, threads=threads, num_workers=0, **RECOMPUTE[recompute]))


# ----------------------------------------------------------------------------------------------- the job runner
def run_jobs_child(jobs_file: str) -> int:
    """Child process: run each job of ``jobs_file`` (``pretrain_jf.main``) not yet done, one after another; write
    ``{rc, error, peak_allocated, wall_s}`` to each job's ``result`` path (``started`` marks the one in flight)."""
    import gc

    import torch

    import pretrain_jf

    with open(jobs_file) as f:
        spec = json.load(f)
    cuda = torch.cuda.is_available()
    longest = 0.0  # the longest job so far: one that would end past the deadline is not started
    for job in spec["jobs"]:
        if os.path.exists(job["result"]):
            continue
        res = {"rc": None, "error": "", "peak_allocated": None}
        if time.time() + longest > spec["deadline"]:
            res.update(skipped=f"time budget ({spec['budget_s']:.0f} s)")
            _write_json(job["result"], res)
            continue
        _write_json(job["result"] + ".started", {})
        if os.path.exists(job["log"]):
            os.remove(job["log"])
        gc.collect()  # the previous job's leftovers (pretrain collects its own; this is for a failed one)
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        t0 = time.time()
        print(f"--- job {job['name']}: pretrain_jf.py {' '.join(job['argv'])}", flush=True)
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(_Tee(sys.stderr, err)):
                res["rc"] = pretrain_jf.main(job["argv"])
            if res["rc"]:
                res["error"] = next((ln for ln in reversed(err.getvalue().splitlines()) if "error" in ln), "")[:300]
        except Exception as e:  # an OOM or a library error stays in its row
            traceback.print_exc()
            res.update(rc=-1, error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300])
        res["wall_s"] = time.time() - t0
        longest = max(longest, res["wall_s"])
        if cuda:
            res["peak_allocated"] = torch.cuda.max_memory_allocated() - before
            gc.collect()
            res["left_allocated"] = torch.cuda.memory_allocated() - before
            if res["left_allocated"] > 2**28:
                res["left_holders"] = _holders()
        _write_json(job["result"], res)
    return 0


def _holders(depth: int = 10, device: str = "cuda", top: int = 2) -> str:
    """Who keeps the largest ``device`` tensors Python can see alive: each one's referrer chain (an object's
    attribute or a dict's key where found). Tensors whose storage cannot be read (fake, functional) are skipped."""
    import gc

    import torch

    here = sys._getframe()
    found = {}
    for o in gc.get_objects():
        try:
            if isinstance(o, torch.Tensor) and o.device.type == device:
                st = o.untyped_storage()
                found.setdefault(st.data_ptr(), (st.nbytes(), o))
        except Exception:  # noqa: BLE001  (fake/functional tensors, half-built objects)
            continue
    if not found:
        return f"no {device} tensor reachable from Python (held from C++)"
    total = sum(n for n, _ in found.values())
    largest = sorted(found.values(), key=lambda x: -x[0])[:top]
    skip = {id(found), id(largest), id(here)} | {id(v) for v in found.values()}

    def edge(holder, obj) -> str:
        try:
            if isinstance(holder, dict):
                key = next((k for k, v in holder.items() if v is obj), "?")
                owner = next((x for x in gc.get_referrers(holder) if getattr(x, "__dict__", None) is holder), None)
                return (f"{type(owner).__qualname__}.{key}" if owner is not None else f"dict[{key!r}]")[:80]
            if isinstance(holder, (list, tuple)):
                return f"{type(holder).__name__}[{len(holder)}]"
            d = getattr(holder, "__dict__", None)
            if isinstance(d, dict):
                key = next((k for k, v in d.items() if v is obj), None)
                if key is not None:
                    return f"{type(holder).__module__}.{type(holder).__qualname__}.{key}"
            return f"{type(holder).__module__}.{type(holder).__qualname__}"
        except Exception as e:  # noqa: BLE001
            return f"{type(holder).__name__} ({type(e).__name__})"

    out = []
    for nbytes, obj in largest:
        chain = [f"{nbytes / 2**20:.0f} MiB {tuple(obj.shape)}"]
        seen = set(skip) | {id(obj)}
        keep = []  # this walk's own lists refer to what it walks: skip them (and keep their ids unused)
        for _ in range(depth):
            everyone = gc.get_referrers(obj)
            keep.append(everyone)
            seen.add(id(everyone))
            refs = [r for r in everyone if id(r) not in seen and type(r).__name__ != "frame"]
            keep.append(refs)
            seen.add(id(refs))
            if not refs:
                chain.append("(no Python referrer: held from C++)")
                break
            holder = refs[0]
            seen.add(id(holder))
            chain.append(edge(holder, obj))
            obj = holder
        out.append(" <- ".join(chain))
    del found, largest
    return f"{total / 2**30:.2f} GiB in Python-visible {device} tensors; " + "; ".join(out)


class _Tee:
    """A text stream writing to two streams (the job's log, and a buffer to name its error from)."""

    def __init__(self, *streams):
        self.streams = streams

    def write(self, text):
        for st in self.streams:
            st.write(text)
        return len(text)

    def flush(self):
        for st in self.streams:
            st.flush()

    def close(self):  # a library's logging handler may close its stream at exit; the streams are not ours
        pass


def _write_json(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


class Runner:
    """Runs a list of jobs in a child process (restarted for the jobs left if it dies) and reads their results."""

    def __init__(self, work: str, name: str, jobs: list[dict], *, env: dict, deadline: float, budget_s: float):
        self.work, self.name, self.jobs = work, name, jobs
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", **env)
        self.env["PYTHONPATH"] = REPO + (os.pathsep + self.env["PYTHONPATH"] if self.env.get("PYTHONPATH") else "")
        for j in jobs:
            j["result"] = os.path.join(work, f"{j['name'].replace('/', '_').replace(' ', '_')}.result.json")
            for p in (j["result"], j["result"] + ".started"):
                if os.path.exists(p):
                    os.remove(p)
        self.jobs_file = os.path.join(work, f"{name}.jobs.json")
        _write_json(self.jobs_file, {"jobs": jobs, "deadline": deadline, "budget_s": budget_s})
        self.log = os.path.join(work, f"{name}.log")
        self.deadline = deadline
        self.proc = None
        open(self.log, "w").close()

    def start(self) -> "Runner":
        self._log_f = open(self.log, "a")
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.gpu.check", "--run-jobs", self.jobs_file],
                                     stdout=self._log_f, stderr=subprocess.STDOUT, env=self.env, cwd=REPO)
        return self

    def wait(self, grace_s: float = 60.0) -> None:
        """Wait for every job (restarting a dead child while jobs are left), at most until the deadline + grace."""
        while True:
            left = max(5.0, self.deadline + grace_s - time.time())
            try:
                rc = self.proc.wait(timeout=left)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                self._mark_unfinished(f"killed at the time limit ({self.name} child)")
                return
            pending = [j for j in self.jobs if not os.path.exists(j["result"])]
            if not pending:
                return
            died = [j for j in pending if os.path.exists(j["result"] + ".started")]
            if not died:  # it ended before starting a job (an import error): restarting would do the same
                for j in pending:
                    _write_json(j["result"], {"rc": rc, "error": f"child exited ({rc}) before this job: "
                                                                 f"{_last_line(self.log)}"})
                return
            for j in died:
                _write_json(j["result"], {"rc": rc, "error": f"process died (exit {rc}): {_last_line(self.log)}"})
            if time.time() > self.deadline:
                self._mark_unfinished("time budget")
                return
            self.start()

    def _mark_unfinished(self, why: str) -> None:
        for j in self.jobs:
            if not os.path.exists(j["result"]):
                _write_json(j["result"], {"rc": None, "skipped": why})

    def result(self, job: dict) -> dict:
        """The job's result with its logged training steps (``losses``, ``step_times``, ``tokens_per_s``)."""
        r = {}
        if os.path.exists(job["result"]):
            with open(job["result"]) as f:
                r = json.load(f)
        steps = []
        if os.path.exists(job["log"]):
            with open(job["log"]) as f:
                steps = [s for s in (json.loads(x) for x in f if x.strip()) if s.get("split") == "train"]
        r["losses"] = [s["loss"] for s in steps]
        r["step_times"] = [s["step_time"] for s in steps]
        r["tokens_per_s"] = [s["tokens_per_s"] for s in steps]
        if r.get("rc") not in (0, None) and not r.get("error"):
            r["error"] = _last_line(self.log)
        return r


def _last_line(path: str) -> str:
    if not os.path.exists(path):
        return ""
    with open(path, errors="replace") as f:
        lines = [ln.rstrip() for ln in f if ln.strip()]
    errs = [ln for ln in lines if "rror" in ln]
    return (errs[-1] if errs else (lines[-1] if lines else ""))[:300]


# ----------------------------------------------------------------------------------------------- in-process rows
def versions_row() -> str:
    import torch

    parts = [f"torch {torch.__version__}"]
    if torch.cuda.is_available():
        nccl = torch.cuda.nccl.version()
        parts += [f"CUDA {torch.version.cuda}", f"cuDNN {torch.backends.cudnn.version()}",
                  f"NCCL {'.'.join(map(str, nccl)) if isinstance(nccl, tuple) else nccl}",
                  torch.cuda.get_device_name()]
    else:
        parts.append("no CUDA")
    try:
        import megatron.core

        parts.append(f"megatron-core {megatron.core.__version__}")
    except Exception as e:  # noqa: BLE001
        parts.append(f"megatron-core missing ({type(e).__name__})")
    from megatron_jf import platform

    te = "absent"
    if platform.HAVE_TE:
        import transformer_engine

        te = transformer_engine.__version__
    parts.append(f"TE {te}")
    import platform as py

    parts.append(f"Python {py.python_version()}")
    return ", ".join(parts)


def _backend(q, k, v, mask, *, causal=False, gqa=False) -> str:
    import torch
    from torch.nn.attention import SDPBackend

    try:
        c = torch._fused_sdp_choice(q, k, v, mask, 0.0, causal, scale=None, enable_gqa=gqa)
        return SDPBackend(c).name
    except Exception as e:  # noqa: BLE001  (a private API: say what happened)
        return f"? ({type(e).__name__})"


def sdpa_probe(dry: bool) -> tuple[str, str]:
    """``(status, text)``: SDPA backends (and, on GPU, cost) of a boolean mask with GQA vs expanded K/V."""
    import torch
    import torch.nn.functional as F

    cuda = torch.cuda.is_available() and not dry
    dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    # 7B: 28 query heads, 4 KV groups, head dim 128. decode: a 1+16 Jacobi block over a 1024-slot static cache
    nh, ng, hd = (28, 4, 128) if cuda else (4, 2, 16)
    cases = {"decode": (1, 17, 1024 if cuda else 64, False), "train": (1, 2048 if cuda else 64, None, True)}
    out, notes = [], []
    for name, (b, sq, sk, grad) in cases.items():
        sk = sk or sq
        g = torch.Generator(device=dev).manual_seed(0)
        q = torch.randn(b, nh, sq, hd, device=dev, dtype=dtype, generator=g).requires_grad_(grad)
        k = torch.randn(b, ng, sk, hd, device=dev, dtype=dtype, generator=g).requires_grad_(grad)
        v = torch.randn(b, ng, sk, hd, device=dev, dtype=dtype, generator=g).requires_grad_(grad)
        mask = torch.ones(sq, sk, device=dev, dtype=torch.bool).tril_(sk - sq)[None, None]
        ke, ve = k.repeat_interleave(nh // ng, 1), v.repeat_interleave(nh // ng, 1)
        masked, expanded = _backend(q, k, v, mask, gqa=True), _backend(q, ke, ve, mask)
        text = f"{name}: {masked} (K/V expanded: {expanded})"
        if name == "train":
            text += f", causal no mask: {_backend(q, k, v, None, causal=True, gqa=True)}"
        if cuda:
            def run(kk, vv, gqa, causal=False):
                if kk is ke:  # the expansion is part of the expanded call's cost (forward and backward)
                    kk, vv = k.repeat_interleave(nh // ng, 1), v.repeat_interleave(nh // ng, 1)
                o = F.scaled_dot_product_attention(q, kk, vv, attn_mask=None if causal else mask, is_causal=causal,
                                                   enable_gqa=gqa)
                if grad:
                    o.sum().backward()
            cost = {}
            runs = [("gqa", (k, v, True)), ("exp", (ke, ve, False))]
            if grad:  # the causal (two-stream, packed) training calls: no mask
                runs += [("gqa causal", (k, v, True, True)), ("exp causal", (ke, ve, False, True))]
            for label, args in runs:
                run(*args)
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                t0 = time.perf_counter()
                for _ in range(5):
                    run(*args)
                torch.cuda.synchronize()
                cost[label] = ((time.perf_counter() - t0) / 5 * 1e3, (torch.cuda.max_memory_allocated() - base) / 2**20)
            text += (f"; {'fwd+bwd' if grad else 'fwd'} {cost['gqa'][0]:.2f} ms / +{cost['gqa'][1]:.0f} MiB vs "
                     f"expanded {cost['exp'][0]:.2f} ms / +{cost['exp'][1]:.0f} MiB")
            if grad:
                text += (f"; causal no mask {cost['gqa causal'][0]:.2f} ms vs expanded "
                         f"{cost['exp causal'][0]:.2f} ms")
        out.append(text)
        if masked == "MATH":
            notes.append(name)
    status = "WARN" if notes else "info"
    return status, "; ".join(out) + (f" -- math kernel on {', '.join(notes)} (item 9)" if notes else "")


def decode_rows(dry: bool) -> list[tuple[str, str, str]]:
    """The ``decode 7B ...`` rows (see the module docstring)."""
    import gc

    import torch

    from bench.common import DRY_RUN_SHAPE, GPU_SHAPE, build_random_model
    from megatron_jf import parallel

    cuda = torch.cuda.is_available() and not dry
    device = torch.device("cuda" if cuda else "cpu")
    parallel.initialize(1, 1)
    rows: list[tuple[str, str, str]] = []
    names = [f"decode 7B {d}" for d in DECODERS] + [f"decode 7B {d} fp32" for d in DECODERS] + [
        "decode 7B logits", "decode 7B memory"]
    try:
        # bf16: the speed rows (tokens/s per forward mode) and whether bf16 rounding kept AR's tokens; fp32: the
        # exactness rows (same model shape and prompt; fp32 matmuls, no TF32). On the CPU dry run one fp32 pass.
        passes = [("bf16", torch.bfloat16, 128), ("fp32", torch.float32, 64)] if cuda else [("fp32", torch.float32, 12)]
        for label, dtype, new in passes:
            if dtype is torch.float32:  # exact fp32 products: no TF32 in matmuls or cuDNN
                torch.backends.cuda.matmul.allow_tf32 = False
                torch.backends.cudnn.allow_tf32 = False
            t0 = time.perf_counter()
            model = build_random_model(GPU_SHAPE if cuda else DRY_RUN_SHAPE, dtype, device)
            with torch.no_grad():  # output layer N(0, 0.2^2): peaked logits
                model.output_layer.weight.mul_(10.0)
            built = time.perf_counter() - t0
            rows += _decode_pass(model, label, cuda, new, built, speed=label == "bf16" or not cuda,
                                 extras=label == passes[0][0])
            del model
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
        if not cuda:  # the dry run's one pass is both the speed and the exactness pass
            rows += [(f"decode 7B {d} fp32", st, txt) for (n_, st, txt) in list(rows) for d in DECODERS
                     if n_ == f"decode 7B {d}"]
    except Exception as e:  # noqa: BLE001  (one failing section must not hide the others)
        traceback.print_exc()
        done = {r[0] for r in rows}
        rows += [(name, "FAIL", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300])
                 for name in names if name not in done]
    finally:
        parallel.destroy()
    return rows


def _decode_pass(model, label: str, cuda: bool, new: int, built: float, *, speed: bool,
                 extras: bool) -> list[tuple[str, str, str]]:
    """One model through the three forward modes and decoders. ``speed``: the bf16 rows (tokens/s; a token
    difference is bf16 rounding unless AR's top-2 logit gap there is wide); else the ``fp32`` exactness rows.
    ``extras``: also the logits and memory rows."""
    import torch

    from bench import common
    from megatron_jf.decoding import DecodeConfig
    from megatron_jf.inference.forward import forward_logits
    from megatron_jf.inference.options import InferenceOptions
    from megatron_jf.inference.lean_forward import lean_forward_for
    from megatron_jf.inference.static_decode import StaticDecoder
    from megatron_jf.models.gpt import new_kv_cache

    prompt_len, n = (512, 16) if cuda else (24, 4)
    rows = []
    with torch.inference_mode():  # no autograd anywhere below (KV buffers, graph capture)
        lean = lean_forward_for(model)
        if lean is None:
            return [(f"decode 7B {d}", "FAIL", "the lean forward does not support the model") for d in DECODERS]
        vocab = model.vocab_size_unpadded
        g = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, vocab, (prompt_len,), generator=g).tolist()
        # the forward implementation is an inference option (inference/options.py): the static path with CUDA
        # graphs, the static path run eagerly, and the eager lean forward
        modes = {"graphs": InferenceOptions(mr_verify="tree", forward="static", cuda_graphs=cuda),
                 "static": InferenceOptions(mr_verify="tree", forward="static", cuda_graphs=False),
                 "eager": InferenceOptions(mr_verify="tree", forward="lean")}
        engines = {mode: common.engine(model, options=o) for mode, o in modes.items()}
        toks, tps = {}, {}
        for mode, engine in engines.items():
            for d in DECODERS:
                cfg = DecodeConfig(decoder=d, block_size=n, num_blocks=2 if n >= 8 else 1, verification_size=4)
                r = _steady_state(engine, prompt, cfg, new)
                toks[mode, d], tps[mode, d] = r.tokens, r.tps
        ref = toks["eager", "ar"]
        for d in DECODERS:
            same = all(toks[m, d] == ref for m in engines)
            first = min((_first_difference(toks[m, d], ref) for m in engines if toks[m, d] != ref), default=None)
            where = "" if same else "; first difference at token " + ", ".join(
                f"{m} {_first_difference(toks[m, d], ref)}" for m in engines if toks[m, d] != ref)
            what = f"({len(ref)} tokens after a {prompt_len}-token prompt, n={n})"
            if not speed:
                rows.append((f"decode 7B {d} {label}", "ok" if same else "FAIL",
                             f"{label}: tokens {'equal' if same else 'DIFFER'} across graphs/static/eager and to "
                             f"AR{where} {what}"))
                continue
            status = "ok"
            if not same:  # bf16: a different GEMM shape rounds differently; flipping a near-tie is that, not a bug
                gap = _top2_gap(model, prompt + ref[:first])
                where += f" (AR's top-2 logit gap there {gap:.3g})"
                status = "info" if cuda else "FAIL"
            rows.append((f"decode 7B {d}", status,
                         f"{label}: tokens {'equal' if same else 'differ'} across graphs/static/eager and to AR"
                         f"{where} {what}; tok/s graphs {tps['graphs', d]:.1f}, static {tps['static', d]:.1f}, "
                         f"eager {tps['eager', d]:.1f}" + ("" if cuda else " (CPU, tiny: plumbing only)")))
        if not extras:
            return rows
        mem = []
        for _ in range(5):  # each generate() builds (and must free) its runner's cache and captured graphs
            engines["graphs"].generate([prompt], DecodeConfig(decoder="ar"), max_new_tokens=new)
            if cuda:
                torch.cuda.synchronize()
            mem.append(torch.cuda.memory_allocated() / 2**20 if cuda else float("nan"))
        # one Jacobi-width cached forward: graph replay (or static eager on CPU) vs the eager lean forward
        cache = new_kv_cache(model, 1, prompt_len + 64)
        pos = torch.arange(prompt_len)[None]
        forward_logits(model, torch.tensor([prompt]), pos, kv_cache=cache, return_logits=False, impl="lean")
        cache.commit([prompt_len])
        blk = torch.randint(0, vocab, (1, 1 + n), generator=g)
        bpos = prompt_len + torch.arange(1 + n)[None]
        eager = forward_logits(model, blk, bpos, kv_cache=cache, impl="lean")
        dec = StaticDecoder(lean, cache, buckets=[1 + n], use_graphs=cuda)
        for _ in range(3):  # capture, then replays
            static = dec.forward(blk, bpos)
        diff = float((static[..., :vocab].float() - eager).abs().max())
        scale = float(eager.abs().max())
        rows.append(("decode 7B logits", "ok" if diff <= 0.05 * max(scale, 1e-6) else "FAIL",
                     f"{label}: max |logit diff| {diff:.3g} (max |logit| {scale:.3g}), "
                     f"{'CUDA graph replay' if cuda else 'static eager (CPU)'} vs eager lean, 1+{n} tokens after "
                     f"{prompt_len}; model built in {built:.1f} s"))
        if cuda:
            grow = mem[-1] - mem[0]
            rows.append(("decode 7B memory", "ok" if grow <= 8 else "FAIL",
                         f"allocated after 5 generate(): {', '.join(f'{m:.0f}' for m in mem)} MiB "
                         f"(+{grow:.0f} MiB from the 1st to the 5th)"))
        else:
            rows.append(("decode 7B memory", "skip", "CPU dry run: 5 generate() calls ran; no GPU memory to read"))
    return rows


def _top2_gap(model, tokens: list[int]) -> float:
    """AR's margin between its two best next-token logits after ``tokens`` (one uncached lean forward)."""
    import torch

    from megatron_jf.inference.forward import forward_logits

    ids = torch.tensor([tokens])
    logits = forward_logits(model, ids, torch.arange(len(tokens))[None], impl="lean")[0, -1]
    logits = logits[: model.vocab_size_unpadded].float()
    top = logits.topk(2).values
    return float(top[0] - top[1])


def _steady_state(engine, prompt: list[int], cfg, new: int):
    """The second of two identical requests through one batch session (as the server runs them): its cache, and so
    its CUDA graphs, were made by the first, so its tokens/s is the steady state (``generate()`` makes a new cache,
    and with it new graphs, per call)."""
    from megatron_jf.inference.engine import forward_width
    from megatron_jf.inference.request import Request

    width = forward_width(cfg)
    sess = engine.open_batch(1, max_width=width, max_len=len(prompt) + new + width + 1)
    done = []
    for _ in range(2):
        sess.add(prompt, Request(decode=cfg, max_new_tokens=new))
        while sess.num_rows:
            done += [res for _, res in sess.step()]
    return done[-1]


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


# ----------------------------------------------------------------------------------------------- table
def _fmt_train(r: dict, ref_loss: float | None, nc_ic_first: float | None, mask: str) -> tuple[str, str]:
    if r.get("skipped"):
        return "skip", r["skipped"]
    if r.get("rc") != 0 or not r["losses"]:
        return "FAIL", f"rc {r.get('rc')}: {r.get('error', '')}"
    st = r["step_times"][1:] or r["step_times"]
    tps = r["tokens_per_s"][1:] or r["tokens_per_s"]
    l1 = r["losses"][0]
    if mask == "nc":
        against, other = ref_loss, "CPU fp32"
    else:
        against, other = nc_ic_first, "packed nc_ic"
    rel = (l1 - against) / abs(against) if against else None
    status = "ok" if rel is None or abs(rel) <= 0.02 else "FAIL"
    mem = f"peak {r['peak_allocated'] / 2**30:.2f} GiB, " if r.get("peak_allocated") else ""
    if r.get("left_allocated", 0) > 2**28:  # pretrain must leave nothing behind (Trainer.release)
        mem += f"{r['left_allocated'] / 2**30:.2f} GiB still allocated after it ({r.get('left_holders', '?')}), "
        status = "FAIL"
    return status, (f"loss step 1 {l1:.4f} ({'vs ' + other + f' {rel:+.1e}' if rel is not None else 'no reference'}),"
                    f" {mem}step {statistics.median(st):.3f} s, {statistics.median(tps):.0f} tok/s; losses "
                    f"{[round(x, 4) for x in r['losses']]}")


def print_table(rows: list[tuple[str, str, str]], header: str) -> None:
    width = max(len(r[0]) for r in rows) + 2
    print(f"\n== gpu_check summary: {header} ==")
    print(f"{'check':<{width}}{'status':<8}result")
    for name, status, text in rows:
        print(f"{name:<{width}}{status:<8}{text}")
    print("== end of summary ==", flush=True)


# ----------------------------------------------------------------------------------------------- main
def build_parser():
    """The command line (torch-free; ``--run-jobs FILE``, the child's entry, is read before it)."""
    from bench import common

    p = common.parser(__doc__.split("\n\n")[0])
    common.DRY_RUN.add(p, help="CPU, tiny models, torch AdamW: the plumbing, no GPU")
    common.WORK.add(p, help="scratch directory (none: /tmp/gpu_check_work[_dry]; the child logs are copied to $OUT "
                            "when it is set)")
    p.add_argument("--sections", default=",".join(SECTIONS),
                   help="comma list of what to run, of " + ", ".join(SECTIONS) + " and 'train:<path>/<recompute>"
                        "[/<mask>]' for one training-matrix row (rerunning a few rows inside a short lease); "
                        "rows not run say 'not selected'")
    p.add_argument("--budget-s", type=float, default=None,
                   help="start no training job after this many seconds less the decode rows' 240 s on GPU "
                        "(none: 450 on GPU, 600 dry)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--run-jobs"]:
        return run_jobs_child(argv[1])
    p = build_parser()
    a = p.parse_args(argv)
    want = {x.strip() for x in a.sections.split(",") if x.strip()}
    unknown = {x for x in want if x not in SECTIONS and not x.startswith("train:")}
    if unknown:
        p.error(f"--sections: unknown {sorted(unknown)} (known: {', '.join(SECTIONS)}, train:<row>)")
    t_start = time.time()
    import torch

    gpu = torch.cuda.is_available() and not a.dry_run
    if not gpu and not a.dry_run:
        print("gpu_check: no CUDA device; run with --dry-run on CPU", file=sys.stderr)
        return 1
    dry = not gpu
    budget = a.budget_s or (450.0 if gpu else 600.0)  # H200 2026-12-04: 11 training jobs end by ~160 s, decode ~85 s
    work = a.work or os.path.join("/tmp", "gpu_check_work" + ("_dry" if dry else ""))
    os.makedirs(work, exist_ok=True)
    print(f"gpu_check: {'GPU' if gpu else 'DRY RUN (CPU, tiny models, fp32, torch AdamW)'}; work {work}", flush=True)
    rows: dict[str, tuple[str, str]] = {}

    rows["versions"] = ("info", versions_row())
    print("versions:", rows["versions"][1], flush=True)
    if "sdpa" in want:
        try:
            rows["sdpa bool mask + GQA"] = sdpa_probe(dry)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            rows["sdpa bool mask + GQA"] = ("FAIL", f"{type(e).__name__}: {e}"[:300])
        print("sdpa:", rows["sdpa bool mask + GQA"][1], flush=True)

    # ---- inputs and jobs
    ncpu = os.cpu_count() or 2
    qwen05b, small_cfg, small_untied = _training_shapes()
    small_hf, small_data = write_inputs(work, "small", small_untied, records=8, prompt_len=6, block_size=4,
                                        num_blocks=4)
    small = dict(steps=3, mbs=2, gbs=4, seq=32, block_size=4, window=2, threads=2)
    if gpu:
        big_hf, big_data = write_inputs(work, "qwen05b", qwen05b, records=32, prompt_len=192, block_size=32,
                                        num_blocks=24)
        big = dict(steps=4, mbs=2, gbs=4, seq=1024, block_size=32, window=16, threads=2)
    else:
        big_hf, big_data = write_inputs(work, "tiny", small_cfg, records=8, prompt_len=6, block_size=4, num_blocks=4)
        big = dict(small, steps=2)
    gpu_flags = USERS_GPU_FLAGS if gpu else ["--precision", "fp32"]
    no_overlap = [f for f in gpu_flags if not f.startswith("--overlap")]

    def job(name, hf, data, flags, **kw):
        log = os.path.join(work, f"{name.replace('/', '_').replace(' ', '_')}.metrics.jsonl")
        return {"name": name, "log": log, "argv": pretrain_args(hf, data, log, **kw) + flags}

    small_bucket = ["--ddp-bucket-size", "10000"] if gpu else []  # output layer (16k params) alone in a bucket
    overlap_jobs = [job("dist-opt no overlap", small_hf, small_data, no_overlap, **small),
                    job("dist-opt overlap", small_hf, small_data, gpu_flags + small_bucket, **small)]
    ckpt = os.path.join(work, "resume_ckpt")
    if os.path.isdir(ckpt):
        import shutil

        shutil.rmtree(ckpt)
    resume_jobs = [job("resume uninterrupted", small_hf, small_data, gpu_flags, **small),
                   job("resume part 1", small_hf, small_data, gpu_flags + ["--exit-interval", "2", "--save", ckpt],
                       **small),
                   job("resume part 2", small_hf, small_data, gpu_flags + ["--save", ckpt], **small)]
    matrix_jobs = [dict(job(f"train {p_}/{r_}" + ("" if m_ == "nc" else f"/{m_}"), big_hf, big_data, gpu_flags,
                            path=p_, mask=m_, recompute=r_, **big), mask=m_) for p_, m_, r_ in MATRIX]
    ref_job = job("cpu fp32 reference", big_hf, big_data, ["--precision", "fp32"],
                  **dict(big, steps=1, threads=max(1, ncpu - 4) if gpu else 2))

    overlap_jobs = overlap_jobs if "overlap" in want else []
    resume_jobs = resume_jobs if "resume" in want else []
    matrix_jobs = [j for j in matrix_jobs if "matrix" in want or f"train:{j['name'][len('train '):]}" in want]
    ref_jobs = [ref_job] if matrix_jobs else []
    decode_reserve = (240.0 if "decode" in want else 0.0) if gpu else 0.0
    deadline = t_start + budget - decode_reserve
    if gpu:
        cpu = Runner(work, "cpu_ref", ref_jobs, env={"CUDA_VISIBLE_DEVICES": ""}, deadline=deadline + 120,
                     budget_s=budget).start()
        runner = Runner(work, "gpu_jobs", overlap_jobs + resume_jobs + matrix_jobs, env={}, deadline=deadline,
                        budget_s=budget).start()
        runner.wait()
    else:  # one CPU child for everything (one import of torch + megatron-core)
        runner = Runner(work, "cpu_jobs", overlap_jobs + resume_jobs + matrix_jobs + ref_jobs, env={},
                        deadline=deadline, budget_s=budget).start()
        runner.wait()
        cpu = runner
    print(f"training jobs done at {time.time() - t_start:.0f} s", flush=True)

    # ---- decode (this process; the GPU is free now)
    decode = decode_rows(dry) if "decode" in want else []
    print(f"decode done at {time.time() - t_start:.0f} s", flush=True)
    if gpu:
        cpu.wait(grace_s=60.0)

    # ---- rows from the jobs
    res = {j["name"]: runner.result(j) for j in overlap_jobs + resume_jobs + matrix_jobs}
    ref = cpu.result(ref_job) if ref_jobs else {}
    ref_loss = ref["losses"][0] if ref.get("rc") == 0 and ref["losses"] else None
    if ref_jobs:
        rows["cpu fp32 reference"] = (("ok", f"loss step 1 {ref_loss:.4f} (two_stream, same seed and batch)")
                                      if ref_loss is not None else
                                      ("FAIL" if not ref.get("skipped") else "skip",
                                       ref.get("skipped") or f"rc {ref.get('rc')}: {ref.get('error', '')}"))
    a_, b_ = res.get("dist-opt no overlap"), res.get("dist-opt overlap")
    if not overlap_jobs:
        pass
    elif a_.get("rc") == 0 and b_.get("rc") == 0 and len(a_["losses"]) == len(b_["losses"]) == small["steps"]:
        rel = max(abs(x - y) / abs(x) for x, y in zip(a_["losses"], b_["losses"]))
        rows["dist-opt overlap"] = ("ok" if rel <= 1e-3 else "FAIL",
                                    f"{small['steps']} steps, losses {[round(x, 5) for x in b_['losses']]} vs no overlap "
                                    f"{[round(x, 5) for x in a_['losses']]} (max rel diff {rel:.1e})"
                                    + ("" if gpu else "; dry run: torch AdamW, no overlap (megatron's DDP and "
                                       "optimizer need CUDA)"))
    else:
        bad = b_ if b_.get("rc") != 0 else a_
        rows["dist-opt overlap"] = ("skip" if bad.get("skipped") else "FAIL",
                                    bad.get("skipped") or f"rc {bad.get('rc')}: {bad.get('error', '')}")
    full, p2 = res.get("resume uninterrupted"), res.get("resume part 2")
    if not resume_jobs:
        pass
    elif full.get("rc") == 0 and p2.get("rc") == 0 and len(full["losses"]) == 3 and p2["losses"]:
        rel = abs(p2["losses"][-1] - full["losses"][-1]) / abs(full["losses"][-1])
        rows["save -> resume"] = ("ok" if rel <= 1e-3 else "FAIL",
                                  f"step-3 loss after resume {p2['losses'][-1]:.6f} vs uninterrupted "
                                  f"{full['losses'][-1]:.6f} (rel diff {rel:.1e})")
    else:
        bad = next((r for r in (res["resume uninterrupted"], res["resume part 1"], p2) if r.get("rc") != 0), p2)
        rows["save -> resume"] = ("skip" if bad.get("skipped") else "FAIL",
                                  bad.get("skipped") or f"rc {bad.get('rc')}: {bad.get('error', '')}"
                                  + ("" if bad.get("rc") != 0 else f"; losses {full['losses']} / {p2['losses']}"))
    first_nc_ic = res.get("train packed/none/nc_ic", {}).get("losses", [])[:1]
    for j in matrix_jobs:
        rows[j["name"]] = _fmt_train(res[j["name"]], ref_loss, first_nc_ic[0] if first_nc_ic else None, j["mask"])
    for name, status, text in decode:
        rows[name] = (status, text)

    if os.environ.get("OUT"):  # the device tool returns at most 8 files from $OUT: the children's logs
        import shutil

        for r in {runner, cpu}:
            shutil.copy(r.log, os.path.join(os.environ["OUT"], os.path.basename(r.log)))
    missing = ("skip", "not selected (--sections)") if want != set(SECTIONS) else ("FAIL", "row missing")
    table = [(n, *rows.get(n, missing)) for n in row_names()]
    print_table(table, ("GPU" if gpu else "DRY RUN on CPU (tiny models; not GPU figures)")
                + f", {time.time() - t_start:.0f} s")
    return 0 if all(s != "FAIL" for _, s, _ in table) else 1


if __name__ == "__main__":
    sys.exit(main())
