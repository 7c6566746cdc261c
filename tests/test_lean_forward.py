"""The lean inference forward computes megatron-core's forward (and transformers') on the same weights (issue 14)."""
import pytest
import torch


def _pair(family, tied, seed=0, **kw):
    from megatron_jf.models.convert import hf_to_mcore
    from megatron_jf.models.gpt import build_model
    from megatron_jf.models.hf_config import ModelArgs
    from megatron_jf.models.zoo import tiny_hf_model

    hf = tiny_hf_model(family, tied=tied, seed=seed, scale=0.2, **kw)
    args = ModelArgs.from_hf_dict(hf.config.to_dict())
    m = build_model(args).eval()
    m.load_state_dict(hf_to_mcore(hf.state_dict(), args), strict=False)
    return hf, m


@pytest.fixture(scope="module")
def pairs(mp1):
    # qwen2: QKV bias, untied head; llama: no bias, tied head (the shared-embedding output layer)
    return {"qwen2": _pair("qwen2", False, seed=1), "llama-tied": _pair("llama", True, seed=2)}


@pytest.mark.parametrize("name", ["qwen2", "llama-tied"])
def test_lean_equals_megatron_and_transformers_no_cache(pairs, name):
    from megatron_jf.inference.lean_forward import lean_forward_for
    from megatron_jf.inference.forward import forward_logits

    hf, m = pairs[name]
    assert lean_forward_for(m) is not None
    g = torch.Generator().manual_seed(0)
    toks = torch.randint(0, 256, (2, 11), generator=g)
    pos = torch.arange(11).expand(2, 11)
    lean = forward_logits(m, toks, pos, impl="lean")
    meg = forward_logits(m, toks, pos, impl="megatron")
    torch.testing.assert_close(lean, meg, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lean, hf(toks).logits, rtol=1e-4, atol=1e-4)
    # an explicit block mask (bidirectional inside two blocks of a packed pair, shifted positions)
    allowed = torch.ones(11, 11, dtype=torch.bool).tril_()
    allowed[3:7, 3:7] = True
    pos2 = torch.cat([torch.arange(7), torch.arange(3, 7)]).expand(2, 11)
    torch.testing.assert_close(forward_logits(m, toks, pos2, allowed=allowed, impl="lean"),
                               forward_logits(m, toks, pos2, allowed=allowed, impl="megatron"), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["default-packed", "default-transposed", "transposed", "packed", "linear", "skinny"])
@pytest.mark.parametrize("name", ["qwen2", "llama-tied"])
def test_lean_equals_megatron_with_kv_cache_tree_mask_and_ragged_rows(pairs, name, kind, monkeypatch):
    """Prefill (causal kernel), ragged committed lengths, a tree mask and a one-row step, both paths; the products
    through each kernel: the default rules (every multi-row product packed, or none: small products), and each
    kernel forced for every shape at every row count as a measured choice (``LeanForward.kernels``) may set it."""
    from megatron_jf.inference import lean_forward
    from megatron_jf.inference.forward import forward_logits
    from megatron_jf.models.gpt import new_kv_cache

    hf, m = pairs[name]
    monkeypatch.setattr(lean_forward, "PACKED_MIN_MACS", 1 << 62 if kind == "default-transposed" else 0)
    lf = lean_forward.lean_forward_for(m)
    forced = {} if kind.startswith("default") else {shape: ((1, kind),) for shape in lf.products()}
    monkeypatch.setattr(lf, "kernels", forced)
    lf._wp.clear()
    lf._wt.clear()
    prompt = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    outs = {}
    for impl in ("lean", "megatron"):
        cache = new_kv_cache(m, 2, 64)
        seq = []
        seq.append(forward_logits(m, prompt, torch.arange(9).expand(2, 9), kv_cache=cache, impl=impl))
        cache.commit([9, 5])  # ragged: row 1 keeps 5 of its 9
        tree = torch.ones(2, 6, 6, dtype=torch.bool).tril_()
        tree[:, 3:, 1:3] = False  # tokens 3.. form a second branch after token 0
        toks = torch.tensor([[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]])
        pos = torch.tensor([[9, 10, 11, 10, 11, 12], [5, 6, 7, 6, 7, 8]])
        seq.append(forward_logits(m, toks, pos, kv_cache=cache, new_mask=tree, impl=impl))
        cache.commit([[0, 3, 4], 2])
        seq.append(forward_logits(m, torch.tensor([[13], [14]]), torch.tensor([[12], [7]]), kv_cache=cache, impl=impl))
        outs[impl] = seq
    for a, b in zip(outs["lean"], outs["megatron"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # the products went the way the rules or the forced kernel say (copies are made on first use)
    # (skinny takes up to 16 rows a pass: the 18-row products here take the default rule, packed)
    assert bool(lf._wp) == (kind in ("default-packed", "packed", "skinny") and lf.packed)
    assert bool(lf._wk) == (kind == "skinny" and bool(lf.glue))  # the last step's 2-row products (with the C glue)
    assert bool(lf._wt) == (kind in ("default-transposed", "transposed"))  # (every product here has 2+ rows)
    # the last one-row step of row 0 equals transformers on the committed sequence: prompt, tokens 0, 3, 4, 13
    full = torch.cat([prompt[0], torch.tensor([1, 4, 5, 13])])[None]
    ref = hf(full, position_ids=torch.tensor([list(range(9)) + [9, 10, 11, 12]])).logits[0, -1]
    torch.testing.assert_close(outs["lean"][2][0, 0], ref, rtol=1e-4, atol=1e-4)


def test_decode_steps_attend_in_the_c_glue_and_equal_megatron(pairs, monkeypatch):
    """Causal steps over rows of one committed length (a prefill of up to DECODE_ATTN_MAX_TOKENS tokens, ``[last] +
    draft``, a one-token step) attend in the C glue, writing the keys and values into the cache; a tree mask, ragged
    rows, wider steps and -- with several torch threads -- a batch's many queries take SDPA. Every step equals
    megatron-core's forward over the same cache contents."""
    import shutil

    from megatron_jf.inference import cpu_glue, lean_forward
    from megatron_jf.inference.forward import forward_logits
    from megatron_jf.models.gpt import new_kv_cache

    if shutil.which("cc") is None:
        pytest.skip("no C compiler")
    hf, m = pairs["qwen2"]
    lf = lean_forward.lean_forward_for(m)
    calls = []
    real = cpu_glue.Glue.decode_attn
    monkeypatch.setattr(cpu_glue.Glue, "decode_attn", lambda self, q, *a: (calls.append(q.shape[2]), real(self, q, *a))[1])
    gen = torch.Generator().manual_seed(5)
    caches = {impl: new_kv_cache(m, 2, 64) for impl in ("lean", "megatron")}

    def step(toks, pos, **kw):
        calls.clear()
        out = {impl: forward_logits(m, toks, pos, kv_cache=caches[impl], impl=impl, **kw) for impl in caches}
        torch.testing.assert_close(out["lean"], out["megatron"], rtol=1e-5, atol=1e-5)
        return list(calls)

    def commit(keep):
        for c in caches.values():
            c.commit(keep)

    layers = len(lf.layers)
    assert step(torch.randint(0, 256, (2, 9), generator=gen), torch.arange(9).expand(2, 9)) == [9] * layers  # prefill
    commit([9, 9])
    assert step(torch.randint(0, 256, (2, 4), generator=gen), torch.arange(9, 13).expand(2, 4)) == [4] * layers
    commit([2, 2])
    assert step(torch.randint(0, 256, (2, 1), generator=gen), torch.tensor([[11], [11]])) == [1] * layers
    commit([1, 1])
    tree = torch.ones(2, 5, 5, dtype=torch.bool).tril_()
    tree[:, 3:, 1:3] = False
    assert step(torch.randint(0, 256, (2, 5), generator=gen), torch.tensor([[12, 13, 14, 13, 14]] * 2),
                new_mask=tree) == []  # a tree: SDPA with its mask
    commit([2, 1])
    assert step(torch.randint(0, 256, (2, 3), generator=gen), torch.tensor([[14, 15, 16], [13, 14, 15]])) == []
    commit([1, 1])  # ragged rows above; equal again below
    for c in caches.values():
        c.trim([14, 14])
    wide = lean_forward.DECODE_ATTN_MAX_TOKENS + 1
    assert step(torch.randint(0, 256, (2, wide), generator=gen), torch.arange(14, 14 + wide).expand(2, wide)) == []
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:  # 2 rows x 9 tokens: more than 16 queries, shared among the threads by SDPA
        assert step(torch.randint(0, 256, (2, 9), generator=gen), torch.arange(14, 23).expand(2, 9)) == []
        assert step(torch.randint(0, 256, (2, 8), generator=gen), torch.arange(14, 22).expand(2, 8)) == [8] * layers
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("kinds", [("transposed", "linear"), ("transposed", "packed"), ("linear", "packed")])
def test_a_row_is_the_same_whichever_kernel_its_row_count_takes_under_bf16_autocast(kinds, mp1):
    """fp32 weights under bf16 autocast (``bench/decode_precision.py``'s third mode), the QKV product with its bias:
    a one-row product through one kernel equals each row of a 4-row product through another, bit for bit -- so a
    draft's rows are the AR step's, whatever kernels the measured choice gives the two row counts (with F.linear's
    fused bias the sum was rounded to bf16 where ``x @ W_t + bias`` was not, and the decoders parted from AR)."""
    from megatron_jf.inference import lean_forward
    from megatron_jf.precision import autocast

    _, m = _pair("qwen2", False, seed=3)
    lf = lean_forward.lean_forward_for(m)
    L = lf.layers[0]
    assert L.qkv_b is not None
    x = torch.randn(4, L.qkv_w.shape[1], generator=torch.Generator().manual_seed(0))
    with autocast(torch.bfloat16), torch.no_grad():
        one = torch.cat([lf._linear(x[i:i + 1], L.qkv_w, L.names[0], L.qkv_b, kind=kinds[0]) for i in range(4)])
        four = lf._linear(x, L.qkv_w, L.names[0], L.qkv_b, kind=kinds[1])
    assert one.dtype == four.dtype and torch.equal(one, four)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_one_row_products_take_the_packed_weights(dtype, monkeypatch, mp1):
    """One-row (AR step) products go through oneDNN's packed copy where it pays: bf16 weights always (native bf16
    kernels; a bf16 ``x @ W_t`` is slower than fp32's), fp32 weights where the measured kernel says so
    (``LeanForward.kernels``); the cached one-row step equals megatron-core's forward (and, fp32, the transposed
    and ``F.linear`` paths)."""
    from megatron_jf.inference import lean_forward
    from megatron_jf.inference.forward import forward_logits
    from megatron_jf.models.gpt import new_kv_cache

    _, m = _pair("qwen2", False, seed=4)
    if dtype == "bf16":
        m = m.to(torch.bfloat16)
    prompt = torch.randint(0, 256, (1, 7), generator=torch.Generator().manual_seed(2))
    step = {}
    modes = ("packed", "megatron") if dtype == "bf16" else ("packed", "transposed", "linear", "megatron")
    for mode in modes:
        lf = lean_forward.lean_forward_for(m)
        # fp32's choice (measured by cost_model.calibrate_products); bf16 always packs
        lf.kernels = {shape: ((1, mode),) for shape in lf.products()} if mode != "megatron" else {}
        impl = "megatron" if mode == "megatron" else "lean"
        cache = new_kv_cache(m, 1, 16)
        forward_logits(m, prompt, torch.arange(7)[None], kv_cache=cache, return_logits=False, impl=impl)
        cache.commit([7])
        lf._wp.clear()
        step[mode] = forward_logits(m, torch.tensor([[5]]), torch.tensor([[7]]), kv_cache=cache, impl=impl).float()
        if mode != "megatron":
            assert bool(lf._wp) == (mode == "packed" and lf.packed), mode  # the one-row step's products went packed
    scale = float(step["megatron"].abs().max())
    tol = 0.03 * scale if dtype == "bf16" else 1e-5 * max(scale, 1.0)
    for mode in step:
        assert float((step[mode] - step["megatron"]).abs().max()) <= tol, mode
    assert int(step["packed"].argmax()) == int(step["megatron"].argmax())


def test_cached_prefill_uses_causal_kernel_and_matches_uncached(pairs):
    from megatron_jf.inference.forward import forward_logits
    from megatron_jf.models.gpt import new_kv_cache

    hf, m = pairs["qwen2"]
    toks = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(10)[None]
    cache = new_kv_cache(m, 1, 32)
    cache.begin(10, causal_kernel=True)
    assert cache.step_is_causal
    cache.end()
    cache.begin(10)  # megatron's core attention reads the mask: it must be built
    kv = torch.zeros(1, cache.k.shape[2], 10, cache.k.shape[-1])
    allow = cache.update(0, kv, kv)[2]
    assert not cache.step_is_causal and allow is not None
    assert torch.equal(allow[0, 0] == 0, torch.ones(10, 10, dtype=torch.bool).tril())
    cache.end()
    a = forward_logits(m, toks, pos, kv_cache=cache, impl="lean")
    torch.testing.assert_close(a, forward_logits(m, toks, pos, impl="megatron"), rtol=1e-5, atol=1e-5)
    # after a commit the next block is not "plain causal from zero": a mask over the committed slots
    cache.commit([10])
    cache.begin(3, causal_kernel=True)
    assert not cache.step_is_causal
    cache.end()


def test_prefill_without_logits(pairs):
    from megatron_jf.inference.forward import forward_logits
    from megatron_jf.models.gpt import new_kv_cache

    hf, m = pairs["llama-tied"]
    toks = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(4))
    for impl in ("lean", "megatron"):
        cache = new_kv_cache(m, 1, 16)
        assert forward_logits(m, toks[:, :7], torch.arange(7)[None], kv_cache=cache, return_logits=False,
                              impl=impl) is None
        cache.commit([7])
        step = forward_logits(m, toks[:, 7:], torch.tensor([[7]]), kv_cache=cache, impl=impl)
        torch.testing.assert_close(step[0, 0], hf(toks).logits[0, 7], rtol=1e-4, atol=1e-4)


def test_transposed_gemv_copies_follow_weight_updates(mp1):
    """One-row forwards read transposed weight copies; loading new weights must refresh them."""
    from megatron_jf.models.convert import hf_to_mcore
    from megatron_jf.inference.forward import forward_logits
    from megatron_jf.models.gpt import new_kv_cache
    from megatron_jf.models.hf_config import ModelArgs
    from megatron_jf.models.zoo import tiny_hf_model

    hf_a, m = _pair("qwen2", False, seed=5)
    toks = torch.tensor([[3, 1, 4, 1, 5]])

    def step_logits():
        cache = new_kv_cache(m, 1, 8)
        forward_logits(m, toks[:, :4], torch.arange(4)[None], kv_cache=cache, return_logits=False)
        cache.commit([4])
        return forward_logits(m, toks[:, 4:], torch.tensor([[4]]), kv_cache=cache)[0, 0]

    torch.testing.assert_close(step_logits(), hf_a(toks).logits[0, 4], rtol=1e-4, atol=1e-4)
    from megatron_jf.inference.lean_forward import lean_forward_for

    lf = lean_forward_for(m)
    assert {"out", "qkv0", "fc11"} <= lf.gemv_transposed and "out" in lf._wt  # copies were made
    hf_b = tiny_hf_model("qwen2", seed=6, scale=0.2)
    m.load_state_dict(hf_to_mcore(hf_b.state_dict(), ModelArgs.from_hf_dict(hf_b.config.to_dict())), strict=False)
    torch.testing.assert_close(step_logits(), hf_b(toks).logits[0, 4], rtol=1e-4, atol=1e-4)


def test_switch_off_by_env(pairs, monkeypatch):
    from megatron_jf.inference.lean_forward import lean_forward_for

    hf, m = pairs["qwen2"]
    monkeypatch.setenv("MEGATRON_JF_LEAN_FORWARD", "0")
    assert lean_forward_for(m) is None
    monkeypatch.setenv("MEGATRON_JF_LEAN_FORWARD", "1")
    assert lean_forward_for(m) is not None


def test_bad_impl_is_named(pairs):
    from megatron_jf.inference.forward import forward_logits

    with pytest.raises(ValueError, match="unknown forward impl"):
        forward_logits(pairs["qwen2"][1], torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2, dtype=torch.long),
                       impl="fast")


def test_inference_models_use_the_spec_the_lean_forward_runs_on(mp1, monkeypatch):
    """Inference tools build the local spec while the lean forward is on, so decoding (and its CUDA-graph path)
    runs also where Transformer Engine is installed; a TE spec that cannot be built is a clear error."""
    from megatron_jf import platform
    from megatron_jf.checkpointing import inference_spec
    from megatron_jf.models.gpt import layer_spec
    from megatron_jf.models.hf_config import ModelArgs
    from megatron_jf.models.zoo import tiny_hf_model

    args = ModelArgs.from_hf_dict(tiny_hf_model("qwen2", seed=0).config.to_dict())
    monkeypatch.delenv("MEGATRON_JF_LEAN_FORWARD", raising=False)
    assert inference_spec() == "local"
    monkeypatch.setenv("MEGATRON_JF_LEAN_FORWARD", "0")
    assert inference_spec() == "auto"
    with pytest.raises(ValueError, match="unknown transformer impl"):
        layer_spec(args, "te")
    if not (platform.HAVE_TE and platform.HAVE_CUDA):
        with pytest.raises(ValueError, match="needs Transformer Engine"):
            layer_spec(args, "transformer_engine")
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    assert layer_spec(args, "local").submodules.self_attention.submodules.linear_qkv is ColumnParallelLinear


def test_local_spec_norms_do_not_follow_what_megatron_finds_installed(mp1, monkeypatch):
    """Issue 21 items 2 and 5. megatron-core picks a block's final norm by what is installed (``TENorm`` with TE,
    apex's LayerNorm-only ``FusedLayerNorm`` with apex) and its torch norm asserts ``not sequence_parallel`` (our CPU
    shim hid that). Here megatron believes something else is installed and its torch norm refuses SP, as on an NGC
    box: the model inference tools build must still have torch RMSNorms the lean forward runs on, and each norm of
    the local spec must build under sequence parallelism with its weight marked for the TP gradient sum."""
    from megatron.core.transformer import torch_norm, transformer_block

    from megatron_jf.inference.lean_forward import LeanForward, supports
    from megatron_jf.inference.forward import forward_logits
    from megatron_jf.checkpointing import inference_spec
    from megatron_jf.models.gpt import build_model, layer_spec
    from megatron_jf.models.gpt import transformer_config
    from megatron_jf.models.hf_config import ModelArgs
    from megatron_jf.models.zoo import tiny_hf_model

    class InstalledNorm:  # stands for megatron's pick by installation; building it is the bug
        def __new__(cls, *a, **k):
            raise AssertionError("the norm megatron-core picks by what is installed was built")

    def no_sp(cls, config, *a, **k):  # megatron's WrappedTorchNorm on CUDA (no CPU shim)
        if config.sequence_parallel:
            raise AssertionError("sequence parallel not supported by torch LayerNorm")
        return torch.nn.RMSNorm(a[0] if a else k["hidden_size"])

    monkeypatch.setattr(transformer_block, "LayerNormImpl", InstalledNorm)
    monkeypatch.setattr(torch_norm.WrappedTorchNorm, "__new__", no_sp)
    monkeypatch.delenv("MEGATRON_JF_LEAN_FORWARD", raising=False)
    args = ModelArgs.from_hf_dict(tiny_hf_model("qwen2", seed=0).config.to_dict())
    m = build_model(args, transformer_impl=inference_spec()).eval()
    assert isinstance(m.decoder.final_layernorm, torch.nn.RMSNorm) and supports(m)
    toks = torch.randint(0, 256, (1, 7), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(7)[None]
    torch.testing.assert_close(forward_logits(m, toks, pos, impl="lean"), forward_logits(m, toks, pos, impl="megatron"),
                               rtol=1e-5, atol=1e-5)
    LeanForward(m)  # impl="lean"/"static" and the GPU decode check require it

    cfg = transformer_config(args)
    cfg.sequence_parallel = True  # as at TP > 1 (the config refuses SP at TP = 1; the norms only read the flag)
    spec = layer_spec(args, "local")
    for build in (spec.submodules.input_layernorm, spec.submodules.pre_mlp_layernorm, type(m.decoder.final_layernorm)):
        norm = build(config=cfg, hidden_size=args.hidden_size, eps=args.rms_norm_eps)
        assert isinstance(norm, torch.nn.RMSNorm) and norm.weight.sequence_parallel is True
        assert norm.eps == args.rms_norm_eps and norm.weight.dtype == cfg.params_dtype
