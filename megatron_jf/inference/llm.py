"""The loaded-model facade: a megatron_jf checkpoint, its tokenizer, its stop ids and an :class:`Engine`, loaded
by one call (after nano-vllm's ``LLM`` and Megatron's ``MegatronLLM``).

Every inference entry point (``tools/generate.py``, the text server, the evaluator, the inference-config search,
the trajectory picture, the quickstart report) loads through :meth:`LLM.from_checkpoint`, so the load sequence --
path checks, threads, ``parallel.initialize``, tokenizer, weights, stop ids, engine -- and its error messages are
written once::

    llm = LLM.from_checkpoint("runs/quickstart-default/jf1")
    [res] = llm.generate(["Question: ...\\nAnswer:"], DecodeConfig("jacobi", block_size=16), max_new_tokens=128)
    print(llm.tokenizer.decode(res.tokens))
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

from megatron_jf.load_errors import CheckpointNotFound, TokenizerNotFound

__all__ = ["LLM", "CheckpointNotFound", "TokenizerNotFound"]


@dataclass
class LLM:
    """A model ready for generation (from a checkpoint, or built in this process: :meth:`from_model`).

    Attributes:
        engine: :class:`~megatron_jf.inference.engine.Engine` over the model.
        tokenizer: :class:`megatron_jf.tokenizer.Tokenizer`.
        eos_ids: the stop ids (the tokenizer's eos ids and the checkpoint's ``eos_token_ids``; the server's set too).
        meta: the checkpoint's ``jf_meta.json``.
        ckpt_dir: absolute checkpoint path ("" for :meth:`from_model`).
        model_args: the checkpoint's model arguments (``max_position_embeddings``: the context window).
    """

    engine: Any
    tokenizer: Any
    eos_ids: frozenset
    meta: dict
    ckpt_dir: str
    model_args: Any = None

    @property
    def model(self):
        """The loaded model (``torch.nn.Module``; the engine's)."""
        return self.engine.model

    @classmethod
    def from_checkpoint(cls, ckpt_dir: str, *, tokenizer: Optional[str] = None, tp: int = 1, seed: int = 1234,
                        threads: Optional[int] = None, params_dtype: Optional[str] = None,
                        max_context: Optional[int] = None, options=None) -> "LLM":
        """Initialise (TP ``tp``, PP 1), load the checkpoint and its tokenizer, wrap the model in an Engine.

        Args:
            ckpt_dir: megatron_jf checkpoint directory (from ``tools/convert_hf.py hf-to-mcore`` or training).
            tokenizer: tokenizer path overriding the one the checkpoint carries.
            tp: tensor-parallel size (all ranks must call this identically).
            seed: seed for :func:`megatron_jf.parallel.set_seed`.
            threads: ``torch.set_num_threads`` value (None: leave as is).
            params_dtype: ``"bf16"`` / ``"fp16"`` weights (``--bf16`` / ``--fp16``); None: the platform default.
            max_context: the engine's context window in tokens (None: the model's ``max_position_embeddings``).
            options: the engine's :class:`~megatron_jf.inference.options.InferenceOptions` (None: every field
                auto; :func:`megatron_jf.cli.inference_options` builds it from the ``--inference-*`` flags).

        Raises:
            HFDirectoryError: ``ckpt_dir`` is a Hugging Face model directory (the message gives the conversion).
            CheckpointNotFound: ``ckpt_dir`` missing or not a checkpoint.
            TokenizerNotFound: no tokenizer in the checkpoint and none given.
            CheckpointFileError: a checkpoint file is missing, truncated or foreign.
            ValueError: bf16 on a CPU without native bf16 (:func:`megatron_jf.cli.params_dtype`),
                ``max_context`` beyond the model's context window, or a bad ``MEGATRON_JF_*`` value.
        """
        from megatron_jf.load_errors import reject_hf_dir

        reject_hf_dir(ckpt_dir)  # the one message for a Hugging Face folder (every tool)
        ckpt_dir = os.path.abspath(ckpt_dir)
        if not os.path.isdir(ckpt_dir):  # reported before torch is imported
            raise CheckpointNotFound(f"checkpoint directory does not exist: {ckpt_dir}")
        import torch

        from megatron_jf import parallel
        from megatron_jf.checkpointing import latest_iteration, load_model, tokenizer_path
        from megatron_jf.cli import params_dtype as dtype_of
        from megatron_jf.inference.engine import Engine
        from megatron_jf.tokenizer import load_tokenizer, stop_token_ids

        try:
            it = latest_iteration(ckpt_dir)
        except (OSError, ValueError) as e:
            raise CheckpointNotFound(f"{ckpt_dir} is not a megatron_jf checkpoint: {e}") from e
        if it is None:
            raise CheckpointNotFound(f"{ckpt_dir} holds no megatron_jf checkpoint (no iter_* with jf_meta.json); "
                                     "convert an HF model with tools/convert_hf.py hf-to-mcore")
        if tokenizer is not None and not os.path.exists(tokenizer):
            raise TokenizerNotFound(f"tokenizer does not exist: {tokenizer} (--tokenizer)")
        tok_dir = tokenizer or tokenizer_path(ckpt_dir)
        if tok_dir is None:
            raise TokenizerNotFound(f"no tokenizer: {ckpt_dir} carries none (no tokenizer/ folder) and --tokenizer "
                                    "was not given")
        if threads:
            torch.set_num_threads(int(threads))
        parallel.initialize(tp, 1)
        parallel.set_seed(seed)
        model, args, meta = load_model(ckpt_dir, params_dtype=dtype_of(params_dtype))
        window = args.max_position_embeddings
        if max_context is not None and max_context > window:
            raise ValueError(f"max_context {max_context} (--max-model-len) exceeds the model's context window of "
                             f"{window}")
        tok = load_tokenizer(tok_dir)
        eos = stop_token_ids(tok, args, ckpt_dir)  # the one stop set (also the server's)
        return cls(Engine(model, max_context=max_context, options=options), tok, eos, meta, ckpt_dir, args)

    @classmethod
    def from_model(cls, model, tokenizer=None, eos_ids=(), *, max_context: Optional[int] = None, options=None,
                   check_invariants: bool = False, forward_cost=None, meta: Optional[dict] = None) -> "LLM":
        """An LLM over a model already built in this process (a converted Hugging Face model, a training run's
        model, a bench's random model): the same engine a checkpoint gets, without the load.

        Args:
            model: a megatron_jf GPT model (``torch.nn.Module``; ``model_args`` on it or its unwrapped module).
            tokenizer: :class:`megatron_jf.tokenizer.Tokenizer` or None (then prompts are token ids).
            eos_ids: stop ids (default: none).
            max_context / options: as :meth:`from_checkpoint`.
            check_invariants / forward_cost: :class:`~megatron_jf.inference.engine.Engine`'s test hooks.
            meta: a description kept as :attr:`meta` (default: empty).

        Raises:
            ValueError: a bad inference option (:class:`~megatron_jf.inference.options.InferenceOptions`).
        """
        from megatron_jf.inference.engine import Engine
        from megatron_jf.models.gpt import unwrap

        engine = Engine(model, max_context=max_context, check_invariants=check_invariants, options=options,
                        forward_cost=forward_cost)
        return cls(engine, tokenizer, frozenset(eos_ids), dict(meta or {}), "", unwrap(model).model_args)

    def generate(self, prompts: list, config=None, *, max_new_tokens: int = 128, sampling=None,
                 stop_strings: tuple[str, ...] = (), eos_ids=None, request=None, **kw) -> list:
        """Generate for a batch of prompts: :meth:`Engine.generate <megatron_jf.inference.engine.Engine.generate>`
        with this checkpoint's stop ids and detokenizer.

        Args:
            prompts: per request, text (encoded with the tokenizer, no chat template) or token ids.
            config: :class:`~megatron_jf.decoding.DecodeConfig` (None: its default, greedy AR).
            max_new_tokens: exact cap on emitted tokens per request (>= 1).
            sampling: :class:`~megatron_jf.inference.request.SamplingParams` (None: greedy).
            stop_strings: stop strings (the detokenizer is the checkpoint's tokenizer).
            eos_ids: stop ids replacing the checkpoint's (None: :attr:`eos_ids`).
            request: instead of ``config`` and the keywords above, a
                :class:`~megatron_jf.inference.request.Request` for every prompt or a list of one per prompt
                (as :meth:`Engine.generate`); a Request whose ``eos_ids`` is None gets :attr:`eos_ids`.
            **kw: further ``Engine.generate`` keywords (``record_trajectory``, ``on_tokens``).

        Returns:
            One :class:`~megatron_jf.inference.engine.GenerationResult` per prompt, in order.

        Raises:
            ValueError: an empty prompt, a bad ``max_new_tokens``, a prompt that does not fit the context, or
                ``request`` next to ``config`` or the request keywords.
        """
        ids = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        if request is not None:
            import dataclasses

            from megatron_jf.inference.request import Request

            given = [k for k, v in (("config", config), ("sampling", sampling), ("eos_ids", eos_ids)) if v is not None]
            given += [k for k, v in (("max_new_tokens", max_new_tokens != 128), ("stop_strings", tuple(stop_strings)))
                      if v]
            if given:
                raise ValueError(f"generate: {', '.join(given)} given next to request= (set them on the Request)")

            def own(r):
                return dataclasses.replace(r, eos_ids=self.eos_ids) if r.eos_ids is None else r

            request = own(request) if isinstance(request, Request) else [own(r) for r in request]
            return self.engine.generate(ids, request, detokenize=self.tokenizer.decode, **kw)
        from megatron_jf.decoding import DecodeConfig
        from megatron_jf.inference.request import SamplingParams

        return self.engine.generate(ids, config or DecodeConfig(), max_new_tokens=max_new_tokens,
                                    sampling=sampling or SamplingParams(),
                                    eos_ids=self.eos_ids if eos_ids is None else eos_ids,
                                    stop_strings=tuple(stop_strings), detokenize=self.tokenizer.decode, **kw)
