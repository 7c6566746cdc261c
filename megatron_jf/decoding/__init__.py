"""Engine-independent drafting policies: the rules of AR, Jacobi, running-window and MR decoding (paper Sec. 2.1,
3.2, Algorithm 1), as plain Python any engine can call -- this project's batch engine
(:mod:`megatron_jf.inference`) and the vLLM speculative-decoding proposer alike.

Standard library only: no torch, numpy or megatron import anywhere in this package.

Contract
--------
Per request the engine holds one state; per step it asks for a proposal, verifies it, and reports back::

    from megatron_jf.decoding import DecodeConfig, Outcome, policy_for

    policy = policy_for(DecodeConfig("jacobi", block_size=16))   # shared by every request with this config
    state = policy.new_state(prompt, seed)                      # the first draft (Algorithm 1 step 1)
    while True:
        prop = policy.propose(state, context)                   # context = prompt + output (committed tokens)
        # the engine forwards [context[-1]] + prop.draft (+ prop.candidates as tree branches), takes
        # g = argmax at each of the len(prop.draft) + 1 main-chain positions, and verifies -- greedy:
        # accepted_prefix(prop.draft, g) tokens + g[k]; sampling: the speculative rule
        # (megatron_jf/inference/sampling.py) -- then truncates at EOS / max tokens / stop strings
        if finished:
            policy.finish(state, output)                        # Jacobi closes its recorded trajectory
            break
        policy.observe(state, context_after, Outcome(predictions=g, emitted=emitted, from_draft=len(emitted) - 1,
                                                     winner=None))  # or the winning candidate's index

* :class:`Proposal` -- ``draft: list[int]`` and ``candidates: list[list[int]]`` (MR's recycled n-grams, each a
  continuation of ``context[-1]``; empty for the other decoders).
* :class:`Outcome` -- ``predictions`` g (greedy token at every main-chain position, bonus included), ``emitted``
  (tokens committed this step), ``from_draft`` (of them, from the winning branch), ``winner`` (None: the draft).
* The engine may verify only the first ``w`` tokens of the draft (``len(g) = w + 1``: the draft width that pays,
  :mod:`~megatron_jf.decoding.width`, or vLLM's budget); positions past them keep their guesses.
* The next draft is the Jacobi update: position ``j`` of the next draft takes ``g`` at the same output position
  (for Jacobi ``g[k+1:]`` after ``k`` accepted draft tokens), refilled by the decoder's rule
  (:meth:`Policy.init`: ``context`` draws uniformly from prompt + output with the request's own
  ``random.Random``, seeded by the prompt and seed only; ``repeat`` repeats the last token).

A linear verifier (no tree attention, e.g. vLLM) gets one linear draft from MR with
``policy_for(cfg, linear=True)``: the K blocks back to back, the best pool candidate substituted for the real-active
block's part (:class:`~megatron_jf.decoding.mr.MRPolicy`); it then reports ``winner=None``.

Modules
-------
``config``          :class:`DecodeConfig`, ``DECODERS``, ``DRAFT_INITS``, ``DRAFT_WIDTHS``, ``PAPER``,
                    :func:`forward_width`.
``base``            :class:`Proposal`, :class:`Outcome`, :func:`accepted_prefix`, :func:`jacobi_update`, draft
                    initialisation, :class:`Policy` (which records each request's acceptance statistics).
``width``           the draft width that pays: :class:`~.width.ForwardCost`, :class:`~.width.AcceptanceStats`,
                    :func:`~.width.choose_widths`.
``ar``              no draft (TPF exactly 1).
``jacobi``          block-wise Jacobi (fixed point per block of n) and trajectory recording (the training data).
``running_window``  a draft of n guesses, refilled as tokens are committed.
``mr``              multi-block decoding + rejection recycling: blocks in flight, candidates, spawning (Algorithm 1).
``ngram_pool``      MR's candidate pool: :class:`NGramPool` (rejected n-grams) and :class:`ContextNGrams` (prompt
                    lookup: what followed earlier occurrences of the newest token).
"""

from __future__ import annotations

from functools import lru_cache

from megatron_jf.decoding.ar import ARPolicy
from megatron_jf.decoding.base import DraftState, Outcome, Policy, Proposal, accepted_prefix, draft_rng, jacobi_update
from megatron_jf.decoding.config import DECODERS, DRAFT_INITS, DRAFT_WIDTHS, PAPER, DecodeConfig, forward_width
from megatron_jf.decoding.jacobi import JacobiPolicy, JacobiState
from megatron_jf.decoding.mr import MRPolicy, MRState
from megatron_jf.decoding.ngram_pool import ContextNGrams, NGramPool
from megatron_jf.decoding.running_window import RunningWindowPolicy

POLICIES = {"ar": ARPolicy, "jacobi": JacobiPolicy, "running-window": RunningWindowPolicy, "mr": MRPolicy}

__all__ = ["ARPolicy", "ContextNGrams", "DECODERS", "DRAFT_INITS", "DRAFT_WIDTHS", "DecodeConfig", "DraftState",
           "JacobiPolicy", "JacobiState", "MRPolicy", "MRState", "NGramPool", "Outcome", "PAPER", "POLICIES", "Policy",
           "Proposal", "RunningWindowPolicy", "accepted_prefix", "draft_rng", "forward_width", "jacobi_update",
           "policy_for"]


def policy_for(cfg: DecodeConfig, linear: bool = False) -> Policy:
    """The policy of ``cfg.decoder`` (one object per config, shared: policies keep no per-request state).

    Args:
        cfg: the decode config.
        linear: one linear draft per step, no candidates: MR substitutes its best pool candidate (see
            :class:`MRPolicy`); the other decoders' drafts are linear already (no change).
    """
    return _policy(cfg, bool(linear) and cfg.decoder == "mr")


@lru_cache(maxsize=256)
def _policy(cfg: DecodeConfig, linear: bool) -> Policy:
    return MRPolicy(cfg, linear=True) if linear else POLICIES[cfg.decoder](cfg)
