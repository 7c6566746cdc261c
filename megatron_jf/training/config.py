"""Training configuration: every ``pretrain_jf.py`` option, its command line, and the LR schedule.

* :class:`TrainConfig` holds every knob of a run, grouped by concern (no global mutable arguments). Each field's
  docstring is its ``--help``: the command line is generated from the dataclass (:func:`build_parser`, as
  Megatron-LM's ``ArgumentGroupFactory``), so help and documentation cannot diverge.
* :func:`build_parser` / :func:`parse_config` are the command line (Megatron-LM flag names where the concept
  matches, e.g. ``--tensor-model-parallel-size`` for ``--tp``, and vLLM's ``--tensor-parallel-size``).
* :func:`lr_at` is the learning rate of a step (linear warmup, then cosine decay).

Nothing here imports torch: ``pretrain_jf.py --help`` and argument errors answer before it is loaded.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass

from megatron_jf import cli
from megatron_jf.config_fields import cli_field

__all__ = ["TrainConfig", "build_parser", "parse_config", "effective_seq_length", "lr_at"]

OBJECTIVES = ("jf", "ar")
#: ``flex`` (FlexAttention) is not offered: on CPU it is slower than SDPA with a dense mask, and the GPU path is
#: ``packed`` (TE varlen attention); see :mod:`megatron_jf.training.attention_paths`.
ATTENTION_PATHS = ("two_stream", "dense", "packed")
MASKS = ("nc", "nc_ic", "clean")
NOISE_SCHEDULES = ("progressive", "reverse", "random")
CONSISTENCY_POSITIONS = ("all", "from_first_diff")
#: The consistency losses (:class:`~megatron_jf.training.losses.LossConfig`): KL (paper Eq. 8), the official
#: code's soft cross-entropy, CE on the fixed-point tokens.
CONSISTENCY_LOSSES = ("kl", "soft_ce", "hard")
#: How L_pc is normalised: the paper's per-block mean then 1/N over blocks, or the official code's.
PC_NORMALIZATIONS = ("paper", "reference")
PRECISIONS = ("auto", "fp32", "bf16")
TRANSFORMER_IMPLS = ("auto", "local", "transformer_engine")
RECOMPUTE_GRANULARITIES = ("full", "selective")
RECOMPUTE_METHODS = ("uniform", "block")
#: megatron-core ``recompute_modules`` that apply to a dense (non-MoE, non-MLA) GPT layer.
RECOMPUTE_MODULES = ("core_attn", "mlp", "layernorm")

@dataclass(frozen=True)
class LossConfig:
    """Loss hyper-parameters (the sources of the defaults: :mod:`megatron_jf.training.losses`).

    Attributes:
        consistency_loss: ``"kl"`` | ``"soft_ce"`` | ``"hard"``.
        temperature: softmax temperature ``tau > 0`` for ``"kl"``/``"soft_ce"``.
        pc_weight: weight of L_pc (>= 0).
        ar_weight: weight ``w`` of L_AR (>= 0).
        pc_normalization: ``"paper"`` | ``"reference"``.
        anchor_weight: weight ``lambda`` of the anchor term L_anchor (>= 0; 0 = off).

    Raises:
        ValueError: unknown loss kind or normalisation, non-positive temperature, negative weights.
    """

    consistency_loss: str = "kl"
    temperature: float = 1.0
    pc_weight: float = 1.0
    ar_weight: float = 1.0
    pc_normalization: str = "paper"
    anchor_weight: float = 0.0

    def __post_init__(self):
        if self.consistency_loss not in CONSISTENCY_LOSSES:
            raise ValueError(f"unknown consistency loss {self.consistency_loss!r}; expected one of {CONSISTENCY_LOSSES}")
        if self.pc_normalization not in PC_NORMALIZATIONS:
            raise ValueError(f"unknown pc normalization {self.pc_normalization!r}; expected one of {PC_NORMALIZATIONS}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.pc_weight < 0 or self.ar_weight < 0 or self.anchor_weight < 0:
            raise ValueError(f"loss weights must be >= 0, got pc_weight={self.pc_weight}, ar_weight={self.ar_weight}, "
                             f"anchor_weight={self.anchor_weight}")



#: ``(first field, title)`` of each ``--help`` group, in declaration order.
GROUPS = (("tp", "parallelism and runtime"), ("recompute_granularity", "activation recomputation (Megatron-LM flags)"),
          ("hf_config", "model"), ("objective", "data"), ("attention_path", "Jacobi Forcing objective"),
          ("micro_batch_size", "optimisation"), ("save", "checkpointing"), ("log_interval", "logging and validation"))


@dataclass
class TrainConfig:
    """Every knob of a training run, grouped by concern (the command line mirrors the groups).

    Defaults marked *official code* come from the official Jacobi Forcing training scripts (AdamW betas
    (0.9, 0.95), eps 1e-8, effective weight decay 0.01, cosine schedule with 3% warmup, window 16); the paper
    (Sec. 4.1) gives lr 1e-6 and batch size 4.
    """

    # --- parallelism / runtime
    tp: int = cli_field(1, *cli.TP_FLAGS[1:])
    """Tensor-parallel size."""
    pp: int = cli_field(1, *cli.PP_FLAGS[1:])
    """Pipeline-parallel size (data-parallel size = world / (tp * pp))."""
    use_megatron_optimizer: bool | None = None
    """megatron DDP + optimizer (GPU path); default: on iff CUDA is available."""
    use_distributed_optimizer: bool = False
    """Shard optimizer state over DP (megatron DistributedOptimizer; GPU path)."""
    overlap_grad_reduce: bool = False
    """megatron DDP: reduce (reduce-scatter with the distributed optimizer) gradient buckets during the
    backward of the last microbatch instead of after it (GPU path)."""
    overlap_param_gather: bool = False
    """megatron DDP: all-gather the updated parameter shards bucket by bucket during the next forward instead
    of at the end of the optimizer step (GPU path; needs --use-distributed-optimizer and --overlap-grad-reduce)."""
    ddp_bucket_size: int | None = None
    """megatron DDP gradient bucket size in parameters; default: megatron-core's, max(4e7, 1e6 x dp)."""
    sequence_parallel: bool = False
    """Megatron-LM's sequence parallelism (needs --tp > 1): norms and residuals run on ``S / tp`` positions per TP
    rank (activations between the TP regions split over the TP group); loss rows are gathered from the shards."""
    precision: str = cli_field("auto", choices=PRECISIONS, const_aliases={"--bf16": "bf16"})
    """``auto`` (bf16 on GPU with the megatron optimizer, else fp32) | ``fp32`` | ``bf16`` (GPU: bf16 weights, fp32
    main weights in megatron's optimizer; CPU: fp32 weights and AdamW state, bf16 autocast compute, needs a CPU
    with AVX-512 BF16 or AMX; :mod:`megatron_jf.precision`)."""
    threads: int | None = None
    """torch intra-op threads per process; default: torch's choice (OMP_NUM_THREADS, else one per core)."""
    seed: int = 1234
    """Seed of weight init (from scratch), data order and the random noise schedule."""
    transformer_impl: str = cli_field("auto", choices=TRANSFORMER_IMPLS)
    """Layer spec (Megatron-LM's ``--transformer-impl``): ``transformer_engine`` (fused norm + projections; needs TE
    and CUDA), ``local`` (megatron-core's own modules) or ``auto`` (TE where present)."""

    # --- activation recomputation (Megatron-LM's flags and meaning; megatron-core TransformerConfig fields)
    recompute_granularity: str | None = cli_field(None, choices=RECOMPUTE_GRANULARITIES)
    """``full``: keep only each recomputed chunk's input and rerun whole layers in the backward; ``selective``:
    rerun only --recompute-modules (core attention); default: off, everything is saved."""
    recompute_method: str | None = cli_field(None, choices=RECOMPUTE_METHODS)
    """``full`` only: ``uniform`` recomputes every layer in chunks of --recompute-num-layers; ``block`` the first
    --recompute-num-layers layers of each pipeline stage."""
    recompute_num_layers: int | None = None
    """``full`` only: layers per recomputed chunk (uniform) or recomputed layers per stage (block)."""
    recompute_modules: list[str] | None = cli_field(None, choices=RECOMPUTE_MODULES)
    """``selective`` only: submodules to rerun; default: megatron-core's, ``core_attn``."""

    # --- model
    hf_config: str | None = None
    """Directory with an HF ``config.json``: the architecture, for training from scratch."""
    load: str | None = None
    """Checkpoint to initialise the weights from (iteration 0; e.g. converted with tools/convert_hf.py)."""

    # --- data
    objective: str = cli_field("jf", choices=OBJECTIVES)
    """``jf``: Jacobi Forcing on trajectory shards; ``ar``: next-token training on token data."""
    data: list[str] = cli_field(dataclasses.MISSING, "--data-path", default_factory=list, required=True)
    """Training data: shard directories/globs/manifests (jf) or token files (ar)."""
    valid_data: list[str] | None = cli_field(None, "--valid-data-path")
    """Held-out data in the same format."""
    block_size: int | None = None
    """Block size n the shards must have (required for --objective jf)."""
    window_size: int = 16
    """Noise window w of the progressive schedule (paper Eq. 7; official code: 16 for n=32); also the NC-IC
    window."""
    noise_schedule: str = cli_field("progressive", choices=NOISE_SCHEDULES)
    """Noise schedule within a window: ``progressive`` (paper Eq. 7), ``reverse`` or ``random``."""
    consistency_positions: str = cli_field("all", choices=CONSISTENCY_POSITIONS)
    """Which (block, offset) pairs carry L_pc: ``all``, or ``from_first_diff`` (official code: offsets from the
    first noisy token)."""
    resample_noise_per_epoch: bool = False
    """Re-draw each record's noisy states every epoch (progressive / reverse: the ramp shifted per record and epoch;
    random: a new draw; the first epoch is the schedule as written). Off: every epoch packs the same state per
    block (one epoch, as the paper trains, is the same either way)."""
    group_by_length: bool = False
    """Fill each micro-batch with training samples of similar length (Hugging Face's ``group_by_length``): this
    rank's shuffled order is cut into groups of 50 micro-batches, each sorted by length and its micro-batches shuffled
    (:mod:`megatron_jf.data.dataset`, point 3). The ``two_stream`` and ``dense`` paths pad a micro-batch's rows to
    its longest; on trajectories whose lengths vary (EOS anywhere in the response) a third of the rows' tokens can
    be padding (the default quickstart: 1.56x the real tokens; JF step 0.69 -> 0.55 s). Same samples per epoch,
    exact resume; the step-to-step loss gets noisier (a step's rows are all long or all short)."""
    seq_length: int | None = None
    """Model-input row length bound. jf: maximum (two-stream ``P+R``, dense ``P+2R``), padded to it when --pp > 1
    with --no-variable-seq-lengths; default: the model context (dense path: twice it). ar: tokens per sample
    (required)."""
    variable_seq_lengths: bool = True
    """--pp > 1: each microbatch keeps its own row length (megatron-core ``variable_seq_lengths``: the pipeline
    stages exchange activation shapes before each send); --no-variable-seq-lengths pads every row to
    --seq-length."""
    tokenizer: str | None = cli_field(None, *cli.TOKENIZER_FLAGS[1:])
    """Tokenizer directory (ar objective with JSONL text, anchor JSONL)."""
    num_workers: int = 0
    """DataLoader worker processes per rank (0: read in the training process)."""

    # --- JF objective
    attention_path: str = cli_field("two_stream", choices=ATTENTION_PATHS)
    """How the noisy and clean streams are attended: ``two_stream`` (exact for --mask nc, stock causal kernels),
    ``dense`` (an explicit mask, any --mask) or ``packed`` (both streams of every sample in one THD row, TE varlen
    attention on GPU)."""
    mask: str = cli_field("nc", choices=MASKS)
    """Attention mask of the noisy stream: ``nc`` (paper), ``nc_ic`` (paper Table 5) or ``clean`` (CLLM)."""
    consistency_loss: str = cli_field("kl", choices=CONSISTENCY_LOSSES)
    """``kl`` (paper Eq. 8), ``soft_ce`` (official code) or ``hard`` (CE on the fixed-point tokens)."""
    kl_temperature: float = 1.0
    """Softmax temperature of the consistency loss (official code's effective value: 1)."""
    pc_weight: float = 1.0
    """Weight of L_pc."""
    ar_weight: float = 1.0
    """Weight of L_AR (paper Eq. 9: L = L_pc + w L_AR, the same symbol as the window w of Eq. 7; official code:
    10)."""
    pc_normalization: str = cli_field("paper", choices=PC_NORMALIZATIONS)
    """``paper``: per-block mean, then 1/N over blocks; ``reference``: the official code's mean over positions
    / N."""
    loss_chunk_size: int = 1024
    """Loss rows per chunk of the fused output layer + JF loss (peak temporaries O(chunk x vocab/tp),
    :func:`megatron_jf.training.losses.loss_temporary_bytes`); 0: all rows in one chunk."""
    anchor_data: list[str] | None = cli_field(None, metavar="PATH")
    """Real-text token files (``.npy``/``.bin``/``.jsonl`` as --objective ar; JSONL needs --tokenizer) for the
    anchor term L_anchor (next-token CE on real text, trained in the same steps)."""
    anchor_weight: float = 0.0
    """Weight lambda of L_anchor (0: off; > 0 needs --anchor-data)."""
    anchor_seq_length: int = 256
    """Tokens per anchor row (<= the model context; <= --seq-length when rows are padded to it)."""
    anchor_micro_batch_size: int | None = None
    """Anchor text rows per JF microbatch; default: --micro-batch-size."""

    # --- optimisation
    micro_batch_size: int = 1
    """Samples per microbatch per data-parallel rank (official code: 1)."""
    global_batch_size: int | None = None
    """Samples per optimizer step over all data-parallel ranks, a multiple of micro-batch-size x dp; default:
    micro-batch-size x dp."""
    lr: float = 1e-5
    """Peak learning rate (paper Sec. 4.1: 1e-6; 1e-5 is the official code's n=32 script)."""
    min_lr: float = 0.0
    """Final learning rate of the cosine decay (official code: 0)."""
    warmup_steps: int | None = cli_field(None, "--lr-warmup-iters")
    """Linear warmup steps; default: 3% of --train-steps (official code; the paper states none)."""
    train_steps: int = cli_field(0, "--train-iters", required=True)
    """Optimizer steps to train."""
    weight_decay: float = 0.01
    """AdamW decoupled weight decay on matrices, none on biases and norms (official code's effective value)."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.95
    """AdamW beta2."""
    adam_eps: float = 1e-8
    """AdamW epsilon."""
    clip_grad: float = 1.0
    """Global gradient-norm clip, 0 disables (official code: HF Trainer's 1.0)."""

    # --- checkpointing
    save: str | None = None
    """Checkpoint directory: saved every --save-interval steps and at the end; a run resumes from its latest
    checkpoint."""
    save_interval: int | None = None
    """Save every this many steps; default: only at the end."""
    dist_ckpt_optim_fully_reshardable: bool = False
    """megatron distributed optimizer: save its state in megatron-core's ``fully_reshardable`` format (gathered on
    data-parallel rank 0 at save: costs memory there; a resume may change TP/PP/DP) instead of Megatron-LM's usual
    ``dp_reshardable`` (each rank writes its own buckets; a resume keeps TP and PP). GPU path."""
    keep_last: int | None = None
    """Keep only this many newest checkpoints; default: keep all."""
    exit_interval: int | None = None
    """Save and stop at a multiple of this iteration; default: never."""

    # --- logging / validation
    log_interval: int = 10
    """Print metrics every this many steps."""
    eval_interval: int | None = None
    """Validate every this many steps (needs --valid-data); default: never."""
    eval_iters: int | None = None
    """Validation microbatches per evaluation; default: the whole validation set."""
    log_file: str | None = None
    """JSONL metrics file: one line per log/eval event, appended on rank 0."""
    tensorboard_dir: str | None = None
    """TensorBoard event directory (only if ``tensorboard`` is installed)."""
    progress: bool = True
    """Progress bar on rank 0."""

    # ------------------------------------------------------------------------------------------
    def loss_config(self) -> LossConfig:
        """The :class:`LossConfig` of the loss options (validates them)."""
        return LossConfig(consistency_loss=self.consistency_loss, temperature=self.kl_temperature,
                          pc_weight=self.pc_weight, ar_weight=self.ar_weight,
                          pc_normalization=self.pc_normalization, anchor_weight=self.anchor_weight)

    def validate(self) -> "TrainConfig":
        """Check values that do not need the data or the model.

        Raises:
            ValueError: naming the offending option.
        """
        def need(cond, msg):
            if not cond:
                raise ValueError(msg)

        need(self.tp >= 1 and self.pp >= 1, f"--tp and --pp must be >= 1, got {self.tp}, {self.pp}")
        need(self.objective in OBJECTIVES, f"--objective must be one of {OBJECTIVES}")
        if self.transformer_impl == "transformer_engine":
            from megatron_jf import platform

            need(platform.HAVE_TE and platform.HAVE_CUDA,
                 "--transformer-impl transformer_engine needs Transformer Engine and a CUDA device")
        need(bool(self.data), "--data is required")
        need(self.train_steps >= 1, f"--train-steps must be >= 1, got {self.train_steps}")
        need(self.micro_batch_size >= 1, f"--micro-batch-size must be >= 1, got {self.micro_batch_size}")
        need(self.global_batch_size is None or self.global_batch_size >= 1, "--global-batch-size must be >= 1")
        need(self.lr > 0 and 0 <= self.min_lr <= self.lr, f"need 0 <= --min-lr <= --lr and --lr > 0 "
             f"(got lr={self.lr}, min_lr={self.min_lr})")
        need(self.warmup_steps is None or 0 <= self.warmup_steps <= self.train_steps,
             f"--warmup-steps must be in [0, --train-steps], got {self.warmup_steps}")
        need(self.weight_decay >= 0 and self.clip_grad >= 0, "--weight-decay and --clip-grad must be >= 0")
        need(self.precision in PRECISIONS, f"--precision must be one of {PRECISIONS}")
        need(self.window_size >= 1, f"--window-size must be >= 1, got {self.window_size}")
        need(self.noise_schedule in NOISE_SCHEDULES, f"--noise-schedule must be one of {NOISE_SCHEDULES}")
        need(self.consistency_positions in CONSISTENCY_POSITIONS,
             f"--consistency-positions must be one of {CONSISTENCY_POSITIONS}")
        need(self.attention_path in ATTENTION_PATHS, f"--attention-path must be one of {ATTENTION_PATHS}")
        need(self.mask in MASKS, f"--mask must be one of {MASKS}")
        need(self.num_workers >= 0, "--num-workers must be >= 0")
        self._validate_recompute(need)
        need(self.loss_chunk_size >= 0, f"--loss-chunk-size must be >= 0, got {self.loss_chunk_size}")
        need(not self.sequence_parallel or self.tp > 1, "--sequence-parallel needs --tp > 1 (as in Megatron-LM)")
        need(not (self.sequence_parallel and self.anchor_data and self.anchor_seq_length % self.tp),
             f"--sequence-parallel splits rows over --tp {self.tp}: --anchor-seq-length {self.anchor_seq_length} "
             "must be a multiple of it")
        need(not self.overlap_param_gather or (self.use_distributed_optimizer and self.overlap_grad_reduce),
             "--overlap-param-gather needs --use-distributed-optimizer and --overlap-grad-reduce (as in Megatron-LM)")
        need(self.ddp_bucket_size is None or self.ddp_bucket_size >= 1, "--ddp-bucket-size must be >= 1")
        need(self.log_interval >= 1, "--log-interval must be >= 1")
        for name in ("save_interval", "eval_interval", "exit_interval", "keep_last", "eval_iters", "threads"):
            v = getattr(self, name)
            need(v is None or v >= 1, f"--{name.replace('_', '-')} must be >= 1, got {v}")
        need(self.save_interval is None or self.save is not None, "--save-interval needs --save")
        need(self.eval_interval is None or self.valid_data, "--eval-interval needs --valid-data")
        need(self.seq_length is None or self.seq_length >= 1, "--seq-length must be >= 1")
        need(self.anchor_weight >= 0, f"--anchor-weight must be >= 0, got {self.anchor_weight}")
        need(not (self.anchor_data and self.anchor_weight == 0),
             "--anchor-data is given but --anchor-weight is 0 (the anchor term would be computed and ignored); "
             "set --anchor-weight > 0 or drop --anchor-data")
        need(not (self.anchor_weight > 0 and not self.anchor_data), "--anchor-weight > 0 needs --anchor-data")
        need(self.anchor_seq_length >= 1, f"--anchor-seq-length must be >= 1, got {self.anchor_seq_length}")
        need(self.anchor_micro_batch_size is None or self.anchor_micro_batch_size >= 1,
             f"--anchor-micro-batch-size must be >= 1, got {self.anchor_micro_batch_size}")
        need(not (self.anchor_data and self.objective != "jf"), "--anchor-data needs --objective jf")
        if self.objective == "jf":
            need(self.block_size is not None and self.block_size >= 1,
                 "--block-size is required for --objective jf (the block size n of the trajectory shards)")
            need(not (self.attention_path == "two_stream" and self.mask != "nc"),
                 f"--attention-path two_stream is exact only for --mask nc (got --mask {self.mask}); "
                 "use --attention-path dense")
            need(not (self.attention_path == "packed" and self.pp > 1),
                 "--attention-path packed (one THD row per microbatch) needs --pp 1; use two_stream or dense with "
                 "--pp > 1")
            need(not (self.attention_path == "packed" and self.anchor_data),
                 "--attention-path packed does not carry --anchor-data rows yet; use two_stream or dense")
            self.loss_config()  # validates the loss options
        else:
            need(self.seq_length is not None, "--seq-length is required for --objective ar")
        need(self.hf_config or self.load or self.save,
             "no model: give --hf-config (from scratch), --load (a checkpoint) or --save with a checkpoint to resume")
        return self

    def _validate_recompute(self, need) -> None:
        g, m, n = self.recompute_granularity, self.recompute_method, self.recompute_num_layers
        need(g is None or g in RECOMPUTE_GRANULARITIES,
             f"--recompute-granularity must be one of {RECOMPUTE_GRANULARITIES}, got {g!r}")
        need(m is None or m in RECOMPUTE_METHODS, f"--recompute-method must be one of {RECOMPUTE_METHODS}, got {m!r}")
        need(g is not None or (m is None and n is None and self.recompute_modules is None),
             "--recompute-method/--recompute-num-layers/--recompute-modules need --recompute-granularity")
        if g == "full":
            need(m is not None and n is not None,
                 "--recompute-granularity full needs --recompute-method {uniform,block} and --recompute-num-layers N")
            need(n >= 1, f"--recompute-num-layers must be >= 1, got {n}")
            need(self.recompute_modules is None, "--recompute-modules applies to --recompute-granularity selective")
        if g == "selective":
            need(n is None and m is None, "--recompute-method/--recompute-num-layers apply to "
                 "--recompute-granularity full (selective recomputes --recompute-modules in every layer)")
            bad = sorted(set(self.recompute_modules or ()) - set(RECOMPUTE_MODULES))
            need(not bad, f"--recompute-modules {bad} not supported (choose from {RECOMPUTE_MODULES})")

    def recompute_kwargs(self) -> dict:
        """The megatron-core ``TransformerConfig`` fields of the recomputation options ({} when off)."""
        if self.recompute_granularity is None:
            return {}
        kw = {"recompute_granularity": self.recompute_granularity, "recompute_method": self.recompute_method,
              "recompute_num_layers": self.recompute_num_layers}
        if self.recompute_modules is not None:
            kw["recompute_modules"] = list(self.recompute_modules)
        return kw

    @property
    def pad_rows_to_seq_length(self) -> bool:
        """Whether every model-input row is padded to ``seq_length`` (pp > 1 with fixed pipeline shapes)."""
        return self.pp > 1 and not self.variable_seq_lengths

    @property
    def anchor_on(self) -> bool:
        """Whether JF microbatches carry anchor rows."""
        return bool(self.anchor_data) and self.anchor_weight > 0

    @property
    def anchor_mbs(self) -> int:
        """Anchor rows per microbatch (0 when the anchor term is off)."""
        if not self.anchor_on:
            return 0
        return self.anchor_micro_batch_size or self.micro_batch_size

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def build_parser() -> argparse.ArgumentParser:
    """The ``pretrain_jf.py`` command line, generated from :class:`TrainConfig` (one flag per field, help from the
    field's docstring, grouped by :data:`GROUPS`; unknown options are an argparse error).

    Megatron-LM's flag names are accepted where the concept is the same (``--tensor-model-parallel-size``
    = ``--tp``, ``--pipeline-model-parallel-size`` = ``--pp``, ``--train-iters`` = ``--train-steps``,
    ``--lr-warmup-iters`` = ``--warmup-steps``, ``--data-path`` = ``--data``, ``--valid-data-path`` =
    ``--valid-data``, ``--tokenizer-model`` = ``--tokenizer``, ``--bf16`` = ``--precision bf16``), and vLLM's
    ``--tensor-parallel-size`` / ``--pipeline-parallel-size``; the shared names (``--micro-batch-size``, ``--lr``,
    ``--clip-grad``, ``--save-interval`` ...) mean what they mean there. Every option's help shows its default.
    """
    p = cli.parser("Jacobi Forcing training on megatron-core (paper arXiv 2512.14681, Sec. 3.1). Megatron-LM flag "
                   "names are accepted where the concept matches.", prog="pretrain_jf.py")
    cli.add_dataclass_arguments(p, TrainConfig, groups=GROUPS)
    return p


def parse_config(argv: list[str] | None = None) -> TrainConfig:
    """Parse the command line into a validated :class:`TrainConfig`.

    Raises:
        SystemExit: unknown options or malformed values (argparse).
        ValueError: inconsistent values (see :meth:`TrainConfig.validate`).
    """
    ns = build_parser().parse_args(argv)
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    return TrainConfig(**{k: v for k, v in vars(ns).items() if k in names}).validate()


def effective_seq_length(cfg: TrainConfig, max_position: int) -> int:
    """The model-input row length bound (and the padded length under pipeline parallelism with fixed shapes)."""
    if cfg.seq_length is not None:
        return cfg.seq_length
    if cfg.objective == "jf" and (cfg.attention_path == "dense"
                                  or (cfg.attention_path == "packed" and cfg.mask != "nc")):
        return 2 * max_position  # one sample = prompt + noisy + clean
    return max_position


def lr_at(iteration: int, cfg: TrainConfig) -> float:
    """Learning rate of optimizer step ``iteration`` (1-based): linear warmup from 0 to ``lr`` over
    ``warmup_steps``, then cosine decay to ``min_lr`` at ``train_steps``."""
    warm = _warmup(cfg)
    if warm and iteration <= warm:
        return cfg.lr * iteration / warm
    span = max(1, cfg.train_steps - warm)
    progress = min(1.0, max(0.0, (iteration - warm) / span))
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


def _warmup(cfg: TrainConfig) -> int:
    return cfg.warmup_steps if cfg.warmup_steps is not None else math.ceil(0.03 * cfg.train_steps)

