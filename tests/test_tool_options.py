"""One definition per option (issue 25): every tool takes the decoder options from ``DecodeConfig`` with the same
defaults and help, the shared options (``--threads``, ``--max-new-tokens``, parallel sizes, tokenizer, precision)
with the same spellings -- ours, Megatron-LM's and vLLM's -- and defaults, ``pretrain_jf.py``'s flags are generated
from ``TrainConfig`` (help = the field's docstring, default = the field's), and no offered choice raises.

Parsers only: no model is built, nothing is loaded.
"""
import dataclasses
import os
import sys

import pytest

from tests.conftest import load_tool

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tool(name):
    return load_tool(name, "_opt")


def _parser(name):
    if name == "pretrain_jf":
        from megatron_jf.training.config import build_parser

        return build_parser()
    return _tool(name).build_parser()


REQUIRED = {
    "generate": ["--load", "ck"], "evaluate": ["--load", "ck"], "run_text_generation_server": ["--load", "ck"],
    "search_inference_config": ["--load", "ck"], "visualize_trajectory": ["--load", "ck", "--out", "o"],
    "generate_trajectories": ["--load", "ck", "--prompts", "p", "--out", "o"],
    "pretrain_jf": ["--data", "d", "--train-steps", "1"],
}
DECODER_TOOLS = ("generate", "evaluate", "run_text_generation_server", "search_inference_config")
JACOBI_TOOLS = ("generate_trajectories", "visualize_trajectory")  # block size and draft init only
GRID = {"block_size", "verification_size", "num_blocks", "spawn_threshold"}  # search_inference_config's grids


def _defaults(name):
    return vars(_parser(name).parse_args(REQUIRED[name]))


def _decode_config():
    from megatron_jf.cli import decode_config_class

    return decode_config_class()


@pytest.mark.parametrize("name", DECODER_TOOLS + JACOBI_TOOLS)
def test_decoder_options_come_from_decode_config(name):
    """Same flags, defaults and help in every tool: DecodeConfig's fields, defaults and docstring (decoder: mr)."""
    from megatron_jf.cli import DEFAULT_DECODER, field_docs, flag_name, help_text

    cls = _decode_config()
    fields = {f.name: f.default for f in dataclasses.fields(cls)}
    docs = field_docs(cls)
    offered = set(fields) if name in DECODER_TOOLS else {"block_size", "draft_init"}
    p = _parser(name)
    got = vars(p.parse_args(REQUIRED[name]))
    actions = {a.dest: a for a in p._actions}
    for f in offered:
        a = actions[f]
        assert flag_name(f) in a.option_strings, (name, f)
        assert a.help.startswith(help_text(docs[f], sys.modules[cls.__module__])), (name, f, a.help)
        want = DEFAULT_DECODER if f == "decoder" else fields[f]
        if name == "search_inference_config" and f in GRID:
            assert want in got[f], (name, f, got[f])  # the grid holds the default
        else:
            assert got[f] == want, (name, f, got[f], want)
    assert DEFAULT_DECODER == "mr"


@pytest.mark.parametrize("name", DECODER_TOOLS + JACOBI_TOOLS)
def test_every_offered_decoder_choice_builds_a_config(name):
    """No choice that raises: every --decoder / --draft-init value the parser accepts is a valid DecodeConfig."""
    from megatron_jf.cli import decode_config

    p = _parser(name)
    actions = {a.dest: a for a in p._actions}
    for dest, flag in (("decoder", "--decoder"), ("draft_init", "--draft-init")):
        if dest not in actions:
            continue
        values = actions[dest].metavar.strip("{}").split(",")
        assert values, (name, dest)
        for v in values:
            a = p.parse_args(REQUIRED[name] + [flag, v])
            if name == "search_inference_config":  # grids: one point of them
                a.block_size, a.verification_size, a.num_blocks, a.spawn_threshold = 16, 4, 2, 0.85
            assert getattr(decode_config(a), dest) == v


@pytest.mark.parametrize("name", ["generate", "evaluate", "run_text_generation_server", "search_inference_config",
                                  "generate_trajectories", "pretrain_jf"])
def test_threads_is_the_same_option_everywhere(name):
    p = _parser(name)
    a = next(a for a in p._actions if a.dest == "threads")
    assert a.option_strings == ["--threads"] and a.default is None  # torch's choice (OMP_NUM_THREADS)
    assert p.parse_args(REQUIRED[name] + ["--threads", "3"]).threads == 3


def test_max_new_tokens_default_is_shared():
    from megatron_jf.cli import DEFAULT_MAX_NEW_TOKENS

    for name in ("generate", "evaluate", "search_inference_config", "visualize_trajectory"):
        assert _defaults(name)["max_new_tokens"] == DEFAULT_MAX_NEW_TOKENS, name
    assert _defaults("generate_trajectories")["max_new_tokens"] == 1024  # training data: documented in its help


SPELLINGS = {  # concept -> (dest, [equivalent argument lists])
    "tp": ("tp", [["--tp", "2"], ["--tensor-model-parallel-size", "2"], ["--tensor-parallel-size", "2"]]),
    "pp": ("pipeline_model_parallel_size", [["--pp", "1"], ["--pipeline-model-parallel-size", "1"],
                                            ["--pipeline-parallel-size", "1"]]),
    "tokenizer": ("tokenizer", [["--tokenizer", "t"], ["--tokenizer-model", "t"]]),
    "max_new_tokens": ("max_new_tokens", [["--max-new-tokens", "7"], ["--num-tokens-to-generate", "7"]]),
    "bf16": ("params_dtype", [["--bf16"], ["--dtype", "bfloat16"]]),
    "fp16": ("params_dtype", [["--fp16"], ["--dtype", "float16"]]),
    "batch": ("batch_size", [["--batch-size", "3"], ["--micro-batch-size", "3"]]),
}
TOOL_CONCEPTS = {
    "generate": ("tp", "pp", "tokenizer", "max_new_tokens", "bf16", "fp16"),
    "evaluate": ("tp", "pp", "tokenizer", "max_new_tokens", "batch"),
    "run_text_generation_server": ("tp", "pp", "tokenizer", "bf16", "fp16"),
    "search_inference_config": ("tokenizer", "max_new_tokens", "batch"),
    "generate_trajectories": ("tp", "pp", "tokenizer", "max_new_tokens", "bf16", "fp16", "batch"),
    "visualize_trajectory": ("tokenizer", "max_new_tokens"),
}


@pytest.mark.parametrize("name,concept", [(n, c) for n, cs in TOOL_CONCEPTS.items() for c in cs])
def test_megatron_lm_and_vllm_spellings_are_accepted(name, concept):
    dest, spellings = SPELLINGS[concept]
    p = _parser(name)
    parsed = [vars(p.parse_args(REQUIRED[name] + s)) for s in spellings]
    assert all(x == parsed[0] for x in parsed[1:]), (name, concept, [x[dest] for x in parsed])
    if concept != "pp":  # pp: inference runs 1, the default
        assert parsed[0][dest] != _defaults(name)[dest]


def test_pretrain_and_convert_take_the_same_parallel_spellings():
    p = _parser("pretrain_jf")
    for flags, dest in ((SPELLINGS["tp"][1], "tp"), ([["--pp", "2"], ["--pipeline-model-parallel-size", "2"],
                                                      ["--pipeline-parallel-size", "2"]], "pp")):
        assert {getattr(p.parse_args(REQUIRED["pretrain_jf"] + f), dest) for f in flags} == {2}
    conv = _tool("convert_hf")
    for f in (["--tp", "2"], ["--tensor-model-parallel-size", "2"], ["--tensor-parallel-size", "2"]):
        assert conv.build_parser().parse_args(["hf-to-mcore", "--hf", "h", "--out", "o", *f]).tp == 2


# ---- pretrain_jf.py: generated from TrainConfig


def test_train_config_flags_are_its_fields_with_their_docstrings_and_defaults():
    from megatron_jf.cli import field_docs, help_text
    from megatron_jf.training import config as C

    p = C.build_parser()
    from megatron_jf.config_fields import leaves

    docs = {}
    for part in dataclasses.fields(C.TrainConfig):  # one documented dataclass per concern
        docs.update(field_docs(part.default_factory))
    fields = {path[-1]: f for path, f in leaves(C.TrainConfig)}
    by_dest = {}
    for a in p._actions:
        if a.option_strings and a.dest != "help" and a.default is not __import__("argparse").SUPPRESS:
            by_dest[a.dest] = a
    assert set(by_dest) == set(fields)  # one flag per field, no flag without a field
    for name, f in fields.items():
        a = by_dest[name]
        assert a.help == help_text(docs[name], C), name  # the docstring is the help: they cannot diverge
        assert "--" + name.replace("_", "-") in a.option_strings
        if not a.required:
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            assert a.default == default, name
    cfg = C.parse_config(REQUIRED["pretrain_jf"] + ["--block-size", "4", "--hf-config", "x"])
    flat = dict(cfg.flat(), data=[], train_steps=0, block_size=None, hf_config=None)
    assert C.TrainConfig.from_flat(**flat) == C.TrainConfig()


@pytest.mark.parametrize("flag,values", [
    ("--attention-path", None), ("--mask", None), ("--noise-schedule", None), ("--consistency-loss", None),
    ("--pc-normalization", None), ("--consistency-positions", None), ("--objective", None)])
def test_every_offered_training_choice_is_valid(flag, values):
    """No offered choice raises NotImplementedError; each passes validation (dense attention takes every mask)."""
    from megatron_jf.training.config import build_parser, parse_config

    a = next(a for a in build_parser()._actions if flag in a.option_strings)
    base = ["--data", "d", "--train-steps", "1", "--block-size", "4", "--hf-config", "x", "--seq-length", "64"]
    for v in a.metavar.strip("{}").split(","):
        extra = [flag, v]
        if flag == "--mask":
            extra += ["--attention-path", "dense"]
        parse_config(base + extra)


@pytest.mark.parametrize("name", DECODER_TOOLS + ("visualize_trajectory",))
def test_inference_forward_flags_in_every_inference_command(name):
    """The inference forward's switches are one ``--inference-*`` flag group in every command that loads a model for
    inference, with the same defaults (auto: the variable, else the device's choice) and spellings (the earlier
    ``--mr-verify``, ``--lean-gemv``, ``--cuda-graphs`` too)."""
    from megatron_jf.cli import inference_options
    from megatron_jf.inference.options import InferenceOptions

    assert inference_options(_parser(name).parse_args(REQUIRED[name])) == InferenceOptions()
    a = _parser(name).parse_args(REQUIRED[name] + ["--inference-forward", "lean", "--mr-verify", "pruned",
                                                   "--lean-gemv", "out", "--cuda-graphs", "on",
                                                   "--inference-static-decode", "off",
                                                   "--inference-lean-packed", "off"])
    assert inference_options(a) == InferenceOptions(forward="lean", mr_verify="pruned", gemv="out", cuda_graphs=True,
                                                    static_decode=False, lean_packed=False)
