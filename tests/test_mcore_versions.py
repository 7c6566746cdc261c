"""Code that must behave the same on megatron-core 0.16.1 and 0.19.x (the two CI environments, README "Tests and
CI"); each test fails on one of the two versions without the version-tolerant code it covers."""
import torch


def test_absent_submodules_are_recognised_in_both_versions():
    from megatron.core.transformer.identity_op import IdentityOp

    from megatron_jf.platform import is_absent_submodule

    assert is_absent_submodule(None) and is_absent_submodule(IdentityOp())
    assert not is_absent_submodule(torch.nn.RMSNorm(4))


def test_lean_forward_supports_the_local_spec_model(mp1):
    """0.19 builds q/k layernorms as None (0.16: IdentityOp); the lean inference forward must still apply."""
    from megatron_jf.inference.lean_forward import supports
    from megatron_jf.models.gpt import build_model, unwrap
    from megatron_jf.models.hf_config import ModelArgs
    from megatron_jf.models.zoo import tiny_hf_config

    m = unwrap(build_model(ModelArgs.from_hf_dict(tiny_hf_config().to_dict())))
    assert m.decoder.layers[0].self_attention.q_layernorm is None or \
        type(m.decoder.layers[0].self_attention.q_layernorm).__name__ == "IdentityOp"
    assert supports(m)
