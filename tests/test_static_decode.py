"""Static-shape decode path: bucket padding, full-cache masks, slot reuse and rollback (CPU), CUDA-graph replay
equal to eager (CUDA only) (issue 14)."""
import pytest
import torch


@pytest.fixture(scope="module")
def model(mp1):
    from megatron_jf.models.convert import hf_to_mcore
    from megatron_jf.models.gpt import build_model
    from megatron_jf.models.hf_config import ModelArgs
    from megatron_jf.models.zoo import tiny_hf_model

    hf = tiny_hf_model("qwen2", seed=21, scale=0.2)
    args = ModelArgs.from_hf_dict(hf.config.to_dict())
    m = build_model(args).eval()
    m.load_state_dict(hf_to_mcore(hf.state_dict(), args), strict=False)
    return m


def test_plan_pads_to_the_bucket_and_masks_the_whole_cache():
    from megatron_jf.inference.static_decode import choose_bucket, plan_static_step

    assert choose_bucket(5, [1, 8, 17]) == 8 and choose_bucket(1, [1, 8]) == 1 and choose_bucket(18, [1, 17]) is None
    lengths = torch.tensor([3, 1])
    tree = torch.tensor([[1, 0], [1, 1]], dtype=torch.bool)
    st = plan_static_step(lengths, 10, torch.tensor([[7, 8], [9, 6]]), torch.tensor([[3, 4], [1, 2]]), tree, 4)
    assert st.bucket == 4 and st.tokens.tolist() == [[7, 8, 8, 8], [9, 6, 6, 6]]
    assert st.positions.tolist() == [[3, 4, 4, 4], [1, 2, 2, 2]]
    assert st.write_slots.tolist() == [[3, 4, 5, 6], [1, 2, 3, 4]]
    m = st.mask[:, 0]
    assert m.shape == (2, 4, 10)
    # row 0: committed slots 0-2, then its own block per the tree mask; nothing past it
    assert m[0, 0].tolist() == [1, 1, 1, 1, 0, 0, 0, 0, 0, 0]
    assert m[0, 1].tolist() == [1, 1, 1, 1, 1, 0, 0, 0, 0, 0]
    assert m[1, 1].tolist() == [1, 1, 1, 0, 0, 0, 0, 0, 0, 0]
    # padding rows see exactly their own slot (no empty softmax row, no influence on real rows)
    assert m[0, 2].tolist() == [0, 0, 0, 0, 0, 1, 0, 0, 0, 0] and m[1, 3].nonzero().flatten().tolist() == [4]
    assert not m[0, :2, 5:].any() and not m[1, :2, 3:].any()
    with pytest.raises(ValueError, match="slots"):
        plan_static_step(torch.tensor([8]), 10, torch.tensor([[1]]), torch.tensor([[8]]), None, 4)


def test_static_forward_equals_cached_lean_forward_through_commit_compaction_and_rollback(model):
    """Both paths run the same sequence of decode steps on their own caches; logits and kept KV must agree."""
    from megatron_jf.inference.forward import forward_logits
    from megatron_jf.models.gpt import new_kv_cache

    g = torch.Generator().manual_seed(5)
    caches = {impl: new_kv_cache(model, 2, 48) for impl in ("lean", "static")}
    prompt = torch.randint(0, 256, (2, 7), generator=g)
    steps = []
    tree = torch.ones(2, 5, 5, dtype=torch.bool).tril_()
    tree[:, 3:, 1:3] = False
    for kind in ("ar", "jacobi", "tree", "ar", "jacobi", "ar"):
        s = {"ar": 1, "jacobi": 4, "tree": 5}[kind]
        steps.append((kind, torch.randint(0, 256, (2, s), generator=g)))
    from megatron_jf.inference.lean_forward import lean_forward_for
    from megatron_jf.inference.static_decode import static_decoder_for

    dec = static_decoder_for(lean_forward_for(model), caches["static"])
    dec.buckets, dec.learn = [1, 6], False  # widths 4 and 5 run padded to 6
    outs = {}
    for impl, cache in caches.items():
        forward_logits(model, prompt, torch.arange(7).expand(2, 7), kv_cache=cache, return_logits=False, impl="lean")
        cache.commit([7, 4])  # ragged rows
        seq = []
        for t, (kind, toks) in enumerate(steps):
            s = toks.shape[1]
            pos = cache.lengths[:, None] + torch.arange(s)[None, :]
            if kind == "tree":
                pos[:, 3:] = pos[:, 1:3]
            seq.append(forward_logits(model, toks, pos, kv_cache=cache, new_mask=tree if kind == "tree" else None,
                                      impl=impl))
            if kind == "tree":
                cache.commit([[0, 3, 4], 1])  # compaction: keep a branch, moved next to the committed tokens
            elif t == 4:
                cache.commit([3, 2])
                cache.trim(cache.lengths - torch.tensor([2, 1]))  # rollback
            else:
                cache.commit([s, max(1, s - 1)])
        outs[impl] = seq
    for a, b in zip(outs["lean"], outs["static"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    L = caches["lean"].lengths
    assert torch.equal(L, caches["static"].lengths)
    for b in range(2):
        n = int(L[b])
        torch.testing.assert_close(caches["lean"].k[:, b, :, :n], caches["static"].k[:, b, :, :n])
    assert dec.eager_static == len(steps) and dec.fallbacks == 0  # every step ran at a static shape


def test_engine_with_static_decode_forced_on_cpu_equals_ar(model, monkeypatch):
    from megatron_jf.inference.engine import DecodeConfig, Engine

    eng = Engine(model, check_invariants=True)
    p = [[3, 1, 4, 1, 5, 9, 2, 6], [5, 3, 5]]
    ref = [r.tokens for r in eng.generate(p, DecodeConfig("ar"), max_new_tokens=30)]
    monkeypatch.setenv("MEGATRON_JF_STATIC_DECODE", "force")
    for cfg in (DecodeConfig("ar"), DecodeConfig("jacobi", block_size=4), DecodeConfig("running-window", block_size=3),
                DecodeConfig("mr", block_size=4, num_blocks=2, spawn_threshold=0.5, verification_size=3)):
        assert [r.tokens for r in eng.generate(p, cfg, max_new_tokens=30)] == ref, cfg.decoder


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_cuda_graph_replay_equals_eager(model):
    from megatron_jf.inference.lean_forward import LeanForward
    from megatron_jf.inference.static_decode import StaticDecoder
    from megatron_jf.inference.forward import forward_logits
    from megatron_jf.models.gpt import new_kv_cache

    m = model.cuda()
    lean = LeanForward(m)
    outs = {}
    for graphs in (False, True):
        cache = new_kv_cache(m, 1, 64)
        forward_logits(m, torch.arange(10)[None], torch.arange(10)[None], kv_cache=cache, return_logits=False)
        cache.commit([10])
        dec = StaticDecoder(lean, cache, buckets=[1, 8], use_graphs=graphs)
        seq = []
        for t in range(6):
            s = 1 if t % 2 else 5
            toks = (torch.arange(s) + 3 * t)[None] % 256
            pos = cache.lengths[:, None] + torch.arange(s)[None, :]
            seq.append(dec.forward(toks, pos).float().cpu())
            cache.commit([max(1, s - 2)])
        outs[graphs] = seq
        if graphs:
            assert dec.replays == 6
    for a, b in zip(outs[False], outs[True]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    model.cpu()
