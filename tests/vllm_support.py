"""Helpers for the vLLM plugin tests (tests/test_vllm_*.py): a reference loop of linear speculative decoding verified by
``transformers`` greedy (tiny real checkpoints with a tokenizer: :func:`megatron_jf.models.zoo.save_with_tokenizer`).

Importing this module imports neither vLLM nor torch (the tests that need them skip where vLLM is missing).
"""

from __future__ import annotations

from megatron_jf.decoding import Outcome, accepted_prefix, draft_rng


def cycle_successor(period: int):
    """Next token of :func:`megatron_jf.models.zoo.peaked_hf_model`'s cycles of ``period`` consecutive ids."""
    return lambda t: t - t % period + (t % period + 1) % period


class RunningWindowRule:
    """Running-window Jacobi (paper Sec. 2.1, 4.3) written out here from the paper, independently of
    :mod:`megatron_jf.decoding`: the next draft is the target's predictions past the accepted prefix (the Jacobi
    update), refilled with tokens drawn uniformly from prompt + output (the request's generator,
    :func:`~megatron_jf.decoding.draft_rng`), ``n`` tokens in all."""

    def __init__(self, n: int):
        self.n = n

    def _fresh(self, st, context, k):
        return [context[st["rng"].randrange(len(context))] for _ in range(k)]

    def new_state(self, prompt, seed):
        st = {"rng": draft_rng(prompt, seed)}
        st["draft"] = self._fresh(st, prompt, self.n)
        return st

    def propose(self, st, context):
        return st["draft"]

    def observe(self, st, context, outcome):
        nxt = outcome.predictions[outcome.from_draft + 1:]
        st["draft"] = nxt + self._fresh(st, context, self.n - len(nxt))


class PolicyRule:
    """A :mod:`megatron_jf.decoding` policy (linear mode) in the reference loop's terms."""

    def __init__(self, policy):
        self.policy = policy

    def new_state(self, prompt, seed):
        return self.policy.new_state(prompt, seed)

    def propose(self, st, context):
        return self.policy.propose(st, context).draft

    def observe(self, st, context, outcome):
        self.policy.observe(st, context, outcome)


def greedy_predictions(hf, tokens: list[int], start: int) -> list[int]:
    """``transformers`` argmax at every position from ``start`` on (one forward over ``tokens``)."""
    import torch

    with torch.no_grad():
        logits = hf(torch.tensor([tokens])).logits[0, start:]
    return logits.argmax(-1).tolist()


def reference_decode(target, rule, prompt: list[int], *, max_tokens: int, max_draft: int, eos: int | None,
                     seed: int = 0):
    """Linear speculative decoding as vLLM does it: the prefill emits one token; each step verifies the rule's
    draft (at most ``max_draft`` tokens) against the target's greedy predictions, emits the accepted prefix and one
    more token, and stops at EOS (kept) or after ``max_tokens``; a step with an empty draft is plain AR.

    Args:
        target: a ``transformers`` causal LM, or a function ``(tokens, start) -> argmax at positions start..``.

    Returns:
        ``(tokens, drafts, accepted)``: the output, and per step with a draft (the steps vLLM's per-request
        spec-decode metrics count), the draft and how many of its tokens were accepted.
    """
    predict = target if callable(target) and not hasattr(target, "config") else (
        lambda tokens, start: greedy_predictions(target, tokens, start))
    ctx = list(prompt)
    out = [predict(ctx, len(ctx) - 1)[0]]
    ctx += out
    drafts, accepted = [], []
    st = rule.new_state(list(prompt), seed)
    while not (eos is not None and out[-1] == eos) and len(out) < max_tokens:
        draft = list(rule.propose(st, ctx))[:max_draft]
        g = predict(ctx + draft, len(ctx) - 1)
        k = accepted_prefix(draft, g)
        emitted = draft[:k] + [g[k]]
        if draft:
            drafts.append(draft)
            accepted.append(k)
        if eos is not None and eos in emitted:
            emitted = emitted[: emitted.index(eos) + 1]
        emitted = emitted[: max_tokens - len(out)]
        out += emitted
        ctx += emitted
        rule.observe(st, ctx, Outcome(predictions=g, emitted=emitted, from_draft=len(emitted) - 1))
    return out, drafts, accepted
