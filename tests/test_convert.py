"""tools/convert_hf.py: HF -> megatron -> HF is bit-exact; transformers loads the export; bad input is named."""
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import load_tool
import torch

from tests.conftest import REPO

TOOL = os.path.join(REPO, "tools", "convert_hf.py")


def _run(*args, ok=True):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    p = subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True, env=env, timeout=300)
    if ok and p.returncode != 0:
        raise AssertionError(p.stdout[-3000:] + p.stderr[-5000:])
    return p


@pytest.mark.parametrize("family,tied,tp", [("qwen2", False, 1), ("qwen2", True, 2), ("llama", False, 2)])
def test_round_trip_bit_exact(tmp_path, family, tied, tp):
    from transformers import AutoModelForCausalLM

    from megatron_jf.hf_io import load_hf_state_dict
    from megatron_jf.models.zoo import save_tiny_hf

    src = save_tiny_hf(str(tmp_path / "hf"), family, tied=tied, seed=7)
    # a generation config with a second stop token: the union must survive the round trip
    json.dump({"eos_token_id": [255, 254]}, open(os.path.join(src, "generation_config.json"), "w"))
    _run("hf-to-mcore", "--hf", src, "--out", str(tmp_path / "mc"), "--tp", str(tp))
    meta = json.load(open(tmp_path / "mc" / "iter_0000000" / "jf_meta.json"))
    assert meta["tp"] == tp and meta["model_args"]["eos_token_ids"] == [255, 254]
    _run("mcore-to-hf", "--load", str(tmp_path / "mc"), "--out", str(tmp_path / "back"))
    a, b = load_hf_state_dict(src), load_hf_state_dict(str(tmp_path / "back"))
    if tied:
        a.pop("lm_head.weight", None)
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    model, info = AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert sorted(model.generation_config.eos_token_id) == [254, 255]


def test_negative_control_swapped_gate_up_breaks_parity(mp1):
    """If the gate/up order in fc1 were wrong, the parity test would catch it."""
    from megatron_jf.models import convert
    from megatron_jf.inference.forward import forward_logits
    from megatron_jf.models.gpt import build_model
    from megatron_jf.models.hf_config import ModelArgs
    from megatron_jf.models.zoo import tiny_hf_model

    hf = tiny_hf_model("qwen2")
    args = ModelArgs.from_hf_dict(hf.config.to_dict())
    sd = dict(hf.state_dict())
    broken = dict(sd)
    for k in list(sd):
        if k.endswith("mlp.gate_proj.weight"):
            up = k.replace("gate_proj", "up_proj")
            broken[k], broken[up] = sd[up], sd[k]
    tokens = torch.randint(0, args.vocab_size, (1, 10), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(10)[None]
    ref = hf(tokens).logits.detach()
    diffs = []
    for state in (sd, broken):
        m = build_model(args).eval()
        m.load_state_dict(convert.hf_to_mcore(state, args), strict=False)
        diffs.append((forward_logits(m, tokens, pos) - ref).abs().max().item())
    assert diffs[0] <= 1e-4 and diffs[1] > 1e-2, diffs


def test_bad_inputs_are_named(tmp_path):
    from megatron_jf.models.zoo import save_tiny_hf

    p = _run("hf-to-mcore", "--hf", str(tmp_path / "nope"), "--out", str(tmp_path / "o"), ok=False)
    assert p.returncode != 0 and "not found" in p.stderr and "nope" in p.stderr
    src = save_tiny_hf(str(tmp_path / "hf"), "qwen2")
    cfg = json.load(open(os.path.join(src, "config.json")))
    bad = tmp_path / "bad"
    bad.mkdir()
    json.dump(dict(cfg, architectures=["GPT2LMHeadModel"]), open(bad / "config.json", "w"))
    p = _run("hf-to-mcore", "--hf", str(bad), "--out", str(tmp_path / "o"), ok=False)
    assert "unsupported architectures" in p.stderr and "GPT2LMHeadModel" in p.stderr
    os.remove(bad / "config.json")
    p = _run("hf-to-mcore", "--hf", str(bad), "--out", str(tmp_path / "o"), ok=False)
    assert "missing config.json" in p.stderr
    p = _run("hf-to-mcore", "--hf", src, "--out", str(tmp_path / "o"), "--tp", "3", ok=False)
    assert "does not divide num_attention_heads" in p.stderr
    (tmp_path / "exists").mkdir()
    p = _run("hf-to-mcore", "--hf", src, "--out", str(tmp_path / "exists"), ok=False)
    assert "exists" in p.stderr and "--overwrite" in p.stderr


def test_shape_mismatch_is_named():
    from megatron_jf.models.convert import hf_to_mcore
    from megatron_jf.models.hf_config import ModelArgs
    from megatron_jf.models.zoo import tiny_hf_model

    hf = tiny_hf_model("llama")
    args = ModelArgs.from_hf_dict(hf.config.to_dict())
    sd = dict(hf.state_dict())
    sd["model.layers.1.mlp.down_proj.weight"] = sd["model.layers.1.mlp.down_proj.weight"][:, :-1]
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.down_proj\.weight.*shape"):
        hf_to_mcore(sd, args)
    del sd["model.norm.weight"]
    sd["model.layers.1.mlp.down_proj.weight"] = hf.state_dict()["model.layers.1.mlp.down_proj.weight"]
    with pytest.raises(KeyError, match="model.norm.weight"):
        hf_to_mcore(sd, args)


def test_rope_base_read_from_both_config_layouts():
    from megatron_jf.models.hf_config import ModelArgs
    from megatron_jf.models.zoo import tiny_hf_config

    cfg = tiny_hf_config("qwen2", rope_theta=1e6).to_dict()
    assert ModelArgs.from_hf_dict(cfg).rope_theta == 1e6
    v4 = {k: v for k, v in cfg.items() if k != "rope_parameters"}
    v4["rope_theta"] = 5e5
    assert ModelArgs.from_hf_dict(v4).rope_theta == 5e5
    v4.pop("rope_theta")
    with pytest.raises(ValueError, match="RoPE base"):
        ModelArgs.from_hf_dict(v4)


def test_missing_checkpoint_and_iteration_are_named(tmp_path):
    from megatron_jf import checkpointing as C

    with pytest.raises(FileNotFoundError, match="checkpoint directory not found: .*nope"):
        C.tokenizer_path(str(tmp_path / "nope"))  # not "carries no tokenizer"
    ck = tmp_path / "ck"
    (ck / "iter_0000004").mkdir(parents=True)
    (ck / "iter_0000004" / C.META).write_text(json.dumps({"format": C.FORMAT, "iteration": 4}))
    (ck / C.LATEST).write_text("4")
    assert C.read_meta(str(ck))["iteration"] == 4 and C.tokenizer_path(str(ck)) is None
    with pytest.raises(FileNotFoundError, match=r"has no iteration 5; available: \[4\]"):
        C.read_meta(str(ck), 5)


# ---------------------------------------------------------------- layer-spec independence (TE vs local)
FIXTURE = os.path.join(REPO, "tests", "fixtures", "te_spec_keys.json")


def _fixture_args():
    """The architecture the fixture was generated for: 2 layers, h=64, ffn=96, 4 heads / 2 groups, qkv bias,
    untied, vocab 256."""
    from megatron_jf.models.hf_config import ModelArgs
    from megatron_jf.models.zoo import tiny_hf_model

    hf = tiny_hf_model("qwen2", seed=3)
    return hf, ModelArgs.from_hf_dict(hf.config.to_dict())


def test_te_spec_names_match_megatron_core_fixture():
    """hf_to_mcore(fused_norms=True) emits exactly the TE spec's parameter names (fixture derived from
    megatron-core's spec definitions); the default emits the local spec's."""
    from megatron_jf.models.convert import hf_to_mcore, uses_fused_norms

    fx = json.load(open(FIXTURE))
    hf, args = _fixture_args()
    sd = dict(hf.state_dict())
    te = hf_to_mcore(sd, args, fused_norms=True)
    local = hf_to_mcore(sd, args)
    assert sorted(te) == fx["te_keys"]
    assert sorted(local) == fx["local_keys"]
    assert uses_fused_norms(te) and not uses_fused_norms(local)
    assert torch.equal(te["decoder.layers.1.mlp.linear_fc1.layer_norm_weight"],
                       sd["model.layers.1.post_attention_layernorm.weight"])
    assert torch.equal(te["decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"],
                       sd["model.layers.0.input_layernorm.weight"])


def test_te_spec_fixture_is_current(tmp_path):
    """The committed fixture is what the generator derives from the installed megatron-core."""
    out = tmp_path / "keys.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    p = subprocess.run([sys.executable, os.path.join(REPO, "tests", "fixtures", "make_te_spec_keys.py"), str(out)],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    new, old = json.load(open(out)), json.load(open(FIXTURE))
    for k in ("te_keys", "local_keys", "te_spec_modules", "local_spec_sharded_state_dict_keys_map"):
        assert new[k] == old[k], k


@pytest.mark.parametrize("tp", [1, 2])
def test_mcore_to_hf_accepts_te_names_bit_exact(tp):
    """mcore_to_hf of TE-named shards equals the HF source (the KeyError under the TE spec)."""
    from megatron_jf.models.convert import hf_to_mcore, mcore_to_hf

    hf, args = _fixture_args()
    sd = dict(hf.state_dict())
    for fused in (False, True):
        shards = [[hf_to_mcore(sd, args, tp_rank=r, tp_size=tp, fused_norms=fused) for r in range(tp)]]
        back = mcore_to_hf(shards, args)
        assert set(back) == set(sd)
        for k in sd:
            assert torch.equal(back[k], sd[k]), (fused, k)


@pytest.mark.skipif("not __import__('megatron_jf.platform', fromlist=['x']).HAVE_TE",
                    reason="Transformer Engine and CUDA absent")
def test_te_model_has_fixture_names_and_loads_conversion(mp1):
    """With TE present, the model built by build_model has the fixture's names and takes the conversion strictly."""
    from megatron_jf.models.convert import hf_to_mcore, uses_fused_norms
    from megatron_jf.models.gpt import build_model

    fx = json.load(open(FIXTURE))
    hf, args = _fixture_args()
    m = build_model(args)
    keys = sorted(k for k in m.state_dict() if not k.endswith("_extra_state"))
    assert keys == fx["te_keys"] and uses_fused_norms(keys)
    missing, unexpected = m.load_state_dict(hf_to_mcore(dict(hf.state_dict()), args, fused_norms=True), strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing)


def test_flag_spellings_both_ways():
    """--load IN --out OUT in both directions; --hf names the HF side (old spellings), Megatron-LM's TP/PP names."""
    parse = load_tool("convert_hf").build_parser().parse_args
    new = parse(["hf-to-mcore", "--load", "H", "--out", "M", "--tp", "2", "--pp", "2"])
    old = parse(["hf-to-mcore", "--hf", "H", "--save", "M", "--tensor-model-parallel-size", "2",
                           "--pipeline-model-parallel-size", "2"])
    assert vars(new) == vars(old) and (new.load, new.out, new.tp, new.pp) == ("H", "M", 2, 2)
    a = parse(["mcore-to-hf", "--load", "M", "--out", "H"])
    b = parse(["mcore-to-hf", "--load", "M", "--hf", "H"])
    assert vars(a) == vars(b) and a.out == "H" and a.max_shard_size == "5GB"
