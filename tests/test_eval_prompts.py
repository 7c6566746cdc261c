"""Prompt construction and chat rendering (megatron_jf.eval.prompts)."""

import pytest

from megatron_jf.eval.benchmarks import Problem, load_benchmark
from megatron_jf.eval.prompts import (
    DEFAULT_PROMPT_SET,
    PROMPT_SETS,
    QWEN25_CHAT_TEMPLATE,
    PromptSet,
    Qwen25ChatFormat,
    build_messages,
    build_raw_prompt,
    get_prompt_set,
    prompt_info,
    render_chat,
    render_prompt,
    stop_sequences,
    text_sha256,
)

# the paper's instruction, typed from the official jacobi_forcing_inference_humaneval.py (not imported from the module
# under test)
PAPER_HUMANEVAL = (
    "Please continue to complete the function. You are not allowed to modify the given code and do the completion "
    "only. Please return all completed function in a codeblock. Here is the given code to do completion:\n"
    "```python\n{prompt}\n```"
)
QWEN_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."


@pytest.fixture(scope="module")
def he0():
    return load_benchmark("humaneval", limit=1)[0]


def test_humaneval_user_turn_is_the_paper_instruction(he0):
    msgs = build_messages(he0)
    assert msgs == [{"role": "user", "content": PAPER_HUMANEVAL.replace("{prompt}", he0.prompt.strip())}]
    bare = build_messages(he0, "jf-mr-bare-fence")[0]["content"]
    assert "\n```\nfrom typing import List" in bare and "```python" not in bare


def test_mbpp_prompt_has_text_and_all_tests():
    p = load_benchmark("mbpp", limit=1)[0]
    (m,) = build_messages(p)
    assert m["content"].startswith(
        "You are an expert Python programmer, and here is your task: Write a python function to remove first"
    )
    assert "Your code should pass these tests:\n\nassert remove_Occ(" in m["content"]
    assert all(t.strip() in m["content"] for t in p.tests)
    raw = build_raw_prompt(p)
    assert raw.endswith("\n[BEGIN]\n") and stop_sequences(p, "raw") == ["[DONE]"]


def test_math_prompts_and_braces_are_safe():
    q = r"Let $f(x)=\frac{1}{x}$ and {question} stays literal. Find $f(2)$."
    p = Problem(task_id="t", benchmark="math500", prompt=q, answer="1/2")
    (m,) = build_messages(p)
    assert m["content"] == q + "\nPlease reason step by step, and put your final answer within \\boxed{}."
    assert build_raw_prompt(p) == f"Problem:\n{q}\n\nSolution:"
    g = load_benchmark("gsm8k", limit=1)[0]
    assert build_messages(g)[0]["content"].startswith("Janet\u2019s ducks lay 16 eggs per day.")
    assert build_messages(g, "jf-ref-gsm8k")[0]["content"] == (
        "Problem: " + g.prompt + "\nMark your solution with \\boxed\nAnswer:"
    )
    assert build_raw_prompt(g).startswith("Question: Janet") and build_raw_prompt(g).endswith("\nAnswer:")


def test_raw_humaneval_is_the_prompt(he0):
    assert build_raw_prompt(he0) == he0.prompt
    assert render_prompt(he0, mode="raw") == he0.prompt
    assert "\ndef" in stop_sequences(he0, "raw") and stop_sequences(he0, "chat") == []


def test_qwen25_format_matches_transformers_jinja(he0):
    """The pure-Python renderer and a real transformers tokenizer carrying QWEN25_CHAT_TEMPLATE agree."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")))
    tok.chat_template = QWEN25_CHAT_TEMPLATE
    fmt = Qwen25ChatFormat()
    cases = [
        build_messages(he0),
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
        [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}],
    ]
    for msgs in cases:
        assert render_chat(msgs, tok) == render_chat(msgs, fmt)
    expected = (
        f"<|im_start|>system\n{QWEN_SYSTEM}<|im_end|>\n<|im_start|>user\n"
        + PAPER_HUMANEVAL.replace("{prompt}", he0.prompt.strip())
        + "<|im_end|>\n<|im_start|>assistant\n"
    )
    assert render_prompt(he0, tok) == expected
    info = prompt_info(mode="chat", tokenizer=tok)
    assert info["chat_template_sha256"] == text_sha256(QWEN25_CHAT_TEMPLATE)


def test_render_errors(he0):
    with pytest.raises(ValueError, match="tokenizer"):
        render_prompt(he0)
    with pytest.raises(TypeError, match="apply_chat_template"):
        render_prompt(he0, object())
    with pytest.raises(ValueError, match="mode"):
        render_prompt(he0, Qwen25ChatFormat(), mode="completion")
    with pytest.raises(ValueError, match="role"):
        render_chat([{"role": "robot", "content": "x"}], Qwen25ChatFormat())
    with pytest.raises(KeyError, match="known"):
        get_prompt_set("nope")


def test_prompt_set_hashes():
    hashes = {name: ps.sha256 for name, ps in PROMPT_SETS.items()}
    assert len(set(hashes.values())) == len(hashes)
    assert PromptSet(name="jf-paper-v1").sha256 == DEFAULT_PROMPT_SET.sha256
    assert PromptSet(name="jf-paper-v1", system="x").sha256 != DEFAULT_PROMPT_SET.sha256
    info = prompt_info()
    assert info["prompt_set"] == "jf-paper-v1" and info["prompt_set_sha256"] == DEFAULT_PROMPT_SET.sha256
    assert info["chat_template_sha256"] is None
    # a system turn in the set is placed first
    sys_set = PromptSet(name="with-system", system="S")
    p = Problem(task_id="g", benchmark="gsm8k", prompt="1+1?", answer="2")
    assert [m["role"] for m in build_messages(p, sys_set)] == ["system", "user"]
