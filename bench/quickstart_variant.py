#!/usr/bin/env python
"""Quickstart preset variants: what a change to the code-domain model's corpus, size or pretraining buys (issue 25
item 7; that model was the default model A until 2026-12, now ``--code``).

Runs the quickstart pipeline with the code preset changed by ``key=value`` pairs (any :class:`Preset` field) up
to ``--until`` (resumable, like the pipeline), then measures the checkpoints named by ``--measure`` the way the report
does: held-out NLL (nats/token), greedy distinct-2 of the evaluation prompts' continuations (mean per completion;
below 0.1 the report flags the model degenerate), Jacobi TPF at n=32 with its output checked equal to greedy AR, and
how many of the round-1 trajectories the repetition filter would keep (``--real``'s filter; the default keeps all)::

    python -m bench.quickstart_variant --out runs/variant-v1 --until prompts \\
        corpus=packages:httpx,uvicorn,tqdm,webdataset,prometheus_client,einops,rich,fastapi,gguf \\
        vocab_size=2048 pretrain_steps=480 pretrain_lr=0.003
    python -m bench.quickstart_variant --out runs/quickstart-code --until prompts   # the code preset as it is

Prints one JSON line per measured checkpoint (``RESULT {...}``) and writes them to ``OUT/variant.json``. Measured
here: ``docs/results.md`` ("Model A: base-model variants").
"""
from __future__ import annotations

import collections
import glob
import json
import sys
import time
from dataclasses import fields, replace
from pathlib import Path


def _parse_overrides(pairs: list[str]) -> dict:
    from recipes.quickstart.presets import PRESETS, Preset

    types = {f.name: type(getattr(PRESETS["code"], f.name)) for f in fields(Preset)}
    types = {k: float if t is type(None) else t for k, t in types.items() if t in (int, float, str, bool, type(None))}
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or key not in types:
            raise SystemExit(f"error: {pair!r}: give key=value with a scalar preset field "
                             f"({', '.join(sorted(types))})")
        out[key] = (value.lower() in ("1", "true", "yes")) if types[key] is bool else types[key](value)
    return out


def filter_kept(out: Path, stage: str = "traj1") -> dict:
    """``{"kept": k, "degenerate/<reason>": m, ...}`` of the repetition filter over a trajectory stage's records."""
    from megatron_jf.data.collect import filter_category, filter_reason
    from megatron_jf.data.shards import iter_shard
    from megatron_jf.tokenizer import load_tokenizer

    eos = frozenset(load_tokenizer(out / "tokenizer").eos_ids)
    counts = collections.Counter()
    for shard in sorted(glob.glob(str(out / stage / "*.tar"))):
        for rec in iter_shard(shard):
            reason = filter_reason(rec, eos)
            counts[filter_category(reason) if reason else "kept"] += 1
    return dict(counts)


def measure(out: Path, ckpt: str, response_tokens: int, nll_chunks: int) -> dict:
    """Held-out NLL, greedy distinct-2 and Jacobi TPF (n=32, output == AR asserted) of ``OUT/ckpt``."""
    import numpy as np

    from bench import common
    from megatron_jf.checkpointing import load_model
    from megatron_jf.decoding import PAPER, DecodeConfig
    from megatron_jf.eval.degenerate import degeneracy
    from megatron_jf.eval.speed import measure as measure_speed
    from megatron_jf.tokenizer import load_tokenizer
    from recipes.quickstart.report import heldout_nll

    eos = set(load_tokenizer(out / "tokenizer").eos_ids)
    prompts = [json.loads(line)["prompt_ids"] for line in open(out / "prompts_eval.jsonl")]
    model = load_model(str(out / ckpt))[0]
    nll, _ = heldout_nll(model, np.load(out / "tokens_heldout.npy"), nll_chunks)
    # measure() runs greedy AR first and checks the Jacobi output against it (LosslessError otherwise)
    speed = measure_speed(common.engine(model), prompts, {"jacobi": DecodeConfig("jacobi", block_size=32, **PAPER)},
                          max_new_tokens=response_tokens, eos_ids=eos, batch_size=len(prompts), label=ckpt)
    return {"checkpoint": ckpt, "nll": round(float(nll), 4),
            "distinct_2": round(degeneracy(speed.outputs)["distinct_2"], 4),
            "jacobi_tpf_n32": round(speed.methods["jacobi"].tpf, 3)}


def build_parser():
    """The command line (torch-free)."""
    from megatron_jf import cli

    from bench import common

    ap = common.parser(__doc__)
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="code-preset fields to change")
    cli.OUT.add(ap, required=True, metavar="DIR", help="work directory (resumable)")
    from recipes.quickstart.presets import UNTIL

    UNTIL.add(ap, default="prompts", help="last pipeline stage to run")
    ap.add_argument("--measure", default=None, help="comma-separated checkpoints to measure, e.g. base,jf1 (default: "
                                                    "base, plus jf1/jf2 when --until reaches them)")
    cli.THREADS.add(ap, default=1)
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    a = ap.parse_args(argv)
    from megatron_jf import parallel
    from megatron_jf.fileio import atomic_write_json
    from recipes.quickstart.pipeline import Pipeline
    from recipes.quickstart.presets import PRESETS, STAGES

    if a.until not in STAGES:
        raise SystemExit(f"error: --until {a.until!r}: one of {', '.join(STAGES)}")
    preset = replace(PRESETS["code"], threads=a.threads, **_parse_overrides(a.overrides))
    out = Path(a.out)
    t0 = time.time()
    Pipeline(out, preset).execute(a.until)
    parallel.initialize(1, 1)
    parallel.set_seed(0)
    done = STAGES[: STAGES.index(a.until) + 1]
    results = [{"variant": a.overrides, "pipeline_seconds": round(time.time() - t0)}]
    if "traj1" in done:
        results[0]["traj1_filter"] = filter_kept(out)
    for ck in a.measure.split(",") if a.measure else [c for c in ("base", "jf1", "jf2") if c in done]:
        results.append(measure(out, ck, preset.response_tokens, preset.nll_chunks))
    for r in results:
        print("RESULT", json.dumps(r), flush=True)
    atomic_write_json(out / "variant.json", results, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
