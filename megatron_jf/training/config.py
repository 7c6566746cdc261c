"""Training configuration: every ``pretrain_jf.py`` option, its command line, and the LR schedule.

* :class:`TrainConfig` holds every knob of a run, grouped by concern (no global mutable arguments).
* :func:`build_parser` / :func:`parse_config` are the command line (Megatron-LM flag names where the concept
  matches, e.g. ``--tensor-model-parallel-size`` for ``--tp``).
* :func:`lr_at` is the learning rate of a step (linear warmup, then cosine decay).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass, field

from megatron_jf.training.losses import CONSISTENCY_LOSSES, PC_NORMALIZATIONS, LossConfig

__all__ = ["TrainConfig", "build_parser", "parse_config", "effective_seq_length", "lr_at"]

OBJECTIVES = ("jf", "ar")
ATTENTION_PATHS = ("two_stream", "dense", "packed", "flex")
MASKS = ("nc", "nc_ic", "clean")
NOISE_SCHEDULES = ("progressive", "reverse", "random")
CONSISTENCY_POSITIONS = ("all", "from_first_diff")
PRECISIONS = ("auto", "fp32", "bf16")
RECOMPUTE_GRANULARITIES = ("full", "selective")
RECOMPUTE_METHODS = ("uniform", "block")
#: megatron-core ``recompute_modules`` that apply to a dense (non-MoE, non-MLA) GPT layer.
RECOMPUTE_MODULES = ("core_attn", "mlp", "layernorm")


@dataclass
class TrainConfig:
    """Every knob of a training run, grouped by concern (the CLI mirrors the groups).

    Defaults marked *reference* come from the official Jacobi Forcing training scripts
    (``shared/research/jf_reference.md`` Sec. 6.4: AdamW betas (0.9, 0.95), eps 1e-8, effective weight
    decay 0.01, LR 1e-5 for n=32, cosine schedule with 3% warmup, block size 32, window 16).
    """

    # --- parallelism / runtime
    tp: int = 1
    """Tensor-parallel size."""
    pp: int = 1
    """Pipeline-parallel size (data-parallel size = world / (tp * pp))."""
    use_megatron_optimizer: bool | None = None
    """megatron DDP + optimizer (GPU only); None = on iff CUDA is available."""
    use_distributed_optimizer: bool = False
    """Shard optimizer state over DP (megatron DistributedOptimizer; GPU path only)."""
    overlap_grad_reduce: bool = False
    """megatron DDP: reduce (reduce-scatter with the distributed optimizer) gradient buckets during the
    backward of the last microbatch instead of after it (GPU path)."""
    overlap_param_gather: bool = False
    """megatron DDP: all-gather the updated parameter shards bucket by bucket during the next forward instead
    of at the end of the optimizer step (GPU path; needs the distributed optimizer and overlap_grad_reduce)."""
    ddp_bucket_size: int | None = None
    """megatron DDP gradient bucket size in parameters (None: megatron-core's default, max(4e7, 1e6 x dp))."""
    sequence_parallel: bool = False
    """Megatron-LM ``--sequence-parallel`` (tp > 1): norms and residuals run on ``S / tp`` positions per TP
    rank (activations between the TP regions split over the TP group); loss rows are gathered from the shards."""
    precision: str = "auto"
    """``auto`` (bf16 on GPU with the megatron optimizer, else fp32) | ``fp32`` | ``bf16`` (GPU: bf16 weights, fp32
    main weights in megatron's optimizer; CPU: fp32 weights and AdamW state, bf16 autocast compute, needs a CPU
    with AVX-512 BF16 or AMX; :mod:`megatron_jf.precision`)."""
    threads: int | None = None
    """torch intra-op threads per process (CPU); None keeps torch's default."""
    seed: int = 1234
    """Seed of weight init (from scratch), data order and the random noise schedule."""
    transformer_impl: str = "auto"
    """Layer spec (Megatron-LM's ``--transformer-impl``): ``transformer_engine`` (fused norm + projections; needs TE
    and CUDA), ``local`` (megatron-core's own modules) or ``auto`` (TE where present)."""

    # --- activation recomputation (Megatron-LM's flags and meaning; megatron-core TransformerConfig fields)
    recompute_granularity: str | None = None
    """``full``: keep only each recomputed chunk's input and rerun the whole layers in the backward;
    ``selective``: rerun only ``recompute_modules`` (default core attention); None: save everything."""
    recompute_method: str | None = None
    """``full`` only: ``uniform`` (every layer, in chunks of ``recompute_num_layers``) | ``block`` (the first
    ``recompute_num_layers`` layers of each pipeline stage)."""
    recompute_num_layers: int | None = None
    """``full`` only: layers per recomputed chunk (uniform) or recomputed layers per stage (block)."""
    recompute_modules: list[str] | None = None
    """``selective`` only: submodules to rerun (megatron-core default ``["core_attn"]``)."""

    # --- model
    hf_config: str | None = None
    """Directory with an HF ``config.json``: the architecture for training from scratch."""
    load: str | None = None
    """Checkpoint to initialise the weights from (e.g. converted with tools/convert_hf.py)."""

    # --- data
    objective: str = "jf"
    """``jf`` (trajectory shards) | ``ar`` (next-token on token data)."""
    data: list[str] = field(default_factory=list)
    """Training data: shard dirs/globs/manifests (jf) or token files (ar)."""
    valid_data: list[str] | None = None
    """Held-out data in the same format."""
    block_size: int | None = None
    """``n``: the block size the shards must have (jf; required)."""
    window_size: int = 16
    """Noise-schedule window ``w`` (paper Eq. 7; reference 16 for n=32); also the NC-IC window."""
    noise_schedule: str = "progressive"
    """``progressive`` (paper Eq. 7) | ``reverse`` | ``random``."""
    consistency_positions: str = "all"
    """``all`` pairs every (block, offset) | ``from_first_diff`` (reference: offsets from the first noisy token)."""
    seq_length: int | None = None
    """Model-input row length. jf: maximum (two-stream ``P+R``, dense ``P+2R``), padded to it when pp > 1
    without ``variable_seq_lengths``; default the model context (dense: twice it). ar: tokens per sample
    (required)."""
    variable_seq_lengths: bool = True
    """pp > 1: each microbatch keeps its own row length (megatron-core ``variable_seq_lengths``: the pipeline
    stages exchange activation shapes before each send) instead of padding every row to ``seq_length``."""
    tokenizer: str | None = None
    """Tokenizer directory (ar objective with JSONL text)."""
    num_workers: int = 0
    """DataLoader worker processes per rank (0 = read in the training process)."""

    # --- JF objective
    attention_path: str = "two_stream"
    """``two_stream`` (nc only, causal kernels) | ``dense`` (explicit mask) | ``flex`` (not implemented)."""
    mask: str = "nc"
    """``nc`` (paper) | ``nc_ic`` (Table 5) | ``clean`` (CLLM)."""
    consistency_loss: str = "kl"
    """``kl`` (paper Eq. 8) | ``soft_ce`` (reference code) | ``hard`` (CE on fixed-point tokens)."""
    kl_temperature: float = 1.0
    """Softmax temperature of the consistency loss (reference effective value 1)."""
    pc_weight: float = 1.0
    """Weight of L_pc."""
    ar_weight: float = 1.0
    """Weight ``w`` of L_AR (paper Eq. 9; reference code uses 10)."""
    pc_normalization: str = "paper"
    """``paper`` (per-block mean, then 1/N over blocks) | ``reference`` (mean over positions / N)."""
    loss_chunk_size: int = 1024
    """Loss rows per chunk of the fused output layer + JF loss (peak temporaries ``O(chunk x V_local)``,
    :func:`megatron_jf.training.losses.loss_temporary_bytes`); 0 = all rows in one chunk."""
    anchor_data: list[str] | None = None
    """Real-text token files (``.npy``/``.bin``/``.jsonl`` as ``--objective ar``; JSONL needs ``--tokenizer``)
    for the anchor term L_anchor (next-token CE on real text, trained in the same steps)."""
    anchor_weight: float = 0.0
    """Weight ``lambda`` of L_anchor (0 = off; > 0 needs ``--anchor-data``)."""
    anchor_seq_length: int = 256
    """Tokens per anchor row (<= the model context; <= ``--seq-length`` when rows are padded to it)."""
    anchor_micro_batch_size: int | None = None
    """Anchor text rows per JF microbatch; default ``--micro-batch-size``."""

    # --- optimisation
    micro_batch_size: int = 1
    """Samples per microbatch per DP rank (reference: 1)."""
    global_batch_size: int | None = None
    """Samples per optimizer step over all DP ranks; default micro_batch_size * dp."""
    lr: float = 1e-5
    """Peak learning rate (reference n=32 stage: 1e-5; n=64 stage: 1e-6)."""
    min_lr: float = 0.0
    """Final learning rate of the cosine decay (reference: 0)."""
    warmup_steps: int | None = None
    """Linear warmup steps; default ceil(3% of train_steps) (reference)."""
    train_steps: int = 0
    """Optimizer steps to train (required)."""
    weight_decay: float = 0.01
    """AdamW decoupled weight decay on matrices (not biases/norms) (reference effective 0.01)."""
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    """Global gradient-norm clip (0 disables; HF Trainer default used by the reference)."""

    # --- checkpointing
    save: str | None = None
    """Checkpoint directory: saved every save_interval steps and at the end; resumed from if it holds one."""
    save_interval: int | None = None
    keep_last: int | None = None
    """Keep only this many newest checkpoints."""
    exit_interval: int | None = None
    """Stop (after saving) once the iteration is a multiple of this."""

    # --- logging / validation
    log_interval: int = 10
    eval_interval: int | None = None
    eval_iters: int | None = None
    """Validation microbatches per evaluation (default: the whole validation set)."""
    log_file: str | None = None
    """Append one JSON line per log/eval event (rank 0)."""
    tensorboard_dir: str | None = None
    """TensorBoard event directory (only if ``tensorboard`` is installed)."""
    progress: bool = True
    """Show a progress bar on rank 0."""

    # ------------------------------------------------------------------------------------------
    def loss_config(self) -> LossConfig:
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
            if self.attention_path == "flex":
                raise NotImplementedError("--attention-path flex is not implemented (use dense or two_stream); "
                                          "TODO: FlexAttention / TE arbitrary-mask attention on GPU")
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


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with its default: ``(default: X)``, or ``(required)``; a help text that
    already states its default ("default: 3% of --train-steps") is left as written."""

    def _get_help_string(self, action):
        h = action.help or ""
        if "default:" in h.lower() or action.default is argparse.SUPPRESS:
            return h
        if action.required:
            return h + " (required)"
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            return h + f" (default: {'on' if action.default else 'off'})"
        return h + " (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    """The ``pretrain_jf.py`` command line (unknown options are an argparse error).

    Megatron-LM's flag names are accepted where the concept is the same (``--tensor-model-parallel-size``
    = ``--tp``, ``--pipeline-model-parallel-size`` = ``--pp``, ``--train-iters`` = ``--train-steps``,
    ``--lr-warmup-iters`` = ``--warmup-steps``, ``--data-path`` = ``--data``, ``--valid-data-path`` =
    ``--valid-data``, ``--tokenizer-model`` = ``--tokenizer``, ``--bf16`` = ``--precision bf16``); the
    shared names (``--micro-batch-size``, ``--lr``, ``--clip-grad``, ``--save-interval`` ...) mean what they
    mean there. Every option's help shows its default.
    """
    d = TrainConfig()
    p = argparse.ArgumentParser(
        prog="pretrain_jf.py",
        description="Jacobi Forcing training on megatron-core (paper arXiv 2512.14681, Sec. 3.1). "
                    "Megatron-LM flag names are accepted where the concept matches.",
        formatter_class=_HelpFormatter, allow_abbrev=False)

    def opt_bool(g, name, help):
        g.add_argument(name, action=argparse.BooleanOptionalAction, default=None, help=help)

    g = p.add_argument_group("parallelism and runtime")
    g.add_argument("--tp", "--tensor-model-parallel-size", dest="tp", type=int, default=d.tp,
                   help="tensor-parallel size")
    g.add_argument("--pp", "--pipeline-model-parallel-size", dest="pp", type=int, default=d.pp,
                   help="pipeline-parallel size (data-parallel size = world / (tp * pp))")
    opt_bool(g, "--use-megatron-optimizer", "megatron DDP + optimizer (default: on iff CUDA is available)")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="shard optimizer state over DP (megatron DistributedOptimizer; GPU)")
    g.add_argument("--overlap-grad-reduce", action="store_true",
                   help="megatron DDP: reduce gradient buckets during the backward (GPU path)")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="megatron DDP: all-gather updated parameters during the next forward (GPU path; needs "
                        "--use-distributed-optimizer --overlap-grad-reduce)")
    g.add_argument("--ddp-bucket-size", type=int, default=None,
                   help="megatron DDP bucket size in parameters (default: megatron-core's, max(4e7, 1e6 x dp))")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="split norms/residuals over the TP group along the sequence (needs --tp > 1)")
    g.add_argument("--precision", choices=PRECISIONS, default=d.precision,
                   help="compute precision (auto: bf16 on GPU with the megatron optimizer, else fp32); bf16 on CPU: "
                        "fp32 master weights and AdamW state, bf16 autocast compute, refused on CPUs without "
                        "AVX-512 BF16/AMX; the loss then differs from an fp32 run's by bf16 rounding")
    g.add_argument("--bf16", dest="precision", action="store_const", const="bf16", default=argparse.SUPPRESS,
                   help="Megatron-LM spelling of --precision bf16 (default: off, i.e. --precision's default)")
    g.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads per process (CPU; default: torch's own choice)")
    g.add_argument("--seed", type=int, default=d.seed, help="seed for init, data order and noise")
    g.add_argument("--transformer-impl", choices=("auto", "local", "transformer_engine"), default=d.transformer_impl,
                   help="layer spec: transformer_engine (needs TE + CUDA), local, or auto (TE where present)")

    g = p.add_argument_group("activation recomputation (Megatron-LM flags)")
    g.add_argument("--recompute-granularity", choices=RECOMPUTE_GRANULARITIES, default=None,
                   help="full: save only each chunk's input and rerun whole layers in the backward; selective: "
                        "rerun --recompute-modules (core attention) only (default: off, everything is saved)")
    g.add_argument("--recompute-method", choices=RECOMPUTE_METHODS, default=None,
                   help="full only: uniform recomputes every layer in chunks of --recompute-num-layers; block "
                        "recomputes the first --recompute-num-layers layers of each pipeline stage")
    g.add_argument("--recompute-num-layers", type=int, default=None,
                   help="full only: layers per chunk (uniform) or recomputed layers per stage (block)")
    g.add_argument("--recompute-modules", nargs="+", choices=RECOMPUTE_MODULES, default=None,
                   help="selective only: submodules to rerun (default: megatron-core's, core_attn)")

    g = p.add_argument_group("model")
    g.add_argument("--hf-config", default=None, help="HF directory with config.json (train from scratch)")
    g.add_argument("--load", default=None, help="checkpoint to initialise the weights from (iteration 0)")

    g = p.add_argument_group("data")
    g.add_argument("--objective", choices=OBJECTIVES, default=d.objective, help="jf: trajectories; ar: next-token")
    g.add_argument("--data", "--data-path", dest="data", nargs="+", required=True,
                   help="training shards (dir/glob/manifest) for jf, or token files for ar")
    g.add_argument("--valid-data", "--valid-data-path", dest="valid_data", nargs="+", default=None,
                   help="held-out data in the same format")
    g.add_argument("--block-size", type=int, default=None,
                   help="block size n of the shards (required for --objective jf)")
    g.add_argument("--window-size", type=int, default=d.window_size,
                   help="noise window w of the progressive schedule (paper Eq. 7); also the NC-IC window")
    g.add_argument("--noise-schedule", choices=NOISE_SCHEDULES, default=d.noise_schedule,
                   help="noise schedule within a window (progressive: paper Eq. 7)")
    g.add_argument("--consistency-positions", choices=CONSISTENCY_POSITIONS, default=d.consistency_positions,
                   help="which (block, offset) pairs carry L_pc (from_first_diff: official code)")
    g.add_argument("--seq-length", type=int, default=None,
                   help="model-input row length bound; rows are padded to it when --pp > 1 with "
                        "--no-variable-seq-lengths (default: the model context; dense path: twice it)")
    g.add_argument("--variable-seq-lengths", action=argparse.BooleanOptionalAction, default=d.variable_seq_lengths,
                   help="--pp > 1: each microbatch keeps its own row length (stages exchange shapes, megatron-core "
                        "variable_seq_lengths); --no-variable-seq-lengths pads every row to --seq-length")
    g.add_argument("--tokenizer", "--tokenizer-model", dest="tokenizer", default=None,
                   help="tokenizer directory (ar objective with JSONL text, anchor JSONL)")
    g.add_argument("--num-workers", type=int, default=d.num_workers, help="DataLoader worker processes per rank")

    g = p.add_argument_group("Jacobi Forcing objective")
    g.add_argument("--attention-path", choices=ATTENTION_PATHS, default=d.attention_path,
                   help="how the noisy and clean streams are attended (two_stream: exact for --mask nc; packed: "
                        "both streams of every sample in one THD row, TE varlen attention on GPU)")
    g.add_argument("--mask", choices=MASKS, default=d.mask,
                   help="attention mask of the noisy stream (nc: paper; nc_ic: Table 5; clean: CLLM)")
    g.add_argument("--consistency-loss", choices=CONSISTENCY_LOSSES, default=d.consistency_loss,
                   help="kl: paper Eq. 8; soft_ce: official code; hard: CE on fixed-point tokens")
    g.add_argument("--kl-temperature", type=float, default=d.kl_temperature,
                   help="softmax temperature of the consistency loss")
    g.add_argument("--pc-weight", type=float, default=d.pc_weight, help="weight of L_pc")
    g.add_argument("--ar-weight", type=float, default=d.ar_weight,
                   help="weight of L_AR (paper Eq. 9: L = L_pc + w L_AR, the same symbol as the window w of Eq. 7; "
                        "official code: 10)")
    g.add_argument("--pc-normalization", choices=PC_NORMALIZATIONS, default=d.pc_normalization,
                   help="paper: per-block mean, then 1/N over blocks; reference: official code's mean over "
                        "positions / N")
    g.add_argument("--loss-chunk-size", type=int, default=d.loss_chunk_size,
                   help="loss rows per chunk of the fused output layer + loss (memory O(chunk x vocab/tp); "
                        "0 = one chunk)")
    g.add_argument("--anchor-data", nargs="+", default=None, metavar="PATH",
                   help="real-text token files (.npy/.bin/.jsonl) for the anchor term (next-token CE on real "
                        "text in the same steps; JSONL needs --tokenizer)")
    g.add_argument("--anchor-weight", type=float, default=d.anchor_weight,
                   help="weight of the anchor term (0 = off; > 0 needs --anchor-data)")
    g.add_argument("--anchor-seq-length", type=int, default=d.anchor_seq_length, help="tokens per anchor row")
    g.add_argument("--anchor-micro-batch-size", type=int, default=None,
                   help="anchor text rows per JF microbatch (default: --micro-batch-size)")

    g = p.add_argument_group("optimisation")
    g.add_argument("--micro-batch-size", type=int, default=d.micro_batch_size,
                   help="samples per microbatch per data-parallel rank")
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="samples per optimizer step over all DP ranks; a multiple of micro-batch-size x dp "
                        "(default: micro-batch-size x dp)")
    g.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (paper Sec. 4.1: 1e-6; 1e-5 is the official code's n=32 script)")
    g.add_argument("--min-lr", type=float, default=d.min_lr, help="final learning rate of the cosine decay (official code: 0)")
    g.add_argument("--warmup-steps", "--lr-warmup-iters", dest="warmup_steps", type=int, default=None,
                   help="linear warmup steps (default: 3%% of --train-steps, official code; the paper states none)")
    g.add_argument("--train-steps", "--train-iters", dest="train_steps", type=int, required=True,
                   help="optimizer steps to train")
    g.add_argument("--weight-decay", type=float, default=d.weight_decay,
                   help="AdamW decoupled weight decay on matrices, none on biases and norms (official code's effective value)")
    g.add_argument("--adam-beta1", type=float, default=d.adam_beta1, help="AdamW beta1")
    g.add_argument("--adam-beta2", type=float, default=d.adam_beta2, help="AdamW beta2")
    g.add_argument("--adam-eps", type=float, default=d.adam_eps, help="AdamW epsilon")
    g.add_argument("--clip-grad", type=float, default=d.clip_grad, help="global gradient-norm clip, 0 disables (official code: HF Trainer's 1.0)")

    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", default=None, help="checkpoint dir (resumes from its latest checkpoint)")
    g.add_argument("--save-interval", type=int, default=None,
                   help="save every this many steps (default: only at the end)")
    g.add_argument("--keep-last", type=int, default=None, help="keep only this many newest checkpoints "
                   "(default: keep all)")
    g.add_argument("--exit-interval", type=int, default=None,
                   help="save and stop at a multiple of this iteration (default: never)")

    g = p.add_argument_group("logging and validation")
    g.add_argument("--log-interval", type=int, default=d.log_interval, help="print metrics every this many steps")
    g.add_argument("--eval-interval", type=int, default=None,
                   help="validate every this many steps (default: never; needs --valid-data)")
    g.add_argument("--eval-iters", type=int, default=None,
                   help="validation microbatches per evaluation (default: the whole validation set)")
    g.add_argument("--log-file", default=None, help="JSONL metrics file, appended on rank 0")
    g.add_argument("--tensorboard-dir", default=None, help="TensorBoard event directory")
    g.add_argument("--progress", action=argparse.BooleanOptionalAction, default=d.progress,
                   help="progress bar on rank 0")
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

