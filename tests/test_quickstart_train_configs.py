"""The quickstart's training stages run ``pretrain_jf.py`` with ``cli.to_argv`` of the ``TrainConfig`` that
``recipes/quickstart/presets.py`` builds for each stage. These configs must be exactly the ones the stages ran
before, when they wrote the argv by hand (the smoke run's golden figures depend on them): for every preset, stage
and round, and for recipe variants, the old hand-built argv (kept below as it was in ``pipeline.py``) and the new one
parse to the same ``TrainConfig``, field by field. Torch-free."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from megatron_jf import cli
from megatron_jf.training.config import parse_config
from recipes.quickstart import presets as PS
from recipes.quickstart.presets import AR_TARGETS

OUT = Path("/work/runs/q")


# ----------------------------------------------------------------------------- the stages' argv before the configs
def _precision(p, cpu_bf16: bool) -> list:
    if p.precision == "auto":
        return ["--precision", "bf16"] if cpu_bf16 else []
    return ["--precision", "bf16"] if p.precision == "bf16" else []


def _argv(args) -> list[str]:
    """``Pipeline.run``'s formatting: floats as ``%g``, the rest as ``str``."""
    return [f"{a:g}" if isinstance(a, float) else str(a) for a in args]


def old_base_argvs(p, out: Path, cpu_bf16: bool, cfg_dir: Path) -> list[list[str]]:
    """``Pipeline.stage_base``'s ``pretrain_jf.py`` argv (one or two passes) before ``base_train_config``."""
    second = p.pretrain_second_pass_steps
    first_dir = out / ("base_pass1" if second else "base")
    common = [*_precision(p, cpu_bf16), "--tokenizer", out / "tokenizer",
              "--data", out / "tokens_train.npy", "--valid-data", out / "tokens_heldout.npy",
              "--seq-length", p.pretrain_seq, "--micro-batch-size", p.pretrain_mbs, "--weight-decay", 0.1,
              "--threads", p.threads]
    runs = [["--objective", "ar", "--hf-config", cfg_dir, *common,
             "--train-steps", p.pretrain_steps, "--lr", p.pretrain_lr, "--min-lr", p.pretrain_lr / 10,
             "--warmup-steps", max(1, p.pretrain_steps // 20),
             "--save", first_dir, "--save-interval", max(10, p.pretrain_steps // 4),
             "--log-interval", max(1, p.pretrain_steps // 20), "--log-file", out / "base_log.jsonl"]]
    if second:
        runs.append(["--objective", "ar", "--load", first_dir, *common,
                     "--train-steps", second, "--lr", p.pretrain_lr / 10, "--min-lr", p.pretrain_lr / 100,
                     "--warmup-steps", 1, "--save", out / "base", "--save-interval", max(10, second // 2),
                     "--log-interval", max(1, second // 10), "--log-file", out / "base_pass2_log.jsonl"])
    return [_argv(r) for r in runs]


def old_jf_argv(p, stage: str, out: Path, cpu_bf16: bool) -> list[str]:
    """``Pipeline.stage_jf``'s ``pretrain_jf.py`` argv before ``jf_train_config``."""
    init, data, n, w, steps = (("base", "traj1", p.n1, p.w1, p.jf1_steps) if stage == "jf1"
                               else ("jf1", "traj2", p.n2, p.w2, p.jf2_steps))
    lr, ar_weight, anchor_weight = p.round_recipe(stage)
    anchor = []
    if p.ar_target not in AR_TARGETS:
        raise ValueError(f"ar_target must be one of {', '.join(AR_TARGETS)}, got {p.ar_target!r}")
    if p.ar_target in ("ground_truth", "both"):
        if anchor_weight > 0:
            raise ValueError("corpus anchor")
        gt_weight = ar_weight if p.jf_gt_weight is None else p.jf_gt_weight
        anchor = ["--anchor-data", out / "tokens_gt_train.npy", "--anchor-weight", gt_weight,
                  "--anchor-seq-length", p.pretrain_seq, "--anchor-micro-batch-size", p.anchor_mbs]
        if p.ar_target == "ground_truth":
            ar_weight = 0.0
    elif anchor_weight > 0:
        anchor = ["--anchor-data", out / "tokens_train.npy", "--anchor-weight", anchor_weight,
                  "--anchor-seq-length", p.pretrain_seq, "--anchor-micro-batch-size", p.anchor_mbs]
    recipe = ["--consistency-positions", p.consistency_positions, "--consistency-loss", p.jf_consistency_loss]
    recipe += ["--seed", p.jf_seed] if p.jf_seed is not None else []
    recipe += ["--resample-noise-per-epoch"] if p.resample_noise else []
    recipe += ["--group-by-length"] if p.group_by_length else []
    return _argv(["--objective", "jf", *_precision(p, cpu_bf16), "--load", out / init,
                  "--data", out / data, *anchor, *recipe,
                  "--block-size", n, "--window-size", w, "--micro-batch-size", p.jf_mbs, "--train-steps", steps,
                  "--lr", lr, "--min-lr", lr * p.jf_min_lr_ratio, "--warmup-steps", max(1, steps // 20),
                  "--ar-weight", ar_weight, "--pc-weight", p.jf_pc_weight, "--save", out / stage,
                  "--save-interval", max(5, steps // p.jf_saves), "--log-interval", max(1, steps // 20),
                  "--threads", p.threads, "--log-file", out / f"{stage}_log.jsonl"])


# ----------------------------------------------------------------------------- the presets and variants compared
def _variants():
    out = {name: p for name, p in PS.PRESETS.items()}
    d, code = PS.PRESETS["default"], PS.PRESETS["code"]
    out.update({
        "default-gt": replace(d, ar_target="ground_truth", jf_gt_weight=None, jf_ar_weight=2.0),
        "default-gt-weight": replace(d, ar_target="both", jf_gt_weight=5.0),
        "default-self-seed": replace(d, ar_target="self", jf_seed=7, resample_noise=True, group_by_length=False,
                                     consistency_positions="all", jf_consistency_loss="hard", jf_min_lr_ratio=0.01),
        "default-bf16": replace(d, precision="bf16", pretrain_lr=1e-3 / 3, jf_lr=1.234567e-4),
        "code-round2": replace(code, jf2_lr=3e-5, jf2_ar_weight=4.0, jf2_anchor_weight=0.0, jf2_steps=96,
                               jf_pc_weight=0.0, threads=1, jf_saves=2),
        "code-fp32": replace(code, precision="fp32", jf_lr=1 / 7, pretrain_second_pass_steps=37),
        "smoke-threads": replace(PS.PRESETS["smoke"], threads=3, anchor_weight=0.3, anchor_mbs=2),
    })
    return out


VARIANTS = _variants()


@pytest.fixture(params=[False, True], ids=["cpu-fp32", "cpu-bf16"])
def cpu_bf16(request, monkeypatch):
    import megatron_jf.precision

    monkeypatch.setattr(megatron_jf.precision, "cpu_bf16_supported", lambda: request.param)
    return request.param


def _same(old_argv: list[str], cfg) -> None:
    old = parse_config(old_argv)
    new = parse_config(cli.to_argv(cfg))
    assert new == cfg  # the argv the stage runs parses back to the recipe's config
    assert old.flat() == new.flat()  # field by field: the stage trains exactly as before


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_pretraining_configs_equal_the_hand_built_argv(name, cpu_bf16):
    p = VARIANTS[name]
    if p.real:
        pytest.skip("model B is converted, not pretrained")
    cfg_dir = OUT / "base_config"
    old = old_base_argvs(p, OUT, cpu_bf16, cfg_dir)
    _same(old[0], PS.base_train_config(p, OUT, cfg_dir))
    second = PS.second_pass_train_config(p, OUT)
    assert (second is None) == (len(old) == 1)
    if second is not None:
        _same(old[1], second)


@pytest.mark.parametrize("stage", ["jf1", "jf2"])
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_jf_round_configs_equal_the_hand_built_argv(name, stage, cpu_bf16):
    p = VARIANTS[name]
    _same(old_jf_argv(p, stage, OUT, cpu_bf16), PS.jf_train_config(p, stage, OUT))


def test_the_derived_values_are_the_recipes():
    p = PS.PRESETS["smoke"]
    cfg = PS.jf_train_config(p, "jf1", OUT)
    assert cfg.optim.lr == p.jf_lr and cfg.optim.min_lr == p.jf_lr * p.jf_min_lr_ratio
    assert cfg.optim.warmup_steps == max(1, p.jf1_steps // 20) and cfg.checkpoint.save_interval == p.jf1_steps // 4
    base = PS.base_train_config(p, OUT, OUT / "base_config")
    assert base.optim.weight_decay == PS.PRETRAIN_WEIGHT_DECAY == 0.1
    assert base.optim.min_lr == 3e-4 != p.pretrain_lr / 10  # floats as the stages always passed them: %g
    with pytest.raises(ValueError, match="ar_target must be one of"):
        PS.jf_train_config(replace(p, ar_target="gt"), "jf1", OUT)
    with pytest.raises(ValueError, match="corpus anchor"):
        PS.jf_train_config(replace(PS.PRESETS["default"], anchor_weight=0.5), "jf1", OUT)
