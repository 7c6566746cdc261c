"""The one measurement loop (megatron_jf/eval/speed.py, issue 22): AR and decoders on the same prompts in one run,
losslessness checked, TPF counted, the faster AR as baseline."""
import pytest


@pytest.fixture(scope="module")
def engine(mp1):
    from megatron_jf.decoding.width import ForwardCost
    from megatron_jf.inference.engine import Engine
    from megatron_jf.testing import mcore_twin, peaked_hf_model

    # wide forwards free: draft_width="auto" drafts whole drafts, and the test measures no cost on the machine
    free = ForwardCost({1: {1: 1.0, 64: 1.0}})
    return Engine(mcore_twin(peaked_hf_model("llama", period=4, seed=4)), forward_cost=free)


def test_measure_totals_lossless_and_the_faster_ar(engine):
    from megatron_jf.eval.hf_baseline import HF, hf_twin
    from megatron_jf.eval.speed import measure
    from megatron_jf.inference.engine import DecodeConfig

    prompts = [[5, 9, 5, 9, 3], [1, 2, 3], [7, 7, 7, 8, 7, 7], [4]]
    methods = {"jacobi": DecodeConfig("jacobi", block_size=4),
               "mr": DecodeConfig("mr", block_size=4, num_blocks=2, spawn_threshold=0.5)}
    s = measure(engine, prompts, methods, max_new_tokens=20, batch_size=3, eos_ids={prompts[0][1]},
                hf=hf_twin(engine.model))
    assert list(s.methods) == ["AR", "jacobi", "mr", HF] and s.reference == "AR"  # an AR reference was added
    ar = s.methods["AR"]
    want = [r.tokens for r in engine.generate(prompts, DecodeConfig("ar"), max_new_tokens=20, eos_ids={prompts[0][1]})]
    assert s.outputs == ar.outputs == want and ar.tpf == 1.0 and ar.tokens == sum(map(len, want))
    for name in ("jacobi", "mr", HF):
        st = s.methods[name]
        assert st.outputs == want and st.identical == 4 and not st.mismatched and st.tokens == ar.tokens
    assert s.methods["mr"].forwards < ar.forwards  # the peaked model's cycle: several tokens per forward
    assert s.methods["mr"].tpf == pytest.approx(ar.tokens / s.methods["mr"].forwards)
    assert s.methods[HF].tpf == 1.0 and s.methods[HF].wall_s > s.methods[HF].decode_s > 0
    fastest = max(("AR", HF), key=lambda n: s.methods[n].tps)
    assert s.fastest_ar == fastest and s.speedup(fastest) == 1.0
    assert s.speedup("mr") == pytest.approx(s.methods["mr"].tps / s.methods[fastest].tps)


def test_measure_names_a_lossless_violation(engine):
    from megatron_jf.eval.speed import LosslessError, measure
    from megatron_jf.inference.engine import DecodeConfig

    prompts = [[5, 9, 5, 9, 3], [1, 2, 3]]
    ref = [r.tokens for r in engine.generate(prompts, DecodeConfig("ar"), max_new_tokens=8)]
    bad = [ref[0], ref[1][:-1] + [ref[1][-1] + 1]]  # one reference token changed on the second prompt
    with pytest.raises(LosslessError, match=r"model-x jacobi: 1 of 2 outputs differ from greedy AR \(prompts \[1\]\)"):
        measure(engine, prompts, {"jacobi": DecodeConfig("jacobi", block_size=4)}, max_new_tokens=8,
                reference=bad, label="model-x")
    s = measure(engine, prompts, {"jacobi": DecodeConfig("jacobi", block_size=4)}, max_new_tokens=8, reference=bad,
                strict=False)
    assert s.methods["jacobi"].mismatched == [1] and s.reference is None and list(s.methods) == ["jacobi"]
    with pytest.raises(ValueError, match="no AR was timed"):
        s.fastest_ar
