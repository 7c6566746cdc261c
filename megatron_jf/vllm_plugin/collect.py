"""Trajectory collection on vLLM's engine: greedy block-wise Jacobi decoding with every intermediate draft
recorded -- the records of this project's collector (:mod:`megatron_jf.data.collect`, paper Sec. 3.1), computed by
vLLM (paged attention, prefix caching, continuous batching).

Used by ``tools/generate_trajectories.py --engine vllm``; the shards, skip ledgers, manifest and resume logic are
:mod:`megatron_jf.data.collect`'s, unchanged.

How one prompt is decoded (two vLLM requests)
---------------------------------------------
Block-wise Jacobi (:class:`megatron_jf.decoding.JacobiPolicy`): each forward verifies ``[last] + draft``, where the
draft covers the rest of the current block of ``n``; the accepted prefix plus one token is emitted and the rest of
the block takes the target's predictions (the Jacobi update); a block at its fixed point is followed by a fresh
random draft. The policy records every draft of every block (the trajectory).

1. **First iteration: one scoring request.** vLLM attaches drafts to running requests only, so a request's prefill
   cannot verify the first random draft ``d0``. The first iteration is therefore the request ``prompt + d0`` with
   ``max_tokens=1`` and ``prompt_logprobs=1`` in the engine's ``raw_logits`` mode: the top-1 logit at each of the
   ``n`` draft positions and the sampled (greedy) token after the draft are the ``n + 1`` predictions ``g``.
2. **The rest: one speculative-decoding request.** Its prompt is ``prompt + e[:-1]`` (``e``: the tokens the first
   iteration emitted, whose last one is a greedy prediction at that very context, so the prefill emits it again;
   the prompt's cached blocks from step 1 are reused). Its drafts come from this module's ``custom_class`` proposer
   (:class:`TrajectoryProposer`, the vLLM plugin's proposer with the block-wise Jacobi policy), which takes over
   the request's Jacobi state from this process; vLLM verifies each draft and the proposer applies the Jacobi
   update, exactly as this project's engine does per forward.

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, one worker): the Jacobi state objects are
shared between the driver here and the proposer inside vLLM's model runner. After the request finishes, the
proposer's update for the request's last forward (which this project's engine does not make) is undone and the
trajectory is closed with the request's final tokens (:meth:`JacobiPolicy.finish`).

Exactness. Fixed points are vLLM's greedy tokens (fp32: equal to this project's collector and ``transformers``
greedy up to near-ties of the logits; bf16: bf16 greedy, a labelled option). Every recorded iteration must be the
verification of the policy's own draft. Two things break that, and either stops the run with an error naming its
cause before that prompt's record is written: a step that verified only part of a draft (vLLM cuts drafts to its
token budget, and a preempted request is recomputed without a draft: more KV cache or a smaller batch), and a step
whose draft vLLM made itself (it drafts zeros for the whole batch, without calling the proposer, once any row's
context + draft + ``n`` passes ``max_model_len``: :func:`context_room`). The engine is configured so that neither
happens -- chunked prefill off, a token budget that fits every row's full draft, ``max_model_len`` at least the
longest prompt + response + :func:`context_room` -- given KV cache for the batch.
"""

from __future__ import annotations

import os
import time
from collections import deque
from dataclasses import asdict, dataclass, fields
from types import SimpleNamespace
from typing import Callable, Sequence

from megatron_jf.decoding import DecodeConfig, DraftState, JacobiPolicy, JacobiState, Outcome, accepted_prefix
from megatron_jf.vllm_plugin.methods import ADDITIONAL_CONFIG_KEY
from megatron_jf.vllm_plugin.proposer import JacobiForcingProposer

__all__ = ["PROPOSER_PATH", "TrajectoryState", "CollectorPolicy", "TrajectoryProposer", "JacobiResult",
           "VLLMCollector", "check_hf_model_dir", "model_args", "context_window", "context_room", "engine_length",
           "kv_cache_estimate",
           "has_tokenizer", "weights_fingerprint",
           "default_dtype", "vllm_version", "collect", "cut_emitted", "top1_token"]

#: the proposer class vLLM loads (``speculative_config = {"method": "custom_class", "model": PROPOSER_PATH}``).
PROPOSER_PATH = "megatron_jf.vllm_plugin.collect.TrajectoryProposer"
_METHOD = "jacobi-trajectory"

# Jacobi states handed from the driver to the proposer, keyed by (the main request's prompt, its SamplingParams.seed
# -- a number unique per request, used only as this key). Same process: see the module docstring.
_HANDOFF: dict[tuple, "TrajectoryState"] = {}


@dataclass(eq=False)
class TrajectoryState(JacobiState):
    """A recorded block-wise Jacobi state with what the collector counts.

    Attributes:
        iterations: Jacobi iterations (verification forwards) applied so far.
        undo: ``(blocks, drafts of the last block, it had a fixed point)`` before the last update, or None.
        short_steps: updates whose verification covered fewer positions than the draft (vLLM cut the draft).
        foreign_steps: updates of a draft vLLM made itself (zeros near ``max_model_len``), not the policy's.
    """

    iterations: int = 0
    undo: tuple | None = None
    short_steps: int = 0
    foreign_steps: int = 0

    @classmethod
    def of(cls, st: JacobiState) -> "TrajectoryState":
        return cls(**{f.name: getattr(st, f.name) for f in fields(JacobiState)})

    def undo_last(self) -> None:
        """Revert the trajectory to before the last :meth:`CollectorPolicy.observe` (no-op if there was none); the
        iteration stays counted (its forward happened)."""
        if self.undo is None:
            return
        nb, nd, had_fp = self.undo
        del self.traj[nb:]
        blk = self.traj[-1]
        del blk["drafts"][nd:]
        if not had_fp:
            blk.pop("fixed_point", None)
        self.undo = None


class CollectorPolicy(JacobiPolicy):
    """Block-wise Jacobi with recording, whose states are created by the collector (:class:`VLLMCollector`).

    ``new_state`` (called by the plugin's proposer on a request's first step) returns the state the collector
    handed over for that prompt and seed; any other request (the first-iteration scoring requests) gets an empty
    draft. ``observe`` counts iterations and keeps what :meth:`TrajectoryState.undo_last` needs.
    """

    def new_state(self, prompt: list[int], seed: int, *, record_trajectory: bool = False):
        st = _HANDOFF.pop((tuple(prompt), seed), None)
        return st if st is not None else DraftState(len(prompt), [], None)

    def observe(self, state, context: list[int], outcome: Outcome) -> None:
        if not isinstance(state, TrajectoryState):
            return
        if len(outcome.predictions) != len(state.draft) + 1:
            state.short_steps += 1
        traj = state.traj
        state.undo = (len(traj), len(traj[-1]["drafts"]), "fixed_point" in traj[-1])
        state.iterations += 1
        super().observe(state, context, outcome)


class TrajectoryProposer(JacobiForcingProposer):
    """The vLLM plugin's proposer (:class:`~megatron_jf.vllm_plugin.proposer.JacobiForcingProposer`) running
    :class:`CollectorPolicy`. Loaded by vLLM from :data:`PROPOSER_PATH`; needs the collector's decode config
    (``decoder='jacobi'``) in ``additional_config`` (:meth:`VLLMCollector.engine_kwargs`)."""

    def __init__(self, vllm_config):
        super().__init__(vllm_config)
        if self.method != _METHOD or self.cfg.decoder != "jacobi":
            raise RuntimeError(f"{PROPOSER_PATH} is the trajectory collector's proposer; it runs only in the engine "
                               f"megatron_jf.vllm_plugin.collect.VLLMCollector builds")
        self.policy = CollectorPolicy(self.cfg)

    def resync(self, state, verified: list[int]) -> None:
        """A draft the policy did not make was verified: counted, and the prompt's collection fails
        (:meth:`VLLMCollector.decode`); no trajectory step is recorded from it as if it were Jacobi's."""
        if isinstance(state, TrajectoryState):
            state.foreign_steps += 1
        super().resync(state, verified)


@dataclass
class JacobiResult:
    """One decoded prompt, in the shape :func:`megatron_jf.data.collect.build_record` reads.

    Attributes:
        tokens: the response token ids.
        trajectory: per block ``{"context_len", "drafts", "fixed_point"}`` (:class:`JacobiPolicy` layout).
        finish_reason: ``"eos"`` or ``"length"``.
        forwards: Jacobi iterations (verification forwards; the second request's prefill not counted).
        prefill_disagreed: the second request's prefill did not re-derive the first iteration's last token (a
            near-tie of the logits between two vLLM forwards; the record follows the second request).
    """

    tokens: list[int]
    trajectory: list[dict]
    finish_reason: str
    forwards: int
    prefill_disagreed: bool = False


def check_hf_model_dir(path: str) -> dict:
    """Return the ``config.json`` of a Hugging Face model directory (what vLLM loads).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: ``path`` is a megatron checkpoint (names the export command) or has no ``config.json``.
    """
    import json

    from megatron_jf.load_errors import is_megatron_dir

    if not os.path.isdir(path):
        raise FileNotFoundError(f"model directory not found: {path}")
    if is_megatron_dir(path):
        raise ValueError(f"{path} is a megatron checkpoint; --engine vllm reads Hugging Face models: export it first "
                         f"with python tools/convert_hf.py mcore-to-hf --load {path} --out {path.rstrip('/')}_hf")
    cfg = os.path.join(path, "config.json")
    if not os.path.isfile(cfg):
        raise ValueError(f"{path} is not a Hugging Face model directory (no config.json)")
    try:
        with open(cfg, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {cfg}: {e}") from None


def model_args(hf_config: dict) -> SimpleNamespace:
    """``vocab_size`` and ``eos_token_ids`` (a list) of a ``config.json`` dict, as
    :func:`megatron_jf.tokenizer.stop_token_ids` and the tokenizer check read them (any architecture vLLM loads)."""
    e = hf_config.get("eos_token_id")
    eos = [int(x) for x in (e if isinstance(e, list) else [e]) if x is not None]
    return SimpleNamespace(vocab_size=int(hf_config.get("vocab_size") or 0), eos_token_ids=eos)


def context_window(hf_config: dict) -> int:
    """The model's context length (``max_position_embeddings``; 2048 when the config does not say)."""
    return int(hf_config.get("max_position_embeddings") or 2048)


def context_room(block_size: int) -> int:
    """Tokens of ``max_model_len`` that collection needs past prompt + response, for a block size ``n``.

    vLLM runs the proposer after a step only if every row's context before the step plus its scheduled draft plus
    ``n`` (the configured draft length) fits in ``max_model_len`` (``GPUModelRunner._input_fits_in_drafter``);
    otherwise it drafts zeros for the whole batch. A running row has at most ``P + max_new - 1`` tokens before a
    step and a draft of at most ``n``: ``P + max_new - 1 + 2n <= max_model_len``, a room of ``2n - 1`` (reached
    when a block starts at the response's last token, ``max_new = 1 (mod n)``).
    """
    return 2 * block_size - 1


def engine_length(longest_prompt: int, max_new_tokens: int, block_size: int) -> int:
    """vLLM's ``max_model_len`` for collecting prompts of up to ``longest_prompt`` tokens with up to
    ``max_new_tokens`` each at block size ``n``: ``longest_prompt + max_new_tokens +`` :func:`context_room`."""
    return longest_prompt + max_new_tokens + context_room(block_size)


def kv_cache_estimate(hf_config: dict, dtype: str) -> int:
    """KV-cache bytes per token of a decoder ``config.json`` in ``dtype``: 2 (K and V) x layers x KV heads x head
    size x element size."""
    heads = int(hf_config.get("num_attention_heads") or 1)
    head_dim = int(hf_config.get("head_dim") or int(hf_config.get("hidden_size", 0)) // heads)
    kv_heads = int(hf_config.get("num_key_value_heads") or heads)
    size = 4 if dtype in ("float32", "float") else 2
    return 2 * int(hf_config.get("num_hidden_layers", 0)) * kv_heads * head_dim * size


def has_tokenizer(path: str) -> bool:
    """Whether a model directory holds tokenizer files (``tokenizer.json`` / ``tokenizer_config.json`` /
    ``tokenizer.model``)."""
    return any(os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json",
                                                                 "tokenizer.model"))


def weights_fingerprint(path: str) -> list:
    """``[name, bytes, mtime_ns]`` of every weight file of a model directory: what a resumed run must find again
    (a re-exported or retrained model changes it)."""
    names = sorted(f for f in os.listdir(path) if f.endswith((".safetensors", ".bin", ".pt")))
    return [[f, os.path.getsize(os.path.join(path, f)), os.stat(os.path.join(path, f)).st_mtime_ns] for f in names]


def default_dtype() -> str:
    """vLLM dtype when neither ``--bf16`` nor ``--fp16`` is given: as this project's engine, bf16 on a GPU and fp32
    on CPU."""
    import torch

    return "bfloat16" if torch.cuda.is_available() else "float32"


def vllm_version() -> str:
    import vllm

    return vllm.__version__


def cut_emitted(emitted: list[int], eos_ids: frozenset, room: int) -> tuple[list[int], str]:
    """This project's engine's end-of-request rule for one forward's tokens: cut after the first EOS, then to the
    ``room`` left; the finish reason (``eos`` / ``length``) or ``""``."""
    finish = ""
    for j, t in enumerate(emitted):
        if t in eos_ids:
            emitted, finish = emitted[: j + 1], "eos"
            break
    if len(emitted) > room:
        emitted = emitted[:room]
        finish = "eos" if emitted and emitted[-1] in eos_ids else "length"
    elif len(emitted) == room and not finish:
        finish = "length"
    return emitted, finish


@dataclass
class _Job:
    key: int
    sample_id: str
    prompt: list[int]
    state: TrajectoryState
    head: list[int]  # tokens emitted by the first iteration


class VLLMCollector:
    """A vLLM engine set up for trajectory collection, and the driver that decodes prompts on it.

    Args:
        model: a Hugging Face model directory (e.g. ``tools/convert_hf.py mcore-to-hf`` output).
        block_size: n.
        draft_init: ``context`` | ``repeat`` (:class:`~megatron_jf.decoding.DecodeConfig`).
        dtype: vLLM's dtype (``float32``, ``bfloat16``, ...).
        max_num_seqs: requests decoded together (vLLM's batch).
        max_model_len: vLLM's context length (default: the model's, :func:`context_window`); prompts up to
            ``max_model_len - context_room(n)`` tokens with their responses fit (:attr:`max_context`).
        kv_cache_bytes: KV-cache size (default on CPU: :func:`kv_cache_estimate` for ``max_num_seqs`` requests
            of ``max_model_len`` tokens, twice; on a GPU: vLLM's, from ``gpu_memory_utilization``).
        enforce_eager: skip vLLM's ``torch.compile`` (faster start, slower steps).
        extra: further ``vllm.LLM`` keyword arguments.

    Raises:
        FileNotFoundError, ValueError: see :func:`check_hf_model_dir`.
    """

    def __init__(self, model: str, *, block_size: int, draft_init: str = "context", dtype: str = "float32",
                 max_num_seqs: int = 32, max_model_len: int | None = None, kv_cache_bytes: int | None = None,
                 enforce_eager: bool = False, **extra):
        hf_config = check_hf_model_dir(model)
        self.model = model
        self.n = block_size
        # a trajectory is the whole block every step (as this project's engine records it): the fixed width
        self.decode_config = DecodeConfig("jacobi", block_size=block_size, draft_init=draft_init, draft_width="fixed")
        self.policy = CollectorPolicy(self.decode_config)
        self.max_num_seqs = max_num_seqs
        self.vocab_size = int(hf_config.get("vocab_size", 0))
        self.max_model_len = int(max_model_len or context_window(hf_config))
        self.max_context = self.max_model_len - context_room(block_size)
        self.dtype = dtype
        if kv_cache_bytes is None and default_dtype() == "float32":  # CPU: vLLM would reserve most of the RAM
            kv_cache_bytes = 2 * max_num_seqs * self.max_model_len * kv_cache_estimate(hf_config, dtype)
        self.prefill_disagreements = 0  # see JacobiResult.prefill_disagreed, counted by collect()
        self._eos_ids: frozenset = frozenset()
        kw = self.engine_kwargs(kv_cache_bytes=kv_cache_bytes, enforce_eager=enforce_eager)
        kw.update(extra)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process (read when it starts)
        from vllm import LLM

        self.llm = LLM(model, **kw)
        self.engine = self.llm.llm_engine
        self._keys = 0

    def engine_kwargs(self, *, kv_cache_bytes: int | None, enforce_eager: bool) -> dict:
        """The ``vllm.LLM`` arguments: the trajectory proposer as a ``custom_class`` speculative method with
        ``n`` draft tokens, prefix caching on, chunked prefill off and a token budget that always fits every
        request's full draft (so vLLM never verifies part of one), raw logits for the scoring requests, one
        in-process worker."""
        n = self.n
        budget = max(self.max_num_seqs * (n + 1), self.max_model_len) + self.max_num_seqs
        kw = dict(dtype=self.dtype, max_model_len=self.max_model_len, max_num_seqs=self.max_num_seqs,
                  max_num_batched_tokens=budget, enable_prefix_caching=True, enable_chunked_prefill=False,
                  logprobs_mode="raw_logits", distributed_executor_backend="uni", tensor_parallel_size=1,
                  enforce_eager=enforce_eager, skip_tokenizer_init=True, seed=0,
                  speculative_config={"method": "custom_class", "model": PROPOSER_PATH, "num_speculative_tokens": n},
                  additional_config={ADDITIONAL_CONFIG_KEY: dict(asdict(self.decode_config), method=_METHOD)})
        if kv_cache_bytes:
            kw["kv_cache_memory_bytes"] = int(kv_cache_bytes)
        return kw

    # ------------------------------------------------------------------ the two requests of a prompt
    def _params(self, **kw):
        from vllm import SamplingParams

        return SamplingParams(temperature=0.0, detokenize=False, ignore_eos=True, **kw)

    def _add(self, job: _Job, prompt: list[int], params) -> None:
        self.engine.add_request(str(job.key), {"prompt_token_ids": prompt}, params)

    def _start(self, sample_id: str, prompt: list[int], seed: int) -> _Job:
        st = TrajectoryState.of(self.policy_new_state(prompt, seed))
        self._keys += 1
        job = _Job(self._keys, sample_id, list(prompt), st, [])
        self._add(job, job.prompt + st.draft, self._params(max_tokens=1, prompt_logprobs=1))
        return job

    def policy_new_state(self, prompt: list[int], seed: int) -> JacobiState:
        """The prompt's first draft, seeded as in this project's engine (by ``seed`` and the prompt)."""
        return JacobiPolicy.new_state(self.policy, prompt, seed, record_trajectory=True)

    def _first_iteration(self, job: _Job, out, max_new: int, eos_ids: frozenset) -> JacobiResult | None:
        """Apply the scoring request's predictions; start the second request or return the finished result."""
        st, P = job.state, len(job.prompt)
        plp = out.prompt_logprobs  # [None, {id: Logprob(rank=...)}...] per prompt position
        g = [top1_token(plp[P + j]) for j in range(len(st.draft))] + [out.outputs[0].token_ids[0]]
        k = accepted_prefix(st.draft, g)
        emitted, finish = cut_emitted(st.draft[:k] + [g[k]], eos_ids, max_new)
        job.head = emitted
        if finish:
            st.iterations = 1
            self.policy.finish(st, emitted)
            return JacobiResult(emitted, st.traj, finish, 1)
        self.policy.observe(st, job.prompt + emitted, Outcome(g, emitted, len(emitted) - 1))
        st.undo = None
        main_prompt = job.prompt + emitted[:-1]
        _HANDOFF[(tuple(main_prompt), job.key)] = st
        self._add(job, main_prompt, self._params(max_tokens=max_new - len(emitted) + 1, seed=job.key,
                                                 stop_token_ids=sorted(eos_ids)))
        return None

    def _close(self, job: _Job, out) -> JacobiResult:
        st = job.state
        if _HANDOFF.pop((tuple(job.prompt + job.head[:-1]), job.key), None) is not None:
            raise RuntimeError(f"sample {job.sample_id!r}: the trajectory proposer never took over the request (is "
                               f"vLLM running its engine in another process? VLLM_ENABLE_V1_MULTIPROCESSING must be 0)")
        comp = out.outputs[0]
        tail = list(comp.token_ids)
        tokens = job.head[:-1] + tail
        if st.foreign_steps:
            raise ValueError(f"sample {job.sample_id!r}: vLLM skipped the proposer for {st.foreign_steps} step(s) "
                             f"and verified its own zero drafts (a row's context + draft + n passed max_model_len="
                             f"{self.max_model_len}; prompt + response must stay within max_context="
                             f"{self.max_context}); the trajectory would not be block-wise Jacobi's")
        if st.short_steps:
            raise ValueError(f"sample {job.sample_id!r}: vLLM verified only part of {st.short_steps} draft(s) (its "
                             f"token budget, or a preempted request: give the engine more KV cache with --kv-cache-gb "
                             f"or decode fewer prompts together with --batch-size); the trajectory would not be "
                             f"block-wise Jacobi's")
        st.undo_last()
        self.policy.finish(st, tokens)
        finish = "eos" if tokens[-1] in self._eos_ids else "length"  # vLLM stops at the first stop id
        return JacobiResult(tokens, st.traj, finish, st.iterations, prefill_disagreed=tail[:1] != job.head[-1:])

    # ------------------------------------------------------------------ the loop
    def decode(self, jobs: Sequence[tuple[str, list[int], int]], *, max_new_tokens: int, eos_ids,
               on_result: Callable[[str, JacobiResult], None]) -> None:
        """Decode ``(sample_id, prompt ids, draft seed)`` jobs with up to ``max_num_seqs`` in flight (continuous
        batching); call ``on_result(sample_id, result)`` as each finishes (completion order).

        Raises:
            ValueError: vLLM verified part of a draft (token budget, context length, a preempted request) or
                rejected a prompt.
            RuntimeError: the proposer did not take a request over (the engine runs in another process).
        """
        eos_ids = self._eos_ids = frozenset(eos_ids)
        queue = deque(jobs)
        live: dict[str, tuple[_Job, int]] = {}  # request id -> (job, phase 1 | 2)
        while queue or live:
            while queue and len(live) < self.max_num_seqs:
                sid, ids, seed = queue.popleft()
                job = self._start(sid, ids, seed)
                live[str(job.key)] = (job, 1)
            for out in self.engine.step():
                if not out.finished:
                    continue
                job, phase = live.pop(out.request_id)
                res = (self._first_iteration(job, out, max_new_tokens, eos_ids) if phase == 1
                       else self._close(job, out))
                if res is None:
                    live[str(job.key)] = (job, 2)
                else:
                    on_result(job.sample_id, res)


def top1_token(entry) -> int:
    """The rank-1 token of one position's prompt logprobs (``{token id: Logprob}``)."""
    best = [t for t, lp in entry.items() if lp.rank == 1]
    if not best:
        raise RuntimeError("vLLM returned prompt logprobs without a rank-1 token")
    return min(best)


def collect(collector: VLLMCollector, prompts, config, *, writer=None, ledger=None, on_batch=None):
    """:func:`megatron_jf.data.collect.collect` on vLLM: decode ``prompts`` (tokenised, fitting the context) with
    recorded block-wise Jacobi and keep each result (:func:`~megatron_jf.data.collect.keep_result`: record,
    repetition filter, shard writer, skip ledger).

    Draft seeds are the reference collector's: prompts are cut into batches of ``config.batch_size`` in the given
    order and each batch's seed is :func:`~megatron_jf.data.collect.batch_seed` of the run seed and its first id,
    so the same prompts, order, batch size and seed give the same initial drafts in both collectors. vLLM then
    decodes up to ``collector.max_num_seqs`` prompts at once, across those batches; records are written as prompts
    finish.

    Args:
        collector: the engine.
        prompts: :class:`~megatron_jf.data.collect.TokenizedPrompt` list.
        config: :class:`~megatron_jf.data.collect.CollectConfig` (``block_size`` must be the collector's).
        writer, ledger: as in :func:`megatron_jf.data.collect.collect`.
        on_batch: called with ``(stats of one prompt, 1)`` as each prompt finishes.

    Returns:
        :class:`~megatron_jf.data.collect.CollectStats` (``collector.prefill_disagreements`` counts the prompts
        whose second request re-derived another token, see :class:`JacobiResult`).

    Raises:
        ValueError: a block size other than the collector's; see also :meth:`VLLMCollector.decode`.
    """
    from megatron_jf.data import collect as C

    if config.block_size != collector.n:
        raise ValueError(f"block size {config.block_size} differs from the engine's n={collector.n}")
    if config.draft_init != collector.decode_config.draft_init:
        raise ValueError(f"draft init {config.draft_init!r} differs from the engine's "
                         f"{collector.decode_config.draft_init!r}")
    by_id = {p.sample_id: p for p in prompts}
    jobs = [(p.sample_id, list(p.ids), C.batch_seed(config.seed, batch[0].sample_id))
            for batch in C.iter_batches(list(prompts), config.batch_size) for p in batch]
    total = C.CollectStats()
    t0 = time.perf_counter()

    def on_result(sid, res):
        nonlocal total
        st = C.CollectStats(prompts=1)
        C.keep_result(by_id[sid], res, config, st, writer=writer, ledger=ledger)
        collector.prefill_disagreements += int(res.prefill_disagreed)
        total = total.merge(st)
        if on_batch is not None:
            on_batch(st, 1)

    collector.decode(jobs, max_new_tokens=config.max_new_tokens, eos_ids=config.eos_ids, on_result=on_result)
    total.seconds = time.perf_counter() - t0
    return total
