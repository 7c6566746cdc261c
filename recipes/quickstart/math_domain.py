"""The quickstart's math domain (``Preset.corpus == "gsm_symbolic"``): GSM8K-style word problems with chain-of-thought
answers, where Jacobi Forcing can be learned on a 2-core CPU and quality is measurable.

Stages (called by :class:`recipes.quickstart.pipeline.Pipeline` in place of the code corpus's):

* ``corpus``: the domain's disjoint sets (:func:`megatron_jf.data.gsm_symbolic.make_splits`: templates held out from
  everything, pretraining problems, Jacobi Forcing training prompts and held-out problems from disjoint seed
  ranges) saved to ``problems.jsonl``; a byte-level BPE on the pretraining problems' text; the pretraining stream
  ``tokens_train.npy`` (problems, plus arithmetic drills in the chains' own style for ``Preset.drill_fraction`` of
  the tokens, :func:`~megatron_jf.data.gsm_symbolic.arithmetic_drills`, documents shuffled); ``tokens_heldout.npy``:
  the first ``n_eval_prompts`` held-out problems' ground-truth text; ``tokens_gt_train.npy``: the training
  prompts with their ground-truth chains (the in-domain anchor / ground-truth AR text).
* ``prompts``: ``prompts_train.jsonl`` (JF training prompts), ``prompts_quality.jsonl`` (every held-out problem,
  ``max(Preset.n_eval_prompts, Preset.n_quality_problems)``), ``prompts_eval.jsonl`` (its first ``n_eval_prompts``:
  the prompts every decoder of the report runs on), ``prompts_eval_template.jsonl`` (problems of the held-out
  templates), each ``{"id", "prompt_ids"}``; the answers stay in ``problems.jsonl``; ``nll_eval.jsonl``: the first
  ``n_eval_prompts`` held-out problems' questions and ground-truth answers as token ids (the report's in-domain NLL:
  the answers given the questions, ``megatron_jf.eval.quality.answer_nll``).

The report adds, per model (:func:`quality`): exact-answer accuracy (``#### N``) and the share of the chains'
``a op b = c`` steps that are arithmetically right, on every held-out problem of ``prompts_quality.jsonl``.
"""

from __future__ import annotations

import json
from pathlib import Path
from random import Random

__all__ = ["stage_corpus", "stage_prompts", "load_problems"]

SETS = ("pretrain", "train", "heldout", "heldout_template")


def _problem_row(p, split: str) -> dict:
    return {"id": p.uid, "split": split, "template": p.template, "seed": p.seed, "question": p.question,
            "chain": p.chain, "answer": p.answer}


def load_problems(out: Path, split: str | None = None) -> list[dict]:
    """The rows of ``OUT/problems.jsonl`` (every set but pretraining), optionally of one ``split``."""
    rows = [json.loads(line) for line in open(Path(out) / "problems.jsonl", encoding="utf-8")]
    return [r for r in rows if split is None or r["split"] == split]


def _text(row: dict) -> str:
    from megatron_jf.data.gsm_symbolic import Problem

    return Problem(row["template"], row["seed"], row["question"], row["chain"], row["answer"]).text()


def stage_corpus(pipe) -> dict:
    """Problems, tokenizer and token streams (see the module docstring)."""
    import numpy as np

    from megatron_jf.data.gsm_symbolic import drill_steps, drills_from_steps, make_splits
    from megatron_jf.fileio import atomic_write_text
    from megatron_jf.data.tokenizer_train import train_bpe_tokenizer
    from megatron_jf.tokenizer import load_tokenizer

    p = pipe.p
    s = make_splits(p.n_pretrain_problems, p.n_train_prompts, max(p.n_eval_prompts, p.n_quality_problems),
                    p.n_eval_template_prompts, n_heldout_templates=p.heldout_templates, seed=0)
    rows = ([_problem_row(x, "train") for x in s.train] + [_problem_row(x, "heldout") for x in s.heldout]
            + [_problem_row(x, "heldout_template") for x in s.heldout_template])
    atomic_write_text(pipe.path("problems.jsonl"), "".join(json.dumps(r) + "\n" for r in rows))
    tok_dir = pipe.path("tokenizer")
    train_bpe_tokenizer(tok_dir, vocab_size=p.vocab_size, overwrite=True, texts=(x.text() for x in s.pretrain))
    tok = load_tokenizer(tok_dir)
    eos = min(tok.eos_ids)
    docs = [tok.encode(x.text()) for x in s.pretrain]
    problem_tokens = sum(len(d) + 1 for d in docs)
    drill_tokens = 0
    if p.drill_fraction > 0:
        want = problem_tokens * p.drill_fraction / (1 - p.drill_fraction)
        batch, steps = 0, drill_steps(s.pretrain)  # scanned once: ~2/3 of the stage's time when rescanned per batch
        while drill_tokens < want:
            for d in drills_from_steps(steps, 1024, seed=batch):
                if drill_tokens >= want:
                    break
                ids = tok.encode(d)
                docs.append(ids)
                drill_tokens += len(ids) + 1
            batch += 1
    Random(0).shuffle(docs)
    streams = {"train": docs,
               "heldout": [tok.encode(_text(r)) for r in rows if r["split"] == "heldout"][: p.n_eval_prompts],
               "gt_train": [tok.encode(x.text()) for x in s.train]}
    for name, ds in streams.items():
        arr = np.asarray([t for d in ds for t in (*d, eos)], dtype=np.int32)
        tmp = pipe.path(f"tokens_{name}.tmp.npy")
        np.save(tmp, arr)
        tmp.replace(pipe.path(f"tokens_{name}.npy"))
        pipe.log(f"[corpus] {name}: {len(ds):,} documents, {len(arr):,} tokens")
    return {"corpus": "gsm_symbolic", "heldout_templates": list(s.heldout_templates),
            "pretrain_problems": len(s.pretrain), "problem_tokens": problem_tokens, "drill_tokens": drill_tokens,
            "vocab_size": tok.vocab_size}


def stage_prompts(pipe) -> dict:
    """The prompt files of the training prompts, the held-out problems and the held-out templates."""
    from megatron_jf.fileio import atomic_write_text
    from megatron_jf.tokenizer import load_tokenizer

    tok = load_tokenizer(pipe.path("tokenizer"))
    counts = {}
    n_eval = pipe.p.n_eval_prompts
    for split, name in (("train", "prompts_train.jsonl"), ("heldout", "prompts_quality.jsonl"),
                        ("heldout_template", "prompts_eval_template.jsonl")):
        rows = [{"id": r["id"], "prompt_ids": tok.encode(f"Question: {r['question']}\nAnswer:")}
                for r in load_problems(pipe.out, split)]
        atomic_write_text(pipe.path(name), "".join(json.dumps(r) + "\n" for r in rows))
        counts[split] = len(rows)
        if split == "heldout":  # the decoders' prompts; the in-domain NLL: ground-truth answers given the questions
            atomic_write_text(pipe.path("prompts_eval.jsonl"), "".join(json.dumps(r) + "\n" for r in rows[:n_eval]))
            nll = [{"prompt_ids": row["prompt_ids"], "response_ids": tok.encode(" " + r["chain"])}
                   for row, r in zip(rows[:n_eval], load_problems(pipe.out, split))]
            atomic_write_text(pipe.path("nll_eval.jsonl"), "".join(json.dumps(r) + "\n" for r in nll))
    pipe.log(f"[prompts] {counts['train']} training prompts, {min(counts['heldout'], n_eval)} held-out problems "
             f"for the decoders ({counts['heldout']} scored for accuracy), {counts['heldout_template']} problems of "
             "held-out templates")
    return counts
