"""The megatron-core model computes the same logits as transformers on the converted weights (issue 2)."""
import pytest
import torch

from tests.conftest import run_torchrun


def _pair(family, tied, layers=2, seed=0):
    from megatron_jf.models.convert import hf_to_mcore
    from megatron_jf.models.gpt import build_model
    from megatron_jf.models.hf_config import ModelArgs
    from megatron_jf.models.zoo import tiny_hf_model

    hf = tiny_hf_model(family, tied=tied, layers=layers, seed=seed)
    args = ModelArgs.from_hf_dict(hf.config.to_dict())
    model = build_model(args).eval()
    missing, unexpected = model.load_state_dict(hf_to_mcore(hf.state_dict(), args), strict=False)
    assert not [k for k in missing if not k.endswith("_extra_state")] and not unexpected
    return hf, model, args


def _hf_logits(hf, tokens, pos, mask4d=None):
    with torch.no_grad():
        return hf(tokens, position_ids=pos, attention_mask=mask4d).logits


@pytest.mark.parametrize("family,tied", [("qwen2", False), ("qwen2", True), ("llama", False), ("llama", True)])
def test_logits_match_transformers(mp1, family, tied):
    from megatron_jf.inference.forward import forward_logits

    hf, model, args = _pair(family, tied)
    if family == "qwen2":  # the biases really are non-zero
        assert hf.model.layers[0].self_attn.q_proj.bias.abs().min() > 0
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab_size, (2, 16), generator=g)
    cases = {
        "causal": torch.arange(16).expand(2, 16),
        "offset": (100 + torch.arange(16)).expand(2, 16),          # a block after a 100-token context
        "non-monotonic": torch.tensor([list(range(8)) + list(range(4, 12))] * 2),  # two copies share positions
    }
    for name, pos in cases.items():
        ref = _hf_logits(hf, tokens, pos)
        out = forward_logits(model, tokens, pos)
        assert out.shape == ref.shape
        assert (out - ref).abs().max() <= 1e-4, name
    # position ids really matter (RoPE is relative, so a uniform offset changes nothing, but reused
    # positions do): a model ignoring position_ids would give the causal logits here
    assert (forward_logits(model, tokens, cases["non-monotonic"]) - forward_logits(model, tokens, cases["causal"])).abs().max() > 1e-3


def test_arbitrary_mask_matches_transformers_float_mask(mp1):
    """A block-sparse mask (a noisy block seeing itself bidirectionally) equals HF with an additive 4-D mask."""
    from megatron_jf.inference.forward import forward_logits

    hf, model, args = _pair("qwen2", False)
    s = 12
    allowed = torch.ones(s, s, dtype=torch.bool).tril()
    allowed[8:, 8:] = True  # last 4 tokens attend to each other both ways
    allowed[8:, 4:8] = False  # and skip a span
    tokens = torch.randint(0, args.vocab_size, (1, s), generator=torch.Generator().manual_seed(2))
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 4, 5, 6, 7]])
    add = torch.zeros(1, 1, s, s).masked_fill(~allowed, torch.finfo(torch.float32).min)
    ref = _hf_logits(hf, tokens, pos, add)
    out = forward_logits(model, tokens, pos, allowed=allowed)
    assert (out - ref).abs().max() <= 1e-4


def test_kv_cache_rows_roll_back_independently(mp1):
    """Appending blocks through the KV cache, with per-row commits, equals one full causal pass."""
    from megatron_jf.inference.forward import forward_logits
    from megatron_jf.models.gpt import new_kv_cache

    _, model, args = _pair("qwen2", False)
    tokens = torch.randint(0, args.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))
    full = forward_logits(model, tokens, torch.arange(24).expand(2, 24))
    cache = new_kv_cache(model, 2, 64)
    a = forward_logits(model, tokens[:, :8], torch.arange(8).expand(2, 8), kv_cache=cache)
    cache.commit([8, 8])
    assert (a - full[:, :8]).abs().max() <= 1e-5
    b = forward_logits(model, tokens[:, 8:14], torch.arange(8, 14).expand(2, 6), kv_cache=cache)
    assert (b - full[:, 8:14]).abs().max() <= 1e-5
    cache.commit([2, 6])  # row 0 keeps 2 of 6 (a rejected tail), row 1 keeps all
    assert cache.lengths.tolist() == [10, 14]
    nxt = torch.stack([tokens[0, 10:15], tokens[1, 14:19]])
    pos = torch.stack([torch.arange(10, 15), torch.arange(14, 19)])
    c = forward_logits(model, nxt, pos, kv_cache=cache)
    assert (c[0] - full[0, 10:15]).abs().max() <= 1e-5
    assert (c[1] - full[1, 14:19]).abs().max() <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_cache_masks_equal_the_boolean_ones(dtype):
    """``KVCache.update`` hands SDPA an additive mask, made once per forward (a causal draft block: a view of one
    template per dtype, grown for a wider block, a narrower block its corner): it must allow exactly what the
    boolean mask of the cache's contract allows -- committed slots and the new tokens' causal (or given) mask -- at
    every committed length and block size the template is reused for, and give SDPA the output the boolean mask
    gives, bit for bit."""
    from megatron_jf.models.kv_cache import KVCache

    g = torch.Generator().manual_seed(5)
    cache = KVCache(1, 2, 40, 2, 8, dtype=dtype)
    for start, s in ((0, 4), (3, 4), (17, 4), (9, 2), (9, 7), (36, 4)):
        cache.lengths[:] = start
        cache.begin(s)
        k, v = (torch.randn(2, 2, s, 8, generator=g).to(dtype) for _ in range(2))
        k_all, v_all, add = cache.update(0, k, v)
        want = torch.cat([torch.ones(s, start, dtype=torch.bool), torch.ones(s, s, dtype=torch.bool).tril()], 1)
        assert add.dtype == dtype and add.shape[-2:] == (s, start + s)
        assert torch.equal(add[0, 0] == 0, want) and bool(torch.isneginf(add[0, 0][~want]).all())
        q = torch.randn(2, 4, s, 8, generator=g).to(dtype)
        out = torch.nn.functional.scaled_dot_product_attention(q, k_all, v_all, attn_mask=add, enable_gqa=True)
        ref = torch.nn.functional.scaled_dot_product_attention(q, k_all, v_all, attn_mask=want, enable_gqa=True)
        assert torch.equal(out, ref)
        assert cache.update(0, k, v)[2] is add  # once per forward, not per layer
        cache.end()
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # a given mask; ragged rows
    cache.lengths[:] = torch.tensor([5, 2])
    cache.begin(3, tree)
    kv = torch.zeros(2, 2, 3, 8, dtype=dtype)
    add = cache.update(0, kv, kv)[2]
    for row, start in ((0, 5), (1, 2)):
        want = torch.zeros(3, 8, dtype=torch.bool)
        want[:, :start] = True
        want[:, start:start + 3] = tree
        assert torch.equal(add[row, 0] == 0, want)
    cache.end()


def test_kv_cache_commit_non_prefix_compacts(mp1):
    """Two candidates forwarded side by side (tree mask); keeping the second one's tokens equals a plain pass."""
    from megatron_jf.inference.forward import forward_logits
    from megatron_jf.models.gpt import new_kv_cache

    _, model, args = _pair("llama", False)
    g = torch.Generator().manual_seed(4)
    prefix = torch.randint(0, args.vocab_size, (1, 6), generator=g)
    cand1 = torch.randint(0, args.vocab_size, (1, 3), generator=g)
    cand2 = torch.randint(0, args.vocab_size, (1, 3), generator=g)
    after = torch.randint(0, args.vocab_size, (1, 2), generator=g)
    cache = new_kv_cache(model, 1, 32)
    forward_logits(model, prefix, torch.arange(6)[None], kv_cache=cache)
    cache.commit([6])
    new = torch.cat([cand1, cand2], 1)
    pos = torch.tensor([[6, 7, 8, 6, 7, 8]])
    tree = torch.zeros(6, 6, dtype=torch.bool)
    tree[:3, :3] = torch.ones(3, 3, dtype=torch.bool).tril()
    tree[3:, 3:] = torch.ones(3, 3, dtype=torch.bool).tril()
    out = forward_logits(model, new, pos, kv_cache=cache, new_mask=tree)
    seq2 = torch.cat([prefix, cand2, after], 1)
    full2 = forward_logits(model, seq2, torch.arange(11)[None])
    full1 = forward_logits(model, torch.cat([prefix, cand1], 1), torch.arange(9)[None])
    assert (out[:, :3] - full1[:, 6:9]).abs().max() <= 1e-5
    assert (out[:, 3:] - full2[:, 6:9]).abs().max() <= 1e-5
    cache.commit([[3, 4, 5]])
    nxt = forward_logits(model, after, torch.tensor([[9, 10]]), kv_cache=cache)
    assert (nxt - full2[:, 9:11]).abs().max() <= 1e-5


def test_tp2_parity_torchrun():
    out = run_torchrun("parity.py", "tp", "qwen2:untied", "llama:tied")
    vals = {l.split()[1]: float(l.split()[2]) for l in out.splitlines() if l.startswith("PARITY")}
    assert set(vals) == {"qwen2:untied", "llama:tied"}
    assert max(vals.values()) <= 1e-4, vals


def test_pp2_parity_torchrun():
    out = run_torchrun("parity.py", "pp", "qwen2:tied", "llama:untied")
    vals = {l.split()[1]: float(l.split()[2]) for l in out.splitlines() if l.startswith("PARITY")}
    assert set(vals) == {"qwen2:tied", "llama:untied"}
    assert max(vals.values()) <= 1e-4, vals
