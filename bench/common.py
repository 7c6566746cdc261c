"""What the benches share: the bench-only command-line options (each defined once, as a
:class:`megatron_jf.cli.Option`), the systems the decode benches compare, and small helpers.

The benches are thin clients of the library: they parse with a torch-free ``build_parser()`` whose options come from
:mod:`megatron_jf.cli` (``THREADS``, ``LOAD``, ``MAX_NEW_TOKENS``, ``JSON_OUT``, ``add_decode_args`` ...) and from
here, build engines through :class:`megatron_jf.inference.llm.LLM`, take model shapes from
:mod:`megatron_jf.models.shapes`, and import no other bench than this module. Nothing heavy is imported at module
level (no torch): ``python -m bench.X --help`` answers at once.
"""

from __future__ import annotations

import os

from megatron_jf import cli
from megatron_jf.cli import Option

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ----------------------------------------------------------------------------------------------- options
#: a scratch / cache directory the bench writes (models it builds, exports, logs)
WORK = Option("work", ("--work",), {"default": None, "metavar": "DIR",
                                    "help": "scratch directory: what the bench builds and caches"})
#: how many prompts a run decodes
NUM_PROMPTS = Option("num_prompts", ("--num-prompts",), {
    "type": cli.positive_int, "default": 4, "help": "prompts decoded one at a time at batch 1"})
#: interleaved rounds: each round runs every system once, the order rotated (ratios: the median over rounds)
ROUNDS = Option("rounds", ("--rounds",), {
    "type": cli.positive_int, "default": 3, "help": "interleaved rounds (ratios: the median over rounds)"})
#: timed repeats of one measurement (``--reps`` is the same flag)
REPEATS = Option("repeats", ("--repeats", "--reps"), {
    "type": cli.positive_int, "default": 1, "help": "timed repeats of each measurement"})
#: batch sizes to run, comma-separated
BATCHES = Option("batches", ("--batches",), {
    "type": cli.comma_list(cli.positive_int), "default": [1], "metavar": "B[,B...]",
    "help": "batch sizes, comma-separated (batch 1: the prompts one at a time; B: the first B prompts at once)"})
#: which models a comparison runs, comma-separated names
MODELS = Option("models", ("--models",), {"default": "smollm2", "metavar": "NAME[,NAME...]",
                                          "help": "models to run, comma-separated"})
#: a Hugging Face model directory
HF = Option("hf", ("--hf",), {"default": None, "metavar": "DIR", "help": "a Hugging Face model directory"})
#: HumanEval problems as chat prompts
HUMANEVAL = Option("humaneval", ("--humaneval",), {
    "action": "store_true", "help": "HumanEval problems as chat prompts (the tokenizer's chat template)"})
#: the built-in random model's shape
HIDDEN = Option("hidden", ("--hidden",), {"type": cli.positive_int, "default": 256,
                                          "help": "hidden size of the built-in random model"})
LAYERS = Option("layers", ("--layers",), {"type": cli.positive_int, "default": 4,
                                          "help": "layers of the built-in random model"})
VOCAB = Option("vocab", ("--vocab",), {"type": cli.positive_int, "default": 8192,
                                       "help": "vocabulary of the built-in random model"})
#: the interpreter of the vLLM environment
VLLM_PYTHON = Option("vllm_python", ("--vllm-python",), {
    "default": os.path.join(REPO, ".venv-vllm", "bin", "python"), "metavar": "PYTHON",
    "help": "interpreter of the vLLM environment (JF_ENV=vllm bash scripts/bootstrap.sh)"})
#: the engines a comparison runs (a list: the tool's ``--engine`` picks one, dest ``engine``)
ENGINES = Option("engines", ("--engine",), {"nargs": "+", "default": None, "metavar": "ENGINE",
                                            "help": "engines to compare"})
#: CPU, tiny models: the plumbing of a GPU bench, no GPU figures
DRY_RUN = Option("dry_run", ("--dry-run",), {"action": "store_true",
                                             "help": "CPU, tiny models, few steps: the plumbing, no GPU figures"})


def add_builtin_model_args(p, *, hidden: int = 256, layers: int = 4, vocab: int = 8192) -> None:
    """``--hidden``, ``--layers``, ``--vocab``: the shape of a bench's built-in random model."""
    HIDDEN.add(p, default=hidden)
    LAYERS.add(p, default=layers)
    VOCAB.add(p, default=vocab)


def add_block_args(p, *, block_size: int | None = None, num_blocks: int | None = None, help: str | None = None):
    """``--block-size`` (and ``--num-blocks`` where ``num_blocks`` is given): the :class:`DecodeConfig` fields'
    flags (:func:`megatron_jf.cli.add_decode_args`), with this bench's defaults."""
    fields = ("block_size",) if num_blocks is None else ("block_size", "num_blocks")
    g = cli.add_decode_args(p, title=help or "decoding (Jacobi Forcing decoders, paper Sec. 3.2)", fields=fields)
    p.set_defaults(**{k: v for k, v in (("block_size", block_size), ("num_blocks", num_blocks)) if v is not None})
    return g


def parser(doc: str | None):
    """A bench's parser: :func:`megatron_jf.cli.parser` (no abbreviations, defaults in the help) with the module
    docstring as description."""
    return cli.parser(doc)


# ----------------------------------------------------------------------------------------------- systems
#: the decode benches' systems of this project's engine (``bench/decode.py``, ``bench/vllm_decode.py``)
SYSTEMS = ("ar", "default", "mr-paper", "jacobi-paper", "jacobi")


def configs(n: int, k: int) -> dict:
    """The benchmarks' systems: name -> ``DecodeConfig`` (block size ``n``, ``k`` MR blocks)."""
    from megatron_jf.cli import DEFAULT_DECODER
    from megatron_jf.decoding import PAPER, DecodeConfig

    return {"ar": DecodeConfig("ar"),
            "default": DecodeConfig(DEFAULT_DECODER, block_size=n, num_blocks=k),
            "mr-paper": DecodeConfig("mr", block_size=n, num_blocks=k, verification_size=4, **PAPER),
            "jacobi-paper": DecodeConfig("jacobi", block_size=n, **PAPER),
            "jacobi": DecodeConfig("jacobi", block_size=n)}


# ----------------------------------------------------------------------------------------------- helpers
def cpu_flags() -> str:
    """The CPU's model name and its AVX2 / AVX-512 / AMX flags (named next to every figure)."""
    name, flags = "unknown CPU", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, v = line.partition(":")
                if key.strip() == "model name" and name == "unknown CPU":
                    name = v.strip()
                elif key.strip() == "flags":
                    flags |= {x for x in v.split() if x == "avx2" or x.startswith(("avx512", "amx"))}
    except OSError:
        pass
    return f"{name}, {os.cpu_count()} cores; flags: {' '.join(sorted(flags)) or 'none of avx2/avx512/amx'}"


def humaneval_chat_prompts(tokenizer_dir: str, count: int) -> list[list[int]]:
    """Token ids of the first ``count`` HumanEval problems as chat prompts (the tokenizer's chat template, with the
    generation prompt), as every bench here prompts SmolLM2."""
    from transformers import AutoTokenizer

    from megatron_jf.eval.benchmarks import load_benchmark
    from megatron_jf.eval.prompts import build_messages

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    out = []
    for pr in load_benchmark("humaneval", limit=count):
        ids = tok.apply_chat_template(build_messages(pr), add_generation_prompt=True, tokenize=True)
        out.append(list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids))
    return out


def tree_layout(n: int, K: int, v: int):
    """One MR forward at full width: ``[last] + K*n`` main draft (causal) and ``v-1`` recycled candidates of
    ``n`` tokens, each a branch after ``last`` (as the engine lays them out in ``tree`` mode). Returns
    ``(s, tree, cand_lens)``."""
    from megatron_jf.inference.mr_verify import tree_mask

    main = 1 + K * n
    lens = [n] * (v - 1)
    s = main + sum(lens)
    return s, tree_mask(main, lens, s), lens


def engine(model, **kw):
    """The engine over an in-memory model (:meth:`megatron_jf.inference.llm.LLM.from_model`; ``kw``: its keywords,
    e.g. ``options=InferenceOptions(...)``)."""
    from megatron_jf.inference.llm import LLM

    return LLM.from_model(model, **kw).engine


#: the GPU checks' model shapes (:mod:`megatron_jf.models.shapes`): on a GPU, and on the CPU dry run
GPU_SHAPE, DRY_RUN_SHAPE = "qwen2.5-7b", "tiny"


def build_random_model(shape, dtype, device):
    """A megatron model of ``shape`` (a :class:`~megatron_jf.models.hf_config.ModelArgs`, or a name of
    :mod:`megatron_jf.models.shapes`) with N(0, 0.02) weights drawn on ``device`` (no CPU init)."""
    import torch

    from megatron_jf.models import gpt, shapes

    args = shapes.get(shape) if isinstance(shape, str) else shape
    tcfg = gpt.transformer_config(args, params_dtype=dtype)
    tcfg.perform_initialization = False  # weights are drawn below, on the device
    tcfg.use_cpu_initialization = device.type != "cuda"
    from megatron.core import parallel_state as ps

    # the local spec with its own final norm (not TE's, whatever is installed): the lean / static-shape inference
    # forward reads it, as for the models checkpointing.load_model builds
    spec = gpt.block_spec(tcfg, gpt.layer_spec(args, "local"))
    model = gpt.JFGPTModel(config=tcfg, transformer_layer_spec=spec,
                           vocab_size=args.padded_vocab_size(ps.get_tensor_model_parallel_world_size(), divisible_by=1),
                           max_sequence_length=args.max_position_embeddings, pre_process=True, post_process=True,
                           share_embeddings_and_output_weights=args.tie_word_embeddings,
                           position_embedding_type="rope", rotary_percent=1.0, rotary_base=int(args.rope_theta))
    gpt.finish_model(model, args)
    model = model.to(device).eval()
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "layernorm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)
    return model
