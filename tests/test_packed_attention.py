"""The packed (THD) attention path: megatron-core ``PackedSeqParams`` through the core attention.

* the packing: ``[noisy_0, clean_0, noisy_1, clean_1, ...]`` in one row, ``cu_seqlens`` delimiting the
  streams (plus a trailing padding segment), positions restarting per stream, loss indices landing on the
  same tokens as the two-stream layout;
* per-segment causal SDPA equals a causal SDPA over each segment cut out by hand, and a query never sees
  another segment;
* model logits on the packed path equal the two-stream and dense paths and independent causal passes;
  the loss and its gradients equal the two-stream path's;
* with Transformer Engine and CUDA present, TE's fused ``padding_causal`` attention equals the SDPA
  reference (skipped when TE/CUDA is absent).
"""
import os
import sys

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "dist"))
from conftest import run_torchrun  # noqa: E402
from train_fixtures import make_record, tiny_mcore_model  # noqa: E402

TOL = 1e-5


@pytest.fixture(scope="module")
def tiny(mp1):
    model, args = tiny_mcore_model(seed=3)
    return model.eval(), args


def _packed_samples():
    from megatron_jf.data.packing import pack_record

    recs = [make_record(11, prompt_len=5, block_size=4, num_blocks=3),
            make_record(12, prompt_len=7, block_size=4, num_blocks=3, last_block_len=2)]
    return recs, [pack_record(r, "progressive", 3) for r in recs]


def _causal(model, ids):
    with torch.no_grad():
        return model(ids[None], torch.arange(ids.shape[0])[None], None, runtime_gather_output=False)[0]


def test_packed_batch_layout():
    """One row [noisy_0, clean_0, noisy_1, clean_1, pad]; cu_seqlens at the stream boundaries; positions
    restart at 0 per stream; the loss indices pick the same tokens as the two-stream batch's."""
    from megatron_jf.data.packing import to_two_stream
    from megatron_jf.training.attention_paths import build_jf_batch

    recs, packed = _packed_samples()
    b = build_jf_batch(packed, path="packed", mask="nc", pad_to_multiple_of=16)
    two = build_jf_batch(packed, path="two_stream", mask="nc")
    lens = [len(to_two_stream(p)) for p in packed]  # P + R per stream
    assert lens == [17, 17]  # 5 + 12, 7 + 10
    T = b.tokens.shape[1]
    assert b.tokens.shape[0] == 1 and T == 80  # 2 * (17 + 17) = 68 real tokens, rounded up to a multiple of 16
    cu = b.packed_seq_params.cu_seqlens_q
    assert cu.dtype == torch.int32
    starts = [0, lens[0], 2 * lens[0], 2 * lens[0] + lens[1], 2 * sum(lens)]
    assert cu.tolist() == starts + ([T] if T > starts[-1] else [])
    assert b.packed_seq_params.qkv_format == "thd" and b.packed_seq_params.cu_seqlens_kv is cu
    assert b.packed_seq_params.max_seqlen_q == max(max(lens), T - starts[-1])
    for i, rec in enumerate(recs):
        noisy = two.tokens[i, : lens[i]]
        clean = two.tokens[len(recs) + i, : lens[i]]
        s0 = starts[2 * i]
        assert torch.equal(b.tokens[0, s0 : s0 + lens[i]], noisy)
        assert torch.equal(b.tokens[0, s0 + lens[i] : s0 + 2 * lens[i]], clean)
        assert torch.equal(clean, rec.full_ids())
        assert torch.equal(b.position_ids[0, s0 : s0 + lens[i]], torch.arange(lens[i]))
        assert torch.equal(b.position_ids[0, s0 + lens[i] : s0 + 2 * lens[i]], torch.arange(lens[i]))
    flat_p, flat_t = b.tokens.reshape(-1), two.tokens.reshape(-1)
    for name in ("student_index", "teacher_index", "ar_index"):
        assert torch.equal(flat_p[getattr(b, name)], flat_t[getattr(two, name)]), name
    for name in ("pc_targets", "pair_sample", "pair_block", "ar_targets", "ar_sample", "num_blocks"):
        assert torch.equal(getattr(b, name), getattr(two, name)), name
    assert b.num_tokens == 2 * sum(lens) and b.attention_mask is None


def test_packed_batch_errors():
    from megatron_jf.training.attention_paths import append_anchor_rows, build_jf_batch

    _, packed = _packed_samples()
    with pytest.raises(ValueError, match="exceeds the sequence length 16"):
        build_jf_batch(packed, path="packed", mask="nc", max_len=16)
    with pytest.raises(ValueError, match="packed row"):
        build_jf_batch(packed, path="packed", mask="nc", pad_to=40)  # 68 tokens do not fit 40
    b = build_jf_batch(packed, path="packed", mask="nc")
    with pytest.raises(ValueError, match="packed THD path"):
        append_anchor_rows(b, None)


def test_packed_causal_sdpa_equals_per_segment_reference():
    """Segment i's queries see exactly keys cu[i]..themselves (GQA; an empty segment is allowed)."""
    from megatron_jf.models.attention import packed_causal_sdpa

    g = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 5, 5, 12, 20], dtype=torch.int32)
    q = torch.randn(20, 4, 8, generator=g)
    k = torch.randn(20, 2, 8, generator=g)
    v = torch.randn(20, 2, 8, generator=g)
    out = packed_causal_sdpa(q, k, v, cu, 0.3)
    assert out.shape == (20, 32)
    for a, b in [(0, 5), (5, 12), (12, 20)]:
        kk = k[a:b].repeat_interleave(2, dim=1)
        vv = v[a:b].repeat_interleave(2, dim=1)
        s = torch.einsum("qhd,khd->hqk", q[a:b], kk) * 0.3
        s = s.masked_fill(torch.ones(b - a, b - a, dtype=torch.bool).triu(1), float("-inf"))
        ref = torch.einsum("hqk,khd->qhd", s.softmax(-1), vv).reshape(b - a, 32)
        assert (out[a:b] - ref).abs().max() <= 1e-5
    # one causal SDPA over everything differs: the segmentation is doing something
    full = F.scaled_dot_product_attention(q.transpose(0, 1), k.repeat_interleave(2, 1).transpose(0, 1),
                                          v.repeat_interleave(2, 1).transpose(0, 1), is_causal=True, scale=0.3)
    assert (full.transpose(0, 1).reshape(20, 32)[5:] - out[5:]).abs().max() > 1e-2
    with pytest.raises(ValueError, match="rise from 0"):
        packed_causal_sdpa(q, k, v, torch.tensor([0, 5, 19], dtype=torch.int32), 0.3)


def test_packed_params_validation():
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_jf.models.attention import _check_packed

    cu = torch.tensor([0, 3, 6], dtype=torch.int32)
    q = torch.zeros(6, 2, 4)
    _check_packed(PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu), q)
    with pytest.raises(ValueError, match="qkv_format"):
        _check_packed(PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=cu, cu_seqlens_kv=cu), q)
    with pytest.raises(ValueError, match="cu_seqlens_kv"):
        _check_packed(PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu.flip(0)), q)
    with pytest.raises(ValueError, match="padded"):
        _check_packed(PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                      cu_seqlens_q_padded=cu * 2), q)


def test_packed_logits_equal_two_stream_dense_and_causal(tiny):
    """Packed-path logits at every stream position equal the two-stream path, the dense path and an
    independent causal pass of prompt + noisy blocks / prompt + clean blocks."""
    from megatron_jf.data.packing import ROLE_CLEAN, ROLE_NOISY, to_two_stream
    from megatron_jf.training.attention_paths import build_jf_batch, forward_model

    model, _ = tiny
    recs, packed = _packed_samples()
    B = len(recs)
    with torch.no_grad():
        pk_batch = build_jf_batch(packed, path="packed", mask="nc", pad_to_multiple_of=16)
        out = forward_model(model, pk_batch)[0]  # [T, V]
        two = forward_model(model, build_jf_batch(packed, path="two_stream", mask="nc"))
        dense = forward_model(model, build_jf_batch(packed, path="dense", mask="nc"))
    cu = pk_batch.packed_seq_params.cu_seqlens_q.tolist()
    for b, (rec, pk) in enumerate(zip(recs, packed)):
        T = len(to_two_stream(pk))
        P = rec.prompt_len
        noisy_p = out[cu[2 * b] : cu[2 * b] + T]
        clean_p = out[cu[2 * b + 1] : cu[2 * b + 1] + T]
        assert (noisy_p - two[b, :T]).abs().max() <= TOL
        assert (clean_p - two[B + b, :T]).abs().max() <= TOL
        clean_ref = _causal(model, rec.full_ids())
        assert (clean_p - clean_ref).abs().max() <= TOL
        noisy_idx = torch.nonzero(pk.roles == ROLE_NOISY).flatten()
        clean_idx = torch.nonzero(pk.roles == ROLE_CLEAN).flatten()
        assert (noisy_p[P:] - dense[b, noisy_idx]).abs().max() <= TOL
        assert (clean_p[P:] - dense[b, clean_idx]).abs().max() <= TOL
    # the noisy and clean streams really differ, so the comparisons above are not vacuous
    assert (out[cu[0] + 6 : cu[0] + 12] - out[cu[1] + 6 : cu[1] + 12]).abs().max() > 1e-2


def test_packed_loss_and_grads_equal_two_stream(mp1):
    """One training forward/backward: loss and every parameter gradient equal the two-stream path."""
    from megatron_jf.training.attention_paths import build_jf_batch, jf_forward
    from megatron_jf.training.config import JFObjective
    from megatron_jf.training.losses import jf_loss

    model, _ = tiny_mcore_model(seed=5)
    model.train()
    _, packed = _packed_samples()
    cfg = JFObjective(consistency_loss="kl", kl_temperature=1.0, pc_weight=1.0, ar_weight=0.7)
    res = {}
    for path in ("two_stream", "packed"):
        model.zero_grad(set_to_none=True)
        loss, _ = jf_loss(jf_forward(model, build_jf_batch(packed, path=path, mask="nc", pad_to_multiple_of=8)), cfg)
        loss.backward()
        res[path] = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    (l2, g2), (lp, gp) = res["two_stream"], res["packed"]
    assert abs(l2.item() - lp.item()) <= 1e-6 * max(1.0, abs(l2.item()))
    assert g2.keys() == gp.keys()
    for n in g2:
        scale = max(g2[n].abs().max().item(), 1e-8)
        assert (g2[n] - gp[n]).abs().max().item() <= 1e-5 * scale, n


@pytest.mark.parametrize("mask", ["nc_ic", "clean"])
def test_gathered_thd_layout_segments(mask):
    """Query order [prompt, clean blocks, noisy windows]; each window's gathered keys are the prompt, the
    clean blocks before the window and the window itself, exactly the keys the dense mask allows."""
    from megatron_jf.data.masks import dense_mask
    from megatron_jf.data.thd import sample_segments, thd_layout

    _, packed = _packed_samples()
    w = 2 if mask == "nc_ic" else None
    lay = thd_layout(packed, mask, window_size=w, pad_to_multiple_of=16)
    T = lay.tokens.shape[0]
    assert T % 16 == 0 and lay.num_real == sum(len(p) for p in packed) < T
    cq, ck = lay.cu_seqlens_q.tolist(), lay.cu_seqlens_kv.tolist()
    assert cq[-1] == T and ck[-1] == lay.kv_index.shape[0] and len(cq) == len(ck)
    inv = torch.full((T,), -1)
    seg = 0
    for b, (p, mp) in enumerate(zip(packed, lay.model_pos)):
        assert torch.equal(lay.tokens[mp], p.tokens) and torch.equal(lay.position_ids[mp], p.position_ids)
        allowed = dense_mask(mask, p, window_size=w)  # [L, L], True = may attend
        inv[mp] = torch.arange(len(p))
        segs = sample_segments(p, mask, w)
        assert len(segs) == 1 + (-(-p.num_blocks // (w or 1)))
        for q, _ in segs:
            keys = inv[lay.kv_index[ck[seg]:ck[seg + 1]]]  # packed indices of the gathered keys
            qi = inv[torch.arange(cq[seg], cq[seg + 1])]
            assert torch.equal(qi, q)
            n, m = keys.numel(), qi.numel()
            for i in range(m):  # bottom-right causal over the gathered keys == the dense mask's row
                seen = torch.zeros(len(p), dtype=torch.bool)
                seen[keys[: n - m + i + 1]] = True
                assert torch.equal(seen, allowed[qi[i]]), (mask, b, int(qi[i]))
            seg += 1
    assert cq[seg + 1] - cq[seg] == T - lay.num_real  # the trailing padding segment


@pytest.mark.parametrize("mask", ["nc_ic", "clean"])
def test_packed_other_masks_equal_dense(tiny, mask):
    """``nc_ic`` / ``clean`` on the packed path (query-ordered THD, gathered keys, bottom-right causal
    segments): logits at every packed position equal the dense-mask path's."""
    from megatron_jf.training.attention_paths import build_jf_batch, forward_model

    model, _ = tiny
    _, packed = _packed_samples()
    a = build_jf_batch(packed, path="packed", mask=mask, window_size=2, pad_to_multiple_of=8)
    d = build_jf_batch(packed, path="dense", mask=mask, window_size=2)
    assert a.attention_mask is None and a.tokens.shape[0] == 1 and a.packed_seq_params.kv_index is not None
    with torch.no_grad():
        out = forward_model(model, a)[0]
        ref = forward_model(model, d)
    from megatron_jf.data.thd import thd_layout

    lay = thd_layout(packed, mask, window_size=2 if mask == "nc_ic" else None, pad_to_multiple_of=8)
    for b, (p, mp) in enumerate(zip(packed, lay.model_pos)):
        assert (out[mp] - ref[b, : len(p)]).abs().max() <= TOL, (mask, b)
    flat_a, flat_d = a.tokens.reshape(-1), d.tokens.reshape(-1)
    for name in ("student_index", "teacher_index", "ar_index"):
        assert torch.equal(flat_a[getattr(a, name)], flat_d[getattr(d, name)]), name


def test_packed_nc_ic_loss_and_grads_equal_dense(mp1):
    from megatron_jf.training.attention_paths import build_jf_batch, jf_forward
    from megatron_jf.training.config import JFObjective
    from megatron_jf.training.losses import jf_loss

    model, _ = tiny_mcore_model(seed=6)
    model.train()
    _, packed = _packed_samples()
    cfg = JFObjective(consistency_loss="kl", kl_temperature=1.0, pc_weight=1.0, ar_weight=0.7)
    res = {}
    for path in ("dense", "packed"):
        model.zero_grad(set_to_none=True)
        loss, rep = jf_loss(jf_forward(model, build_jf_batch(packed, path=path, mask="nc_ic", window_size=2)), cfg)
        loss.backward()
        res[path] = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    (ld, gd), (lp, gp) = res["dense"], res["packed"]
    assert abs(ld.item() - lp.item()) <= 1e-6 * max(1.0, abs(ld.item()))
    for n in gd:
        assert (gd[n] - gp[n]).abs().max().item() <= 1e-5 * max(gd[n].abs().max().item(), 1e-8), n


def test_gathered_keys_reproduce_nc_two_stream(tiny):
    """The gathered-key mechanism with one window of all blocks (the ``nc`` mask, prompt not duplicated)
    gives the two-stream logits: an independent check of the bottom-right segments and the key gather."""
    from megatron_jf.data.thd import thd_layout
    from megatron_jf.models.attention import GatheredKVPackedSeqParams
    from megatron_jf.training.attention_paths import build_jf_batch, forward_model

    model, _ = tiny
    recs, packed = _packed_samples()
    lay = thd_layout(packed, "nc")
    cu = lay.cu_seqlens_q
    psp = GatheredKVPackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=lay.max_seqlen_q,
                                    max_seqlen_kv=lay.max_seqlen_q, kv_index=lay.kv_index,
                                    cu_seqlens_kv_gathered=lay.cu_seqlens_kv, max_seqlen_kv_gathered=lay.max_seqlen_kv)
    with torch.no_grad():
        out = model(lay.tokens[None], lay.position_ids[None], None, runtime_gather_output=False,
                    packed_seq_params=psp)[0]
        two = forward_model(model, build_jf_batch(packed, path="two_stream", mask="nc"))
    from megatron_jf.data.packing import to_two_stream

    B = len(packed)
    for b, (p, mp) in enumerate(zip(packed, lay.model_pos)):
        ts = to_two_stream(p)
        T = len(ts)
        assert (out[mp[ts.noisy_index]] - two[b, :T]).abs().max() <= TOL
        assert (out[mp[ts.clean_index]] - two[B + b, :T]).abs().max() <= TOL
    assert lay.num_real == sum(len(p) for p in packed)  # P + 2R per sample: the prompt is computed once


def test_packed_causal_sdpa_bottom_right():
    from megatron_jf.models.attention import packed_causal_sdpa

    g = torch.Generator().manual_seed(1)
    q = torch.randn(5, 2, 4, generator=g)
    k = torch.randn(9, 2, 4, generator=g)
    v = torch.randn(9, 2, 4, generator=g)
    cu_q = torch.tensor([0, 2, 5], dtype=torch.int32)
    cu_k = torch.tensor([0, 4, 9], dtype=torch.int32)  # segment 0: 2 queries over 4 keys; 1: 3 over 5
    out = packed_causal_sdpa(q, k, v, cu_q, 0.5, cu_seqlens_kv=cu_k)
    for (a, b), (c, d) in zip([(0, 2), (2, 5)], [(0, 4), (4, 9)]):
        m, n = b - a, d - c
        for i in range(m):
            keys = k[c : c + n - m + i + 1]
            w = (torch.einsum("hd,khd->hk", q[a + i], keys) * 0.5).softmax(-1)
            ref = torch.einsum("hk,khd->hd", w, v[c : c + n - m + i + 1]).reshape(-1)
            assert (out[a + i] - ref).abs().max() <= 1e-5
    with pytest.raises(ValueError, match="shorter than its query"):
        packed_causal_sdpa(q, k[:6], v[:6], cu_q, 0.5, cu_seqlens_kv=torch.tensor([0, 1, 6], dtype=torch.int32))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("expand_kv", [True, False])
def test_gqa_sdpa_equals_per_head_reference(expand_kv, causal):
    """The training modes' GQA attention (K/V expanded, the CUDA default, or ``enable_gqa``), masked or causal:
    outputs and gradients equal a per-head softmax reference where query head ``h`` reads K/V group
    ``h // (np / ng)``."""
    from megatron_jf.models.attention import gqa_sdpa

    g = torch.Generator().manual_seed(7)
    b, nh, ng, sq, sk, hd = 2, 6, 2, 5, 5 if causal else 9, 8
    q = torch.randn(b, nh, sq, hd, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, ng, sk, hd, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, ng, sk, hd, generator=g, dtype=torch.float64, requires_grad=True)
    allow = torch.rand(b, 1, sq, sk, generator=g) < 0.6
    allow[..., 0] = True  # every query sees at least one key
    if causal:
        allow = torch.ones(sq, sk, dtype=torch.bool).tril_()[None, None].expand(b, 1, sq, sk)
    out = gqa_sdpa(q, k, v, None if causal else allow, 0.3, expand_kv=expand_kv)
    ref = torch.stack([torch.softmax((q[:, h] @ k[:, h // (nh // ng)].transpose(-1, -2) * 0.3)
                                     .masked_fill(~allow[:, 0], float("-inf")), -1) @ v[:, h // (nh // ng)]
                       for h in range(nh)], 1)
    assert out.shape == (b, nh, sq, hd)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    w = torch.randn(out.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for a, r in zip(grads, ref_grads):
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-10)


def _te_cuda():
    from megatron_jf import platform

    return platform.HAVE_TE and platform.HAVE_CUDA


@pytest.mark.skipif(not _te_cuda(), reason="needs Transformer Engine and CUDA")
def test_te_packed_attention_equals_sdpa(mp1):
    """TE's fused padding_causal THD attention (bf16) matches the per-segment SDPA reference; TE's
    arbitrary-mask attention (opt-in) matches SDPA with the same boolean mask."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_jf.models.attention import JFCoreAttention, packed_causal_sdpa
    from megatron_jf.models.gpt import build_model
    from megatron_jf.models.hf_config import ModelArgs
    from megatron_jf.models.zoo import tiny_hf_config

    args = ModelArgs.from_hf_dict(tiny_hf_config("qwen2").to_dict())
    model = build_model(args, params_dtype=torch.bfloat16)
    core = next(m for m in model.modules() if isinstance(m, JFCoreAttention))
    g = torch.Generator(device="cuda").manual_seed(0)
    nh, ng, hd = args.num_heads, args.num_kv_heads, args.head_dim
    cu = torch.tensor([0, 37, 80, 128], dtype=torch.int32, device="cuda")
    q = torch.randn(128, nh, hd, generator=g, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(128, ng, hd, generator=g, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(128, ng, hd, generator=g, device="cuda", dtype=torch.bfloat16)
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=48, max_seqlen_kv=48)
    te_out = core(q, k, v, None, packed_seq_params=psp).reshape(128, -1).float()
    ref = packed_causal_sdpa(q.float(), k.float(), v.float(), cu, core.softmax_scale)
    assert core.__dict__.get("_te") is not None  # TE really ran
    assert (te_out - ref).abs().max().item() <= 2e-2
    mask = torch.rand(2, 1, 64, 64, generator=g, device="cuda") > 0.5
    mask[..., torch.arange(64), torch.arange(64)] = False  # every query sees itself
    qs, ks, vs = (x[:128].reshape(64, 2, *x.shape[1:]) for x in (q, k, v))
    core.te_arbitrary_mask = True
    te_m = core(qs, ks, vs, mask).float()
    core.use_te = False
    sd_m = core(qs.float(), ks.float(), vs.float(), mask)
    assert (te_m - sd_m).abs().max().item() <= 2e-2


def test_trainer_packed_path_matches_two_stream(mp1, tmp_path):
    """``--attention-path packed`` through the trainer (pretrain_jf's forward step and collate): the
    losses and gradient norms of 3 optimizer steps equal ``two_stream``'s (``--mask nc``) and ``dense``'s
    (``--mask nc_ic``); bad combinations error."""
    from functools import partial

    import pretrain_jf
    from megatron_jf.models.zoo import save_tiny_hf
    from megatron_jf.training.trainer import Trainer
    from megatron_jf.training.config import TrainConfig
    from train_fixtures import hf_weights_provider, write_shards

    d = str(tmp_path)
    save_tiny_hf(os.path.join(d, "hf"), "qwen2", seed=5, vocab=255, layers=2, tied=True, max_pos=128)
    recs = [make_record(100 + i, prompt_len=4 + i % 3, block_size=4, num_blocks=3, vocab=255,
                        last_block_len=3 if i % 4 == 1 else None) for i in range(4)]
    write_shards(os.path.join(d, "train"), recs, per_shard=2)
    hist = {}
    for path, mask in (("two_stream", "nc"), ("packed", "nc"), ("dense", "nc_ic"), ("packed", "nc_ic")):
        cfg = TrainConfig.from_flat(hf_config=os.path.join(d, "hf"), data=[os.path.join(d, "train")], block_size=4,
                          window_size=2, train_steps=3, micro_batch_size=2, global_batch_size=2, lr=2e-3,
                          warmup_steps=0, clip_grad=0.05, log_interval=100, progress=False, threads=1, seed=7,
                          attention_path=path, mask=mask)
        tr = Trainer(cfg, hf_weights_provider(os.path.join(d, "hf")), partial(pretrain_jf.forward_step, cfg=cfg),
                     pretrain_jf.train_valid_datasets_provider)
        hist[path, mask] = tr.train()
    for ref, mask in (("two_stream", "nc"), ("dense", "nc_ic")):
        for a, b in zip(hist[ref, mask], hist["packed", mask]):
            assert abs(a["loss"] - b["loss"]) <= 1e-5 * max(1.0, abs(a["loss"])), mask
            assert abs(a["grad norm"] - b["grad norm"]) <= 1e-4 * a["grad norm"], mask
        assert hist["packed", mask][0]["loss"] != hist["packed", mask][-1]["loss"]  # the optimizer moved
    assert hist["packed", "nc"][0]["loss"] != hist["packed", "nc_ic"][0]["loss"]  # the masks differ
    base = dict(hf_config=os.path.join(d, "hf"), data=[os.path.join(d, "train")], block_size=4,
                attention_path="packed", train_steps=1)
    with pytest.raises(ValueError, match="needs --pp 1"):
        TrainConfig.from_flat(**base, pp=2).validate()


def test_packed_path_parallel_layouts_match_single_process_two_stream(mp1, tmp_path):
    """The packed THD row at TP=2, TP=2 + sequence parallelism (the row's tokens split over the ranks) and
    DP=2 (torchrun, gloo) gives the single-process two-stream losses and gradient norms at every step;
    ``nc_ic`` at TP=2 + sequence parallelism gives the single-process dense-mask run's."""
    import json
    from functools import partial

    import numpy as np

    import pretrain_jf
    from megatron_jf.models.zoo import save_tiny_hf
    from megatron_jf.training.trainer import Trainer
    from train_fixtures import hf_weights_provider, parallel_config, write_shards

    d = str(tmp_path)
    save_tiny_hf(os.path.join(d, "hf"), "qwen2", seed=5, vocab=255, layers=2, tied=True, max_pos=128)
    recs = [make_record(100 + i, prompt_len=4 + i % 3, block_size=4, num_blocks=3, vocab=255,
                        last_block_len=3 if i % 4 == 1 else None) for i in range(8)]
    write_shards(os.path.join(d, "train"), recs, per_shard=3)
    ref = {}
    for name in ("two_stream_kl", "dense_ncic_ref"):
        cfg = parallel_config(d, name)
        hist = Trainer(cfg, hf_weights_provider(os.path.join(d, "hf")), partial(pretrain_jf.forward_step, cfg=cfg),
                       pretrain_jf.train_valid_datasets_provider).train()
        ref[name] = [h["loss"] for h in hist], [h["grad norm"] for h in hist]
    out = run_torchrun("packed_tp.py", d, timeout=400)
    results = [json.loads(line[len("RESULT "):]) for line in out.splitlines() if line.startswith("RESULT ")]
    assert [r["layout"] for r in results] == ["tp2", "tp2_sp", "dp2", "tp2_sp_ncic"]
    for r in results:
        loss, gn = ref["dense_ncic_ref" if r["layout"].endswith("ncic") else "two_stream_kl"]
        np.testing.assert_allclose(r["loss"], loss, rtol=2e-5, atol=1e-6, err_msg=r["layout"])
        np.testing.assert_allclose(r["grad_norm"], gn, rtol=2e-4, err_msg=r["layout"])


def test_te_switches_come_from_one_place(mp1, monkeypatch):
    """The TE code-path switches: environment overrides read by ``platform.TESwitches`` only; the core attention's
    ``te_arbitrary_mask`` argument wins over the environment."""
    from megatron_jf import platform
    from megatron_jf.models.attention import JFCoreAttention
    from megatron_jf.models.gpt import build_model
    from megatron_jf.models.hf_config import ModelArgs
    from megatron_jf.models.zoo import tiny_hf_config

    assert platform.TESwitches.from_env({}) == platform.TESwitches(False, False)
    assert platform.TESwitches.from_env({"MEGATRON_JF_DISABLE_TE": "1", "MEGATRON_JF_TE_ARBITRARY_MASK": "0"}) == \
        platform.TESwitches(disable=True, arbitrary_mask=False)
    monkeypatch.setenv("MEGATRON_JF_TE_ARBITRARY_MASK", "1")
    core = next(m for m in build_model(ModelArgs.from_hf_dict(tiny_hf_config("qwen2").to_dict())).modules()
                if isinstance(m, JFCoreAttention))
    assert core.te_arbitrary_mask is True
    again = JFCoreAttention(core.config, 1, None, None, te_arbitrary_mask=False)
    assert again.te_arbitrary_mask is False
