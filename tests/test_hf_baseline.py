"""Speedups against the faster AR: transformers greedy timed on the same weights in the same run (issue 14)."""
import json

import pytest
import torch

from tests.test_evaluate import _eval_args, _records, _tool, ckpt  # noqa: F401  (the tiny checkpoint fixture)


def test_hf_twin_has_the_same_weights(mp1):
    from megatron_jf.eval.hf_baseline import hf_twin, time_hf_greedy
    from megatron_jf.inference.engine import DecodeConfig, Engine
    from megatron_jf.models.convert import hf_to_mcore
    from megatron_jf.models.gpt import build_model
    from megatron_jf.models.hf_config import ModelArgs
    from megatron_jf.models.zoo import tiny_hf_model

    for tied in (False, True):
        ref = tiny_hf_model("llama", seed=7, scale=0.3, tied=tied)
        args = ModelArgs.from_hf_dict(ref.config.to_dict())
        m = build_model(args).eval()
        m.load_state_dict(hf_to_mcore(ref.state_dict(), args), strict=False)
        twin = hf_twin(m)
        x = torch.tensor([[0, 5, 0, 9, 31]])
        torch.testing.assert_close(twin(x).logits, ref(x).logits, rtol=1e-5, atol=1e-5)
        wall, toks = time_hf_greedy(twin, [0, 5, 0, 9], 9)
        assert wall > 0 and toks == Engine(m).generate([[0, 5, 0, 9]], DecodeConfig("ar"), max_new_tokens=9)[0].tokens


def test_fastest_ar_names_the_faster():
    from megatron_jf.eval.hf_baseline import HF, OURS, fastest_ar

    assert fastest_ar(2.0, 3.0) == (OURS, 2.0)
    assert fastest_ar(3.0, 2.0) == (HF, 2.0)
    assert fastest_ar(3.0, None) == (OURS, 3.0)


def test_evaluate_reports_speedup_against_the_faster_ar(ckpt, tmp_path):  # noqa: F811
    from megatron_jf.eval.hf_baseline import HF, OURS

    ev = _tool("evaluate")
    out = tmp_path / "out"
    assert ev.main(_eval_args(ckpt, out, "gsm8k")) == 0
    recs = _records(out / "gsm8k_jacobi.jsonl")
    assert all(r["hf"]["equal"] and r["hf"]["new_tokens"] == r["ar"]["new_tokens"] for r in recs)
    s = json.load(open(out / "gsm8k_jacobi.summary.json"))
    hf_wall = sum(r["hf"]["wall_s"] for r in recs)
    assert s["hf_greedy"]["wall_s"] == pytest.approx(hf_wall) and s["hf_greedy"]["identical_to_ar"] == 2
    base = min(s["ar"]["wall_s"], hf_wall)
    assert s["fastest_ar"] == (OURS if s["ar"]["wall_s"] <= hf_wall else HF)
    assert s["speedup_vs_fastest_ar"] == pytest.approx(base / s["decoder"]["wall_s"])
    md = open(out / "gsm8k_jacobi.md").read()
    assert f"speedup against the faster AR ({s['fastest_ar']}): {s['speedup_vs_fastest_ar']:.2f}×" in md
    # without the baseline: the faster AR is this project's
    out2 = tmp_path / "out2"
    assert ev.main(_eval_args(ckpt, out2, "gsm8k", "--no-hf-baseline")) == 0
    s2 = json.load(open(out2 / "gsm8k_jacobi.summary.json"))
    assert s2["hf_greedy"] is None and s2["fastest_ar"] == OURS
    assert s2["speedup_vs_fastest_ar"] == pytest.approx(s2["speedup"])
