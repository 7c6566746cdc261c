"""The decoding engine: AR, Jacobi, running-window and MR decoding over the megatron-core model.

Every decoder shares one loop (paper Sec. 2.1, 3.2, Algorithm 1). Per request (a batch row):

* the KV cache holds the prompt and the emitted tokens *except the newest one*, ``last``;
* ``draft`` holds guesses for the next ``m`` positions;
* one forward over ``[last] + draft`` (plus recycled candidates for MR) gives, at every position,
  the distribution of the next token. :func:`~megatron_jf.inference.sampling.verify` accepts the
  longest verified prefix and one more token, so each forward emits >= 1 token and the output is
  exactly greedy AR (or, when sampling, exactly AR's distribution);
* the cache keeps ``[last] + accepted``; the tail is rolled back (slots are reused);
* the draft for the next forward is the Jacobi update (each unverified position takes the model's
  prediction from this forward), refilled by the decoder's rule.

Decoders differ only in the draft they keep:

``ar``              no draft: one token per forward (the baseline; TPF is exactly 1).
``jacobi``          block-wise Jacobi: the draft covers the rest of the current block of ``n`` tokens;
                    when the block reaches its fixed point, the next block starts from a fresh draft.
``running-window``  the draft always has ``n`` guesses, refilled as tokens are committed.
``mr``              multi-block decoding + rejection recycling: up to ``K`` blocks of ``n`` in flight,
                    one real-active (RA) block and pseudo-active blocks that follow it on unverified
                    context. A pseudo-active block is spawned when the newest block has at least
                    ``ceil(r*n)`` stable tokens (RA: accepted; pseudo: leading tokens equal to the
                    model's prediction). Its draft and stable tokens carry over and are verified when
                    it is reached. Rejected draft n-grams go to an n-gram pool that persists for the
                    request; up to ``verification_size - 1`` pool candidates for the RA block are
                    verified next to the Jacobi draft, sharing its prefix KV: in the same forward as
                    tree branches, or in a second pass over only the candidates that can still win
                    (:mod:`~megatron_jf.inference.mr_verify`); the branch with the most
                    greedily-matching tokens is verified and wins.

Stopping: any of ``eos_ids`` (kept in the output, nothing after it emitted, counted or cached),
stop strings (needs ``detokenize``; the output ends right before the first occurrence of any of them,
see :class:`GenerationResult`), and ``max_new_tokens`` exactly.

Batching: :class:`BatchSession` (``Engine.open_batch``) is the step-level API -- rows carry their own
:class:`~megatron_jf.inference.request.Request` (decode config, sampling parameters, ``max_new_tokens``, EOS ids,
stop strings), join between steps and leave when finished or removed; :meth:`Engine.generate` is one session
stepped to the end.

Layout (nano-vllm style): the drafting rules are engine-independent policies (:mod:`megatron_jf.decoding`); a
batch is a :class:`~megatron_jf.inference.slots.SlotTable` (KV rows, admission, compaction, swaps), a
:class:`~megatron_jf.inference.runner.ModelRunner` (KV cache, tensor assembly, prefill, forwards; the forward
implementation and its switches an :class:`~megatron_jf.inference.options.InferenceOptions`) and the step
(:mod:`~megatron_jf.inference.session`). Every request ends in one
:class:`~megatron_jf.inference.results.GenerationResult`.
"""

from __future__ import annotations

import dataclasses

import torch

from megatron_jf.decoding import DECODERS, DRAFT_INITS, DecodeConfig, forward_width
from megatron_jf.decoding.width import ForwardCost, StepCalibration
from megatron_jf.inference import cost_model
from megatron_jf.inference.options import InferenceOptions, gemv_mode, mr_verify_mode
from megatron_jf.inference.request import Request, SamplingParams
from megatron_jf.inference.results import GenerationResult
from megatron_jf.inference.session import BatchSession
from megatron_jf.models.gpt import unwrap

__all__ = ["DECODERS", "DRAFT_INITS", "BatchSession", "DecodeConfig", "Engine", "GenerationResult", "InferenceOptions",
           "Request", "SamplingParams", "forward_width"]


class Engine:
    """Greedy/sampled generation with the decoders above.

    Args:
        model: a :class:`~megatron_jf.models.gpt.JFGPTModel` (eval mode), pipeline size 1. Under tensor
            parallelism every rank runs the same calls (same prompts and seeds): logits are gathered,
            so all ranks make the same decisions.
        max_context: the model's context window (prompt + output), tokens.
        options: the forward implementation and its switches, MR's verification mode among them
            (:class:`~megatron_jf.inference.options.InferenceOptions`; None: every field auto). Output is the same
            whichever they are.
        forward_cost: the cost table ``draft_width="auto"`` rows choose their widths by
            (:class:`~megatron_jf.decoding.width.ForwardCost`; used as given, never measured); None: measured on
            this machine when first needed, or read from the cache (:meth:`forward_cost`).

    Attributes:
        options: the :class:`~megatron_jf.inference.options.InferenceOptions` every runner is built with.
        mr_verify: ``tree`` or ``pruned``, as resolved at construction (a runner resolves it again).

    Raises:
        ValueError: a bad ``MEGATRON_JF_MR_VERIFY`` or ``MEGATRON_JF_LEAN_GEMV`` value.
    """

    def __init__(self, model, max_context: int | None = None, check_invariants: bool = False, *,
                 options: InferenceOptions | None = None, forward_cost: ForwardCost | None = None):
        self.model = model
        self.check_invariants = check_invariants  # tests: assert the KV-cache length after every step
        m = unwrap(model)
        self.max_context = max_context or m.model_args.max_position_embeddings
        self.vocab_size = m.vocab_size_unpadded
        device = next(m.parameters()).device
        self.options = InferenceOptions() if options is None else options
        self.mr_verify = mr_verify_mode(self.options.mr_verify, device)  # checked now; a runner resolves it again
        gemv_mode(self.options.gemv)
        self._cost, self._cost_given = forward_cost, forward_cost is not None
        self._cost_covers: dict[int, int] = {}  # torch threads -> most rows the table was last ensured for
        # whole steps against the measured table (a table given to the constructor is taken as it is: tests)
        self.step_calibration = None if self._cost_given else StepCalibration()

    def forward_cost(self, rows: int = 1, max_tokens: int = 81) -> ForwardCost:
        """Seconds of one decode forward by rows x tokens per row on this machine (issue 33): the table given to the
        constructor, else read from the cache or measured now for up to ``rows`` rows and ``max_tokens`` tokens per
        row (a few seconds on a CPU; :mod:`megatron_jf.inference.cost_model`), then kept."""
        if not self._cost_given:
            threads = torch.get_num_threads()
            if self._cost is None or rows > self._cost_covers.get(threads, 0):  # (asked every step: checked once)
                self._cost = cost_model.ensure_cost(self.model, self._cost, rows, max_tokens, self.options)
                self._cost_covers = {threads: rows}
        return self._cost

    # ------------------------------------------------------------------ public API
    def open_batch(self, capacity: int, *, max_width: int = 256, max_len: int | None = None,
                   detokenize=None, split_min_saving: int | None = 256) -> "BatchSession":
        """A step-level decoding session of at most ``capacity`` rows (continuous batching).

        Args:
            capacity: most rows decoding at once (KV-cache rows, reused as rows finish).
            max_width: most tokens one row may forward per step (see :func:`forward_width`); rows whose
                config needs more are refused by :meth:`BatchSession.add`.
            max_len: KV slots per row (default ``max_context + max_width + 1``).
            detokenize: ``ids -> str``, needed by rows with stop strings.
            split_min_saving: a step runs as two forwards (wide rows, then narrow ones such as AR next to
                MR) when that saves at least this many padded tokens; None: always one forward.
        """
        return BatchSession(self, capacity, max_width=max_width, max_len=max_len, detokenize=detokenize,
                            split_min_saving=split_min_saving)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], request: Request | list[Request] | DecodeConfig = DecodeConfig(), *,
                 max_new_tokens: int = 128, sampling: SamplingParams = SamplingParams(),
                 eos_ids: frozenset[int] | set[int] = frozenset(), stop_strings: tuple[str, ...] = (),
                 detokenize=None, record_trajectory: bool = False, on_tokens=None) -> list[GenerationResult]:
        """Generate for a batch of prompts (rows decode independently; shapes are padded per forward).

        One :class:`BatchSession` with every prompt added up front, stepped until all rows finish.

        Args:
            prompts: token ids per request (each non-empty).
            request: a :class:`~megatron_jf.inference.request.Request` for every prompt (prompt ``i`` samples with
                seed ``request.row_seed + i`` and is named ``prompt i`` in errors), a list of one per prompt (used
                as given), or a :class:`DecodeConfig` -- then the keywords below make the Request (and must be left
                at their defaults otherwise).
            max_new_tokens: exact cap on emitted tokens per request (>= 1).
            sampling: greedy (default) or sampling parameters; request ``i`` uses seed ``seed + i``.
            eos_ids: tokens that end a request (kept as its last token).
            stop_strings: strings that end a request (needs ``detokenize(ids) -> str``): the output
                ends right before the first occurrence of any of them (see :class:`GenerationResult`).
            record_trajectory: keep every block's intermediate drafts (``jacobi`` decoder only).
            detokenize: ``ids -> str``, needed by requests with stop strings.
            on_tokens: optional callback ``(row_index, new_token_ids)`` called as tokens are final
                (with stop strings, tokens that may start a stop string are held back until decided).

        Returns:
            one :class:`GenerationResult` per prompt, in order.

        Raises:
            ValueError: an empty prompt, a prompt that leaves no room in the context window for
                ``max_new_tokens``, ``max_new_tokens < 1`` (any invalid :class:`Request` field), stop strings without
                ``detokenize``, trajectory recording with a decoder other than ``jacobi``, a list of requests whose
                length is not the number of prompts, or request keywords next to a Request.
        """
        if not prompts:
            return []
        requests = _requests(len(prompts), request, max_new_tokens=max_new_tokens, sampling=sampling,
                             eos_ids=frozenset(eos_ids), stop_strings=tuple(stop_strings),
                             record_trajectory=record_trajectory)
        width = max(forward_width(r.decode) for r in requests)
        max_len = max(len(p) + r.max_new_tokens for p, r in zip(prompts, requests)) + width + 1
        sess = BatchSession(self, len(prompts), max_width=width, max_len=max_len, detokenize=detokenize)
        for p, r in zip(prompts, requests):
            sess.add(p, r)
        results: dict[int, GenerationResult] = {}
        while sess.num_rows:
            for key, res in sess.step(on_tokens):
                results[key] = res
        return [results[i] for i in range(len(prompts))]


def _requests(n: int, request, **kw) -> list[Request]:
    """One :class:`Request` per prompt from :meth:`Engine.generate`'s arguments (see there)."""
    if isinstance(request, DecodeConfig):
        one = Request(request, kw["sampling"], kw["max_new_tokens"], kw["stop_strings"], kw["eos_ids"],
                      record_trajectory=kw["record_trajectory"])
    else:
        defaults = {"max_new_tokens": 128, "sampling": SamplingParams(), "eos_ids": frozenset(), "stop_strings": (),
                    "record_trajectory": False}
        given = sorted(k for k, v in kw.items() if v != defaults[k])
        if given:
            raise ValueError(f"generate: {', '.join(given)} given next to a Request (set them on the Request)")
        if isinstance(request, Request):
            one = request
        else:
            requests = list(request)
            if len(requests) != n or not all(isinstance(r, Request) for r in requests):
                raise ValueError(f"generate: expected {n} Requests (one per prompt), got {request!r}"[:300])
            return requests
    return [dataclasses.replace(one, seed=one.row_seed + i, name=f"prompt {i}") for i in range(n)]
