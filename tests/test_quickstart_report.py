"""The quickstart report never contradicts itself: one warning line per flagged model, no target "met" next to a
flag, a one-sided pass@1 target; and its batch-1 timing method (warm-up, interleaved rounds, fastest round)."""

from __future__ import annotations

import pytest

from recipes.quickstart.interpret import interpretation_markdown, row_check, target_verdict, warning_lines
from recipes.quickstart.timing import time_interleaved, torch_threads

DEGENERATE = ("DEGENERATE OUTPUT: distinct-2 0.051 < 0.1 - TPF and speedup are not meaningful; L_pc IDENTICALLY ZERO "
              "during JF training (pc_loss = 0 at every logged step)")


def _row(model, dec, tpf, nll, warning=None):
    return {"model": model, "decoder": dec, "tpf": tpf, "speedup": 1.0, "pass@1": None, "nll": nll,
            "tf_agreement_with_base": 1.0 if model == "base" else 0.9, "distinct4": 0.5, "output_warning": warning}


def _summary(final_warning=None, base_warning=None):
    rows = [_row("base", "AR", 1.0, 3.0, base_warning), _row("base", "Jacobi (n=32)", 1.05, 3.0, base_warning),
            _row("JF round 2", "AR", 1.0, 3.05, final_warning),
            _row("JF round 2", "Jacobi (n=32)", 2.3, 3.05, final_warning)]
    warnings = {m: w for m, w in (("base", base_warning), ("JF round 2", final_warning)) if w}
    return {"rows": rows, "warnings": warnings}


def test_flagged_models_never_meet_a_target():
    ok = interpretation_markdown(_summary())
    assert "target TPF > 1.13 at drift <= 0.1 met" in ok and "target <= 0.1 met" in ok and "not meaningful" not in ok
    md = interpretation_markdown(_summary(final_warning=DEGENERATE))
    assert " met" not in md and "missed" not in md  # neither verdict next to a flag
    assert md.count("not meaningful (JF round 2: degenerate output, L_pc identically zero)") == 2
    md = interpretation_markdown(_summary(base_warning="DEGENERATE OUTPUT: 100% of generated tokens are one token"))
    assert md.count("not meaningful (base: degenerate output)") == 2 and " met" not in md
    # a miss says which half missed, to the precision that shows it, when nothing is flagged
    s = _summary()
    s["rows"][-1]["tpf"] = 1.1298
    assert "1.05 -> 1.13 at held-out NLL drift +0.050: target TPF > 1.13 at drift <= 0.1 missed (TPF 1.130 <= 1.13)" \
        in interpretation_markdown(s)
    s["rows"][-1]["nll"] = s["rows"][-2]["nll"] = 3.2
    assert "missed (TPF 1.130 <= 1.13, drift +0.200)" in interpretation_markdown(s)


def test_pass_at_1_target_is_one_sided():
    def md(base, final):
        curve = [{"pass@1": base / 40, "pass_prompts": 40}, {"pass@1": final / 40, "pass_prompts": 40}]
        return interpretation_markdown(dict(_summary(), learning_curve=curve))

    assert "+3 problems, target within 2: met" in md(10, 13)  # a gain is never "missed"
    assert "-2 problems, target within 2: met" in md(10, 8)
    assert "-3 problems, target within 2: missed" in md(10, 7)
    assert target_verdict(True, {"x": DEGENERATE}, ("x",)).startswith("not meaningful")
    assert target_verdict(False, {"x": None}, ("x",)) == "missed"


def test_one_warning_line_per_model_and_short_tags_in_cells():
    warnings = {"base": None, "JF round 2": DEGENERATE}
    assert warning_lines(warnings) == [f"**WARNING (JF round 2)**: {DEGENERATE}."]
    assert row_check({"output_warning": DEGENERATE}) == "⚠ degenerate output, L_pc identically zero"
    assert row_check({"output_warning": None}) == "ok"


def test_markdown_prints_each_warning_once():
    from recipes.quickstart.report import _markdown

    s = _summary(final_warning=DEGENERATE)
    for r in s["rows"]:
        r.update(tps=100.0, agreement_with_base=1.0, speedup=1.0, fastest_ar="AR")
    s.update(preset="smoke", eval_prompts=2, timing_prompts=2, response_tokens=8,
             tpf_by_block_size={"base": {8: 1.0}, "JF round 2": {8: 2.0}})
    md = _markdown(s)
    assert md.count(DEGENERATE) == 1
    assert md.count("| ⚠ degenerate output, L_pc identically zero |") == 2  # the two JF round 2 rows
    assert md.count("| ok |") == 2


def test_time_interleaved_warms_up_rotates_and_keeps_the_fastest_round():
    calls = []
    # decode seconds each runner reports, per call (the warm-up is the first call of each)
    script = {"AR": [9.0, 4.0, 2.0, 3.0], "Jacobi": [9.0, 1.0, 1.5, 1.2], "HF": [9.0, 5.0, 5.0, 5.0]}

    def runner(name):
        def run():
            calls.append(name)
            d = script[name][sum(c == name for c in calls) - 1]
            return d, d + 0.5, 100
        return run

    got = time_interleaved({n: runner(n) for n in script}, rounds=3)
    # one untimed warm-up each, then the order rotates every round
    assert calls == ["AR", "Jacobi", "HF", "AR", "Jacobi", "HF", "Jacobi", "HF", "AR", "HF", "AR", "Jacobi"]
    assert got["AR"]["decode_s"] == 2.0 and got["AR"]["tps"] == 50.0 and got["AR"]["spread"] == 2.0
    assert got["Jacobi"]["decode_s"] == 1.0 and got["Jacobi"]["e2e_s"] == 1.5 and got["Jacobi"]["tps_e2e"] == 100 / 1.5
    assert got["HF"]["spread"] == 1.0 and got["AR"]["tokens"] == 100


def test_time_interleaved_uses_the_given_warmup_and_checks_token_counts():
    seen = []
    got = time_interleaved({"a": lambda: (1.0, 1.0, 5)}, rounds=2, warmup={"a": lambda: seen.append("warm")})
    assert seen == ["warm"] and got["a"]["tps"] == 5.0
    counts = iter([5, 6])
    with pytest.raises(ValueError, match="a: tokens differ between rounds"):
        time_interleaved({"a": lambda: (1.0, 1.0, next(counts))}, rounds=2, warmup={"a": lambda: None})
    with pytest.raises(ValueError, match="rounds >= 1"):
        time_interleaved({"a": lambda: (1.0, 1.0, 1)}, rounds=0)


def test_torch_threads_restores_the_thread_count():
    import torch

    before = torch.get_num_threads()
    with torch_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
