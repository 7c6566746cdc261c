"""Server command line (issue 15): vLLM spellings of the flags and every flag's default in --help."""
import os
import re
import subprocess
import sys

from megatron_jf.commands.serve import build_parser

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_vllm_flag_aliases():
    parse_args = build_parser().parse_args
    a = parse_args(["--load", "/ck", "--tensor-parallel-size", "2", "--served-model-name", "m", "--max-model-len",
                    "1024", "--max-num-seqs", "7"])
    b = parse_args(["--load", "/ck", "--tp", "2", "--model-name", "m", "--max-batch", "7"])
    assert (a.tp, a.model_name, a.max_batch, a.max_model_len) == (2, "m", 7, 1024)
    assert (b.tp, b.model_name, b.max_batch, b.max_model_len) == (2, "m", 7, None)


def test_help_shows_every_default():
    import argparse

    p = build_parser()
    fmt = p._get_formatter()
    flags = [a for a in p._actions if a.dest != "help"]
    assert len(flags) >= 20
    missing = [a.option_strings[0] for a in flags if "%(default)" not in fmt._get_help_string(a)]
    assert not missing, missing
    out = subprocess.run([sys.executable, os.path.join(REPO, "tools", "run_text_generation_server.py"), "--help"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    for want in ("(default: 2097152)", "(default: 512)", "--tensor-parallel-size", "--max-num-seqs"):
        assert want in text
    assert argparse.ArgumentDefaultsHelpFormatter in type(fmt).__mro__
