"""tools/evaluate.py, tools/search_inference_config.py, tools/visualize_trajectory.py end to end on a real tiny
converted checkpoint (paper Tables 1-3, Appendix E, Figure 4).

The model is :func:`megatron_jf.models.zoo.peaked_hf_model` with ``period=1`` (greedy = repeat the current token) and a
tiny BPE tokenizer with a ChatML template, converted to a megatron checkpoint that carries the tokenizer. With
``draft_init="repeat"`` the Jacobi draft is the fixed point, so Jacobi's TPF is well above 1 while its output must
still equal AR's.
"""
import json
import os
import shutil

import pytest

from tests.conftest import load_tool
import torch

from tests.sandbox_marks import needs_os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tool(name):
    return load_tool(name)


@pytest.fixture(scope="module")
def ckpt(mp1, tmp_path_factory):
    from megatron_jf.checkpointing import save_checkpoint
    from megatron_jf.hf_io import load_hf_state_dict
    from megatron_jf.models.convert import hf_to_mcore
    from megatron_jf.models.gpt import build_model
    from megatron_jf.models.hf_config import ModelArgs
    from megatron_jf.data.tokenizer_train import train_bpe_tokenizer
    from megatron_jf.models.zoo import peaked_hf_model
    from megatron_jf.tokenizer import load_tokenizer

    root = tmp_path_factory.mktemp("evalckpt")
    texts = ["def add(a, b):\n    return a + b\n", "Question: what is 2 + 3?\nAnswer: 5\n"] * 20
    tokd = train_bpe_tokenizer(root / "tok", texts=texts, vocab_size=300, overwrite=True)
    vocab = len(load_tokenizer(tokd))
    hfd = root / "hf"
    peaked_hf_model("qwen2", period=1, seed=3, vocab=vocab, max_pos=2048).save_pretrained(hfd)
    for f in os.listdir(tokd):  # the checkpoint carries the tokenizer (as tools/convert_hf.py does)
        shutil.copy(tokd / f, hfd / f)
    args = ModelArgs.from_hf_dict(json.load(open(hfd / "config.json")))
    m = build_model(args)
    missing, unexpected = m.load_state_dict(hf_to_mcore(load_hf_state_dict(str(hfd)), args), strict=False)
    assert not [k for k in missing if not k.endswith("_extra_state")] and not unexpected
    save_checkpoint(str(root / "ckpt"), 0, m, tokenizer_dir=str(hfd))
    return str(root / "ckpt")


def _eval_args(ckpt, out, bench, *extra):
    # the fixed width: these tests check Jacobi's accepted tokens (with the default auto width a tiny model's
    # cheap forward can make every step an AR step on a given machine)
    return ["--load", ckpt, "--benchmark", bench, "--decoder", "jacobi", "--block-size", "4", "--draft-init", "repeat",
            "--draft-width", "fixed", "--limit", "2", "--max-new-tokens", "8", "--out", str(out), "--no-progress", "--threads", "1", *extra]


def _records(path):
    return [json.loads(line) for line in open(path)]


@pytest.mark.parametrize("bench,task", [pytest.param("humaneval", "HumanEval", marks=needs_os), ("gsm8k", "GSM8K")])
def test_evaluate_table_lossless_and_resume(ckpt, tmp_path, bench, task):
    ev = _tool("evaluate")
    out = tmp_path / "out"
    assert ev.main(_eval_args(ckpt, out, bench)) == 0
    stem = out / f"{bench}_jacobi"
    recs = _records(f"{stem}.jsonl")
    assert [r["task_id"] for r in recs] == ([f"HumanEval/{i}" for i in range(2)] if bench == "humaneval"
                                            else [f"gsm8k/{i}" for i in range(2)])
    for r in recs:
        assert r["lossless"] is True
        assert r["completion"] == r["ar"]["completion"] and r["completion"]  # identical, non-empty greedy text
        assert r["correct"] == r["ar"]["correct"] and r["status"] == r["ar"]["status"]
        assert r["ar"]["forwards"] == r["ar"]["new_tokens"] == 8  # AR: one token per forward, length-capped
        assert r["gen"]["new_tokens"] == 8 and r["gen"]["forwards"] < 8  # Jacobi accepted several per forward
        assert sum(r["accepted"]) == 8
        assert r["prompt_meta"]["prompt_set"] == "jf-paper-v1" and len(r["prompt_sha256"]) == 64
    if bench == "humaneval":  # the sandbox really ran the repeated-token completion and it failed
        assert all(r["status"] in ("failed", "error") and r["exec_duration_s"] > 0 for r in recs)
    else:
        assert all(r["status"] == "failed" and r["gold"] for r in recs)

    s = json.load(open(f"{stem}.summary.json"))
    assert s["ar"]["tpf"] == 1.0
    assert s["decoder"]["tpf"] == pytest.approx(16 / sum(r["gen"]["forwards"] for r in recs))
    assert s["decoder"]["tpf"] > 1.5
    assert s["decoder"]["accuracy"] == s["ar"]["accuracy"] == 0.0
    assert s["lossless"] == {"checked": 2, "identical": 2, "mismatched": [], "near_ties": []}
    assert s["speedup"] == pytest.approx(s["ar"]["wall_s"] / s["decoder"]["wall_s"])
    assert s["prompt"]["prompt_set"] == "jf-paper-v1" and s["generated"] == 2 and s["resumed"] == 0
    md = open(f"{stem}.md").read().splitlines()
    assert md[0] == "| Task | Method | Speedup | TPF | TPS | Acc |"
    assert md[2].startswith(f"| {task} | AR | 1.00× | 1.00 | ") and md[2].endswith("| 0.0 |")
    assert md[3].startswith(f"| {task} | Jacobi (n=4) | {s['speedup']:.2f}× | {s['decoder']['tpf']:.2f} | ")
    # the repeat-the-token model is degenerate: flagged next to TPF and speedup, in the table and the summary
    assert md[4].startswith(f"| {task} | AR | ⚠ | ⚠ |") and "DEGENERATE OUTPUT" in md[4]
    assert md[5].startswith(f"| {task} | Jacobi (n=4) | ⚠ | ⚠ |") and s["decoder"]["degeneracy"]["degenerate"]
    assert s["isolation"] == "os" and "UNISOLATED" not in "\n".join(md)
    if bench == "humaneval":
        assert all(r["verdict"] == "split" and r["isolation"] == "os" for r in recs)

    # resume: nothing is regenerated, records are byte-identical
    before = open(f"{stem}.jsonl").read()
    assert ev.main(_eval_args(ckpt, out, bench)) == 0
    s2 = json.load(open(f"{stem}.summary.json"))
    assert (s2["resumed"], s2["generated"]) == (2, 0)
    assert open(f"{stem}.jsonl").read() == before
    # drop the last record: only that sample is generated again
    lines = before.splitlines(keepends=True)
    open(f"{stem}.jsonl", "w").write(lines[0])
    assert ev.main(_eval_args(ckpt, out, bench)) == 0
    s3 = json.load(open(f"{stem}.summary.json"))
    assert (s3["resumed"], s3["generated"]) == (1, 1)
    after = _records(f"{stem}.jsonl")
    assert after[0] == recs[0] and after[1]["completion"] == recs[1]["completion"]
    assert after[1]["gen"]["decode_s"] != recs[1]["gen"]["decode_s"]  # really re-run
    # another configuration may not be mixed into the same file
    assert ev.main(_eval_args(ckpt, out, bench)[:5] + ["5"] + _eval_args(ckpt, out, bench)[6:]) == 2


def test_evaluate_bad_inputs(ckpt, tmp_path, capsys):
    ev = _tool("evaluate")
    assert ev.main(_eval_args(ckpt, tmp_path, "nosuchbench")) == 2
    assert "unknown benchmark 'nosuchbench'" in capsys.readouterr().err
    args = _eval_args(ckpt, tmp_path, "gsm8k")
    args[args.index("jacobi")] = "medusa"
    assert ev.main(args) == 2
    assert "unknown decoder 'medusa'" in capsys.readouterr().err
    assert ev.main(_eval_args(str(tmp_path / "missing"), tmp_path, "gsm8k")) == 2
    assert f"checkpoint directory not found: {tmp_path / 'missing'} (--load)" in capsys.readouterr().err
    assert ev.main(_eval_args(str(tmp_path), tmp_path, "gsm8k")) == 2  # exists, but no checkpoint inside
    assert "holds no megatron_jf checkpoint" in capsys.readouterr().err


def test_evaluate_refuses_code_without_isolation_unless_unisolated(ckpt, tmp_path, capsys, monkeypatch):
    from megatron_jf.eval import sandbox

    monkeypatch.setattr(sandbox, "_probe", lambda: "user namespaces are disabled (test)")
    ev = _tool("evaluate")
    assert ev.main(_eval_args(ckpt, tmp_path / "a", "humaneval")) == 2
    assert "refusing to execute generated code" in capsys.readouterr().err
    assert not (tmp_path / "a" / "humaneval_jacobi.jsonl").exists()  # refused before generating anything
    assert ev.main(_eval_args(ckpt, tmp_path / "b", "humaneval") + ["--unisolated"]) == 0
    err = capsys.readouterr().err
    assert "UNISOLATED" in err and "WITHOUT OS isolation" in err
    md = open(tmp_path / "b" / "humaneval_jacobi.md").read()
    assert "⚠ UNISOLATED" in md
    s = json.load(open(tmp_path / "b" / "humaneval_jacobi.summary.json"))
    assert s["isolation"] == "none" and s["accuracy_by_benchmark"]["humaneval"]["unisolated"] == 2
    assert ev.main(_eval_args(ckpt, tmp_path / "c", "gsm8k")) == 0  # math runs no code: no sandbox needed


def test_visualize_live_and_shard(ckpt, tmp_path):
    viz = _tool("visualize_trajectory")
    from megatron_jf.data import BlockTrajectory, TrajectoryRecord, TrajectoryShardWriter
    from megatron_jf.eval import trajectory_view

    # live: one row per Jacobi forward (each forward either adds an iterate or closes its block)
    blocks, tok, _, res = trajectory_view.live_trajectory(ckpt, "def add(a, b):", block_size=4, max_new_tokens=10)
    assert res.tokens and sum(len(b["drafts"]) for b in blocks) == res.forwards
    assert [t for b in blocks for t in b["fixed_point"]] == res.tokens
    assert viz.main(["--load", ckpt, "--prompt", "def add(a, b):", "--block-size", "4", "--max-new-tokens", "10",
                     "--out", str(tmp_path / "live")]) == 0
    html = open(tmp_path / "live.html").read()
    assert html.count("<tr class='iter'") == res.forwards
    assert open(tmp_path / "live.png", "rb").read(8) == b"\x89PNG\r\n\x1a\n"

    # shard: a hand-made record whose labels are known
    T = lambda rows: torch.tensor(rows, dtype=torch.int64)  # noqa: E731
    rec = TrajectoryRecord("s0", T([5, 6, 7]), [
        BlockTrajectory(3, T([[9, 9, 9, 9, 9], [1, 9, 3, 4, 5], [1, 2, 3, 4, 5]]), T([1, 2, 3, 4, 5])),
        BlockTrajectory(8, T([[8, 6, 8], [6, 6, 8]]), T([6, 6, 8])),
    ], block_size=5)
    with TrajectoryShardWriter(str(tmp_path / "shards"), prefix="t") as w:
        w.write(rec)
    shard = os.path.join(tmp_path, "shards", sorted(os.listdir(tmp_path / "shards"))[0])
    assert viz.main(["--shard", shard, "--index", "0", "--out", str(tmp_path / "rec")]) == 0
    html = open(tmp_path / "rec.html").read()
    assert html.count("<tr class='iter'") == 5
    rows = trajectory_view.trajectory_rows(trajectory_view.blocks_from_record(rec))
    assert rows[1]["labels"] == ["accepted", "unconverged", "stationary", "stationary", "stationary"]
    assert rows[0]["labels"] == ["unconverged"] * 5
    assert rows[3]["labels"] == ["unconverged", "match", "match"]  # a run of 2 is not highlighted
    assert rows[2]["labels"] == ["accepted"] * 5
    assert html.count("tok stationary") == 3
    assert viz.main(["--shard", shard, "--index", "3", "--out", str(tmp_path / "x")]) == 2


def test_search_writes_best_config(ckpt, tmp_path):
    search = _tool("search_inference_config")
    out = tmp_path / "search"
    assert search.main(["--load", ckpt, "--benchmark", "gsm8k", "--limit", "1", "--decoder", "mr",
                        "--block-sizes", "2,4", "--verification-sizes", "1,2", "--num-blocks", "1",
                        "--draft-init", "repeat", "--max-new-tokens", "12", "--out", str(out), "--no-progress"]) == 0
    res = json.load(open(out / "search.json"))
    pts = res["points"]
    assert sorted((p["block_size"], p["verification_size"]) for p in pts) == [(2, 1), (2, 2), (4, 1), (4, 2)]
    assert res["best"] == max(pts, key=lambda p: (p["tps"], p["tpf"]))
    assert res["lossless"] and res["ar"]["tpf"] == 1.0
    tpf = {(p["block_size"], p["verification_size"]): p["tpf"] for p in pts}
    assert tpf[(4, 1)] > tpf[(2, 1)] > 1.0  # a longer exact draft accepts more per forward
    assert res["fit"]["terms"] == ["1", "x", "v", "xv"] and res["fit"]["r2"] == pytest.approx(1.0)
    assert open(out / "surface.png", "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    from megatron_jf.eval.search import fit_quadratic_surface

    assert fit_quadratic_surface([(0, 0, 1.0)]) == {"terms": ["1"], "coef": [1.0], "r2": 1.0}


def test_evaluate_bf16_lossless_in_its_precision_and_keyed_apart(ckpt, tmp_path, monkeypatch, capsys):
    """``--bf16``: bf16 weights, the decoder equal to AR in bf16; its results never resume into an fp32 run's file;
    refused in one line on a CPU without native bf16."""
    from megatron_jf.platform import HAVE_CUDA
    from megatron_jf.precision import CPU_BF16_ENV

    ev = _tool("evaluate")
    out = tmp_path / "out"
    monkeypatch.setenv(CPU_BF16_ENV, "1")
    assert ev.main(_eval_args(ckpt, out, "gsm8k", "--bf16")) == 0
    s = json.load(open(out / "gsm8k_jacobi.summary.json"))
    assert s["lossless"] == {"checked": 2, "identical": 2, "mismatched": [], "near_ties": []} and s["decoder"]["tpf"] > 1.5
    assert ev.main(_eval_args(ckpt, out, "gsm8k")) == 2  # fp32 into the bf16 run's file: another configuration
    assert "another configuration" in capsys.readouterr().err
    if not HAVE_CUDA:
        monkeypatch.setenv(CPU_BF16_ENV, "0")
        assert ev.main(_eval_args(ckpt, tmp_path / "o2", "gsm8k", "--bf16")) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith("evaluate: error: --bf16 on CPU needs native bf16"), err
