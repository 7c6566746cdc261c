import pytest
import torch

from megatron_jf.data.packing import (
    IGNORE_INDEX as IGN,
    ROLE_CLEAN,
    ROLE_NOISY,
    ROLE_PROMPT,
    check_packed,
    from_two_stream,
    pack_record,
    packed_equal,
    to_two_stream,
)
from tests.test_data_common import EOS, hand_record, make_record, random_records


# ---------------------------------------------------------------------------- hand-made record
def test_hand_layout_progressive_w2():
    # targets (i mod 2)/2 = [0, .5, 0]
    # block 0 fractions [2/3, 1/3, 0] -> t=0 -> state 2 (the fixed point)
    # block 1 fractions [2/3, 1/3]    -> t=.5 -> tie (1/6 each) -> noisier state 0 = [30, 8, 8]
    # block 2 fractions [1/2]         -> state 0 = [40, 7]
    p = pack_record(hand_record(), "progressive", 2, 0)
    assert p.tokens.tolist() == [10, 11, 12, 20, 21, 22, 20, 21, 22, 30, 8, 8, 30, 31, 32, 40, 7, 40, EOS]
    assert len(p) == 3 + 2 * 8
    assert p.position_ids.tolist() == [0, 1, 2, 3, 4, 5, 3, 4, 5, 6, 7, 8, 6, 7, 8, 9, 10, 9, 10]
    P_, N_, C_ = ROLE_PROMPT, ROLE_NOISY, ROLE_CLEAN
    assert p.roles.tolist() == [P_] * 3 + [N_] * 3 + [C_] * 3 + [N_] * 3 + [C_] * 3 + [N_] * 2 + [C_] * 2
    assert p.block_ids.tolist() == [-1] * 3 + [0] * 6 + [1] * 6 + [2] * 4
    # prompt's last token -> 20; clean tokens -> next fixed-point token; EOS is a target; nothing after it
    assert p.ar_targets.tolist() == [
        IGN, IGN, 20, IGN, IGN, IGN, 21, 22, 30, IGN, IGN, IGN, 31, 32, 40, IGN, IGN, EOS, IGN
    ]
    assert p.consistency_pairs.tolist() == [[3, 6], [4, 7], [5, 8], [9, 12], [10, 13], [11, 14], [15, 17]]
    assert p.consistency_pairs.dtype == torch.int64
    assert p.state_indices.tolist() == [2, 0, 0]
    assert p.target_ratios.dtype == torch.float32 and p.target_ratios.tolist() == [0.0, 0.5, 0.0]
    assert torch.allclose(p.noise_ratios, torch.tensor([0.0, 2 / 3, 0.5]))
    assert p.noise_ratios.dtype == torch.float32
    assert p.prompt_len == 3 and p.sample_id == "hand/0"
    check_packed(p)


def test_hand_layout_from_first_diff():
    p = pack_record(hand_record(), "progressive", 2, 0, consistency="from_first_diff")
    # block 0: noisy == clean -> nothing; block 1: [30,8,8] vs [30,31,32] differ from offset 1;
    # block 2: [40,7] vs [40,EOS] differ at offset 1 but that clean position has no target.
    assert p.consistency_pairs.tolist() == [[10, 13], [11, 14]]


def test_hand_layout_reverse_w2():
    # targets [.5, 0, .5]: block 0 tie 2/3 vs 1/3 -> state 0 [20,9,9]; block 1 -> state 1 [30,31,8] (1/3)
    p = pack_record(hand_record(), "reverse", 2, 0)
    assert p.tokens.tolist() == [10, 11, 12, 20, 9, 9, 20, 21, 22, 30, 31, 8, 30, 31, 32, 40, 7, 40, EOS]
    assert p.state_indices.tolist() == [0, 1, 0]
    assert torch.allclose(p.noise_ratios, torch.tensor([2 / 3, 1 / 3, 0.5]))
    p2 = pack_record(hand_record(), "reverse", 2, 0, consistency="from_first_diff")
    assert p2.consistency_pairs.tolist() == [[4, 7], [5, 8], [11, 14]]


def test_no_eos_full_last_block():
    rec = make_record("noeos", [7], [([[3, 3]], [4, 5]), ([[4, 4], [6, 7]], [6, 7])], n=2)
    p = pack_record(rec, "progressive", 2, 0)
    # L = 1 + 2*4; layout [7 | 3 3 | 4 5 | 6 7 | 6 7]  (block 1: t=.5 -> fractions [1, 0] tie -> noisier)
    assert p.tokens.tolist() == [7, 3, 3, 4, 5, 4, 4, 6, 7]
    assert p.ar_targets.tolist() == [4, IGN, IGN, 5, 6, IGN, IGN, 7, IGN]
    assert p.consistency_pairs.tolist() == [[1, 3], [2, 4], [5, 7]]


def test_explicit_targets_and_errors():
    rec = hand_record()
    p = pack_record(rec, torch.tensor([1.0, 0.0, 0.0]), 2, 0)
    assert p.state_indices.tolist() == [0, 1, 0]
    with pytest.raises(ValueError, match="hand/0"):
        pack_record(rec, torch.tensor([1.0, 0.0]), 2, 0)
    with pytest.raises(ValueError, match="consistency"):
        pack_record(rec, "progressive", 2, 0, consistency="some")
    with pytest.raises(ValueError, match="schedule"):
        pack_record(rec, "linear", 2, 0)
    bad = hand_record()
    bad.blocks[2].context_len = 10
    with pytest.raises(ValueError, match="hand/0.*context_len"):
        pack_record(bad, "progressive", 2, 0)


# ---------------------------------------------------------------------------- brute force
def brute_force_pack(rec, targets, consistency):
    """Independent, loop-based packer written from the spec."""
    P = rec.prompt_len
    resp = rec.response_ids().tolist()
    R = len(resp)
    tokens, pos, roles, bids, tgt = [], [], [], [], []
    for j, tok in enumerate(rec.prompt_ids.tolist()):
        tokens.append(tok)
        pos.append(j)
        roles.append(ROLE_PROMPT)
        bids.append(-1)
        tgt.append(resp[0] if j == P - 1 else IGN)
    pairs, ratios, chosen = [], [], []
    for i, b in enumerate(rec.blocks):
        fp = b.fixed_point.tolist()
        nb = len(fp)
        best = None
        for s in range(b.num_states):
            d = b.drafts[s].tolist()
            k = next((c for c in range(nb) if d[c] != fp[c]), nb)
            u = (nb - k) / nb
            key = (round(abs(u - targets[i]), 9), -u, s)
            if best is None or key < best[0]:
                best = (key, s, u, k)
        _, s, u, first_diff = best
        chosen.append(s)
        ratios.append(u)
        noisy = b.drafts[s].tolist()
        start_noisy = len(tokens)
        for c in range(nb):
            tokens.append(noisy[c])
            pos.append(b.context_len + c)
            roles.append(ROLE_NOISY)
            bids.append(i)
            tgt.append(IGN)
        start_clean = len(tokens)
        for c in range(nb):
            r = b.context_len - P + c
            tokens.append(fp[c])
            pos.append(b.context_len + c)
            roles.append(ROLE_CLEAN)
            bids.append(i)
            tgt.append(resp[r + 1] if r + 1 < R else IGN)
            if r + 1 < R and (consistency == "all" or c >= first_diff):
                pairs.append([start_noisy + c, start_clean + c])
    return tokens, pos, roles, bids, tgt, pairs, ratios, chosen


@pytest.mark.parametrize("schedule,w", [("progressive", 2), ("reverse", 3), ("random", 4)])
@pytest.mark.parametrize("consistency", ["all", "from_first_diff"])
def test_random_records_match_brute_force(schedule, w, consistency):
    from megatron_jf.data.schedule import noise_targets

    for rec in random_records(11, 25):
        p = pack_record(rec, schedule, w, 5, consistency)
        check_packed(p)
        targets = noise_targets(schedule, rec.num_blocks, w, seed=5, sample_id=rec.sample_id).tolist()
        tokens, pos, roles, bids, tgt, pairs, ratios, chosen = brute_force_pack(rec, targets, consistency)
        assert len(p) == rec.prompt_len + 2 * rec.response_len
        assert p.tokens.tolist() == tokens
        assert p.position_ids.tolist() == pos
        assert p.roles.tolist() == roles
        assert p.block_ids.tolist() == bids
        assert p.ar_targets.tolist() == tgt
        assert p.consistency_pairs.reshape(-1, 2).tolist() == pairs
        assert p.state_indices.tolist() == chosen
        assert torch.allclose(p.noise_ratios, torch.tensor(ratios, dtype=torch.float32))


def test_check_packed_catches_corruption():
    p = pack_record(hand_record(), "progressive", 2, 0)
    for field, idx, val, msg in [
        ("ar_targets", 16, 2, "ar_targets"),
        ("position_ids", 9, 7, "position"),
        ("roles", 5, ROLE_CLEAN, "noisy"),
        ("block_ids", 6, 1, "block"),
    ]:
        q = pack_record(hand_record(), "progressive", 2, 0)
        getattr(q, field)[idx] = val
        with pytest.raises(ValueError, match=msg):
            check_packed(q)
    q = pack_record(hand_record(), "progressive", 2, 0)
    q.consistency_pairs = torch.tensor([[3, 7]])  # offset 0 noisy vs offset 1 clean
    with pytest.raises(ValueError, match="consistency"):
        check_packed(q)
    q.consistency_pairs = torch.tensor([[16, 18]])  # clean position without a target
    with pytest.raises(ValueError, match="without an AR target"):
        check_packed(q)
    check_packed(p)


# ---------------------------------------------------------------------------- two-stream form
def test_two_stream_hand():
    p = pack_record(hand_record(), "progressive", 2, 0)
    s = to_two_stream(p)
    assert s.noisy_stream.tolist() == [10, 11, 12, 20, 21, 22, 30, 8, 8, 40, 7]
    assert s.clean_stream.tolist() == [10, 11, 12, 20, 21, 22, 30, 31, 32, 40, EOS]
    assert s.position_ids.tolist() == list(range(11))
    # ordinary shifted next-token targets on the clean stream, prompt except its last token ignored
    assert s.ar_targets.tolist() == [IGN, IGN, 20, 21, 22, 30, 31, 32, 40, EOS, IGN]
    assert s.consistency_mask.tolist() == [False] * 3 + [True] * 7 + [False]
    assert s.block_ids.tolist() == [-1, -1, -1, 0, 0, 0, 1, 1, 1, 2, 2]
    assert s.noisy_index.tolist() == [0, 1, 2, 3, 4, 5, 9, 10, 11, 15, 16]
    assert s.clean_index.tolist() == [0, 1, 2, 6, 7, 8, 12, 13, 14, 17, 18]
    assert torch.equal(p.tokens[s.noisy_index], s.noisy_stream)
    assert packed_equal(from_two_stream(s), p)


def test_two_stream_roundtrip_random():
    for rec in random_records(3, 20):
        for consistency in ("all", "from_first_diff"):
            p = pack_record(rec, "random", 3, 1, consistency)
            s = to_two_stream(p)
            T = rec.prompt_len + rec.response_len
            assert s.noisy_stream.shape == s.clean_stream.shape == s.position_ids.shape == (T,)
            assert s.clean_stream.tolist() == rec.full_ids().tolist()
            # clean-stream targets are the plain shifted sequence from the prompt's last token on
            full = rec.full_ids().tolist()
            exp = [IGN] * (rec.prompt_len - 1) + full[rec.prompt_len :] + [IGN]
            assert s.ar_targets.tolist() == exp
            assert int(s.consistency_mask.sum()) == p.consistency_pairs.shape[0]
            assert packed_equal(from_two_stream(s), p)


def test_to_two_stream_rejects_misaligned_pairs():
    p = pack_record(hand_record(), "progressive", 2, 0)
    p.consistency_pairs = torch.tensor([[3, 7]])
    with pytest.raises(ValueError, match="hand/0"):
        to_two_stream(p)
