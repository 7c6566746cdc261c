"""MR verification of recycled candidates (issue 14): the pruned two-pass verification computes only candidates
that can still win, reuses the main chain's rows for their shared prefix, and gives the same branch, logits, KV
and output as one full-tree forward."""
import random

import pytest
import torch


@pytest.fixture(scope="module")
def model(mp1):
    from megatron_jf.models.convert import hf_to_mcore
    from megatron_jf.models.gpt import build_model
    from megatron_jf.models.hf_config import ModelArgs
    from megatron_jf.models.zoo import tiny_hf_model

    hf = tiny_hf_model("qwen2", seed=11, scale=0.2)
    args = ModelArgs.from_hf_dict(hf.config.to_dict())
    m = build_model(args).eval()
    m.load_state_dict(hf_to_mcore(hf.state_dict(), args), strict=False)
    return m


def _cache_with_context(model, ctx, impl):
    from megatron_jf.inference.forward import forward_logits
    from megatron_jf.models.gpt import new_kv_cache

    cache = new_kv_cache(model, 1, 96)
    L = ctx.shape[1] - 1
    forward_logits(model, ctx[:, :L], torch.arange(L)[None], kv_cache=cache, return_logits=False, impl=impl)
    cache.commit([L])
    return cache


def _full_tree(model, ctx, last, draft, cands, impl):
    """One forward over [last] + draft + candidates (tree layout); returns (logits [s, V], cache)."""
    from megatron_jf.inference import mr_verify
    from megatron_jf.inference.forward import forward_logits

    cache = _cache_with_context(model, ctx, impl)
    base = ctx.shape[1] - 1
    n_main = 1 + len(draft)
    seq = [last] + draft + [t for c in cands for t in c]
    pos = list(range(base, base + n_main)) + [base + 1 + j for c in cands for j in range(len(c))]
    tree = mr_verify.tree_mask(n_main, [len(c) for c in cands], len(seq))
    out = forward_logits(model, torch.tensor([seq]), torch.tensor([pos]), kv_cache=cache, new_mask=tree[None], impl=impl)
    return out[0], cache


def _case(model, seed, impl, n=6):
    """A draft whose first k tokens are the model's greedy tokens, and candidates that share 0..n draft tokens and
    then continue with the greedy token, a wrong token, or stop."""
    from megatron_jf.inference.forward import forward_logits

    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    ctx = torch.randint(0, 256, (1, 10), generator=g)
    last = int(ctx[0, -1])
    # the greedy continuation of the context, by AR
    cache = _cache_with_context(model, ctx, impl)
    greedy, t, p = [], last, ctx.shape[1] - 1
    for _ in range(n + 1):
        t = int(forward_logits(model, torch.tensor([[t]]), torch.tensor([[p]]), kv_cache=cache, impl=impl)[0, -1].argmax())
        cache.commit([1])
        greedy.append(t)
        p += 1
    k = rng.randrange(0, n)
    draft = greedy[:k] + [(greedy[k] + 1 + rng.randrange(200)) % 256] + [rng.randrange(256) for _ in range(n - k - 1)]
    cands = []
    for _ in range(5):
        share = rng.choice([k, k, k, max(k - 1, 0), min(k + 1, n - 1)])
        c = draft[:share]
        if share == k:
            c = c + greedy[k:k + rng.randrange(1, n - k + 1)]  # continues correctly for a while ...
        c = c + [rng.randrange(256) for _ in range(n - len(c))]  # ... then noise
        cands.append(c[:n])
    return ctx, last, draft, cands


@pytest.mark.parametrize("impl", ["lean", "megatron"])
def test_pruned_verification_equals_full_tree(model, impl):
    from megatron_jf.inference import mr_verify
    from megatron_jf.inference.forward import forward_logits

    wins = skipped = 0
    for seed in range(8):
        ctx, last, draft, cands = _case(model, seed, impl)
        full, cache_full = _full_tree(model, ctx, last, draft, cands, impl)
        n_main = 1 + len(draft)
        main = full[:n_main]
        g = main.argmax(-1).tolist()
        k_main = mr_verify.matches(draft, g)
        want = mr_verify.best_in_tree(main, g, k_main, full, cands, n_main)
        # every candidate the rule drops has a greedy match <= the draft's (it could never win)
        live = mr_verify.live_candidates(draft, g, k_main, cands)
        gc = full[n_main:].argmax(-1).tolist()
        off = 0
        for c in cands:
            m = 0
            if c[0] == g[0]:
                m = 1
                while m < len(c) and c[m] == gc[off + m - 1]:
                    m += 1
            if c not in live:
                assert m <= k_main
                skipped += 1
            off += len(c)
        # the pruned path: main chain forward, then only the live candidates (as a trie)
        cache = _cache_with_context(model, ctx, impl)
        base = ctx.shape[1] - 1
        p1 = forward_logits(model, torch.tensor([[last] + draft]), torch.arange(base, base + n_main)[None],
                            kv_cache=cache, impl=impl)[0]
        torch.testing.assert_close(p1, main, rtol=1e-5, atol=1e-5)
        got = None
        if live:
            got, computed = mr_verify.pruned_second_pass(model, cache, base=base, block=n_main, main_logits=p1, g=g,
                                                         k_main=k_main, live=live, impl=impl)
            assert computed <= sum(len(c) - k_main for c in live)
        assert (got is None) == (want is None)
        if want is None:
            continue
        wins += 1
        assert got.tokens == want.tokens and got.matched == want.matched
        torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-5)
        # committing the winner's slots leaves the same KV: the next forward gives the same logits
        keep = want.matched + 1
        outs = []
        for c, br in ((cache_full, want), (cache, got)):
            c.commit([br.slots[:keep]])
            outs.append(forward_logits(model, torch.tensor([[7]]), torch.tensor([[base + keep]]), kv_cache=c, impl=impl))
        torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    assert wins >= 3 and skipped >= 3, (wins, skipped)  # the cases exercise both winning and pruned candidates


def test_trie_shares_common_prefixes():
    from megatron_jf.inference.mr_verify import _trie

    toks, parents, depths, paths = _trie([[4, 5, 6], [4, 5, 7], [4, 8]])
    assert toks == [4, 5, 6, 7, 8]
    assert parents == [-1, 0, 1, 1, 0] and depths == [0, 1, 2, 2, 1]
    assert paths == [[0, 1, 2], [0, 1, 3], [0, 4]]


def test_mode_resolution(monkeypatch):
    from megatron_jf.inference.options import mr_verify_mode as resolve_mode

    monkeypatch.delenv("MEGATRON_JF_MR_VERIFY", raising=False)
    assert resolve_mode("auto", torch.device("cpu")) == "pruned"
    assert resolve_mode(None, torch.device("cuda")) == "tree"
    assert resolve_mode("tree", torch.device("cpu")) == "tree"
    monkeypatch.setenv("MEGATRON_JF_MR_VERIFY", "tree")
    assert resolve_mode("auto", torch.device("cpu")) == "tree"
    monkeypatch.setenv("MEGATRON_JF_MR_VERIFY", "fast")
    with pytest.raises(ValueError, match="MEGATRON_JF_MR_VERIFY"):
        resolve_mode("auto", torch.device("cpu"))
    with pytest.raises(ValueError, match="the argument"):
        resolve_mode("bogus", torch.device("cpu"))


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


def test_mr_engine_pruned_equals_tree_and_ar(model):
    """MR decoding with recycled candidates: pruned and tree verification give AR's greedy output, and the same
    tokens and per-forward acceptances when sampling with a seed (batch 1 and a batch of 3)."""
    from megatron_jf.inference import mr_verify
    from megatron_jf.inference.engine import DecodeConfig, Engine, InferenceOptions
    from megatron_jf.inference.sampling import SamplingParams

    prompts = [[5, 9, 5, 9, 5, 9, 3, 5, 9, 5], [1, 2, 3, 1, 2, 3, 1, 2], [7, 7, 7, 8, 7, 7, 7, 8, 7]]
    engines = {m: Engine(model, check_invariants=True, options=InferenceOptions(mr_verify=m))
               for m in ("pruned", "tree")}
    passes = []
    orig = mr_verify.pruned_second_pass

    def spy(*a, **kw):
        out = orig(*a, **kw)
        passes.append(out[1])
        return out

    mr_verify.pruned_second_pass = spy
    try:
        # a fixed width: the same drafts both ways (with "auto", tree mode's branches make the forward wider, so the
        # widths chosen differ between the modes)
        cfgs = (DecodeConfig("mr", block_size=4, num_blocks=2, spawn_threshold=0.5, verification_size=4,
                             draft_width="fixed"),
                DecodeConfig("mr", block_size=8, num_blocks=1, verification_size=3, draft_width="fixed"))
        ar = [engines["tree"].generate([p], DecodeConfig("ar"), max_new_tokens=40)[0].tokens for p in prompts]
        for cfg in cfgs:
            for batch in ([prompts[0]], prompts):
                want = ar[:len(batch)]
                res = {m: e.generate(batch, cfg, max_new_tokens=40) for m, e in engines.items()}
                assert [r.tokens for r in res["pruned"]] == want == [r.tokens for r in res["tree"]]
                assert [r.accepted for r in res["pruned"]] == [r.accepted for r in res["tree"]]
        sp = SamplingParams(temperature=0.8, seed=3)
        for batch in ([prompts[0]], prompts):
            a = engines["pruned"].generate(batch, cfgs[0], max_new_tokens=32, sampling=sp)
            b = engines["tree"].generate(batch, cfgs[0], max_new_tokens=32, sampling=sp)
            assert [r.tokens for r in a] == [r.tokens for r in b]
            assert [r.accepted for r in a] == [r.accepted for r in b]
    finally:
        mr_verify.pruned_second_pass = orig
    assert passes, "no candidate was ever live: the test does not exercise the second pass"


def test_branch_next_token_is_greedy_verification(model):
    """The engine emits a greedy branch as tokens[:matched] + next_token without re-running verify: both equal
    sampling.verify on the branch's logits."""
    from megatron_jf.inference import mr_verify
    from megatron_jf.inference.sampling import SamplingParams, verify

    n = 0
    for seed in range(8):
        ctx, last, draft, cands = _case(model, seed, "lean")
        full, _ = _full_tree(model, ctx, last, draft, cands, "lean")
        main = full[: 1 + len(draft)]
        g = main.argmax(-1).tolist()
        k = mr_verify.matches(draft, g)
        br = mr_verify.best_in_tree(main, g, k, full, cands, 1 + len(draft))
        if br is not None:
            assert verify(br.tokens, br.logits, SamplingParams(), None) == br.tokens[:br.matched] + [br.next_token]
            n += 1
    assert n >= 3


def test_auto_width_rows_run_no_second_pass(model, monkeypatch):
    """``pruned`` verification: rows of ``draft_width="auto"`` forward their main chain only (a second pass costs a
    whole forward on a CPU; mr_verify's docstring) and still give AR's greedy output; fixed-width rows on the same
    prompts do run second passes (so the spy sees them)."""
    from megatron_jf.decoding.width import ForwardCost
    from megatron_jf.inference import mr_verify
    from megatron_jf.inference.engine import DecodeConfig, Engine, InferenceOptions

    prompts = [[5, 9, 5, 9, 5, 9, 3, 5, 9, 5], [1, 2, 3, 1, 2, 3, 1, 2], [7, 7, 7, 8, 7, 7, 7, 8, 7]]
    eng = Engine(model, check_invariants=True, options=InferenceOptions(mr_verify="pruned"),
                 forward_cost=ForwardCost({1: {1: 1.0, 64: 1.0}, 4: {1: 1.0, 64: 1.0}}))  # wide forwards free: auto rows draft their whole chain
    passes = []
    orig = mr_verify.pruned_second_pass
    monkeypatch.setattr(mr_verify, "pruned_second_pass", lambda *a, **kw: passes.append(1) or orig(*a, **kw))
    ar = eng.generate(prompts, DecodeConfig("ar"), max_new_tokens=40)
    kw = dict(block_size=4, num_blocks=2, spawn_threshold=0.5, verification_size=4)
    auto = eng.generate(prompts, DecodeConfig("mr", draft_width="auto", **kw), max_new_tokens=40)
    assert [r.tokens for r in auto] == [r.tokens for r in ar] and not passes
    assert sum(w > 0 for r in auto for w in r.draft_lens) > 0  # (the rows did draft)
    fixed = eng.generate(prompts, DecodeConfig("mr", draft_width="fixed", **kw), max_new_tokens=40)
    assert [r.tokens for r in fixed] == [r.tokens for r in ar] and passes
