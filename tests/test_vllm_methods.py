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


@pytest.mark.parametrize("spec, match", [
    ({"method": "jacobi"}, "num_speculative_tokens >= 1"),
    ({"method": "mr", "num_speculative_tokens": 0}, "num_speculative_tokens >= 1"),
    ({"method": "jacobi", "num_speculative_tokens": 4, "num_blocks": 2}, "does not take num_blocks"),
    ({"method": "mr", "num_speculative_tokens": 9, "num_blocks": 2}, "must be num_blocks"),
    ({"method": "mr", "num_speculative_tokens": 8, "spawn_threshold": 1.5}, "spawn threshold r"),
    ({"method": "jacobi", "num_speculative_tokens": 4, "draft_init": "zeros"}, "unknown draft init"),
    ({"method": "jacobi", "num_speculative_tokens": 4, "prompt_lookup_max": 3}, "does not take prompt_lookup_max"),
    ({"method": "mr", "num_speculative_tokens": 8, "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt lookup"),
])
def test_bad_speculative_configs_are_named(spec, match):
    with pytest.raises(ValueError, match=match):
        translate(spec)


def test_proposer_needs_the_plugin_method():
    with pytest.raises(RuntimeError, match="method 'jacobi' or 'mr'.*not method 'custom_class'"):
        methods.from_additional_config({})
    _, ours = translate({"method": "mr", "num_speculative_tokens": 8})
    assert methods.from_additional_config({ADDITIONAL_CONFIG_KEY: ours}) == ("mr", DecodeConfig("mr", block_size=4))


def test_untested_vllm_version_fails_with_one_clear_line(monkeypatch):
    monkeypatch.delenv(vllm_internals.UNTESTED_OK_ENV, raising=False)
    with pytest.raises(vllm_internals.UnsupportedVLLMError) as e:
        vllm_internals.check_version("0.33.1")
    msg = str(e.value)
    assert "\n" not in msg and "vLLM 0.33.1 is untested" in msg and "0.32.0" in msg and "JF_VLLM_UNTESTED_OK" in msg
    assert vllm_internals.check_version("0.32.0") == "0.32.0"
    monkeypatch.setenv(vllm_internals.UNTESTED_OK_ENV, "1")
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


def _run_batch(proposer, requests, max_tokens):
    """A stand-in for vLLM's runner loop around the proposer: requests join at given steps (a prefill chunk first
    when marked), each step verifies every row's previous draft greedily against ``_f`` and hands the proposer a
    BatchView; finished requests are reported in the next step. Returns per request the output and the drafts
    the proposer made."""
    import numpy as np

    k_max = proposer.max_draft
    live, out, pending, finished, drafts_seen = [], {}, {}, set(), {}
    step = 0
    while step == 0 or live or any(r["join"] >= step for r in requests):
        for r in requests:
            if r["join"] == step:
                live.append(r["id"])
                out[r["id"]], pending[r["id"]] = [], []
        rows = list(live)
        tok = np.zeros((len(rows), 512), dtype=np.int64)
        num = np.zeros(len(rows), dtype=np.int64)
        sampled, drafts, preds = [], [], []
        for i, rid in enumerate(rows):
            req = next(r for r in requests if r["id"] == rid)
            ctx = req["prompt"] + out[rid]
            chunked = req.get("chunk") and step == req["join"]
            draft = [] if chunked or not out[rid] else pending[rid]
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
        view = vllm_internals.BatchView(req_ids=rows, prompt_lens=[len(next(r for r in requests if r["id"] == x)
                                                                       ["prompt"]) for x in rows],
                                        seeds=[None] * len(rows), sampled=sampled,
                                        verification=vllm_internals.Verification(drafts, preds),
                                        _token_ids=tok, _num_tokens=num)
        proposer.finish(finished)
        new = proposer.propose_batch(view)
        finished = set()
        for i, rid in enumerate(rows):
            assert len(new[i]) <= k_max
            pending[rid] = new[i]
            if sampled[i]:
                drafts_seen.setdefault(rid, []).append(new[i])
            if len(out[rid]) >= max_tokens:
                out[rid] = out[rid][:max_tokens]
                live.remove(rid)
                finished.add(rid)
        step += 1
    proposer.finish(finished)
    return out, drafts_seen


@pytest.mark.parametrize("method", ["jacobi", "mr"])
def test_proposer_keeps_each_request_on_its_own_trajectory(method):
    """Three requests sharing the proposer (one joining late, one prefilled in two chunks): each request's output
    is greedy AR and its drafts are exactly the reference loop's for that request alone."""
    from megatron_jf.vllm_plugin.proposer import JacobiForcingProposer

    spec = {"jacobi": {"method": "jacobi", "num_speculative_tokens": 4},
            "mr": {"method": "mr", "num_speculative_tokens": 8, "num_blocks": 2, "spawn_threshold": 0.5}}[method]
    _, ours = translate(spec)
    cfg = SimpleNamespace(additional_config={ADDITIONAL_CONFIG_KEY: ours},
                          speculative_config=SimpleNamespace(num_speculative_tokens=spec["num_speculative_tokens"]))
    proposer = JacobiForcingProposer(cfg)
    requests = [{"id": "a", "prompt": [3, 1, 4], "join": 0}, {"id": "b", "prompt": [9, 2], "join": 2},
                {"id": "c", "prompt": [7, 7, 1, 5], "join": 1, "chunk": True}]
    rule = (RunningWindowRule(4) if method == "jacobi"
            else PolicyRule(policy_for(decode_config(spec), linear=True)))
    out, drafts = _run_batch(proposer, requests, 30)
    for r in requests:
        ref_out, ref_drafts, _ = reference_decode(_predict, rule, r["prompt"], max_tokens=30,
                                                  max_draft=spec["num_speculative_tokens"], eos=None)
        assert out[r["id"]] == ref_out == [_f((r["prompt"] + ref_out)[: len(r["prompt"]) + j])
                                           for j in range(30)]
        assert drafts[r["id"]][: len(ref_drafts)] == ref_drafts
    assert proposer.states == {}  # finished requests are forgotten
