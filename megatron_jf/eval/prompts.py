"""Prompt construction for the Jacobi Forcing accuracy benchmarks (paper Tables 1-3).

Chat mode (instruction-tuned models such as Qwen2.5-Coder-7B-Instruct, the paper's base model) builds a list of
chat turns and renders it with the tokenizer's own chat template (:func:`render_chat`); raw mode (base models)
builds plain text to be continued (:func:`build_raw_prompt`).

Prompt texts of the default prompt set ``"jf-paper-v1"`` and their sources:

* **HumanEval** (user turn, verbatim from the reference drivers ``jacobi_forcing_inference_humaneval.py``
  of the official JacobiForcing code): "Please continue to complete the function. You are not allowed to modify the
  given code and do the completion only. Please return all completed function in a codeblock. Here is the given
  code to do completion:\\n```python\\n{prompt}\\n```", where ``{prompt}`` is the HumanEval prompt ``.strip()``-ed as
  in the reference. The reference renders it with the Qwen2.5 template, which adds the default system prompt "You
  are Qwen, created by Alibaba Cloud. You are a helpful assistant." when no system turn is given (so no system turn
  is added here).
* **MBPP** (user turn): the prompt of the MBPP paper (Austin et al., 2021, "Program Synthesis with Large Language
  Models", section 2.2; also the usual zero-shot instruct form, e.g. DeepSeek-Coder's evaluation): "You are an
  expert Python programmer, and here is your task: {text} Your code should pass these tests:\\n\\n{tests}" with the
  three ``assert`` lines of ``test_list``.
* **GSM8K / MATH / MATH-500** (user turn): "{question}\\nPlease reason step by step, and put your final answer within
  \\\\boxed{}." This is the Qwen2.5-Math chain-of-thought instruction (``qwen-boxed`` / ``qwen25-math-cot`` templates in
  QwenLM/Qwen2.5-Math ``evaluation/utils.py``; that repo places the same sentence either after the question in the
  user turn or as the system turn; we use the user turn and keep the model's default system prompt).

Raw mode: HumanEval = the prompt itself (the model continues the function body; Codex stop sequences);
MBPP = the MBPP-paper prompt followed by ``[BEGIN]`` (stop at ``[DONE]``); GSM8K = ``"Question: {q}\\nAnswer:"``;
MATH = Minerva's ``"Problem:\\n{problem}\\n\\nSolution:"`` (Lewkowycz et al., 2022).

Alternative sets: ``"jf-mr-bare-fence"`` reproduces the multi-block/rejection-recycling (MR) and chat-sweep scripts
of the reference, which use the same HumanEval text with a bare ```` ``` ```` fence instead of ```` ```python ````;
``"jf-ref-gsm8k"`` uses the GSM8K user turn of the reference repo's
``reference/jacobi_forcing_inference_gsm8k_greedy_reference.py``: "Problem: {question}\\nMark your solution with
\\\\boxed\\nAnswer:".

Every prompt set has a ``sha256`` over its name and templates; :func:`prompt_info` records it (plus the
tokenizer's chat-template hash) so that saved outputs can be traced to the exact prompts.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass
from typing import Any, Optional, Sequence

from .benchmarks import BENCHMARKS, Problem

__all__ = [
    "DEFAULT_PROMPT_SET",
    "PROMPT_SETS",
    "PromptSet",
    "QWEN25_CHAT_TEMPLATE",
    "QWEN25_DEFAULT_SYSTEM",
    "Qwen25ChatFormat",
    "build_messages",
    "build_raw_prompt",
    "get_prompt_set",
    "prompt_info",
    "render_chat",
    "render_prompt",
    "stop_sequences",
    "text_sha256",
]

HUMANEVAL_INSTRUCTION = (
    "Please continue to complete the function. You are not allowed to modify the given code and do the "
    "completion only. Please return all completed function in a codeblock. Here is the given code to do "
    "completion:\n```python\n{prompt}\n```"
)
MBPP_INSTRUCTION = (
    "You are an expert Python programmer, and here is your task: {text} Your code should pass these tests:\n\n{tests}"
)
MATH_INSTRUCTION = "{question}\nPlease reason step by step, and put your final answer within \\boxed{}."
#: GSM8K user turn of the reference repo's ``reference/jacobi_forcing_inference_gsm8k_greedy_reference.py``
REFERENCE_GSM8K_PROMPT = "Problem: {question}\nMark your solution with \\boxed\nAnswer:"


@dataclass(frozen=True)
class PromptSet:
    """A named, hashable set of prompt templates.

    Placeholders ``{name}`` are filled in one pass (values are never re-scanned, so braces in problem text are
    safe); ``\\boxed{}`` in a template is left alone because it has no name inside the braces.

    Attributes:
        name: identifier recorded with every output.
        humaneval: chat user-turn template, placeholder ``{prompt}``.
        mbpp: chat user-turn template, placeholders ``{text}``, ``{tests}`` (newline-joined asserts).
        gsm8k: chat user-turn template, placeholder ``{question}``.
        math: chat user-turn template for MATH and MATH-500, placeholder ``{question}``.
        system: optional system turn; ``None`` keeps the chat template's default.
        raw_humaneval, raw_mbpp, raw_gsm8k, raw_math: raw-completion templates for base models.
    """

    name: str
    humaneval: str = HUMANEVAL_INSTRUCTION
    mbpp: str = MBPP_INSTRUCTION
    gsm8k: str = MATH_INSTRUCTION
    math: str = MATH_INSTRUCTION
    system: Optional[str] = None
    raw_humaneval: str = "{prompt}"
    raw_mbpp: str = MBPP_INSTRUCTION + "\n[BEGIN]\n"
    raw_gsm8k: str = "Question: {question}\nAnswer:"
    raw_math: str = "Problem:\n{question}\n\nSolution:"

    @property
    def sha256(self) -> str:
        """SHA-256 (hex) of the canonical JSON of all fields."""
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode("utf-8")).hexdigest()


PROMPT_SETS: dict[str, PromptSet] = {
    "jf-paper-v1": PromptSet(name="jf-paper-v1"),
    "jf-mr-bare-fence": PromptSet(
        name="jf-mr-bare-fence", humaneval=HUMANEVAL_INSTRUCTION.replace("```python\n", "```\n")
    ),
    "jf-ref-gsm8k": PromptSet(name="jf-ref-gsm8k", gsm8k=REFERENCE_GSM8K_PROMPT),
}
DEFAULT_PROMPT_SET = PROMPT_SETS["jf-paper-v1"]


def get_prompt_set(name_or_set: "str | PromptSet | None" = None) -> PromptSet:
    """Return a :class:`PromptSet` by name (``None`` gives the default ``"jf-paper-v1"``).

    Raises:
        KeyError: unknown name (the message lists the known names).
    """
    if name_or_set is None:
        return DEFAULT_PROMPT_SET
    if isinstance(name_or_set, PromptSet):
        return name_or_set
    try:
        return PROMPT_SETS[name_or_set]
    except KeyError:
        raise KeyError(f"unknown prompt set {name_or_set!r}; known: {sorted(PROMPT_SETS)}") from None


_PLACEHOLDER_RE = re.compile(r"\{([A-Za-z_]\w*)\}")


def _fill(template: str, **values: str) -> str:
    return _PLACEHOLDER_RE.sub(lambda m: values[m.group(1)] if m.group(1) in values else m.group(0), template)


def _fields(problem: Problem) -> dict[str, str]:
    if problem.benchmark == "humaneval":
        return {"prompt": problem.prompt.strip()}  # the reference driver formats row["prompt"].strip()
    if problem.benchmark == "mbpp":
        return {"text": problem.prompt.strip(), "tests": "\n".join(t.strip() for t in problem.tests)}
    return {"question": problem.prompt.strip()}


def _template(problem: Problem, ps: PromptSet, raw: bool) -> str:
    kind = "math" if problem.benchmark in ("math", "math500") else problem.benchmark
    if kind not in ("humaneval", "mbpp", "gsm8k", "math"):
        raise ValueError(f"problem {problem.task_id!r}: no prompt for benchmark {problem.benchmark!r} ({BENCHMARKS})")
    return getattr(ps, ("raw_" if raw else "") + kind)


def build_messages(problem: Problem, prompt_set: "str | PromptSet | None" = None) -> list[dict[str, str]]:
    """Chat turns for ``problem``: an optional system turn and one user turn.

    Args:
        problem: a :class:`~megatron_jf.eval.benchmarks.Problem`.
        prompt_set: prompt set or its name (default ``"jf-paper-v1"``).

    Returns:
        ``[{"role": "user", "content": ...}]`` (preceded by a system turn if the prompt set has one).

    Raises:
        KeyError: unknown prompt-set name. ValueError: unknown benchmark.
    """
    ps = get_prompt_set(prompt_set)
    msgs = []
    if ps.system is not None:
        msgs.append({"role": "system", "content": ps.system})
    msgs.append({"role": "user", "content": _fill(_template(problem, ps, raw=False), **_fields(problem))})
    return msgs


def build_raw_prompt(problem: Problem, prompt_set: "str | PromptSet | None" = None) -> str:
    """Raw-completion prompt for base models (no chat template).

    HumanEval returns ``problem.prompt`` unchanged (including its trailing newline), so the completion is the
    function body.

    Raises:
        KeyError: unknown prompt-set name. ValueError: unknown benchmark.
    """
    ps = get_prompt_set(prompt_set)
    if problem.benchmark == "humaneval" and ps.raw_humaneval == "{prompt}":
        return problem.prompt
    return _fill(_template(problem, ps, raw=True), **_fields(problem))


def stop_sequences(problem: Problem, mode: str = "chat") -> list[str]:
    """Stop strings for generation.

    Chat mode: ``[]`` (generation ends at the template's end-of-turn token). Raw mode: HumanEval uses the Codex
    stop sequences (Chen et al., 2021) ``["\\nclass", "\\ndef", "\\n#", "\\nif", "\\nprint"]``; MBPP ``["[DONE]"]``;
    GSM8K ``["\\n\\nQuestion:", "Question:"]``; MATH ``["\\n\\nProblem:", "Problem:"]``.

    Raises:
        ValueError: unknown ``mode``.
    """
    if mode == "chat":
        return []
    if mode != "raw":
        raise ValueError(f"mode must be 'chat' or 'raw', got {mode!r}")
    return {
        "humaneval": ["\nclass", "\ndef", "\n#", "\nif", "\nprint"],
        "mbpp": ["[DONE]"],
        "gsm8k": ["\n\nQuestion:", "Question:"],
    }.get(problem.benchmark, ["\n\nProblem:", "Problem:"])


def _check_messages(messages: Sequence[dict[str, Any]]) -> None:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("chat messages must be a non-empty list of {'role', 'content'} dicts")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant"):
            raise ValueError(f"chat message {i}: expected a dict with role system/user/assistant, got {m!r}")
        if not isinstance(m.get("content"), str):
            raise ValueError(f"chat message {i}: 'content' must be a string")


def render_chat(messages: Sequence[dict[str, str]], tokenizer: Any) -> str:
    """Render chat turns with the tokenizer's own chat template, ending with the assistant generation prompt.

    Args:
        messages: ``[{"role": "system"|"user"|"assistant", "content": str}, ...]``.
        tokenizer: any object with ``apply_chat_template(messages, tokenize=False, add_generation_prompt=True)``
            returning ``str`` (a ``transformers`` tokenizer, or :class:`Qwen25ChatFormat`).

    Returns:
        The prompt text.

    Raises:
        ValueError: malformed messages, or the tokenizer has no usable chat template.
        TypeError: ``tokenizer`` lacks ``apply_chat_template`` or it did not return a string.
    """
    _check_messages(messages)
    fn = getattr(tokenizer, "apply_chat_template", None)
    if not callable(fn):
        raise TypeError(f"{type(tokenizer).__name__} has no apply_chat_template(); use mode='raw' for base models")
    try:
        out = fn(list(messages), tokenize=False, add_generation_prompt=True)
    except ValueError as e:
        raise ValueError(f"{type(tokenizer).__name__} could not apply its chat template: {e}") from e
    if not isinstance(out, str):
        raise TypeError(f"apply_chat_template(tokenize=False) returned {type(out).__name__}, expected str")
    return out


def render_prompt(
    problem: Problem, tokenizer: Any = None, *, mode: str = "chat", prompt_set: "str | PromptSet | None" = None
) -> str:
    """Full prompt text for ``problem``.

    Args:
        problem: the problem.
        tokenizer: required in chat mode (see :func:`render_chat`); ignored in raw mode.
        mode: ``"chat"`` (instruct models) or ``"raw"`` (base models).
        prompt_set: prompt set or name (default ``"jf-paper-v1"``).

    Raises:
        ValueError: unknown mode, or chat mode without a tokenizer.
    """
    if mode == "raw":
        return build_raw_prompt(problem, prompt_set)
    if mode != "chat":
        raise ValueError(f"mode must be 'chat' or 'raw', got {mode!r}")
    if tokenizer is None:
        raise ValueError("chat mode needs a tokenizer with apply_chat_template (or use mode='raw')")
    return render_chat(build_messages(problem, prompt_set), tokenizer)


def text_sha256(text: str) -> str:
    """SHA-256 (hex) of ``text`` encoded as UTF-8 (used to record each rendered prompt)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def prompt_info(
    prompt_set: "str | PromptSet | None" = None, *, mode: str = "chat", tokenizer: Any = None
) -> dict[str, Any]:
    """Provenance of the prompts: ``{"prompt_set", "prompt_set_sha256", "mode", "chat_template_sha256"}``.

    ``chat_template_sha256`` is the hash of ``tokenizer.chat_template`` when it is a string, else ``None``.
    """
    ps = get_prompt_set(prompt_set)
    tmpl = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
    return {
        "prompt_set": ps.name,
        "prompt_set_sha256": ps.sha256,
        "mode": mode,
        "chat_template_sha256": text_sha256(tmpl) if isinstance(tmpl, str) else None,
    }


# ---------------------------------------------------------------------------------------------------------------
# Qwen2.5 chat format (no tools), for tokenizers shipped with another template (e.g. Qwen3's)

QWEN25_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."

#: The Qwen2.5-(Coder-)Instruct chat template without the tool-calling branches (Jinja, for
#: ``tokenizer.chat_template``).
QWEN25_CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\n" + QWEN25_DEFAULT_SYSTEM + "<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (message['role'] == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


class Qwen25ChatFormat:
    """Pure-Python renderer of :data:`QWEN25_CHAT_TEMPLATE` with the ``apply_chat_template`` interface.

    Use it when no tokenizer is at hand or the tokenizer carries a different template; a ``transformers``
    tokenizer whose ``chat_template`` is :data:`QWEN25_CHAT_TEMPLATE` renders the same text.
    """

    chat_template = QWEN25_CHAT_TEMPLATE

    def apply_chat_template(
        self, messages: Sequence[dict[str, str]], tokenize: bool = False, add_generation_prompt: bool = True
    ) -> str:
        """Render ``messages``.

        Raises:
            ValueError: ``tokenize=True`` (this class has no vocabulary) or malformed messages.
        """
        if tokenize:
            raise ValueError("Qwen25ChatFormat renders text only; call with tokenize=False")
        _check_messages(messages)
        parts = []
        if messages[0]["role"] == "system":
            parts.append(f"<|im_start|>system\n{messages[0]['content']}<|im_end|>\n")
            rest = messages[1:]
        else:
            parts.append(f"<|im_start|>system\n{QWEN25_DEFAULT_SYSTEM}<|im_end|>\n")
            rest = messages
        for m in rest:
            parts.append(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n")
        if add_generation_prompt:
            parts.append("<|im_start|>assistant\n")
        return "".join(parts)
