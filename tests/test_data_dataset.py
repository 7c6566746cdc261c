import os
import tarfile

import pytest
import torch
from torch.utils.data import DataLoader

from megatron_jf.data.dataset import TrajectoryDataset, collate_packed, collate_two_stream
from megatron_jf.data.packing import IGNORE_INDEX as IGN
from megatron_jf.data.packing import ROLE_PAD, check_packed, pack_record, packed_equal, to_two_stream
from megatron_jf.data.schedule import epoch_phase, noise_targets
from megatron_jf.data.shards import TrajectoryShardWriter
from tests.test_data_common import PAD, hand_record, random_records

N_REC = 10


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("shards")
    recs = random_records(42, N_REC, prefix="s")
    with TrajectoryShardWriter(str(d), prefix="traj", max_records_per_shard=3) as w:
        for r in recs:
            w.write(r)
    manifest = w.write_manifest(model="m", tokenizer="t")
    return str(d), manifest, recs


def ids_of(ds, **loader_kw):
    loader = DataLoader(ds, collate_fn=lambda b: [s.sample_id for s in b], **loader_kw)
    return [sid for batch in loader for sid in batch]


def test_ranks_by_workers_disjoint_and_covering(shard_dir):
    d, _, recs = shard_dir
    per_rank = []
    for rank in range(2):
        ds = TrajectoryDataset(os.path.join(d, "*.tar"), window_size=4, seed=1, rank=rank, world_size=2, batch_size=2)
        assert len(ds) == 5
        got = ids_of(ds, batch_size=2, num_workers=2)
        # the loader yields exactly the rank's list, in order, despite two workers
        assert got == [ds.read_record(i).sample_id for i in ds.rank_indices().tolist()]
        per_rank.append(got)
    assert len(per_rank[0]) == len(per_rank[1]) == 5
    assert set(per_rank[0]).isdisjoint(per_rank[1])
    assert sorted(per_rank[0] + per_rank[1]) == sorted(r.sample_id for r in recs)


def test_worker_indices_partition(shard_dir):
    d, _, _ = shard_dir
    ds = TrajectoryDataset(d, window_size=4, seed=3, batch_size=2)
    full = ds.rank_indices().tolist()
    parts = [ds.worker_indices(w, 3).tolist() for w in range(3)]
    assert sorted(sum(parts, [])) == sorted(full) and len(set(sum(parts, []))) == len(full)
    # chunks of batch_size go round-robin: worker 0 gets chunks 0, 3; worker 1 chunks 1, 4; worker 2 chunk 2
    assert parts[0] == full[0:2] + full[6:8] and parts[1] == full[2:4] + full[8:10] and parts[2] == full[4:6]


def test_remainder_drop_and_wrap(shard_dir):
    d, _, _ = shard_dir
    drop = [TrajectoryDataset(d, window_size=4, rank=r, world_size=3).rank_indices().tolist() for r in range(3)]
    assert [len(x) for x in drop] == [3, 3, 3]
    flat = sum(drop, [])
    assert len(set(flat)) == 9  # 10 mod 3 = 1 sample skipped this epoch
    wrap = [TrajectoryDataset(d, window_size=4, rank=r, world_size=3, remainder="wrap").rank_indices().tolist() for r in range(3)]
    assert [len(x) for x in wrap] == [4, 4, 4]
    flat = sum(wrap, [])
    assert set(flat) == set(range(N_REC)) and len(flat) == 12  # 2 samples repeated
    with pytest.raises(ValueError, match="fewer than world_size"):
        TrajectoryDataset(d, window_size=4, rank=0, world_size=11)


def test_determinism_and_epochs(shard_dir):
    d, manifest, _ = shard_dir
    a = TrajectoryDataset(manifest, window_size=4, seed=5)
    b = TrajectoryDataset(os.path.join(d, "traj-*.tar"), window_size=4, seed=5)
    assert ids_of(a) == ids_of(b)
    e0 = ids_of(a)
    a.set_epoch(1)
    e1 = ids_of(a)
    assert sorted(e0) == sorted(e1) and e0 != e1
    c = TrajectoryDataset(manifest, window_size=4, seed=6)
    assert ids_of(c) != e0
    ordered = TrajectoryDataset(manifest, window_size=4, shuffle=False)
    assert ids_of(ordered) == [f"s{i:03d}" for i in range(N_REC)]
    # the yielded samples are exactly pack_record of the stored records
    for p, rec in zip(ordered, shard_dir[2]):
        assert packed_equal(p, pack_record(rec, "progressive", 4, 0))


def test_resume_exactly(shard_dir):
    _, manifest, _ = shard_dir
    ds = TrajectoryDataset(manifest, window_size=4, seed=2, rank=1, world_size=2, batch_size=2)
    ds.set_epoch(3)
    full = ids_of(ds, batch_size=2, num_workers=2)
    ds.set_start(3)
    assert len(ds) == 2
    assert ids_of(ds, batch_size=2, num_workers=2) == full[3:]
    ds2 = TrajectoryDataset(manifest, window_size=4, seed=2, rank=1, world_size=2, batch_size=2)
    ds2.load_state_dict(ds.state_dict())
    assert ids_of(ds2) == full[3:]
    with pytest.raises(ValueError):
        ds.set_start(6)


def test_random_noise_resampled_per_epoch_only_if_asked(shard_dir):
    _, manifest, _ = shard_dir
    ds = TrajectoryDataset(manifest, window_size=4, schedule="random", shuffle=False, resample_noise_per_epoch=True)
    t0 = torch.cat([p.target_ratios for p in ds])
    ds.set_epoch(1)
    t1 = torch.cat([p.target_ratios for p in ds])
    assert not torch.equal(t0, t1)
    fixed = TrajectoryDataset(manifest, window_size=4, schedule="random", shuffle=False)
    f0 = torch.cat([p.target_ratios for p in fixed])
    fixed.set_epoch(1)
    assert torch.equal(f0, torch.cat([p.target_ratios for p in fixed]))


@pytest.mark.parametrize("schedule", ["progressive", "reverse"])
def test_progressive_noise_redrawn_per_epoch_only_if_asked(shard_dir, schedule):
    """--resample-noise-per-epoch on the paper's schedule: epoch 0 packs exactly the states of Eq. 7 as written;
    later epochs shift each record's ramp by its own phase, so a block meets other noise levels (other states) --
    and without the option every epoch packs the identical state per block (issue 31)."""
    _, manifest, recs = shard_dir
    w = 4
    ds = TrajectoryDataset(manifest, window_size=w, schedule=schedule, shuffle=False, resample_noise_per_epoch=True)
    fixed = TrajectoryDataset(manifest, window_size=w, schedule=schedule, shuffle=False)
    e0 = list(ds)
    assert all(packed_equal(a, pack_record(r, schedule, w)) for a, r in zip(e0, recs))
    levels = {r.sample_id: [set() for _ in r.blocks] for r in recs}
    for epoch in range(12):
        ds.set_epoch(epoch)
        fixed.set_epoch(epoch)
        for got, same, r in zip(ds, fixed, recs):
            assert packed_equal(same, e0[recs.index(r)])  # the option off: the same state every epoch
            for b, t in enumerate(got.target_ratios.tolist()):
                levels[r.sample_id][b].add(t)
            # the targets are the schedule's ramp shifted by this record's phase of this epoch
            phase = epoch_phase(ds.seed, epoch, r.sample_id, w)
            assert torch.equal(got.target_ratios, noise_targets(schedule, r.num_blocks, w, phase=phase).float())
    # over 12 epochs a block meets several of the window's levels, not one
    assert min(len(s) for blocks in levels.values() for s in blocks) >= 2
    assert max(len(s) for blocks in levels.values() for s in blocks) == w


def test_empty_and_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing-here"):
        TrajectoryDataset(str(tmp_path / "nothing-here-*.tar"), window_size=4)
    empty = tmp_path / "empty.tar"
    with tarfile.open(empty, "w"):
        pass
    with pytest.raises(ValueError, match="empty dataset"):
        TrajectoryDataset(str(empty), window_size=4)


def test_block_size_mismatch(shard_dir):
    d, manifest, _ = shard_dir
    with pytest.raises(ValueError, match="block_size 4 != requested block_size 8"):
        TrajectoryDataset(manifest, window_size=4, block_size=8)
    ds = TrajectoryDataset(d, window_size=4, block_size=8)  # no manifest: found on read
    with pytest.raises(ValueError, match=r"traj-00000\d.tar, sample 's\d+': block_size 4 != requested block_size 8"):
        next(iter(ds))
    assert len(list(TrajectoryDataset(d, window_size=4, block_size=4))) == N_REC


def test_max_seq_len(shard_dir):
    _, manifest, recs = shard_dir
    lens = sorted(r.prompt_len + 2 * r.response_len for r in recs)
    cap = lens[N_REC // 2]
    with pytest.raises(ValueError, match=f"> max_seq_len {cap}"):
        list(TrajectoryDataset(manifest, window_size=4, max_seq_len=cap))
    ds = TrajectoryDataset(manifest, window_size=4, max_seq_len=cap, on_too_long="skip")
    got = list(ds)
    assert len(got) == sum(1 for n in lens if n <= cap) and all(len(p) <= cap for p in got)
    assert ds.num_skipped == N_REC - len(got)


# ---------------------------------------------------------------------------- collators
def _samples():
    recs = [hand_record()] + random_records(77, 2)
    return [pack_record(r, "progressive", 2, 0) for r in recs]


def test_collate_packed_pad():
    ps = _samples()
    b = collate_packed(ps, PAD, "pad", pad_to_multiple_of=8)
    B, Lmax = 3, max(len(p) for p in ps)
    Lp = -(-Lmax // 8) * 8
    for name in ("tokens", "position_ids", "roles", "block_ids", "ar_targets"):
        assert b[name].shape == (B, Lp) and b[name].dtype == torch.int64
    for i, p in enumerate(ps):
        L = len(p)
        assert torch.equal(b["tokens"][i, :L], p.tokens)
        assert torch.equal(b["ar_targets"][i, :L], p.ar_targets)
        assert (b["tokens"][i, L:] == PAD).all() and (b["position_ids"][i, L:] == 0).all()
        assert (b["roles"][i, L:] == ROLE_PAD).all() and (b["block_ids"][i, L:] == -1).all()
        assert (b["ar_targets"][i, L:] == IGN).all()
        assert b["valid"][i].tolist() == [True] * L + [False] * (Lp - L)
    cp = b["consistency_pairs"]
    assert cp.shape == (sum(p.consistency_pairs.shape[0] for p in ps), 3)
    for i, p in enumerate(ps):
        rows = cp[cp[:, 0] == i]
        assert torch.equal(rows[:, 1:], p.consistency_pairs)
        # pairs index the right tokens in the batch
        assert torch.equal(b["position_ids"][i, rows[:, 1]], b["position_ids"][i, rows[:, 2]])
    assert b["seq_lens"].tolist() == [len(p) for p in ps] and b["sample_ids"][0] == "hand/0"
    assert b["noise_ratios"].shape == (sum(p.num_blocks for p in ps),)
    with pytest.raises(ValueError, match="max_len"):
        collate_packed(ps, PAD, "pad", max_len=Lmax - 1)
    with pytest.raises(ValueError, match="empty"):
        collate_packed([], PAD)
    with pytest.raises(ValueError, match="mode"):
        collate_packed(ps, PAD, "ragged")


def test_collate_packed_pack():
    ps = _samples()
    total = sum(len(p) for p in ps)
    b = collate_packed(ps, PAD, "pack", max_len=total + 3)
    assert b["tokens"].shape == (1, total + 3)
    assert b["cu_seqlens"].dtype == torch.int32
    starts = [0, len(ps[0]), len(ps[0]) + len(ps[1]), total]
    assert b["cu_seqlens"].tolist() == starts and b["max_seqlen"] == max(len(p) for p in ps)
    assert b["segment_ids"][0].tolist() == sum([[i] * len(p) for i, p in enumerate(ps)], []) + [-1] * 3
    for i, p in enumerate(ps):
        s, e = starts[i], starts[i + 1]
        assert torch.equal(b["tokens"][0, s:e], p.tokens)
        assert torch.equal(b["position_ids"][0, s:e], p.position_ids)  # positions restart per sample
    assert (b["tokens"][0, total:] == PAD).all() and (b["ar_targets"][0, total:] == IGN).all()
    cp = b["consistency_pairs"]
    assert (cp[:, 0] == 0).all()
    expect = torch.cat([p.consistency_pairs + starts[i] for i, p in enumerate(ps)])
    assert torch.equal(cp[:, 1:], expect)
    with pytest.raises(ValueError, match="max_len"):
        collate_packed(ps, PAD, "pack", max_len=total - 1)


def test_collate_two_stream_pad():
    ps = _samples()
    b = collate_two_stream(ps, PAD, "pad")
    twos = [to_two_stream(p) for p in ps]
    B, Tmax = 3, max(len(s) for s in twos)
    assert b["tokens"].shape == (2 * B, Tmax) and b["consistency_mask"].shape == (B, Tmax)
    for i, s in enumerate(twos):
        T = len(s)
        assert torch.equal(b["tokens"][i, :T], s.noisy_stream)
        assert torch.equal(b["tokens"][B + i, :T], s.clean_stream)
        assert torch.equal(b["position_ids"][i, :T], torch.arange(T))
        assert torch.equal(b["position_ids"][B + i, :T], torch.arange(T))
        assert (b["ar_targets"][i] == IGN).all()  # no AR loss on noisy streams
        assert torch.equal(b["ar_targets"][B + i, :T], s.ar_targets)
        assert (b["tokens"][B + i, T:] == PAD).all() and (b["ar_targets"][B + i, T:] == IGN).all()
        assert b["consistency_mask"][i].tolist() == s.consistency_mask.tolist() + [False] * (Tmax - T)
        assert b["valid"][i].sum() == T and b["valid"][B + i].sum() == T
    # student/teacher of every consistency position share the position id and block
    rows, cols = torch.nonzero(b["consistency_mask"], as_tuple=True)
    assert torch.equal(b["position_ids"][rows, cols], b["position_ids"][rows + B, cols])
    assert torch.equal(b["block_ids"][rows, cols], b["block_ids"][rows + B, cols])


def test_collate_two_stream_pack():
    ps = _samples()
    twos = [to_two_stream(p) for p in ps]
    b = collate_two_stream(twos, PAD, "pack", pad_to_multiple_of=16)
    lens = [len(s) for s in twos]
    total = 2 * sum(lens)
    assert b["tokens"].shape == (1, -(-total // 16) * 16)
    cu = [0]
    for n in lens:
        cu += [cu[-1] + n, cu[-1] + 2 * n]
    assert b["cu_seqlens"].tolist() == cu
    for i, s in enumerate(twos):
        assert torch.equal(b["tokens"][0, cu[2 * i] : cu[2 * i + 1]], s.noisy_stream)
        assert torch.equal(b["tokens"][0, cu[2 * i + 1] : cu[2 * i + 2]], s.clean_stream)
    cp = b["consistency_pairs"]
    assert cp.shape == (sum(int(s.consistency_mask.sum()) for s in twos), 2)
    pos = b["position_ids"][0]
    assert torch.equal(pos[cp[:, 0]], pos[cp[:, 1]])
    # pair (student, teacher) maps back to the packed sample's (noisy, clean) pairs
    first = cp[cp[:, 1] < cu[2]]
    s0 = twos[0]
    assert torch.equal(
        torch.stack([s0.noisy_index[first[:, 0]], s0.clean_index[first[:, 1] - cu[1]]], 1), ps[0].consistency_pairs
    )
    check_packed(ps[0])


def test_portable_permutation_is_splitmix_order():
    from megatron_jf.data.dataset import portable_permutation

    M = (1 << 64) - 1

    def splitmix(x):  # reference SplitMix64 finaliser in pure Python
        x = (x + 0x9E3779B97F4A7C15) & M
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M
        return x ^ (x >> 31)

    for seed in (0, 12345, (1 << 63) - 7):
        expect = sorted(range(50), key=lambda i: splitmix((seed + i) & M))
        assert portable_permutation(50, seed).tolist() == expect


@pytest.fixture(scope="module")
def varied_dir(tmp_path_factory):
    """48 records of 1-8 blocks (n=4) and 1-5 prompt tokens: lengths vary several-fold, as trajectories ending at an
    EOS anywhere do."""
    d = tmp_path_factory.mktemp("varied")
    g = torch.Generator().manual_seed(11)
    from tests.test_data_common import random_record

    recs = [random_record(g, f"v{i:03d}", n=4, num_blocks=1 + i % 8, prompt_len=1 + i % 5, last_len=4, eos=False)
            for i in range(48)]
    with TrajectoryShardWriter(str(d), prefix="traj", max_records_per_shard=10) as w:
        for r in recs:
            w.write(r)
    return str(d), recs


def _padded_rows(ds, mb):
    """Tokens the two-stream path forwards (rows padded to the micro-batch's longest) over one epoch of ``ds``."""
    samples = list(ds)
    return sum(collate_two_stream(samples[i:i + mb], PAD, "pad")["tokens"].numel() for i in range(0, len(samples), mb))


def test_group_by_length_fills_micro_batches_with_similar_lengths(varied_dir):
    """--group-by-length: the same samples each epoch, micro-batches of similar length (far less row padding), the
    lengths read from the shard headers equal the records', and the order is reproducible and resumes exactly."""
    d, recs = varied_dir
    mb = 4
    kw = dict(window_size=4, seed=3, micro_batch_size=mb)
    plain = TrajectoryDataset(d, **kw)
    grouped = TrajectoryDataset(d, length_group_size=4 * mb, **kw)
    by_id = {r.sample_id: r for r in recs}
    stored = [by_id[grouped.read_record(i).sample_id] for i in range(len(recs))]
    assert grouped.sample_lengths().tolist() == [r.prompt_len + sum(b.length for b in r.blocks) for r in stored]
    for epoch in range(2):
        plain.set_epoch(epoch)
        grouped.set_epoch(epoch)
        a, b = plain.rank_indices().tolist(), grouped.rank_indices().tolist()
        assert a != b and sorted(a) == sorted(b)  # same samples, other order
        for g in range(0, len(a), 4 * mb):  # grouping stays inside each group of the shuffled order
            assert sorted(a[g:g + 4 * mb]) == sorted(b[g:g + 4 * mb])
        lens = grouped.sample_lengths()
        spread = [int(lens[b[i:i + mb]].max() - lens[b[i:i + mb]].min()) for i in range(0, len(b), mb)]
        spread_plain = [int(lens[a[i:i + mb]].max() - lens[a[i:i + mb]].min()) for i in range(0, len(a), mb)]
        assert sum(spread) * 3 < sum(spread_plain), (spread, spread_plain)
        assert _padded_rows(grouped, mb) < 0.85 * _padded_rows(plain, mb)
    assert TrajectoryDataset(d, length_group_size=4 * mb, **kw).rank_indices(1).tolist() == b  # reproducible
    full = ids_of(grouped)
    grouped.set_start(5)
    assert ids_of(grouped) == full[5:]
    other_seed = TrajectoryDataset(d, length_group_size=4 * mb, **dict(kw, seed=4))
    assert other_seed.rank_indices(1).tolist() != b
    with pytest.raises(ValueError, match="length_group_size"):
        TrajectoryDataset(d, window_size=4, length_group_size=-1)
