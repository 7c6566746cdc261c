"""The quickstart's presets: the sizes and recipe of each run (``smoke``, ``default``, ``code``, ``real``), the
library's training configuration of each training stage (:func:`base_train_config`, :func:`second_pass_train_config`,
:func:`jf_train_config`: every derived value -- min lr, warmup, weight decay, save and log intervals -- is computed
there), the recipe knobs its command line may change, and the work directory's record of them (``preset.json``)."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from pathlib import Path

from megatron_jf import cli
from megatron_jf.training.config import RuntimeConfig, TrainConfig

#: what L_AR trains on (``Preset.ar_target``)
AR_TARGETS = ("self", "ground_truth", "both")
#: Anchor-term text made for model B (``Pipeline.anchor_tokens``): 176 steps x 4 rows x 256 tokens is 0.18 M.
ANCHOR_TOKENS = 2_000_000
STAGES = ("corpus", "base", "prompts", "traj1", "jf1", "traj2", "jf2", "report")
#: ``--until STAGE``: the last pipeline stage to run (every command that runs the pipeline offers this definition)
UNTIL = cli.Option("until", ("--until",), {"default": None, "choices": STAGES, "help": "stop after this stage"})


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
    # MBPP: megatron_jf/data/sources/code_prompts.py)
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
    # math domain (corpus="gsm_symbolic", recipes/quickstart/math_domain.py): problem counts, templates held out
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
    # recipes/quickstart/math_domain.py), one Jacobi Forcing round at n=16 on thousands of the base model's own
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


#: The "type" of a :data:`RECIPE` knob that is the same concept as ``pretrain_jf.py``'s flag of the same name: the
#: recipe's flag is that flag's definition (the ``TrainConfig`` field: its spelling, type and choices), with the
#: recipe's help and no default (the preset's value).
SAME_AS_PRETRAIN = "pretrain_jf.py"

#: The recipe knobs: preset field -> (command-line flag, type or choices or :data:`SAME_AS_PRETRAIN`, help). Each is
#: recorded in ``preset.json``. A knob with its own meaning has its own ``dest`` (the preset field): ``--lr`` is the
#: JF rounds' peak lr (``jf_lr``), not pretraining's.
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
    "anchor_weight": ("--anchor-weight", SAME_AS_PRETRAIN, "weight of the real-text anchor term (next-token CE on "
                      "stdlib train-split text; 0: off; round 2: --jf2-anchor-weight when given)"),
    "precision": ("--precision", SAME_AS_PRETRAIN, "auto: bf16 training where the CPU has native bf16, "
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


# ----------------------------------------------------------------------------- the training stages' configurations
#: AdamW weight decay of model A's pretraining (the JF rounds keep pretrain_jf.py's default, 0.01).
PRETRAIN_WEIGHT_DECAY = 0.1


def _g(x: float) -> float:
    """``x`` as the stages have always handed floats to ``pretrain_jf.py``: ``%g``, six significant digits
    (``3e-3 / 10`` is 0.0003, not 0.00030000000000000003)."""
    return float(f"{x:g}")


def train_precision(preset: Preset) -> str:
    """``pretrain_jf.py --precision`` of the training stages: ``bf16`` for ``precision="bf16"``, and for ``"auto"``
    on a CPU with native bf16; else pretrain_jf.py's own default (``auto``: fp32 on CPU)."""
    if preset.precision == "auto":
        from megatron_jf.precision import cpu_bf16_supported

        bf16 = cpu_bf16_supported()
    else:
        bf16 = preset.precision == "bf16"
    return "bf16" if bf16 else RuntimeConfig.precision


def warmup_steps(steps: int) -> int:
    """Linear-warmup steps of a quickstart training run: a twentieth of its steps, at least one."""
    return max(1, steps // 20)


def _pretrain(preset: Preset, out: Path, **kw) -> TrainConfig:
    """The settings both pretraining passes share: next-token training on the corpus token stream, held-out
    validation, weight decay :data:`PRETRAIN_WEIGHT_DECAY`."""
    p = preset
    return TrainConfig.from_flat(
        objective="ar", precision=train_precision(p), tokenizer=str(out / "tokenizer"),
        data=[str(out / "tokens_train.npy")], valid_data=[str(out / "tokens_heldout.npy")], seq_length=p.pretrain_seq,
        micro_batch_size=p.pretrain_mbs, weight_decay=PRETRAIN_WEIGHT_DECAY, threads=p.threads, **kw)


def base_train_config(preset: Preset, out: Path, hf_config: Path) -> TrainConfig:
    """Model A's (first) pretraining pass from scratch (architecture: the ``hf_config`` directory): peak lr
    ``pretrain_lr`` cosine to a tenth of it, 4 checkpoints into ``OUT/base`` (``OUT/base_pass1`` when a second pass
    follows), 20 log lines into ``OUT/base_log.jsonl``."""
    p, steps = preset, preset.pretrain_steps
    return _pretrain(p, out, hf_config=str(hf_config), train_steps=steps, lr=_g(p.pretrain_lr),
                     min_lr=_g(p.pretrain_lr / 10), warmup_steps=warmup_steps(steps),
                     save=str(out / ("base_pass1" if p.pretrain_second_pass_steps else "base")),
                     save_interval=max(10, steps // 4), log_interval=max(1, steps // 20),
                     log_file=str(out / "base_log.jsonl"))


def second_pass_train_config(preset: Preset, out: Path) -> TrainConfig | None:
    """Model A's second pretraining pass (``pretrain_second_pass_steps``; None: none): from the first pass's weights
    (``--load``: a new optimizer, the data order from its start) at lr ``pretrain_lr / 10`` cosine to
    ``pretrain_lr / 100`` after one warmup step, 2 checkpoints into ``OUT/base``."""
    p, steps = preset, preset.pretrain_second_pass_steps
    if not steps:
        return None
    return _pretrain(p, out, load=str(out / "base_pass1"), train_steps=steps, lr=_g(p.pretrain_lr / 10),
                     min_lr=_g(p.pretrain_lr / 100), warmup_steps=1, save=str(out / "base"),
                     save_interval=max(10, steps // 2), log_interval=max(1, steps // 10),
                     log_file=str(out / "base_pass2_log.jsonl"))


def jf_round(preset: Preset, stage: str) -> tuple[str, str, int, int, int]:
    """``(initial checkpoint, trajectory stage, block size n, window w, steps)`` of JF round ``stage`` (``jf1``:
    from the base on ``traj1`` at n1/w1; ``jf2``: from round 1 on ``traj2`` at n2/w2)."""
    if stage == "jf1":
        return "base", "traj1", preset.n1, preset.w1, preset.jf1_steps
    if stage == "jf2":
        return "jf1", "traj2", preset.n2, preset.w2, preset.jf2_steps
    raise ValueError(f"unknown JF round {stage!r}; expected jf1 or jf2")


def jf_train_config(preset: Preset, stage: str, out: Path) -> TrainConfig:
    """JF round ``stage`` (:func:`jf_round`; the round's lr / AR weight / anchor weight:
    :meth:`Preset.round_recipe`): cosine from the peak lr to ``jf_min_lr_ratio`` of it, ``jf_saves`` checkpoints
    into ``OUT/<stage>``, 20 log lines into ``OUT/<stage>_log.jsonl``. The AR target (:data:`AR_TARGETS`) decides
    the anchor rows: ``ground_truth`` / ``both`` train L_AR on the ground-truth answers (``OUT/tokens_gt_train.npy``)
    as anchor rows at ``jf_gt_weight`` (default: the AR weight; ``ground_truth`` moves the clean blocks' AR weight
    there), ``self`` with an anchor weight > 0 adds corpus text rows (``OUT/tokens_train.npy``).

    Raises:
        ValueError: an unknown AR target, or the corpus anchor together with ground-truth rows.
    """
    p = preset
    init, data, n, w, steps = jf_round(p, stage)
    lr, ar_weight, anchor_weight = p.round_recipe(stage)
    if p.ar_target not in AR_TARGETS:
        raise ValueError(f"ar_target must be one of {', '.join(AR_TARGETS)}, got {p.ar_target!r}")
    anchor: dict = {}
    if p.ar_target in ("ground_truth", "both"):  # L_AR on ground-truth answers (too)
        if anchor_weight > 0:
            raise ValueError(f"ar_target={p.ar_target!r} trains L_AR through the anchor rows: the corpus anchor "
                             "(anchor weight > 0) cannot be used with it")
        gt_weight = ar_weight if p.jf_gt_weight is None else p.jf_gt_weight
        anchor = dict(anchor_data=[str(out / "tokens_gt_train.npy")], anchor_weight=_g(gt_weight))
        if p.ar_target == "ground_truth":
            ar_weight = 0.0
    elif anchor_weight > 0:
        anchor = dict(anchor_data=[str(out / "tokens_train.npy")], anchor_weight=_g(anchor_weight))
    if anchor:
        anchor.update(anchor_seq_length=p.pretrain_seq, anchor_micro_batch_size=p.anchor_mbs)
    if p.jf_seed is not None:
        anchor["seed"] = p.jf_seed
    return TrainConfig.from_flat(
        objective="jf", precision=train_precision(p), load=str(out / init), data=[str(out / data)],
        consistency_positions=p.consistency_positions, consistency_loss=p.jf_consistency_loss,
        resample_noise_per_epoch=p.resample_noise, group_by_length=p.group_by_length, block_size=n, window_size=w,
        micro_batch_size=p.jf_mbs, train_steps=steps, lr=_g(lr), min_lr=_g(lr * p.jf_min_lr_ratio),
        warmup_steps=warmup_steps(steps), ar_weight=_g(ar_weight), pc_weight=_g(p.jf_pc_weight),
        save=str(out / stage), save_interval=max(5, steps // p.jf_saves), log_interval=max(1, steps // 20),
        threads=p.threads, log_file=str(out / f"{stage}_log.jsonl"), **anchor)
