"""The proposer vLLM runs for ``method: jacobi | mr``: per request, this project's drafting policy.

vLLM loads it as a ``custom_class`` proposer in every worker (:mod:`megatron_jf.vllm_plugin.methods`); the
runner wrap of :mod:`megatron_jf.vllm_plugin.vllm_internals` calls :meth:`JacobiForcingProposer.propose_batch`
after each step with the batch's request ids and what verification found. Per request and step the contract
of :mod:`megatron_jf.decoding` is followed exactly as this project's engine follows it:

* a request's first step (its prefill emitted one token): ``state = policy.new_state(prompt, seed)``;
* every later step: ``policy.observe(state, context, Outcome(g, emitted, len(emitted) - 1))`` with ``g`` the
  target's argmax at every verified draft position plus the bonus token (a row verified without a draft, or a
  step without any draft in the batch, gives ``g = emitted``);
* then ``policy.propose(state, context).draft`` (at most ``num_speculative_tokens``) is the request's next draft.

vLLM verifies whatever is drafted with its rejection sampler, so the output is vLLM's own greedy output (or
its sampling distribution) whatever the policy proposes: the policy only decides how many tokens each forward
yields (TPF, vLLM's "mean acceptance length").
"""

from __future__ import annotations

from megatron_jf.decoding import Outcome, policy_for
from megatron_jf.vllm_plugin.methods import from_additional_config


class JacobiForcingProposer:
    """vLLM ``custom_class`` proposer running a :mod:`megatron_jf.decoding` policy per request.

    Args:
        vllm_config: vLLM's ``VllmConfig``; reads ``speculative_config.num_speculative_tokens`` and
            ``additional_config["megatron_jf"]`` (written by the plugin from ``method: jacobi | mr``).

    Raises:
        RuntimeError: the plugin's decode config is missing (see :func:`methods.from_additional_config`).
    """

    def __init__(self, vllm_config):
        from megatron_jf.vllm_plugin import vllm_internals

        self.method, self.cfg = from_additional_config(vllm_config.additional_config)
        self.policy = policy_for(self.cfg, linear=True)
        self.max_draft = vllm_config.speculative_config.num_speculative_tokens
        self.states: dict[str, object] = {}
        #: when a dict (tests, debugging; set through ``LLM.collective_rpc``): request id -> ``{"prompt": [...],
        #: "drafts": [draft per step]}``, the drafts exactly as proposed
        self.record: dict | None = None
        vllm_internals.activate_recording()

    def load_model(self, *args, **kwargs) -> None:
        """No draft model (vLLM's CPU runner calls this for every drafter)."""

    def propose(self, *args, **kwargs):
        """vLLM's plain ``custom_class`` call: never reached while the plugin's runner wrap is installed."""
        raise RuntimeError("megatron-jf's proposer was called without its runner wrap: the plugin's register() did "
                           "not run in this worker (is VLLM_PLUGINS excluding 'megatron_jf'?)")

    def finish(self, req_ids) -> None:
        """Forget finished requests (their n-gram pools and windows)."""
        for r in req_ids:
            self.states.pop(r, None)

    def propose_batch(self, view) -> list[list[int]]:
        """Observe this step's outcome and return each row's next draft.

        Args:
            view: a :class:`~megatron_jf.vllm_plugin.vllm_internals.BatchView` (rows in the runner's order).

        Returns:
            one draft (``list[int]``, at most ``num_speculative_tokens``) per row; ``[]`` for a row that sampled
            nothing this step (a prefill chunk).
        """
        policy, states = self.policy, self.states
        ver = view.verification
        drafts = []
        for i, rid in enumerate(view.req_ids):
            emitted = view.sampled[i]
            if not emitted:
                drafts.append([])
                continue
            context = view.context(i)
            state = states.get(rid)
            if state is None:
                seed = view.seeds[i]
                state = states[rid] = policy.new_state(context[: view.prompt_lens[i]], 0 if seed is None else seed)
            else:
                g = ver.predictions[i] if ver is not None and ver.drafts[i] else emitted[:1]
                policy.observe(state, context, Outcome(predictions=g, emitted=emitted, from_draft=len(emitted) - 1))
            draft = policy.propose(state, context).draft[: self.max_draft]
            drafts.append(draft)
            if self.record is not None:
                self.record.setdefault(rid, {"prompt": context[: view.prompt_lens[i]], "drafts": []})["drafts"].append(
                    list(draft))
        return drafts
