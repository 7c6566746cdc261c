"""The model runner of a batch: the KV cache, tensor assembly, prefill and decode forwards over rows of it.

The forward implementation (``lean``, ``static`` -- the lean forward with static shapes and, on CUDA, CUDA graphs
--, ``megatron``, or ``auto``), MR's verification mode, the lean forward's weight copies and CUDA graphs are the
constructor's :class:`~megatron_jf.inference.options.InferenceOptions`; environment variables set fields left at
auto. The runner owns the static decoders of its cache's row views -- at most
``max_static_views``, least recently used dropped -- so their KV buffers, captured graphs and memory pools go when
the runner goes (one runner per :meth:`Engine.generate <megatron_jf.inference.engine.Engine.generate>` call or
batch session).
"""

from __future__ import annotations

import time
from collections import OrderedDict

import torch

from megatron_jf.inference import mr_verify
from megatron_jf.inference.forward import forward_logits
from megatron_jf.inference.lean_forward import lean_forward_for
from megatron_jf.inference.options import (InferenceOptions, cuda_graphs_on, lean_packed_on, mr_verify_mode,
                                           static_decode_on)
from megatron_jf.inference.static_decode import StaticDecoder
from megatron_jf.models.gpt import new_kv_cache, unwrap


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA), so a wall-clock reading after it includes that work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class ModelRunner:
    """Forwards for one batch of ``capacity`` rows of ``max_len`` KV slots each.

    Args:
        model: a :class:`~megatron_jf.models.gpt.JFGPTModel` (eval mode, one pipeline stage).
        capacity, max_len: KV-cache rows and slots per row.
        options: :class:`~megatron_jf.inference.options.InferenceOptions` (None: every field auto). ``forward``
            auto: the lean forward where the model supports it and ``MEGATRON_JF_LEAN_FORWARD`` is on -- its static
            path per ``static_decode`` -- else megatron's. ``gemv`` and ``lean_packed`` set explicitly stay on the
            model's lean forward; auto leaves it as it is (built with the environment's or the size's choice).
        max_static_views: most row views (``[lo, hi)`` ranges) with a static decoder at once.

    Attributes:
        impl: the resolved forward (``lean``, ``static`` or ``megatron``); mr_verify: ``tree`` or ``pruned``;
        cuda_graphs: whether the static path captures CUDA graphs.

    Raises:
        ValueError: a bad ``MEGATRON_JF_*`` value among those the options leave at auto.
    """

    def __init__(self, model, capacity: int, max_len: int, *, options: InferenceOptions | None = None,
                 max_static_views: int = 8):
        m = unwrap(model)
        opts = InferenceOptions() if options is None else options
        self.model = model
        self.options = opts
        self.device = next(m.parameters()).device
        self.mr_verify = mr_verify_mode(opts.mr_verify, self.device)
        self.impl = opts.forward
        self.lean = None
        if opts.forward == "auto":
            self.lean = lean_forward_for(m)
            self.impl = "megatron" if self.lean is None else (
                "static" if static_decode_on(self.device, opts.static_decode) else "lean")
        if self.impl != "megatron" and (opts.gemv != "auto" or opts.lean_packed is not None):
            lean = self._lean()
            if opts.gemv != "auto":
                lean.gemv_transposed = lean._gemv_policy(opts.gemv)
            if opts.lean_packed is not None:
                lean.set_packed(lean_packed_on(opts.lean_packed))
        self.cuda_graphs = cuda_graphs_on(self.device, opts.cuda_graphs)
        self.max_static_views = max_static_views
        #: prefill the prompts of one call as one padded batch (on an accelerator) or each alone (on CPU: a padded
        #: batch computes its padding and gains nothing on a CPU's GEMMs; 16 HumanEval chat prompts through
        #: SmolLM2-135M, one thread: 5.2-6.4 s padded, 3.7 s one at a time)
        self.prefill_together = self.device.type != "cpu"
        self.cache = new_kv_cache(model, capacity, max_len)
        self._static: OrderedDict[tuple[int, int], StaticDecoder] = OrderedDict()

    def _lean(self):
        if self.lean is None:  # lean/static named explicitly: the model's lean forward, built on first use
            from megatron_jf.inference.lean_forward import LeanForward

            m = unwrap(self.model)
            self.lean = getattr(m, "_jf_lean_forward", None) or LeanForward(m)
            m._jf_lean_forward = self.lean
        return self.lean

    def static_decoder(self, lo: int, hi: int, view) -> StaticDecoder:
        """The static decoder of rows ``[lo, hi)`` (made on first use, following ``view``'s lengths)."""
        key = (lo, hi)
        dec = self._static.get(key)
        if dec is None:
            dec = self._static[key] = StaticDecoder(self._lean(), view, use_graphs=self.cuda_graphs)
            if len(self._static) > self.max_static_views:
                self._static.popitem(last=False)
        else:
            self._static.move_to_end(key)
            dec.cache = view
        return dec

    # ------------------------------------------------------------------ forwards
    def prefill(self, prompts: list[list[int]], base: int) -> float:
        """Forward every prompt but its last token (forwarded with the first draft) in a scratch cache, move the
        keys/values into cache rows ``base, base+1, ...`` and commit them. Returns the wall seconds it took,
        device work included."""
        t0 = time.perf_counter()
        groups = [list(range(len(prompts)))] if self.prefill_together else [[i] for i in range(len(prompts))]
        for rows in groups:
            n = len(rows)
            P = max(len(prompts[i]) for i in rows)
            if P <= 1:
                continue
            tmp = new_kv_cache(self.model, n, P - 1)
            toks = torch.zeros(n, P - 1, dtype=torch.long)
            for j, i in enumerate(rows):
                toks[j, : len(prompts[i]) - 1] = torch.tensor(prompts[i][:-1])
            forward_logits(self.model, toks, torch.arange(P - 1).expand(n, P - 1), kv_cache=tmp,
                           return_logits=False, impl=self.impl)  # nobody reads prefill logits
            for j, i in enumerate(rows):
                L = len(prompts[i]) - 1
                self.cache.k[:, base + i, :, :L] = tmp.k[:, j, :, :L]
                self.cache.v[:, base + i, :, :L] = tmp.v[:, j, :, :L]
        synchronize(self.device)
        dt = time.perf_counter() - t0
        for i, p in enumerate(prompts):
            self.cache.lengths[base + i] = len(p) - 1
        return dt

    def decode(self, lo: int, hi: int, seqs: list[list[int]], bases: list[int], n_mains: list[int],
               cand_lens: list[list[int]], tree: bool):
        """One decode forward for cache rows ``[lo, hi)``.

        Args:
            seqs: per row, the tokens to forward: ``[last] + draft`` (``n_mains[i]`` tokens, a causal chain) and,
                with ``tree``, the recycled candidates after it (``cand_lens[i]``), each a branch that sees ``last``
                and itself (:func:`~megatron_jf.inference.mr_verify.tree_mask`).
            bases: per row, the position of ``last`` (its committed length).

        Returns:
            ``(logits, view)``: float32 ``[hi - lo, s, V]`` (``s`` the longest row; shorter rows are padded with a
            causal tail that is never committed) and the cache view the forward wrote (commit on it).
        """
        view = self.cache.view(lo, hi)
        m = hi - lo
        s = max(len(x) for x in seqs)
        mask = torch.ones(m, s, s, dtype=torch.bool).tril_() if tree else None
        if m == 1 and mask is None:  # one row, one causal chain: no padding (the common batch-1 step)
            toks = torch.tensor(seqs)
            pos = torch.arange(bases[0], bases[0] + s).unsqueeze(0)
        else:
            toks = torch.zeros(m, s, dtype=torch.long)
            pos = torch.zeros(m, s, dtype=torch.long)
            for i, (seq, base, n_main, lens) in enumerate(zip(seqs, bases, n_mains, cand_lens)):
                toks[i, : len(seq)] = torch.tensor(seq)
                p = list(range(base, base + n_main))
                if mask is not None and lens:
                    for n in lens:
                        p += range(base + 1, base + 1 + n)
                    mask[i] = mr_verify.tree_mask(n_main, lens, s)
                pos[i, : len(p)] = torch.tensor(p)
                pos[i, len(p):] = base + n_main
        static = self.static_decoder(lo, hi, view) if self.impl == "static" else None
        return forward_logits(self.model, toks, pos, kv_cache=view, new_mask=mask, impl=self.impl,
                              static=static), view

    def second_pass(self, view, i: int, **kw):
        """MR's ``pruned`` verification of row ``i`` of ``view`` after its main-chain forward
        (:func:`~megatron_jf.inference.mr_verify.pruned_second_pass`; ``kw``: its keyword arguments)."""
        return mr_verify.pruned_second_pass(self.model, view.view(i, i + 1), impl=self.impl, **kw)
