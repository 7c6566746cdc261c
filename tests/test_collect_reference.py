"""This project's trajectory collector (megatron_jf.data.collect on the engine) against the independent reference of
tests/trajectory_reference.py (block-wise Jacobi verified by ``transformers``): the same records on tiny fp32 models,
any difference a counted near-tie. The vLLM collector is checked against the same reference, on the same models and
prompts, in the vLLM environment (tests/test_vllm_collect.py): together, the two collectors write the same data.
"""

import os

import pytest

from tests.test_collect import _mcore
from tests.trajectory_reference import collector_prompts, compare, reference_decode, tiny_models

CASES = {"rand": dict(block_size=4, max_new_tokens=24, draft_init="context"),
         "cycle": dict(block_size=6, max_new_tokens=40, draft_init="context"),
         "peaked": dict(block_size=5, max_new_tokens=23, draft_init="repeat")}


def check_coverage(name, records):
    """The cases exercise what they are meant to: many states per block (rand), EOS after a few tokens (cycle), whole
    blocks accepted in one forward with bonus tokens past the block's end, EOS and the length limit inside an
    accepted draft (peaked)."""
    states = [len(b.drafts) for r in records.values() for b in r.blocks]
    eos = sum(r.eos_reached for r in records.values())
    if name == "rand":
        assert sum(states) / len(states) > 2.5, states
    elif name == "cycle":
        assert eos >= 4, eos
    else:
        tokens = sum(r.response_ids().numel() for r in records.values())
        assert eos == 2 and tokens / sum(states) > 3, (eos, tokens, states)
        assert sum(r.response_ids().numel() == 23 for r in records.values()) == 8


@pytest.mark.parametrize("name", sorted(CASES))
def test_engine_collector_equals_transformers_reference(name, mp1, tmp_path):
    from megatron_jf.data import collect as C
    from megatron_jf.data.shards import TrajectoryShardWriter, read_shard
    from megatron_jf.inference.engine import Engine

    hf = tiny_models()[name]
    case = CASES[name]
    prompts = [C.TokenizedPrompt(f"p{i:02d}", ids, "test") for i, ids in enumerate(collector_prompts())]
    cfg = C.CollectConfig(block_size=case["block_size"], max_new_tokens=case["max_new_tokens"],
                          draft_init=case["draft_init"], seed=7, batch_size=4, filter=False, eos_ids=frozenset({255}))
    with TrajectoryShardWriter(str(tmp_path), prefix="traj-dp00000", max_records_per_shard=100) as w:
        C.collect(Engine(_mcore(hf)), prompts, cfg, writer=w)
    records = {r.sample_id: r for f in sorted(os.listdir(tmp_path)) if f.endswith(".tar")
               for r in read_shard(str(tmp_path / f))}
    refs = {}
    for batch in C.iter_batches(prompts, cfg.batch_size):
        seed = C.batch_seed(cfg.seed, batch[0].sample_id)
        for p in batch:
            refs[p.sample_id] = reference_decode(hf, p.ids, block_size=cfg.block_size, seed=seed,
                                                 max_new_tokens=cfg.max_new_tokens, eos_ids={255},
                                                 draft_init=cfg.draft_init)
    cmp = compare(records, refs, cfg.block_size)
    print(f"{name}: {cmp.summary()}")
    assert not cmp.different, cmp.summary()
    assert len(cmp.equal) >= len(refs) - 1, cmp.summary()
    check_coverage(name, records)

def test_vllm_engine_bad_input_is_named(tmp_path, capsys):
    """``--engine vllm`` reads Hugging Face directories: a megatron checkpoint, a folder without config.json and
    ``--tp 2`` stop with one line naming the problem (no vLLM needed to get there)."""
    from tests.test_collect import _tool, _write_jsonl

    prompts = _write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt_ids": [5, 6, 7]}])
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "latest_checkpointed_iteration.txt").write_text("10")
    (tmp_path / "empty").mkdir()
    base = ["--engine", "vllm", "--prompts", prompts, "--out", str(tmp_path / "out")]
    for load, extra, want in ((ckpt, [], "is a megatron checkpoint; --engine vllm reads Hugging Face models: export "
                               f"it first with python tools/convert_hf.py mcore-to-hf --load {ckpt}"),
                              (tmp_path / "empty", [], "is not a Hugging Face model directory (no config.json)"),
                              (tmp_path / "nowhere", [], "model directory not found")):
        assert _tool().main(base + ["--load", str(load)] + extra) == 2
        err = capsys.readouterr().err
        assert want in err, err
    assert _tool().main(base + ["--load", str(ckpt), "--tp", "2"]) == 2
    assert "--engine vllm runs one in-process vLLM worker: --tp must be 1" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
