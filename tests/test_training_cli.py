"""The ``pretrain_jf.py`` command line: Megatron-LM aliases parse to the same config, every option documents
its default. No model or process group is built here."""
import argparse

import pytest

BASE = ["--block-size", "4", "--hf-config", "x"]


def _parse(argv):
    from megatron_jf.training.config import parse_config

    return parse_config(argv)


@pytest.mark.parametrize("ours,megatron", [
    (["--tp", "2"], ["--tensor-model-parallel-size", "2"]),
    (["--pp", "2"], ["--pipeline-model-parallel-size", "2"]),
    (["--train-steps", "7"], ["--train-iters", "7"]),
    (["--warmup-steps", "3"], ["--lr-warmup-iters", "3"]),
    (["--data", "a", "b"], ["--data-path", "a", "b"]),
    (["--valid-data", "v"], ["--valid-data-path", "v"]),
    (["--tokenizer", "tok"], ["--tokenizer-model", "tok"]),
    (["--precision", "bf16"], ["--bf16"]),
])
def test_megatron_lm_aliases_parse_to_the_same_config(ours, megatron):
    def full(extra):
        argv = list(BASE)
        if "--data" not in extra and "--data-path" not in extra:
            argv += ["--data", "d"]
        if "--train-steps" not in extra and "--train-iters" not in extra:
            argv += ["--train-steps", "10"]
        return argv + extra

    a, b = _parse(full(ours)), _parse(full(megatron))
    assert a == b
    assert a != _parse(full([]))  # the option really changed something


def test_bf16_alias_does_not_override_an_explicit_precision_default():
    cfg = _parse([*BASE, "--data", "d", "--train-steps", "1"])
    assert cfg.runtime.precision == "auto"
    assert _parse([*BASE, "--data", "d", "--train-steps", "1", "--bf16"]).runtime.precision == "bf16"


def test_every_option_has_help_that_shows_its_default():
    from megatron_jf.training.config import FIELD_PART, build_parser

    p = build_parser()
    fmt = p._get_formatter()
    names = set(FIELD_PART)
    seen = set()
    for action in p._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help and action.help.strip(), f"{action.option_strings} has no help"
        shown = fmt._get_help_string(action)
        if "%(default)" in shown:
            shown = shown % {"default": action.default}
        assert "default:" in shown.lower() or "(required)" in shown, (action.option_strings, shown)
        seen.add(action.dest)
    # every option maps onto a TrainConfig field (parse_config would silently drop it otherwise)
    assert seen <= names, seen - names
    text = p.format_help()
    assert "--tensor-model-parallel-size" in text and "(default: 1)" in text


def test_transformer_impl_flag():
    """Megatron-LM's --transformer-impl picks the layer spec; asking for TE where it cannot run is refused by name."""
    from megatron_jf import platform

    base = BASE + ["--data", "d", "--train-steps", "2"]
    assert _parse(base).runtime.transformer_impl == "auto"
    assert _parse(base + ["--transformer-impl", "local"]).runtime.transformer_impl == "local"
    if not (platform.HAVE_TE and platform.HAVE_CUDA):
        with pytest.raises(ValueError, match="--transformer-impl transformer_engine needs Transformer Engine"):
            _parse(base + ["--transformer-impl", "transformer_engine"])
