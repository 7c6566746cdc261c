"""HF export as ``save_pretrained`` writes it: safetensors shards + index, ``dtype`` in config.json, the source's
generation config carried over with every stop token; round trips stay bit-exact; both flag spellings work."""
import json
import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO

TOOL = os.path.join(REPO, "tools", "convert_hf.py")
SOURCE_GEN = {"bos_token_id": 3, "do_sample": True, "eos_token_id": [255, 254], "pad_token_id": 0,
              "repetition_penalty": 1.05, "temperature": 0.7, "top_k": 20, "top_p": 0.8,
              "transformers_version": "4.43.1"}


def _run(*args, ok=True):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    p = subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True, env=env, timeout=300)
    if ok and p.returncode != 0:
        raise AssertionError(p.stdout[-3000:] + p.stderr[-5000:])
    return p


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A tiny Qwen2 with a full generation config -> megatron (new flag spellings) -> HF in 100 KB shards."""
    from megatron_jf.models.zoo import save_tiny_hf

    root = tmp_path_factory.mktemp("export")
    src = save_tiny_hf(str(root / "src"), "qwen2", seed=9)
    json.dump(SOURCE_GEN, open(os.path.join(src, "generation_config.json"), "w"))
    _run("hf-to-mcore", "--load", src, "--save", str(root / "mc"))
    _run("mcore-to-hf", "--load", str(root / "mc"), "--hf", str(root / "out"), "--max-shard-size", "100KB")
    return src, str(root / "out"), root


def test_sharded_export_index_and_bit_exact_round_trip(exported):
    from safetensors import safe_open

    from megatron_jf.hf_io import load_hf_state_dict

    src, out, _ = exported
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    shards = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
    n = len(shards)
    assert n >= 3 and shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert "model.safetensors" not in os.listdir(out)
    a = load_hf_state_dict(src)
    assert set(index["weight_map"]) == set(a) and set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in a.values())
    assert index["metadata"]["total_parameters"] == sum(v.numel() for v in a.values())
    for f in shards:
        with safe_open(os.path.join(out, f), "pt") as sf:
            names = list(sf.keys())
            size = sum(sf.get_tensor(k).numel() * 4 for k in names)
            assert sf.metadata() == {"format": "pt"}
            assert all(index["weight_map"][k] == f for k in names)
        assert size <= 100_000 or len(names) == 1, (f, size)  # a tensor above the limit gets its own shard
    b = load_hf_state_dict(out)
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_transformers_loads_the_sharded_export(exported):
    from transformers import AutoModelForCausalLM, GenerationConfig

    src, out, _ = exported
    m, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    ref = AutoModelForCausalLM.from_pretrained(src)
    x = torch.tensor([[1, 5, 9, 200, 17]])
    assert torch.equal(m(x).logits, ref(x).logits)
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert cfg["dtype"] == "float32" and cfg["torch_dtype"] == "float32" and m.dtype == torch.float32
    g = GenerationConfig.from_pretrained(out)
    assert (g.temperature, g.top_p, g.top_k, g.repetition_penalty, g.do_sample) == (0.7, 0.8, 20, 1.05, True)
    assert sorted(g.eos_token_id) == [254, 255] and (g.bos_token_id, g.pad_token_id) == (3, 0)


def test_every_generation_config_field_is_carried(exported):
    _, out, _ = exported
    gen = json.load(open(os.path.join(out, "generation_config.json")))
    assert gen == SOURCE_GEN


def test_default_shard_size_writes_one_file_like_save_pretrained(exported, tmp_path):
    """Under the 5GB default a small model is one model.safetensors with no index (save_pretrained's layout)."""
    _, _, root = exported
    _run("mcore-to-hf", "--load", str(root / "mc"), "--out", str(tmp_path / "one"))
    names = set(os.listdir(tmp_path / "one"))
    assert "model.safetensors" in names and "model.safetensors.index.json" not in names
    assert "--max-shard-size" in _run("mcore-to-hf", "--help").stdout and "(default: 5GB)" in _run(
        "mcore-to-hf", "--help").stdout.replace("\n", " ").replace("  ", " ")


def test_shard_size_parsing_matches_huggingface(tmp_path):
    from huggingface_hub.serialization._base import parse_size_to_int

    from megatron_jf.hf_io import parse_shard_size

    for s in ("5GB", "500MB", "1.5GB", "100KB", "2TB", " 3gb "):
        assert parse_shard_size(s) == parse_size_to_int(s), s
    assert parse_shard_size(1234) == 1234 and parse_shard_size("1234") == 1234
    p = _run("mcore-to-hf", "--load", str(tmp_path), "--out", str(tmp_path / "o"), "--max-shard-size", "5XB",
             ok=False)
    assert p.returncode == 2 and "--max-shard-size" in p.stderr and "Supported units are TB, GB, MB, KB" in p.stderr


def test_generation_config_without_source():
    from megatron_jf.hf_io import generation_config
    from megatron_jf.models.hf_config import ModelArgs
    from megatron_jf.models.zoo import tiny_hf_config

    args = ModelArgs.from_hf_dict(tiny_hf_config("llama").to_dict())
    args.eos_token_ids = [7, 9]
    assert generation_config(args) == {"do_sample": False, "eos_token_id": [7, 9]}
    args.eos_token_ids = [7]
    assert generation_config(args, {"eos_token_id": 1, "top_p": 0.9}) == {"eos_token_id": 7, "top_p": 0.9}


def test_bf16_source_round_trips_in_its_own_dtype(tmp_path):
    """The checkpoint and the export keep the source's dtype (not the platform default: bf16 on GPU, fp32 on
    CPU), so conversion gives the same files on every machine."""
    from megatron_jf import checkpointing as C
    from megatron_jf import parallel
    from megatron_jf.hf_io import load_hf_state_dict
    from megatron_jf.models.zoo import tiny_hf_model

    src = str(tmp_path / "src")
    tiny_hf_model("llama", seed=4).to(torch.bfloat16).save_pretrained(src)
    _run("hf-to-mcore", "--hf", src, "--out", str(tmp_path / "mc"))
    parallel.initialize(1, 1)
    assert C.stored_dtype(str(tmp_path / "mc")) == torch.bfloat16
    _run("mcore-to-hf", "--load", str(tmp_path / "mc"), "--out", str(tmp_path / "back"))
    a, b = load_hf_state_dict(src), load_hf_state_dict(str(tmp_path / "back"))
    assert set(a) == set(b)
    for k in a:
        assert b[k].dtype == torch.bfloat16 and torch.equal(a[k], b[k]), k
    assert json.load(open(tmp_path / "back" / "config.json"))["dtype"] == "bfloat16"
