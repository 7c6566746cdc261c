"""The vLLM plugin end to end on vLLM's own engine (issue 23): ``speculative_config={"method": "jacobi" | "mr"}``.

Runs in the vLLM environment (``JF_ENV=vllm bash scripts/test.sh``); skipped where vLLM is not installed.

Lossless in vLLM's terms: with greedy sampling every request's tokens equal vLLM's own AR output for the same model
and dtype -- at batch 1, many concurrent requests of different lengths with chunked prefill and prefix caching on,
EOS and ``max_tokens`` inside an accepted draft, stop strings -- and with sampling the joint distribution of the
generated tokens is the model's (a chi-square test).

What fails if the drafting rule is wrong: vLLM verifies any draft, so the tokens alone cannot show it. Every request's
drafts, exactly as the proposer made them, are compared step by step with a reference loop that verifies drafts with
``transformers`` greedy (Jacobi: the running-window rule written out in ``tests/vllm_support.py``; MR:
``megatron_jf.decoding``'s policy), and vLLM's per-request acceptance counts (``per_request_spec_decode_metrics``)
and its Prometheus counters with the loop's.

Engines run in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the ``uni`` executor, eager mode): the first
start imports vLLM (about a minute here), later ones take seconds; each is started once per module.
``test_vllm_serve_metrics`` starts ``vllm serve`` as a subprocess (the plugin loaded through its entry point in
vLLM's engine-core process) and reads ``/metrics``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

pytest.importorskip("vllm")
# engines in this process (the plugin is loaded here by vLLM's plugin loader, as in every vLLM process)
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

from megatron_jf.models.zoo import save_with_tokenizer  # noqa: E402
from tests.vllm_support import PolicyRule, RunningWindowRule, cycle_successor, reference_decode  # noqa: E402

N_JACOBI = 4
MR_K, MR_N = 2, 4
# the methods whose drafts the tests replay exactly run at the fixed width (the auto width follows vLLM's step times)
SPECS = {"ar": None,
         "jacobi": {"method": "jacobi", "num_speculative_tokens": N_JACOBI, "draft_width": "fixed"},
         "mr": {"method": "mr", "num_speculative_tokens": MR_K * MR_N, "num_blocks": MR_K, "spawn_threshold": 0.5,
                "draft_width": "fixed"},
         # MR without context n-grams (recycled n-grams only)
         "mr-recycled": {"method": "mr", "num_speculative_tokens": MR_K * MR_N, "num_blocks": MR_K,
                         "spawn_threshold": 0.5, "prompt_lookup_max": 0, "draft_width": "fixed"},
         # the plugin's default: drafts cut to the width that pays on vLLM's steps
         "mr-auto": {"method": "mr", "num_speculative_tokens": MR_K * MR_N, "num_blocks": MR_K,
                     "spawn_threshold": 0.5}}
# chunked prefill (prompts longer than the token budget are prefilled in chunks) and prefix caching (blocks of 32)
ENGINE = dict(dtype="float32", max_model_len=512, block_size=32, max_num_batched_tokens=192, max_num_seqs=16,
              enable_chunked_prefill=True, enable_prefix_caching=True, enforce_eager=True,
              kv_cache_memory_bytes=48 << 20, distributed_executor_backend="uni", disable_log_stats=False, seed=0)
CYCLE = cycle_successor(4)
# engines stay alive until the process ends: a collected in-process engine tears down vLLM's process-wide
# distributed state under the others
_KEEP = []


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two tiny checkpoints (vocabulary 256, head size 32 as vLLM's CPU attention needs, EOS 255) with their
    transformers twins: ``rand``, a random Llama (drafts are rarely accepted), and ``cycle``, a Qwen2 whose greedy
    continuation walks cycles of 4 consecutive ids (252 -> 253 -> 254 -> 255=EOS -> 252 ...; long accepted drafts)."""
    from megatron_jf.models.zoo import peaked_hf_model, tiny_hf_model

    root = tmp_path_factory.mktemp("vllm_models")
    shape = dict(hidden=128, heads=4, kv_heads=2, ffn=192)
    hfs = {"rand": tiny_hf_model("llama", seed=2, scale=0.3, **shape),
           "cycle": peaked_hf_model("qwen2", period=4, seed=4, **shape)}
    return {name: (save_with_tokenizer(hf, str(root / name)), hf) for name, hf in hfs.items()}


@pytest.fixture(scope="module")
def engines(models):
    """One vLLM engine per (model, method), started on first use and shared by the module's tests."""
    from vllm import LLM

    cache = {}

    def get(model: str, method: str):
        if (model, method) not in cache:
            extra = {} if SPECS[method] is None else dict(speculative_config=dict(SPECS[method]),
                                                          per_request_spec_decode_metrics="detailed")
            cache[model, method] = LLM(models[model][0], **ENGINE, **extra)
            _KEEP.append(cache[model, method])
        return cache[model, method]

    return get


# ------------------------------------------------------------------------------------------------ helpers
def _record(llm, on: bool):
    """Start (or stop and return) the proposer's record of every draft it makes, per request id."""
    def set_record(worker, on):
        drafter = worker.model_runner.drafter
        rec, drafter.record = drafter.record, ({} if on else None)
        return rec
    return llm.collective_rpc(set_record, args=(on,))[0]


def _generate(llm, prompts, params):
    from vllm import SamplingParams

    params = params if isinstance(params, list) else [params] * len(prompts)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], [SamplingParams(**p) for p in params],
                        use_tqdm=False)


def _steps(o, k_max: int, n_ref: int) -> tuple[list[int], list[int]]:
    """vLLM's per-step (drafted, accepted) counts of one request, without the placeholder step vLLM's scheduler adds
    to a new request whose prompt is cached but for one token (``[-1] * num_speculative_tokens``, padded to keep
    decode batches uniform; ``v1/core/sched/scheduler.py``), which no proposer made."""
    m = o.spec_decode_metrics
    drafted, accepted = (list(m.per_step_drafted), list(m.per_step_accepted)) if m is not None else ([], [])
    if len(drafted) == n_ref + 1 and drafted[0] == k_max and accepted[0] == 0:
        drafted, accepted = drafted[1:], accepted[1:]
    return drafted, accepted


def _rule(method: str):
    from megatron_jf.decoding import policy_for
    from megatron_jf.vllm_plugin.methods import decode_config

    if method == "jacobi":
        return RunningWindowRule(N_JACOBI)
    return PolicyRule(policy_for(decode_config(SPECS[method]), linear=True))


def _check_against_reference(models, engines, model, method, prompts, params, *, batch=True):
    """Run ``prompts`` through vLLM AR and ``method``; assert tokens equal, and drafts and acceptance equal the
    reference loop's for every request vLLM did not cut a draft of. Returns (``method``'s ``RequestOutput`` list,
    the reference loop's ``(tokens, drafts, accepted)`` per prompt)."""
    path, hf = models[model]
    ar = engines(model, "ar")
    spec = engines(model, method)
    params = params if isinstance(params, list) else [params] * len(prompts)
    _record(spec, True)
    if batch:
        ours, base = _generate(spec, prompts, params), _generate(ar, prompts, params)
    else:
        ours = [_generate(spec, [p], q)[0] for p, q in zip(prompts, params)]
        base = [_generate(ar, [p], q)[0] for p, q in zip(prompts, params)]
    requests = ours
    ours, base = [r.outputs[0] for r in ours], [r.outputs[0] for r in base]
    record = {tuple(r["prompt"]): r["drafts"] for r in _record(spec, False).values()}
    k_max = SPECS[method]["num_speculative_tokens"]
    refs, compared = [], 0
    for p, q, o, b in zip(prompts, params, ours, base):
        assert list(o.token_ids) == list(b.token_ids), (method, p[:8], q)
        eos = None if q.get("ignore_eos") else hf.config.eos_token_id
        ref = reference_decode(hf, _rule(method), p, max_tokens=q["max_tokens"],
                               max_draft=k_max, eos=eos)
        refs.append(ref)
        assert ref[0] == list(o.token_ids), "transformers greedy differs from vLLM's greedy"
        drafted, accepted = _steps(o, k_max, len(ref[1]))
        recorded = record.get(tuple(p), [])
        if len(drafted) == len(ref[1]) and any(d < len(r) for d, r in zip(drafted, recorded)):
            continue  # the scheduler cut a draft to fit its token budget: from there the trajectory differs
        compared += 1
        assert recorded[: len(ref[1])] == ref[1], (method, p[:8], "drafts differ from the reference rule's")
        assert len(recorded) == len(ref[1]) + (len(o.token_ids) > 1 or not ref[1])
        assert drafted == [len(d) for d in ref[1]]
        assert accepted == ref[2]
    assert compared >= max(1, len(prompts) // 2), f"only {compared} of {len(prompts)} requests compared"
    return requests, refs


def _prompts(seed, lengths, vocab=250):
    import random

    rnd = random.Random(seed)
    return [[rnd.randrange(vocab) for _ in range(n)] for n in lengths]


# ------------------------------------------------------------------------------------------------ greedy
@pytest.mark.parametrize("method", ["jacobi", "mr"])
@pytest.mark.parametrize("model", ["rand", "cycle"])
def test_batch1_greedy_equals_vllm_ar_and_follows_the_rule(models, engines, model, method):
    prompts = _prompts(1, (1, 5, 23))
    outs, refs = _check_against_reference(models, engines, model, method, prompts,
                                          dict(temperature=0.0, max_tokens=40, ignore_eos=True), batch=False)
    if (model, method) == ("cycle", "mr"):  # the n-gram pool learns the cycle: drafts get accepted (measured: 18
        accepted = [a for r in refs for a in r[2]]  # tokens over 3 prompts, up to 4 in one step; Jacobi: none)
        assert sum(accepted) >= 10 and max(accepted) >= 2, accepted


def test_mr_context_ngrams_lead_drafts_and_stay_lossless(models, engines):
    """Issue 33: MR's context n-grams (prompt lookup) in vLLM. Prompts that already hold the cycle model's
    continuation: the n-gram after the newest tokens' earlier occurrence leads each draft from the first step, so
    the requests take far fewer steps than MR with recycled n-grams only; greedy tokens equal vLLM's AR and every
    draft equals the reference loop's (the same policy over transformers greedy)."""
    cycle = [252, 253, 254, 255] * 2
    prompts = [p + cycle + [252] for p in _prompts(5, (3, 17, 40))]
    params = dict(temperature=0.0, max_tokens=32, ignore_eos=True)
    steps = {}
    for method in ("mr", "mr-recycled"):
        outs, refs = _check_against_reference(models, engines, "cycle", method, prompts, params, batch=False)
        steps[method] = sum(len(r[1]) for r in refs)
        first = [r[2][0] for r in refs]  # accepted in the first drafted step
        if method == "mr":
            assert first == [MR_K * MR_N] * len(prompts), first  # the whole first draft: the context's cycle
    assert steps["mr"] * 2 <= steps["mr-recycled"], steps


def test_auto_width_greedy_equals_vllm_ar(models, engines):
    """The plugin's default ``draft_width: auto`` (drafts cut each step to the width that pays on vLLM's steps as
    the proposer times them): greedy tokens equal vLLM's AR, one request at a time and 6 at once; the proposer
    timed the steps (its step-time table exists) and drafted in some of them."""
    cycle = [252, 253, 254, 255] * 2
    prompts = [p + cycle + [252] for p in _prompts(7, (3, 17, 40, 9, 1, 30))]
    params = dict(temperature=0.0, max_tokens=32, ignore_eos=True)
    ar, auto = engines("cycle", "ar"), engines("cycle", "mr-auto")
    base = [list(o.outputs[0].token_ids) for o in _generate(ar, prompts, params)]
    one = [list(_generate(auto, [p], params)[0].outputs[0].token_ids) for p in prompts]
    together = [list(o.outputs[0].token_ids) for o in _generate(auto, prompts, params)]
    assert one == base and together == base
    timed = auto.collective_rpc(lambda w: (w.model_runner.drafter.step_times.table() is not None,
                                           w.model_runner.drafter.step_times.timed_up_to()))[0]
    assert timed[0] and timed[1] > 1, timed  # wider steps than AR's were timed


@pytest.mark.parametrize("method", ["jacobi", "mr"])
def test_concurrent_requests_chunked_prefill_prefix_caching(models, engines, method):
    """16 requests at once, prompts of 1 to 280 tokens (the longest prefilled in chunks of the 192-token budget),
    half of them sharing a 96-token prefix (3 cached blocks), different max_tokens, EOS on; run twice (the second
    time every prefix block is cached)."""
    shared = _prompts(7, (96,))[0]
    lengths = [1, 3, 8, 13, 21, 34, 55, 70, 90, 120, 150, 200, 230, 260, 280, 300]
    prompts = [shared + p[: len(p) // 2] if i % 2 else p for i, p in enumerate(_prompts(3, lengths))]
    params = [dict(temperature=0.0, max_tokens=8 + 3 * i) for i in range(len(prompts))]
    for _ in range(2):
        outs, _ = _check_against_reference(models, engines, "cycle", method, prompts, params)
    cached = [r.num_cached_tokens or 0 for r in outs]
    assert all(c >= 96 for c in cached[1::2]), cached  # the shared prefix came from the cache
    assert max(map(len, prompts)) > ENGINE["max_num_batched_tokens"]


# --------------------------------------------------------------------------- EOS / max_tokens / stop inside a draft
class _CycleOracle:
    """A drafting policy that proposes the cycle model's true continuation (n tokens, EOS included and past it),
    so every draft is accepted whole and EOS, ``max_tokens`` and stop strings fall inside accepted drafts."""

    def __init__(self, n):
        self.n = n

    def new_state(self, prompt, seed):
        return None

    def propose(self, state, context):
        from megatron_jf.decoding import Proposal

        d = [CYCLE(context[-1])]
        while len(d) < self.n:
            d.append(CYCLE(d[-1]))
        return Proposal(d)

    def observe(self, state, context, outcome):
        pass


def _with_policy(llm, policy):
    def swap(worker, policy):
        drafter = worker.model_runner.drafter
        old, drafter.policy = drafter.policy, policy
        return old
    return llm.collective_rpc(swap, args=(policy,))[0]


@pytest.mark.parametrize("method", ["jacobi", "mr"])
def test_eos_max_tokens_and_stop_strings_inside_accepted_drafts(models, engines, method):
    path, hf = models["cycle"]
    llm, ar = engines("cycle", method), engines("cycle", "ar")
    k = SPECS[method]["num_speculative_tokens"]
    old = _with_policy(llm, _CycleOracle(k))
    try:
        # EOS (255) two tokens after the prefill token: inside the first draft, which runs past it
        eos_prompts = [[7, 252], [9, 30, 253], [251, 252]]
        p_eos = dict(temperature=0.0, max_tokens=30)
        # max_tokens ends inside the first or second draft
        len_prompts = [[11, 12, 40], [60, 61, 62, 63]]
        p_len = [dict(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (3, k + 3)]
        # a stop string inside an accepted draft (word-level text: "t40 t41 t42 t43 t40 ...")
        stop_prompts = [[5, 40], [5, 100]]
        p_stop = [dict(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[s]) for s in ("t42 t43", "t101 t102 t103")]
        for prompts, params in ((eos_prompts, p_eos), (len_prompts, p_len), (stop_prompts, p_stop)):
            ours = [r.outputs[0] for r in _generate(llm, prompts, params)]
            base = [r.outputs[0] for r in _generate(ar, prompts, params)]
            for o, b in zip(ours, base):
                assert list(o.token_ids) == list(b.token_ids)
                assert o.finish_reason == b.finish_reason
            if prompts is not stop_prompts:  # accepted + 1 per step, past the end: the stop fell inside a draft
                for o in ours:
                    m = o.spec_decode_metrics
                    assert 1 + sum(a + 1 for a in m.per_step_accepted) > len(o.token_ids), m
        assert [list(r.outputs[0].token_ids)[-1] for r in _generate(llm, eos_prompts, p_eos)] == [255] * 3
        assert [len(r.outputs[0].token_ids) for r in _generate(llm, len_prompts, p_len)] == [3, k + 3]
        texts = [r.outputs[0].text for r in _generate(llm, stop_prompts, p_stop)]
        assert [t.split() for t in texts] == [["t41"], []]
        assert all(s not in t for s, t in zip(("t42 t43", "t101 t102 t103"), texts))
    finally:
        _with_policy(llm, old)


# ------------------------------------------------------------------------------------- per-request options
@pytest.mark.parametrize("method", ["jacobi", "mr"])
def test_request_options_turn_drafting_off_or_shrink_the_block(models, engines, method):
    """``SamplingParams.extra_args`` per request, in one batch: ``jf_draft: false`` drafts nothing (vLLM counts no
    drafted step for it), ``jf_block_size: 2`` drafts blocks of 2 (drafts and acceptance equal the reference loop's
    with n = 2), the default request drafts with the engine's n; every output equals vLLM AR's. A bad option is
    refused in one line before it reaches the engine, which keeps serving."""
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    from megatron_jf.decoding import DecodeConfig, policy_for

    path, hf = models["cycle"]
    llm, ar = engines("cycle", method), engines("cycle", "ar")
    prompts = _prompts(17, (3, 9, 14, 6))
    extra = [{"jf_draft": False}, {"jf_block_size": 2}, None, {"jf_block_size": 2, "other_extension": "x"}]
    params = [dict(temperature=0.0, max_tokens=40, ignore_eos=True, extra_args=x) for x in extra]
    _record(llm, True)
    ours = [r.outputs[0] for r in _generate(llm, prompts, params)]
    record = {tuple(r["prompt"]): r["drafts"] for r in _record(llm, False).values()}
    base = [r.outputs[0] for r in _generate(ar, prompts, params)]
    assert [list(o.token_ids) for o in ours] == [list(b.token_ids) for b in base]
    K = SPECS[method].get("num_blocks", 1)
    n = SPECS[method]["num_speculative_tokens"] // K
    for p, x, o in zip(prompts, extra, ours):
        b = 0 if x and x.get("jf_draft") is False else (x or {}).get("jf_block_size", n)
        drafted, accepted = _steps(o, K * b, 10 ** 6)
        if b == 0:
            assert sum(drafted) == 0 and tuple(p) not in record
            continue
        rule = (RunningWindowRule(b) if method == "jacobi" else
                PolicyRule(policy_for(DecodeConfig("mr", block_size=b, num_blocks=K, spawn_threshold=0.5),
                                      linear=True)))
        _, ref_drafts, ref_accepted = reference_decode(hf, rule, p, max_tokens=40, max_draft=K * b, eos=None)
        assert record[tuple(p)][: len(ref_drafts)] == ref_drafts
        assert drafted == [len(d) for d in ref_drafts] and accepted == ref_accepted and max(drafted) <= K * b
    for bad, words in (({"jf_block_size": n + 1}, ["jf_block_size", f"1..{n}", f"got {n + 1}"]),
                       ({"jf_draft": "no"}, ["jf_draft", "got 'no'"])):
        with pytest.raises(VLLMValidationError) as e:
            llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=4, extra_args=bad),
                         use_tqdm=False)
        assert "\n" not in str(e.value) and all(w in str(e.value) for w in words), str(e.value)
    again = _generate(llm, prompts[:1], params[2])[0].outputs[0]
    assert list(again.token_ids) == list(base[0].token_ids)


# ------------------------------------------------------------------------------------------- engine start
@pytest.mark.parametrize("spec, words", [
    ({"method": "mr", "num_speculative_tokens": 256, "num_blocks": 2}, ["num_speculative_tokens", "1..128",
                                                                       "got 256"]),
    ({"method": "mr", "num_speculative_tokens": 8, "ngram_pool_size": 0}, ["ngram_pool_size", ">= 1", "got 0"]),
    ({"method": "mr", "num_speculative_tokens": 8, "spawn_threshold": "0.5"}, ["spawn_threshold", "(0, 1]",
                                                                               "got '0.5'"]),
    ({"method": "Jacobi", "num_speculative_token": 4}, ["unknown key 'num_speculative_token'",
                                                         "did you mean 'num_speculative_tokens'"]),
    ({"method": "jacobbi", "num_speculative_tokens": 4}, ["unknown method 'jacobbi'", "did you mean 'jacobi'"]),
])
def test_bad_configs_refused_at_engine_start(models, spec, words):
    """Against vLLM's own keys and methods: each bad config stops ``LLM(...)`` before any engine process or model
    exists, with one line naming the key, the allowed values and the value."""
    from vllm import LLM

    with pytest.raises(ValueError) as e:
        LLM(models["cycle"][0], speculative_config=spec, **ENGINE)
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


def test_spellings_vllm_accepts_reach_the_plugin(models):
    """Capitalised method names, hyphenated keys (as vLLM accepts them) and the ``spec_method`` / ``spec_tokens``
    engine arguments configure the same proposer (the engine config, not an engine, is built)."""
    from vllm.engine.arg_utils import EngineArgs

    from megatron_jf.vllm_plugin.methods import ADDITIONAL_CONFIG_KEY, PROPOSER_PATH

    path = models["cycle"][0]
    kw = dict(model=path, dtype="float32", max_model_len=512, kv_cache_memory_bytes=ENGINE["kv_cache_memory_bytes"])
    cases = [(dict(speculative_config={"method": "MR", "num-speculative-tokens": 8, "num-blocks": 2,
                                       "spawn-threshold": 0.5}), "mr", 8),
             (dict(spec_method="jacobi", spec_tokens=6), "jacobi", 6)]
    for args, method, k in cases:
        cfg = EngineArgs(**kw, **args).create_engine_config()
        ours = cfg.additional_config[ADDITIONAL_CONFIG_KEY]
        assert (cfg.speculative_config.method, cfg.speculative_config.model) == ("custom_class", PROPOSER_PATH)
        assert cfg.speculative_config.num_speculative_tokens == k and ours["method"] == method
    assert ours["block_size"] == 6 and ours["decoder"] == "running-window"


_GATE = """
import json, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
import vllm
vllm.__version__ = sys.argv[3]  # what the plugin reads; set before vLLM loads its plugins (at the first engine)
from vllm import LLM, SamplingParams
llm = LLM(sys.argv[1], **json.loads(sys.argv[2]))
out = llm.generate([{"prompt_token_ids": [5, 40]}], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                   use_tqdm=False)
try:
    LLM(sys.argv[1], speculative_config={"method": "jacobi", "num_speculative_tokens": 4}, **json.loads(sys.argv[2]))
    error = None
except ValueError as e:
    error = str(e)
from vllm.v1.sample import rejection_sampler
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
wrapped = [hasattr(f, "_megatron_jf_wrapped") for f in (rejection_sampler.rejection_sample,
           rejection_sampler.expand_batch_to_tokens, GPUModelRunner.propose_draft_token_ids,
           GPUModelRunner._update_states)]
print("RESULT " + json.dumps({"tokens": list(out[0].outputs[0].token_ids), "error": error, "wrapped": wrapped}))
"""


def test_unsupported_vllm_version_leaves_vllm_working(models, tmp_path):
    """vLLM reporting a version the plugin does not support (0.34.0 here, faked): the plugin logs one warning and
    wraps nothing, ``import vllm`` and an AR ``LLM(...).generate`` work (the cycle model's continuation), and asking
    for ``jacobi`` fails with one line naming the supported versions. (Before: ``register()`` raised in every vLLM
    process, so vLLM could not start an engine at all.)"""
    engine = dict(dtype="float32", max_model_len=256, block_size=32, enforce_eager=True,
                  kv_cache_memory_bytes=16 << 20, distributed_executor_backend="uni")
    p = subprocess.run([sys.executable, "-c", _GATE, models["cycle"][0], json.dumps(engine), "0.34.0"],
                       capture_output=True, text=True, timeout=900,
                       env={k: v for k, v in os.environ.items()
                            if k not in ("MEGATRON_JF_VLLM_UNTESTED_OK", "JF_VLLM_UNTESTED_OK")})
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout.split("RESULT ", 1)[1])
    assert res["tokens"] == [41, 42, 43, 40, 41, 42, 43, 40]  # 40 -> 41 -> 42 -> 43 -> 40: the cycle
    assert res["wrapped"] == [False] * 4
    warnings = [line for line in p.stderr.splitlines() if "megatron-jf vLLM plugin" in line]
    assert len(warnings) == 1 and "vLLM 0.34.0 is not supported" in warnings[0], warnings
    err = res["error"]
    assert err is not None and "\n" not in err and "'jacobi'" in err and "0.32.0" in err and "0.34.0" in err, err


# ------------------------------------------------------------------------------------------------ metrics
def _counter(llm, name: str) -> float:
    return sum(m.value for m in llm.get_metrics() if m.name == name and hasattr(m, "value"))


def _per_pos(llm) -> list[int]:
    vec = [m for m in llm.get_metrics() if m.name == "vllm:spec_decode_num_accepted_tokens_per_pos"]
    return list(vec[0].values) if vec else []


@pytest.mark.parametrize("method", ["jacobi", "mr"])
def test_acceptance_in_vllm_metrics(models, method):
    """vLLM's own counters count the plugin's drafts: num_drafts, num_draft_tokens, num_accepted_tokens and the
    per-position accepted counts equal the reference loop's totals, so vLLM's mean acceptance length
    (1 + accepted / drafts) is the decoder's tokens per forward. A fresh engine: vLLM's Prometheus registry is
    process-wide and shows the newest engine's series."""
    from vllm import LLM

    path, hf = models["cycle"]
    llm = LLM(path, speculative_config=dict(SPECS[method]), **ENGINE)
    _KEEP.append(llm)
    prompts = _prompts(11, (4, 9, 17, 2))
    outs = _generate(llm, prompts, dict(temperature=0.0, max_tokens=48, ignore_eos=True))
    k_max = SPECS[method]["num_speculative_tokens"]
    steps = []
    for p, r in zip(prompts, outs):
        tokens, drafts, accepted = reference_decode(hf, _rule(method), p, max_tokens=48, max_draft=k_max, eos=None)
        assert list(r.outputs[0].token_ids) == tokens
        steps += [(len(d), a) for d, a in zip(drafts, accepted)]
    names = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
             "vllm:spec_decode_num_accepted_tokens")
    assert [_counter(llm, n) for n in names] == [len(steps), sum(d for d, _ in steps), sum(a for _, a in steps)]
    pos = _per_pos(llm)
    assert len(pos) == k_max and pos == [sum(a > i for _, a in steps) for i in range(k_max)]
    if method == "mr":
        assert sum(pos) > 0  # the n-gram pool learns the cycle model's cycles


# ------------------------------------------------------------------------------------------------ sampling
def _chi2_critical(df: int, z: float = 3.09) -> float:
    """Upper 0.1% point of chi-square with ``df`` degrees of freedom (Wilson-Hilferty)."""
    c = 2.0 / (9.0 * df)
    return df * (1.0 - c + z * c ** 0.5) ** 3


def _chi2(counts: dict, probs: dict, n: int) -> tuple[float, int]:
    """Pearson's statistic over the cells of ``probs``, cells with an expected count below 5 pooled."""
    stat, df, pool_o, pool_e = 0.0, -1, 0, 0.0
    for cell, p in probs.items():
        e, o = n * p, counts.get(cell, 0)
        if e < 5:
            pool_o, pool_e = pool_o + o, pool_e + e
            continue
        stat += (o - e) ** 2 / e
        df += 1
    if pool_e > 0:
        stat += (pool_o - pool_e) ** 2 / pool_e
        df += 1
    return stat, df


def test_sampling_keeps_the_distribution(tmp_path):
    """Temperature-1 sampling through Jacobi and MR drafts: the joint distribution of the first three tokens
    matches the model's exact one (enumerated with transformers) by a chi-square test at the 0.1% level (1800
    requests; 43 cells with 5 or more expected, the rest pooled); the same test rejects samples drawn at
    temperature 0.8, so it has the power to fail. Without the plugin's fix of vLLM-CPU's parameter expansion
    (``vllm_internals.expand_batch_to_tokens``) it fails: statistic 14,897 for Jacobi, 1,870 for vLLM's own n-gram
    method, against a critical value of 77.5."""
    import collections

    import torch
    from vllm import LLM

    from megatron_jf.models.zoo import tiny_hf_model

    hf = tiny_hf_model("qwen2", vocab=6, scale=0.1, seed=9, hidden=128, heads=4, kv_heads=2, ffn=192)
    path = save_with_tokenizer(hf, str(tmp_path / "v6"))
    prompt, V, N = [1, 4, 2], 6, 1800

    def probs(seq):
        with torch.no_grad():
            return torch.softmax(hf(torch.tensor([seq])).logits[0, -1].double(), -1).tolist()

    exact = {}
    p1 = probs(prompt)
    for a in range(V):
        p2 = probs(prompt + [a])
        for b in range(V):
            p3 = probs(prompt + [a, b])
            for c in range(V):
                exact[a, b, c] = p1[a] * p2[b] * p3[c]
    kw = dict(ENGINE, kv_cache_memory_bytes=64 << 20, max_num_seqs=64, max_num_batched_tokens=1024)
    for method in ("jacobi", "mr"):
        llm = LLM(path, speculative_config=dict(SPECS[method]), **kw)
        _KEEP.append(llm)
        for temp, ok in ((1.0, True), (0.8, False)):
            outs = _generate(llm, [prompt] * N, dict(temperature=temp, max_tokens=3, ignore_eos=True))
            stat, df = _chi2(collections.Counter(tuple(r.outputs[0].token_ids) for r in outs), exact, N)
            assert (stat < _chi2_critical(df)) == ok, (method, temp, stat, df, _chi2_critical(df))
        assert _counter(llm, "vllm:spec_decode_num_accepted_tokens") > 0


def test_cpu_sampling_parameter_expansion_is_fixed():
    """The plugin's replacement of vLLM's ``expand_batch_to_tokens`` on CPU repeats each row's value for its tokens
    (float and int parameters, greedy rows mapped to 1 as vLLM's temperature expansion asks)."""
    import torch
    from vllm.v1.sample import rejection_sampler

    from megatron_jf.vllm_plugin import register

    register()
    cu = torch.tensor([2, 5, 6], dtype=torch.int32)
    got = rejection_sampler.expand_batch_to_tokens(torch.tensor([0.0, 0.7, 1.3]), cu, 6, replace_from=0,
                                                   replace_to=1)
    assert got.tolist() == pytest.approx([1.0, 1.0, 0.7, 0.7, 0.7, 1.3])
    got = rejection_sampler.expand_batch_to_tokens(torch.tensor([5, 0, 9], dtype=torch.int32), cu, 6)
    assert got.dtype == torch.int32 and got.tolist() == [5, 5, 0, 0, 0, 9]


# ------------------------------------------------------------------------------------------------ vllm serve
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _http(url: str, body: dict | None = None, timeout: float = 60) -> str:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read().decode()


@pytest.fixture(scope="module")
def serve(models, tmp_path_factory):
    """vLLM's OpenAI server as a subprocess (its API server and engine-core processes, the plugin loaded through its
    entry point in each) on the cycle model with ``--speculative-config '{"method": "mr", ...}'``, the plugin's
    worker extension and vLLM's dev-mode ``POST /collective_rpc`` (which reads the proposer's live-state count).
    Yields the base URL."""
    path = models["cycle"][0]
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env["VLLM_SERVER_DEV_MODE"] = "1"
    # ``vllm serve``'s server; vllm-cpu 0.32.0's ``vllm`` command itself fails before parsing its arguments (it asks
    # importlib.metadata for the version of a distribution named "vllm"; this one is "vllm-cpu")
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", path, "--port", str(port),
           "--host", "127.0.0.1", "--dtype", "float32", "--max-model-len", "512", "--block-size", "32",
           "--enforce-eager", "--kv-cache-memory-bytes", str(ENGINE["kv_cache_memory_bytes"]),
           "--distributed-executor-backend", "uni", "--speculative-config", json.dumps(SPECS["mr"]),
           "--worker-extension-cls", "megatron_jf.vllm_plugin.proposer.WorkerExtension"]
    log_path = tmp_path_factory.mktemp("serve") / "serve.log"
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 600
        while True:
            assert proc.poll() is None, open(log_path).read()[-4000:]
            try:
                _http(base + "/health", timeout=5)
                break
            except OSError:
                assert time.time() < deadline, "vllm serve did not come up in 600 s"
                time.sleep(2)
        yield base
        assert proc.poll() is None, open(log_path).read()[-4000:]  # the engine never died
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 15)
            proc.wait(timeout=60)
        log.close()


def _spec_counters(base: str) -> dict:
    metrics = {}
    for line in _http(base + "/metrics").splitlines():
        name, _, value = line.partition("{")
        if name in ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                    "vllm:spec_decode_num_accepted_tokens_total"):
            metrics[name] = metrics.get(name, 0.0) + float(value.rsplit(" ", 1)[1])
    return metrics


def _live_states(base: str) -> list:
    """The proposer's live-state count in each worker (the plugin's worker extension, through /collective_rpc)."""
    return [int(x) for x in json.loads(_http(base + "/collective_rpc", {"method": "jf_live_states"}))["results"]]


def test_vllm_serve_metrics(models, engines, serve):
    """vLLM's OpenAI server with ``--speculative-config '{"method": "mr", ...}'``: greedy completions equal vLLM AR's,
    and ``/metrics`` counts exactly the reference loop's drafts and accepted tokens."""
    path, hf = models["cycle"]
    before = _spec_counters(serve)
    prompts = _prompts(13, (3, 11))
    texts = [json.loads(_http(serve + "/v1/completions", {"model": path, "prompt": p, "max_tokens": 40,
                                                          "temperature": 0, "ignore_eos": True}))
             ["choices"][0]["text"] for p in prompts]
    ar = _generate(engines("cycle", "ar"), prompts, dict(temperature=0.0, max_tokens=40, ignore_eos=True))
    assert texts == [r.outputs[0].text for r in ar]
    after = _spec_counters(serve)
    steps = []
    for p in prompts:
        _, drafts, accepted = reference_decode(hf, _rule("mr"), p, max_tokens=40,
                                               max_draft=SPECS["mr"]["num_speculative_tokens"], eos=None)
        steps += [(len(d), a) for d, a in zip(drafts, accepted)]
    assert {k: after[k] - before.get(k, 0.0) for k in after} == {
        "vllm:spec_decode_num_drafts_total": len(steps),
        "vllm:spec_decode_num_draft_tokens_total": sum(d for d, _ in steps),
        "vllm:spec_decode_num_accepted_tokens_total": sum(a for _, a in steps)}


def _stream_then_close(url: str, body: dict, chunks: int) -> int:
    """POST a streaming completion, read ``chunks`` server-sent events, then drop the connection (a client
    abort). Returns the events read."""
    import http.client
    from urllib.parse import urlparse

    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    conn.request("POST", u.path, json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    seen = 0
    while seen < chunks:
        line = resp.fp.readline()
        if not line:
            break
        seen += line.startswith(b"data: ")
    conn.sock.close()
    conn.close()
    return seen


def test_served_requests_leave_no_state_at_idle(models, engines, serve):
    """Concurrent greedy requests of different lengths, streamed or not, one with drafting off, one aborted by its
    client mid-stream, one refused for a bad option: once the server is idle the proposer holds no request state
    (before the fix, the requests that finished in the server's last step kept theirs for the life of the server:
    vLLM reports them in a zero-token step that never reaches the proposer)."""
    import threading

    path = models["cycle"][0]
    url = serve + "/v1/completions"
    prompts = _prompts(29, (2, 5, 9, 17, 30))
    bodies = [{"model": path, "prompt": p, "max_tokens": 8 + 13 * i, "temperature": 0, "ignore_eos": True}
              for i, p in enumerate(prompts)]
    bodies[1]["vllm_xargs"] = {"jf_draft": False}
    bodies[3]["stream"] = True
    texts = [None] * len(bodies)

    def run(i):
        raw = _http(url, bodies[i])
        if bodies[i].get("stream"):
            texts[i] = "".join(json.loads(x[6:])["choices"][0]["text"] for x in raw.splitlines()
                               if x.startswith("data: {"))
        else:
            texts[i] = json.loads(raw)["choices"][0]["text"]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    assert _stream_then_close(url, {"model": path, "prompt": [7, 3], "max_tokens": 400, "temperature": 0,
                                    "ignore_eos": True, "stream": True}, chunks=2) == 2
    for t in threads:
        t.join()
    try:
        _http(url, {"model": path, "prompt": [1, 2], "max_tokens": 4, "vllm_xargs": {"jf_block_size": 99}})
        raise AssertionError("a bad jf_block_size was accepted")
    except urllib.error.HTTPError as e:
        assert e.code == 400 and "jf_block_size must be an integer in 1..4" in e.read().decode()
    ar = _generate(engines("cycle", "ar"), prompts, [dict(temperature=0.0, max_tokens=b["max_tokens"],
                                                          ignore_eos=True) for b in bodies])
    assert texts == [r.outputs[0].text for r in ar]
    for _ in range(120):  # idle once the aborted request is gone and vLLM's last (zero-token) step has run
        if _live_states(serve) == [0]:
            break
        time.sleep(1)
    assert _live_states(serve) == [0]
