"""Quiet, readable output (issue 25, "Fast, quiet start-up"): no known third-party deprecation warning reaches a
tool's stderr (each is filtered where it is raised), step lines are not buried in progress-bar updates when both
streams go to one log, and a logged command pastes back as is.
"""
import os
import shlex
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, mp1):
    from megatron_jf.models.zoo import build_tiny_checkpoint

    return build_tiny_checkpoint(str(tmp_path_factory.mktemp("quiet")), max_pos=128, in_process=True)


def test_generate_prints_no_warnings(ckpt):
    """Loading a checkpoint and building the model used to print four deprecation warnings (megatron-core's
    ``cuda_graph_scope`` default, its torch_dist loader's ``load_state_dict``, torch DCP's ShardedTensor, twice)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}  # the warnings a user sees
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tools", "generate.py"), "--load", ckpt, "--prompt",
                           "Hello", "--max-new-tokens", "4", "--decoder", "jacobi", "--block-size", "4"],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Warning" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("[jacobi: 4 tokens")  # only the summary line


def test_step_lines_come_in_order_with_the_progress_bar(tmp_path, monkeypatch):
    """stdout (step lines) and stderr (the bar) into one file, stdout block-buffered as in a pipe or a log: each
    step line is written when it is printed, between the bar updates around it, on a line of its own."""
    from tqdm import tqdm

    from megatron_jf.training.trainer import Trainer

    log = tmp_path / "run.log"
    out = open(log, "a", buffering=1 << 16)
    err = open(log, "a", buffering=1)
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)

    class Run:  # the state Trainer._print reads
        _bar = tqdm(total=3, desc="train", file=err, mininterval=0)

    for step in (1, 2, 3):
        Run._bar.update(1)
        Trainer._print(Run, f"train step {step}/3 | loss 1.0")
    Run._bar.close()
    out.flush()
    err.flush()
    monkeypatch.undo()
    text = log.read_text()
    for step in (1, 2, 3):
        line = next(x for x in text.split("\n") if f"train step {step}/3" in x)
        assert line.split("\r")[-1] == f"train step {step}/3 | loss 1.0"  # a whole line once the bar is cleared
    assert text.index("train step 1/3") < text.index("2/3 [") < text.index("train step 2/3") < text.index("3/3 [")


def test_logged_commands_paste_back(tmp_path):
    """The quickstart logs each command it runs; pasted into a shell, the logged line runs the same argv."""
    from recipes.quickstart.pipeline import Pipeline
    from recipes.quickstart.presets import PRESETS

    lines = []
    pipe = Pipeline(tmp_path / "work", PRESETS["smoke"], log=lines.append)
    prompt = 'def greet(name):\n    return f"hi {name}!"  # $HOME `x`'
    args = ["-c", "import sys; open(sys.argv[-1], 'w').write(repr(sys.argv[1:-1]))", "--prompt", prompt,
            "--block-size", 16.0, tmp_path / "out dir.txt"]
    pipe.run(args, "report")
    logged = lines[-1].split(" $ ", 1)[1]
    argv = shlex.split(logged)
    assert argv == [sys.executable, "-c", args[1], "--prompt", prompt, "--block-size", "16", str(tmp_path / "out dir.txt")]
    assert (tmp_path / "out dir.txt").read_text() == repr(["--prompt", prompt, "--block-size", "16"])
