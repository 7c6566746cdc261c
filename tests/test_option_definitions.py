"""Every command-line option concept has one definition: across the parsers of every tool, bench, recipe and
``pretrain_jf.py``, the actions that set the same ``dest`` were all made from one definition object -- a shared
:class:`megatron_jf.cli.Option`, a dataclass field (``add_dataclass_arguments``), or one shared ``add_*`` function --
so a flag's spelling, type and meaning cannot drift between commands."""

from __future__ import annotations

import argparse
import importlib
import os
from collections import defaultdict

import pytest

from tests.conftest import load_tool

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _modules(folder: str) -> list[str]:
    out = []
    for d, dirs, files in os.walk(os.path.join(REPO, folder)):
        dirs[:] = [x for x in dirs if x != "__pycache__"]
        rel = os.path.relpath(d, REPO).replace(os.sep, ".")
        out += [f"{rel}.{f[:-3]}" for f in files if f.endswith(".py") and f != "__init__.py"]
    return sorted(out)


def all_parsers() -> dict[str, argparse.ArgumentParser]:
    """``{command: parser}`` of every entry point (each module's ``build_parser()``)."""
    from megatron_jf.training.config import build_parser as pretrain_parser

    parsers = {"pretrain_jf.py": pretrain_parser()}
    for name in sorted(os.listdir(os.path.join(REPO, "tools"))):
        if name.endswith(".py"):
            parsers[f"tools/{name}"] = load_tool(name[:-3], "_options").build_parser()
    for mod in _modules("bench") + ["recipes.quickstart.cli", "recipes.quickstart.sweep"]:
        m = importlib.import_module(mod)
        if hasattr(m, "main") or hasattr(m, "build_parser"):
            assert hasattr(m, "build_parser"), f"{mod} has a main() but no build_parser()"
            parsers[mod] = m.build_parser()
    return parsers


def definitions(parsers) -> dict[str, dict[int, tuple]]:
    """``dest -> {id(definition): (definition, [(command, option strings), ...])}`` over every optional action;
    an action made by hand (no ``definition`` mark) is its own definition."""
    out: dict[str, dict[int, tuple]] = defaultdict(dict)

    def walk(cmd, p):
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):  # sub-commands: their options count too
                for name, sub in a.choices.items():
                    walk(f"{cmd} {name}", sub)
            if isinstance(a, argparse._HelpAction) or not a.option_strings:
                continue
            d = getattr(a, "definition", a)
            out[a.dest].setdefault(id(d), (d, []))[1].append((cmd, tuple(a.option_strings)))

    for cmd, p in parsers.items():
        walk(cmd, p)
    return out


def test_a_hand_written_duplicate_is_found():
    p1, p2 = argparse.ArgumentParser(), argparse.ArgumentParser()
    p1.add_argument("--threads", type=int)
    p2.add_argument("--threads", type=int)
    assert len(definitions({"a": p1, "b": p2})["threads"]) == 2
    from megatron_jf import cli

    q1, q2 = argparse.ArgumentParser(), argparse.ArgumentParser()
    cli.add_threads_arg(q1)
    cli.THREADS.add(q2, help="this tool's words")
    assert len(definitions({"a": q1, "b": q2})["threads"]) == 1
    r = argparse.ArgumentParser()
    sub = r.add_subparsers()
    sub.add_parser("x").add_argument("--overwrite", action="store_true")
    sub.add_parser("y").add_argument("--overwrite", action="store_true")
    assert len(definitions({"r": r})["overwrite"]) == 2  # sub-commands are searched too


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_every_option_concept_has_one_definition():
    parsers = all_parsers()
    assert len(parsers) >= 20
    clashes = {dest: sorted({c for _, uses in defs.values() for c in uses})
               for dest, defs in definitions(parsers).items() if len(defs) > 1}
    assert clashes == {}
