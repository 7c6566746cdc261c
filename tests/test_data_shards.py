import json
import os
import tarfile

import pytest
import torch

from megatron_jf.data.filters import (
    degeneracy_reason,
    distinct_ngram_ratio,
    is_degenerate,
    periodic_tail,
    periodic_tail_lengths,
)
from megatron_jf.data.shards import (
    TrajectoryShardWriter,
    index_shard,
    iter_shard,
    read_manifest,
    read_shard,
    write_manifest,
)
from tests.test_data_common import EOS, hand_record, make_record, random_records


def odd_id_records():
    recs = random_records(1, 7)
    recs[0].sample_id = "bucket.0030/data 7:ü"  # dots, slashes, spaces, non-ASCII
    recs[1].sample_id = "bucket_0030_data_7__"  # may sanitize to the same string as recs[0]
    # a huge token id forces the int64 storage path
    recs[2].prompt_ids[0] = 2**40
    return recs


def write(tmp_path, recs, per_shard=3, **kw):
    with TrajectoryShardWriter(str(tmp_path), prefix="traj", max_records_per_shard=per_shard, eos_id=EOS) as w:
        for r in recs:
            w.write(r)
        w.count_filtered("degenerate", 2)
    return w


def test_round_trip_and_manifest(tmp_path):
    recs = odd_id_records()
    w = write(tmp_path, recs)
    mpath = w.write_manifest(model="tiny-model", tokenizer="tiny-tok", extra={"note": "x"})
    names = sorted(f for f in os.listdir(tmp_path) if f.endswith(".tar"))
    assert names == ["traj-000000.tar", "traj-000001.tar", "traj-000002.tar"]
    assert not [f for f in os.listdir(tmp_path) if "partial" in f]
    back = []
    for name in names:
        back += read_shard(str(tmp_path / name))
    assert len(back) == len(recs)
    for a, b in zip(recs, back):
        assert a.equal(b), a.sample_id
    # keys never contain dots, even for ids that do
    with tarfile.open(tmp_path / names[0]) as tf:
        keys = {m.name.split(".", 1)[0] for m in tf.getmembers()}
    assert len(keys) == 3 and not any("." in k or "/" in k for k in keys)

    m = read_manifest(mpath)
    assert m["model"] == "tiny-model" and m["tokenizer"] == "tiny-tok" and m["block_size"] == 4
    assert m["counts"]["records"] == 7 and m["counts"]["shards"] == 3
    assert m["counts"]["blocks"] == sum(r.num_blocks for r in recs)
    assert m["counts"]["response_tokens"] == sum(r.response_len for r in recs)
    assert m["filtered"] == {"degenerate": 2}
    assert [s["num_records"] for s in m["shards"]] == [3, 3, 1]
    assert [s["path"] for s in m["shards"]] == names
    assert m["shard_paths"] == [str(tmp_path / n) for n in names]
    assert [s["num_bytes"] for s in m["shards"]] == [os.path.getsize(p) for p in m["shard_paths"]]
    assert m["extra"] == {"note": "x"}
    assert list(iter_shard(m["shard_paths"][2]))[0].equal(recs[6])


def test_shards_readable_by_webdataset(tmp_path):
    import webdataset as wds

    from megatron_jf.data.shards import decode_record

    recs = random_records(5, 4)
    write(tmp_path, recs, per_shard=10)
    ds = wds.WebDataset(str(tmp_path / "traj-000000.tar"), shardshuffle=False, empty_check=False)
    back = [decode_record(s["json"], s["npz"], s["sha256"]) for s in ds]
    assert len(back) == 4 and all(a.equal(b) for a, b in zip(recs, back))


def test_writer_rejects_mixed_block_sizes_and_invalid_records(tmp_path):
    with TrajectoryShardWriter(str(tmp_path), prefix="a") as w:
        w.write(hand_record())
        other = make_record("n2", [5], [([[3, 3]], [4, 4])], n=2)
        with pytest.raises(ValueError, match="n2.*block_size 2"):
            w.write(other)
        bad = hand_record()
        bad.blocks[1].context_len = 0
        with pytest.raises(ValueError, match="hand/0"):
            w.write(bad)
    assert [r.sample_id for r in read_shard(str(tmp_path / "a-000000.tar"))] == ["hand/0"]


def test_refuses_to_overwrite(tmp_path):
    write(tmp_path, random_records(0, 2))
    with pytest.raises(FileExistsError, match="traj-000000.tar"):
        write(tmp_path, random_records(0, 2))


def test_atomic_write_failure_midway(tmp_path):
    recs = random_records(4, 5)
    with pytest.raises(RuntimeError, match="collector crashed"):
        with TrajectoryShardWriter(str(tmp_path), prefix="t", max_records_per_shard=3) as w:
            for r in recs[:4]:
                w.write(r)
            # shard 0 complete and renamed; shard 1 is in progress under a hidden temporary name only
            assert sorted(os.listdir(tmp_path))[-1] == "t-000000.tar"
            assert not os.path.exists(tmp_path / "t-000001.tar")
            assert any(f.startswith(".t-000001.tar.partial") for f in os.listdir(tmp_path))
            raise RuntimeError("collector crashed")
    assert sorted(os.listdir(tmp_path)) == ["t-000000.tar"]  # no partial file, no temp left
    assert [r.sample_id for r in read_shard(str(tmp_path / "t-000000.tar"))] == [r.sample_id for r in recs[:3]]


def test_write_manifest_atomic_and_errors(tmp_path):
    p = tmp_path / "m.json"
    write_manifest(str(p), model="m", tokenizer="t", block_size=4, shards=[{"path": "x.tar", "num_records": 2, "num_bytes": 1}])
    assert read_manifest(str(p))["counts"] == {"records": 2, "shards": 1}
    assert os.listdir(tmp_path) == ["m.json"]
    p.write_text("{not json")
    with pytest.raises(ValueError, match="m.json"):
        read_manifest(str(p))
    p.write_text(json.dumps({"format": "other"}))
    with pytest.raises(ValueError, match="m.json"):
        read_manifest(str(p))
    with pytest.raises(FileNotFoundError, match="nope.json"):
        read_manifest(str(tmp_path / "nope.json"))
    w = TrajectoryShardWriter(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="no records"):
        w.write_manifest(model="m", tokenizer="t")


@pytest.fixture
def one_shard(tmp_path):
    write(tmp_path, random_records(9, 3), per_shard=10)
    path = str(tmp_path / "traj-000000.tar")
    return path, open(path, "rb").read(), index_shard(path)


def test_truncated_shard_names_path(one_shard):
    path, data, entries = one_shard
    cut_points = [
        entries[1].npz[0] + 10,  # inside a member's data
        entries[1].json[0] - 512,  # exactly at a header boundary (tarfile alone would not notice)
        entries[2].sha256[0] + 512,  # all members present, end-of-archive marker missing
        100,  # inside the first header
    ]
    for cut in cut_points:
        with open(path, "wb") as f:
            f.write(data[:cut])
        with pytest.raises(ValueError, match="traj-000000.tar") as ei:
            read_shard(path)
        assert "truncated" in str(ei.value) or "corrupt" in str(ei.value)


def test_corrupt_bytes_names_path(one_shard):
    path, data, entries = one_shard
    for pos in [
        entries[1].npz[0] + entries[1].npz[1] // 2,  # compressed array bytes
        entries[0].json[0] + 5,  # metadata text
        entries[2].sha256[0] + 1,  # the checksum itself
        entries[1].json[0] - 512 + 3,  # a member name in a tar header
    ]:
        bad = bytearray(data)
        bad[pos] ^= 0x5A
        with open(path, "wb") as f:
            f.write(bytes(bad))
        with pytest.raises(ValueError, match="traj-000000.tar"):
            read_shard(path)
    with open(path, "wb") as f:
        f.write(data)
    assert len(read_shard(path)) == 3


def test_missing_and_foreign_shards(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.tar"):
        read_shard(str(tmp_path / "missing.tar"))
    foreign = tmp_path / "foreign.tar"
    src = tmp_path / "a.txt"
    src.write_text("hi")
    with tarfile.open(foreign, "w") as tf:
        tf.add(src, arcname="k1.txt")
    with pytest.raises(ValueError, match="foreign.tar.*unexpected member"):
        read_shard(str(foreign))


# ---------------------------------------------------------------------------- repetition filter
def test_periodic_tail_matches_brute_force():
    g = torch.Generator().manual_seed(0)
    for _ in range(40):
        L = int(torch.randint(1, 30, (), generator=g))
        x = torch.randint(0, 3, (L,), generator=g).tolist()
        best = (0, 0)
        for p in range(1, min(6, L - 1) + 1):
            j = L - 1
            while j - p >= 0 and x[j] == x[j - p]:
                j -= 1
            run = L - 1 - j
            if run > 0 and run + p > best[0]:
                best = (run + p, p)
        assert periodic_tail(x, 6) == best


def test_distinct_ratio_hand():
    assert distinct_ngram_ratio([1, 2, 1, 2, 1], 2) == 0.5  # (1,2),(2,1),(1,2),(2,1)
    assert distinct_ngram_ratio([1, 2, 3], 4) == 1.0


def test_is_degenerate_examples():
    distinct = list(range(100, 150))
    assert not is_degenerate(distinct)
    loop = list(range(100, 120)) + [7, 8, 9] * 10  # 30 of 50 tokens are a period-3 loop
    assert is_degenerate(loop)
    assert degeneracy_reason(loop) == "periodic_tail(p=3, len=30/50)"
    short_loop = list(range(100, 140)) + [1, 2] * 5  # loop covers only 10 of 50 tokens
    assert not is_degenerate(short_loop)
    # a trailing EOS breaks the period unless it is stripped; 51 tokens are too few for the distinct rule
    assert is_degenerate(loop + [EOS], eos_id=EOS)
    assert not is_degenerate(loop + [EOS])
    # Thue-Morse over {5, 6} is overlap-free, so no block repeats even 3 times in a row (the periodic
    # rule cannot fire), and 2 symbols allow at most 2^4 = 16 distinct 4-grams among 197 (< 0.3).
    thue_morse = [5 + bin(i).count("1") % 2 for i in range(200)]
    assert all(t < 4 * p for p, t in enumerate(periodic_tail_lengths(thue_morse), start=1))
    assert degeneracy_reason(thue_morse).startswith("distinct_4gram=")
    assert not is_degenerate(thue_morse[:63])  # too short for the distinct rule
    with pytest.raises(ValueError):
        is_degenerate(torch.zeros(2, 2, dtype=torch.int64))
