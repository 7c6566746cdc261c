"""The proposer vLLM runs for ``method: jacobi | mr``: per request, this project's drafting policy.

vLLM loads it as a ``custom_class`` proposer in every worker (:mod:`megatron_jf.vllm_plugin.methods`); the
runner wrap of :mod:`megatron_jf.vllm_plugin.vllm_internals` calls :meth:`JacobiForcingProposer.propose_batch`
after each step with the batch's request ids and what verification found, and :meth:`JacobiForcingProposer.finish`
on every step with the requests vLLM finished. Per request and step the contract of :mod:`megatron_jf.decoding` is
followed exactly as this project's engine follows it:

* a request's first step (its prefill emitted one token): ``state = policy.new_state(prompt, seed)``, with the
  engine's policy or the request's own block size (:func:`~megatron_jf.vllm_plugin.methods.request_block_size`;
  a request with drafting off gets no state and drafts nothing);
* every later step: ``policy.observe(state, context, Outcome(g, emitted, len(emitted) - 1))`` with ``g`` the
  target's argmax at every verified draft position plus the bonus token (a row verified without a draft, or a
  step without any draft in the batch, gives ``g = emitted``);
* then ``policy.propose(state, context).draft`` (at most ``num_speculative_tokens``) is the request's next draft.

What vLLM verified can differ from what the policy proposed. A *prefix* of the draft (vLLM's token budget,
``max_model_len``, structured output, a preempted request re-prefilled without a draft) is what the policies
handle as a short ``g``. *Another* draft (vLLM drafts zeros for the whole batch in a step where a row is too close
to ``max_model_len`` to draft, and the proposer is not called for that step) is adopted as the state's draft
before ``observe`` (:meth:`JacobiForcingProposer.resync`), so the update stays aligned with the positions verified.

vLLM verifies whatever is drafted with its rejection sampler, so the output is vLLM's own greedy output (or
its sampling distribution) whatever the policy proposes: the policy only decides how many tokens each forward
yields (TPF, vLLM's "mean acceptance length").

With ``draft_width: auto`` (the default) the drafts are cut each step to the width that pays on vLLM's own steps,
as this project's engine cuts its own (issue 33): the proposer times every step (from its return to its next call:
vLLM's forward, sampling and bookkeeping) by the tokens it forwarded (:class:`~megatron_jf.decoding.width.StepTimes`)
and picks the width maximising expected tokens per second over the batch's flattened tokens
(:func:`~megatron_jf.decoding.width.choose_flat_width`) from each request's acceptance by draft position and source.
Until two widths are timed it explores: the first steps draft nothing (AR's time), the next the whole draft; later,
now and then (:data:`EXPLORE_EVERY`), a step tries a wider width than any timed where that would pay at the widest
timed step's cost.
``draft_width: fixed`` drafts the whole draft every step.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

from megatron_jf.decoding import DraftState, Outcome, Policy, policy_for
from megatron_jf.decoding.width import StepTimes, choose_flat_width
from megatron_jf.vllm_plugin.methods import from_additional_config, request_block_size

logger = logging.getLogger(__name__)

#: ``draft_width: auto``: at most every this many steps, a step tries a width wider than any timed where it would
#: pay if it cost what the widest timed step did (the step-time table prices an untimed width pessimistically, so it
#: would never be tried otherwise).
EXPLORE_EVERY = 8


@dataclass(eq=False)
class RequestDrafting:
    """One request's drafting in the proposer.

    Attributes:
        policy: the request's policy (the engine's, or one with the request's own block size); None: drafting off.
        state: the policy's state for the request (None when drafting is off).
        drafted_at: the context length (prompt + output tokens) when ``state.draft`` was proposed.
    """

    policy: Policy | None
    state: DraftState | None
    drafted_at: int = -1


class JacobiForcingProposer:
    """vLLM ``custom_class`` proposer running a :mod:`megatron_jf.decoding` policy per request.

    Args:
        vllm_config: vLLM's ``VllmConfig``; reads ``speculative_config.num_speculative_tokens`` and
            ``additional_config["megatron_jf"]`` (written by the plugin from ``method: jacobi | mr``).

    Attributes:
        states: request id -> :class:`RequestDrafting`, for every request vLLM has started and not yet finished
            (:meth:`live_states`).

    Raises:
        RuntimeError: the plugin's decode config is missing (see :func:`methods.from_additional_config`).
    """

    def __init__(self, vllm_config):
        from megatron_jf.vllm_plugin import vllm_internals

        self.method, self.cfg = from_additional_config(vllm_config.additional_config)
        self.policy = policy_for(self.cfg, linear=True)
        self._sized: dict[int, Policy] = {}  # policies of requests with their own block size
        self.max_draft = vllm_config.speculative_config.num_speculative_tokens
        self.states: dict[str, RequestDrafting] = {}
        #: when a dict (tests, debugging; set through ``LLM.collective_rpc``): request id -> ``{"prompt": [...],
        #: "drafts": [draft per step]}``, the drafts exactly as proposed
        self.record: dict | None = None
        #: vLLM's step seconds by tokens forwarded (``draft_width: auto``)
        self.step_times = StepTimes()
        self._returned_at: float | None = None  # when propose_batch last returned
        self._since_explored = 0  # steps since a width wider than any timed was tried
        vllm_internals.activate_recording(type(self))

    def load_model(self, *args, **kwargs) -> None:
        """No draft model (vLLM's CPU runner calls this for every drafter)."""

    def propose(self, *args, **kwargs):
        """vLLM's plain ``custom_class`` call: never reached while the plugin's runner wrap is installed."""
        raise RuntimeError("megatron-jf's proposer was called without its runner wrap: the plugin's register() did "
                           "not run in this worker (is VLLM_PLUGINS excluding 'megatron_jf'?)")

    def finish(self, req_ids) -> None:
        """Forget finished requests (their n-gram pools and windows); unknown ids are ignored."""
        for r in req_ids:
            self.states.pop(r, None)

    def live_states(self) -> int:
        """Requests whose drafting state this proposer holds: 0 once vLLM has finished every request it started
        (an idle server)."""
        return len(self.states)

    def _policy(self, extra_args) -> Policy | None:
        """A new request's policy from its ``SamplingParams.extra_args`` (None: drafting off)."""
        try:
            n = request_block_size(extra_args, self.cfg)
        except ValueError as e:  # the front end refuses these (vllm_internals); never fail a step over one
            logger.warning("megatron-jf: %s; this request drafts with the engine's settings", e)
            n = self.cfg.block_size
        if n == self.cfg.block_size:
            return self.policy
        if n == 0:
            return None
        if n not in self._sized:
            self._sized[n] = policy_for(dataclasses.replace(self.cfg, block_size=n), linear=True)
        return self._sized[n]

    def resync(self, state: DraftState, verified: list[int]) -> None:
        """vLLM verified ``verified``, which is not a prefix of ``state.draft`` or follows a step the proposer did
        not see (vLLM's zero drafts near ``max_model_len``): make it the draft ``observe`` updates from."""
        state.draft = list(verified)

    def propose_batch(self, view) -> list[list[int]]:
        """Observe this step's outcome and return each row's next draft.

        Args:
            view: a :class:`~megatron_jf.vllm_plugin.vllm_internals.BatchView` (rows in the runner's order).

        Returns:
            one draft (``list[int]``, at most ``num_speculative_tokens``) per row; ``[]`` for a row that sampled
            nothing this step (a prefill chunk) or whose request drafts nothing.
        """
        now = time.perf_counter()
        ver = view.verification
        # the step since the last return forwarded one token per row plus the drafts vLLM verified; timed only when
        # every row was a known request's decode step (a prefill in the step would be counted as its tokens)
        if self._returned_at is not None and all(view.sampled[i] and rid in self.states
                                                 for i, rid in enumerate(view.req_ids)):
            tokens = sum(1 + (len(ver.drafts[i]) if ver is not None else 0) for i in range(len(view.req_ids)))
            self.step_times.record(tokens, now - self._returned_at)
        drafts = []
        auto = []  # rows whose drafts the width choice cuts
        for i, rid in enumerate(view.req_ids):
            emitted = view.sampled[i]
            req = self.states.get(rid)
            if not emitted or (req is not None and req.policy is None):
                drafts.append([])
                continue
            context = view.context(i)
            if req is None:
                policy = self._policy(view.extra_args[i])
                seed = view.seeds[i]
                state = None if policy is None else policy.new_state(context[: view.prompt_lens[i]],
                                                                     0 if seed is None else seed)
                req = self.states[rid] = RequestDrafting(policy, state)
                if policy is None:
                    drafts.append([])
                    continue
            else:
                verified = ver.drafts[i] if ver is not None else []
                if isinstance(req.state, DraftState) and (len(context) - len(emitted) != req.drafted_at
                                                          or verified != req.state.draft[: len(verified)]):
                    self.resync(req.state, verified)
                g = ver.predictions[i] if verified else emitted[:1]
                req.policy.observe(req.state, context, Outcome(predictions=g, emitted=emitted,
                                                               from_draft=len(emitted) - 1))
            draft = req.policy.propose(req.state, context).draft[: self.max_draft]
            req.drafted_at = len(context)
            drafts.append(draft)
            if draft and self.cfg.draft_width == "auto":
                auto.append((i, req.policy, req.state))
        if auto:
            try:  # the width only decides how much is verified: never fail vLLM's step over it
                self._cut(drafts, [(i, pol.draft_probs(st)[: len(drafts[i])]) for i, pol, st in auto])
            except Exception as e:  # noqa: BLE001
                logger.warning("megatron-jf: draft width choice failed (%s: %s); whole drafts this step",
                               type(e).__name__, e)
        if self.record is not None:
            for i, (rid, draft) in enumerate(zip(view.req_ids, drafts)):
                if rid in self.states and self.states[rid].policy is not None and view.sampled[i]:
                    self.record.setdefault(rid, {"prompt": view.context(i)[: view.prompt_lens[i]],
                                                 "drafts": []})["drafts"].append(list(draft))
        self._returned_at = time.perf_counter()
        return drafts

    def _cut(self, drafts: list[list[int]], auto: list[tuple[int, list[float]]]) -> None:
        """Cut the ``auto`` rows' drafts (``(row, acceptance by position)``) to the width that pays on vLLM's steps
        as timed so far (see the module docstring); until two widths are timed: no drafts for the first steps, then
        whole ones."""
        cost = self.step_times.table()
        if cost is None:
            w = 0 if self.step_times.steps_at(len(drafts)) < self.step_times.min_steps else None
        else:
            rows = [[] for _ in drafts]
            for i, probs in auto:
                rows[i] = probs
            w = choose_flat_width(cost, rows)
            self._since_explored += 1
            if self._since_explored >= EXPLORE_EVERY:  # a wider step than any timed, priced as the widest timed
                w_try = choose_flat_width(self.step_times.table(optimistic=True), rows)
                if w_try > w and sum(1 + min(w_try, len(d)) for d in drafts) > self.step_times.timed_up_to():
                    w, self._since_explored = w_try, 0
        if w is not None:
            for i, _ in auto:
                del drafts[i][w:]


class WorkerExtension:
    """vLLM worker extension exposing the proposer's live-state count to ``collective_rpc``.

    ``LLM(..., worker_extension_cls="megatron_jf.vllm_plugin.proposer.WorkerExtension")`` then
    ``llm.collective_rpc("jf_live_states")``; the OpenAI server: ``--worker-extension-cls`` with that path and
    ``VLLM_SERVER_DEV_MODE=1``, then ``POST /collective_rpc {"method": "jf_live_states"}``. One int per worker.
    """

    def jf_live_states(self) -> int:
        """Requests whose drafting state this worker's proposer holds (0 without the plugin's proposer)."""
        drafter = getattr(getattr(self, "model_runner", None), "drafter", None)
        return drafter.live_states() if isinstance(drafter, JacobiForcingProposer) else 0
