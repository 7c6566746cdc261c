"""Checkpoints: megatron-core distributed checkpoints (``torch_dist``), saved atomically, loadable at any TP/PP.

Directory layout (Megatron-LM's, so its tools recognise it)::

    CKPT/
      latest_checkpointed_iteration.txt     # "120": the newest complete checkpoint
      iter_0000120/                         # megatron dist_checkpointing files + jf_meta.json
      tokenizer/                            # tokenizer files copied from the HF checkpoint

A save writes ``iter_XXXXXXX.tmp`` and renames it into place, then rewrites the ``latest`` file
through a temporary name, so a crash mid-save leaves the previous checkpoint loadable. Scripts that
save must run under ``if __name__ == "__main__":`` (dist_checkpointing starts a spawn-context manager).
"""

from __future__ import annotations

import json
import os
import shutil

import torch
import torch.distributed as dist

from megatron_jf.fileio import atomic_write_text
from megatron_jf.models.hf_config import ModelArgs

META = "jf_meta.json"
LATEST = "latest_checkpointed_iteration.txt"
FORMAT = "megatron-jf/1"


def iter_dir(ckpt_dir: str, iteration: int) -> str:
    """The directory of one iteration: ``CKPT/iter_0000042``."""
    return os.path.join(ckpt_dir, f"iter_{iteration:07d}")


def latest_iteration(ckpt_dir: str) -> int | None:
    """The newest complete iteration in ``ckpt_dir``, or None if it holds no checkpoint.

    Raises:
        ValueError: the ``latest`` file is corrupt or points to a missing directory.
    """
    path = os.path.join(ckpt_dir, LATEST)
    if not os.path.isfile(path):
        return None
    text = open(path).read().strip()
    if not text.isdigit():
        raise ValueError(f"corrupt checkpoint pointer {path}: {text[:40]!r}")
    it = int(text)
    if not os.path.isfile(os.path.join(iter_dir(ckpt_dir, it), META)):
        raise ValueError(f"{path} names iteration {it} but {iter_dir(ckpt_dir, it)} is missing or incomplete")
    return it


def read_meta(ckpt_dir: str, iteration: int | None = None) -> dict:
    """The ``jf_meta.json`` of a checkpoint (``model_args``, ``iteration``, ``tp``, ``pp``, extras).

    Raises:
        FileNotFoundError: no checkpoint in ``ckpt_dir``.
        ValueError: unknown format or corrupt metadata.
    """
    if not os.path.isdir(ckpt_dir):
        raise FileNotFoundError(f"checkpoint directory not found: {ckpt_dir}")
    it = latest_iteration(ckpt_dir) if iteration is None else iteration
    if it is None:
        raise FileNotFoundError(f"no checkpoint in {ckpt_dir} (missing {LATEST})")
    path = os.path.join(iter_dir(ckpt_dir, it), META)
    if iteration is not None and not os.path.isfile(path):
        have = sorted(int(n[5:]) for n in os.listdir(ckpt_dir)
                      if n.startswith("iter_") and n[5:].isdigit() and os.path.isfile(os.path.join(ckpt_dir, n, META)))
        raise FileNotFoundError(f"{ckpt_dir} has no iteration {iteration}; available: {have or 'none'}")
    try:
        meta = json.load(open(path))
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"corrupt checkpoint metadata {path}: {e}") from None
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: unknown checkpoint format {meta.get('format')!r}, expected {FORMAT!r}")
    return meta


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def save_checkpoint(ckpt_dir: str, iteration: int, model, *, sharded_extra: dict | None = None,
                    common: dict | None = None, tokenizer_dir: str | None = None, keep_last: int | None = None) -> str:
    """Save ``model`` (and optional sharded optimizer state) as iteration ``iteration`` of ``ckpt_dir``.

    Collective: every rank calls it.

    Args:
        model: the (unwrapped or wrapped) :class:`~megatron_jf.models.gpt.JFGPTModel`; it must carry
            ``model_args``.
        sharded_extra: more sharded-state entries saved next to the model (e.g. ``{"optimizer": ...}``
            built with megatron ``ShardedTensor``/``ShardedObject`` factories).
        common: JSON-serialisable training state saved in ``jf_meta.json`` (scheduler, data position, RNG seeds, ...).
        tokenizer_dir: a directory of tokenizer files copied to ``ckpt_dir/tokenizer`` once.
        keep_last: delete older iterations beyond this many (None keeps all).

    Returns:
        The final iteration directory.
    """
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    from megatron_jf.models.gpt import unwrap

    m = unwrap(model)
    final = iter_dir(ckpt_dir, iteration)
    tmp = final + ".tmp"
    if _rank0():
        os.makedirs(ckpt_dir, exist_ok=True)
        if os.path.isdir(tmp):
            shutil.rmtree(tmp)
        os.makedirs(tmp)
        if (tokenizer_dir and not os.path.isdir(os.path.join(ckpt_dir, "tokenizer"))
                and any(os.path.isfile(os.path.join(tokenizer_dir, n)) for n in TOKENIZER_FILES[:-1])):
            _copy_tokenizer(tokenizer_dir, os.path.join(ckpt_dir, "tokenizer"))
    _barrier()
    state = {"model": m.sharded_state_dict(prefix="model.")}
    state.update(sharded_extra or {})
    dist_checkpointing.save(state, tmp)
    _barrier()
    if _rank0():
        meta = {
            "format": FORMAT,
            "iteration": iteration,
            "model_args": m.model_args.to_dict(),
            "tp": ps.get_tensor_model_parallel_world_size(),
            "pp": ps.get_pipeline_model_parallel_world_size(),
            "common": common or {},
        }
        with open(os.path.join(tmp, META), "w") as f:
            json.dump(meta, f, indent=1)
        if os.path.isdir(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        atomic_write_text(os.path.join(ckpt_dir, LATEST), str(iteration))
        if keep_last:
            its = sorted(int(d[5:]) for d in os.listdir(ckpt_dir)
                         if d.startswith("iter_") and d[5:].isdigit())
            for old in its[:-keep_last]:
                shutil.rmtree(iter_dir(ckpt_dir, old), ignore_errors=True)
    _barrier()
    return final


def load_checkpoint(ckpt_dir: str, model, *, iteration: int | None = None,
                    sharded_extra: dict | None = None, strict: bool = True) -> dict:
    """Load model weights (and optional extra sharded state) into ``model`` from ``ckpt_dir``.

    Works across TP/PP layouts: the checkpoint is resharded to the current one.

    Returns:
        ``{"meta": jf_meta, "extra": loaded extra sharded state}``.

    Raises:
        FileNotFoundError: no checkpoint there.
        ValueError: the checkpoint's architecture differs from the model's (names the first field).
    """
    from megatron.core import dist_checkpointing

    from megatron_jf.models.gpt import unwrap

    m = unwrap(model)
    meta = read_meta(ckpt_dir, iteration)
    saved = ModelArgs.from_dict(meta["model_args"])
    for field in ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                  "num_kv_heads", "head_dim", "tie_word_embeddings", "qkv_bias"):
        if getattr(saved, field) != getattr(m.model_args, field):
            raise ValueError(f"checkpoint {ckpt_dir} has {field}={getattr(saved, field)!r} but the model has "
                             f"{getattr(m.model_args, field)!r}: checkpoint from another architecture")
    state = {"model": m.sharded_state_dict(prefix="model.")}
    state.update(sharded_extra or {})
    loaded = dist_checkpointing.load(state, iter_dir(ckpt_dir, meta["iteration"]))
    m.load_state_dict({k[len("model."):]: v for k, v in _flatten_model(loaded["model"]).items()}, strict=strict)
    return {"meta": meta, "extra": {k: v for k, v in loaded.items() if k != "model"}}


def _flatten_model(sd: dict) -> dict:
    return {k: v for k, v in sd.items()}


def load_model(ckpt_dir: str, *, iteration: int | None = None, params_dtype: torch.dtype | None = None):
    """Build the model described by a checkpoint and load its weights (for inference tools).

    Requires :func:`megatron_jf.parallel.initialize` first (any TP/PP layout).

    Returns:
        ``(model in eval mode, ModelArgs, meta)``.
    """
    from megatron_jf.models.gpt import build_model

    meta = read_meta(ckpt_dir, iteration)
    args = ModelArgs.from_dict(meta["model_args"])
    model = build_model(args, params_dtype=params_dtype)
    load_checkpoint(ckpt_dir, model, iteration=meta["iteration"], strict=False)
    return model.eval(), args, meta


def tokenizer_path(ckpt_dir: str) -> str | None:
    """``ckpt_dir/tokenizer`` when the checkpoint carries tokenizer files, else None.

    Raises:
        FileNotFoundError: ``ckpt_dir`` does not exist (so a mistyped ``--load`` is not reported as a
            missing tokenizer).
    """
    if not os.path.isdir(ckpt_dir):
        raise FileNotFoundError(f"checkpoint directory not found: {ckpt_dir}")
    p = os.path.join(ckpt_dir, "tokenizer")
    return p if os.path.isdir(p) else None


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja",
                   "generation_config.json")


def _copy_tokenizer(src: str, dst: str) -> None:
    tmp = dst + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(src, name)):
            shutil.copy2(os.path.join(src, name), os.path.join(tmp, name))
    os.replace(tmp, dst)
