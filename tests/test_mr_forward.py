"""Two-pass MR verification forward: branches that cannot be accepted are not computed (issue 14)."""
import pytest
import torch


@pytest.fixture(scope="module")
def model(mp1):
    from megatron_jf.models.convert import hf_to_mcore
    from megatron_jf.models.gpt import build_model
    from megatron_jf.models.hf_config import ModelArgs
    from megatron_jf.testing import tiny_hf_model

    hf = tiny_hf_model("qwen2", seed=11, scale=0.2)
    args = ModelArgs.from_hf_dict(hf.config.to_dict())
    m = build_model(args).eval()
    m.load_state_dict(hf_to_mcore(hf.state_dict(), args), strict=False)
    return m


def _tree(main, branches, s):
    tree = torch.ones(s, s, dtype=torch.bool).tril_()
    for o, n in branches:
        tree[o:o + n, 1:o] = False
        tree[o:, o:o + n] = False
        tree[o:o + n, o:o + n] = torch.ones(n, n, dtype=torch.bool).tril_()
    return tree


@pytest.mark.parametrize("impl", ["lean", "megatron"])
def test_pruned_tree_forward_equals_full_tree_on_live_rows(model, impl):
    from megatron_jf.models.gpt import forward_logits, new_kv_cache

    g = torch.Generator().manual_seed(0)
    ctx = torch.randint(0, 256, (1, 12), generator=g)
    main, branches = 5, [(5, 4), (9, 4), (13, 1)]
    s = 14
    tree = _tree(main, branches, s)
    toks = torch.randint(0, 256, (1, s), generator=g)
    base = 11
    pos = torch.tensor([list(range(base, base + main)) + [base + 1 + j for o, n in branches for j in range(n)]])

    def run(b, toks):
        cache = new_kv_cache(model, 1, 40)
        forward_logits(model, ctx[:, :11], torch.arange(11)[None], kv_cache=cache, return_logits=False, impl=impl)
        cache.commit([11])
        out = forward_logits(model, toks, pos, kv_cache=cache, new_mask=tree[None], impl=impl, branches=b)
        return out, cache

    full, _ = run(None, toks)
    g0 = int(full[0, 0].argmax())
    toks[0, 5] = g0  # branch (5, 4) starts with the greedy prediction after `last`: it can be accepted
    toks[0, 9] = (g0 + 1) % 256  # these two cannot
    toks[0, 13] = (g0 + 2) % 256
    full, cache_full = run(None, toks)
    pruned, cache = run([branches], toks)
    live = list(range(0, 9))
    torch.testing.assert_close(pruned[0, live], full[0, live], rtol=1e-5, atol=1e-5)
    assert torch.isneginf(pruned[0, 9:]).all()
    # the KV of the live branch sits in the same slots as in the one-pass forward: committing it gives the
    # same next-step logits
    nxt = torch.tensor([[7]])
    outs = []
    for c in (cache_full, cache):
        c.commit([[0, 5, 6]])
        outs.append(forward_logits(model, nxt, torch.tensor([[14]]), kv_cache=c, impl=impl))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


def test_kv_cache_slot_pass_validates(model):
    from megatron_jf.models.gpt import new_kv_cache

    cache = new_kv_cache(model, 2, 16)
    m = torch.ones(1, 2, 4, dtype=torch.bool)
    cache.commit([3, 2])
    with pytest.raises(ValueError, match="equal committed lengths"):
        cache.begin(2, m, slots=torch.tensor([1, 2]), region=4)
    cache.trim([2, 2])
    with pytest.raises(ValueError, match="distinct offsets"):
        cache.begin(2, m, slots=torch.tensor([1, 1]), region=4)
    with pytest.raises(ValueError, match="distinct offsets"):
        cache.begin(2, m, slots=torch.tensor([1, 4]), region=4)
    with pytest.raises(ValueError, match="new_mask"):
        cache.begin(2, None, slots=torch.tensor([1, 2]), region=4)
    with pytest.raises(ValueError, match="overflow"):
        cache.begin(2, torch.ones(1, 2, 15, dtype=torch.bool), slots=torch.tensor([1, 2]), region=15)


def test_mr_engine_output_unchanged_with_pruned_branches(model):
    """MR with recycled candidates at batch 1 (pruned two-pass forward) equals AR, greedy and sampled-seeded."""
    from megatron_jf.inference.engine import DecodeConfig, Engine
    from megatron_jf.inference.sampling import SamplingParams
    from megatron_jf.models import gpt

    eng = Engine(model, check_invariants=True)
    p = [[5, 9, 5, 9, 5, 9, 3, 5, 9, 5]]
    ar = eng.generate(p, DecodeConfig("ar"), max_new_tokens=48)[0].tokens
    calls = []
    orig = gpt._forward_pruned_tree

    def spy(*a, **kw):
        calls.append(1)
        return orig(*a, **kw)

    gpt._forward_pruned_tree = spy
    try:
        for cfg in (DecodeConfig("mr", block_size=4, num_blocks=2, spawn_threshold=0.5, verification_size=4),
                    DecodeConfig("mr", block_size=8, num_blocks=1, verification_size=3)):
            assert eng.generate(p, cfg, max_new_tokens=48)[0].tokens == ar
    finally:
        gpt._forward_pruned_tree = orig
    assert calls, "MR at batch 1 did not take the pruned two-pass path"
    # sampling: the pruned rows are never read, so the same seed gives the same tokens as one full-tree forward
    from megatron_jf.inference import engine as eng_mod

    sp = SamplingParams(temperature=0.8, seed=3)
    cfg = DecodeConfig("mr", block_size=4, num_blocks=2, spawn_threshold=0.5, verification_size=4)
    a = eng.generate(p, cfg, max_new_tokens=32, sampling=sp)[0]
    full = eng_mod.forward_logits
    eng_mod.forward_logits = lambda *x, branches=None, **kw: full(*x, **kw)
    try:
        b = eng.generate(p, cfg, max_new_tokens=32, sampling=sp)[0]
    finally:
        eng_mod.forward_logits = full
    assert a.tokens == b.tokens and a.accepted == b.accepted
