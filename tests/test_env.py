"""The library's environment variables (issue 34): read in one module, ``megatron_jf/env.py``, with one parse rule per
kind; the earlier ``JF_*`` names still read; ``InferenceOptions`` resolving explicit > variable > device default;
README's table generated from the registry; the ``--inference-*`` flag group building ``InferenceOptions``."""
import logging
import os
import pathlib
import re
import subprocess
import sys
import types

import pytest

from megatron_jf import cli, env

REPO = pathlib.Path(__file__).resolve().parent.parent
CPU, CUDA = types.SimpleNamespace(type="cpu"), types.SimpleNamespace(type="cuda")  # torch.device-like


@pytest.fixture
def clean_env(monkeypatch):
    """No library variable (nor an earlier name) set."""
    for v in env.VARIABLES.values():
        for name in (v.name, *v.old_names):
            monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(env, "_warned", set())
    return monkeypatch


# ------------------------------------------------------------------------------------------------ parse rules
@pytest.mark.parametrize("word", ["1", "true", "on", "yes", "TRUE", " On ", "Yes"])
def test_a_switch_reads_every_on_word(word):
    assert env.parse("MEGATRON_JF_DISABLE_TE", word) is True
    assert env.parse("MEGATRON_JF_LEAN_FORWARD", word) is True


@pytest.mark.parametrize("word", ["0", "false", "off", "no", "FALSE", " Off", "No"])
def test_a_switch_reads_every_off_word(word):
    assert env.parse("MEGATRON_JF_DISABLE_TE", word) is False
    assert env.parse("MEGATRON_JF_LEAN_FORWARD", word) is False


def test_unset_or_blank_is_the_default():
    assert env.parse("MEGATRON_JF_LEAN_FORWARD", None) is True
    assert env.parse("MEGATRON_JF_LEAN_FORWARD", "  ") is True
    assert env.parse("MEGATRON_JF_DISABLE_TE", "") is False
    assert env.parse("MEGATRON_JF_CPU_BF16", None) is None  # tri-state: the CPU decides
    assert env.parse("MEGATRON_JF_LEAN_GEMV", "") is None
    assert env.parse("MEGATRON_JF_MR_VERIFY", None) == "auto"


@pytest.mark.parametrize("name,bad", [("MEGATRON_JF_LEAN_FORWARD", "2"), ("MEGATRON_JF_DISABLE_TE", "enabled"),
                                      ("MEGATRON_JF_CUDA_GRAPHS", "y"), ("MEGATRON_JF_CPU_BF16", "maybe"),
                                      ("MEGATRON_JF_VLLM_UNTESTED_OK", "ok")])
def test_a_bad_switch_value_names_the_variable_and_its_words(name, bad):
    with pytest.raises(ValueError) as e:
        env.parse(name, bad)
    msg = str(e.value)
    assert msg.startswith(f"{name} must be ") and repr(bad) in msg
    assert all(w in msg for w in env.ON + env.OFF)


def test_a_switch_with_an_extra_word():
    assert env.parse("MEGATRON_JF_STATIC_DECODE", "Force") == "force"
    assert env.parse("MEGATRON_JF_STATIC_DECODE", "0") is False
    with pytest.raises(ValueError, match="MEGATRON_JF_STATIC_DECODE must be .* or force, got 'forced'"):
        env.parse("MEGATRON_JF_STATIC_DECODE", "forced")
    with pytest.raises(ValueError):  # only the switch that takes it
        env.parse("MEGATRON_JF_CUDA_GRAPHS", "force")


def test_a_choice_takes_its_words_only():
    assert env.parse("MEGATRON_JF_LEAN_GEMV", "OUT") == "out"
    assert env.parse("MEGATRON_JF_MR_VERIFY", "tree") == "tree"
    with pytest.raises(ValueError, match=r"^MEGATRON_JF_LEAN_GEMV must be all, out or none, got 'some'$"):
        env.parse("MEGATRON_JF_LEAN_GEMV", "some")
    with pytest.raises(ValueError, match=r"^MEGATRON_JF_MR_VERIFY must be auto, tree or pruned, got '1'$"):
        env.parse("MEGATRON_JF_MR_VERIFY", "1")


def test_a_path_is_kept_as_given(tmp_path):
    assert env.parse("MEGATRON_JF_SANDBOX_PYTHON", " /Opt/Py/bin/Python3 ") == "/Opt/Py/bin/Python3"
    assert env.parse("MEGATRON_JF_SANDBOX_PYTHON", "0") == "0"  # not a path that can be switched off
    assert env.cost_cache_dir({"MEGATRON_JF_COST_CACHE": "Off"}) is None
    assert env.cost_cache_dir({"MEGATRON_JF_COST_CACHE": str(tmp_path)}) == str(tmp_path)
    assert env.cost_cache_dir({"XDG_CACHE_HOME": str(tmp_path)}) == str(tmp_path / "megatron_jf")
    assert env.cost_cache_dir({}) == os.path.join(os.path.expanduser("~"), ".cache", "megatron_jf")


def test_accessors_read_the_process_environment(clean_env):
    assert env.lean_forward() is True and env.cuda_graphs() is True and env.lean_packed() is True
    clean_env.setenv("MEGATRON_JF_LEAN_FORWARD", "off")
    clean_env.setenv("MEGATRON_JF_LEAN_PACKED", "no")
    clean_env.setenv("MEGATRON_JF_CUDA_GRAPHS", "false")
    clean_env.setenv("MEGATRON_JF_LEAN_GEMV", "none")
    assert (env.lean_forward(), env.lean_packed(), env.cuda_graphs(), env.lean_gemv()) == (False, False, False, "none")
    clean_env.setenv("MEGATRON_JF_LEAN_FORWARD", "banana")
    with pytest.raises(ValueError, match="MEGATRON_JF_LEAN_FORWARD"):
        env.lean_forward()


def test_te_switches_and_cpu_bf16_follow_the_rule(clean_env):
    import megatron_jf.platform as platform
    from megatron_jf import precision

    assert platform.TESwitches.from_env({"MEGATRON_JF_DISABLE_TE": "true", "MEGATRON_JF_TE_ARBITRARY_MASK": "no"}) == \
        platform.TESwitches(disable=True, arbitrary_mask=False)
    assert platform.TESwitches.from_env({}) == platform.TESwitches()
    with pytest.raises(ValueError, match="MEGATRON_JF_TE_ARBITRARY_MASK"):
        platform.TESwitches.from_env({"MEGATRON_JF_TE_ARBITRARY_MASK": "2"})
    clean_env.setattr(precision, "cpu_bf16_feature", lambda *a: None)
    assert precision.cpu_bf16_supported() is False  # unset: the CPU's flags
    clean_env.setenv("MEGATRON_JF_CPU_BF16", "yes")
    assert precision.cpu_bf16_supported() is True
    clean_env.setattr(precision, "cpu_bf16_feature", lambda *a: "amx_bf16")
    clean_env.setenv("MEGATRON_JF_CPU_BF16", "0")
    assert precision.cpu_bf16_supported() is False


# ------------------------------------------------------------------------------------------------ earlier names
@pytest.mark.parametrize("old,new,value,read", [
    ("JF_SANDBOX_PYTHON", "MEGATRON_JF_SANDBOX_PYTHON", "/x/python3", env.sandbox_python),
    ("JF_VLLM_PYTHON", "MEGATRON_JF_VLLM_PYTHON", "/envs/vllm/bin/python", env.vllm_python),
    ("JF_VLLM_UNTESTED_OK", "MEGATRON_JF_VLLM_UNTESTED_OK", "1", env.vllm_untested_ok),
])
def test_an_earlier_name_is_still_read_with_one_warning(clean_env, caplog, old, new, value, read):
    expect = env.parse(new, value)
    assert read() == env.VARIABLES[new].default
    clean_env.setenv(old, value)
    with caplog.at_level(logging.WARNING, logger="megatron_jf.env"):
        assert read() == expect
        assert read() == expect
    warned = [r.getMessage() for r in caplog.records if r.name == "megatron_jf.env"]
    assert warned == [f"{old} is deprecated: set {new} instead (the old name is still read)"]
    other = "/y/python" if env.VARIABLES[new].kind == "path" else "0"
    clean_env.setenv(new, other)  # the new name wins
    assert read() == env.parse(new, other)


def test_the_sandbox_and_the_vllm_gate_read_both_names(clean_env, tmp_path):
    from megatron_jf.eval import sandbox
    from megatron_jf.vllm_plugin import vllm_internals

    py = tmp_path / "python3"
    py.write_text("")
    clean_env.setenv("JF_SANDBOX_PYTHON", str(py))
    assert sandbox.sandbox_python() == os.path.realpath(py)
    clean_env.delenv("JF_SANDBOX_PYTHON")
    clean_env.setenv("MEGATRON_JF_SANDBOX_PYTHON", str(py))
    assert sandbox.sandbox_python() == os.path.realpath(py)
    with pytest.raises(vllm_internals.UnsupportedVLLMError):
        vllm_internals.check_version("0.0.1")
    clean_env.setenv("JF_VLLM_UNTESTED_OK", "1")
    assert vllm_internals.check_version("0.0.1") == "0.0.1"


# ------------------------------------------------------------------------------------------------ one reader
def test_the_registry_uses_one_prefix_and_documents_every_variable():
    assert env.VARIABLES and all(n.startswith("MEGATRON_JF_") and v.name == n for n, v in env.VARIABLES.items())
    assert all(v.meaning and "\n" not in v.meaning for v in env.VARIABLES.values())
    with pytest.raises(ValueError, match="MEGATRON_JF_"):
        env.Var("JF_NEW", "switch", False, "x")


def test_only_env_py_reads_library_variables():
    """No module of the library but env.py reads a ``MEGATRON_JF_*`` / ``JF_*`` variable (process-wide names such as
    ``WORLD_SIZE`` are read where they are used); every ``MEGATRON_JF_*`` name the library mentions is registered."""
    read = re.compile(r"""(environ(\.get)?\s*[\[(]|getenv\()\s*["'](MEGATRON_)?JF_""")
    named = re.compile(r"\bMEGATRON_JF_[A-Z0-9_]*[A-Z0-9]\b")
    offenders, unknown = [], set()
    for path in (REPO / "megatron_jf").rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        if path.name != "env.py" and read.search(text):
            offenders.append(str(path.relative_to(REPO)))
        unknown |= set(named.findall(text)) - set(env.VARIABLES)
    assert not offenders, offenders
    assert not unknown, sorted(unknown)


def test_importing_env_is_cheap():
    out = subprocess.run([sys.executable, "-c", "import sys, megatron_jf.env, megatron_jf.inference.options; "
                          "print(sorted(m for m in ('torch', 'megatron', 'numpy') if m in sys.modules))"],
                         capture_output=True, text=True, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr[-2000:]


def test_readme_table_is_the_registry():
    """README's table of variables is :func:`env.markdown_table` (regenerate it from the registry after a change)."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    m = re.search(r"<!-- generated by megatron_jf\.env\.markdown_table\(\)[^\n]*-->\n(.*?)<!-- end of the generated "
                  r"table -->", text, re.S)
    assert m, "README.md lost the markers of the generated table"
    assert m.group(1) == env.markdown_table()
    rows = env.markdown_table().splitlines()[2:]
    assert [r.split("`")[1] for r in rows] == list(env.VARIABLES)


# ------------------------------------------------------------------------------------------------ InferenceOptions
def test_inference_options_check_their_fields():
    from megatron_jf.inference.options import InferenceOptions

    with pytest.raises(ValueError, match="unknown forward impl 'fast'; choose one of auto, lean, static, megatron"):
        InferenceOptions(forward="fast")
    with pytest.raises(ValueError, match="unknown gemv mode 'some'"):
        InferenceOptions(gemv="some")
    with pytest.raises(ValueError, match="unknown mr verify mode 'fast'"):
        InferenceOptions(mr_verify="fast")
    with pytest.raises(ValueError, match="cuda_graphs must be True, False or None"):
        InferenceOptions(cuda_graphs="on")


def test_explicit_beats_variable_beats_device_default(clean_env):
    from megatron_jf.inference import options as o

    # device defaults
    assert not o.static_decode_on(CPU) and o.static_decode_on(CUDA)
    assert not o.cuda_graphs_on(CPU) and o.cuda_graphs_on(CUDA)
    assert o.mr_verify_mode("auto", CPU) == "pruned" and o.mr_verify_mode(None, CUDA) == "tree"
    assert o.gemv_mode("auto") == "" and o.lean_packed_on() is True and o.lean_forward_on() is True
    # the variable over the device default
    clean_env.setenv("MEGATRON_JF_STATIC_DECODE", "force")
    clean_env.setenv("MEGATRON_JF_CUDA_GRAPHS", "0")
    clean_env.setenv("MEGATRON_JF_MR_VERIFY", "tree")
    clean_env.setenv("MEGATRON_JF_LEAN_GEMV", "out")
    clean_env.setenv("MEGATRON_JF_LEAN_PACKED", "off")
    assert o.static_decode_on(CPU) and not o.cuda_graphs_on(CUDA)
    assert o.mr_verify_mode("auto", CPU) == "tree" and o.gemv_mode(None) == "out" and o.lean_packed_on() is False
    clean_env.setenv("MEGATRON_JF_STATIC_DECODE", "off")
    assert not o.static_decode_on(CUDA)
    # the explicit value over the variable
    assert o.static_decode_on(CUDA, True) and o.static_decode_on(CPU, True)
    clean_env.setenv("MEGATRON_JF_STATIC_DECODE", "force")
    assert not o.static_decode_on(CPU, False)
    assert o.cuda_graphs_on(CUDA, True) and not o.cuda_graphs_on(CUDA, False)
    assert o.mr_verify_mode("pruned", CUDA) == "pruned" and o.gemv_mode("all") == "all"
    assert o.lean_packed_on(True) is True
    with pytest.raises(ValueError, match="from the argument"):
        o.mr_verify_mode("fast", CPU)


# ------------------------------------------------------------------------------------------------ --inference-*
def _inference_parser():
    p = cli.parser("t")
    cli.add_inference_args(p)
    return p


def test_one_flag_per_field_with_auto_defaults():
    import dataclasses

    from megatron_jf.inference.options import InferenceOptions

    flags = cli.option_strings(_inference_parser())
    fields = [f.name for f in dataclasses.fields(InferenceOptions)]
    assert {d: s[0] for d, s in flags.items() if d != "help"} == \
        {f"inference_{f}": "--inference-" + f.replace("_", "-") for f in fields}
    assert flags["inference_mr_verify"][1:] == ("--mr-verify",)  # the earlier spellings
    assert flags["inference_gemv"][1:] == ("--lean-gemv",) and flags["inference_cuda_graphs"][1:] == ("--cuda-graphs",)
    assert cli.inference_options(_inference_parser().parse_args([])) == InferenceOptions()
    helptext = " ".join(_inference_parser().format_help().split())
    assert helptext.count("(default: auto)") == len(fields) and "MEGATRON_JF_MR_VERIFY" in helptext


@pytest.mark.parametrize("argv,field,value", [
    (["--inference-forward", "static"], "forward", "static"),
    (["--inference-forward", "megatron"], "forward", "megatron"),
    (["--inference-static-decode", "on"], "static_decode", True),
    (["--inference-static-decode", "off"], "static_decode", False),
    (["--inference-cuda-graphs", "off"], "cuda_graphs", False),
    (["--cuda-graphs", "on"], "cuda_graphs", True),
    (["--inference-gemv", "none"], "gemv", "none"),
    (["--lean-gemv", "all"], "gemv", "all"),
    (["--inference-lean-packed", "off"], "lean_packed", False),
    (["--inference-mr-verify", "tree"], "mr_verify", "tree"),
    (["--mr-verify", "pruned"], "mr_verify", "pruned"),
    (["--inference-cuda-graphs", "auto"], "cuda_graphs", None),
])
def test_a_flag_round_trips_into_inference_options(argv, field, value):
    import dataclasses

    from megatron_jf.inference.options import InferenceOptions

    got = cli.inference_options(_inference_parser().parse_args(argv))
    assert got == dataclasses.replace(InferenceOptions(), **{field: value})


@pytest.mark.parametrize("argv", [["--inference-forward", "fast"], ["--inference-static-decode", "yes"],
                                  ["--inference-gemv", "some"], ["--mr-verify", "bogus"]])
def test_a_bad_flag_value_is_an_argument_error(argv, capsys):
    with pytest.raises(SystemExit) as e:
        _inference_parser().parse_args(argv)
    assert e.value.code == 2 and argv[0] in capsys.readouterr().err
