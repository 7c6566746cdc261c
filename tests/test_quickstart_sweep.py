"""The round-2 recipe sweep (recipes.quickstart.sweep) on a tiny finished "quickstart" directory: each run trains
round 2 from the round-1 checkpoint with its own lr / AR weight / anchor weight and is measured (Jacobi TPF with
output == AR, held-out NLL, distinct-4); re-running skips finished runs."""

from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import asdict, replace

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist"))
from train_fixtures import make_record, write_shards  # noqa: E402


def test_parse_run_and_names():
    from recipes.quickstart.sweep import parse_run, run_name

    assert parse_run("lr=3e-5, ar=4") == {"jf2_lr": 3e-5, "jf2_ar_weight": 4.0}
    assert run_name(parse_run("ar=4,lr=3e-5,steps=96,anchor=1")) == "lr3e-05_ar4_anchor1_steps96"
    for bad, msg in (("lr=fast", "is not a float"), ("beta=1", "unknown key 'beta'"), ("", "give key=value")):
        with pytest.raises(ValueError, match=msg):
            parse_run(bad)


@pytest.fixture(scope="module")
def finished(tmp_path_factory, mp1):
    """A work directory past traj2: base = jf1 = a tiny peaked checkpoint with a tokenizer, n=32 trajectories,
    evaluation prompts, held-out tokens, a smoke preset with 2 round-2 steps of 2 samples."""
    from megatron_jf.checkpointing import read_meta
    from megatron_jf.fileio import atomic_write_json
    from recipes.quickstart.presets import PRESETS
    from megatron_jf.models.zoo import build_tiny_checkpoint

    src = tmp_path_factory.mktemp("qs")
    ck = build_tiny_checkpoint(str(src / "tiny"), in_process=True, max_pos=512)
    shutil.copytree(ck, src / "base")
    shutil.copytree(ck, src / "jf1")
    V = read_meta(ck)["model_args"]["vocab_size"]
    write_shards(str(src / "traj2"), [make_record(i, prompt_len=6, block_size=32, num_blocks=2, vocab=V)
                                      for i in range(4)])
    (src / "traj2.done").write_text("{}")
    g = np.random.default_rng(0)
    (src / "prompts_eval.jsonl").write_text("".join(json.dumps({"id": str(i), "prompt_ids": g.integers(0, V - 1, 5)
                                                                 .tolist()}) + "\n" for i in range(2)))
    np.save(src / "tokens_heldout.npy", g.integers(0, V - 1, 3000).astype(np.int32))
    np.save(src / "tokens_train.npy", g.integers(0, V - 1, 3000).astype(np.int32))
    pre = replace(PRESETS["smoke"], jf2_steps=2, jf_mbs=2, response_tokens=24, nll_chunks=2, threads=1,
                  pretrain_seq=32, anchor_mbs=1)
    atomic_write_json(src / "preset.json", asdict(pre))
    return src


def test_sweep_trains_each_run_and_measures_it(finished, tmp_path, capsys):
    from recipes.quickstart import sweep

    out = tmp_path / "sweep"
    argv = ["--from", str(finished), "--out", str(out), "--run", "lr=1e-3,ar=1,anchor=0", "--run", "lr=1e-3,ar=1,anchor=1",
            "--threads", "1"]
    sweep.main(argv)
    rows = json.loads((out / "sweep.json").read_text())
    assert [r["run"] for r in rows] == ["base", "jf1", "lr0.001_ar1_anchor0", "lr0.001_ar1_anchor1"]
    base, jf1, plain, anchored = rows
    assert base["nll"] == pytest.approx(jf1["nll"])  # the same weights (round 1 = base here)
    assert "tpf" not in base and jf1["tpf"] >= 1.0
    assert (plain["anchor"], anchored["anchor"], plain["lr"], plain["ar"]) == (0, 1, 1e-3, 1)
    for r in (plain, anchored):
        assert r["samples"] == 4 and r["tpf"] >= 1.0 and 0 < r["distinct4"] <= 1 and r["train_s"] > 0
        assert r["nll"] != jf1["nll"]  # round 2 changed the weights
    assert plain["nll"] != anchored["nll"]  # the anchor term changed the training
    log = [json.loads(line) for line in open(out / "lr0.001_ar1_anchor1" / "jf2_log.jsonl")]
    plain_log = json.loads(open(out / "lr0.001_ar1_anchor0" / "jf2_log.jsonl").readline())
    assert "anchor_loss" in log[-1] and "anchor_loss" not in plain_log
    assert os.path.islink(out / "lr0.001_ar1_anchor0" / "jf1")  # the round-1 model is shared, not copied
    md = (out / "sweep.md").read_text()
    assert "| lr0.001_ar1_anchor0 | 0.001 | 1 | 0 | 4 | " in md and f"({plain['nll'] - base['nll']:+.3f})" in md
    assert plain["finish"] == (f"python -m recipes.quickstart --out {finished} --smoke --jf2-steps 2 "
                               f"--jf2-lr 0.001 --jf2-ar-weight 1 --jf2-anchor-weight 0 --jf2-from "
                               f"{out / 'lr0.001_ar1_anchor0'}")
    assert f"- lr0.001_ar1_anchor0: `{plain['finish']}`" in md
    assert plain["train_cpu_s"] > 0
    before = (out / "lr0.001_ar1_anchor0" / "result.json").read_text()
    sweep.main(argv[:-2])  # finished runs are skipped (and without --threads the preset's are used)
    assert (out / "lr0.001_ar1_anchor0" / "result.json").read_text() == before
    (tmp_path / "preset.json").write_text("{}")
    with pytest.raises(SystemExit, match="has no traj2.done: run the quickstart there up to round 2"):
        sweep.main(["--from", str(tmp_path), "--out", str(out), "--run", "lr=1e-3"])

    # adopting a run's round 2 (--jf2-from): its checkpoints become the swept directory's jf2 stage, byte for byte
    from recipes.quickstart.presets import load_preset

    run = out / "lr0.001_ar1_anchor1"
    pre = replace(load_preset(finished), **sweep.parse_run("lr=1e-3,ar=1,anchor=1"))
    copy = tmp_path / "copy"
    shutil.copytree(finished, copy, symlinks=True)
    with pytest.raises(ValueError, match="swept from another work directory: its jf1 is"):
        sweep.adopt_round2(run, copy, pre)
    with pytest.raises(ValueError, match=r"other settings \(jf2_anchor_weight=1.0 here 0.0\)"):
        sweep.adopt_round2(run, finished, replace(pre, jf2_anchor_weight=0.0))
    sweep.adopt_round2(run, finished, replace(pre, threads=2))  # threads do not change the run
    files = sorted(p.relative_to(run / "jf2") for p in (run / "jf2").rglob("*") if p.is_file())
    assert files and files == sorted(p.relative_to(finished / "jf2") for p in (finished / "jf2").rglob("*")
                                     if p.is_file())
    assert all((run / "jf2" / f).read_bytes() == (finished / "jf2" / f).read_bytes() for f in files)
    mark = json.loads((finished / "jf2.done").read_text())
    assert mark["adopted_from"] == str(run.resolve()) and mark["steps"] == 2 and mark["seconds"] > 0
    assert not list(finished.glob("*adopt-tmp*"))
    sweep.adopt_round2(run, finished, pre)  # again: a no-op
    with pytest.raises(ValueError, match="has a finished jf2 stage of its own"):
        sweep.adopt_round2(out / "lr0.001_ar1_anchor0", finished, replace(pre, jf2_anchor_weight=0.0))
    shutil.rmtree(finished / "jf2")
    (finished / "jf2.done").unlink()
    (finished / "jf2").mkdir()
    with pytest.raises(ValueError, match="has a started jf2 stage; delete"):
        sweep.adopt_round2(run, finished, pre)
    (finished / "jf2").rmdir()


def test_finish_command_resumes_the_run_with_round_2_recipe(tmp_path, monkeypatch, capsys):
    """A sweep run's finish command is accepted by the work directory it was swept from while its jf2 stage has not
    started, and round 2 then trains with the run's recipe while round 1 keeps its own; a started jf2 stage, or a
    change to round 1's recipe, is refused with a line naming what to do."""
    from megatron_jf.fileio import atomic_write_json
    from recipes.quickstart import cli as QC, pipeline as P, presets as PS
    from recipes.quickstart.sweep import finish_command, parse_run

    src = tmp_path / "qs"
    src.mkdir()
    atomic_write_json(src / "preset.json", asdict(replace(PS.PRESETS["real"], traj2_prompts=192)))
    for st in ("corpus", "base", "prompts", "traj1", "jf1", "traj2"):
        (src / f"{st}.done").write_text("{}")
    cmd = finish_command(src, parse_run("lr=3e-5,ar=4,steps=96"))
    argv = cmd.split()[3:]
    assert argv == ["--out", str(src), "--real", "--traj2-prompts", "192", "--jf2-steps", "96", "--jf2-lr", "3e-05",
                    "--jf2-ar-weight", "4"]
    seen = []
    monkeypatch.setattr(P.Pipeline, "execute", lambda self, until=None: seen.append(self))
    QC.main(argv)
    pre = seen[-1].p
    assert pre.round_recipe("jf2") == (3e-5, 4.0, 0.0) and pre.round_recipe("jf1") == (1e-4, 1.0, 0.0)
    assert "jf2_lr: None -> 3e-05 (stage jf2 not run yet)" in capsys.readouterr().out
    assert PS.load_preset(src) == pre  # recorded: the next resume needs the same flags
    calls = []
    seen[-1].run = lambda args, stage: calls.append([str(a) for a in args])
    seen[-1].stage_jf("jf2")
    seen[-1].stage_jf("jf1")
    from megatron_jf.training.config import parse_config

    (jf2, jf1) = (parse_config(c[1:]) for c in calls)  # the rounds' pretrain_jf.py configs
    assert (jf2.optim.lr, jf2.jf.ar_weight) == (3e-5, 4.0)
    assert (jf1.optim.lr, jf1.jf.ar_weight) == (1e-4, 1.0)
    with pytest.raises(SystemExit, match=r"other preset settings \(jf_lr\)"):
        QC.main([*argv, "--lr", "3e-5"])
    (src / "jf2").mkdir()
    with pytest.raises(SystemExit, match=r"started jf2 stage made with other settings \(jf2_lr\); delete .*jf2"):
        QC.main([*argv[:-4], "--jf2-lr", "1e-5", "--jf2-ar-weight", "4"])

    # --jf2-from: a (here hand-made) sweep run of this recipe becomes the jf2 stage; one of another recipe is refused
    (src / "jf2").rmdir()
    run = tmp_path / "sweep" / "run"
    (run / "jf2").mkdir(parents=True)
    (run / "jf2" / "weights").write_bytes(b"w")
    (run / "jf2_log.jsonl").write_text("{}\n")
    for name in ("jf1", "traj2"):
        (src / name).mkdir(exist_ok=True)
        os.symlink(src / name, run / name)
    atomic_write_json(run / "result.json", {"train_s": 12.5, "preset": asdict(replace(pre, jf2_lr=1e-5))})
    with pytest.raises(SystemExit, match=r"trained with other settings \(jf2_lr=1e-05 here 3e-05\)"):
        QC.main([*argv, "--jf2-from", str(run)])
    atomic_write_json(run / "result.json", {"train_s": 12.5, "preset": asdict(replace(pre, threads=1))})
    QC.main([*argv, "--jf2-from", str(run)])
    assert (src / "jf2" / "weights").read_bytes() == b"w" and (src / "jf2_log.jsonl").read_text() == "{}\n"
    assert json.loads((src / "jf2.done").read_text())["seconds"] == 12.5
