"""``TrainConfig`` by concern: every field is declared once (in one part), each part checks itself with the same
allowed values argparse offers, checkpoints' saved configs (nested now, flat before) load back, and
``cli.to_argv`` is the inverse of the generated command line. Torch-free."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

import pytest

from megatron_jf import cli
from megatron_jf.config_fields import cli_field, leaves, part
from megatron_jf.training import config as C

BASE = ["--data", "d", "--train-steps", "10", "--block-size", "4", "--hf-config", "x"]


def test_every_field_is_declared_in_exactly_one_part():
    names = [path[-1] for path, _ in leaves(C.TrainConfig)]
    assert len(names) == len(set(names)) == len(C.FIELD_PART)
    assert all(len(path) == 2 for path, _ in leaves(C.TrainConfig))  # parts hold values, not parts
    # the loss functions' configuration is the objective part itself: one set of names
    from megatron_jf.training import losses

    assert losses.JFObjective is C.JFObjective and not hasattr(losses, "LossConfig")
    assert {"kl_temperature", "pc_weight", "ar_weight", "anchor_weight"} <= {f.name for f in
                                                                             dataclasses.fields(C.JFObjective)}


def test_each_part_is_an_argument_group():
    titles = {g.title for g in C.build_parser()._action_groups}
    for f in dataclasses.fields(C.TrainConfig):
        assert f.metadata["cli"]["title"] in titles


@pytest.mark.parametrize("part_cls,field,bad", [
    (C.DataConfig, "noise_schedule", "zigzag"), (C.JFObjective, "mask", "causal"),
    (C.RuntimeConfig, "precision", "fp8"), (C.DataConfig, "objective", "mlm")])
def test_a_part_checks_its_choices_with_the_tuple_argparse_offers(part_cls, field, bad):
    cfg = C.TrainConfig.from_flat(data=["d"], train_steps=1, block_size=4, hf_config="x")
    allowed = next(f for f in dataclasses.fields(part_cls) if f.name == field).metadata["cli"]["choices"]
    action = next(a for a in C.build_parser()._actions if a.dest == field)
    assert action.metavar == "{" + ",".join(allowed) + "}"
    setattr(getattr(cfg, C.FIELD_PART[field]), field, bad)
    with pytest.raises(ValueError, match=f"unknown {field.replace('_', ' ')} '{bad}'; choose one of"):
        cfg.validate()
    with pytest.raises(SystemExit):
        C.build_parser().parse_args(BASE + [cli.flag_name(field), bad])


def test_from_flat_and_old_flat_checkpoint_config_load():
    cfg = C.parse_config(BASE + ["--lr", "3e-4", "--tp", "2", "--sequence-parallel", "--kl-temperature", "2"])
    assert cfg.optim.lr == 3e-4 and cfg.parallel.tp == 2 and cfg.jf.kl_temperature == 2.0
    assert C.TrainConfig.from_json(cfg.to_json()) == cfg  # what the trainer saves now
    old = dict(cfg.flat())  # what checkpoints saved before the parts: one flat dict, plus a removed option
    old["some_removed_option"] = 1
    assert C.TrainConfig.from_json(old) == cfg
    assert C.TrainConfig.from_flat(**cfg.flat()) == cfg
    with pytest.raises(TypeError, match="no field bogus"):
        C.TrainConfig.from_flat(bogus=1)


# ----------------------------------------------------------------------------- to_argv
@pytest.mark.parametrize("argv", [
    BASE,
    BASE + ["--bf16", "--tp", "2", "--sequence-parallel", "--no-progress", "--use-megatron-optimizer"],
    BASE + ["--precision", "fp32", "--lr", "3e-05", "--min-lr", "3.0000000000000004e-06", "--warmup-steps", "0"],
    BASE + ["--recompute-granularity", "selective", "--recompute-modules", "mlp", "core_attn", "--seed", "-3"],
    BASE + ["--anchor-data", "a.npy", "b.npy", "--anchor-weight", "0.25", "--valid-data", "v", "--eval-interval",
            "5", "--no-use-megatron-optimizer", "--no-variable-seq-lengths", "--pp", "2"],
    ["--objective", "ar", "--data-path", "t.npy", "--seq-length", "64", "--train-iters", "3", "--load", "ck",
     "--tensor-model-parallel-size", "2", "--tokenizer-model", "tok", "--threads", "2", "--save", "s",
     "--save-interval", "1", "--lr-warmup-iters", "1"],
])
@pytest.mark.parametrize("defaults", [False, True])
def test_to_argv_round_trips_train_configs(argv, defaults):
    cfg = C.parse_config(argv)
    again = cli.to_argv(cfg, defaults=defaults)
    assert C.parse_config(again) == cfg
    if not defaults:  # only what differs from the defaults, required flags always
        assert "--train-steps" in again and "--data" in again and "--window-size" not in again


def test_to_argv_spells_flags_as_the_parser_does():
    cfg = C.parse_config(BASE + ["--bf16", "--tensor-model-parallel-size", "2", "--no-progress", "--seed", "-3"])
    argv = cli.to_argv(cfg)
    assert argv[argv.index("--precision") + 1] == "bf16" and "--bf16" not in argv  # the field's own flag
    assert argv[argv.index("--tp") + 1] == "2" and "--no-progress" in argv  # a shared Option's first spelling
    assert "--seed=-3" in argv  # a value that looks like a flag


@dataclass
class _Inner:
    """A part."""

    names: list[str] | None = None
    """names"""
    size: int = cli_field(3, "--size-alias")
    """size"""


@dataclass
class _Outer:
    """A config with every kind of field."""

    flag: bool = False
    """a switch"""
    on: bool = True
    """a switch on by default"""
    auto: bool | None = cli_field(None, tristate=True)
    """auto/on/off"""
    kind: str = cli_field("a", choices=("a", "b"), const_aliases={"--bee": "b"})
    """a choice with a switch"""
    ratio: float = 0.1
    """a float"""
    maybe: int | None = None
    """optional"""
    values: list[int] = dataclasses.field(default_factory=lambda: [1, 2])
    """a list"""
    inner: _Inner = part(_Inner, "inner things")


@pytest.mark.parametrize("cfg", [
    _Outer(),
    _Outer(flag=True, on=False, auto=False, kind="b", ratio=1 / 3, maybe=-2, values=[5], inner=_Inner(["x", "y"], 7)),
    _Outer(auto=True, values=[0, 0, 0], inner=_Inner(size=-1)),
])
def test_to_argv_inverts_add_dataclass_arguments(cfg):
    p = argparse.ArgumentParser()
    cli.add_dataclass_arguments(p, _Outer)
    for defaults in (False, True):
        assert cli.dataclass_from_args(_Outer, p.parse_args(cli.to_argv(cfg, defaults=defaults))) == cfg
    assert cli.to_argv(_Outer()) == []
    assert "--bee" in p.format_help() and "inner things" in p.format_help()


def test_to_argv_refuses_what_the_command_line_cannot_spell():
    with pytest.raises(ValueError, match="empty list"):
        cli.to_argv(_Outer(values=[]))
    with pytest.raises(ValueError, match="choose one of a, b"):
        cli.to_argv(_Outer(kind="c"))
    with pytest.raises(ValueError, match="None has no command-line form"):
        cli.to_argv(_Outer(ratio=None))
