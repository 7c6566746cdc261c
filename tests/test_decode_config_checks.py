"""DecodeConfig settings that cannot do what they say are reported (issue 14)."""
import warnings

import pytest
import torch


def test_mr_that_never_spawns_warns_and_runs_as_k1(mp1):
    from megatron_jf.decoding import PAPER
    from megatron_jf.inference.engine import DecodeConfig, Engine
    from megatron_jf.models.convert import hf_to_mcore
    from megatron_jf.models.gpt import build_model
    from megatron_jf.models.hf_config import ModelArgs
    from megatron_jf.models.zoo import peaked_hf_model

    with pytest.warns(UserWarning, match="never spawns a second block"):
        never = DecodeConfig("mr", block_size=8, num_blocks=2, spawn_threshold=1.0, verification_size=2, **PAPER)
    with pytest.warns(UserWarning, match="never spawns"):
        DecodeConfig("mr", block_size=1, num_blocks=2)  # ceil(r*1) = 1 = n for every r
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        DecodeConfig("mr", block_size=8, num_blocks=2, spawn_threshold=0.875)  # ceil(7) = 7 <= n-1: spawns
        DecodeConfig("mr", block_size=8, num_blocks=1, spawn_threshold=1.0)  # K=1: nothing to spawn
        DecodeConfig("jacobi", block_size=1)  # K and r are MR-only
    # the warning is true: the K=2, r=1 run is step for step the K=1 run, while r=0.5 does spawn (more tokens/forward)
    hf = peaked_hf_model("qwen2", period=1, seed=3)
    args = ModelArgs.from_hf_dict(hf.config.to_dict())
    m = build_model(args).eval()
    m.load_state_dict(hf_to_mcore(hf.state_dict(), args), strict=False)
    eng = Engine(m)
    p = [torch.randint(0, 256, (9,), generator=torch.Generator().manual_seed(0)).tolist()]
    a = eng.generate(p, never, max_new_tokens=40)[0]
    b = eng.generate(p, DecodeConfig("mr", block_size=8, num_blocks=1, spawn_threshold=1.0, verification_size=2,
                                     **PAPER), max_new_tokens=40)[0]
    c = eng.generate(p, DecodeConfig("mr", block_size=8, num_blocks=2, spawn_threshold=0.5, verification_size=2,
                                     **PAPER), max_new_tokens=40)[0]
    assert a.tokens == b.tokens == c.tokens and a.accepted == b.accepted
    assert c.accepted != a.accepted
