"""The measurement loop: AR and decoders timed on the same prompts in one run, losslessness checked, TPF counted,
speedups reported against the faster AR (paper Sec. 4.1: this project's AR or ``transformers`` greedy
on the same weights, whichever is faster).

Used by the evaluator (:mod:`megatron_jf.eval.harness`, per batch: :func:`run_batch`), the inference-config search
(:mod:`megatron_jf.eval.search`), the quickstart report and ``bench/quickstart_variant.py`` (:func:`measure`);
``bench/decode_vs_hf.py`` and ``bench/vllm_decode.py`` pool their figures with :class:`MethodStats` but time their
own way (per-prompt path rotation; one system per worker process).

For each batch of prompts, every method runs back to back on the same token ids (the AR reference first), each
``generate`` call timed on the wall clock; ``transformers`` greedy (when given) then produces exactly the
reference's tokens for each prompt at batch 1, timed end to end and decode-only. A method's output is lossless
when it equals the reference's, prompt by prompt.

Floating-point near ties. The decoders are lossless in exact arithmetic; in floating point a verification forward
over many tokens and AR's one-token forward take differently shaped products, whose rounding differs in the last
bits, so where the two best logits are within that rounding of each other (a near tie) the two runs can take
different tokens and then go on differently. An output that differs from the reference is therefore checked at its
first differing token: a full causal forward of the prompt and the reference's tokens before it gives the two tokens'
logits, and a gap within :func:`near_tie_tolerance` of them (relative ``1e-4`` in fp32) is a near tie
(:class:`NearTie`), recorded and reported but not an error; a larger gap is a losslessness bug
(:class:`LosslessError`). Measured: on an Intel Xeon with AMX one of 100 held-out-template outputs of a 4-layer fp32
model left AR at a gap of 3-5e-6 between logits of 5.47.

Definitions (sums over prompts, ratios of sums):

* TPF = emitted tokens / decode forwards (AR: exactly 1 unless a stop string cut the output);
* TPS (decode) = tokens / decode seconds; end-to-end TPS = tokens / wall seconds, a prompt's wall seconds being its
  batch's ``generate`` time divided by the batch size;
* speedup = a method's decode TPS / the faster AR's decode TPS (:meth:`Speed.speedup`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from megatron_jf.eval.hf_baseline import HF, time_hf_greedy_decode


class LosslessError(AssertionError):
    """A decoder's greedy output differs from greedy AR's other than at a floating-point near tie (the decoders are
    lossless by construction: a bug)."""


#: relative logit gap under which a divergence from the reference is a floating-point near tie (fp32 weights; half
#: precision ones: a few of their epsilons, :func:`near_tie_tolerance`)
NEAR_TIE_RTOL = 1e-4


@dataclass(frozen=True)
class NearTie:
    """Where an output left the reference at a floating-point near tie (see the module docstring).

    Attributes:
        position: index of the first differing response token.
        gap: ``|logit(reference token) - logit(output's token)|`` there, float32, from a full causal forward of the
            prompt and the reference's tokens before it.
        tolerance: the largest gap counted as a near tie there (:func:`near_tie_tolerance`).
    """

    position: int
    gap: float
    tolerance: float


def near_tie_tolerance(a: float, b: float, dtype=None) -> float:
    """The largest logit gap between logits ``a`` and ``b`` counted as a floating-point near tie:
    ``rtol * max(1, |a|, |b|)`` with ``rtol`` = :data:`NEAR_TIE_RTOL`, or 4 epsilons of ``dtype`` (the weights'
    ``torch`` dtype) where that is larger (bf16: 0.031)."""
    import torch

    rtol = NEAR_TIE_RTOL if dtype is None else max(NEAR_TIE_RTOL, 4 * torch.finfo(dtype).eps)
    return rtol * max(1.0, abs(a), abs(b))


def divergence(engine, prompt: list[int], reference: list[int], output: list[int]) -> NearTie | None:
    """Classify an output that differs from the reference tokens of the same prompt.

    Args:
        engine: the :class:`~megatron_jf.inference.engine.Engine` whose model made ``output`` (its full forward gives
            the logits; under tensor parallelism every rank calls this with the same tokens).
        prompt, reference, output: token ids.

    Returns:
        A :class:`NearTie` where the first differing token's logit gap is within :func:`near_tie_tolerance`; None
        otherwise (a larger gap, equal outputs, or one output a prefix of the other: an early stop is no tie).

    Raises:
        ValueError: the model cannot run the inference forward (pipeline parallelism > 1:
            :func:`~megatron_jf.inference.forward.forward_logits`).
    """
    import torch

    from megatron_jf.inference.forward import forward_logits

    k = next((i for i, (r, o) in enumerate(zip(reference, output)) if r != o), None)
    if k is None:
        return None
    ids = torch.tensor([list(prompt) + list(reference[:k])], dtype=torch.long)
    pos = torch.arange(ids.shape[1], dtype=torch.long)[None]
    logits = forward_logits(engine.model, ids, pos)[0, -1].float()
    a, b = float(logits[reference[k]]), float(logits[output[k]])
    tol = near_tie_tolerance(a, b, next(engine.model.parameters()).dtype)
    return NearTie(k, abs(a - b), tol) if abs(a - b) <= tol else None


@dataclass
class BatchRun:
    """One batch, every method on it.

    Attributes:
        results: per method, one :class:`~megatron_jf.inference.results.GenerationResult` per prompt.
        wall_s: per method, the wall seconds of its ``generate`` call on the whole batch.
        lossless: per method, per prompt: tokens equal to the reference's.
        hf: per prompt ``(decode seconds, end-to-end seconds, tokens)`` of ``transformers`` greedy, or None.
        near_ties: per method, ``{prompt index in the batch: NearTie}`` for the outputs that differ from the
            reference at a floating-point near tie (:func:`divergence`); the other differing ones are bugs.
        hf_near_ties: the same for ``transformers`` greedy's outputs.
    """

    results: dict[str, list]
    wall_s: dict[str, float]
    lossless: dict[str, list[bool]]
    hf: list[tuple[float, float, list[int]]] | None = None
    near_ties: dict[str, dict[int, NearTie]] = field(default_factory=dict)
    hf_near_ties: dict[int, NearTie] = field(default_factory=dict)


def _reference_name(methods: dict) -> str | None:
    return next((k for k, c in methods.items() if c.decoder == "ar"), None)


def run_batch(engine, prompts: list[list[int]], methods: dict, *, max_new_tokens: int, eos_ids=frozenset(),
              stop_strings: tuple[str, ...] = (), detokenize=None, hf=None,
              reference: list[list[int]] | None = None) -> BatchRun:
    """Run every method of ``methods`` (name -> :class:`~megatron_jf.decoding.DecodeConfig`) on ``prompts``.

    Args:
        reference: the prompts' reference tokens; default: those of the first AR config in ``methods``.
        hf: a ``transformers`` twin of the model (:func:`~megatron_jf.eval.hf_baseline.hf_twin`) or None.

    Raises:
        ValueError: no reference (neither ``reference`` nor an AR config).
    """
    ref_name = _reference_name(methods)
    if reference is None and ref_name is None:
        raise ValueError("run_batch needs an AR config in methods or reference tokens")
    results, wall = {}, {}
    for name, cfg in methods.items():
        t0 = time.perf_counter()
        results[name] = engine.generate(prompts, cfg, max_new_tokens=max_new_tokens, eos_ids=eos_ids,
                                        stop_strings=tuple(stop_strings), detokenize=detokenize if stop_strings else None)
        wall[name] = time.perf_counter() - t0
    ref = reference if reference is not None else [r.tokens for r in results[ref_name]]
    lossless = {name: [r.tokens == t for r, t in zip(res, ref)] for name, res in results.items()}
    near = {name: {j: tie for j, ok in enumerate(ll) if not ok
                   and (tie := divergence(engine, prompts[j], ref[j], results[name][j].tokens)) is not None}
            for name, ll in lossless.items()}
    hf_runs, hf_near = None, {}
    if hf is not None:
        hf_runs = [time_hf_greedy_decode(hf, p, len(t)) for p, t in zip(prompts, ref)]
        hf_near = {j: tie for j, (run, t) in enumerate(zip(hf_runs, ref)) if run[2] != t
                   and (tie := divergence(engine, prompts[j], t, run[2])) is not None}
    return BatchRun(results, wall, lossless, hf_runs, near, hf_near)


@dataclass
class MethodStats:
    """Totals of one method over every prompt (see the module docstring for the definitions)."""

    name: str
    config: object = None                 # None for transformers greedy
    tokens: int = 0
    forwards: int = 0
    decode_s: float = 0.0
    prefill_s: float = 0.0
    wall_s: float = 0.0
    identical: int = 0
    mismatched: list[int] = field(default_factory=list)   # prompt indices
    near_ties: dict[int, NearTie] = field(default_factory=dict)  # the mismatched ones left at a near tie, by prompt
    outputs: list[list[int]] = field(default_factory=list)
    results: list = field(default_factory=list)

    @property
    def tpf(self) -> float:
        return self.tokens / self.forwards if self.forwards else float("nan")

    @property
    def tps(self) -> float:
        """Decode tokens per second."""
        return self.tokens / self.decode_s if self.decode_s > 0 else float("nan")

    @property
    def tps_e2e(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else float("nan")


@dataclass
class Speed:
    """Every method's totals (in the order run; ``transformers greedy`` last when timed).

    Attributes:
        reference: the AR method the outputs were checked against (None when reference tokens were given).
        outputs: the reference tokens per prompt.
    """

    methods: dict[str, MethodStats]
    reference: str | None
    outputs: list[list[int]]

    @property
    def fastest_ar(self) -> str:
        """Name of the faster AR by decode TPS: the reference AR or ``transformers greedy`` (the reference on ties).

        Raises:
            ValueError: no AR was timed (reference tokens were given instead).
        """
        ars = [n for n in (self.reference, HF) if n in self.methods]
        if not ars:
            raise ValueError("no AR was timed in this measurement")
        return max(ars, key=lambda n: (self.methods[n].tps, n == self.reference))

    def speedup(self, name: str) -> float:
        """Decode TPS of ``name`` / decode TPS of :attr:`fastest_ar`."""
        return self.methods[name].tps / self.methods[self.fastest_ar].tps


def measure(engine, prompts: list[list[int]], methods: dict, *, max_new_tokens: int, batch_size: int = 1,
            eos_ids=frozenset(), stop_strings: tuple[str, ...] = (), detokenize=None, hf=None, strict: bool = True,
            reference: list[list[int]] | None = None, label: str = "") -> Speed:
    """Run ``methods`` on ``prompts`` in batches of ``batch_size`` (:func:`run_batch`), every method back to back on
    each batch, and total them.

    Without an AR config in ``methods`` and without ``reference`` tokens, an AR run named ``AR`` is added first.

    Raises:
        LosslessError: (``strict``) some method's output differs from the reference on some prompt other than at a
            floating-point near tie (those are kept in :attr:`MethodStats.near_ties`).
    """
    methods = dict(methods)
    if reference is None and _reference_name(methods) is None:
        from megatron_jf.decoding import DecodeConfig

        methods = {"AR": DecodeConfig("ar"), **methods}
    ref_name = _reference_name(methods) if reference is None else None
    ref_out = [] if reference is None else [list(t) for t in reference]
    stats = {n: MethodStats(n, c) for n, c in methods.items()}
    if hf is not None:
        stats[HF] = MethodStats(HF)
    for b0 in range(0, len(prompts), batch_size):
        batch = prompts[b0: b0 + batch_size]
        ref = reference[b0: b0 + batch_size] if reference is not None else None
        run = run_batch(engine, batch, methods, max_new_tokens=max_new_tokens, eos_ids=eos_ids,
                        stop_strings=stop_strings, detokenize=detokenize, hf=hf, reference=ref)
        for name, res in run.results.items():
            s = stats[name]
            s.results += res
            s.outputs += [r.tokens for r in res]
            s.tokens += sum(len(r.tokens) for r in res)
            s.forwards += sum(r.forwards for r in res)
            s.decode_s += sum(r.decode_s for r in res)
            s.prefill_s += sum(r.prefill_s for r in res)
            s.wall_s += run.wall_s[name]
            s.identical += sum(run.lossless[name])
            s.mismatched += [b0 + j for j, ok in enumerate(run.lossless[name]) if not ok]
            s.near_ties.update({b0 + j: tie for j, tie in run.near_ties.get(name, {}).items()})
        if ref_name in run.results:
            ref_out += [r.tokens for r in run.results[ref_name]]
        for j, (d, e2e, toks) in enumerate(run.hf or ()):  # exactly the reference's tokens, at batch 1
            s = stats[HF]
            s.tokens, s.forwards = s.tokens + len(toks), s.forwards + len(toks)
            s.decode_s, s.wall_s = s.decode_s + d, s.wall_s + e2e
            s.outputs.append(toks)
            if toks == ref_out[b0 + j]:
                s.identical += 1
            else:
                s.mismatched.append(b0 + j)
                if j in run.hf_near_ties:
                    s.near_ties[b0 + j] = run.hf_near_ties[j]
    if strict:
        bad = {n: [i for i in s.mismatched if i not in s.near_ties] for n, s in stats.items()}
        bad = {n: idx for n, idx in bad.items() if idx}
        if bad:
            name, idx = next(iter(bad.items()))
            raise LosslessError(f"{label + ' ' if label else ''}{name}: {len(idx)} of {len(prompts)} outputs differ "
                                f"from greedy AR (prompts {idx[:10]}) beyond a floating-point near tie: decoder not "
                                "lossless")
    return Speed(stats, ref_name, ref_out)


def warm_up(engine, prompt: list[int], methods: dict, *, max_new_tokens: int = 4, eos_ids=frozenset(), hf=None):
    """One short untimed ``generate`` per method (and ``transformers`` greedy) on ``prompt``, so one-off costs
    (first-use allocations, lazily built weights) do not land in the first timed method."""
    for cfg in methods.values():
        engine.generate([prompt], cfg, max_new_tokens=max_new_tokens, eos_ids=eos_ids)
    if hf is not None:
        time_hf_greedy_decode(hf, prompt, max_new_tokens)
