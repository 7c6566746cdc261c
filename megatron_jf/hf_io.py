"""Reading and writing Hugging Face checkpoint directories (safetensors + config + tokenizer files)."""

from __future__ import annotations

import glob
import json
import os
import shutil

import torch

from megatron_jf.models.hf_config import ModelArgs


def load_hf_state_dict(path: str) -> dict[str, torch.Tensor]:
    """All tensors of an HF checkpoint directory (``*.safetensors``, sharded or not; ``*.bin`` fallback).

    Raises:
        FileNotFoundError: the directory holds no weight files.
        ValueError: a weight file is corrupt (names it).
    """
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    out: dict[str, torch.Tensor] = {}
    if files:
        from safetensors.torch import load_file

        for f in files:
            try:
                out.update(load_file(f))
            except Exception as e:  # safetensors raises its own error types
                raise ValueError(f"corrupt safetensors file {f}: {e}") from None
        return out
    bins = sorted(glob.glob(os.path.join(path, "pytorch_model*.bin")))
    if not bins:
        raise FileNotFoundError(f"no *.safetensors or pytorch_model*.bin weights in {path}")
    for f in bins:
        try:
            out.update(torch.load(f, map_location="cpu", weights_only=True))
        except Exception as e:
            raise ValueError(f"corrupt weight file {f}: {e}") from None
    return out


def tokenizer_eos_ids(path: str) -> list[int]:
    """EOS ids named by the tokenizer files in ``path`` (empty if there is no loadable tokenizer)."""
    if not any(os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        return []
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception:
        return []
    return [int(tok.eos_token_id)] if tok.eos_token_id is not None else []


def read_model_args(path: str) -> ModelArgs:
    """:class:`ModelArgs` of an HF directory with stop tokens = config ∪ generation config ∪ tokenizer."""
    args = ModelArgs.from_hf_dir(path)
    for e in tokenizer_eos_ids(path):
        if e not in args.eos_token_ids:
            args.eos_token_ids.append(e)
    return args


def save_hf_checkpoint(out_dir: str, state: dict[str, torch.Tensor], args: ModelArgs, *,
                       tokenizer_dir: str | None = None, overwrite: bool = False) -> str:
    """Write an HF directory that ``AutoModelForCausalLM.from_pretrained`` loads with no missing weights.

    Files: ``model.safetensors``, ``config.json``, ``generation_config.json`` (all stop tokens), and
    tokenizer files copied from ``tokenizer_dir``. Written to ``out_dir.tmp`` and renamed.

    Raises:
        FileExistsError: ``out_dir`` exists and ``overwrite`` is False.
    """
    from safetensors.torch import save_file

    from megatron_jf.checkpointing import TOKENIZER_FILES

    if os.path.exists(out_dir) and not overwrite:
        raise FileExistsError(f"output directory {out_dir} exists (pass --overwrite to replace it)")
    tmp = out_dir.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(tmp, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(args.to_hf_dict(), f, indent=2)
    gen = {"eos_token_id": list(args.eos_token_ids), "do_sample": False}
    if args.bos_token_id is not None:
        gen["bos_token_id"] = args.bos_token_id
    if args.pad_token_id is not None:
        gen["pad_token_id"] = args.pad_token_id
    with open(os.path.join(tmp, "generation_config.json"), "w") as f:
        json.dump(gen, f, indent=2)
    if tokenizer_dir:
        for name in TOKENIZER_FILES:
            src = os.path.join(tokenizer_dir, name)
            if os.path.isfile(src) and name != "generation_config.json":
                shutil.copy2(src, os.path.join(tmp, name))
    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    return out_dir
