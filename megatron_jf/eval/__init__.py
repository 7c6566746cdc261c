"""Accuracy evaluation for Jacobi Forcing (arXiv 2512.14681, Tables 1-3: accuracy next to TPF/TPS).

Modules:

* :mod:`.benchmarks` - offline loaders for HumanEval, MBPP, GSM8K, MATH, MATH-500 and local JSONL files.
* :mod:`.prompts` - the paper's prompts, chat-template rendering, prompt-set hashes.
* :mod:`.code_exec` - code extraction and sandboxed subprocess execution (pass@1).
* :mod:`.sandbox` - OS isolation of generated code (bubblewrap namespaces, unprivileged uid).
* :mod:`.verdict` - HumanEval/MBPP checks run outside the sandbox against the candidate's returned values.
* :mod:`.math_grading` - final-answer extraction, normalisation and equivalence (CPU-time limited).
* :mod:`.degenerate` - flags for degenerate output (one repeated token) next to TPF and speedup.
* :mod:`.scoring` - per-benchmark scoring, aggregation, resumable JSONL results.
* :mod:`.speed` - the one measurement loop: AR and decoders on the same prompts, lossless check, TPF, speedup
  against the faster AR (:mod:`.hf_baseline`: ``transformers`` greedy on the same weights).

Nothing here imports torch or downloads data.
"""

from .benchmarks import BENCHMARKS, MissingBenchmarkPackage, Problem, load_benchmark, load_jsonl_problems
from .code_exec import ExecResult, extract_code, run_program, run_programs
from .math_grading import answers_equivalent, extract_answer, grade_gsm8k, grade_math
from .prompts import build_messages, build_raw_prompt, prompt_info, render_chat, render_prompt
from .scoring import ResultsWriter, Score, aggregate, make_record, score, score_many

__all__ = [
    "BENCHMARKS",
    "ExecResult",
    "MissingBenchmarkPackage",
    "Problem",
    "ResultsWriter",
    "Score",
    "aggregate",
    "answers_equivalent",
    "build_messages",
    "build_raw_prompt",
    "extract_answer",
    "extract_code",
    "grade_gsm8k",
    "grade_math",
    "load_benchmark",
    "load_jsonl_problems",
    "make_record",
    "prompt_info",
    "render_chat",
    "render_prompt",
    "run_program",
    "run_programs",
    "score",
    "score_many",
]
