"""Fast start (issue 25): ``--help``, argument errors and a missing ``--load`` are answered before torch (and
megatron-core) are imported, by every tool and ``pretrain_jf.py``.

Each command runs in a subprocess that reports whether ``torch`` was imported when the entry point returned; no
timing (the time is a figure for the report, measured on an idle machine, not a test).
"""
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _imports_torch(argv, tool):
    code = ("import runpy, sys\nsys.argv = [sys.argv[1]] + sys.argv[2:]\n"
            "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\n"
            "except SystemExit as e:\n    print(e.code, file=sys.stderr) if isinstance(e.code, str) else None\n"
            "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')\n")
    env = dict(os.environ, PYTHONPATH=REPO)
    out = subprocess.run([sys.executable, "-c", code, os.path.join(REPO, tool), *argv], capture_output=True,
                         text=True, timeout=300, env=env, cwd=REPO)
    return out.stdout.strip().splitlines()[-1] == "TORCH", out


ENTRY_POINTS = ["pretrain_jf.py", "tools/convert_hf.py", "tools/generate.py", "tools/evaluate.py",
                "tools/run_text_generation_server.py", "tools/search_inference_config.py",
                "tools/generate_trajectories.py", "tools/visualize_trajectory.py"]


@pytest.mark.parametrize("tool", ENTRY_POINTS)
def test_help_and_argument_errors_do_not_import_torch(tool):
    for argv in (["--help"], ["--no-such-flag"]):
        heavy, out = _imports_torch(argv, tool)
        assert not heavy, (tool, argv, out.stderr[-2000:])


@pytest.mark.parametrize("tool,argv", [
    ("pretrain_jf.py", ["--data", "d", "--train-steps", "1", "--block-size", "4"]),
    ("tools/convert_hf.py", ["mcore-to-hf", "--out", "o"]),  # --load goes after the sub-command
    ("tools/generate.py", ["--prompt", "x"]),
    ("tools/generate_trajectories.py", ["--prompts", "p", "--out", "o"]),
    ("tools/run_text_generation_server.py", []),
    ("tools/search_inference_config.py", []),
    ("tools/visualize_trajectory.py", ["--prompt", "x", "--out", "o"]),
    ("tools/evaluate.py", ["--benchmark", "gsm8k"]),
])
def test_missing_load_is_reported_before_torch(tool, argv, tmp_path):
    missing = str(tmp_path / "no-such-ckpt")
    argv = argv[:1] + ["--load", missing] + argv[1:] if tool == "tools/convert_hf.py" else ["--load", missing, *argv]
    heavy, out = _imports_torch(argv, tool)
    assert f"checkpoint directory not found: {missing}" in out.stderr, out.stderr[-2000:]
    assert not heavy, (tool, out.stderr[-2000:])
