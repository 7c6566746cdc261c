"""The one measurement loop (megatron_jf/eval/speed.py, issue 22): AR and decoders on the same prompts in one run,
losslessness checked, TPF counted, the faster AR as baseline."""
import pytest


@pytest.fixture(scope="module")
def engine(mp1):
    from megatron_jf.decoding.width import ForwardCost
    from megatron_jf.inference.engine import Engine
    from megatron_jf.models.zoo import mcore_twin, peaked_hf_model

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


def test_measure_counts_a_floating_point_near_tie_and_raises_beyond_it(mp1):
    """An output that leaves the reference where the two best logits are within rounding of each other (a wider
    forward's rounding can pick the other token: seen on an AMX Xeon, gap 4.8e-6 on logits of 5.5) is recorded as a
    near tie, not raised; the gap is checked against `transformers`' logits on the same weights."""
    import torch

    from megatron_jf.eval.speed import LosslessError, divergence, measure
    from megatron_jf.inference.engine import DecodeConfig, Engine
    from megatron_jf.models.zoo import mcore_twin, peaked_hf_model

    hf = peaked_hf_model("llama", period=4, seed=4)
    prompts = [[5, 9, 5, 9, 3], [1, 2, 3]]
    ar = [r.tokens for r in Engine(mcore_twin(hf)).generate(prompts, DecodeConfig("ar"), max_new_tokens=8)]
    k = 2
    x = ar[1][k]
    y = next(t for t in range(hf.config.vocab_size - 1, 0, -1) if all(t not in o + p for o, p in zip(ar, prompts)))
    with torch.no_grad():  # token y: x's head row, a hair smaller -- always second to x, within 1e-5 of it
        hf.lm_head.weight[y] = hf.lm_head.weight[x] * (1 - 3e-6)
    engine = Engine(mcore_twin(hf))
    ref = [r.tokens for r in engine.generate(prompts, DecodeConfig("ar"), max_new_tokens=8)]
    assert ref == ar  # y is never the argmax
    with torch.no_grad():
        logits = hf(torch.tensor([prompts[1] + ref[1][:k]])).logits[0, -1].float()
    want_gap = float(logits[x] - logits[y])
    assert 0 < want_gap < 1e-4 * float(logits[x])
    tied = [ref[0], ref[1][:k] + [y] + ref[1][k + 1:]]  # a reference that took y at the near tie
    methods = {"jacobi": DecodeConfig("jacobi", block_size=4)}
    s = measure(engine, prompts, methods, max_new_tokens=8, reference=tied)  # strict: no LosslessError
    st = s.methods["jacobi"]
    assert st.mismatched == [1] and st.identical == 1 and list(st.near_ties) == [1]
    tie = st.near_ties[1]
    assert tie.position == k and tie.gap == pytest.approx(want_gap, rel=1e-2, abs=1e-6) and tie.gap <= tie.tolerance
    assert divergence(engine, prompts[1], ref[1], ref[1]) is None  # equal outputs: nothing to classify
    far = [ref[0], ref[1][:k] + [ref[1][k] + 1] + ref[1][k + 1:]]  # a token far from the best: a real violation
    with pytest.raises(LosslessError, match=r"beyond a floating-point near tie"):
        measure(engine, prompts, methods, max_new_tokens=8, reference=far)
