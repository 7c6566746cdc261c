"""Tool command lines: one message for a Hugging Face folder given as ``--load`` (every tool), Megatron-LM flag
aliases, and help that shows every default (issue 13, "Flags users already know", "One message for one mistake").

The HF folder is a real tiny ``save_pretrained`` output (:func:`megatron_jf.models.zoo.save_tiny_hf`).
"""
import argparse
import os
import subprocess
import sys

import pytest

from tests.conftest import load_tool

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONVERT_CMD = "python tools/convert_hf.py hf-to-mcore --hf"


def _tool(name):
    return load_tool(name)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from megatron_jf.models.zoo import save_tiny_hf

    return save_tiny_hf(str(tmp_path_factory.mktemp("hfload") / "tiny-qwen2"))


@pytest.fixture(scope="module")
def message(hf_dir):
    from megatron_jf.load_errors import hf_dir_message

    msg = hf_dir_message(hf_dir)
    assert f"{CONVERT_CMD} {hf_dir} --out {hf_dir}-mcore" in msg and "Hugging Face" in msg
    return msg


def test_generate(hf_dir, message, capsys):
    assert _tool("generate").main(["--load", hf_dir, "--prompt", "hi"]) == 2
    assert capsys.readouterr().err.strip() == f"generate: error: {message}"


def test_evaluate(hf_dir, message, tmp_path, capsys):
    assert _tool("evaluate").main(["--load", hf_dir, "--benchmark", "gsm8k", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == f"evaluate: error: {message}"


def test_generate_trajectories(hf_dir, message, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt_ids": [1, 2, 3]}\n')
    assert _tool("generate_trajectories").main(["--prompts", str(prompts), "--load", hf_dir, "--out",
                                                str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err.strip() == f"generate_trajectories: error: {message}"
    assert not (tmp_path / "o").exists()  # rejected before any output is prepared


def test_search_inference_config(hf_dir, message, tmp_path, capsys):
    assert _tool("search_inference_config").main(["--load", hf_dir, "--out", str(tmp_path / "s")]) == 2
    assert capsys.readouterr().err.strip() == f"search_inference_config: error: {message}"


def test_visualize_trajectory(hf_dir, message, tmp_path, capsys):
    assert _tool("visualize_trajectory").main(["--load", hf_dir, "--prompt", "x", "--out", str(tmp_path / "v")]) == 2
    assert capsys.readouterr().err.strip() == f"visualize_trajectory: error: {message}"


def test_server(hf_dir, message, capsys):
    assert _tool("run_text_generation_server").main(["--load", hf_dir]) == 2
    assert capsys.readouterr().err.strip() == f"run_text_generation_server: error: {message}"


def test_convert_mcore_to_hf(hf_dir, message, tmp_path, capsys):
    assert _tool("convert_hf").main(["mcore-to-hf", "--load", hf_dir, "--out", str(tmp_path / "x")]) == 2
    assert capsys.readouterr().err.strip() == f"convert_hf: error: {message}"


def test_pretrain(hf_dir, message, tmp_path):
    # a subprocess: pretrain_jf.main() tears down the process group this test session shares
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, os.path.join(REPO, "pretrain_jf.py"), "--load", hf_dir, "--data",
                           str(tmp_path / "d"), "--train-steps", "1", "--block-size", "4", "--save",
                           str(tmp_path / "s")], capture_output=True, text=True, env=env, timeout=300, cwd=REPO)
    assert proc.returncode == 2, proc.stderr
    assert f"pretrain_jf.py: error: {message}" in proc.stderr.splitlines()  # torch may log other lines


def test_megatron_checkpoint_is_not_called_hf(tmp_path, hf_dir):
    """A megatron checkpoint that happens to hold a config.json, and an HF folder's parent, are not HF folders."""
    from megatron_jf.load_errors import is_hf_model_dir, reject_hf_dir

    ck = tmp_path / "ckpt"
    (ck / "iter_0000003").mkdir(parents=True)
    (ck / "config.json").write_text("{}")
    assert not is_hf_model_dir(str(ck))
    (ck / "latest_checkpointed_iteration.txt").write_text("3")
    reject_hf_dir(str(ck))  # no error
    assert not is_hf_model_dir(os.path.dirname(hf_dir)) and not is_hf_model_dir(str(tmp_path / "missing"))
    assert is_hf_model_dir(hf_dir)
    reject_hf_dir(None)


# ---- flags users already know


INFERENCE_TOOLS = ("generate", "evaluate", "generate_trajectories", "search_inference_config")
REQUIRED = {"generate": ["--load", "x"], "evaluate": ["--load", "x"], "search_inference_config": ["--load", "x"],
            "generate_trajectories": ["--load", "x", "--prompts", "p", "--out", "o"]}


def _parser(name):
    mod = _tool(name)
    return mod.build_parser()


@pytest.mark.parametrize("name", INFERENCE_TOOLS)
def test_every_flag_has_help_showing_its_default(name):
    from megatron_jf.cli import HelpFormatter

    p = _parser(name)
    fmt = HelpFormatter(prog=name)
    for action in p._actions:
        if not action.option_strings or action.dest == "help":
            continue
        assert action.help, f"{name} {action.option_strings} has no help"
        text = fmt._get_help_string(action)
        assert "default" in text or "required" in text, f"{name} {action.option_strings}: {text!r}"
    assert "(default: " in p.format_help()


def test_a_help_that_mentions_the_word_default_still_shows_the_flags_default():
    """Only a help that states its default (``default: ...``) is left as written: one that merely says "the default
    quickstart" (--group-by-length's) lost its ``(default: off)`` and failed CI."""
    from megatron_jf.cli import HelpFormatter

    p = argparse.ArgumentParser(formatter_class=HelpFormatter)
    p.add_argument("--grouped", action=argparse.BooleanOptionalAction, default=False,
                   help="padding was 1.56x on the default quickstart")
    p.add_argument("--rows", type=int, default=3, help="rows per step; default: one per rank")
    text = " ".join(p.format_help().split())
    assert "default quickstart (default: off)" in text
    assert "default: one per rank" in text and "(default: 3)" not in text


@pytest.mark.parametrize("name,megatron,ours", [
    ("generate", ["--tensor-model-parallel-size", "2"], ["--tp", "2"]),
    ("generate", ["--num-tokens-to-generate", "7"], ["--max-new-tokens", "7"]),
    ("generate", ["--top_k", "5", "--top_p", "0.5"], ["--top-k", "5", "--top-p", "0.5"]),
    ("generate", ["--tokenizer-model", "t"], ["--tokenizer", "t"]),
    ("generate", ["--pipeline-model-parallel-size", "1", "--bf16"], ["--bf16"]),
    ("evaluate", ["--tensor-model-parallel-size", "2", "--micro-batch-size", "4"], ["--tp", "2", "--batch-size", "4"]),
    ("evaluate", ["--num-tokens-to-generate", "9", "--tokenizer-model", "t"], ["--max-new-tokens", "9", "--tokenizer", "t"]),
    ("generate_trajectories", ["--tensor-model-parallel-size", "2", "--micro-batch-size", "3", "--bf16"],
     ["--tp", "2", "--batch-size", "3", "--bf16"]),
    ("generate_trajectories", ["--num-tokens-to-generate", "64"], ["--max-new-tokens", "64"]),
    ("search_inference_config", ["--micro-batch-size", "2", "--num-tokens-to-generate", "5"],
     ["--batch-size", "2", "--max-new-tokens", "5"]),
])
def test_megatron_lm_spellings_are_aliases(name, megatron, ours):
    p = _parser(name)
    got, want = p.parse_args(REQUIRED[name] + megatron), p.parse_args(REQUIRED[name] + ours)
    assert vars(got) == vars(want)
    assert vars(got) != vars(p.parse_args(REQUIRED[name]))  # the alias changed something


@pytest.mark.parametrize("name", ("generate", "evaluate", "generate_trajectories"))
def test_pipeline_parallel_other_than_one_is_a_named_error(name, capsys):
    with pytest.raises(SystemExit):
        _parser(name).parse_args(REQUIRED[name] + ["--pipeline-model-parallel-size", "2"])
    assert "inference tools run pipeline-parallel size 1" in capsys.readouterr().err


def test_precision_switches_map_to_dtypes(monkeypatch):
    import torch

    from megatron_jf.cli import params_dtype
    from megatron_jf.platform import default_dtype
    from megatron_jf.precision import CPU_BF16_ENV

    monkeypatch.setenv(CPU_BF16_ENV, "1")  # --bf16 on any CPU (refused without native bf16: test below)

    p = _parser("generate")
    assert params_dtype(p.parse_args(["--load", "x", "--bf16"]).params_dtype) is torch.bfloat16
    assert params_dtype(p.parse_args(["--load", "x", "--fp16"]).params_dtype) is torch.float16
    assert params_dtype(p.parse_args(["--load", "x"]).params_dtype) is default_dtype()
    with pytest.raises(SystemExit):
        p.parse_args(["--load", "x", "--bf16", "--fp16"])


@pytest.mark.parametrize("name", ("generate", "evaluate", "generate_trajectories", "run_text_generation_server"))
def test_bf16_help_says_outputs_differ_and_cpu_without_bf16_is_refused(name, monkeypatch):
    import torch

    from megatron_jf.cli import params_dtype
    from megatron_jf.platform import HAVE_CUDA
    from megatron_jf.precision import CPU_BF16_ENV

    p = _parser(name)
    help_text = " ".join(p.format_help().split())
    assert "bf16 outputs differ from fp32 outputs" in help_text and "AVX-512 BF16" in help_text
    name_ = p.parse_args(REQUIRED.get(name, ["--load", "x"]) + ["--bf16"]).params_dtype
    monkeypatch.setenv(CPU_BF16_ENV, "0")
    if HAVE_CUDA:
        assert params_dtype(name_) is torch.bfloat16
    else:
        with pytest.raises(ValueError, match="--bf16 on CPU needs native bf16"):
            params_dtype(name_)

