"""``transformers`` greedy decoding on the same weights: the second AR baseline every speedup is checked against.

A speedup "against AR" means little if a user's ordinary ``transformers`` ``generate`` is faster than this
project's AR. So the evaluation, the quickstart report and the benchmarks time ``transformers`` greedy
decoding on the very same weights, threads and prompts in the same run, and report every decoder's speedup
against the *faster* of the two ARs, naming which one it was (the paper's own baseline is HF
eager decoding).

* :func:`hf_twin`: a ``transformers`` model holding a TP=1 megatron model's weights (via
  :func:`~megatron_jf.models.convert.mcore_to_hf`).
* :func:`time_hf_greedy`: wall seconds of greedy ``generate`` producing exactly ``n`` tokens (EOS off, explicit
  ``attention_mask`` so prompt tokens with id 0 are not taken for padding), and its tokens.
* :func:`time_hf_greedy_decode`: the same, with the prefill split off (decode-only seconds).
* :func:`fastest_ar`: which AR is faster, from total wall seconds over the same tokens.
"""

from __future__ import annotations

import time

OURS = "megatron-jf ar"
HF = "transformers greedy"


def hf_twin(model):
    """A ``transformers`` causal LM (eval, in the dtype of ``model``'s weights: fp32, or bf16 under ``--bf16``) with
    the same weights as ``model``, or None under TP > 1.

    Args:
        model: a (possibly wrapped) :class:`~megatron_jf.models.gpt.JFGPTModel` on one pipeline stage.
    """
    import torch
    from megatron.core import parallel_state as ps
    from transformers import AutoConfig, AutoModelForCausalLM

    from megatron_jf.models.convert import mcore_to_hf
    from megatron_jf.models.gpt import unwrap

    if ps.get_tensor_model_parallel_world_size() > 1 or ps.get_pipeline_model_parallel_world_size() > 1:
        return None
    m = unwrap(model)
    args = m.model_args
    d = args.to_hf_dict()
    cfg = AutoConfig.for_model(d.pop("model_type"), **d)
    dtype = next(m.parameters()).dtype
    hf = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    sd = {k: v.to(dtype) for k, v in mcore_to_hf([[m.state_dict()]], args).items()}
    hf.load_state_dict(sd, strict=not args.tie_word_embeddings)
    if args.tie_word_embeddings:
        hf.tie_weights()
    return hf


def time_hf_greedy(hf, prompt: list[int], num_tokens: int) -> tuple[float, list[int]]:
    """Greedy ``generate`` of exactly ``num_tokens`` tokens after ``prompt``.

    Returns:
        ``(wall seconds, generated token ids)``; ``(0.0, [])`` for ``num_tokens < 1``.
    """
    import torch

    if num_tokens < 1:
        return 0.0, []
    ids = torch.tensor([prompt])
    t0 = time.perf_counter()
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=num_tokens,
                          min_new_tokens=num_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    return time.perf_counter() - t0, out[0, len(prompt):].tolist()


def time_hf_greedy_decode(hf, prompt: list[int], num_tokens: int) -> tuple[float, float, list[int]]:
    """Like :func:`time_hf_greedy`, split as this project's engine reports it: ``(decode seconds, end-to-end
    seconds, tokens)``, decode = end-to-end minus a 1-token ``generate`` (its prefill) timed right before."""
    pre, _ = time_hf_greedy(hf, prompt, 1)
    e2e, toks = time_hf_greedy(hf, prompt, num_tokens)
    return max(e2e - pre, 1e-9), e2e, toks


def fastest_ar(ours_wall_s: float, hf_wall_s: float | None) -> tuple[str, float]:
    """``(name, wall seconds)`` of the faster AR over the same tokens (ours when there is no HF timing)."""
    if hf_wall_s is not None and hf_wall_s > 0 and hf_wall_s < ours_wall_s:
        return HF, hf_wall_s
    return OURS, ours_wall_s
