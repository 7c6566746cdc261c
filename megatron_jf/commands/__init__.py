"""The project's commands: ``jf <command> ...`` (installed), ``python -m megatron_jf.commands.<command>``, or the
``tools/*.py`` files Megatron-LM users call.

======================  ==================================  ===================================================
command                 tool                                what it does
======================  ==================================  ===================================================
``jf convert``          ``tools/convert_hf.py``             Hugging Face <-> megatron checkpoints
``jf generate``         ``tools/generate.py``               text from a checkpoint with any decoder
``jf collect``          ``tools/generate_trajectories.py``  Jacobi trajectories for training (paper Sec. 3.1)
``jf evaluate``         ``tools/evaluate.py``               benchmarks: accuracy, TPF, TPS, speedup
``jf serve``            ``tools/run_text_generation_server.py``  OpenAI- and Megatron-style text server
``jf search``           ``tools/search_inference_config.py``  the best (n, v, K, r) on a benchmark
``jf visualize``        ``tools/visualize_trajectory.py``   a trajectory as HTML and PNG
======================  ==================================  ===================================================

Training is ``pretrain_jf.py`` (Megatron-LM's ``pretrain_gpt.py`` shape; ``torchrun pretrain_jf.py ...``).

Every command's module has a torch-free ``build_parser()`` and ``main(argv=None) -> int``; ``main`` returns the exit
status through :func:`run`, so every command answers a fault the same way:

=====  =====================================================================================================
exit   meaning
=====  =====================================================================================================
0      done
2      bad input: a flag (argparse), a missing or foreign file, a checkpoint that is not one, a bad value; one
       line ``<command>: error: <what>`` on stderr
3      a lossless check failed: a decoder's output differed from greedy AR's (``<command>: LOSSLESS CHECK
       FAILED: ...``)
=====  =====================================================================================================

Modules here import torch inside functions, after parsing (``tests/test_fast_start.py``).
"""

from __future__ import annotations

import sys
from typing import Callable, Sequence

#: exit status of bad input (argparse's own)
EXIT_INPUT = 2
#: exit status of a failed lossless check
EXIT_LOSSLESS = 3
#: the ``jf`` subcommands, each a module of :mod:`megatron_jf.commands`
COMMANDS = ("convert", "generate", "collect", "evaluate", "serve", "search", "visualize")


class InputError(Exception):
    """Bad input a command found after parsing (its message is the one line printed)."""


def run(name: str, body: Callable[[], int | None], input_errors: tuple = ()) -> int:
    """Run a command's ``body`` and map its faults to the exit statuses above.

    Args:
        name: the command's name, first word of the error line.
        body: the command after parsing; returns an exit status (None: 0).
        input_errors: exception types that mean bad input for this command (besides :class:`InputError`, the
            checkpoint-loading errors of :mod:`megatron_jf.load_errors` and ``FileNotFoundError``).

    Returns:
        The exit status.
    """
    from megatron_jf.load_errors import CheckpointFileError, CheckpointNotFound, HFDirectoryError, TokenizerNotFound

    if sys.argv[0].startswith("jf "):  # under the jf dispatcher: the command as typed
        name = sys.argv[0]
    bad_input = (InputError, CheckpointNotFound, TokenizerNotFound, HFDirectoryError, CheckpointFileError,
                 FileNotFoundError, *input_errors)
    try:
        return int(body() or 0)
    except bad_input as e:
        print(f"{name}: error: {e}", file=sys.stderr)
        return EXIT_INPUT
    except Exception as e:  # a lossless violation of any engine layer (matched by name: no torch import here)
        if type(e).__name__ not in ("LosslessViolation", "LosslessError"):
            raise
        print(f"{name}: LOSSLESS CHECK FAILED: {e}", file=sys.stderr)
        return EXIT_LOSSLESS


def main(argv: Sequence[str] | None = None) -> int:
    """``jf <command> [args]``: run a command (``jf --help``: the list)."""
    import importlib

    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(__doc__.split("\n\n")[0] + "\n\ncommands: " + ", ".join(COMMANDS) + "\n\n"
              "jf <command> --help: that command's options")
        return 0 if args else EXIT_INPUT
    if args[0] not in COMMANDS:
        print(f"jf: error: unknown command {args[0]!r}; choose one of {', '.join(COMMANDS)}", file=sys.stderr)
        return EXIT_INPUT
    module = importlib.import_module(f"megatron_jf.commands.{args[0]}")
    prog, sys.argv[0] = sys.argv[0], f"jf {args[0]}"  # argparse's usage line names the command
    try:
        return module.main(args[1:])
    finally:
        sys.argv[0] = prog


def console_main() -> None:
    """The installed ``jf`` command (``setup.py`` console script)."""
    sys.exit(main())
