"""Jacobi Forcing losses (paper Eq. 8-9) and the attention paths that produce their logits.

* loss values and gradients equal a direct computation from the definition (plain torch softmax /
  log_softmax, loops over samples and blocks), with vocabulary-padding columns that would change the
  result if they were not excluded;
* the packed forward equals ordinary causal forwards: noisy positions = prompt + noisy blocks, clean
  positions = prompt + clean blocks (two-stream and dense paths); the dense ``nc_ic`` / ``clean``
  masks equal forwards over the context their definition gives each noisy block;
* perturbing a noisy block never changes a clean or prompt logit.
"""
import os
import sys

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "dist"))
from train_fixtures import make_record, tiny_mcore_model  # noqa: E402

TOL = 1e-5


# ----------------------------------------------------------------------------- loss definition
def reference_loss(s, t, pc_targets, pair_sample, pair_block, a, ar_targets, ar_sample, num_blocks, V, *, kind,
                   tau, norm, pc_w, ar_w):
    """The JF loss written directly from its definition (independent of the implementation)."""
    s, t, a = s[:, :V], t[:, :V], a[:, :V]
    if kind == "hard":
        d = F.cross_entropy(s, pc_targets, reduction="none")
    else:
        p = torch.softmax(t / tau, dim=-1)
        log_q = torch.log_softmax(s / tau, dim=-1)
        if kind == "kl":
            d = (p * (torch.log_softmax(t / tau, dim=-1) - log_q)).sum(-1) * tau**2
        else:
            d = -(p * log_q).sum(-1) * tau**2
    ce = F.cross_entropy(a, ar_targets, reduction="none")
    total, pcs, ars = 0.0, [], []
    for b in range(len(num_blocks)):
        N = int(num_blocks[b])
        if norm == "paper":
            pc = 0.0
            for j in range(N):
                sel = (pair_sample == b) & (pair_block == j)
                if sel.any():
                    pc = pc + d[sel].mean()
            pc = pc / N
        else:
            sel = pair_sample == b
            pc = d[sel].mean() / N if sel.any() else torch.zeros(())
        ar = ce[ar_sample == b].mean()
        pcs.append(float(pc))
        ars.append(float(ar))
        total = total + pc_w * pc + ar_w * ar
    return total, pcs, ars


def _hand_batch(seed=0, V=37, pad=3):
    """Random logits for 3 samples; padding columns hold large values (must be ignored)."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = torch.tensor([3, 1, 4])
    pair_sample = torch.tensor([0, 0, 0, 0, 0, 1, 1, 2, 2, 2, 2, 2, 2])
    pair_block = torch.tensor([0, 0, 1, 2, 2, 0, 0, 0, 1, 1, 1, 3, 3])  # block 2 of sample 2 has no pairs
    C = len(pair_sample)
    ar_sample = torch.tensor([0] * 6 + [1] * 3 + [2] * 8)
    M = len(ar_sample)
    W = V + pad

    def logits(n):
        x = 2.0 * torch.randn(n, W, generator=g)
        x[:, V:] = 50.0  # vocabulary padding: would dominate every softmax if not excluded
        return x

    return dict(student=logits(C), teacher=logits(C), ar=logits(M), pc_targets=torch.randint(0, V, (C,), generator=g),
                ar_targets=torch.randint(0, V, (M,), generator=g), pair_sample=pair_sample, pair_block=pair_block,
                ar_sample=ar_sample, num_blocks=num_blocks, V=V)


@pytest.mark.parametrize("kind,norm,tau,pc_w,ar_w", [
    ("kl", "paper", 1.0, 1.0, 1.0),
    ("kl", "reference", 2.0, 0.5, 10.0),
    ("soft_ce", "paper", 1.5, 1.0, 0.3),
    ("soft_ce", "reference", 1.0, 1.0, 10.0),
    ("hard", "paper", 1.0, 2.0, 1.0),
])
def test_loss_equals_definition(mp1, kind, norm, tau, pc_w, ar_w):
    from megatron_jf.training.config import JFObjective
    from megatron_jf.training.losses import JFLossInputs, jf_loss

    h = _hand_batch()
    V = h["V"]
    s = h["student"].clone().requires_grad_(True)
    a = h["ar"].clone().requires_grad_(True)
    t = h["teacher"].clone().requires_grad_(True)
    inp = JFLossInputs(student_logits=s, teacher_logits=t, pc_targets=h["pc_targets"], pair_sample=h["pair_sample"],
                       pair_block=h["pair_block"], ar_logits=a, ar_targets=h["ar_targets"], ar_sample=h["ar_sample"],
                       num_blocks=h["num_blocks"], vocab_size=V)
    cfg = JFObjective(consistency_loss=kind, kl_temperature=tau, pc_weight=pc_w, ar_weight=ar_w, pc_normalization=norm)
    loss, report = jf_loss(inp, cfg)
    loss.backward()

    s2 = h["student"].clone().requires_grad_(True)
    a2 = h["ar"].clone().requires_grad_(True)
    ref, pcs, ars = reference_loss(s2, h["teacher"], h["pc_targets"], h["pair_sample"], h["pair_block"], a2,
                                   h["ar_targets"], h["ar_sample"], h["num_blocks"], V, kind=kind, tau=tau, norm=norm,
                                   pc_w=pc_w, ar_w=ar_w)
    ref.backward()
    assert abs(loss.item() - ref.item()) <= TOL * max(1.0, abs(ref.item()))
    assert report["loss"][1] == 3 and abs(report["loss"][0].item() - ref.item()) <= 1e-4
    assert abs(report["pc loss"][0].item() - sum(pcs)) <= 1e-4
    assert abs(report["ar loss"][0].item() - sum(ars)) <= 1e-4
    # gradients: student and AR logits as the definition says; zero on padding; teacher stop-gradient
    assert (s.grad - s2.grad).abs().max() <= 1e-6
    assert (a.grad - a2.grad).abs().max() <= 1e-6
    assert s.grad[:, V:].abs().max() == 0 and a.grad[:, V:].abs().max() == 0
    assert t.grad is None or t.grad.abs().max() == 0
    # accuracy: argmax over the real vocabulary vs the fixed-point tokens
    correct = (h["student"][:, :V].argmax(-1) == h["pc_targets"]).sum().item()
    assert report["noisy acc"].tolist() == [correct, len(h["pc_targets"])]


def test_kl_is_zero_iff_distributions_match(mp1):
    from megatron_jf.training.losses import vocab_parallel_divergence

    x = torch.randn(4, 10)
    assert vocab_parallel_divergence(x, x.clone()).abs().max() <= 1e-6
    assert (vocab_parallel_divergence(x, x + torch.randn(4, 10)) > 1e-3).all()
    # soft_ce = KL + teacher entropy
    t = torch.randn(4, 10)
    ent = -(torch.softmax(t, -1) * torch.log_softmax(t, -1)).sum(-1)
    diff = vocab_parallel_divergence(x, t, kind="soft_ce") - vocab_parallel_divergence(x, t, kind="kl")
    assert (diff - ent).abs().max() <= 1e-5


def test_jf_objective_rejects_bad_loss_values():
    from megatron_jf.training.config import JFObjective

    for kw in ({"consistency_loss": "mse"}, {"pc_normalization": "x"}, {"kl_temperature": 0.0}, {"ar_weight": -1.0}):
        with pytest.raises(ValueError):
            JFObjective(**kw)


# ----------------------------------------------------------------------------- attention paths
@pytest.fixture(scope="module")
def tiny(mp1):
    model, args = tiny_mcore_model(seed=3)
    return model.eval(), args


def _records():
    # different prompt lengths, a short last block -> right padding inside the batch
    return [make_record(11, prompt_len=5, block_size=4, num_blocks=3),
            make_record(12, prompt_len=7, block_size=4, num_blocks=3, last_block_len=2)]


def _pack(records):
    from megatron_jf.data.packing import pack_record

    return [pack_record(r, "progressive", 3) for r in records]


def _causal(model, ids):
    with torch.no_grad():
        return model(ids[None], torch.arange(ids.shape[0])[None], None, runtime_gather_output=False)[0]


def _noisy_blocks(rec, packed):
    return [b.drafts[int(k)] for b, k in zip(rec.blocks, packed.state_indices)]


def _run(model, packed, path, mask, w=2):
    from megatron_jf.training.attention_paths import build_jf_batch, forward_model

    batch = build_jf_batch(packed, path=path, mask=mask, window_size=w)
    with torch.no_grad():
        return batch, forward_model(model, batch)


def test_packed_logits_equal_causal_streams(tiny):
    """Noisy positions == causal(prompt + noisy blocks); clean == causal(prompt + clean blocks)."""
    from megatron_jf.data.packing import ROLE_CLEAN, ROLE_NOISY

    model, _ = tiny
    recs = _records()
    packed = _pack(recs)
    _, two = _run(model, packed, "two_stream", "nc")
    _, dense = _run(model, packed, "dense", "nc")
    B = len(recs)
    for b, (rec, pk) in enumerate(zip(recs, packed)):
        P, T = rec.prompt_len, rec.prompt_len + rec.response_len
        noisy_ref = _causal(model, torch.cat([rec.prompt_ids, *_noisy_blocks(rec, pk)]))
        clean_ref = _causal(model, rec.full_ids())
        assert (two[b, :T] - noisy_ref).abs().max() <= TOL
        assert (two[B + b, :T] - clean_ref).abs().max() <= TOL
        noisy_idx = torch.nonzero(pk.roles == ROLE_NOISY).flatten()
        clean_idx = torch.nonzero(pk.roles == ROLE_CLEAN).flatten()
        assert (dense[b, noisy_idx] - noisy_ref[P:]).abs().max() <= TOL
        assert (dense[b, clean_idx] - clean_ref[P:]).abs().max() <= TOL
        assert (dense[b, :P] - clean_ref[:P]).abs().max() <= TOL
    # the noisy and clean streams really differ (the comparison above is not vacuous)
    assert (two[0, 6:12] - two[B, 6:12]).abs().max() > 1e-2


@pytest.mark.parametrize("path", ["two_stream", "dense"])
def test_model_loss_equals_definition_from_causal_streams(tiny, path):
    """End to end: the loss of a packed batch equals the definition evaluated on two independent causal
    forwards per sample (student = noisy stream at response token r, teacher = clean stream at r, both
    predicting response[r+1]; AR = clean stream from the last prompt token)."""
    from megatron_jf.training.attention_paths import build_jf_batch, jf_forward
    from megatron_jf.training.config import JFObjective
    from megatron_jf.training.losses import jf_loss

    model, args = tiny
    recs = _records()
    packed = _pack(recs)
    cfg = JFObjective(consistency_loss="kl", kl_temperature=1.0, pc_weight=1.0, ar_weight=0.7)
    with torch.no_grad():
        loss, report = jf_loss(jf_forward(model, build_jf_batch(packed, path=path, mask="nc")), cfg)
        S, T, A, pc_t, ar_t, ps, pb, as_ = [], [], [], [], [], [], [], []
        for b, (rec, pk) in enumerate(zip(recs, packed)):
            P, R = rec.prompt_len, rec.response_len
            noisy_ref = _causal(model, torch.cat([rec.prompt_ids, *_noisy_blocks(rec, pk)]))
            clean_ref = _causal(model, rec.full_ids())
            resp = rec.response_ids()
            blk = torch.cat([torch.full((blk.length,), j) for j, blk in enumerate(rec.blocks)])
            r = torch.arange(R - 1)  # the last response token has no target
            S.append(noisy_ref[P + r]); T.append(clean_ref[P + r]); pc_t.append(resp[r + 1])
            ps.append(torch.full((R - 1,), b)); pb.append(blk[r])
            A.append(clean_ref[P - 1 + torch.arange(R)]); ar_t.append(resp); as_.append(torch.full((R,), b))
        ref, _, _ = reference_loss(torch.cat(S), torch.cat(T), torch.cat(pc_t), torch.cat(ps), torch.cat(pb),
                                   torch.cat(A), torch.cat(ar_t), torch.cat(as_),
                                   torch.tensor([r.num_blocks for r in recs]), args.vocab_size, kind="kl", tau=1.0,
                                   norm="paper", pc_w=1.0, ar_w=0.7)
    assert abs(loss.item() - ref.item()) <= 1e-5 * max(1.0, abs(ref.item()))
    assert report["pc loss"][0].item() > 1e-4  # the consistency term is not trivially zero


@pytest.mark.parametrize("mask", ["nc_ic", "clean"])
def test_dense_masks_equal_their_definitions(tiny, mask):
    """``clean``: noisy block j sees prompt + clean blocks < j. ``nc_ic`` (window w): prompt, clean blocks
    before its window, noisy blocks of its window up to j."""
    from megatron_jf.data.packing import ROLE_CLEAN, ROLE_NOISY

    model, _ = tiny
    w = 2
    recs = _records()
    packed = _pack(recs)
    _, dense = _run(model, packed, "dense", mask, w)
    for b, (rec, pk) in enumerate(zip(recs, packed)):
        noisy = _noisy_blocks(rec, pk)
        fps = [blk.fixed_point for blk in rec.blocks]
        for j in range(rec.num_blocks):
            start = 0 if mask == "clean" else (j // w) * w
            if mask == "clean":
                ctx = [rec.prompt_ids, *fps[:j], noisy[j]]
            else:
                ctx = [rec.prompt_ids, *fps[:start], *noisy[start : j + 1]]
            ref = _causal(model, torch.cat(ctx))[-noisy[j].shape[0]:]
            idx = torch.nonzero((pk.roles == ROLE_NOISY) & (pk.block_ids == j)).flatten()
            assert (dense[b, idx] - ref).abs().max() <= TOL, (mask, b, j)
        clean_ref = _causal(model, rec.full_ids())
        clean_idx = torch.nonzero(pk.roles == ROLE_CLEAN).flatten()
        assert (dense[b, clean_idx] - clean_ref[rec.prompt_len:]).abs().max() <= TOL
    # nc_ic differs from nc in the second window (the context really changed)
    if mask == "nc_ic":
        _, nc = _run(model, packed, "dense", "nc")
        idx = torch.nonzero((packed[0].roles == ROLE_NOISY) & (packed[0].block_ids == 2)).flatten()
        assert (dense[0, idx] - nc[0, idx]).abs().max() > 1e-3


@pytest.mark.parametrize("path,mask", [("two_stream", "nc"), ("dense", "nc"), ("dense", "nc_ic"), ("dense", "clean")])
def test_noisy_perturbation_never_changes_clean_logits(tiny, path, mask):
    from megatron_jf.data.packing import ROLE_NOISY

    model, args = tiny
    packed = _pack(_records())
    batch, base = _run(model, packed, path, mask)
    pk = packed[0]
    sel = (pk.roles == ROLE_NOISY) & (pk.block_ids == 1)
    pk.tokens = pk.tokens.clone()
    pk.tokens[sel] = (pk.tokens[sel] + 17) % (args.vocab_size - 1)
    batch2, pert = _run(model, packed, path, mask)
    R, S, V = base.shape
    flat_b, flat_p = base.reshape(-1, V), pert.reshape(-1, V)
    # every teacher (clean) and AR position, over all samples, is unchanged
    for idx in (batch.teacher_index, batch.ar_index):
        assert (flat_b[idx] - flat_p[idx]).abs().max() <= 1e-6
    # ... while the perturbed block's own student logits did change (control)
    changed = (flat_b[batch.student_index] - flat_p[batch2.student_index]).abs().amax(-1)
    assert changed.max() > 1e-3


def test_batch_indices_address_the_paired_positions(tiny):
    """Student/teacher indices of the batch hit positions with the same position id and block, and the
    pc target equals the clean token that follows (the fixed point)."""
    from megatron_jf.training.attention_paths import build_jf_batch

    packed = _pack(_records())
    for path in ("two_stream", "dense"):
        b = build_jf_batch(packed, path=path, mask="nc")
        pos = b.position_ids.reshape(-1)
        assert torch.equal(pos[b.student_index], pos[b.teacher_index])
        assert len(b.student_index) == sum(len(p.consistency_pairs) for p in packed)
        assert len(b.ar_index) == sum(int((p.ar_targets != -100).sum()) for p in packed)
        tok = b.tokens.reshape(-1)
        # the AR target of a clean position is the next clean token of the same row
        nxt = b.ar_index[:-1] + 1
        same_row = (b.ar_index[:-1] // b.tokens.shape[1]) == (nxt // b.tokens.shape[1])
        if path == "two_stream":
            assert torch.equal(b.ar_targets[:-1][same_row], tok[nxt][same_row])


def test_bad_path_and_mask_combinations():
    from megatron_jf.training.attention_paths import build_jf_batch

    packed = _pack(_records())
    with pytest.raises(ValueError, match="two-stream path is exact only"):
        build_jf_batch(packed, path="two_stream", mask="nc_ic", window_size=2)
    with pytest.raises(NotImplementedError, match="flex"):
        build_jf_batch(packed, path="flex", mask="nc")
    with pytest.raises(ValueError, match="exceeds the model's context"):
        build_jf_batch(packed, path="two_stream", mask="nc", max_position=10)
    with pytest.raises(ValueError, match="exceeds the sequence length"):
        build_jf_batch(packed, path="dense", mask="nc", max_len=20)
    with pytest.raises(ValueError, match="vocabulary size"):
        build_jf_batch(packed, path="two_stream", mask="nc", vocab_size=5)
