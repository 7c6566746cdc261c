#!/usr/bin/env python
"""Time cost of isolated, split-verdict scoring: seconds per problem before and after, per benchmark.

"Before" is the evaluation package as it was at ``--before`` (default ``3239e60``: the program and its tests in one
``python -I`` subprocess with an audit hook, the in-process verdict, math under a 3 s wall-clock guard), loaded
from git into a temporary package; "after" is the working tree (bubblewrap namespaces as an unprivileged uid,
candidate behind a proxy, comparison in the evaluator; math under a CPU-time limit with math-verify's LaTeX
extraction). Both score the reference solutions of the first ``--n`` problems of each benchmark, one problem
at a time, alternating before/after in chunks so that machine load drifts affect both alike; the figures are
ratios measured in one run. Also prints how many reference solutions pass (should be all)::

    OMP_NUM_THREADS=1 python -m bench.eval_isolation --n 40
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
import tempfile
import time

from bench.common import REPO


def load_old_package(rev: str, tmp: str):
    """Import ``megatron_jf/eval`` as it was at ``rev`` under the name ``old_jf_eval``."""
    names = subprocess.run(["git", "-C", REPO, "ls-tree", "--name-only", f"{rev}:megatron_jf/eval"],
                           capture_output=True, text=True, check=True).stdout.split()
    pkg = os.path.join(tmp, "old_jf_eval")
    os.makedirs(pkg)
    for n in names:
        if n.endswith(".py"):
            src = subprocess.run(["git", "-C", REPO, "show", f"{rev}:megatron_jf/eval/{n}"], capture_output=True,
                                 text=True, check=True).stdout
            with open(os.path.join(pkg, n), "w") as f:
                f.write(src)
    spec = importlib.util.spec_from_file_location("old_jf_eval", os.path.join(pkg, "__init__.py"),
                                                  submodule_search_locations=[pkg])
    sys.modules["old_jf_eval"] = module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return importlib.import_module("old_jf_eval.scoring")


def build_parser():
    """The command line (torch-free)."""
    from megatron_jf import cli

    from bench import common

    ap = common.parser(__doc__)
    ap.add_argument("--n", type=cli.positive_int, default=40, help="problems per benchmark")
    ap.add_argument("--before", default="3239e60", help="git revision of the 'before' evaluation package")
    ap.add_argument("--chunk", type=cli.positive_int, default=5, help="problems per alternation")
    ap.add_argument("--benchmarks", default="humaneval,mbpp,gsm8k,math500", help="benchmarks, comma-separated")
    return ap


def main(argv=None) -> None:
    a = build_parser().parse_args(argv)

    from megatron_jf.eval import scoring as new
    from megatron_jf.eval.benchmarks import load_benchmark
    from megatron_jf.eval.sandbox import isolation_status, sandbox_python

    why = isolation_status()
    print(f"isolation: {'bubblewrap namespaces, sandbox python ' + sandbox_python() if why is None else why}")
    if why is None:  # start-up of one empty sandbox, namespaces vs plain subprocess, alternating
        from megatron_jf.eval.code_exec import run_program

        t = {"os": 0.0, "none": 0.0}
        for _ in range(10):
            for iso in t:
                t0 = time.perf_counter()
                assert run_program("pass", isolation=iso).passed
                t[iso] += time.perf_counter() - t0
        print(f"empty program: {t['none'] / 10:.3f} s plain subprocess, {t['os'] / 10:.3f} s in bubblewrap "
              f"namespaces ({t['os'] / t['none']:.2f}x)")
    with tempfile.TemporaryDirectory() as tmp:
        old = load_old_package(a.before, tmp)
        print("| benchmark | n | before s/problem | after s/problem | after / before | before correct "
              "| after correct |")
        print("|---|---|---|---|---|---|---|")
        for bench in a.benchmarks.split(","):
            probs = load_benchmark(bench, limit=a.n)
            refs = [p.reference or p.answer for p in probs]  # GSM8K/MATH: the worked solution ("#### N", \boxed)
            for mod in (old, new):  # warm-up (imports, first sandbox), not timed
                mod.score(probs[0] if mod is new else _as_old(probs[0], old), refs[0], timeout_s=60)
            t = {"before": 0.0, "after": 0.0}
            ok = {"before": 0, "after": 0}
            for i in range(0, len(probs), a.chunk):
                for name, mod in (("before", old), ("after", new)):
                    for p, r in zip(probs[i:i + a.chunk], refs[i:i + a.chunk]):
                        p_mod = p if mod is new else _as_old(p, old)
                        t0 = time.perf_counter()
                        s = mod.score(p_mod, r, timeout_s=60)
                        t[name] += time.perf_counter() - t0
                        ok[name] += bool(s.correct)
            n = len(probs)
            print(f"| {bench} | {n} | {t['before'] / n:.3f} | {t['after'] / n:.3f} | "
                  f"{t['after'] / max(t['before'], 1e-9):.2f} | {ok['before']}/{n} | {ok['after']}/{n} |")


def _as_old(p, old_scoring):
    """The same problem as an ``old_jf_eval.benchmarks.Problem`` (the old package has its own class)."""
    from dataclasses import asdict

    mod = sys.modules["old_jf_eval.benchmarks"]
    return mod.Problem(**asdict(p))


if __name__ == "__main__":
    main()
