"""Every bench (``python -m bench.X``) has a torch-free ``build_parser()``, imports no other bench than
``bench/common.py``, and builds no ``Engine`` itself."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: the training benches' parsers are their owner's (moving onto the TrainConfig dataclasses)
BENCHES = ["bench.collect", "bench.decode", "bench.decode_precision", "bench.decode_vs_hf", "bench.eval_isolation",
           "bench.quickstart_variant", "bench.serve", "bench.vllm_decode", "bench.vllm_soak", "bench.gpu.check",
           "bench.gpu.decode_check"]


def _path(mod: str) -> str:
    return os.path.join(REPO, *mod.split(".")) + ".py"


def test_bench_parsers_are_torch_free():
    code = ("import importlib, sys\n"
            f"for m in {BENCHES!r}:\n"
            "    p = importlib.import_module(m).build_parser()\n"
            "    p.format_help()\n"
            "print('torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_benches_import_only_bench_common_and_build_no_engine():
    for mod in BENCHES + ["bench.common"]:
        tree = ast.parse(open(_path(mod)).read())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                if node.module == "bench":
                    assert [a.name for a in node.names] == ["common"], f"{mod} imports another bench"
                else:
                    assert not node.module.startswith("bench.") or node.module == "bench.common", \
                        f"{mod} imports another bench: {node.module}"
                assert not any(a.name.startswith("_") for a in node.names), f"{mod} imports a private name"
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) == "Engine":
                raise AssertionError(f"{mod} builds an Engine (use LLM.from_model / LLM.from_checkpoint)")
