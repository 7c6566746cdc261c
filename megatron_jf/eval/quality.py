"""Quality measures of a model and its outputs, shared by the evaluator, the quickstart recipe and the benches:
teacher-forced held-out NLL (on a token stream and on answers given questions), distinct n-grams of outputs,
HumanEval pass@1 of completions and GSM-style math accuracy (exact answers, right arithmetic steps).
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["heldout_nll", "answer_nll", "distinct4", "humaneval_pass1", "math_accuracy"]


@torch.no_grad()
def heldout_nll(model, tokens: np.ndarray, chunks: int, seq: int = 256) -> tuple[float, torch.Tensor]:
    """Teacher-forced quality on held-out text.

    Args:
        tokens: int token stream (held-out files, EOS-separated).
        chunks: number of evenly spaced windows of ``seq`` tokens.

    Returns:
        ``(nll, argmax)``: mean next-token negative log-likelihood in nats/token, and the model's greedy
        next-token predictions, int64 ``[chunks, seq]`` (compared across models for teacher-forced agreement,
        which unlike free-running agreement is not dominated by where two greedy continuations first part).
    """
    from megatron_jf.inference.forward import forward_logits

    starts = np.linspace(0, len(tokens) - seq - 2, chunks).astype(int)
    total, count, preds = 0.0, 0, []
    for i in range(0, len(starts), 8):
        batch = torch.tensor(np.stack([tokens[s: s + seq + 1] for s in starts[i:i + 8]]).astype(np.int64))
        logits = forward_logits(model, batch[:, :-1], torch.arange(seq).expand(batch.shape[0], seq))
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1),
                                                reduction="sum")
        total += float(nll)
        count += batch[:, 1:].numel()
        preds.append(logits.argmax(-1))
    return total / count, torch.cat(preds)


@torch.no_grad()
def answer_nll(model, rows: list[dict], eos: int, batch: int = 16) -> tuple[float, torch.Tensor]:
    """Teacher-forced quality on held-out problems: mean NLL (nats/token) of the ground-truth answers given their
    questions -- the task's conditional distribution. (Jacobi Forcing trains no question token, so a stream NLL
    over questions and answers together mostly measures how well the model still writes questions.)

    Args:
        rows: ``{"prompt_ids", "response_ids"}`` per problem; the response is followed by ``eos``.

    Returns:
        ``(nll, argmax)``: the mean over every answer token (and the final EOS), and the model's greedy next-token
        predictions at those positions, int64 ``[total answer tokens]`` (teacher-forced agreement across models).
    """
    from megatron_jf.inference.forward import forward_logits

    total, count, preds = 0.0, 0, []
    for i in range(0, len(rows), batch):
        seqs = [r["prompt_ids"] + r["response_ids"] + [eos] for r in rows[i:i + batch]]
        L = max(map(len, seqs))
        tokens = torch.zeros((len(seqs), L), dtype=torch.int64)
        for j, sq in enumerate(seqs):
            tokens[j, : len(sq)] = torch.tensor(sq)
        logits = forward_logits(model, tokens, torch.arange(L).expand(len(seqs), L)).float()
        for j, (r, sq) in enumerate(zip(rows[i:i + batch], seqs)):
            P = len(r["prompt_ids"])
            pos = torch.arange(P - 1, len(sq) - 1)
            target = tokens[j, P: len(sq)]
            total += float(torch.nn.functional.cross_entropy(logits[j, pos], target, reduction="sum"))
            count += target.numel()
            preds.append(logits[j, pos].argmax(-1))
    return total / max(count, 1), torch.cat(preds)


def distinct4(seqs) -> float:
    """Distinct 4-gram ratio of token sequences (1.0 = no repeated 4-gram; low values mean loops)."""
    grams, total = set(), 0
    for s in seqs:
        for i in range(len(s) - 3):
            grams.add(tuple(s[i:i + 4]))
            total += 1
    return len(grams) / max(total, 1)


def humaneval_pass1(prompt_rows, outputs, tok) -> dict:
    """pass@1 of each model's greedy completions (identical for every decoder: they are lossless)."""
    from megatron_jf.eval.benchmarks import load_benchmark
    from megatron_jf.eval.scoring import aggregate, score_many

    probs = {p.task_id: p for p in load_benchmark("humaneval")}
    problems = [probs[r["task_id"]] for r in prompt_rows]
    out = {}
    for label, toks in outputs.items():
        scores = score_many(problems, [tok.decode(t) for t in toks])
        out[label] = aggregate(scores)["humaneval"]["accuracy"]
    return out


def math_accuracy(outputs: dict, answers: list[str], decode) -> dict:
    """Per model: ``{"accuracy", "correct", "step_accuracy", "steps"}`` of its greedy outputs on the held-out problems
    (``step_accuracy`` is None when the outputs hold no ``a op b = c`` step: report.json stays strict JSON).

    Args:
        outputs: model label -> token ids per problem (the greedy AR outputs, in ``answers``' order).
        answers: the reference answers.
        decode: ``ids -> str``.
    """
    from megatron_jf.data.gsm_symbolic import answers_match, arithmetic_steps, final_answer

    out = {}
    for label, toks in outputs.items():
        texts = [decode(t) for t in toks]
        correct = sum(answers_match(final_answer(t), a) for t, a in zip(texts, answers))
        steps = [arithmetic_steps(t) for t in texts]
        right, total = sum(r for r, _ in steps), sum(t for _, t in steps)
        out[label] = {"accuracy": correct / max(len(texts), 1), "correct": correct, "problems": len(texts),
                      "step_accuracy": right / total if total else None, "steps": total}
    return out
