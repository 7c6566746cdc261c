"""The lean forward's C glue (megatron_jf/inference/cpu_glue.py, csrc/glue.c): equal to the torch ops it replaces up to
rounding, row-invariant (a token's bits do not depend on the tokens beside it: the decoders' losslessness), taken
by fp32 CPU forwards only, and off cleanly (switch, no compiler, a failing build)."""
import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from megatron_jf.inference import cpu_glue

needs_cc = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")


@pytest.fixture
def glue():
    g = cpu_glue.load()
    assert g is not None, "a C compiler is here but the glue did not build (see the log)"
    return g


def _rope_ref(qkv, cos, sin, ng, qpg, hd):
    b, s = qkv.shape[:2]
    q, k, v = torch.split(qkv.view(b, s, ng, (qpg + 2) * hd), [qpg * hd, hd, hd], dim=3)
    c4, s4 = cos.unsqueeze(1), sin.unsqueeze(1)

    def rot(t):
        t1, t2 = torch.chunk(t, 2, dim=-1)
        return t * c4 + torch.cat((-t2, t1), dim=-1) * s4

    return rot(q.reshape(b, s, ng * qpg, hd).transpose(1, 2)), rot(k.transpose(1, 2)), v.transpose(1, 2)


def _run(glue, x, r, w, qkv, cos, sin, gu, ng, qpg, hd):
    b, s = x.shape[:2]
    x = x.clone()
    h = torch.empty_like(x)
    glue.add_rmsnorm(x, r, w, h, 1e-6)
    q, k, v = torch.empty(b, ng * qpg, s, hd), torch.empty(b, ng, s, hd), torch.empty(b, ng, s, hd)
    glue.rope_split_qkv(qkv, cos, sin, q, k, v, ng, qpg, hd)
    act = torch.empty(b, s, gu.shape[-1] // 2)
    glue.silu_mul(gu, act)
    return x, h, q, k, v, act


def _case(b, s, hid, ng, qpg, hd, ff, seed=0):
    g = torch.Generator().manual_seed(seed)
    ang = torch.randn(b, s, hd, generator=g) * 3
    return dict(x=torch.randn(b, s, hid, generator=g), r=torch.randn(b, s, hid, generator=g),
                w=torch.randn(hid, generator=g), qkv=torch.randn(b, s, ng * (qpg + 2) * hd, generator=g),
                cos=ang.cos(), sin=ang.sin(),
                # gate values out to +-120: exp's clamped range and silu's tails
                gu=torch.randn(b, s, 2 * ff, generator=g) * torch.tensor([40.0] * ff + [1.0] * ff))


@needs_cc
@pytest.mark.parametrize("shape", [(2, 5, 576, 3, 3, 64, 1536), (1, 1, 37, 1, 1, 8, 19), (3, 4, 64, 2, 4, 16, 96),
                                   (1, 7, 1000, 4, 1, 32, 250)])
def test_glue_equals_the_torch_ops(glue, shape):
    b, s, hid, ng, qpg, hd, ff = shape
    c = _case(*shape)
    x, h, q, k, v, act = _run(glue, **c, ng=ng, qpg=qpg, hd=hd)
    rq, rk, rv = _rope_ref(c["qkv"], c["cos"], c["sin"], ng, qpg, hd)
    gate, up = torch.chunk(c["gu"], 2, dim=-1)
    torch.testing.assert_close(x, c["x"] + c["r"], rtol=0, atol=0)  # one rounding, as torch's add
    torch.testing.assert_close(h, F.rms_norm(c["x"] + c["r"], (hid,), c["w"], 1e-6), rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(q, rq, rtol=0, atol=0)  # the same products and sum, each rounded as written
    torch.testing.assert_close(k, rk, rtol=0, atol=0)
    assert torch.equal(v, rv)
    torch.testing.assert_close(act, F.silu(gate) * up, rtol=3e-6, atol=1e-6)
    # without a residual: the norm of x alone
    h2 = torch.empty_like(h)
    glue.add_rmsnorm(c["x"].clone(), None, c["w"], h2, 1e-6)
    torch.testing.assert_close(h2, F.rms_norm(c["x"], (hid,), c["w"], 1e-6), rtol=2e-6, atol=2e-6)


@needs_cc
def test_a_tokens_glue_values_do_not_depend_on_the_tokens_beside_it(glue):
    """Seven tokens in one call and each token alone (as a one-token AR step) give the same bits."""
    ng, qpg, hd = 3, 3, 64
    c = _case(1, 7, 576, ng, qpg, hd, 1536, seed=3)
    together = _run(glue, **c, ng=ng, qpg=qpg, hd=hd)
    for t in range(7):
        alone = _run(glue, **{k: (v if k == "w" else v[:, t:t + 1].contiguous()) for k, v in c.items()},
                     ng=ng, qpg=qpg, hd=hd)
        for i, (a, b) in enumerate(zip(alone, together)):
            part = b[:, :, t:t + 1] if i in (2, 3, 4) else b[:, t:t + 1]  # q/k/v are [b, heads, s, hd]
            assert torch.equal(a, part), f"output {i} of token {t}"


@needs_cc
@pytest.mark.parametrize("n,k", [(960, 576), (37, 19), (5 * 32, 64), (9 * 32 + 7, 33), (3 * 32 + 5, 300)])
def test_skinny_products_equal_the_sequential_sum_and_do_not_depend_on_the_rows(glue, n, k):
    """Every output element is the sequential fp32 sum over k (checked against a float64 reference and against
    itself computed alone): 1-19 rows (up to 16 a pass; past four, in groups of four over k chunks, the sums carried
    from one chunk to the next), panels several / one at a time, and the columns past the last full panel."""
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g)
    panels = glue.pack_panels(w)
    assert panels.shape == (n // 32, k, 32)
    x = torch.randn(19, k, generator=g)
    for rows in (1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 12, 13, 16, 17, 19):
        y = glue.skinny_mm(x[:rows].contiguous(), panels, w)
        torch.testing.assert_close(y.double(), x[:rows].double() @ w.double().T, rtol=1e-5, atol=k * 1e-6)
        for r in range(rows):
            alone = glue.skinny_mm(x[r:r + 1].contiguous(), panels, w)
            assert torch.equal(alone[0], y[r]), f"row {r} of {rows}"
    # the order of the sum is k's: a packed column and the last one by hand, for the first half's and second's rows;
    # a fused multiply-add is the exact x * w (a float32 product is exact in float64) plus the sum, rounded once
    y8 = glue.skinny_mm(x[:16].contiguous(), panels, w)
    for r, col in ((0, n - 1), (0, 0), (6, 0), (15, 0)):
        acc = torch.zeros((), dtype=torch.float32)
        for j in range(k):
            if glue.fused:
                acc = (x[r, j].double() * w[col, j].double() + acc.double()).float()
            else:
                acc = acc + x[r, j] * w[col, j]
        assert torch.equal(y8[r, col], acc), (r, col)
    if os.path.exists("/proc/cpuinfo"):  # -march=native: fused exactly where the CPU has FMA
        assert glue.fused == ("fma" in open("/proc/cpuinfo").read().split())


def _attn_case(b, ng, qpg, hd, start, s, slots, seed=0):
    g = torch.Generator().manual_seed(seed)
    kc, vc = torch.randn(b, ng, slots, hd, generator=g) * 2, torch.randn(b, ng, slots, hd, generator=g)
    q = torch.randn(b, ng * qpg, s, hd, generator=g) * 2
    return q, kc, vc


def _attn(glue, q, kc, vc, start, qpg, scale):
    b, nh, s, hd = q.shape
    out = torch.full((b, s, nh * hd), float("nan"))
    glue.decode_attn(q.contiguous(), kc, vc, out, torch.empty(glue.attn_scratch(s, qpg, hd, start)), start, qpg, scale)
    return out


@needs_cc
@pytest.mark.parametrize("shape", [(1, 2, 4, 32, 150, 1), (1, 2, 4, 32, 150, 8), (2, 3, 3, 64, 37, 5),
                                   (1, 1, 1, 16, 0, 20), (3, 2, 1, 48, 15, 1), (1, 4, 2, 128, 64, 17),
                                   (1, 1, 2, 256, 3, 3), (1, 2, 3, 32, 127, 3), (2, 1, 4, 64, 60, 9)])
def test_decode_attention_equals_sdpa_over_the_cache(glue, shape):
    """jf_decode_attn: s new tokens (their keys/values at slots start..start+s-1) over each row's cache, causal among
    the new tokens, GQA (query head h on key/value head h // qpg), output [b, s, heads * hd] -- SDPA's values up to
    rounding, for head dims 16-256 (one to sixteen 16-lane chunks), key counts below and past 16 (the butterfly's
    blocks and the one-at-a-time tail), 64-key chunks ending inside and at a token's keys (127 + 1..3: the four-way
    value sums' tail in the chunk after the last full one), an empty cache (a prefill) and several rows."""
    b, ng, qpg, hd, start, s = shape
    q, kc, vc = _attn_case(b, ng, qpg, hd, start, s, slots=start + s + 5, seed=sum(shape))
    scale = hd ** -0.5
    got = _attn(glue, q, kc, vc, start, qpg, scale)
    allow = torch.ones(s, start + s, dtype=torch.bool).tril_(start)
    want = F.scaled_dot_product_attention(q.double(), kc[:, :, :start + s].double(), vc[:, :, :start + s].double(),
                                          attn_mask=allow, scale=scale, enable_gqa=qpg > 1)
    want = want.transpose(1, 2).reshape(b, s, -1).float()
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-6)
    # the slots past each token's own are not read: garbage there changes nothing
    kc2, vc2 = kc.clone(), vc.clone()
    kc2[:, :, start + s:], vc2[:, :, start + s:] = float("nan"), float("nan")
    assert torch.equal(_attn(glue, q, kc2, vc2, start, qpg, scale), got)


@needs_cc
@pytest.mark.parametrize("hd", [32, 64, 48])
def test_a_tokens_attention_does_not_depend_on_the_tokens_beside_it(glue, hd):
    """Token t of an s-token step gives the bits it gives as a one-token step at start + t (an AR step after the
    draft's first t tokens were accepted): a draft's rows are the AR step's rows."""
    b, ng, qpg, start, s = 2, 2, 4, 141, 9
    q, kc, vc = _attn_case(b, ng, qpg, hd, start, s, slots=start + s)
    together = _attn(glue, q, kc, vc, start, qpg, 0.17)
    for t in range(s):
        alone = _attn(glue, q[:, :, t:t + 1], kc, vc, start + t, qpg, 0.17)
        assert torch.equal(alone[:, 0], together[:, t]), f"token {t}"


def _tiny(family="llama", tied=True, seed=2):
    from megatron_jf.models.convert import hf_to_mcore
    from megatron_jf.models.gpt import build_model
    from megatron_jf.models.hf_config import ModelArgs
    from megatron_jf.models.zoo import tiny_hf_model

    hf = tiny_hf_model(family, tied=tied, seed=seed, scale=0.2)
    args = ModelArgs.from_hf_dict(hf.config.to_dict())
    m = build_model(args).eval()
    m.load_state_dict(hf_to_mcore(hf.state_dict(), args), strict=False)
    return m


@needs_cc
@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_the_lean_forward_takes_the_glue_for_fp32_cpu_forwards_only(mp1, family, monkeypatch):
    from megatron_jf.inference.forward import forward_logits
    from megatron_jf.inference.lean_forward import lean_forward_for

    m = _tiny(family, tied=family == "llama")
    lf = lean_forward_for(m)
    calls = []
    real = cpu_glue.Glue.silu_mul
    monkeypatch.setattr(cpu_glue.Glue, "silu_mul", lambda self, *a: (calls.append(1), real(self, *a))[1])
    toks = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(9).expand(2, 9)
    with_glue = forward_logits(m, toks, pos, impl="lean")
    assert lf.glue is not None and len(calls) == len(lf.layers)
    saved, lf.glue = lf.glue, None  # None: the torch ops
    without = forward_logits(m, toks, pos, impl="lean")
    lf.glue = saved
    torch.testing.assert_close(with_glue, without, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(with_glue, forward_logits(m, toks, pos, impl="megatron"), rtol=1e-5, atol=1e-5)
    calls.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # bf16 products: the torch ops
        forward_logits(m, toks, pos, impl="lean")
    with torch.enable_grad():  # the glue writes through data pointers, outside autograd
        lf.hidden(toks, pos)
    assert calls == []


def test_the_glue_is_off_by_switch_and_where_it_cannot_be_built(mp1, monkeypatch, caplog, tmp_path):
    from megatron_jf.inference.cost_model import cost_key
    from megatron_jf.inference.forward import forward_logits
    from megatron_jf.inference.lean_forward import lean_forward_for

    monkeypatch.setattr(cpu_glue, "_LOADED", {})
    monkeypatch.setenv("MEGATRON_JF_CPU_GLUE", "0")
    assert cpu_glue.load() is None
    monkeypatch.delenv("MEGATRON_JF_CPU_GLUE")
    monkeypatch.setenv("MEGATRON_JF_COST_CACHE", str(tmp_path))
    bad = tmp_path / "cc"
    bad.write_text("#!/bin/sh\necho 'cc: internal error' >&2\nexit 1\n")
    bad.chmod(0o755)
    monkeypatch.setenv("CC", str(bad))
    with caplog.at_level("WARNING", logger="megatron_jf.inference.cpu_glue"):
        assert cpu_glue.load() is None
    assert "internal error" in caplog.text and not list((tmp_path / "glue").glob("*.so"))
    m = _tiny()
    toks = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(6).expand(1, 6)
    torch.testing.assert_close(forward_logits(m, toks, pos, impl="lean"),
                               forward_logits(m, toks, pos, impl="megatron"), rtol=1e-5, atol=1e-5)
    assert lean_forward_for(m).glue is None
    # the measured cost of a forward is kept per glue (the same model, with and without)
    off = cost_key(m, "lean")["impl"]
    if shutil.which("cc"):
        monkeypatch.delenv("CC")
        monkeypatch.setattr(cpu_glue, "_LOADED", {})
        on = cost_key(m, "lean")["impl"]
        assert on != off and os.path.basename(cpu_glue.load().path) in on  # a rebuilt glue is measured anew
