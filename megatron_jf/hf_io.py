"""Reading and writing Hugging Face checkpoint directories (safetensors + config + tokenizer files).

Exports are laid out as ``transformers``' ``save_pretrained`` writes them: weights split into shards of at most
``max_shard_size`` (``model-00001-of-00003.safetensors`` + ``model.safetensors.index.json``, or one
``model.safetensors`` when they fit; the split is ``huggingface_hub.split_torch_state_dict_into_shards``, the one
``save_pretrained`` calls), ``config.json`` with ``dtype``, and a ``generation_config.json`` that keeps every field
of the source model's (sampling defaults that serving engines read) with the full stop-token list.
"""

from __future__ import annotations

import glob
import json
import os
import shutil

from megatron_jf.models.hf_config import ModelArgs
from megatron_jf.tokenizer import TOKENIZER_FILES, tokenizer_eos_ids

# torch is imported inside the functions that use it: tools/convert_hf.py reads DEFAULT_MAX_SHARD_SIZE while it
# builds its parser, before torch is imported (--help answers at once)


def load_hf_state_dict(path: str) -> dict[str, torch.Tensor]:
    """All tensors of an HF checkpoint directory (``*.safetensors``, sharded or not; ``*.bin`` fallback).

    Raises:
        FileNotFoundError: the directory holds no weight files.
        ValueError: a weight file is corrupt (names it).
    """
    import torch

    index = os.path.join(path, SAFE_INDEX)
    if os.path.isfile(index):
        try:
            weight_map = json.load(open(index))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"corrupt safetensors index {index}: {e}") from None
        files = [os.path.join(path, f) for f in sorted(set(weight_map.values()))]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise FileNotFoundError(f"{index} names shard {os.path.basename(missing[0])}, which is missing")
    else:
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


def read_model_args(path: str) -> ModelArgs:
    """:class:`ModelArgs` of an HF directory with stop tokens = config ∪ generation config ∪ tokenizer."""
    args = ModelArgs.from_hf_dir(path)
    for e in tokenizer_eos_ids(path):
        if e not in args.eos_token_ids:
            args.eos_token_ids.append(e)
    return args


SAFE_INDEX = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = "5GB"


def parse_shard_size(size: int | str) -> int:
    """Bytes in a shard-size limit, parsed as ``save_pretrained`` parses ``max_shard_size``: an int (bytes) or a
    string with a decimal unit (``"5GB"`` = 5·10⁹, ``"500MB"``, ``"1.5GB"``, ``"100KB"``, ``"1TB"``).

    Raises:
        ValueError: not a size (names the accepted units).
    """
    from huggingface_hub import split_torch_state_dict_into_shards

    if isinstance(size, str) and size.strip().isdigit():
        size = int(size.strip())
    if isinstance(size, int):
        if size < 1:
            raise ValueError(f"shard size must be positive, got {size}")
        return size
    try:  # huggingface_hub parses the string (the same call save_pretrained makes)
        split_torch_state_dict_into_shards({}, max_shard_size=size)
        from huggingface_hub.serialization._base import parse_size_to_int
    except ValueError as e:
        raise ValueError(f"invalid shard size {size!r}: {e}") from None
    return parse_size_to_int(size)


def generation_config(args: ModelArgs, source: dict | None = None) -> dict:
    """The ``generation_config.json`` of an export: every field of ``source`` (the original model's: temperature,
    top_p, top_k, repetition_penalty, do_sample, ...) with ``eos_token_id`` set to all stop tokens
    (``args.eos_token_ids``) and bos/pad ids filled in where the source has none."""
    gen = dict(source or {"do_sample": False})
    eos = list(args.eos_token_ids)
    if eos:
        gen["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    for key, val in (("bos_token_id", args.bos_token_id), ("pad_token_id", args.pad_token_id)):
        if gen.get(key) is None and val is not None:
            gen[key] = val
    return gen


def _dtype_name(state: dict[str, torch.Tensor]) -> str:
    import torch

    dts = {v.dtype for v in state.values() if v.is_floating_point()}
    dt = dts.pop() if len(dts) == 1 else torch.float32
    return str(dt).removeprefix("torch.")


def save_hf_checkpoint(out_dir: str, state: dict[str, torch.Tensor], args: ModelArgs, *,
                       tokenizer_dir: str | None = None, overwrite: bool = False,
                       max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
                       generation_source: dict | None = None) -> str:
    """Write an HF directory as ``save_pretrained`` does; ``AutoModelForCausalLM.from_pretrained`` loads it with
    no missing weights.

    Files: safetensors shards of at most ``max_shard_size`` each (a tensor larger than that gets a shard of its
    own) with ``model.safetensors.index.json`` (``metadata.total_size`` in bytes, ``total_parameters``,
    ``weight_map``), or a single ``model.safetensors`` when everything fits; ``config.json`` with ``dtype`` (and
    ``torch_dtype``, the transformers 4 name); ``generation_config.json`` (:func:`generation_config`, from
    ``tokenizer_dir/generation_config.json`` when there is one, else from ``generation_source``); tokenizer files
    copied from ``tokenizer_dir``.
    Written to ``out_dir.tmp`` and renamed.

    Raises:
        FileExistsError: ``out_dir`` exists and ``overwrite`` is False.
        ValueError: ``max_shard_size`` is not a size.
    """
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file


    limit = parse_shard_size(max_shard_size)
    if os.path.exists(out_dir) and not overwrite:
        raise FileExistsError(f"output directory {out_dir} exists (pass --overwrite to replace it)")
    tmp = out_dir.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    split = split_torch_state_dict_into_shards(state, filename_pattern="model{suffix}.safetensors",
                                               max_shard_size=limit)
    for fname, names in split.filename_to_tensors.items():
        save_file({k: state[k].contiguous() for k in names}, os.path.join(tmp, fname), metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": {"total_parameters": sum(v.numel() for v in state.values()), **split.metadata},
                 "weight_map": split.tensor_to_filename}
        with open(os.path.join(tmp, SAFE_INDEX), "w") as f:
            f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
    cfg = args.to_hf_dict()
    cfg["dtype"] = cfg["torch_dtype"] = _dtype_name(state)
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    source = generation_source
    if tokenizer_dir and os.path.isfile(os.path.join(tokenizer_dir, "generation_config.json")):
        with open(os.path.join(tokenizer_dir, "generation_config.json")) as f:
            source = json.load(f)
    with open(os.path.join(tmp, "generation_config.json"), "w") as f:
        json.dump(generation_config(args, source), f, indent=2)
    if tokenizer_dir:
        for name in TOKENIZER_FILES:
            src = os.path.join(tokenizer_dir, name)
            if os.path.isfile(src) and name != "generation_config.json":
                shutil.copy2(src, os.path.join(tmp, name))
    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    return out_dir
