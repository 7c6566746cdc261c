import time

import pytest
import torch

from megatron_jf.data.dataset import collate_packed
from megatron_jf.data.masks import block_mask, dense_mask, dense_mask_from_layout, make_mask_mod
from megatron_jf.data.packing import pack_record, to_two_stream
from tests.test_data_common import PAD, make_record, random_records


def five_block_record():
    """P=2, n=2, five blocks (the last has 1 token): L = 2 + 2*9 = 20.

    packed indices: prompt 0,1 | k0 2,3 c0 4,5 | k1 6,7 c1 8,9 | k2 10,11 c2 12,13 | k3 14,15 c3 16,17 | k4 18 c4 19
    """
    blocks = [([[3, 3], [i + 10, 4]], [i + 10, i + 20]) for i in range(4)] + [([[5]], [6])]
    return make_record("five", [7, 8], blocks, n=2)


def describe(rec):
    """(type, block, offset) of each packed index, derived from the record without the packer."""
    d = [("P", -1, a) for a in range(rec.prompt_len)]
    for j, b in enumerate(rec.blocks):
        d += [("K", j, a) for a in range(b.length)]
        d += [("C", j, a) for a in range(b.length)]
    return d


def brute_allowed(kind, w, q, k):
    tq, jq, aq = q
    tk, jk, ak = k
    if tq == "P":
        return tk == "P" and ak <= aq
    if tk == "P":
        return True  # every block token sees the whole prompt
    own = tk == tq and jk == jq and ak <= aq
    if tq == "C":  # same for all kinds: earlier clean blocks, itself causally
        return (tk == "C" and jk < jq) or own
    if kind == "nc":
        return (tk == "K" and jk < jq) or own
    if kind == "clean":
        return (tk == "C" and jk < jq) or own
    if kind == "nc_ic":
        i = (jq // w) * w
        return (tk == "C" and jk < i) or (tk == "K" and i <= jk < jq) or own
    raise AssertionError(kind)


def brute_mask(kind, w, rec):
    d = describe(rec)
    L = len(d)
    return torch.tensor([[brute_allowed(kind, w, d[q], d[k]) for k in range(L)] for q in range(L)])


CASES = [("nc", None), ("clean", None), ("nc_ic", 1), ("nc_ic", 2), ("nc_ic", 3), ("nc_ic", 8)]


@pytest.mark.parametrize("kind,w", CASES)
def test_dense_masks_cell_by_cell(kind, w):
    rec = five_block_record()
    p = pack_record(rec, "progressive", 2, 0)
    m = dense_mask(kind, p, window_size=w)
    assert m.dtype == torch.bool and m.shape == (20, 20)
    assert torch.equal(m, brute_mask(kind, w, rec))
    assert not bool(torch.triu(m, diagonal=1).any())  # every kind is a sub-mask of causal


@pytest.mark.parametrize("kind,w", CASES)
def test_dense_masks_random_layouts(kind, w):
    for rec in random_records(21, 12, n=3):
        p = pack_record(rec, "reverse", 2, 0)
        assert torch.equal(dense_mask(kind, p, window_size=w), brute_mask(kind, w, rec))


def test_hand_cells():
    p = pack_record(five_block_record(), "progressive", 2, 0)
    nc = dense_mask("nc", p)
    assert nc[6, 2] and not nc[6, 4]  # k1 sees k0, not c0
    assert nc[8, 4] and not nc[8, 2]  # c1 sees c0, not k0
    assert nc[7, 6] and not nc[6, 7]  # causal inside a block
    assert nc[19, 0] and nc[18, 1] and not nc[0, 1]
    ic = dense_mask("nc_ic", p, window_size=2)  # windows {0,1}, {2,3}, {4}
    assert ic[14, 4] and ic[14, 9] and ic[14, 10] and ic[14, 11]  # k3: c0, c1, k2 (own window)
    assert not ic[14, 2] and not ic[14, 12] and not ic[14, 6]  # not k0, not c2, not k1
    assert ic[10, 8] and not ic[10, 6]  # k2 opens a window: c1 yes, k1 no
    assert ic[6, 2] and not ic[6, 4]  # k1 in window 0: k0 yes, c0 no
    cl = dense_mask("clean", p)
    assert cl[14, 12] and cl[14, 4] and not cl[14, 10]


def test_window_identities():
    for rec in random_records(5, 8, n=2):
        p = pack_record(rec, "progressive", 2, 0)
        assert torch.equal(dense_mask("nc_ic", p, window_size=1), dense_mask("clean", p))
        assert torch.equal(dense_mask("nc_ic", p, window_size=rec.num_blocks), dense_mask("nc", p))


def test_nc_is_union_of_two_causal_streams():
    for rec in [five_block_record()] + random_records(8, 10):
        p = pack_record(rec, "random", 3, 0)
        s = to_two_stream(p)
        T = len(s)
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        union = torch.zeros(len(p), len(p), dtype=torch.bool)
        for idx in (s.noisy_index, s.clean_index):
            union[idx[:, None], idx[None, :]] |= causal
        assert torch.equal(dense_mask("nc", p), union)
        # and the other kinds are not two-stream decomposable (they differ whenever N >= 2)
        if rec.num_blocks >= 2:
            assert not torch.equal(dense_mask("clean", p), union)


def test_batched_padded_and_segmented():
    recs = random_records(2, 3, n=3)
    ps = [pack_record(r, "progressive", 2, 0) for r in recs]
    b = collate_packed(ps, PAD, "pad")
    m = dense_mask_from_layout("nc_ic", b["roles"], b["block_ids"], window_size=2)
    Lmax = b["tokens"].shape[1]
    assert m.shape == (3, Lmax, Lmax)
    for i, p in enumerate(ps):
        L = len(p)
        assert torch.equal(m[i, :L, :L], dense_mask("nc_ic", p, window_size=2))
        assert not bool(m[i, :L, L:].any())  # real tokens never see padding
        assert torch.equal(m[i, L:, :], torch.eye(Lmax, dtype=torch.bool)[L:])  # pad rows: self only
    pk = collate_packed(ps, PAD, "pack", max_len=sum(len(p) for p in ps) + 5)
    m2 = dense_mask_from_layout("nc", pk["roles"][0], pk["block_ids"][0], segment_ids=pk["segment_ids"][0])
    expect = torch.block_diag(*[dense_mask("nc", p) for p in ps], torch.eye(5, dtype=torch.bool))
    assert torch.equal(m2, expect)


def test_mask_errors():
    p = pack_record(five_block_record(), "progressive", 2, 0)
    with pytest.raises(ValueError, match="unknown mask kind"):
        dense_mask("causal", p)
    with pytest.raises(ValueError, match="window_size"):
        dense_mask("nc_ic", p)
    with pytest.raises(ValueError, match="window_size"):
        dense_mask("nc", p, window_size=4)
    with pytest.raises(ValueError):
        make_mask_mod("nc", p.roles, p.block_ids[:-1])


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_attention_block_mask_cpu():
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    p = pack_record(five_block_record(), "progressive", 2, 0)
    L = len(p)
    t0 = time.time()
    for kind, w in [("nc", None), ("nc_ic", 2)]:
        dense = dense_mask(kind, p, window_size=w)
        # the mask_mod under torch's vmap (FlexAttention's evaluation path) gives the same mask
        mod = make_mask_mod(kind, p.roles, p.block_ids, window_size=w)
        assert torch.equal(flex.create_mask(mod, None, None, L, L, device="cpu")[0, 0], dense)
        bm = block_mask(kind, p.roles, p.block_ids, window_size=w, block_size=4)
        blocks = torch.zeros(5, 5, dtype=torch.bool)
        blocks |= dense.reshape(5, 4, 5, 4).any(dim=(1, 3))
        assert torch.equal(bm.to_dense()[0, 0].bool(), blocks)
        if time.time() - t0 > 20:
            pytest.skip("FlexAttention too slow on this CPU for the numerical check")
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 2, L, 8, generator=g) for _ in range(3))
        with torch.no_grad():
            out = flex.flex_attention(q, k, v, block_mask=bm)
            ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense)
        assert torch.allclose(out, ref, atol=1e-5)
