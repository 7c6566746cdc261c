"""A damaged checkpoint stops every tool with one line naming the file and what is wrong (issue 25, "Errors that
name the file"): a truncated ``.distcp``, a missing ``common.pt`` or ``metadata.json``, a pointer file naming a
missing iteration, and foreign files (garbage where torch DCP's index or ``common.pt`` belongs).

The checkpoint is the real tiny one of :mod:`megatron_jf.models.zoo`, copied and damaged per case.
"""
import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import load_tool

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ITER = "iter_0000000"


def _truncate(ck):
    p = os.path.join(ck, ITER, "__0_0.distcp")
    os.truncate(p, os.path.getsize(p) // 2)
    return p, "truncated: "


def _drop(name, fragment):
    def damage(ck):
        p = os.path.join(ck, ITER, name)
        os.remove(p)
        return p, fragment
    return damage


def _pointer(ck):
    p = os.path.join(ck, "latest_checkpointed_iteration.txt")
    with open(p, "w") as f:
        f.write("7")
    return p, f"names '7' but {ck}/iter_0000007 is missing (complete iterations there: [0])"


def _garbage(name, fragment):
    def damage(ck):
        p = os.path.join(ck, ITER, name)
        with open(p, "wb") as f:
            f.write(b"not a checkpoint file\n" * 40)
        return p, fragment
    return damage


DAMAGE = {
    "truncated_distcp": _truncate,
    "missing_common_pt": _drop("common.pt", "missing (the common state"),
    "missing_metadata_json": _drop("metadata.json", "missing (dist_checkpointing's format file"),
    "pointer_to_missing_iteration": _pointer,
    "foreign_dcp_index": _garbage(".metadata", "not a torch distributed checkpoint index"),
    "foreign_common_pt": _garbage("common.pt", "not a torch.save archive"),
}
REQUIRED = ("truncated_distcp", "missing_common_pt", "missing_metadata_json", "pointer_to_missing_iteration")


@pytest.fixture(scope="module")
def good_ckpt(tmp_path_factory, mp1):
    from megatron_jf.models.zoo import build_tiny_checkpoint

    return build_tiny_checkpoint(str(tmp_path_factory.mktemp("ckerr")), max_pos=128, in_process=True)


def damaged(good_ckpt, tmp_path, kind):
    """A copy of the tiny checkpoint with ``kind`` applied; returns ``(dir, damaged file, message fragment)``."""
    if kind.endswith("common_pt") and not os.path.isfile(os.path.join(good_ckpt, ITER, "common.pt")):
        pytest.skip("megatron-core >= 0.17 keeps the common state inside the DCP files: there is no common.pt")
    ck = str(tmp_path / f"ck-{kind}")
    shutil.copytree(good_ckpt, ck)
    path, fragment = DAMAGE[kind](ck)
    return ck, path, fragment


def _assert_names_file(text, path, fragment):
    assert "\n" not in text.strip(), text
    assert f"{path}: " in text or f"{path} names" in text, text
    assert fragment in text, text


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_read_meta_names_the_damaged_file(good_ckpt, tmp_path, kind):
    from megatron_jf.checkpointing import read_meta
    from megatron_jf.load_errors import CheckpointFileError

    ck, path, fragment = damaged(good_ckpt, tmp_path, kind)
    with pytest.raises(CheckpointFileError) as e:
        read_meta(ck, verify=True)
    assert str(e.value).startswith(path)
    _assert_names_file(str(e.value), path, fragment)


def test_undecodable_weights_are_one_line_naming_the_directory(good_ckpt, tmp_path):
    """Garbage of the right size in a ``.distcp`` passes the file checks; megatron-core's failure becomes one line."""
    from megatron_jf.checkpointing import load_model
    from megatron_jf.load_errors import CheckpointFileError

    ck = str(tmp_path / "ck")
    shutil.copytree(good_ckpt, ck)
    p = os.path.join(ck, ITER, "__0_0.distcp")
    with open(p, "r+b") as f:
        f.write(b"\0" * os.path.getsize(p))
    with pytest.raises(CheckpointFileError) as e:
        load_model(ck)
    msg = str(e.value)
    assert msg.startswith(os.path.join(ck, ITER) + ": cannot load the distributed checkpoint (") and "\n" not in msg


def test_the_intact_checkpoint_still_loads(good_ckpt):
    from megatron_jf.checkpointing import load_model, read_meta

    model, margs, meta = load_model(good_ckpt)
    assert meta["iteration"] == 0 and margs.max_position_embeddings == 128
    assert read_meta(good_ckpt)["path"].endswith(ITER)


# ---- every tool: one line, naming the file


def _tool(name):
    return load_tool(name, "_ckerr")


def _run_generate_trajectories(ck, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt_ids": [1, 2, 3]}\n')
    msg = _returns_2("generate_trajectories", lambda ck, t: ["--prompts", str(prompts), "--load", ck, "--out",
                                                            str(t / "traj"), "--no-progress"])(ck, tmp_path, capsys)
    assert not (tmp_path / "traj").exists()  # stopped before any output
    return msg


def _returns_2(name, argv):
    def run(ck, tmp_path, capsys):
        assert _tool(name).main(argv(ck, tmp_path)) == 2
        err = capsys.readouterr().err.strip().splitlines()
        errors = [line for line in err if "error" in line]
        assert len(errors) == 1, err
        return errors[0]
    return run


def _run_convert(ck, tmp_path, capsys):
    msg = _returns_2("convert_hf", lambda ck, t: ["mcore-to-hf", "--load", ck, "--out", str(t / "hf")])(ck, tmp_path,
                                                                                                     capsys)
    assert not (tmp_path / "hf").exists()
    return msg


TOOLS = {
    "generate": _returns_2("generate", lambda ck, t: ["--load", ck, "--prompt", "hi", "--max-new-tokens", "2"]),
    "generate_trajectories": _run_generate_trajectories,
    "evaluate": _returns_2("evaluate", lambda ck, t: ["--load", ck, "--benchmark", "gsm8k", "--limit", "1",
                                                      "--out", str(t / "ev"), "--no-progress"]),
    "search_inference_config": _returns_2("search_inference_config",
                                          lambda ck, t: ["--load", ck, "--limit", "1", "--out", str(t / "s"),
                                                         "--no-progress"]),
    "visualize_trajectory": _returns_2("visualize_trajectory",
                                       lambda ck, t: ["--load", ck, "--prompt", "x", "--out", str(t / "v")]),
    "run_text_generation_server": _returns_2("run_text_generation_server", lambda ck, t: ["--load", ck]),
    "convert_hf_mcore_to_hf": _run_convert,
}


@pytest.mark.parametrize("kind", REQUIRED)
@pytest.mark.parametrize("tool", list(TOOLS))
def test_every_tool_stops_with_one_line_naming_the_file(good_ckpt, tmp_path, capsys, tool, kind):
    ck, path, fragment = damaged(good_ckpt, tmp_path, kind)
    msg = TOOLS[tool](ck, tmp_path, capsys)
    _assert_names_file(msg, path, fragment)


@pytest.mark.parametrize("mode,kind", [("load", "truncated_distcp"), ("resume", "pointer_to_missing_iteration")])
def test_pretrain_load_and_resume_stop_with_one_line(good_ckpt, tmp_path, mode, kind):
    # a subprocess: pretrain_jf.main() tears down the process group this test session shares
    ck, path, fragment = damaged(good_ckpt, tmp_path, kind)
    data = tmp_path / "tokens.npy"
    import numpy as np

    np.save(data, np.arange(600, dtype=np.int32) % 50)
    where = ["--load", ck] if mode == "load" else ["--save", ck]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    proc = subprocess.run([sys.executable, os.path.join(REPO, "pretrain_jf.py"), *where, "--objective", "ar",
                           "--data", str(data), "--seq-length", "16", "--train-steps", "1", "--no-progress"],
                          capture_output=True, text=True, env=env, timeout=600, cwd=REPO)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert lines and lines[-1].startswith("pretrain_jf.py: error: "), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    _assert_names_file(lines[-1], path, fragment)
