"""Every command in the README's ```bash blocks still runs (issue 25): a renamed or removed flag breaks CI.

Whatever README.md says is read at collection time. Each ``python tools/X.py ...``, ``python pretrain_jf.py ...``
(also under ``torchrun`` / ``python -m torch.distributed.run``) and ``bash examples/X.sh ...`` command is checked
without running the work it describes:

* its arguments are parsed by the entry point's own parser (``build_parser()``: unknown flags and bad values are
  errors), after ``bash examples/...`` is resolved to the commands it would run -- by the script's dry run
  (``DRY_RUN=1``) where it has one, else by running it with a stand-in interpreter that records its argv;
* the entry point answers ``--help`` in a subprocess.

Other commands (``bash scripts/...``, ``curl``, benches) are not the README's tool commands and are skipped.
"""
import functools
import importlib
import os
import re
import shlex
import subprocess
import sys

import pytest

from tests.conftest import load_tool

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(REPO, "README.md")
#: ``bash examples/X.sh`` -> how its commands are found: ``dry-run`` (DRY_RUN=1 prints them), ``stub`` (run with a
#: stand-in $PYTHON that records its argv), or ``("module", name)`` (the script execs ``python -m name "$@"``).
EXAMPLES = {
    "examples/progressive_distillation.sh": "dry-run",
    "examples/train_jf_qwen7b_h200.sh": "dry-run",
    "examples/run_text_server.sh": "stub",
    "examples/quickstart.sh": ("module", "recipes.quickstart"),
}


def readme_commands(text: str) -> list[str]:
    """The command lines of the ```bash blocks (continuations joined, comments and blank lines dropped)."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            if shlex.split(line, comments=True):
                out.append(line.strip())
    return out


def _strip_env(words):
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
        words = words[1:]
    return words


def entry_point(words):
    """``(entry, args)`` of a ``python``/``torchrun``/``bash examples`` command, or None: ``entry`` is a script path
    relative to the repository (``tools/generate.py``, ``examples/quickstart.sh``) or a ``python -m megatron_jf.X``
    module."""
    words = _strip_env(words)
    if not words:
        return None
    exe = os.path.basename(words[0])
    if exe == "bash" and len(words) > 1 and words[1].startswith("examples/"):
        return words[1], words[2:]
    if exe.startswith("python") and len(words) > 2 and words[1] == "-m" and words[2].startswith("megatron_jf."):
        return words[2], words[3:]  # a module of this project with its own build_parser()
    launcher = exe == "torchrun" or (exe.startswith("python") and words[1:3] == ["-m", "torch.distributed.run"])
    if exe.startswith("python") or launcher:
        i = next((i for i, w in enumerate(words) if w.endswith(".py")), None)
        if i is not None and (words[i].startswith("tools/") or words[i] == "pretrain_jf.py"):
            return words[i], words[i + 1:]
    return None


def parser_of(entry: str):
    """The ``argparse`` parser of a Python entry point (a script path, or a ``-m`` module or package)."""
    if entry == "pretrain_jf.py":
        from megatron_jf.training.config import build_parser

        return build_parser()
    if entry.endswith(".py"):
        mod = load_tool(os.path.splitext(os.path.basename(entry))[0], "_readme")
    else:
        mod = importlib.import_module(entry)
        if not hasattr(mod, "build_parser"):  # a package run with -m: its command line is its cli module's
            mod = importlib.import_module(entry + ".cli")
    return mod.build_parser()


STUB = '#!/bin/sh\nprintf "%s\\n" "$*" >> "$RAN"\n'


def example_commands(script: str, args: list[str], tmp_path) -> list[tuple[str, list[str]]]:
    """The ``(entry, args)`` a ``bash examples/...`` command runs (see :data:`EXAMPLES`)."""
    how = EXAMPLES.get(script)
    if how is None:
        pytest.fail(f"README runs {script}, which this test cannot resolve to its commands: add it to EXAMPLES")
    if isinstance(how, tuple):
        return [(how[1], args)]
    env = {k: v for k, v in os.environ.items() if k not in ("DRY_RUN", "PYTHON", "TP", "PP", "NNODES")}
    if how == "dry-run":
        env.update(DRY_RUN="1", WORK=str(tmp_path / "work"))
        if script.endswith("progressive_distillation.sh"):
            args = args[:2] + [str(tmp_path / "work")] + args[3:]  # its work directory is an argument
        proc = subprocess.run(["bash", script, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        lines = [shlex.split(x[2:]) for x in proc.stdout.splitlines() if x.startswith("+ ")]
    else:
        stub = tmp_path / "python"
        stub.write_text(STUB)
        stub.chmod(0o755)
        env.update(PYTHON=str(stub), RAN=str(tmp_path / "ran.txt"))
        proc = subprocess.run(["bash", script, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        lines = [[str(stub), *shlex.split(x)] for x in (tmp_path / "ran.txt").read_text().splitlines()]
    found = []
    for words in lines:
        i = next(i for i, w in enumerate(words) if w.endswith(".py"))
        found.append((os.path.relpath(os.path.join(REPO, words[i]), REPO), words[i + 1:]))
    assert found, f"{script} {args}: no command found"
    return found


COMMANDS = [c for c in readme_commands(open(README).read()) if entry_point(shlex.split(c, comments=True))]


def test_the_readme_has_tool_commands():
    assert COMMANDS, "no python tools/... / pretrain_jf.py / bash examples/... command found in README.md's bash blocks"


@functools.lru_cache(maxsize=None)
def help_output(entry: str) -> tuple[int, str, str]:
    """``(status, stdout, stderr)`` of ``python ENTRY --help`` (``-m`` for a module), once per entry point."""
    cmd = [sys.executable, entry, "--help"] if entry.endswith(".py") else [sys.executable, "-m", entry, "--help"]
    proc = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO), capture_output=True, text=True,
                          timeout=600)
    return proc.returncode, proc.stdout, proc.stderr


@pytest.mark.parametrize("line", COMMANDS, ids=[c[:60] for c in COMMANDS])
def test_readme_command_parses_and_its_entry_point_answers_help(line, tmp_path, capsys):
    entry, args = entry_point(shlex.split(line, comments=True))
    runs = example_commands(entry, args, tmp_path) if entry.endswith(".sh") else [(entry, args)]
    for script, argv in runs:
        try:
            parser_of(script).parse_args(argv)
        except SystemExit as e:
            pytest.fail(f"README: {line}\n-> {script} {shlex.join(argv)}\n{capsys.readouterr().err}(exit {e.code})")
        rc, out, err = help_output(script)
        assert rc == 0 and out.startswith("usage:"), f"{script} --help: exit {rc}\n{err[-2000:]}"
