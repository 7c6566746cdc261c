"""Degenerate-output flags next to TPF and speedup (megatron_jf.eval.degenerate, harness table, quickstart report)."""

import json

from megatron_jf.eval.degenerate import degeneracy, degeneracy_from_stats, pc_loss_identically_zero, token_stats
from megatron_jf.eval.harness import markdown_table


def test_repeated_token_is_flagged_and_varied_text_is_not():
    spaces = [[220] * 64 for _ in range(6)]  # the smoke model's output: one token (a space) over and over
    d = degeneracy(spaces, decode=lambda ids: " " * len(ids))
    assert d["degenerate"] and d["top_token_share"] == 1.0 and d["distinct_2"] < 0.02
    assert "100% of generated tokens are one token 220 (' ')" in d["warning"] and "TPF" in d["warning"]
    varied = [list(range(i, i + 40)) for i in range(6)]
    d = degeneracy(varied)
    assert not d["degenerate"] and d["warning"] is None and d["distinct_2"] == 1.0
    loop = [[1, 2, 3, 4] * 16]  # a short loop: no token dominates, but distinct-2 is tiny
    d = degeneracy(loop)
    assert d["degenerate"] and "distinct-2" in d["warning"] and d["top_token_share"] == 0.25
    assert degeneracy([])["degenerate"] is False
    # the pooled verdict from stored per-completion stats matches the one from the tokens
    assert degeneracy_from_stats([token_stats(s) for s in spaces])["warning"] == degeneracy(spaces)["warning"]
    assert degeneracy_from_stats([token_stats(s) for s in varied])["degenerate"] is False


def test_pc_loss_identically_zero(tmp_path):
    f = tmp_path / "jf_log.jsonl"
    assert pc_loss_identically_zero(str(f)) is None
    f.write_text("".join(json.dumps(r) + "\n" for r in [{"split": "train", "pc_loss": 0.0, "ar_loss": 2.1},
                                                          {"split": "train", "pc_loss": 0.0, "ar_loss": 2.0},
                                                          {"split": "valid", "pc_loss": 0.3}]))
    assert pc_loss_identically_zero(str(f)) is True
    with open(f, "a") as fh:
        fh.write(json.dumps({"split": "train", "pc_loss": 0.0125}) + "\n")
    assert pc_loss_identically_zero(str(f)) is False


def _method(tpf, deg):
    return {"tpf": tpf, "tps_decode": 100.0, "tps_e2e": 90.0, "latency_p50_s": 0.1, "latency_p95_s": 0.2,
            "accuracy": 0.5, "degeneracy": deg}


def test_evaluate_table_carries_the_warnings():
    bad = degeneracy([[7] * 50] * 4)
    good = degeneracy([list(range(50))] * 4)
    summary = {"n": 4, "ar": _method(1.0, bad), "decoder": _method(16.0, bad), "speedup": 9.3,
               "lossless": {"identical": 4, "checked": 4}, "isolation": "none",
               "accuracy_by_benchmark": {"math": {"ungraded": 1, "ungraded_ids": ["m3"]}}}
    md = markdown_table("HumanEval", "Jacobi", summary)
    rows = md.splitlines()
    assert rows[3].startswith("| HumanEval | Jacobi | 9.30× | 16.00 |")
    assert rows[4].startswith("| HumanEval | AR | ⚠ | ⚠ |") and "DEGENERATE OUTPUT" in rows[4]
    assert rows[5].startswith("| HumanEval | Jacobi | ⚠ | ⚠ |") and "DEGENERATE OUTPUT" in rows[5]
    assert "UNISOLATED" in md and "1 UNGRADED (math" in md and "m3" in md
    summary.update(ar=_method(1.0, good), decoder=_method(3.0, good), isolation="os", accuracy_by_benchmark={})
    md = markdown_table("HumanEval", "Jacobi", summary)
    assert "⚠" not in md
