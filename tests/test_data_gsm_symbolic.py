"""The math domain's problems (megatron_jf/data/gsm_symbolic.py): reasoning-gym's GSM-Symbolic generators loaded
without the package's heavy import, deterministic problems, disjoint splits, and answer / arithmetic scoring."""
import sys

import pytest

from megatron_jf.data import gsm_symbolic as G


def test_generators_load_without_importing_the_package():
    gens = G.generators()
    assert len(G.usable_templates()) == 85 and set(G.usable_templates()) <= set(gens)
    assert "reasoning_gym" not in sys.modules  # the stand-in package is gone again
    p = G.generate(3, 7)
    assert p == G.generate(3, 7) and p != G.generate(3, 8)  # deterministic per (template, seed)
    assert p.prompt_text().startswith("Question: ") and p.prompt_text().endswith("\nAnswer:")
    assert p.response_text().startswith(" ") and p.chain.splitlines()[-1] == f"#### {p.answer}"
    assert p.text() == p.prompt_text() + p.response_text()


def test_splits_are_disjoint_and_hold_out_templates():
    s = G.make_splits(300, 100, 60, 20, n_heldout_templates=5, seed=1)
    assert len(s.heldout_templates) == 5 and (len(s.pretrain), len(s.train), len(s.heldout)) == (300, 100, 60)
    held_t = set(s.heldout_templates)
    for probs in (s.pretrain, s.train, s.heldout):
        assert not {p.template for p in probs} & held_t
    assert {p.template for p in s.heldout_template} <= held_t and len(s.heldout_template) == 20
    seen = {p.question for p in s.pretrain + s.train}
    assert not {p.question for p in s.heldout} & seen  # held-out questions are new as text
    assert len({p.uid for p in s.pretrain + s.train + s.heldout + s.heldout_template}) == 480
    assert s == G.make_splits(300, 100, 60, 20, n_heldout_templates=5, seed=1)
    with pytest.raises(ValueError, match="n_heldout_templates"):
        G.make_splits(1, 1, 1, 1, n_heldout_templates=85)


def test_final_answer_and_arithmetic_steps():
    assert G.final_answer("so 3 + 4 = 7\n#### 1,234\n#### 5") == "1234"
    assert G.final_answer("no answer here") is None
    assert G.answers_match("6.0", "6") and G.answers_match("1234", "1,234") and not G.answers_match("7", "6")
    assert not G.answers_match(None, "6")
    text = ("He has 9-6=3 pals. 3*2=6 letters, 6 * 12 = 71 pages. Then 3 + 9 + 12 = 24 slices and $370,000 x 3/100 "
            "= $11,100. 0.22*80 = 17 students. 19 / 20 = 95.0% and 40 questions x 60/100 = 24 (units: not counted)")
    # right: 9-6=3, 3*2=6, 3+9+12=24, 370000*3/100=11100, 0.22*80 -> 17 (rounded down), 19/20 = 95.0%; wrong: 6*12=71
    assert G.arithmetic_steps(text) == (6, 7)
    # the ground-truth chains score (almost) all right: the measure reads them as they are written
    right = total = 0
    for p in G.make_splits(400, 0, 0, 0).pretrain:
        r, t = G.arithmetic_steps(p.chain)
        right, total = right + r, total + t
    assert total > 600 and right / total > 0.98
