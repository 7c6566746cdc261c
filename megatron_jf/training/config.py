"""Training configuration: every ``pretrain_jf.py`` option, its command line, and the LR schedule.

* :class:`TrainConfig` holds every knob of a run (no global mutable arguments) in one part per concern, each a
  dataclass that checks itself: :class:`ParallelConfig`, :class:`RuntimeConfig`, :class:`RecomputeConfig`,
  :class:`ModelSource`, :class:`DataConfig`, :class:`JFObjective` (also the loss functions' configuration),
  :class:`OptimConfig`, :class:`CheckpointConfig`, :class:`LoggingConfig`. Each field's docstring is its
  ``--help``: the command line is generated from the parts, one argument group each (:func:`build_parser`, as
  Megatron-LM's ``ArgumentGroupFactory``), so help and documentation cannot diverge, and a field's allowed values
  are one tuple that both argparse and the part's check use (``cli_field(choices=...)``).
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
from megatron_jf.config_fields import check_choices, cli_field, part

__all__ = ["TrainConfig", "ParallelConfig", "RuntimeConfig", "RecomputeConfig", "ModelSource", "DataConfig",
           "JFObjective", "OptimConfig", "CheckpointConfig", "LoggingConfig", "build_parser", "parse_config",
           "config_from_args", "effective_seq_length", "lr_at"]

OBJECTIVES = ("jf", "ar")
#: ``flex`` (FlexAttention) is not offered: on CPU it is slower than SDPA with a dense mask, and the GPU path is
#: ``packed`` (TE varlen attention); see :mod:`megatron_jf.training.attention_paths`.
ATTENTION_PATHS = ("two_stream", "dense", "packed")
MASKS = ("nc", "nc_ic", "clean")
NOISE_SCHEDULES = ("progressive", "reverse", "random")
CONSISTENCY_POSITIONS = ("all", "from_first_diff")
#: The consistency losses (:attr:`JFObjective.consistency_loss`): KL (paper Eq. 8), the official
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

# ------------------------------------------------------------------------------------------ the parts
def _need(cond, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _at_least_one(obj, *names: str) -> None:
    for name in names:
        v = getattr(obj, name)
        _need(v is None or v >= 1, f"--{name.replace('_', '-')} must be >= 1, got {v}")


@dataclass
class ParallelConfig:
    """Model parallelism and megatron's DDP / distributed optimizer."""

    tp: int = cli_field(1, option="TP")
    """Tensor-parallel size."""
    pp: int = cli_field(1, option="PP")
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

    def validate(self) -> "ParallelConfig":
        """Raises ValueError naming the offending option."""
        _need(self.tp >= 1 and self.pp >= 1, f"--tp and --pp must be >= 1, got {self.tp}, {self.pp}")
        _need(not self.sequence_parallel or self.tp > 1, "--sequence-parallel needs --tp > 1 (as in Megatron-LM)")
        _need(not self.overlap_param_gather or (self.use_distributed_optimizer and self.overlap_grad_reduce),
              "--overlap-param-gather needs --use-distributed-optimizer and --overlap-grad-reduce (as in Megatron-LM)")
        _need(self.ddp_bucket_size is None or self.ddp_bucket_size >= 1, "--ddp-bucket-size must be >= 1")
        return self


@dataclass
class RuntimeConfig:
    """Precision, threads, seed and layer implementation of the run."""

    precision: str = cli_field("auto", choices=PRECISIONS, const_aliases={"--bf16": "bf16"})
    """``auto`` (bf16 on GPU with the megatron optimizer, else fp32) | ``fp32`` | ``bf16`` (GPU: bf16 weights, fp32
    main weights in megatron's optimizer; CPU: fp32 weights and AdamW state, bf16 autocast compute, needs a CPU
    with AVX-512 BF16 or AMX; :mod:`megatron_jf.precision`)."""
    threads: int | None = cli_field(None, option="THREADS")
    """torch intra-op threads per process; default: torch's choice (OMP_NUM_THREADS, else one per core)."""
    seed: int = cli_field(1234, option="SEED")
    """Seed of weight init (from scratch), data order and the random noise schedule."""
    transformer_impl: str = cli_field("auto", choices=TRANSFORMER_IMPLS)
    """Layer spec (Megatron-LM's ``--transformer-impl``): ``transformer_engine`` (fused norm + projections; needs TE
    and CUDA), ``local`` (megatron-core's own modules) or ``auto`` (TE where present)."""

    def validate(self) -> "RuntimeConfig":
        """Raises ValueError naming the offending option."""
        check_choices(self)
        _at_least_one(self, "threads")
        if self.transformer_impl == "transformer_engine":
            from megatron_jf import platform

            _need(platform.HAVE_TE and platform.HAVE_CUDA,
                  "--transformer-impl transformer_engine needs Transformer Engine and a CUDA device")
        return self


@dataclass
class RecomputeConfig:
    """Activation recomputation: Megatron-LM's flags and meaning (megatron-core ``TransformerConfig`` fields)."""

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

    def validate(self) -> "RecomputeConfig":
        """Raises ValueError naming the offending option."""
        g, m, n = self.recompute_granularity, self.recompute_method, self.recompute_num_layers
        _need(g is None or g in RECOMPUTE_GRANULARITIES,
              f"--recompute-granularity must be one of {RECOMPUTE_GRANULARITIES}, got {g!r}")
        _need(m is None or m in RECOMPUTE_METHODS, f"--recompute-method must be one of {RECOMPUTE_METHODS}, got {m!r}")
        _need(g is not None or (m is None and n is None and self.recompute_modules is None),
              "--recompute-method/--recompute-num-layers/--recompute-modules need --recompute-granularity")
        if g == "full":
            _need(m is not None and n is not None,
                  "--recompute-granularity full needs --recompute-method {uniform,block} and --recompute-num-layers N")
            _need(n >= 1, f"--recompute-num-layers must be >= 1, got {n}")
            _need(self.recompute_modules is None, "--recompute-modules applies to --recompute-granularity selective")
        if g == "selective":
            _need(n is None and m is None, "--recompute-method/--recompute-num-layers apply to "
                  "--recompute-granularity full (selective recomputes --recompute-modules in every layer)")
            bad = sorted(set(self.recompute_modules or ()) - set(RECOMPUTE_MODULES))
            _need(not bad, f"--recompute-modules {bad} not supported (choose from {RECOMPUTE_MODULES})")
        return self

    def kwargs(self) -> dict:
        """The megatron-core ``TransformerConfig`` fields of the recomputation options ({} when off)."""
        if self.recompute_granularity is None:
            return {}
        kw = {"recompute_granularity": self.recompute_granularity, "recompute_method": self.recompute_method,
              "recompute_num_layers": self.recompute_num_layers}
        if self.recompute_modules is not None:
            kw["recompute_modules"] = list(self.recompute_modules)
        return kw


@dataclass
class ModelSource:
    """Where the architecture and the initial weights come from."""

    hf_config: str | None = None
    """Directory with an HF ``config.json``: the architecture, for training from scratch."""
    load: str | None = cli_field(None, option="LOAD")
    """Checkpoint to initialise the weights from (iteration 0; e.g. converted with tools/convert_hf.py)."""


@dataclass
class DataConfig:
    """Training data: the objective's data format, the JF noise schedule over the trajectories, row lengths."""

    objective: str = cli_field("jf", choices=OBJECTIVES)
    """``jf``: Jacobi Forcing on trajectory shards; ``ar``: next-token training on token data."""
    data: list[str] = cli_field(dataclasses.MISSING, "--data-path", default_factory=list, required=True)
    """Training data: shard directories/globs/manifests (jf) or token files (ar)."""
    valid_data: list[str] | None = cli_field(None, "--valid-data-path")
    """Held-out data in the same format."""
    block_size: int | None = cli_field(None, option="BLOCK_SIZE")
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
    tokenizer: str | None = cli_field(None, option="TOKENIZER")
    """Tokenizer directory (ar objective with JSONL text, anchor JSONL)."""
    num_workers: int = 0
    """DataLoader worker processes per rank (0: read in the training process)."""

    def validate(self) -> "DataConfig":
        """Raises ValueError naming the offending option."""
        check_choices(self)
        _need(bool(self.data), "--data is required")
        _need(self.window_size >= 1, f"--window-size must be >= 1, got {self.window_size}")
        _need(self.num_workers >= 0, "--num-workers must be >= 0")
        _need(self.seq_length is None or self.seq_length >= 1, "--seq-length must be >= 1")
        if self.objective == "jf":
            _need(self.block_size is not None and self.block_size >= 1,
                  "--block-size is required for --objective jf (the block size n of the trajectory shards)")
        else:
            _need(self.seq_length is not None, "--seq-length is required for --objective ar")
        return self


@dataclass
class JFObjective:
    """The Jacobi Forcing objective: attention path and mask, the loss (paper Eq. 8-9) and the anchor term. It is
    also the loss functions' configuration (:func:`megatron_jf.training.losses.jf_loss`): constructing one checks
    the loss values (kind, normalisation, temperature, weights).

    Raises:
        ValueError: unknown loss kind or normalisation, non-positive temperature, negative weights.
    """

    attention_path: str = cli_field("two_stream", choices=ATTENTION_PATHS)
    """How the noisy and clean streams are attended: ``two_stream`` (exact for --mask nc, stock causal kernels),
    ``dense`` (an explicit mask, any --mask) or ``packed`` (both streams of every sample in one THD row, TE varlen
    attention on GPU)."""
    mask: str = cli_field("nc", choices=MASKS)
    """Attention mask of the noisy stream: ``nc`` (paper), ``nc_ic`` (paper Table 5) or ``clean`` (CLLM)."""
    consistency_loss: str = cli_field("kl", choices=CONSISTENCY_LOSSES)
    """``kl`` (paper Eq. 8), ``soft_ce`` (official code) or ``hard`` (CE on the fixed-point tokens)."""
    kl_temperature: float = 1.0
    """Softmax temperature ``tau > 0`` of the consistency loss (``kl`` / ``soft_ce``; official code's effective
    value: 1)."""
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

    def __post_init__(self):
        check_choices(self)
        _need(self.kl_temperature > 0, f"--kl-temperature must be > 0, got {self.kl_temperature}")
        _need(self.pc_weight >= 0 and self.ar_weight >= 0 and self.anchor_weight >= 0,
              f"loss weights must be >= 0, got --pc-weight {self.pc_weight}, --ar-weight {self.ar_weight}, "
              f"--anchor-weight {self.anchor_weight}")

    def validate(self) -> "JFObjective":
        """The checks of a training run's objective (besides the loss values checked at construction).

        Raises:
            ValueError: naming the offending option.
        """
        self.__post_init__()
        _need(self.loss_chunk_size >= 0, f"--loss-chunk-size must be >= 0, got {self.loss_chunk_size}")
        _need(not (self.anchor_data and self.anchor_weight == 0),
              "--anchor-data is given but --anchor-weight is 0 (the anchor term would be computed and ignored); "
              "set --anchor-weight > 0 or drop --anchor-data")
        _need(not (self.anchor_weight > 0 and not self.anchor_data), "--anchor-weight > 0 needs --anchor-data")
        _need(self.anchor_seq_length >= 1, f"--anchor-seq-length must be >= 1, got {self.anchor_seq_length}")
        _need(self.anchor_micro_batch_size is None or self.anchor_micro_batch_size >= 1,
              f"--anchor-micro-batch-size must be >= 1, got {self.anchor_micro_batch_size}")
        return self


@dataclass
class OptimConfig:
    """Batch sizes, steps, the learning-rate schedule (:func:`lr_at`) and AdamW."""

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

    def validate(self) -> "OptimConfig":
        """Raises ValueError naming the offending option."""
        _need(self.train_steps >= 1, f"--train-steps must be >= 1, got {self.train_steps}")
        _need(self.micro_batch_size >= 1, f"--micro-batch-size must be >= 1, got {self.micro_batch_size}")
        _need(self.global_batch_size is None or self.global_batch_size >= 1, "--global-batch-size must be >= 1")
        _need(self.lr > 0 and 0 <= self.min_lr <= self.lr, f"need 0 <= --min-lr <= --lr and --lr > 0 "
              f"(got lr={self.lr}, min_lr={self.min_lr})")
        _need(self.warmup_steps is None or 0 <= self.warmup_steps <= self.train_steps,
              f"--warmup-steps must be in [0, --train-steps], got {self.warmup_steps}")
        _need(self.weight_decay >= 0 and self.clip_grad >= 0, "--weight-decay and --clip-grad must be >= 0")
        return self


@dataclass
class CheckpointConfig:
    """Saving, resuming and stopping."""

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

    def validate(self) -> "CheckpointConfig":
        """Raises ValueError naming the offending option."""
        _at_least_one(self, "save_interval", "exit_interval", "keep_last")
        _need(self.save_interval is None or self.save is not None, "--save-interval needs --save")
        return self


@dataclass
class LoggingConfig:
    """Metrics output and validation."""

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

    def validate(self) -> "LoggingConfig":
        """Raises ValueError naming the offending option."""
        _need(self.log_interval >= 1, "--log-interval must be >= 1")
        _at_least_one(self, "eval_interval", "eval_iters")
        return self


# ------------------------------------------------------------------------------------------ the whole run
@dataclass
class TrainConfig:
    """Every knob of a training run, one part per concern (the command line has one argument group per part, flags
    unprefixed: ``--lr`` is ``cfg.optim.lr``).

    Defaults marked *official code* come from the official Jacobi Forcing training scripts (AdamW betas
    (0.9, 0.95), eps 1e-8, effective weight decay 0.01, cosine schedule with 3% warmup, window 16); the paper
    (Sec. 4.1) gives lr 1e-6 and batch size 4. :meth:`from_flat` builds one from field names alone
    (``TrainConfig.from_flat(lr=1e-4, data=[...])``), as checkpoints saved before the parts existed hold it.
    """

    parallel: ParallelConfig = part(ParallelConfig, "parallelism")
    runtime: RuntimeConfig = part(RuntimeConfig, "runtime")
    recompute: RecomputeConfig = part(RecomputeConfig, "activation recomputation (Megatron-LM flags)")
    model: ModelSource = part(ModelSource, "model")
    dataset: DataConfig = part(DataConfig, "data")
    jf: JFObjective = part(JFObjective, "Jacobi Forcing objective")
    optim: OptimConfig = part(OptimConfig, "optimisation")
    checkpoint: CheckpointConfig = part(CheckpointConfig, "checkpointing")
    logging: LoggingConfig = part(LoggingConfig, "logging and validation")

    # ------------------------------------------------------------------------------------------
    @classmethod
    def from_flat(cls, **values) -> "TrainConfig":
        """A config from flat field names (``lr=1e-4`` -> ``optim.lr``; the command line's ``dest`` names and the
        pre-parts checkpoints' ``config``); the rest keep their defaults.

        Raises:
            TypeError: a name that is no field of any part.
        """
        unknown = set(values) - set(FIELD_PART)
        if unknown:
            raise TypeError(f"TrainConfig has no field {', '.join(sorted(unknown))}")
        parts = {}
        for f in dataclasses.fields(cls):
            kw = {g.name: values[g.name] for g in dataclasses.fields(f.default_factory) if g.name in values}
            parts[f.name] = f.default_factory(**kw)
        return cls(**parts)

    @classmethod
    def from_json(cls, d: dict) -> "TrainConfig":
        """The config :meth:`to_json` wrote, or the flat dict a checkpoint saved before the parts existed (its
        common state's ``config``); keys no part knows (options since removed) are ignored."""
        if all(isinstance(d.get(f.name), dict) for f in dataclasses.fields(cls)):
            flat = {k: v for f in dataclasses.fields(cls) for k, v in d[f.name].items()}
        else:
            flat = dict(d)
        return cls.from_flat(**{k: v for k, v in flat.items() if k in FIELD_PART})

    def flat(self) -> dict:
        """``{field name: value}`` over every part (the command line's ``dest`` names)."""
        return {f.name: getattr(getattr(self, p.name), f.name) for p in dataclasses.fields(self)
                for f in dataclasses.fields(getattr(self, p.name))}

    def validate(self) -> "TrainConfig":
        """Check values that do not need the data or the model: each part's own checks, then those across parts.

        Raises:
            ValueError: naming the offending option.
        """
        par, data, jf = self.parallel, self.dataset, self.jf
        par.validate()
        self.runtime.validate()
        data.validate()
        self.optim.validate()
        self.recompute.validate()
        self.checkpoint.validate()
        self.logging.validate()
        _need(not (par.sequence_parallel and jf.anchor_data and jf.anchor_seq_length % par.tp),
              f"--sequence-parallel splits rows over --tp {par.tp}: --anchor-seq-length {jf.anchor_seq_length} "
              "must be a multiple of it")
        _need(self.logging.eval_interval is None or data.valid_data, "--eval-interval needs --valid-data")
        _need(not (jf.anchor_data and data.objective != "jf"), "--anchor-data needs --objective jf")
        jf.validate()
        if data.objective == "jf":
            _need(not (jf.attention_path == "two_stream" and jf.mask != "nc"),
                  f"--attention-path two_stream is exact only for --mask nc (got --mask {jf.mask}); "
                  "use --attention-path dense")
            _need(not (jf.attention_path == "packed" and par.pp > 1),
                  "--attention-path packed (one THD row per microbatch) needs --pp 1; use two_stream or dense with "
                  "--pp > 1")
            _need(not (jf.attention_path == "packed" and jf.anchor_data),
                  "--attention-path packed does not carry --anchor-data rows yet; use two_stream or dense")
        _need(self.model.hf_config or self.model.load or self.checkpoint.save,
              "no model: give --hf-config (from scratch), --load (a checkpoint) or --save with a checkpoint to resume")
        return self

    @property
    def pad_rows_to_seq_length(self) -> bool:
        """Whether every model-input row is padded to ``seq_length`` (pp > 1 with fixed pipeline shapes)."""
        return self.parallel.pp > 1 and not self.dataset.variable_seq_lengths

    @property
    def anchor_on(self) -> bool:
        """Whether JF microbatches carry anchor rows."""
        return bool(self.jf.anchor_data) and self.jf.anchor_weight > 0

    @property
    def anchor_mbs(self) -> int:
        """Anchor rows per microbatch (0 when the anchor term is off)."""
        if not self.anchor_on:
            return 0
        return self.jf.anchor_micro_batch_size or self.optim.micro_batch_size

    def to_json(self) -> dict:
        """``{part: {field: value}}`` (:meth:`from_json` reads it back)."""
        return dataclasses.asdict(self)


#: ``{field name: part name}`` of every :class:`TrainConfig` field (each declared in exactly one part).
FIELD_PART: dict[str, str] = {}
for _p in dataclasses.fields(TrainConfig):
    for _f in dataclasses.fields(_p.default_factory):
        assert _f.name not in FIELD_PART and _f.name not in {p.name for p in dataclasses.fields(TrainConfig)}, _f.name
        FIELD_PART[_f.name] = _p.name
del _p, _f


def build_parser() -> argparse.ArgumentParser:
    """The ``pretrain_jf.py`` command line, generated from :class:`TrainConfig` (one flag per field, help from the
    field's docstring, one argument group per part; unknown options are an argparse error).

    Megatron-LM's flag names are accepted where the concept is the same (``--tensor-model-parallel-size``
    = ``--tp``, ``--pipeline-model-parallel-size`` = ``--pp``, ``--train-iters`` = ``--train-steps``,
    ``--lr-warmup-iters`` = ``--warmup-steps``, ``--data-path`` = ``--data``, ``--valid-data-path`` =
    ``--valid-data``, ``--tokenizer-model`` = ``--tokenizer``, ``--bf16`` = ``--precision bf16``), and vLLM's
    ``--tensor-parallel-size`` / ``--pipeline-parallel-size``; the shared names (``--micro-batch-size``, ``--lr``,
    ``--clip-grad``, ``--save-interval`` ...) mean what they mean there. Every option's help shows its default.
    """
    p = cli.parser("Jacobi Forcing training on megatron-core (paper arXiv 2512.14681, Sec. 3.1). Megatron-LM flag "
                   "names are accepted where the concept matches.", prog="pretrain_jf.py")
    cli.add_dataclass_arguments(p, TrainConfig)
    return p


def parse_config(argv: list[str] | None = None) -> TrainConfig:
    """Parse the command line into a validated :class:`TrainConfig`.

    Raises:
        SystemExit: unknown options or malformed values (argparse).
        ValueError: inconsistent values (see :meth:`TrainConfig.validate`).
    """
    return config_from_args(build_parser().parse_args(argv)).validate()


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The :class:`TrainConfig` of parsed :func:`build_parser` flags (not validated; the loss values are checked).
    :func:`megatron_jf.cli.to_argv` is the inverse."""
    return cli.dataclass_from_args(TrainConfig, args)


def effective_seq_length(cfg: TrainConfig, max_position: int) -> int:
    """The model-input row length bound (and the padded length under pipeline parallelism with fixed shapes)."""
    data, jf = cfg.dataset, cfg.jf
    if data.seq_length is not None:
        return data.seq_length
    if data.objective == "jf" and (jf.attention_path == "dense" or (jf.attention_path == "packed" and jf.mask != "nc")):
        return 2 * max_position  # one sample = prompt + noisy + clean
    return max_position


def lr_at(iteration: int, cfg: TrainConfig) -> float:
    """Learning rate of optimizer step ``iteration`` (1-based): linear warmup from 0 to ``lr`` over
    ``warmup_steps``, then cosine decay to ``min_lr`` at ``train_steps``."""
    o = cfg.optim
    warm = _warmup(o)
    if warm and iteration <= warm:
        return o.lr * iteration / warm
    span = max(1, o.train_steps - warm)
    progress = min(1.0, max(0.0, (iteration - warm) / span))
    return o.min_lr + 0.5 * (o.lr - o.min_lr) * (1.0 + math.cos(math.pi * progress))


def _warmup(o: OptimConfig) -> int:
    return o.warmup_steps if o.warmup_steps is not None else math.ceil(0.03 * o.train_steps)

