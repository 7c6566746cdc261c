"""The commands package (megatron_jf/commands): the ``jf`` dispatcher, the installed console script, the thin
``tools/*.py`` files, and one exit status per kind of fault (:func:`megatron_jf.commands.run`)."""

import os
import subprocess
import sys

import pytest

from megatron_jf import commands
from tests.conftest import REPO, TOOL_COMMANDS


def test_run_maps_each_fault_to_its_exit_status(capsys):
    from megatron_jf.eval.harness import LosslessViolation
    from megatron_jf.eval.speed import LosslessError
    from megatron_jf.load_errors import CheckpointNotFound

    def raising(e):
        def body():
            raise e
        return body

    assert commands.run("x", lambda: None) == 0 and commands.run("x", lambda: 5) == 5
    cases = [(commands.InputError("bad flag value"), 2, "x: error: bad flag value"),
             (CheckpointNotFound("checkpoint directory does not exist: /nope"), 2,
              "x: error: checkpoint directory does not exist: /nope"),
             (FileNotFoundError("no such prompt file"), 2, "x: error: no such prompt file"),
             (LosslessViolation("mr differs from AR at prompt 3"), 3,
              "x: LOSSLESS CHECK FAILED: mr differs from AR at prompt 3"),
             (LosslessError("jacobi differs"), 3, "x: LOSSLESS CHECK FAILED: jacobi differs")]
    for err, status, line in cases:
        assert commands.run("x", raising(err)) == status
        assert capsys.readouterr().err.strip() == line
    # an error type the command did not declare as bad input is a bug: it propagates with its traceback
    with pytest.raises(ValueError):
        commands.run("x", raising(ValueError("a bug")))
    assert commands.run("x", raising(ValueError("declared")), (ValueError,)) == 2


def test_jf_dispatches_to_every_command_and_refuses_unknown_ones(capsys):
    assert set(TOOL_COMMANDS.values()) == set(commands.COMMANDS)
    assert commands.main(["nope"]) == 2
    assert "unknown command 'nope'" in capsys.readouterr().err
    assert commands.main([]) == 2 and commands.main(["--help"]) == 0
    assert "commands: convert, generate, collect" in capsys.readouterr().out
    for name in commands.COMMANDS:
        assert commands.main([name, "--help"]) == 0  # every main returns its status, --help included
        assert capsys.readouterr().out.startswith(f"usage: jf {name} ")


def test_tool_files_run_their_command_and_the_console_script_is_installed(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for tool, command in TOOL_COMMANDS.items():
        proc = subprocess.run([sys.executable, os.path.join(REPO, "tools", f"{tool}.py"), "--help"],
                              capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
        assert proc.returncode == 0 and proc.stdout.startswith(f"usage: {tool}.py "), (tool, proc.stderr[-2000:])
    jf = os.path.join(os.path.dirname(sys.executable), "jf")
    if not os.path.exists(jf):
        pytest.skip("the jf console script is not installed in this environment (pip install -e .)")
    proc = subprocess.run([jf, "generate", "--load", str(tmp_path / "nope"), "--prompt", "hi"], capture_output=True,
                          text=True, env=env, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().startswith("jf generate: error: "), proc.stderr[-2000:]
