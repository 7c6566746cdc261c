import random

import pytest
import torch

from megatron_jf.data.schedule import (
    first_mismatch,
    noise_targets,
    select_state,
    unconverged_fraction,
    unconverged_fractions,
)
from tests.test_data_common import T


def test_progressive_eq7_w4_8_blocks():
    t = noise_targets("progressive", 8, 4)
    assert t.dtype == torch.float64
    assert t.tolist() == [0.0, 0.25, 0.5, 0.75, 0.0, 0.25, 0.5, 0.75]


def test_reverse_same_levels_reversed():
    assert noise_targets("reverse", 8, 4).tolist() == [0.75, 0.5, 0.25, 0.0, 0.75, 0.5, 0.25, 0.0]
    assert noise_targets("progressive", 3, 1).tolist() == [0.0, 0.0, 0.0]
    assert noise_targets("progressive", 0, 4).shape == (0,)


def test_random_deterministic_seeded_and_on_grid():
    a = noise_targets("random", 64, 8, seed=3, sample_id="abc")
    # Global RNG state must not matter.
    torch.manual_seed(12345)
    random.seed(999)
    b = noise_targets("random", 64, 8, seed=3, sample_id="abc")
    assert torch.equal(a, b)
    assert not torch.equal(a, noise_targets("random", 64, 8, seed=4, sample_id="abc"))
    assert not torch.equal(a, noise_targets("random", 64, 8, seed=3, sample_id="abd"))
    k = a * 8
    assert torch.equal(k, k.round()) and k.min() >= 0 and k.max() <= 7
    # prefix-stable: block i's level does not depend on the number of blocks
    assert torch.equal(noise_targets("random", 10, 8, seed=3, sample_id="abc"), a[:10])


def test_random_roughly_uniform():
    counts = torch.zeros(4)
    for s in range(200):
        t = noise_targets("random", 20, 4, seed=7, sample_id=f"s{s}")
        counts += torch.bincount((t * 4).long(), minlength=4)
    # 4000 draws, expectation 1000 per level, sd ~27
    assert counts.min() > 880 and counts.max() < 1120, counts


@pytest.mark.parametrize("bad", [dict(schedule="cosine"), dict(window_size=0), dict(num_blocks=-1)])
def test_noise_targets_errors(bad):
    kw = dict(schedule="progressive", num_blocks=4, window_size=4)
    kw.update(bad)
    with pytest.raises(ValueError):
        noise_targets(kw["schedule"], kw["num_blocks"], kw["window_size"])


def test_unconverged_fraction_examples():
    fp = T(5, 6, 7, 8)
    assert unconverged_fraction(fp.clone(), fp) == 0.0
    assert unconverged_fraction(T(9, 6, 7, 8), fp) == 1.0  # wrong first token: nothing committed
    assert unconverged_fraction(T(5, 6, 7, 9), fp) == 0.25
    # coincidental matches after the first mismatch still count as unconverged
    assert unconverged_fraction(T(5, 9, 7, 8), fp) == 0.75
    assert unconverged_fraction(T(5, 6, 0, 8), fp) == 0.5
    fr = unconverged_fractions(torch.stack([T(9, 6, 7, 8), T(5, 9, 7, 8), fp]), fp)
    assert fr.dtype == torch.float64 and fr.tolist() == [1.0, 0.75, 0.0]


def test_first_mismatch_matches_brute_force():
    g = torch.Generator().manual_seed(0)
    for _ in range(30):
        nb = int(torch.randint(1, 9, (), generator=g))
        fp = torch.randint(0, 3, (nb,), generator=g)
        drafts = torch.randint(0, 3, (7, nb), generator=g)
        got = first_mismatch(drafts, fp).tolist()
        for s in range(7):
            k = 0
            while k < nb and int(drafts[s, k]) == int(fp[k]):
                k += 1
            assert got[s] == k


def test_first_mismatch_shape_errors():
    with pytest.raises(ValueError):
        first_mismatch(torch.zeros(2, 3, dtype=torch.int64), torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError):
        first_mismatch(torch.zeros(2, 0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64))


def _drafts_with_fractions(fp, first_mismatches):
    """Drafts of the fixed point whose first mismatch is at the given offsets."""
    rows = []
    for k in first_mismatches:
        d = fp.clone()
        if k < fp.numel():
            d[k] = 0  # fp tokens are >= 3
        rows.append(d)
    return torch.stack(rows)


def test_select_state_nearest():
    fp = T(3, 4, 5, 6)
    drafts = _drafts_with_fractions(fp, [0, 1, 2, 4])  # fractions 1, .75, .5, 0
    assert select_state(drafts, fp, 0.0) == 3
    assert select_state(drafts, fp, 0.6) == 2
    assert select_state(drafts, fp, 0.7) == 1
    assert select_state(drafts, fp, 0.95) == 0
    assert select_state(drafts, fp, 0.2) == 3  # |0.2-0| < |0.2-0.5|


def test_select_state_tie_prefers_noisier_then_earlier():
    fp = T(3, 4, 5, 6)
    # fractions .75 and .25 equidistant from .5 -> the noisier (.75), whichever comes first
    assert select_state(_drafts_with_fractions(fp, [1, 3]), fp, 0.5) == 0
    assert select_state(_drafts_with_fractions(fp, [3, 1]), fp, 0.5) == 1
    # same fraction twice -> the earlier state
    d = _drafts_with_fractions(fp, [2, 2, 4])
    d[1, 3] = 0  # differs from d[0] but has the same first mismatch
    assert select_state(d, fp, 0.5) == 0
    # non-representable tie: 0.2 and 0.4 around 0.3 (n=5): float rounding must not break the tie rule
    fp5 = T(3, 4, 5, 6, 7)
    assert select_state(_drafts_with_fractions(fp5, [4, 3]), fp5, 0.3) == 1  # fractions .2, .4 -> .4


def test_initial_draft_is_a_state():
    # Our drafts[0] is the true initial draft (not aliased to the fixed point, reference bug B1):
    # with a fully wrong initial draft, the top level selects it.
    fp = T(3, 4, 5, 6)
    drafts = torch.stack([T(9, 9, 9, 9), T(3, 9, 9, 9), T(3, 4, 9, 6), fp])
    assert unconverged_fractions(drafts, fp).tolist() == [1.0, 0.75, 0.5, 0.0]
    assert select_state(drafts, fp, 0.875) == 0


def test_select_state_errors():
    fp = T(3, 4)
    with pytest.raises(ValueError):
        select_state(torch.zeros(0, 2, dtype=torch.int64), fp, 0.5)
    with pytest.raises(ValueError):
        select_state(torch.zeros(1, 3, dtype=torch.int64), fp, 0.5)
    with pytest.raises(ValueError):
        select_state(torch.zeros(1, 2, dtype=torch.int64), fp, float("nan"))
