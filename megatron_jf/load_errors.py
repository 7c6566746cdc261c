"""One message for one mistake with ``--load``: a Hugging Face model directory passed where a megatron checkpoint
belongs, a directory that does not exist, or a checkpoint file that is missing, truncated or not what its name says.

Every tool that takes ``--load`` (``tools/generate.py``, ``tools/evaluate.py``, ``tools/generate_trajectories.py``,
``tools/search_inference_config.py``, ``tools/run_text_generation_server.py``, ``tools/convert_hf.py mcore-to-hf``,
``tools/visualize_trajectory.py``, ``pretrain_jf.py``) calls :func:`reject_hf_dir` on it before any other work, so
the same mistake always gets the same message with the command that fixes it. Damaged checkpoint files raise
:class:`CheckpointFileError` (from :func:`megatron_jf.checkpointing.verify_checkpoint_files`), one line naming the
file. This module imports nothing heavy: tools call it before torch is imported.
"""

from __future__ import annotations

import os
import shlex

#: Files that mark a directory written by ``transformers``' ``save_pretrained`` (or downloaded from the Hub).
HF_MARKERS = ("config.json", "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
              "pytorch_model.bin.index.json")
#: Files/folders that mark a megatron checkpoint (this project's or Megatron-LM's): never called HF.
_MCORE_MARKERS = ("latest_checkpointed_iteration.txt", "release")


class HFDirectoryError(FileNotFoundError, ValueError):
    """``--load`` names a Hugging Face model directory, not a megatron checkpoint.

    A ``FileNotFoundError`` (no checkpoint was found there) and a ``ValueError`` (bad input), so every tool's
    existing bad-input handler prints it as a one-line error.
    """


class CheckpointFileError(FileNotFoundError, ValueError):
    """A checkpoint file is missing, truncated or foreign (not the format its name says); the message is one line
    that starts with the file's path and says what is wrong, like the shard errors of :mod:`megatron_jf.data.shards`.

    A ``FileNotFoundError`` and a ``ValueError``, so every tool's existing bad-input handler prints it as a one-line
    error.
    """


class CheckpointNotFound(FileNotFoundError):
    """The ``--load`` directory does not exist or holds no megatron_jf checkpoint."""


class TokenizerNotFound(FileNotFoundError):
    """Neither the checkpoint nor ``--tokenizer`` provides tokenizer files."""


def is_megatron_dir(path: str) -> bool:
    """True when ``path`` is a directory holding a megatron checkpoint (``latest_checkpointed_iteration.txt``,
    ``release/`` or an ``iter_*`` folder at the top level) -- the mirror mistake for tools that read Hugging Face
    directories (``tools/generate_trajectories.py --engine vllm``)."""
    if not os.path.isdir(path):
        return False
    names = os.listdir(path)
    return any(m in names for m in _MCORE_MARKERS) or any(n.startswith("iter_") for n in names)


def is_hf_model_dir(path: str) -> bool:
    """True when ``path`` is a directory laid out like ``save_pretrained`` output and holds no megatron checkpoint.

    Hugging Face: any of :data:`HF_MARKERS` at the top level. Megatron: ``latest_checkpointed_iteration.txt``,
    ``release/`` or an ``iter_*`` folder at the top level (such a directory is a checkpoint even if it also holds a
    ``config.json``).
    """
    if not os.path.isdir(path) or is_megatron_dir(path):
        return False
    return any(m in os.listdir(path) for m in HF_MARKERS)


def hf_dir_message(path: str, flag: str = "--load") -> str:
    """The one-line error for a Hugging Face directory given as ``flag``, with the conversion command."""
    src = os.path.normpath(path)
    out = src + "-mcore"
    found = ", ".join(m for m in HF_MARKERS if os.path.exists(os.path.join(path, m))) or "config.json"
    return (f"{flag} {path} is a Hugging Face model directory ({found}), not a megatron checkpoint; convert it "
            f"first: python tools/convert_hf.py hf-to-mcore --hf {shlex.quote(src)} --out {shlex.quote(out)} "
            f"(then pass {flag} {shlex.quote(out)})")


def reject_hf_dir(path: str | None, flag: str = "--load") -> None:
    """Raise :class:`HFDirectoryError` when ``path`` is a Hugging Face model directory (see :func:`is_hf_model_dir`).

    ``None`` and non-directories pass (the caller reports a missing checkpoint its own way).

    Raises:
        HFDirectoryError: with :func:`hf_dir_message`.
    """
    if path is not None and is_hf_model_dir(path):
        raise HFDirectoryError(hf_dir_message(path, flag))


def check_load_dir(path: str | None, flag: str = "--load") -> None:
    """The checks of a ``--load`` path that need no torch, so a tool reports them before importing it: the directory
    exists and is not a Hugging Face model directory (:func:`reject_hf_dir`). ``None`` passes.

    Raises:
        CheckpointFileError: ``checkpoint directory not found: PATH`` (or not a directory).
        HFDirectoryError: see :func:`reject_hf_dir`.
    """
    if path is None:
        return
    if not os.path.exists(path):
        raise CheckpointFileError(f"checkpoint directory not found: {path} ({flag})")
    if not os.path.isdir(path):
        raise CheckpointFileError(f"{path}: not a directory ({flag} takes a checkpoint directory)")
    reject_hf_dir(path, flag)
