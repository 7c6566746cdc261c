"""The vLLM plugin's parts that need no vLLM (issue 23): method translation, the version check, the import contract,
and the proposer's per-request bookkeeping driven by a model-free stand-in for vLLM's runner.

Runs in every environment (vLLM itself is never imported here); tests/test_vllm_plugin.py runs vLLM end to end.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import asdict
from types import SimpleNamespace

import pytest

from megatron_jf.decoding import DecodeConfig, policy_for
from megatron_jf.vllm_plugin import methods, vllm_internals
from megatron_jf.vllm_plugin.methods import ADDITIONAL_CONFIG_KEY, PROPOSER_PATH, decode_config, translate
from tests.vllm_support import PolicyRule, RunningWindowRule, reference_decode


def test_translate_jacobi_and_mr_to_custom_class():
    spec, ours = translate({"method": "jacobi", "num_speculative_tokens": 16, "draft_init": "repeat"})
    assert spec == {"method": "custom_class", "model": PROPOSER_PATH, "num_speculative_tokens": 16}
    assert ours == dict(asdict(DecodeConfig("running-window", block_size=16, draft_init="repeat")), method="jacobi")
    spec, ours = translate({"method": "mr", "num_speculative_tokens": 24, "num_blocks": 3, "spawn_threshold": 0.5,
                            "ngram_pool_size": 4, "verification_size": 2, "disable_padded_drafter_batch": True})
    assert spec == {"method": "custom_class", "model": PROPOSER_PATH, "num_speculative_tokens": 24,
                    "disable_padded_drafter_batch": True}
    assert decode_config({"method": "mr", "num_speculative_tokens": 24, "num_blocks": 3}) == DecodeConfig(
        "mr", block_size=8, num_blocks=3)
    assert ours["block_size"] == 8 and ours["num_blocks"] == 3 and ours["method"] == "mr"
    ngram = {"method": "ngram", "num_speculative_tokens": 4}
    assert translate(ngram) == (ngram, None)
    # MR's context n-grams (on by default) take vLLM's n-gram names
    spec, ours = translate({"method": "mr", "num_speculative_tokens": 8, "prompt_lookup_min": 2, "prompt_lookup_max": 0})
    assert spec == {"method": "custom_class", "model": PROPOSER_PATH, "num_speculative_tokens": 8}
    assert (ours["prompt_lookup_min"], ours["prompt_lookup_max"]) == (2, 0)
    assert decode_config({"method": "mr", "num_speculative_tokens": 8}).prompt_lookup_max == 4


_KEYS = ("method", "model", "num_speculative_tokens", "disable_padded_drafter_batch")  # some of vLLM's keys


@pytest.mark.parametrize("spec, words", [
    ({"method": "jacobi"}, ["num_speculative_tokens", "1..128", "got None"]),
    ({"method": "mr", "num_speculative_tokens": 0}, ["num_speculative_tokens", "1..128", "got 0"]),
    ({"method": "jacobi", "num_speculative_tokens": 129}, ["num_speculative_tokens", "1..128", "MAX_SPEC_LEN",
                                                           "got 129"]),
    ({"method": "mr", "num_speculative_tokens": 256, "num_blocks": 2}, ["num_speculative_tokens", "1..128", "got 256"]),
    ({"method": "jacobi", "num_speculative_tokens": 16.0}, ["num_speculative_tokens", "1..128", "got 16.0"]),
    ({"method": "jacobi", "num_speculative_tokens": True}, ["num_speculative_tokens", "got True"]),
    ({"method": "jacobi", "num_speculative_tokens": 4, "num_blocks": 2}, ["does not take num_blocks", "draft_init"]),
    ({"method": "mr", "num_speculative_tokens": 9, "num_blocks": 2}, ["num_blocks", "dividing num_speculative_tokens "
                                                                      "(9)", "got 2"]),
    ({"method": "mr", "num_speculative_tokens": 8, "num_blocks": 0}, ["num_blocks", "integer >= 1", "got 0"]),
    ({"method": "mr", "num_speculative_tokens": 8, "num_blocks": "2"}, ["num_blocks", "integer >= 1", "got '2'"]),
    ({"method": "mr", "num_speculative_tokens": 8, "spawn_threshold": 1.5}, ["spawn_threshold", "(0, 1]", "got 1.5"]),
    ({"method": "mr", "num_speculative_tokens": 8, "spawn_threshold": "0.5"}, ["spawn_threshold", "(0, 1]",
                                                                               "got '0.5'"]),
    ({"method": "mr", "num_speculative_tokens": 8, "ngram_pool_size": 0}, ["ngram_pool_size", ">= 1", "got 0"]),
    ({"method": "mr", "num_speculative_tokens": 8, "ngram_pool_size": -3}, ["ngram_pool_size", ">= 1", "got -3"]),
    ({"method": "mr", "num_speculative_tokens": 8, "verification_size": 2.5}, ["verification_size", "integer >= 1",
                                                                               "got 2.5"]),
    ({"method": "jacobi", "num_speculative_tokens": 4, "draft_init": "zeros"}, ["draft_init", "'context' or 'repeat'",
                                                                                "got 'zeros'"]),
    ({"method": "jacobi", "num_speculative_tokens": 4, "model": "some/draft"}, ["without a model", "'some/draft'"]),
    ({"method": "jacobbi", "num_speculative_tokens": 4}, ["unknown method 'jacobbi'", "did you mean 'jacobi'"]),
    ({"method": "mr", "num_speculative_tokens": 8, "spawn_treshold": 0.5}, ["unknown key 'spawn_treshold'",
                                                                            "did you mean 'spawn_threshold'"]),
    ({"method": "MR", "num-speculative-tokens": 8, "num-block": 2}, ["unknown key 'num_block'",
                                                                    "did you mean 'num_blocks'"]),
    ({"method": "jacobi", "num_speculative_tokens": 4, "prompt_lookup_max": 3}, ["does not take prompt_lookup_max"]),
    ({"method": "mr", "num_speculative_tokens": 8, "prompt_lookup_min": 3, "prompt_lookup_max": 2},
     ["prompt_lookup_min <= prompt_lookup_max", "got 3 and 2"]),
    ({"method": "mr", "num_speculative_tokens": 8, "prompt_lookup_min": 0}, ["prompt_lookup_min", ">= 1", "got 0"]),
    ({"method": "mr", "num_speculative_tokens": 8, "prompt_lookup_max": -1}, ["prompt_lookup_max", ">= 0", "got -1"]),
])
def test_bad_speculative_configs_are_refused_in_one_line(spec, words):
    """Each bad config is refused when the engine is configured (before vLLM starts anything), in one line naming
    the key, the allowed values and the value given -- not later in a worker (num_speculative_tokens > 128 used to
    pass and then fail vLLM's MAX_SPEC_LEN assertion at the first verification; ngram_pool_size 0 crashed the worker
    on the first request; a string threshold raised a raw TypeError)."""
    with pytest.raises(ValueError) as e:
        translate(spec, vllm_methods=("ngram", "eagle", "custom_class"), vllm_keys=_KEYS)
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


def test_method_names_and_keys_normalised_as_vllm_does():
    """Capitalised method names and hyphenated keys (vLLM accepts ``num-speculative-tokens``) mean the same config;
    vLLM's own methods pass through untouched, misspelt ones too (vLLM reports those)."""
    want = translate({"method": "mr", "num_speculative_tokens": 8, "spawn_threshold": 0.5, "draft_init": "repeat"})
    for spec in ({"method": "MR", "num-speculative-tokens": 8, "spawn-threshold": 0.5, "draft-init": "repeat"},
                 {"method": " Mr ", "num_speculative_tokens": 8, "spawn_threshold": 0.5, "draft_init": "repeat"}):
        assert translate(spec, vllm_keys=_KEYS) == want
    assert translate({"method": "Jacobi", "num_speculative_tokens": 4})[1]["method"] == "jacobi"
    for spec in ({"method": "ngram", "num-speculative-tokens": 4}, {"method": "ngarm", "num_speculative_tokens": 4}):
        assert translate(spec, vllm_methods=("ngram",), vllm_keys=_KEYS) == (spec, None)


def test_request_options():
    """``SamplingParams.extra_args`` of one request: drafting off, or its own block size within the engine's; other
    extensions' keys ignored; a bad value or a misspelt ``jf_`` key is one line naming it, the range and the value."""
    from megatron_jf.vllm_plugin.methods import request_block_size

    cfg = DecodeConfig("mr", block_size=4, num_blocks=2)
    assert request_block_size(None, cfg) == request_block_size({"kv_transfer_params": {}}, cfg) == 4
    assert request_block_size({"jf_draft": False}, cfg) == request_block_size({"jf_draft": 0}, cfg) == 0
    assert request_block_size({"jf_draft": True, "jf_block_size": 2}, cfg) == 2
    assert request_block_size({"jf_block_size": 4}, cfg) == 4
    for extra, words in [({"jf_block_size": 5}, ["jf_block_size", "1..4", "got 5"]),
                         ({"jf_block_size": 0}, ["jf_block_size", "1..4", "got 0"]),
                         ({"jf_block_size": "2"}, ["jf_block_size", "1..4", "got '2'"]),
                         ({"jf_block_size": True}, ["jf_block_size", "got True"]),
                         ({"jf_draft": "no"}, ["jf_draft", "true or false", "got 'no'"]),
                         ({"jf_draft": 2}, ["jf_draft", "true or false", "got 2"]),
                         ({"jf_blocksize": 2}, ["'jf_blocksize'", "did you mean 'jf_block_size'"])]:
        with pytest.raises(ValueError) as e:
            request_block_size(extra, cfg)
        assert "\n" not in str(e.value) and all(w in str(e.value) for w in words), str(e.value)


def test_proposer_needs_the_plugin_method():
    with pytest.raises(RuntimeError, match="method 'jacobi' or 'mr'.*not method 'custom_class'"):
        methods.from_additional_config({})
    _, ours = translate({"method": "mr", "num_speculative_tokens": 8})
    assert methods.from_additional_config({ADDITIONAL_CONFIG_KEY: ours}) == ("mr", DecodeConfig("mr", block_size=4))


def test_untested_vllm_version_fails_with_one_clear_line(monkeypatch):
    for name in (vllm_internals.UNTESTED_OK_ENV, "JF_VLLM_UNTESTED_OK"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(vllm_internals.UnsupportedVLLMError) as e:
        vllm_internals.check_version("0.33.1")
    msg = str(e.value)
    assert "\n" not in msg and "vLLM 0.33.1 is not supported" in msg
    assert "0.32.0" in msg and "MEGATRON_JF_VLLM_UNTESTED_OK" in msg
    assert vllm_internals.check_version("0.32.0") == "0.32.0"
    monkeypatch.setenv(vllm_internals.UNTESTED_OK_ENV, "1")
    assert vllm_internals.check_version("0.33.1") == "0.33.1"
    monkeypatch.delenv(vllm_internals.UNTESTED_OK_ENV)
    monkeypatch.setenv("JF_VLLM_UNTESTED_OK", "1")  # the earlier name, still read
    assert vllm_internals.check_version("0.33.1") == "0.33.1"


def test_imports_pull_in_no_torch_megatron_or_vllm():
    code = ("import sys, megatron_jf, megatron_jf.decoding, megatron_jf.vllm_plugin, megatron_jf.vllm_plugin.methods, "
            "megatron_jf.vllm_plugin.proposer, megatron_jf.vllm_plugin.vllm_internals\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy', 'megatron', 'vllm'))\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------- the proposer under a model-free stand-in runner
def _f(seq):
    """Next token of a deterministic 'model' over 23 tokens that depends on the last two tokens."""
    return (seq[-1] * 7 + seq[-2] * 3 + 1) % 23 if len(seq) > 1 else 5


def _predict(tokens, start):
    return [_f(tokens[: j + 1]) for j in range(start, len(tokens))]


def _run_batch(proposer, requests, max_tokens, *, cut=None, skip=(), preempt=None, verified=None):
    """A stand-in for vLLM's runner loop around the proposer: requests join at given steps (a prefill chunk first
    when marked), each step verifies every row's pending draft greedily against ``_f`` and hands the proposer a
    BatchView; finished requests are reported in the next step. Returns per request the output and the drafts
    the proposer made.

    What vLLM does to drafts, on request: ``cut(step, request id, draft)`` -> how many of the draft's tokens are
    verified (a prefix: token budget, max_model_len, structured output); after each step in ``skip`` the proposer
    is not called and every row's next draft is zeros (vLLM when a row is too close to max_model_len);
    ``preempt[id] = (first, last)``: the request is out of the batch for those steps and then recomputed (a prefill
    that emits one token and verifies no draft). ``verified``, a dict: filled with ``(request id, context length
    after the step) -> the draft tokens verified``."""
    import numpy as np

    k_max = proposer.max_draft
    live, out, pending, finished, drafts_seen = [], {}, {}, set(), {}
    step = 0
    while step == 0 or live or any(r["join"] >= step for r in requests):
        for r in requests:
            if r["join"] == step:
                live.append(r["id"])
                out[r["id"]], pending[r["id"]] = [], []
        out_now = {rid for rid, (a, b) in (preempt or {}).items() if a <= step <= b}
        rows = [rid for rid in live if rid not in out_now]
        tok = np.zeros((len(rows), 512), dtype=np.int64)
        num = np.zeros(len(rows), dtype=np.int64)
        sampled, drafts, preds = [], [], []
        for i, rid in enumerate(rows):
            req = next(r for r in requests if r["id"] == rid)
            ctx = req["prompt"] + out[rid]
            chunked = req.get("chunk") and step == req["join"]
            resumed = preempt and rid in preempt and step == preempt[rid][1] + 1
            draft = [] if chunked or resumed or not out[rid] else pending[rid]
            if cut is not None and draft:
                draft = draft[: cut(step, rid, draft)]
            g = [] if chunked else _predict(ctx + draft, len(ctx) - 1)
            k = 0
            while k < len(draft) and draft[k] == g[k]:
                k += 1
            emitted = [] if chunked else draft[:k] + [g[k]]
            out[rid] += emitted
            sampled.append(emitted)
            drafts.append(draft)
            preds.append(g if draft else g[:1])
            full = req["prompt"] + out[rid]
            tok[i, : len(full)] = full
            num[i] = len(full)
            if verified is not None:
                verified[rid, len(full)] = list(draft)
        view = vllm_internals.BatchView(req_ids=rows, prompt_lens=[len(next(r for r in requests if r["id"] == x)
                                                                       ["prompt"]) for x in rows],
                                        seeds=[None] * len(rows),
                                        extra_args=[next(r for r in requests if r["id"] == x).get("extra_args")
                                                    for x in rows],
                                        sampled=sampled, verification=vllm_internals.Verification(drafts, preds),
                                        _token_ids=tok, _num_tokens=num)
        proposer.finish(finished)  # vLLM's _update_states, every step
        new = [[0] * k_max for _ in rows] if step in skip else proposer.propose_batch(view)
        finished = set()
        for i, rid in enumerate(rows):
            assert len(new[i]) <= k_max
            pending[rid] = new[i]
            if sampled[i] and step not in skip:
                drafts_seen.setdefault(rid, []).append(new[i])
            if len(out[rid]) >= max_tokens:
                out[rid] = out[rid][:max_tokens]
                live.remove(rid)
                finished.add(rid)
        step += 1
    proposer.finish(finished)
    return out, drafts_seen


def _proposer(spec):
    """The proposer of ``spec``, at the fixed width unless ``spec`` says otherwise (the tests that replay a policy's
    drafts exactly; the auto width follows the steps' times)."""
    from megatron_jf.vllm_plugin.proposer import JacobiForcingProposer

    _, ours = translate({"draft_width": "fixed", **spec})
    return JacobiForcingProposer(SimpleNamespace(
        additional_config={ADDITIONAL_CONFIG_KEY: ours},
        speculative_config=SimpleNamespace(num_speculative_tokens=spec["num_speculative_tokens"])))


def _ar(prompt, n):
    seq = list(prompt)
    for _ in range(n):
        seq.append(_f(seq))
    return seq[len(prompt):]


@pytest.mark.parametrize("method", ["jacobi", "mr"])
def test_proposer_keeps_each_request_on_its_own_trajectory(method):
    """Three requests sharing the proposer (one joining late, one prefilled in two chunks): each request's output
    is greedy AR and its drafts are exactly the reference loop's for that request alone."""
    spec = {"jacobi": {"method": "jacobi", "num_speculative_tokens": 4},
            "mr": {"method": "mr", "num_speculative_tokens": 8, "num_blocks": 2, "spawn_threshold": 0.5}}[method]
    proposer = _proposer(spec)
    requests = [{"id": "a", "prompt": [3, 1, 4], "join": 0}, {"id": "b", "prompt": [9, 2], "join": 2},
                {"id": "c", "prompt": [7, 7, 1, 5], "join": 1, "chunk": True}]
    rule = (RunningWindowRule(4) if method == "jacobi"
            else PolicyRule(policy_for(decode_config({"draft_width": "fixed", **spec}), linear=True)))
    out, drafts = _run_batch(proposer, requests, 30)
    for r in requests:
        ref_out, ref_drafts, _ = reference_decode(_predict, rule, r["prompt"], max_tokens=30,
                                                  max_draft=spec["num_speculative_tokens"], eos=None)
        assert out[r["id"]] == ref_out == _ar(r["prompt"], 30)
        assert drafts[r["id"]][: len(ref_drafts)] == ref_drafts
    assert proposer.states == {} and proposer.live_states() == 0  # finished requests are forgotten


@pytest.mark.parametrize("cost", ["free", "dear"])
def test_proposer_auto_width_follows_vllms_step_times(cost, monkeypatch):
    """``draft_width: auto`` (the plugin's default): the proposer times vLLM's steps by the tokens they forwarded
    and cuts the drafts to the width that pays -- the whole draft where a wider step costs nothing more ("free"),
    no draft where each token costs a step ("dear") -- after exploring (the first steps AR, then whole drafts, then
    now and then a width not timed yet).
    Output is greedy AR either way."""
    from megatron_jf.vllm_plugin import proposer as mod

    spec = {"method": "mr", "num_speculative_tokens": 8, "num_blocks": 2, "spawn_threshold": 0.5,
            "draft_width": "auto"}
    proposer = _proposer(spec)
    clock = [0.0]
    monkeypatch.setattr(mod.time, "perf_counter", lambda: clock[0])
    real = proposer.propose_batch

    def timed(view):  # vLLM's step before this call: 1 s, or 1 s per token forwarded
        tokens = sum(1 + len(d) for d in view.verification.drafts)
        clock[0] += 1.0 if cost == "free" else float(tokens)
        return real(view)

    proposer.propose_batch = timed
    cuts = []  # per step: (proposed, forwarded) draft lengths of the row
    cut = proposer._cut

    def spy(drafts, auto):
        before = len(drafts[0])
        cut(drafts, auto)
        cuts.append((before, len(drafts[0])))

    proposer._cut = spy
    out, _ = _run_batch(proposer, [{"id": "a", "prompt": [3, 1, 4], "join": 0}], 80)
    assert out["a"] == _ar([3, 1, 4], 80)
    assert [c[1] for c in cuts[:2]] == [0, 0] and all(a == b > 0 for a, b in cuts[2:4])  # exploring: AR, then whole
    late = cuts[24:]  # (widths not timed yet are tried every EXPLORE_EVERY steps until timed)
    assert len(late) > 10
    if cost == "free":
        assert all(a == b for a, b in late), cuts  # the whole draft
    else:
        assert all(b == 0 for _, b in late)  # no draft
    assert proposer.step_times.table() is not None


# ------------------------------------------------ MR with K >= 3 when vLLM verifies less than the policy drafted
def _mr(K, n=4, r=0.5):
    return {"method": "mr", "num_speculative_tokens": K * n, "num_blocks": K, "spawn_threshold": r}


@pytest.mark.parametrize("K", [3, 4])
def test_mr_policy_under_truncated_verification(K):
    """MR's update after a forward that verified only a prefix of the draft (vLLM's token budget, max_model_len,
    structured output, preemption: ``g`` has ``m + 1 <= len(draft)`` predictions), 300 steps with random cuts: no
    IndexError (before the fix: the pseudo-active block's stable count read ``g`` past its end, within the first 10
    steps here), the output is greedy AR, the draft always covers exactly the blocks in flight, and the positions
    the forward did not predict keep their guesses."""
    import random

    from megatron_jf.decoding import Outcome, accepted_prefix

    pol = policy_for(decode_config(_mr(K)), linear=True)
    prompt = [3, 1, 4]
    st = pol.new_state(prompt, 0)
    ctx = prompt + [_f(prompt)]
    rnd = random.Random(K)
    exercised = 0
    for step in range(300):
        d = list(pol.propose(st, ctx).draft)
        end, pseudo_active = st.blocks[-1], len(st.blocks) > 1  # where the blocks in flight end; a 2nd in flight
        m = min(rnd.choice([0, 1, 2, 3, len(d), len(d)]), len(d))
        g = _predict(ctx + d[:m], len(ctx) - 1)  # m + 1 predictions: the verified prefix and the bonus
        k = accepted_prefix(d[:m], g)
        emitted = d[:k] + [g[k]]
        ctx = ctx + emitted
        pol.observe(st, ctx, Outcome(g, emitted, len(emitted) - 1))
        e = len(ctx) - len(prompt)
        assert len(st.draft) == st.blocks[-1] - e and all(b > e for b in st.blocks)
        if len(g) < len(d) and len(emitted) < len(g):  # unpredicted positions (up to the blocks' end) keep guesses
            j = len(g) - len(emitted)  # where old position len(g) is in the new draft
            kept = d[len(g):][: max(0, end - e - j)]
            assert st.draft[j: j + len(kept)] == kept
        exercised += pseudo_active and m < len(d)
    assert ctx[len(prompt):] == _ar(prompt, len(ctx) - len(prompt))
    assert exercised > 50  # cut verifications while a pseudo-active block was in flight (the path that raised)


@pytest.mark.parametrize("K", [3, 4])
def test_mr_proposer_when_vllm_cuts_skips_and_preempts(K):
    """The proposer with K = 3 and 4 under what vLLM does to drafts: cut to a prefix at random, a step where vLLM
    does not call the proposer and verifies zero drafts instead (near max_model_len), a preempted request
    recomputed without a draft -- with request options (one with drafting off, one with block size 2). Every
    output is greedy AR, nothing raises, and the proposer holds no state once the requests finished."""
    import random

    rnd = random.Random(K)
    proposer = _proposer(_mr(K))
    requests = [{"id": "a", "prompt": [3, 1, 4], "join": 0}, {"id": "b", "prompt": [9, 2], "join": 1},
                {"id": "c", "prompt": [7, 7, 1, 5], "join": 2, "chunk": True},
                {"id": "d", "prompt": [5, 6], "join": 0, "extra_args": {"jf_draft": False}},
                {"id": "e", "prompt": [8, 1, 2], "join": 3, "extra_args": {"jf_block_size": 2}}]
    out, drafts = _run_batch(proposer, requests, 120, cut=lambda step, rid, d: rnd.choice([0, 1, 2, 3, len(d)]),
                             skip={6, 7, 30}, preempt={"b": (10, 13), "a": (40, 41)})
    for r in requests:
        assert out[r["id"]] == _ar(r["prompt"], 120), r["id"]
    assert all(d == [] for d in drafts["d"]) and all(len(d) <= 2 * K for d in drafts["e"])
    assert max(len(d) for d in drafts["a"]) > 4  # pseudo-active blocks were drafted (and cut)
    assert proposer.live_states() == 0


def test_proposer_updates_from_the_draft_vllm_verified():
    """MR's update is made from the draft vLLM verified, at the positions it verified: its own draft when vLLM
    verified it or a prefix of it, and the zeros vLLM drafted itself in the steps after it skipped the proposer
    (without adopting them, the update would compare predictions with a stale draft at other positions)."""
    from megatron_jf.decoding import MRPolicy

    seen = []

    class Spy(MRPolicy):
        def observe(self, state, context, outcome):
            seen.append((len(context), list(state.draft)))
            super().observe(state, context, outcome)

    spec = _mr(3)
    proposer = _proposer(spec)
    proposer.policy = Spy(decode_config({"draft_width": "fixed", **spec}), linear=True)
    verified = {}
    skip = {5, 14, 30}
    out, _ = _run_batch(proposer, [{"id": "a", "prompt": [3, 1, 4], "join": 0}], 60,
                        cut=lambda step, rid, d: len(d) if step % 3 else 2, skip=skip, verified=verified)
    assert out["a"] == _ar([3, 1, 4], 60) and len(seen) > 20
    adopted = 0
    for n_ctx, draft in seen:
        v = verified["a", n_ctx]
        assert draft[: len(v)] == v, (n_ctx, draft, v)
        adopted += v == [0] * len(v) and len(v) > 0 and draft == v
    assert adopted == len(skip)  # one step after each skipped one verified vLLM's zeros, adopted whole
