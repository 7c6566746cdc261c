"""The launch scripts (``DRY_RUN=1``): the paper's two-round recipe (Sec. 4.1), every stage's command line
parses with the real parsers, resumable stages are skipped once done, and a forced batch change is announced."""
import os
import shlex
import shutil
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
H200 = os.path.join(REPO, "examples", "train_jf_qwen7b_h200.sh")
PROGRESSIVE = os.path.join(REPO, "examples", "progressive_distillation.sh")


def _dry(script, args=(), **env):
    e = {k: v for k, v in os.environ.items() if k not in ("GLOBAL_BATCH", "TP", "PP", "NNODES", "LR")}
    e.update(DRY_RUN="1", **env)
    proc = subprocess.run(["bash", script, *args], env=e, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    cmds = [shlex.split(line[2:]) for line in proc.stdout.splitlines() if line.startswith("+ ")]
    return proc.stdout, cmds


def _split(cmd):
    """(script name, its argv) of a torchrun / python command."""
    i = next(i for i, w in enumerate(cmd) if w.endswith(".py"))
    return os.path.basename(cmd[i]), cmd[i + 1:]


def _parse(cmd):
    name, argv = _split(cmd)
    if name == "pretrain_jf.py":
        from megatron_jf.training.config import parse_config

        return name, parse_config(argv)
    from megatron_jf.commands import collect

    p = collect.build_parser()
    args = p.parse_args(argv)
    collect.check_args(p, args)
    return name, args


def test_h200_script_runs_the_papers_two_rounds(tmp_path):
    out, cmds = _dry(H200, WORK=str(tmp_path), BASE="ckpt/base")
    parsed = [_parse(c) for c in cmds]
    assert [n for n, _ in parsed] == ["generate_trajectories.py", "pretrain_jf.py"] * 2
    (_, t1), (_, r1), (_, t2), (_, r2) = parsed
    # trajectories: base model at n=16, then the round-1 model at n=32, max 2048 new tokens
    assert (t1.load, t1.block_size, t1.max_new_tokens) == ("ckpt/base", 16, 2048)
    assert (t2.load, t2.block_size, t2.max_new_tokens) == (r1.checkpoint.save, 32, 2048)
    # training rounds: (n, w) = (16, 16) then (32, 8), 10k steps each, on the matching trajectories
    for r, want in ((r1, (16, 16, 10000, [t1.out], "ckpt/base")), (r2, (32, 8, 10000, [t2.out], r1.checkpoint.save))):
        assert (r.dataset.block_size, r.dataset.window_size, r.optim.train_steps, r.dataset.data, r.model.load) == want
    for r in (r1, r2):
        assert r.optim.lr == 1e-6 and r.optim.global_batch_size == 4 and r.optim.micro_batch_size == 1
        assert r.dataset.noise_schedule == "progressive" and r.jf.mask == "nc" and r.jf.consistency_loss == "kl"
        assert r.jf.pc_weight == 1.0 and r.jf.ar_weight == 1.0 and r.jf.pc_normalization == "paper"
        par = r.parallel
        assert (par.tp, par.pp, par.sequence_parallel, par.use_distributed_optimizer) == (2, 1, True, True)
        assert r.parallel.overlap_grad_reduce and r.parallel.overlap_param_gather
        assert r.recompute.kwargs() == {"recompute_granularity": "full", "recompute_method": "uniform",
                                        "recompute_num_layers": 1}
        assert r.runtime.precision == "bf16" and r.parallel.use_megatron_optimizer
    assert "global batch" not in out.split("batch:")[0]  # one node: DP 4 x 1 = the paper's 4, nothing changed
    assert "4 samples per step = 1 microbatch(es) x 1 x DP 4" in out


def test_h200_script_announces_a_forced_global_batch_change(tmp_path):
    out, cmds = _dry(H200, WORK=str(tmp_path), NNODES="2")
    assert "note: global batch 4 -> 8" in out and "8 x 1 on 16 GPUs" in out
    assert {_parse(c)[1].optim.global_batch_size for c in cmds if _split(c)[0] == "pretrain_jf.py"} == {8}
    # a global batch that allows it runs several microbatches per step
    out, cmds = _dry(H200, WORK=str(tmp_path), GLOBAL_BATCH="16")
    assert "16 samples per step = 4 microbatch(es) x 1 x DP 4" in out and "note:" not in out


def test_h200_script_skips_finished_stages_and_passes_extra_flags(tmp_path):
    (tmp_path / "traj1.done").write_text("x")
    (tmp_path / "jf1.done").write_text("x")
    out, cmds = _dry(H200, ["--", "--eval-interval", "100", "--valid-data", "v"], WORK=str(tmp_path))
    assert "[traj1] done earlier, skipping" in out and "[jf1] done earlier, skipping" in out
    names = [_split(c)[0] for c in cmds]
    assert names == ["generate_trajectories.py", "pretrain_jf.py"]
    cfg = _parse(cmds[1])[1]
    assert cfg.dataset.block_size == 32 and cfg.logging.eval_interval == 100 and cfg.dataset.valid_data == ["v"]
    assert not (tmp_path / "traj2.done").exists()  # a dry run marks nothing done


def test_h200_script_official_code_values_are_one_switch_away(tmp_path):
    _, cmds = _dry(H200, WORK=str(tmp_path), AR_WEIGHT="10", PC_NORMALIZATION="reference", LR="1e-5")
    cfg = _parse(cmds[1])[1]
    assert (cfg.jf.ar_weight, cfg.jf.pc_normalization, cfg.optim.lr) == (10.0, "reference", 1e-5)


@pytest.mark.parametrize("nproc,gbs", [("1", 4), ("4", 4), ("3", 6)])
def test_progressive_script_defaults_to_the_paper(tmp_path, nproc, gbs):
    out, cmds = _dry(PROGRESSIVE, ["base", "p.jsonl", str(tmp_path), nproc])
    parsed = [_parse(c) for c in cmds]
    assert [n for n, _ in parsed] == ["generate_trajectories.py", "pretrain_jf.py"] * 2
    (_, t1), (_, r1), (_, t2), (_, r2) = parsed
    assert (t1.block_size, r1.dataset.block_size, r1.dataset.window_size, t2.block_size, r2.dataset.block_size,
            r2.dataset.window_size) == (
        16, 16, 16, 32, 32, 8)
    assert t1.max_new_tokens == 2048 and r1.optim.lr == 1e-6
    assert r2.model.load == r1.checkpoint.save and t2.load == r1.checkpoint.save
    assert r1.optim.global_batch_size == gbs and (("note: global batch 4 -> 6" in out) == (gbs == 6))


# ---- which Python the example scripts run (issue 25: a fresh clone has no `python` with torch on PATH)

FAKE_PY = '#!/bin/sh\nprintf "%s\\n" "$0 $*" >> "$(dirname "$0")/../../ran.txt"\n'


def _checkout(tmp_path, script, *, venv):
    """A copy of ``script`` and scripts/jf_env.sh in a fresh directory; with ``venv`` a stand-in
    ``.venv/bin/python`` that records how it was called (in ``ran.txt``) and exits 0."""
    root = tmp_path / "clone"
    (root / "examples").mkdir(parents=True)
    (root / "scripts").mkdir()
    shutil.copy2(os.path.join(REPO, "examples", script), root / "examples" / script)
    shutil.copy2(os.path.join(REPO, "scripts", "jf_env.sh"), root / "scripts" / "jf_env.sh")
    if venv:
        (root / ".venv" / "bin").mkdir(parents=True)
        py = root / ".venv" / "bin" / "python"
        py.write_text(FAKE_PY)
        py.chmod(0o755)
    return root


def _run_script(root, script, args, **env):
    e = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "DRY_RUN", "JF_ENV")}
    e.update(env)
    return subprocess.run(["bash", str(root / "examples" / script), *args], env=e, capture_output=True, text=True,
                          timeout=60, cwd=str(root))


@pytest.mark.parametrize("script,args", [("run_text_server.sh", ["ckpt", "1", "5077"]),
                                         ("progressive_distillation.sh", ["base", "p.jsonl", "work"])])
def test_examples_without_an_environment_say_to_run_the_setup(tmp_path, script, args):
    root = _checkout(tmp_path, script, venv=False)
    proc = _run_script(root, script, args)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "run the set-up first (bash scripts/bootstrap.sh)" in lines[0], proc.stderr
    assert f"{root}/.venv is missing" in lines[0]


def test_server_script_runs_the_checkouts_venv(tmp_path):
    root = _checkout(tmp_path, "run_text_server.sh", venv=True)
    proc = _run_script(root, "run_text_server.sh", ["runs/ck", "1", "5077", "--decoder", "ar"])
    assert proc.returncode == 0, proc.stderr
    assert (root / "ran.txt").read_text().splitlines() == [
        f"{root}/.venv/bin/python {root}/tools/run_text_generation_server.py --load runs/ck --tp 1 --port 5077 "
        "--decoder ar"]
    # PYTHON still wins (a container's interpreter)
    (root / "ran.txt").unlink()
    other = root / ".venv" / "bin" / "other"
    shutil.copy2(root / ".venv" / "bin" / "python", other)
    proc = _run_script(root, "run_text_server.sh", ["ck", "2"], PYTHON=str(other))
    assert proc.returncode == 0, proc.stderr
    assert (root / "ran.txt").read_text().split()[:4] == [str(other), "-m", "torch.distributed.run",
                                                         "--nproc_per_node"]


def test_progressive_script_runs_the_checkouts_venv(tmp_path):
    root = _checkout(tmp_path, "progressive_distillation.sh", venv=True)
    proc = _run_script(root, "progressive_distillation.sh", ["base", "p.jsonl", "work", "2"])
    assert proc.returncode == 0, proc.stderr
    ran = (root / "ran.txt").read_text().splitlines()
    assert len(ran) == 4 and all(r.startswith(f"{root}/.venv/bin/python -m torch.distributed.run --nproc_per_node 2 ")
                                 for r in ran)
    assert [r.split()[5] for r in ran] == ["tools/generate_trajectories.py", "pretrain_jf.py"] * 2
