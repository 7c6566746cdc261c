import pytest
import torch

from megatron_jf.data.trajectory import BlockTrajectory
from tests.test_data_common import EOS, T, hand_record, make_record, random_records


def test_hand_record_is_valid_and_helpers():
    rec = hand_record()
    assert rec.validate(eos_id=EOS) is rec
    assert rec.prompt_len == 3 and rec.num_blocks == 3
    assert rec.block_lens == [3, 3, 2] and rec.response_len == 8
    assert rec.response_ids().tolist() == [20, 21, 22, 30, 31, 32, 40, EOS]
    assert rec.full_ids().tolist() == [10, 11, 12, 20, 21, 22, 30, 31, 32, 40, EOS]
    assert [b.context_len for b in rec.blocks] == [3, 6, 9]
    assert [b.num_states for b in rec.blocks] == [3, 2, 1]


def test_random_records_valid():
    for rec in random_records(0, 20):
        rec.validate(eos_id=EOS)


def test_equal_detects_any_difference():
    a, b = hand_record(), hand_record()
    assert a.equal(b)
    b.blocks[1].drafts[1, 2] = 99
    assert not a.equal(b)
    c = hand_record()
    c.blocks[0].drafts = c.blocks[0].drafts.to(torch.int32)
    assert not a.equal(c)


def _mutations():
    def shape_mismatch(r):
        r.blocks[0].drafts = torch.zeros(2, 4, dtype=torch.int64)

    def no_blocks(r):
        r.blocks = []

    def no_states(r):
        r.blocks[1].drafts = torch.zeros(0, 3, dtype=torch.int64)

    def bad_context(r):
        r.blocks[1].context_len = 5

    def short_middle(r):
        r.blocks[1] = BlockTrajectory(6, torch.zeros(1, 2, dtype=torch.int64) + 5, T(30, 31))
        r.blocks[2].context_len = 8

    def long_last(r):
        r.blocks[2] = BlockTrajectory(9, torch.zeros(1, 4, dtype=torch.int64) + 5, T(40, 41, 42, EOS))

    def wrong_dtype(r):
        r.prompt_ids = r.prompt_ids.to(torch.int32)

    def negative(r):
        r.blocks[0].fixed_point = T(20, -1, 22)

    def empty_prompt(r):
        r.prompt_ids = torch.empty(0, dtype=torch.int64)
        for b in r.blocks:
            b.context_len -= 3

    def empty_block(r):
        r.blocks[2] = BlockTrajectory(9, torch.zeros(1, 0, dtype=torch.int64), torch.empty(0, dtype=torch.int64))

    def bad_block_size(r):
        r.block_size = 0

    def eos_not_bool(r):
        r.eos_reached = 1

    return {
        "shape mismatch": (shape_mismatch, "shape mismatch"),
        "empty blocks": (no_blocks, "empty blocks"),
        "no drafts": (no_states, "no drafts"),
        "context_len": (bad_context, "context_len is 5, expected 6"),
        "short middle block": (short_middle, "only the last block may be shorter"),
        "long last block": (long_last, "> block_size"),
        "dtype": (wrong_dtype, "int64"),
        "negative ids": (negative, "negative"),
        "empty prompt": (empty_prompt, "empty prompt"),
        "empty block": (empty_block, "is empty"),
        "block_size": (bad_block_size, "block_size"),
        "eos_reached type": (eos_not_bool, "eos_reached must be a bool"),
    }


@pytest.mark.parametrize("name", list(_mutations()))
def test_validate_names_sample_and_problem(name):
    mutate, msg = _mutations()[name]
    rec = hand_record()
    mutate(rec)
    with pytest.raises(ValueError) as ei:
        rec.validate()
    assert "hand/0" in str(ei.value)
    assert msg in str(ei.value)


def test_eos_convention_checked_only_with_eos_id():
    # EOS inside block 0 although it is not the end of the response.
    rec = make_record("e1", [5], [([[3, 3]], [EOS, 4]), ([[3, 3]], [6, 7])], n=2, eos_reached=False)
    rec.validate()  # no eos_id: not checked
    with pytest.raises(ValueError, match="e1.*contains EOS 2 at index 0"):
        rec.validate(eos_id=EOS)
    rec2 = make_record("e2", [5], [([[3, 3]], [4, 4]), ([[3]], [6])], n=2, eos_reached=True)
    with pytest.raises(ValueError, match="e2.*eos_reached=True but EOS 2 is not exactly the last"):
        rec2.validate(eos_id=EOS)


def test_short_last_block_without_eos_is_allowed():
    # e.g. a max-new-tokens cap that is not a multiple of n
    rec = make_record("cap", [5, 6], [([[3, 3, 3]], [4, 4, 4]), ([[3]], [6])], n=3)
    rec.validate(eos_id=EOS)
