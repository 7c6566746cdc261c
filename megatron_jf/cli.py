"""Command-line pieces the inference tools share: help that shows every default, and the Megatron-LM spellings.

Megatron-LM users type ``--tensor-model-parallel-size``, ``--pipeline-model-parallel-size``, ``--bf16``,
``--micro-batch-size``, ``--tokenizer-model``, ``--num-tokens-to-generate`` and ``--top_k``/``--top_p``; the tools
(``tools/generate.py``, ``tools/evaluate.py``, ``tools/generate_trajectories.py``,
``tools/search_inference_config.py``) accept them as aliases of their own flags wherever the concept is the same.
Training flags (``pretrain_jf.py``) live in :mod:`megatron_jf.training.config`.
"""

from __future__ import annotations

import argparse

#: The option strings every tool gives for the same concept (first: ours, then Megatron-LM's).
TP_FLAGS = ("--tp", "--tensor-model-parallel-size")
PP_FLAG = "--pipeline-model-parallel-size"
TOKENIZER_FLAGS = ("--tokenizer", "--tokenizer-model")
MAX_NEW_TOKENS_FLAGS = ("--max-new-tokens", "--num-tokens-to-generate")
BATCH_FLAGS = ("--batch-size", "--micro-batch-size")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the module docstring's layout and appends ``(default: ...)`` to every optional flag's help that does
    not already say its default (switches read ``on``/``off``; a ``None`` default reads ``none``, so a help whose
    ``None`` means something else says so itself)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (not action.option_strings or action.default is argparse.SUPPRESS or action.required
                or "default" in text):
            return text
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            on = action.default if isinstance(action, argparse._StoreTrueAction) else not action.default
            return f"{text} (default: {'on' if on else 'off'})"
        if action.default is None:
            return f"{text} (default: none)"
        d = action.default
        if isinstance(d, (list, tuple)):
            d = ",".join(str(x) for x in d) if d else "none"
        return f"{text} (default: {d})"


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def _pp_one(text: str) -> int:
    v = positive_int(text)
    if v != 1:
        raise argparse.ArgumentTypeError(
            f"inference tools run pipeline-parallel size 1 (a checkpoint saved at any TP/PP layout loads), got {v}")
    return v


def add_parallel_args(p: argparse.ArgumentParser, *, tp_help: str = "tensor-parallel size (= WORLD_SIZE under "
                      "torchrun, or a divisor of it)") -> None:
    """``--tp`` (alias ``--tensor-model-parallel-size``) and ``--pipeline-model-parallel-size`` (only 1 here:
    accepted so Megatron-LM launch scripts run unchanged)."""
    p.add_argument(*TP_FLAGS, dest="tp", type=positive_int, default=1, metavar="TP", help=tp_help)
    p.add_argument(PP_FLAG, dest="pipeline_model_parallel_size", type=_pp_one, default=1, metavar="PP",
                   help="pipeline-parallel size; inference runs PP=1 and loads checkpoints of any layout")


#: What the inference tools' help says about bf16 (one text for every tool).
BF16_HELP = ("run the model in bfloat16 weights (default: bf16 on GPU, fp32 on CPU; on CPU it needs AVX-512 BF16 "
             "or AMX and is refused without). bf16 outputs differ from fp32 outputs, and where the top two logits are "
             "within bf16 rounding a decoder's output can part from greedy AR's (a wider or batched forward rounds "
             "differently); lossless checks are exact in fp32")


def add_precision_args(p: argparse.ArgumentParser) -> None:
    """``--bf16`` / ``--fp16`` (Megatron-LM's switches) set ``params_dtype``; neither: bf16 on GPU, fp32 on CPU."""
    g = p.add_mutually_exclusive_group()
    g.add_argument("--bf16", dest="params_dtype", action="store_const", const="bf16", default=None, help=BF16_HELP)
    g.add_argument("--fp16", dest="params_dtype", action="store_const", const="fp16",
                   help="run the model in float16 (default: bf16 on GPU, fp32 on CPU)")


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
    return {None: default_dtype(), "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def option_strings(p: argparse.ArgumentParser) -> dict[str, tuple[str, ...]]:
    """``dest -> option strings`` of every option of ``p`` (for tests and docs)."""
    return {a.dest: tuple(a.option_strings) for a in p._actions if a.option_strings}
