"""Model hyper-parameters read from a Hugging Face ``config.json`` (Qwen2/Qwen2.5 and Llama families).

:class:`ModelArgs` is the single description of an architecture in this project: the model provider
builds a megatron-core ``GPTModel`` from it, the converter maps weights with it, and it is written
back as ``config.json`` when exporting to Hugging Face.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = {
    "Qwen2ForCausalLM": "qwen2",
    "LlamaForCausalLM": "llama",
}


@dataclass
class ModelArgs:
    """Architecture of a decoder-only LM with RMSNorm, SwiGLU, GQA and RoPE.

    Attributes:
        architecture: HF class name, one of ``SUPPORTED_ARCHITECTURES``.
        vocab_size: rows of the embedding in the HF checkpoint (may exceed the tokenizer's size).
        hidden_size, intermediate_size, num_layers, num_heads, num_kv_heads, head_dim: shapes.
        rms_norm_eps: RMSNorm epsilon.
        rope_theta: RoPE base (Qwen2.5: 1e6, Llama 3: 5e5).
        max_position_embeddings: context window in tokens.
        tie_word_embeddings: output layer shares the input embedding (Qwen2.5 <= 3B).
        qkv_bias: q/k/v projections have biases (Qwen2: True, Llama: False).
        eos_token_ids: stop-token ids from config.json and generation_config.json (union).
        bos_token_id, pad_token_id: as in the HF config, or None.
        extra: other HF config keys, kept verbatim for the round trip back to HF.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def family(self) -> str:
        """``qwen2`` or ``llama`` (the HF ``model_type``)."""
        return SUPPORTED_ARCHITECTURES[self.architecture]

    # ------------------------------------------------------------------ HF config dicts
    @classmethod
    def from_hf_dict(cls, cfg: dict, generation_config: dict | None = None) -> "ModelArgs":
        """Build from a parsed HF ``config.json`` (and optionally ``generation_config.json``).

        Reads the RoPE base from ``rope_parameters["rope_theta"]`` (transformers 5) or the top-level
        ``rope_theta`` (transformers 4).

        Raises:
            ValueError: unsupported ``architectures``, a missing key, a RoPE base that is absent,
                or a RoPE scaling type other than the default (not implemented).
        """
        archs = cfg.get("architectures") or []
        if len(archs) != 1 or archs[0] not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architectures {archs!r} in config.json; supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        arch = archs[0]

        def need(key):
            if key not in cfg or cfg[key] is None:
                raise ValueError(f"config.json is missing required key {key!r}")
            return cfg[key]

        rope = cfg.get("rope_parameters") or {}
        theta = rope.get("rope_theta", cfg.get("rope_theta"))
        if theta is None:
            raise ValueError("config.json gives no RoPE base: neither rope_parameters.rope_theta nor rope_theta")
        rope_type = rope.get("rope_type", (cfg.get("rope_scaling") or {}).get("rope_type", "default"))
        if rope_type not in (None, "default"):
            raise ValueError(f"RoPE scaling type {rope_type!r} is not supported (only 'default')")
        heads = need("num_attention_heads")
        hidden = need("hidden_size")
        head_dim = cfg.get("head_dim") or hidden // heads
        if head_dim * heads != hidden:
            raise ValueError(f"head_dim {head_dim} x heads {heads} != hidden_size {hidden} is not supported")
        eos: list[int] = []
        for src in (cfg, generation_config or {}):
            e = src.get("eos_token_id")
            for x in (e if isinstance(e, list) else [e]):
                if x is not None and int(x) not in eos:
                    eos.append(int(x))
        known = {
            "architectures", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
            "rope_parameters", "rope_scaling", "max_position_embeddings", "tie_word_embeddings",
            "attention_bias", "eos_token_id", "bos_token_id", "pad_token_id", "model_type",
        }
        qkv_bias = True if arch == "Qwen2ForCausalLM" else bool(cfg.get("attention_bias", False))
        if arch == "LlamaForCausalLM" and cfg.get("mlp_bias"):
            raise ValueError("Llama configs with mlp_bias=True are not supported")
        return cls(
            architecture=arch,
            vocab_size=int(need("vocab_size")),
            hidden_size=int(hidden),
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=int(heads),
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            eos_token_ids=eos,
            bos_token_id=cfg.get("bos_token_id"),
            pad_token_id=cfg.get("pad_token_id"),
            extra={k: v for k, v in cfg.items() if k not in known and not k.startswith("_")},
        )

    @classmethod
    def from_hf_dir(cls, path: str) -> "ModelArgs":
        """Read ``config.json`` (+ ``generation_config.json`` if present) from an HF directory.

        Raises:
            FileNotFoundError: the directory or its ``config.json`` is missing.
            ValueError: see :meth:`from_hf_dict`.
        """
        cfg_path = os.path.join(path, "config.json")
        if not os.path.isdir(path):
            raise FileNotFoundError(f"Hugging Face checkpoint directory not found: {path}")
        if not os.path.isfile(cfg_path):
            raise FileNotFoundError(f"missing config.json in {path}")
        with open(cfg_path) as f:
            cfg = json.load(f)
        gen = None
        gen_path = os.path.join(path, "generation_config.json")
        if os.path.isfile(gen_path):
            with open(gen_path) as f:
                gen = json.load(f)
        return cls.from_hf_dict(cfg, gen)

    def to_hf_dict(self) -> dict:
        """The HF ``config.json`` for this architecture (transformers 5 layout, 4.x keys kept too)."""
        cfg = dict(self.extra)
        cfg.update(
            architectures=[self.architecture],
            model_type=self.family,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=self.tie_word_embeddings,
            eos_token_id=self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else list(self.eos_token_ids),
            bos_token_id=self.bos_token_id,
            pad_token_id=self.pad_token_id,
        )
        if self.architecture == "LlamaForCausalLM":
            cfg["attention_bias"] = self.qkv_bias
            cfg["mlp_bias"] = False
        return cfg

    # ------------------------------------------------------------------ serialisation
    def to_dict(self) -> dict:
        """A JSON-serialisable dict (stored in checkpoint metadata)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelArgs":
        """Inverse of :meth:`to_dict`."""
        return cls(**d)

    def validate_parallel(self, tp: int, pp: int) -> None:
        """Check that the architecture splits over ``tp`` tensor and ``pp`` pipeline ranks.

        Raises:
            ValueError: naming the dimension that ``tp`` or ``pp`` does not divide.
        """
        if self.num_heads % tp:
            raise ValueError(f"tensor-parallel size {tp} does not divide num_attention_heads {self.num_heads}")
        if self.num_kv_heads % tp:
            raise ValueError(f"tensor-parallel size {tp} does not divide num_key_value_heads {self.num_kv_heads}")
        if self.intermediate_size % tp:
            raise ValueError(f"tensor-parallel size {tp} does not divide intermediate_size {self.intermediate_size}")
        if self.num_layers % pp:
            raise ValueError(f"pipeline-parallel size {pp} does not divide num_hidden_layers {self.num_layers}")

    def padded_vocab_size(self, tp: int, divisible_by: int = 128) -> int:
        """Vocabulary rows after padding so each TP rank holds an equal multiple of ``divisible_by``."""
        m = divisible_by * tp
        return ((self.vocab_size + m - 1) // m) * m
