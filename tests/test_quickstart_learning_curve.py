"""The quickstart's learning curve (every saved JF checkpoint evaluated) and its per-stage cost table."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, replace
from pathlib import Path

import torch

from megatron_jf.fileio import atomic_write_json
from recipes.quickstart.presets import PRESETS


class _Pipe:
    """What the report's helpers use of a Pipeline: the preset, paths in the work directory, a log."""

    def __init__(self, out: Path, preset):
        self.out, self.p, self.logged = out, preset, []

    def path(self, *parts):
        return self.out.joinpath(*parts)

    def log(self, msg):
        self.logged.append(msg)


def _args():
    from megatron_jf.models.hf_config import ModelArgs

    return ModelArgs(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=48,
                     num_layers=1, num_heads=2, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=1e4,
                     max_position_embeddings=128, tie_word_embeddings=True, qkv_bias=False)


def _model():
    from megatron_jf.models.gpt import build_model

    m = build_model(_args(), params_dtype=torch.float32)
    with torch.no_grad():  # large random weights: different models give different greedy outputs
        for q in m.parameters():
            q.add_(torch.randn_like(q) * 0.5)
    return m


def test_learning_curve_evaluates_every_saved_iteration(tmp_path, mp1):
    from megatron_jf import checkpointing as C
    from megatron_jf.inference.engine import DecodeConfig, Engine
    from megatron_jf.decoding import PAPER
    from recipes.quickstart.learning_curve import curve_markdown, curve_points, evaluate_curve, plot_curve

    pre = replace(PRESETS["smoke"], jf1_steps=4, jf2_steps=6, jf_mbs=3, n2=8, response_tokens=10,
                  curve_tpf_prompts=2)
    pipe = _Pipe(tmp_path, pre)
    torch.manual_seed(0)
    for ck, its in (("base", (1,)), ("jf1", (2, 4)), ("jf2", (3, 6))):
        for it in its:
            C.save_checkpoint(str(tmp_path / ck), it, _model())  # fresh random weights: every point differs
    rows = [{"id": str(i), "prompt_ids": [1 + i, 5, 9, 2 + i]} for i in range(3)]
    # the pass@1 set (the prompts stage writes it) replaces the report's prompts; TPF on its first 2
    (tmp_path / "prompts_pass.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pts = curve_points(pipe)
    assert [(p["ckpt"], p["iteration"], p["samples"]) for p in pts] == [
        ("base", None, 0), ("jf1", 2, 6), ("jf1", 4, 12), ("jf2", 3, 12 + 9), ("jf2", 6, 12 + 18)]
    got = evaluate_curve(pipe, rows[:1], eos=set())
    assert len(got) == 5 and all(g["pass@1"] is None for g in got)
    # each point is that iteration's model: its greedy output and Jacobi TPF, computed here independently
    for g in got:
        model, _, _ = C.load_model(str(tmp_path / g["ckpt"]), iteration=g["iteration"])
        eng = Engine(model)
        ar = eng.generate([r["prompt_ids"] for r in rows], DecodeConfig("ar"), max_new_tokens=10)
        jac = eng.generate([r["prompt_ids"] for r in rows[:2]], DecodeConfig("jacobi", block_size=8, **PAPER),
                           max_new_tokens=10)
        cache = json.loads((tmp_path / "report" / f"curve_{g['ckpt']}_{g['iteration'] or 'latest'}.json").read_text())
        assert cache["outputs"] == [r.tokens for r in ar]
        assert g["tpf"] == sum(len(r.tokens) for r in jac) / sum(r.forwards for r in jac)
    outs = [json.loads(f.read_text())["outputs"] for f in sorted((tmp_path / "report").glob("curve_jf1_*.json"))]
    assert outs[0] != outs[1]  # iteration 2 and 4 are different models
    # cached: nothing is evaluated again; a re-saved checkpoint is
    n_logged = len(pipe.logged)
    assert evaluate_curve(pipe, rows, eos=set()) == got and len(pipe.logged) == n_logged
    C.save_checkpoint(str(tmp_path / "jf2"), 3, _model())
    evaluate_curve(pipe, rows, eos=set())
    assert len(pipe.logged) == n_logged + 1 and "jf2 step 3" in pipe.logged[-1]
    md = curve_markdown(got, 8)
    assert "on the first 2 and greedy pass@1 on 3 evaluation" in md and "| jf1 step 4 | 12 | " in md and md.count("\n| ") == 1 + 5  # header + 5 points
    png = plot_curve(tmp_path / "report", got, 8)
    assert png is None or png.stat().st_size > 1000


def test_stage_costs_from_done_markers(tmp_path):
    from recipes.quickstart.costs import costs_markdown, stage_costs

    pipe = _Pipe(tmp_path, replace(PRESETS["smoke"], jf_mbs=2))
    atomic_write_json(tmp_path / "prompts.done", {"train": 5, "seconds": 3.0})
    atomic_write_json(tmp_path / "traj1.done", {"manifest": {"counts": {"records": 30}, "filtered": {"loop": 10}},
                                               "seconds": 80.0})
    atomic_write_json(tmp_path / "jf1.done", {"steps": 50, "block_size": 16, "window_size": 16, "seconds": 25.0})
    atomic_write_json(tmp_path / "report.done", {"seconds": 99.0})
    costs = stage_costs(pipe)
    assert costs == [{"stage": "prompts", "seconds": 3.0, "samples": None, "samples_per_s": None},
                     {"stage": "traj1", "seconds": 80.0, "samples": 40, "samples_per_s": 0.5},
                     {"stage": "jf1", "seconds": 25.0, "samples": 100, "samples_per_s": 4.0}]
    md = costs_markdown(costs)
    assert "| traj1 | 80 | 40 | 0.500 |" in md and "| jf1 | 25 | 100 | 4.000 |" in md


def test_interpretation_compares_base_and_final_against_the_targets():
    from recipes.quickstart.interpret import interpretation_markdown

    def row(model, dec, tpf, nll, speed=1.0, p1=0.25):
        return {"model": model, "decoder": dec, "tpf": tpf, "speedup": speed, "pass@1": p1, "nll": nll,
                "tf_agreement_with_base": 1.0 if model == "base" else 0.9, "distinct4": 0.8}

    rows = [row("base", "AR", 1.0, 1.20), row("base", "Jacobi (n=32)", 1.05, 1.20, 0.3),
            row("base", "transformers greedy", 1.0, 1.20),
            row("JF round 2", "AR", 1.0, 1.35), row("JF round 2", "Jacobi (n=32)", 1.62, 1.35, 0.5)]
    curve = [{"pass@1": 10 / 40, "pass_prompts": 40}, {"pass@1": 7 / 40, "pass_prompts": 40}]
    md = interpretation_markdown({"rows": rows, "learning_curve": curve})
    assert "| Jacobi (n=32) | 1.05 -> 1.62 | 0.30x -> 0.50x | 25.0% -> 25.0% | 1.200 -> 1.350 (+0.150) | 90.0% |" in md
    assert "transformers greedy |" not in md
    # TPF 1.62 passes 1.13, but at drift +0.150: the joint target (issue 31) is missed, and says why
    assert "target TPF > 1.13 at drift <= 0.1 missed (drift +0.150)" in md and "target <= 0.1 missed" in md
    assert "-3 problems, target within 2: missed" in md
    rows[-1]["tpf"] = 1.1
    assert "missed (TPF 1.100 <= 1.13, drift +0.150)" in interpretation_markdown({"rows": rows})
    assert interpretation_markdown({"rows": rows[:3]}) == ""  # one model: nothing to compare


def test_real_preset_round2_collects_a_prefix_of_the_prompts(tmp_path, monkeypatch):
    """traj2 regenerates trajectories for the first traj2_prompts training prompts, at the trajectory length; the
    JF rounds save jf_saves evenly spaced checkpoints (the learning curve's points)."""
    from recipes.quickstart import cli as QC, pipeline, presets as PS
    from recipes.quickstart.pipeline import Pipeline

    monkeypatch.setattr(pipeline, "vllm_python", lambda: None)  # this project's collector (vLLM's: its own test)

    pre = replace(PRESETS["real"], traj2_prompts=2, traj_response_tokens=24, response_tokens=64, jf2_steps=48)
    pipe = Pipeline(tmp_path, pre, log=lambda *a: None)
    (tmp_path / "prompts_train.jsonl").write_text("".join(json.dumps({"id": str(i), "prompt_ids": [i]}) + "\n"
                                                          for i in range(5)))
    calls = []

    def fake_run(args, stage):  # the subprocess itself is covered by the smoke test; here only its arguments
        calls.append([str(a) for a in args])
        if stage.startswith("traj"):
            (tmp_path / stage).mkdir(exist_ok=True)
            (tmp_path / stage / "manifest.json").write_text(json.dumps({"counts": {"records": 2}}))

    pipe.run = fake_run
    pipe.stage_traj("traj2", "jf1", 32)
    a = calls[-1]
    assert a[a.index("--prompts") + 1] == str(tmp_path / "prompts_traj2.jsonl")
    assert [json.loads(l)["id"] for l in open(tmp_path / "prompts_traj2.jsonl")] == ["0", "1"]
    assert a[a.index("--max-new-tokens") + 1] == "24" and a[a.index("--block-size") + 1] == "32"
    pipe.stage_traj("traj1", "base", 16)
    assert calls[-1][calls[-1].index("--prompts") + 1] == str(tmp_path / "prompts_train.jsonl")
    pipe.stage_jf("jf2")
    assert calls[-1][calls[-1].index("--save-interval") + 1] == "24"  # 2 saves per round: 24 and 48


def test_work_directory_of_other_preset_settings_is_refused(tmp_path):
    import pytest

    from recipes.quickstart.cli import main

    out = tmp_path / "w"
    out.mkdir()
    atomic_write_json(out / "preset.json", dict(asdict(PRESETS["real"]), n_train_prompts=64, jf_lr=2e-5))
    with pytest.raises(SystemExit, match=r"other preset settings \(jf_lr, n_train_prompts\).*--fresh"):
        main(["--real", "--out", str(out), "--until", "corpus"])


def test_work_directory_older_than_a_setting_resumes_with_its_default(tmp_path, monkeypatch):
    """A preset.json written before a setting existed (here jf_pc_weight) resumes when the run keeps that setting's
    default, and is refused when the command line changes it."""
    import pytest

    from recipes.quickstart import cli as QC, pipeline as P, presets as PS

    seen = []
    monkeypatch.setattr(P.Pipeline, "execute", lambda self, until=None: seen.append(self.p))
    out = tmp_path / "w"
    out.mkdir()
    old = asdict(PRESETS["real"])
    del old["jf_pc_weight"]
    atomic_write_json(out / "preset.json", old)
    QC.main(["--real", "--out", str(out)])
    assert seen and seen[-1].jf_pc_weight == 1.0
    atomic_write_json(out / "preset.json", old)
    with pytest.raises(SystemExit, match=r"other preset settings \(jf_pc_weight\)"):
        QC.main(["--real", "--out", str(out), "--pc-weight", "0"])


def test_recipe_knobs_from_the_command_line_reach_the_stages(tmp_path, monkeypatch):
    """--lr/--ar-weight/--anchor-weight/--traj2-prompts/--jf2-steps/--precision set the preset
    (recorded in preset.json), and the stages pass them on: bf16 training and collection, the anchor term on real
    text made from the stdlib train split in the model's tokenizer. bf16 on a CPU without it stops at once."""
    import numpy as np
    import pytest

    from megatron_jf.precision import CPU_BF16_ENV
    from recipes.quickstart import cli as QC, pipeline as P, presets as PS
    from megatron_jf.data.sources.corpus import list_corpus_files, split_files
    from megatron_jf.data.tokenizer_train import train_bpe_tokenizer
    from megatron_jf.tokenizer import load_tokenizer

    seen = []
    monkeypatch.setattr(P.Pipeline, "execute", lambda self, until=None: seen.append(self.p))
    monkeypatch.setenv(CPU_BF16_ENV, "1")
    out = tmp_path / "w"
    knobs = ["--lr", "5e-5", "--ar-weight", "4", "--anchor-weight", "0.5", "--traj2-prompts", "200",
             "--jf2-steps", "100", "--precision", "bf16", "--pc-weight", "0"]
    QC.main(["--real", "--out", str(out), *knobs])
    pre = seen[-1]
    assert (pre.jf_lr, pre.jf_ar_weight, pre.anchor_weight, pre.traj2_prompts, pre.jf2_steps, pre.precision,
            pre.jf_pc_weight) == (5e-5, 4.0, 0.5, 200, 100, "bf16", 0.0)
    assert json.loads((out / "preset.json").read_text())["jf_lr"] == 5e-5
    with pytest.raises(SystemExit, match=r"other preset settings \(jf_lr\)"):  # resumes only with the same recipe
        QC.main(["--real", "--out", str(out), *knobs[2:]])
    monkeypatch.setenv(CPU_BF16_ENV, "0")
    with pytest.raises(SystemExit, match="--precision bf16 on CPU needs native bf16"):
        QC.main(["--real", "--out", str(tmp_path / "w2"), "--precision", "bf16"])

    pipe = P.Pipeline(out, pre, log=lambda *a: None)
    tok_dir = train_bpe_tokenizer(tmp_path / "tok", texts=["def f(x):\n    return x + 1\n"] * 30, vocab_size=300,
                                  overwrite=True)
    monkeypatch.setattr(pipe, "_tokenizer_dir", lambda: tok_dir)
    monkeypatch.setattr(P, "ANCHOR_TOKENS", 3000)
    calls = []
    pipe.run = lambda args, stage: calls.append([str(a) for a in args])
    pipe.stage_jf("jf2")
    a = calls[-1]
    for flag, value in (("--precision", "bf16"), ("--lr", "5e-05"), ("--ar-weight", "4.0"), ("--pc-weight", "0.0"),
                        ("--anchor-weight", "0.5"),
                        ("--anchor-micro-batch-size", "1"), ("--anchor-data", str(out / "tokens_train.npy"))):
        assert a[a.index(flag) + 1] == value, flag
    ids = np.load(out / "tokens_train.npy")
    assert ids.dtype == np.int32 and len(ids) == 3000
    first = split_files(list_corpus_files())[0][0]  # the train split's first file, in the model's tokenizer
    want = load_tokenizer(tok_dir).encode(open(first.path, encoding="utf-8", errors="replace").read())
    assert ids[:100].tolist() == want[:100]
    (out / "prompts_train.jsonl").write_text(json.dumps({"id": "0", "prompt_ids": [1]}) + "\n")
    # this project's collector (a checkout with .venv-vllm would send --real's collection to vLLM: another command)
    monkeypatch.setattr(P, "vllm_python", lambda: None)
    pipe.run = lambda args, stage: (calls.append([str(x) for x in args]), (out / stage).mkdir(exist_ok=True),
                                    (out / stage / "manifest.json").write_text('{"counts": {"records": 1}}'))
    pipe.stage_traj("traj2", "jf1", 32)
    assert "--bf16" in calls[-1]
    pipe = P.Pipeline(tmp_path / "w3", PRESETS["real"], log=lambda *a: None)  # the preset as run: fp32, no anchor
    pipe.run = lambda args, stage: calls.append([str(x) for x in args])
    pipe.stage_jf("jf1")
    assert "--anchor-data" not in calls[-1] and "--precision" not in calls[-1]
