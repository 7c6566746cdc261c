"""Trajectory collection (megatron_jf.data.collect + tools/generate_trajectories.py), paper Sec. 3.1.

Real tiny models throughout: records are checked against the engine's own greedy AR decoding, shards
are read back and compared with the engine's output, a collector is SIGKILLed mid-run and resumed,
and a two-rank torchrun run is checked for disjoint, covering shards.
"""
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest

from tests.conftest import load_tool
import torch

from tests.conftest import REPO, run_torchrun

TOOL = os.path.join(REPO, "tools", "generate_trajectories.py")
CONVERT = os.path.join(REPO, "tools", "convert_hf.py")
VOCAB = 320
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)


def _tool():
    return load_tool("generate_trajectories")


def _mcore(hf):
    from megatron_jf.models.convert import hf_to_mcore
    from megatron_jf.models.gpt import build_model
    from megatron_jf.models.hf_config import ModelArgs

    args = ModelArgs.from_hf_dict(hf.config.to_dict())
    m = build_model(args).eval()
    m.load_state_dict(hf_to_mcore(hf.state_dict(), args), strict=False)
    return m


def _prompts(k, seed=0, lo=2, hi=12, vocab=256):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()
            for _ in range(k)]


def _write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


def _read_dir(out):
    from megatron_jf.data.shards import read_shard

    recs = []
    for p in sorted(glob.glob(os.path.join(out, "traj-dp*.tar"))):
        recs += read_shard(p)
    return recs


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A tiny random Qwen2 (vocab 320) with a byte-level BPE tokenizer (eos <|endoftext|>=0, <|im_end|>=2),
    converted with tools/convert_hf.py."""
    from megatron_jf.data.tokenizer_train import train_bpe_tokenizer
    from megatron_jf.models.zoo import save_tiny_hf

    d = tmp_path_factory.mktemp("collect")
    hf = save_tiny_hf(str(d / "hf"), vocab=VOCAB, seed=3)
    texts = ["def f(x):\n    return x + 1\n", "Hello world.\n\tTabs, spaces  and\nnewlines.", "for i in range(9):\n"]
    train_bpe_tokenizer(str(d / "tok"), texts=texts * 10, vocab_size=VOCAB, min_frequency=1)
    for name in os.listdir(d / "tok"):
        shutil.copy(d / "tok" / name, hf)
    cfg = json.load(open(os.path.join(hf, "config.json")))
    cfg["eos_token_id"] = 2  # the random model's default stop id (vocab-1) is outside the trained vocabulary
    json.dump(cfg, open(os.path.join(hf, "config.json"), "w"))
    p = subprocess.run([sys.executable, CONVERT, "hf-to-mcore", "--hf", hf, "--out", str(d / "ckpt")],
                       capture_output=True, text=True, env=ENV, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return str(d / "ckpt")


# ----------------------------------------------------------------------------- records from the engine
def test_first_draft_is_the_initialisation_and_a_copy(mp1):
    from megatron_jf.data.collect import build_record
    from megatron_jf.inference.engine import DecodeConfig, Engine
    from megatron_jf.models.zoo import tiny_hf_model

    eng = Engine(_mcore(tiny_hf_model(seed=5)))
    prompts = _prompts(3, seed=1)
    n = 4
    res = eng.generate(prompts, DecodeConfig("jacobi", block_size=n, draft_init="repeat"), max_new_tokens=22,
                       record_trajectory=True)
    differs = 0
    for i, (p, r) in enumerate(zip(prompts, res)):
        rec = build_record(f"s{i}", p, r, n, frozenset())
        assert rec.response_ids().tolist() == r.tokens and rec.prompt_ids.tolist() == p
        ctx = list(p)
        for j, b in enumerate(rec.blocks):
            d0, fp = b.drafts[0].tolist(), b.fixed_point.tolist()
            assert b.context_len == len(ctx)
            if j == 0:  # nothing known yet: the last prompt token repeated
                assert d0 == [p[-1]] * b.length
            else:  # 0 or 1 known leading token (the bonus token of the previous forward), then it repeated
                assert d0 in ([ctx[-1]] * b.length, [fp[0]] * b.length), (d0, ctx[-1], fp)
            # each iterate fed to the model has at least one more correct leading token than the one before
            for s, d in enumerate(b.drafts.tolist()):
                agree = next((k for k in range(b.length) if d[k] != fp[k]), b.length)
                assert agree >= s, (s, d, fp)
            differs += d0 != fp
            ctx += fp
        # copies: mutating later states, the fixed point or the engine's lists leaves the initial draft alone
        for b in rec.blocks:
            if b.num_states > 1:
                before, fp_before = b.drafts[0].clone(), b.fixed_point.clone()
                r.trajectory[rec.blocks.index(b)]["drafts"][0][0] = 9999
                b.drafts[-1].fill_(7777)
                assert torch.equal(b.drafts[0], before)
                b.fixed_point.fill_(8888)
                assert torch.equal(b.drafts[0], before)
                b.drafts[0].fill_(6666)
                assert torch.equal(b.drafts[-1], torch.full_like(before, 7777))
                assert not torch.equal(fp_before, b.fixed_point)
                break
        else:
            raise AssertionError("no block needed more than one iteration")
    assert differs > 0  # an aliased drafts[0] (reference bug B1) would equal the fixed point everywhere


def test_fixed_points_are_greedy_ar_of_their_context(mp1):
    from megatron_jf.data.collect import build_record
    from megatron_jf.inference.engine import DecodeConfig, Engine
    from megatron_jf.models.zoo import tiny_hf_model

    eng = Engine(_mcore(tiny_hf_model(seed=6)))
    prompts = _prompts(4, seed=2)
    n = 5
    res = eng.generate(prompts, DecodeConfig("jacobi", block_size=n, draft_init="context"), max_new_tokens=23,
                       record_trajectory=True)
    iterated = 0
    for i, (p, r) in enumerate(zip(prompts, res)):
        rec = build_record(f"s{i}", p, r, n, frozenset())
        assert rec.response_len == 23 and rec.block_lens == [5, 5, 5, 5, 3] and not rec.eos_reached
        ctx = list(p)
        for b in rec.blocks:
            ar = eng.generate([ctx], DecodeConfig("ar"), max_new_tokens=b.length)[0].tokens
            assert b.fixed_point.tolist() == ar
            assert b.context_len == len(ctx)
            iterated += b.num_states > 1
            ctx += ar
    assert iterated > 0  # some block needed Jacobi iterations (the check is not vacuous)


def test_eos_and_length_cut_the_last_block(mp1):
    """EOS mid-block: last block cut right after it; a token the engine emits past the last recorded
    block (the final forward's bonus token) still ends up in the record."""
    from megatron_jf.data.collect import build_record
    from megatron_jf.inference.engine import DecodeConfig, Engine
    from megatron_jf.models.zoo import peaked_hf_model

    eng = Engine(_mcore(peaked_hf_model(period=4, seed=1)))  # next token: 248->249->250->251->248 ...
    r = eng.generate([[9, 30, 249]], DecodeConfig("jacobi", block_size=4, draft_init="repeat"), max_new_tokens=20,
                     eos_ids={251}, record_trajectory=True)[0]
    assert r.tokens == [250, 251] and r.finish_reason == "eos"
    rec = build_record("e", [9, 30, 249], r, 4, frozenset({251}))
    assert rec.eos_reached and rec.block_lens == [2] and rec.blocks[0].drafts.shape[1] == 2
    rec.validate(eos_id=251)
    r = eng.generate([[9, 30, 249]], DecodeConfig("jacobi", block_size=4, draft_init="repeat"), max_new_tokens=20,
                     eos_ids={2}, record_trajectory=True)[0]
    assert not build_record("l", [9, 30, 249], r, 4, frozenset({2})).eos_reached

    eng = Engine(_mcore(peaked_hf_model(period=1, seed=1)))
    r = eng.generate([[5, 6, 7]], DecodeConfig("jacobi", block_size=2, draft_init="repeat"), max_new_tokens=3,
                     record_trajectory=True)[0]
    assert r.tokens == [7, 7, 7]  # one forward: 2 accepted + the bonus token
    rec = build_record("b", [5, 6, 7], r, 2, frozenset())
    assert rec.response_ids().tolist() == [7, 7, 7] and rec.block_lens == [2, 1]
    assert rec.blocks[1].context_len == 5 and rec.blocks[1].drafts.tolist() == [[7]]


def test_peaked_model_converges_in_few_iterations(mp1):
    from megatron_jf.data.collect import build_record
    from megatron_jf.inference.engine import DecodeConfig, Engine
    from megatron_jf.models.zoo import peaked_hf_model, tiny_hf_model

    prompts = _prompts(3, seed=4)
    mean_states = []
    for hf in (peaked_hf_model(period=1, seed=2), tiny_hf_model(seed=2)):
        eng = Engine(_mcore(hf))
        res = eng.generate(prompts, DecodeConfig("jacobi", block_size=8, draft_init="repeat"), max_new_tokens=32,
                           record_trajectory=True)
        recs = [build_record(f"s{i}", p, r, 8, frozenset()) for i, (p, r) in enumerate(zip(prompts, res))]
        states = [b.num_states for rec in recs for b in rec.blocks]
        mean_states.append(sum(states) / len(states))
        if len(mean_states) == 1:
            assert max(states) <= 2, states
            for rec, p in zip(recs, prompts):  # the model repeats the last prompt token
                assert rec.response_ids().tolist() == [p[-1]] * 32
    assert mean_states[0] <= 1.5 < mean_states[1], mean_states


# ----------------------------------------------------------------------------- the tool
def test_tool_round_trip_equals_engine(ckpt, mp1, tmp_path):
    from megatron_jf.checkpointing import load_model, tokenizer_path
    from megatron_jf.data.shards import expand_sources, read_manifest, read_shard
    from megatron_jf.inference.engine import DecodeConfig, Engine
    from megatron_jf.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer_path(ckpt))
    text = "  def f(x):\n\treturn x  \n\n# trailing spaces   "
    msgs = [{"role": "system", "content": "Be brief.\n"}, {"role": "user", "content": "for i in range(9):\n    pass"}]
    rows = [{"id": "text", "prompt": text}, {"id": 7, "messages": msgs}]
    rows += [{"id": f"ids{i}", "prompt_ids": p} for i, p in enumerate(_prompts(6, seed=9, vocab=VOCAB))]
    rows += [{"id": "huge", "prompt_ids": [5] * 500}]  # 500 + 16 > 512: skipped and counted
    prompts = _write_jsonl(tmp_path / "p.jsonl", rows)
    out = str(tmp_path / "out")
    _tool().main(["--prompts", prompts, "--load", ckpt, "--out", out, "--block-size", "4", "--max-new-tokens", "16",
                  "--batch-size", "3", "--draft-init", "repeat", "--max-records-per-shard", "3", "--no-filter",
                  "--no-progress"])
    man = read_manifest(os.path.join(out, "manifest.json"))
    assert man["block_size"] == 4 and man["counts"]["records"] == 8 and man["counts"]["missing"] == 0
    assert man["filtered"] == {"prompt_too_long": 1} and man["counts"]["shards"] == 3
    recs = {r.sample_id: r for p, _, _ in expand_sources(os.path.join(out, "manifest.json")) for r in read_shard(p)}
    assert sorted(recs) == sorted(["text", "7"] + [f"ids{i}" for i in range(6)])
    # whitespace and newlines survive; messages use the tokenizer's chat template
    assert recs["text"].prompt_ids.tolist() == tok.encode(text) and tok.decode(recs["text"].prompt_ids) == text
    assert recs["7"].prompt_ids.tolist() == tok.encode(tok.apply_chat_template(msgs))
    for i, r in enumerate(rows[2:8]):
        assert recs[f"ids{i}"].prompt_ids.tolist() == r["prompt_ids"]
    # every record equals what the engine produces for that prompt alone
    model, _, _ = load_model(ckpt)
    eng = Engine(model)
    for sid, rec in recs.items():
        r = eng.generate([rec.prompt_ids.tolist()], DecodeConfig("jacobi", block_size=4, draft_init="repeat"),
                         max_new_tokens=16, eos_ids={0, 2}, record_trajectory=True)[0]
        assert rec.response_ids().tolist() == r.tokens, sid
        assert rec.eos_reached == (r.finish_reason == "eos")
        for b, t in zip(rec.blocks, r.trajectory):
            assert b.context_len == t["context_len"] and b.fixed_point.tolist() == t["fixed_point"]
            assert b.drafts.tolist() == t["drafts"], sid


def test_kill_mid_run_then_resume_covers_every_prompt_once(ckpt, tmp_path):
    from megatron_jf.data.shards import read_manifest

    n_prompts = 14
    prompts = _write_jsonl(tmp_path / "p.jsonl", [{"id": f"q{i:02d}", "prompt_ids": p}
                                                  for i, p in enumerate(_prompts(n_prompts, seed=11, vocab=VOCAB))])
    out = str(tmp_path / "out")
    cmd = [sys.executable, TOOL, "--prompts", prompts, "--load", ckpt, "--out", out, "--block-size", "4",
           "--max-new-tokens", "24", "--batch-size", "4", "--max-records-per-shard", "2", "--no-progress"]
    crash = [sys.executable, os.path.join(REPO, "tests", "fault_injection.py"), *cmd[1:]]  # test-only crash hook
    p = subprocess.run(crash, capture_output=True, text=True, timeout=300,
                       env=dict(ENV, MEGATRON_JF_COLLECT_CRASH_AFTER_RECORDS="5"))
    assert p.returncode == -signal.SIGKILL, (p.returncode, p.stderr[-3000:])
    names = sorted(os.listdir(out))
    assert [n for n in names if n.endswith(".tar")] == ["traj-dp00000-000000.tar", "traj-dp00000-000001.tar"]
    assert any(".partial-" in n for n in names) and "manifest.json" not in names
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=ENV)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "4 records in 2 complete shards" in p.stdout and "1 partial file(s) removed" in p.stdout
    names = os.listdir(out)
    assert not any(".partial-" in n for n in names)
    ids = [r.sample_id for r in _read_dir(out)]
    skipped = [json.loads(line)["id"] for f in glob.glob(os.path.join(out, "*.skipped.jsonl")) for line in open(f)]
    assert len(ids) == len(set(ids)) and not set(ids) & set(skipped)
    assert sorted(ids + skipped) == [f"q{i:02d}" for i in range(n_prompts)]
    man = read_manifest(os.path.join(out, "manifest.json"))
    assert man["counts"]["records"] == len(ids) and man["counts"]["missing"] == 0
    assert sum(man["filtered"].values()) == len(skipped)


def test_two_ranks_write_disjoint_covering_shards(ckpt, tmp_path):
    from megatron_jf.data.shards import read_manifest

    n_prompts = 9
    prompts = _write_jsonl(tmp_path / "p.jsonl", [{"id": f"r{i}", "prompt_ids": p}
                                                  for i, p in enumerate(_prompts(n_prompts, seed=12, vocab=VOCAB))])
    out_dp, out_tp = str(tmp_path / "dp"), str(tmp_path / "tp")
    stdout = run_torchrun("collect_2ranks.py", ckpt, prompts, out_dp, out_tp)
    assert "DONE 0" in stdout and "DONE 1" in stdout
    want = [f"r{i}" for i in range(n_prompts)]
    from megatron_jf.data.shards import read_shard

    per_rank = {}
    for path in sorted(glob.glob(os.path.join(out_dp, "*.tar"))):
        per_rank.setdefault(os.path.basename(path)[:12], []).extend(r.sample_id for r in read_shard(path))
    assert sorted(per_rank) == ["traj-dp00000", "traj-dp00001"]
    a, b = per_rank["traj-dp00000"], per_rank["traj-dp00001"]
    assert len(a) == 5 and len(b) == 4 and not set(a) & set(b) and sorted(a + b) == want
    assert read_manifest(os.path.join(out_dp, "manifest.json"))["counts"]["records"] == n_prompts
    # tp=2: one data-parallel group, one writer, same greedy responses
    tp_recs = {r.sample_id: r for r in _read_dir(out_tp)}
    assert {os.path.basename(p)[:12] for p in glob.glob(os.path.join(out_tp, "*.tar"))} == {"traj-dp00000"}
    assert sorted(tp_recs) == want
    for r in _read_dir(out_dp):
        assert torch.equal(r.response_ids(), tp_recs[r.sample_id].response_ids()), r.sample_id


# ----------------------------------------------------------------------------- bad inputs
def test_bad_prompt_files_are_named(tmp_path):
    from megatron_jf.data.collect import read_prompts

    def err(lines, exc=ValueError):
        path = _write_jsonl(tmp_path / "bad.jsonl", lines)
        with pytest.raises(exc) as e:
            read_prompts(path)
        return str(e.value)

    ok = json.dumps({"id": "a", "prompt": "x"})
    assert "bad.jsonl:3: invalid JSON" in err([ok, "", '{"id": "b", "prompt": '])
    assert "bad.jsonl:2: unknown key(s) ['text']" in err([ok, {"id": "b", "text": "x"}])
    assert "bad.jsonl:1: missing 'id'" in err([{"prompt": "x"}])
    assert "exactly one of" in err([{"id": "b", "prompt": "x", "prompt_ids": [1]}])
    assert "exactly one of" in err([{"id": "b"}])
    m = err([ok, {"id": "c", "prompt": "y"}, {"id": "a", "prompt": "z"}])
    assert "bad.jsonl:3: duplicate id 'a' (first at" in m and "bad.jsonl:1" in m
    assert "duplicate id '5'" in err([{"id": 5, "prompt": "x"}, {"id": "5", "prompt": "y"}])
    assert "empty 'prompt'" in err([{"id": "b", "prompt": ""}])
    assert "prompt_ids[1] = True" in err([{"id": "b", "prompt_ids": [1, True]}])
    assert "prompt_ids[0] = -3" in err([{"id": "b", "prompt_ids": [-3]}])
    assert "messages[1]" in err([{"id": "b", "messages": [{"role": "user", "content": "x"}, {"role": "user"}]}])
    assert "expected a JSON object" in err(["[1, 2]"])
    assert "has no prompts" in err(["", "   "])
    (tmp_path / "latin.jsonl").write_bytes(b'{"id": "a", "prompt": "\xe9"}\n')
    with pytest.raises(ValueError, match="latin.jsonl:1: invalid UTF-8"):
        read_prompts(str(tmp_path / "latin.jsonl"))
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        read_prompts(str(tmp_path / "nope.jsonl"))
    # raw text is kept exactly, including U+2028 and CRLF-like content inside strings
    text = "a\r\n\tb\u2028c  "
    rows = [{"id": 1, "prompt": text}, "  ", {"id": "x", "prompt_ids": [4]}]
    specs = read_prompts(_write_jsonl(tmp_path / "good.jsonl", rows))
    assert [(s.sample_id, s.kind, s.value) for s in specs] == [("1", "prompt", text), ("x", "prompt_ids", [4])]
    assert specs[1].where.endswith("good.jsonl:3")


def test_bad_tokens_and_long_prompts(tmp_path):
    from megatron_jf.data.collect import PromptSpec, TokenizedPrompt, split_too_long, tokenize_prompt

    with pytest.raises(ValueError, match=r"f.jsonl:4: id 'a': a 'prompt' prompt needs a tokenizer"):
        tokenize_prompt(PromptSpec("a", "prompt", "hi", "f.jsonl:4"), None, 100)
    with pytest.raises(ValueError, match=r"f.jsonl:2: id 'b': token id 100 is outside the model vocabulary \[0, 100\)"):
        tokenize_prompt(PromptSpec("b", "prompt_ids", [1, 100], "f.jsonl:2"), None, 100)
    ps = [TokenizedPrompt("s", [1] * 10, "f:1"), TokenizedPrompt("l", [1] * 11, "f:2")]
    ok, long = split_too_long(ps, max_context=20, max_new_tokens=10)
    assert [p.sample_id for p in ok] == ["s"] and [p.sample_id for p in long] == ["l"]
    with pytest.raises(ValueError, match=r"f:2: id 'l': prompt has 11 tokens; with --max-new-tokens 10 it exceeds "
                                         r"the context window of 20"):
        split_too_long(ps, max_context=20, max_new_tokens=10, policy="error")


def test_tool_errors_are_named(ckpt, mp1, tmp_path, capsys):
    tool = _tool()
    good = _write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt_ids": [5, 6]}, {"id": "b", "prompt_ids": [5] * 600}])
    base = ["--load", ckpt, "--block-size", "4", "--max-new-tokens", "8", "--no-progress"]
    cases = [
        (["--prompts", _write_jsonl(tmp_path / "e.jsonl", [])], "e.jsonl has no prompts"),
        (["--prompts", str(tmp_path / "missing.jsonl")], "prompt file not found"),
        (["--prompts", good, "--load", str(tmp_path / "nockpt")], "checkpoint directory not found"),
        (["--prompts", good, "--long-prompts", "error"], "p.jsonl:2: id 'b': prompt has 600 tokens"),
    ]
    for extra, msg in cases:
        assert tool.main(base + ["--out", str(tmp_path / "o1")] + extra) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("generate_trajectories: error: ") and msg in err, (msg, err)
    # a text prompt without any tokenizer
    bare = str(tmp_path / "bare")
    shutil.copytree(ckpt, bare, ignore=shutil.ignore_patterns("tokenizer"))
    txt = _write_jsonl(tmp_path / "t.jsonl", [{"id": "a", "prompt_ids": [3]}, {"id": "z", "prompt": "hi"}])
    assert tool.main(base + ["--load", bare, "--prompts", txt, "--out", str(tmp_path / "o2")]) == 2
    assert re.search(r"t.jsonl:2: id 'z' is a 'prompt' prompt, .* pass --tokenizer", capsys.readouterr().err)
    # resuming into a directory made with other settings
    out = str(tmp_path / "o3")
    run = ["--load", ckpt, "--max-new-tokens", "8", "--no-progress", "--prompts", good, "--out", out]
    assert tool.main(run + ["--block-size", "4", "--batch-size", "2"]) == 0
    assert tool.main(run + ["--block-size", "5"]) == 2
    assert re.search(r"other settings.*block_size: 4 \(existing\) vs 5 \(now\)", capsys.readouterr().err)


def test_prepare_output_dir_cleans_a_killed_run(tmp_path):
    from megatron_jf.data.collect import prepare_output_dir, scan_output_dir

    out = tmp_path / "o"
    settings = {"block_size": 4, "seed": 0}
    assert prepare_output_dir(str(out), settings) == []
    (out / ".traj-dp00001-000003.tar.partial-4242").write_bytes(b"half a tar")
    (out / "manifest.json").write_text("{}")
    (out / "traj-dp00001.skipped.jsonl").write_text('{"id": "a", "reason": "r", "category": "c"}\n{"id": "b", "rea')
    assert prepare_output_dir(str(out), settings) == [".traj-dp00001-000003.tar.partial-4242"]
    assert sorted(os.listdir(out)) == ["collect_config.json", "traj-dp00001.skipped.jsonl"]
    assert (out / "traj-dp00001.skipped.jsonl").read_text().endswith('"c"}\n')
    assert set(scan_output_dir(str(out)).skipped) == {"a"}  # "b" was cut mid-line: collected again
    with pytest.raises(ValueError, match=r"other settings.*seed: 0 \(existing\) vs 1 \(now\)"):
        prepare_output_dir(str(out), {"block_size": 4, "seed": 1})
    os.remove(out / "traj-dp00001.skipped.jsonl")  # no data left: new settings are adopted
    prepare_output_dir(str(out), {"block_size": 4, "seed": 1})
    assert json.load(open(out / "collect_config.json"))["seed"] == 1
