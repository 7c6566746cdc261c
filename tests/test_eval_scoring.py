"""Scoring dispatch, aggregation and resumable result files (megatron_jf.eval.scoring)."""

import json
import os

import pytest

from megatron_jf.eval.benchmarks import Problem, load_benchmark
from megatron_jf.eval.prompts import prompt_info
from tests.sandbox_marks import needs_os
from megatron_jf.eval.scoring import (
    ResultsWriter,
    Score,
    aggregate,
    make_record,
    read_jsonl,
    score,
    score_many,
    write_jsonl_atomic,
)


@pytest.fixture(scope="module")
def mixed():
    return (
        load_benchmark("humaneval", limit=2)
        + load_benchmark("mbpp", limit=2)
        + load_benchmark("gsm8k", limit=2)
        + load_benchmark("math500", limit=2)
    )


def _right(p):
    if p.benchmark == "humaneval":
        return f"```python\n{p.prompt}{p.reference}```"
    if p.benchmark == "mbpp":
        return f"Here you go:\n```python\n{p.reference}\n```"
    return f"Reasoning...\nSo the final answer is $\\boxed{{{p.answer}}}$."


def _wrong(p):
    if p.benchmark == "humaneval":
        return "    return None\n"
    if p.benchmark == "mbpp":
        return "```python\ndef nothing():\n    pass\n```"
    return "Reasoning...\nSo the final answer is $\\boxed{-12345}$."


@needs_os
def test_score_dispatch_right_and_wrong(mixed):
    for p in mixed:
        good = score(p, _right(p))
        bad = score(p, _wrong(p))
        assert good.correct and good.status == "passed", (p.task_id, good)
        assert not bad.correct and bad.status == "failed", (p.task_id, bad)
        assert good.task_id == p.task_id and good.benchmark == p.benchmark
    g = score(mixed[4], "The answer is 18.")
    assert g.correct and g.predicted == "18" and g.gold == "18"
    assert score(mixed[4], None).message == "no answer found in the completion"
    with pytest.raises(TypeError, match="completion must be str"):
        score(mixed[4], 18)


@needs_os
def test_score_many_and_aggregate(mixed):
    comps = [_right(p) if i % 2 == 0 else _wrong(p) for i, p in enumerate(mixed)]
    comps[3] = 12345  # a bad completion type must not stop the batch
    scores = score_many(mixed, comps, workers=2)
    assert [s.task_id for s in scores] == [p.task_id for p in mixed]
    assert [s.correct for s in scores] == [True, False, True, False, True, False, True, False]
    assert scores[3].status == "error" and "TypeError" in scores[3].message
    agg = aggregate(scores)
    assert agg["humaneval"] == {"n": 2, "correct": 1, "accuracy": 0.5, "metric": "pass@1",
                                "status_counts": {"passed": 1, "failed": 1}}
    assert agg["mbpp"]["status_counts"] == {"passed": 1, "error": 1}
    assert agg["gsm8k"]["metric"] == "accuracy" and agg["gsm8k"]["accuracy"] == 0.5
    assert agg["all"]["n"] == 8 and agg["all"]["correct"] == 4
    with pytest.raises(ValueError, match="2 problems but 1 completions"):
        score_many(mixed[:2], ["x"])


@needs_os
def test_records_and_resume(tmp_path, mixed):
    path = str(tmp_path / "out" / "results.jsonl")
    probs = mixed[4:8]
    meta = prompt_info()
    with ResultsWriter(path, flush_every=1) as w:
        assert w.pending(probs) == probs
        for p in probs[:2]:
            c = _right(p)
            assert w.add(make_record(p, c, score(p, c), prompt="PROMPT", prompt_meta=meta, extra={"tpf": 3.5}))
    recs = read_jsonl(path)
    assert [r["task_id"] for r in recs] == [p.task_id for p in probs[:2]]
    assert recs[0]["correct"] is True and recs[0]["tpf"] == 3.5
    assert recs[0]["prompt_meta"]["prompt_set"] == "jf-paper-v1" and len(recs[0]["prompt_sha256"]) == 64
    assert os.listdir(tmp_path / "out") == ["results.jsonl"]  # no temporary files left behind

    w2 = ResultsWriter(path, flush_every=100)
    assert [p.task_id for p in w2.pending(probs)] == [p.task_id for p in probs[2:]]
    p0 = probs[0]
    assert w2.add(make_record(p0, "x", score(p0, "x"))) is False  # already present: skipped
    p2 = probs[2]
    assert w2.add(make_record(p2, "x", score(p2, "x"))) is True
    assert len(read_jsonl(path)) == 2  # not flushed yet
    w2.flush()
    assert [r["task_id"] for r in read_jsonl(path)] == [p.task_id for p in probs[:3]]

    with pytest.raises(ValueError, match="overwrite"):
        make_record(p0, "x", score(p0, "x"), extra={"correct": True})
    with pytest.raises(ValueError, match="score is for"):
        make_record(p0, "x", score(p2, "x"))


def test_writer_flushes_on_exception(tmp_path):
    path = str(tmp_path / "r.jsonl")
    p = Problem(task_id="q1", benchmark="gsm8k", prompt="1+1?", answer="2")
    with pytest.raises(RuntimeError):
        with ResultsWriter(path, flush_every=50) as w:
            w.add(make_record(p, "2", score(p, "2")))
            raise RuntimeError("generation crashed")
    assert [r["task_id"] for r in read_jsonl(path)] == ["q1"]


def test_read_jsonl_truncated_and_corrupt(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps({"task_id": "a"}) + "\n" + '{"task_id": "b", "comp')
    with pytest.warns(RuntimeWarning, match="truncated last line"):
        assert [r["task_id"] for r in read_jsonl(str(path))] == ["a"]
    path.write_text('{"task_id": "a"}\n[1, 2]\n{"task_id": "c"}\n')
    with pytest.raises(ValueError, match=r"r.jsonl:2"):
        read_jsonl(str(path))
    assert read_jsonl(str(tmp_path / "missing.jsonl")) == []


def test_atomic_write_keeps_old_file_on_error(tmp_path):
    path = str(tmp_path / "r.jsonl")
    write_jsonl_atomic(path, [{"task_id": "a"}])
    with pytest.raises(TypeError):
        write_jsonl_atomic(path, [{"task_id": "b"}, {"task_id": object()}])
    assert read_jsonl(path) == [{"task_id": "a"}]
    assert os.listdir(tmp_path) == ["r.jsonl"]


def test_score_to_dict_roundtrip():
    s = Score("t", "gsm8k", True, "passed", "m", "1", "1", 0.0)
    assert json.loads(json.dumps(s.to_dict()))["correct"] is True
