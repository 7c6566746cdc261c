"""Trajectory collection on vLLM (issue 24; megatron_jf/vllm_plugin/collect.py, ``tools/generate_trajectories.py
--engine vllm``), in the vLLM environment (``JF_ENV=vllm bash scripts/test.sh``); skipped where vLLM is not installed.

* Equal to the reference collector: on the two tiny fp32 models, prompts, block sizes and draft initialisations of
  tests/test_collect_reference.py, every record (block layout, every state, fixed points, EOS) equals the reference
  of tests/trajectory_reference.py (block-wise Jacobi verified by ``transformers``), which this project's collector
  is checked against in the primary environment; any difference must be a counted near-tie of the logits. The fixed
  points equal ``transformers`` greedy (``generate``), and the Jacobi forwards counted equal the reference's.
* Resumable: the tool is SIGKILLed after 5 records and re-run; every prompt ends up exactly once, and every record
  equals the reference decoded with the draft seeds of the run that wrote it.

One vLLM engine per model, in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, eager mode), started once for the
module; the resume test runs the tool twice as a subprocess.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys

import pytest

pytest.importorskip("vllm")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

from tests.test_collect_reference import CASES, check_coverage  # noqa: E402
from tests.trajectory_reference import (NEAR_TIE, collector_prompts, compare, greedy, reference_decode,  # noqa: E402
                                        tiny_models)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(REPO, "tools", "generate_trajectories.py")
EOS = frozenset({255})
KV_BYTES = 64 << 20


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The tiny models saved as Hugging Face directories (no tokenizer: prompts are token ids)."""
    root = tmp_path_factory.mktemp("vllm_collect")
    out = {}
    for name, hf in tiny_models().items():
        path = str(root / name)
        hf.save_pretrained(path)
        out[name] = (path, hf)
    return out


@pytest.fixture(scope="module")
def collectors(models):
    """One VLLMCollector per model (block size and draft init of its case), started on first use."""
    from megatron_jf.vllm_plugin.collect import VLLMCollector

    cache = {}

    def get(name):
        if name not in cache:
            case = CASES[name]
            cache[name] = VLLMCollector(models[name][0], block_size=case["block_size"],
                                        draft_init=case["draft_init"], max_num_seqs=6, kv_cache_bytes=KV_BYTES,
                                        enforce_eager=True)
        return cache[name]

    yield get
    cache.clear()


def _config(name, seed=7):
    from megatron_jf.data import collect as C

    case = CASES[name]
    return C.CollectConfig(block_size=case["block_size"], max_new_tokens=case["max_new_tokens"],
                           draft_init=case["draft_init"], seed=seed, batch_size=4, filter=False, eos_ids=EOS)


def _read(out_dir) -> dict:
    from megatron_jf.data.shards import read_shard

    return {r.sample_id: r for p in sorted(glob.glob(os.path.join(out_dir, "traj-dp*.tar"))) for r in read_shard(p)}


def _references(hf, prompts, cfg, seeds: dict | None = None) -> dict:
    """Reference decodes; draft seeds as the collectors give them (per batch of ``cfg.batch_size`` in this order)
    unless ``seeds`` (id -> seed) says otherwise."""
    from megatron_jf.data import collect as C

    refs = {}
    for batch in C.iter_batches(prompts, cfg.batch_size):
        for p in batch:
            seed = (seeds or {}).get(p.sample_id, C.batch_seed(cfg.seed, batch[0].sample_id))
            refs[p.sample_id] = reference_decode(hf, p.ids, block_size=cfg.block_size, seed=seed,
                                                 max_new_tokens=cfg.max_new_tokens, eos_ids=EOS,
                                                 draft_init=cfg.draft_init)
    return refs


@pytest.mark.parametrize("name", sorted(CASES))
def test_vllm_collector_equals_reference_and_greedy(name, models, collectors, tmp_path):
    from megatron_jf.data import collect as C
    from megatron_jf.data.shards import TrajectoryShardWriter
    from megatron_jf.vllm_plugin.collect import collect

    hf = models[name][1]
    cfg = _config(name)
    prompts = [C.TokenizedPrompt(f"p{i:02d}", ids, "test") for i, ids in enumerate(collector_prompts())]
    col = collectors(name)
    with TrajectoryShardWriter(str(tmp_path), prefix="traj-dp00000", max_records_per_shard=4) as w:
        stats = collect(col, prompts, cfg, writer=w)
    records = _read(str(tmp_path))
    refs = _references(hf, prompts, cfg)
    cmp = compare(records, refs, cfg.block_size)
    print(f"{name}: {cmp.summary()}; prefill disagreements {col.prefill_disagreements}")
    assert not cmp.different, cmp.summary()
    assert len(cmp.near_ties) <= 1 and col.prefill_disagreements <= len(cmp.near_ties), cmp.summary()
    if not cmp.near_ties:
        assert stats.forwards == sum(r.forwards for r in refs.values())
    assert stats.records == len(prompts) and stats.tokens == sum(len(r.tokens) for r in refs.values())
    # fixed points = transformers greedy (up to near-ties along the greedy path)
    for p in prompts:
        toks, margin = greedy(hf, p.ids, max_new_tokens=cfg.max_new_tokens, eos_ids=EOS)
        assert records[p.sample_id].response_ids().tolist() == toks or margin < NEAR_TIE, p.sample_id
    check_coverage(name, records)

_KEEP = []  # in-process engines live until the process ends (see tests/test_vllm_plugin.py)


def test_collection_whose_longest_rows_reach_the_context_limit(models, tmp_path):
    """``max_model_len`` as ``--engine vllm`` sizes it (:func:`engine_length`: longest prompt + response +
    ``context_room(n)``, here 31 + 25 + 7 = 63) for prompts whose longest rows reach it (``max_new = 1 (mod n)``: a
    block starts at the last response token, the tightest case), four rows at a time: every record equals the
    reference. One token less and vLLM stops drafting for the whole batch in the longest row's last step: the run
    stops naming max_model_len instead of recording iterations of vLLM's zero drafts. (Before the fix the tool sized
    the engine 2 tokens short, ``+ n + 1``, and the run aborted with "give the engine more KV cache".)"""
    from megatron_jf.data import collect as C
    from megatron_jf.data.shards import TrajectoryShardWriter
    from megatron_jf.vllm_plugin.collect import VLLMCollector, collect, engine_length

    path, hf = models["rand"]
    cfg = C.CollectConfig(block_size=4, max_new_tokens=25, draft_init="context", seed=7, batch_size=4, filter=False,
                          eos_ids=EOS)
    prompts = [C.TokenizedPrompt(f"p{i:02d}", ids, "test")
               for i, ids in enumerate(sorted(collector_prompts(), key=len, reverse=True))]  # as the tool orders them
    length = engine_length(len(prompts[0].ids), cfg.max_new_tokens, cfg.block_size)
    assert length == 63
    refs = _references(hf, prompts, cfg)
    for max_model_len in (length, length - 1):
        col = VLLMCollector(path, block_size=4, max_num_seqs=4, max_model_len=max_model_len, kv_cache_bytes=KV_BYTES,
                            enforce_eager=True)
        _KEEP.append(col)
        out = tmp_path / str(max_model_len)
        if max_model_len < length:
            with pytest.raises(ValueError, match=r"skipped the proposer .* max_model_len=62"):
                with TrajectoryShardWriter(str(out), prefix="traj-dp00000", max_records_per_shard=100) as w:
                    collect(col, prompts, cfg, writer=w)
            continue
        assert col.max_context == len(prompts[0].ids) + cfg.max_new_tokens
        with TrajectoryShardWriter(str(out), prefix="traj-dp00000", max_records_per_shard=100) as w:
            collect(col, prompts, cfg, writer=w)
        records = _read(str(out))
        cmp = compare(records, refs, cfg.block_size)
        assert not cmp.different and not cmp.near_ties, cmp.summary()
        longest = records[prompts[0].sample_id]
        assert len(prompts[0].ids) + longest.response_ids().numel() == col.max_context  # it reached the limit


def test_tool_killed_then_resumed_covers_every_prompt_once_with_reference_records(models, tmp_path):
    from megatron_jf.data import collect as C
    from megatron_jf.data.shards import read_manifest

    path, hf = models["rand"]
    cfg = _config("rand", seed=3)
    rows = [{"id": f"q{i:02d}", "prompt_ids": ids} for i, ids in enumerate(collector_prompts())]
    prompts_file = tmp_path / "p.jsonl"
    prompts_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = str(tmp_path / "out")
    cmd = [sys.executable, TOOL, "--engine", "vllm", "--prompts", str(prompts_file), "--load", path, "--out", out,
           "--block-size", str(cfg.block_size), "--max-new-tokens", str(cfg.max_new_tokens), "--draft-init",
           cfg.draft_init, "--seed", str(cfg.seed), "--batch-size", str(cfg.batch_size), "--max-records-per-shard",
           "2", "--no-filter", "--no-progress", "--enforce-eager", "--kv-cache-gb", str(KV_BYTES / 2**30)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    crash = [sys.executable, os.path.join(REPO, "tests", "fault_injection.py"), *cmd[1:]]  # test-only crash hook
    p = subprocess.run(crash, capture_output=True, text=True, timeout=900,
                       env=dict(env, MEGATRON_JF_COLLECT_CRASH_AFTER_RECORDS="5"))
    assert p.returncode == -signal.SIGKILL, (p.returncode, p.stdout[-2000:], p.stderr[-3000:])
    names = sorted(os.listdir(out))
    assert [n for n in names if n.endswith(".tar")] == ["traj-dp00000-000000.tar", "traj-dp00000-000001.tar"]
    assert any(".partial-" in n for n in names) and "manifest.json" not in names
    first = _read(out)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-3000:])
    assert "4 records in 2 complete shards" in p.stdout and "1 partial file(s) removed" in p.stdout, p.stdout
    assert not any(".partial-" in n for n in os.listdir(out))
    records = _read(out)
    assert sorted(records) == [r["id"] for r in rows] and len(first) == 4
    man = read_manifest(os.path.join(out, "manifest.json"))
    assert man["counts"]["records"] == len(rows) and man["counts"]["missing"] == 0
    assert man["extra"]["engine"] == "vllm" and man["extra"]["dtype"] == "float32"
    # draft seeds: the first run's batches for what it wrote, the resumed run's batches for the rest
    specs = [C.TokenizedPrompt(r["id"], r["prompt_ids"], "test") for r in rows]
    order = sorted(specs, key=lambda q: -len(q.ids))
    rest = [q for q in order if q.sample_id not in first]
    seeds = {q.sample_id: C.batch_seed(cfg.seed, b[0].sample_id) for b in C.iter_batches(order, cfg.batch_size)
             for q in b if q.sample_id in first}
    seeds.update({q.sample_id: C.batch_seed(cfg.seed, b[0].sample_id) for b in C.iter_batches(rest, cfg.batch_size)
                  for q in b})
    cmp = compare(records, _references(hf, specs, cfg, seeds), cfg.block_size)
    print(cmp.summary())
    assert not cmp.different and len(cmp.near_ties) <= 1, cmp.summary()
