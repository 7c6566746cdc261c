"""The launch scripts (``DRY_RUN=1``): the paper's two-round recipe (Sec. 4.1), every stage's command line
parses with the real parsers, resumable stages are skipped once done, and a forced batch change is announced."""
import os
import shlex
import subprocess
import sys

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
    sys.path.insert(0, os.path.join(REPO, "tools"))
    import generate_trajectories

    return name, generate_trajectories.parse_args(argv)


def test_h200_script_runs_the_papers_two_rounds(tmp_path):
    out, cmds = _dry(H200, WORK=str(tmp_path), BASE="ckpt/base")
    parsed = [_parse(c) for c in cmds]
    assert [n for n, _ in parsed] == ["generate_trajectories.py", "pretrain_jf.py"] * 2
    (_, t1), (_, r1), (_, t2), (_, r2) = parsed
    # trajectories: base model at n=16, then the round-1 model at n=32, max 2048 new tokens
    assert (t1.load, t1.block_size, t1.max_new_tokens) == ("ckpt/base", 16, 2048)
    assert (t2.load, t2.block_size, t2.max_new_tokens) == (r1.save, 32, 2048)
    # training rounds: (n, w) = (16, 16) then (32, 8), 10k steps each, on the matching trajectories
    assert (r1.block_size, r1.window_size, r1.train_steps, r1.data, r1.load) == (16, 16, 10000, [t1.out], "ckpt/base")
    assert (r2.block_size, r2.window_size, r2.train_steps, r2.data, r2.load) == (32, 8, 10000, [t2.out], r1.save)
    for r in (r1, r2):
        assert r.lr == 1e-6 and r.global_batch_size == 4 and r.micro_batch_size == 1
        assert r.noise_schedule == "progressive" and r.mask == "nc" and r.consistency_loss == "kl"
        assert r.pc_weight == 1.0 and r.ar_weight == 1.0 and r.pc_normalization == "paper"
        assert (r.tp, r.pp, r.sequence_parallel, r.use_distributed_optimizer) == (2, 1, True, True)
        assert r.overlap_grad_reduce and r.overlap_param_gather
        assert r.recompute_kwargs() == {"recompute_granularity": "full", "recompute_method": "uniform",
                                        "recompute_num_layers": 1}
        assert r.precision == "bf16" and r.use_megatron_optimizer
    assert "global batch" not in out.split("batch:")[0]  # one node: DP 4 x 1 = the paper's 4, nothing changed
    assert "4 samples per step = 1 microbatch(es) x 1 x DP 4" in out


def test_h200_script_announces_a_forced_global_batch_change(tmp_path):
    out, cmds = _dry(H200, WORK=str(tmp_path), NNODES="2")
    assert "note: global batch 4 -> 8" in out and "8 x 1 on 16 GPUs" in out
    assert {_parse(c)[1].global_batch_size for c in cmds if _split(c)[0] == "pretrain_jf.py"} == {8}
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
    assert cfg.block_size == 32 and cfg.eval_interval == 100 and cfg.valid_data == ["v"]
    assert not (tmp_path / "traj2.done").exists()  # a dry run marks nothing done


def test_h200_script_official_code_values_are_one_switch_away(tmp_path):
    _, cmds = _dry(H200, WORK=str(tmp_path), AR_WEIGHT="10", PC_NORMALIZATION="reference", LR="1e-5")
    cfg = _parse(cmds[1])[1]
    assert (cfg.ar_weight, cfg.pc_normalization, cfg.lr) == (10.0, "reference", 1e-5)


@pytest.mark.parametrize("nproc,gbs", [("1", 4), ("4", 4), ("3", 6)])
def test_progressive_script_defaults_to_the_paper(tmp_path, nproc, gbs):
    out, cmds = _dry(PROGRESSIVE, ["base", "p.jsonl", str(tmp_path), nproc])
    parsed = [_parse(c) for c in cmds]
    assert [n for n, _ in parsed] == ["generate_trajectories.py", "pretrain_jf.py"] * 2
    (_, t1), (_, r1), (_, t2), (_, r2) = parsed
    assert (t1.block_size, r1.block_size, r1.window_size, t2.block_size, r2.block_size, r2.window_size) == (
        16, 16, 16, 32, 32, 8)
    assert t1.max_new_tokens == 2048 and r1.lr == 1e-6 and r2.load == r1.save and t2.load == r1.save
    assert r1.global_batch_size == gbs and (("note: global batch 4 -> 6" in out) == (gbs == 6))
