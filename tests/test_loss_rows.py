"""The loss-row output layer and the chunked loss (issue 12, "bounded loss memory").

* The fused, chunked output layer + loss (:func:`megatron_jf.training.losses.fused_head_loss`) on the
  loss rows gives the same loss, report and gradients (w.r.t. every model parameter) as today's path --
  the output layer over every row, then :func:`~megatron_jf.training.losses.jf_loss` -- on a real tiny
  model, for both attention paths, every consistency loss kind, several chunk sizes, tied and untied
  output weights and with anchor rows; vocabulary padding columns hold large values in the reference.
* Its peak temporary memory does not grow with the number of rows at a fixed chunk size (torch
  profiler), and stays under :func:`~megatron_jf.training.losses.loss_temporary_bytes`.
TP=2 (with and without sequence parallelism) equals TP=1 in ``tests/dist/loss_rows_tp.py``
(``test_tp2_sequence_parallel_parity_torchrun``).
"""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "dist"))
from train_fixtures import make_record, tiny_mcore_model  # noqa: E402

from tests.conftest import run_torchrun  # noqa: E402


def _packed(n=3, seed=20):
    from megatron_jf.data.packing import pack_record

    recs = [make_record(seed + i, prompt_len=5 + 2 * i, block_size=4, num_blocks=3,
                        last_block_len=2 if i == 1 else None) for i in range(n)]
    return [pack_record(r, "progressive", 3) for r in recs]


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def old_step(model, batch, cfg, vocab):
    """Today's path: the output layer over every row, gather, jf_loss (+ anchor as pretrain_jf)."""
    from megatron_jf.training.attention_paths import forward_model, gather_anchor_logits, gather_jf_logits
    from megatron_jf.training.losses import anchor_term, jf_loss

    model.zero_grad(set_to_none=True)
    out = forward_model(model, batch)
    loss, report = jf_loss(gather_jf_logits(out, batch, vocab), cfg)
    if batch.has_anchor:
        add, metric = anchor_term(gather_anchor_logits(out, batch), batch.anchor_targets, batch.num_samples,
                                  weight=cfg.anchor_weight, vocab_size=vocab)
        loss = loss + add
        report["loss"] = report["loss"] + torch.stack([add.detach().double(), torch.zeros((), dtype=torch.float64)])
        report["anchor loss"] = metric
    loss.backward()
    return loss.detach(), report, _grads(model)


def new_step(model, batch, cfg, vocab, chunk):
    from megatron_jf.training.output_head import forward_loss_rows, head_loss, output_weight

    model.zero_grad(set_to_none=True)
    rows = forward_loss_rows(model, batch, with_teacher=cfg.consistency_loss != "hard")
    loss, report = head_loss(rows, output_weight(model), batch, cfg, vocab, chunk_size=chunk)
    loss.backward()
    return loss.detach(), report, _grads(model), rows.shape[0]


def assert_same(old, new, rtol=2e-5):
    (l0, r0, g0), (l1, r1, g1) = old, new[:3]
    assert abs(l0.item() - l1.item()) <= rtol * max(1.0, abs(l0.item())), (l0, l1)
    assert set(r0) == set(r1)
    for k in r0:
        assert torch.allclose(r0[k], r1[k], rtol=1e-5, atol=1e-6), (k, r0[k], r1[k])
    assert set(g0) == set(g1)
    for n in g0:
        scale = g0[n].abs().max().item()
        assert scale > 0, n  # every parameter receives a gradient (the comparison is not vacuous)
        assert (g0[n] - g1[n]).abs().max().item() <= 1e-5 * max(scale, 1e-3), n


@pytest.fixture(scope="module")
def models(mp1):
    untied, args = tiny_mcore_model(seed=5)
    tied, targs = tiny_mcore_model(seed=6, tied=True)
    return {"untied": (untied, args), "tied": (tied, targs)}


@pytest.mark.parametrize("path,kind,norm,chunk", [
    ("two_stream", "kl", "paper", 7),
    ("two_stream", "kl", "paper", None),
    ("two_stream", "soft_ce", "reference", 5),
    ("two_stream", "hard", "paper", 3),
    ("dense", "kl", "paper", 4),
    ("dense", "soft_ce", "reference", 1000),
    ("packed", "kl", "paper", 6),
])
def test_loss_rows_equal_full_rows(models, path, kind, norm, chunk):
    from megatron_jf.training.attention_paths import build_jf_batch
    from megatron_jf.training.config import JFObjective

    model, args = models["untied"]
    cfg = JFObjective(consistency_loss=kind, kl_temperature=1.5 if kind == "soft_ce" else 1.0, pc_normalization=norm,
                     ar_weight=0.7)
    batch = build_jf_batch(_packed(), path=path, mask="nc_ic" if path == "dense" else "nc", window_size=2)
    old = old_step(model, batch, cfg, args.vocab_size)
    new = new_step(model, batch, cfg, args.vocab_size, chunk)
    assert_same(old, new)
    C, M = len(batch.pc_targets), len(batch.ar_targets)
    assert new[3] == (C if kind == "hard" else 2 * C) + M
    # the loss rows are fewer than the model's rows: the prompt rows and padding carry no loss
    assert new[3] < batch.tokens.numel()


def test_loss_rows_tied_weights_with_anchor_rows(models):
    """Tied output weight (gradient from the embedding and the output layer) and anchor CE rows."""
    from megatron_jf.data.text import TextBatch
    from megatron_jf.training.attention_paths import append_anchor_rows, build_jf_batch
    from megatron_jf.training.config import JFObjective

    model, args = models["tied"]
    g = torch.Generator().manual_seed(4)
    tok = torch.randint(0, args.vocab_size - 1, (2, 9), generator=g)
    lab = torch.randint(0, args.vocab_size - 1, (2, 9), generator=g)
    lab[1, :3] = -100
    text = TextBatch(tokens=tok, labels=lab, position_ids=torch.arange(9).expand(2, 9).clone())
    cfg = JFObjective(anchor_weight=0.4)
    batch = append_anchor_rows(build_jf_batch(_packed(2), path="two_stream", mask="nc"), text)
    assert_same(old_step(model, batch, cfg, args.vocab_size), new_step(model, batch, cfg, args.vocab_size, 6))


@pytest.mark.parametrize("kind", ["kl", "soft_ce", "hard"])
def test_fused_head_loss_excludes_vocab_padding(mp1, kind):
    """Output-weight rows beyond ``vocab_size`` (TP padding) with huge logits change nothing: values and
    gradients equal the per-row divergence / CE of the logits over the real vocabulary."""
    from megatron_jf.training.losses import fused_head_loss, vocab_parallel_ce, vocab_parallel_divergence

    g = torch.Generator().manual_seed(2)
    V, pad, H, C, M = 37, 3, 8, 6, 5
    w = torch.randn(V + pad, H, generator=g)
    w[V:] = 40.0
    rows = (C if kind == "hard" else 2 * C) + M
    h = torch.randn(rows, H, generator=g)
    pc_t, ce_t = torch.randint(0, V, (C,), generator=g), torch.randint(0, V, (M,), generator=g)
    pc_c, ce_c = torch.rand(C, generator=g), torch.rand(M, generator=g)
    h1, w1 = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    loss, pcv, cev, correct = fused_head_loss(h1, w1, num_pairs=C, pc_coef=pc_c, ce_coef=ce_c, pc_targets=pc_t,
                                              ce_targets=ce_t, kind=kind, temperature=1.3, vocab_size=V, chunk_size=4)
    (2.0 * loss).backward()
    h2, w2 = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    z = h2 @ w2.t()
    if kind == "hard":
        ref_pc = vocab_parallel_ce(z[:C], pc_t, vocab_size=V)
    else:
        ref_pc = vocab_parallel_divergence(z[:C], z[C:2 * C], vocab_size=V, temperature=1.3, kind=kind)
    ref_ce = vocab_parallel_ce(z[rows - M:], ce_t, vocab_size=V)
    ref = (ref_pc * pc_c).sum() + (ref_ce * ce_c).sum()
    (2.0 * ref).backward()
    assert abs(loss.item() - ref.item()) <= 1e-5 * abs(ref.item())
    assert torch.allclose(pcv, ref_pc.detach(), atol=1e-5) and torch.allclose(cev, ref_ce.detach(), atol=1e-5)
    assert torch.equal(correct, z[:C, :V].argmax(-1) == pc_t)
    assert torch.allclose(h1.grad, h2.grad, atol=1e-5) and torch.allclose(w1.grad, w2.grad, atol=1e-5)
    assert w1.grad[V:].abs().max() == 0


def test_fused_head_loss_rejects_bad_shapes(mp1):
    from megatron_jf.training.losses import fused_head_loss

    h, w = torch.randn(5, 4), torch.randn(10, 4)
    kw = dict(num_pairs=2, pc_coef=torch.ones(2), ce_coef=torch.ones(1), pc_targets=torch.zeros(2, dtype=torch.long),
              ce_targets=torch.zeros(1, dtype=torch.long))
    fused_head_loss(h, w, **kw)  # 2C + M = 5 rows: fine
    with pytest.raises(ValueError, match=r"must be \[3, h\]"):
        fused_head_loss(h, w, **{**kw, "kind": "hard"})
    with pytest.raises(ValueError, match="chunk size"):
        fused_head_loss(h, w, **kw, chunk_size=-1)
    with pytest.raises(ValueError, match="unknown consistency loss"):
        fused_head_loss(h, w, **{**kw, "kind": "mse"})


def _peak_temp_bytes(fn):
    from megatron_jf.training.memstats import peak_bytes

    return peak_bytes(fn, device="cpu")[0]


def test_chunked_loss_memory_is_bounded_by_the_chunk(mp1):
    """At a fixed chunk, 8x more rows leave the peak temporary memory of the loss (forward + backward)
    nearly unchanged, while one chunk of all rows grows with them; the peak stays under the documented
    ``loss_temporary_bytes``."""
    from megatron_jf.training.losses import fused_head_loss, loss_temporary_bytes

    V, H, chunk = 4096, 32, 64
    w = torch.randn(V, H, requires_grad=True)

    def run(C, M, ch):
        g = torch.Generator().manual_seed(0)
        hid = torch.randn(2 * C + M, H, generator=g, requires_grad=True)
        kw = dict(num_pairs=C, pc_coef=torch.full((C,), 1.0 / C), ce_coef=torch.full((M,), 1.0 / M),
                  pc_targets=torch.randint(0, V, (C,), generator=g), ce_targets=torch.randint(0, V, (M,), generator=g))

        def step():
            loss = fused_head_loss(hid, w, chunk_size=ch, **kw)[0]
            loss.backward()
        return _peak_temp_bytes(step), 2 * C + M

    small, _ = run(64, 64, chunk)
    big, rows = run(512, 512, chunk)
    whole, _ = run(512, 512, None)
    one_chunk = chunk * V * 4
    assert big - small < 0.25 * one_chunk * 8, (small, big)  # the 8x rows add far less than 8 chunks' worth
    assert whole > 4 * big, (whole, big)  # without chunking the peak grows with the rows
    assert big <= loss_temporary_bytes(rows, V, chunk, hidden=H), (big, loss_temporary_bytes(rows, V, chunk, hidden=H))
    assert big >= 2 * one_chunk  # the bound is not vacuous: a chunk holds several [chunk, V] buffers


@pytest.mark.timeout(600)
def test_tp2_sequence_parallel_parity_torchrun(tmp_path):
    """TP=2 without and with --sequence-parallel, all three attention paths: loss and every gradient equal the
    TP=1 full-row reference; 3 trainer steps with --sequence-parallel equal those without (losses and
    gradient norms, clipping active). See tests/dist/loss_rows_tp.py. Without the TP sum of the norm
    gradients the sequence-parallel gradients are off by ~80% and the trainer losses by ~1e-4."""
    out = run_torchrun("loss_rows_tp.py", str(tmp_path), timeout=500)
    lines = [ln for ln in out.splitlines() if ln.startswith("PARITY")]
    assert len(lines) == 9, out
    for ln in lines:
        _, case, loss_diff, grad_diff = ln.split()
        assert float(loss_diff) <= 1e-5 and float(grad_diff) <= 1e-5, ln
    train = [ln.split() for ln in out.splitlines() if ln.startswith("TRAIN")]
    assert len(train) == 2, out
    for _, name, loss_diff, norm_diff, steps in train:
        assert steps == "steps=3" and float(loss_diff) <= 1e-6 and float(norm_diff) <= 1e-6, (name, loss_diff, norm_diff)


def test_trainer_flags_parse_and_reject_bad_values(tmp_path):
    """--loss-chunk-size and --sequence-parallel reach the config; bad values are named errors."""
    from megatron_jf.training.config import parse_config

    base = ["--hf-config", str(tmp_path), "--data", str(tmp_path), "--train-steps", "1", "--block-size", "4"]
    cfg = parse_config(base + ["--tp", "2", "--sequence-parallel", "--loss-chunk-size", "256"])
    assert cfg.parallel.sequence_parallel and cfg.jf.loss_chunk_size == 256
    assert parse_config(base).jf.loss_chunk_size == 1024 and not parse_config(base).parallel.sequence_parallel
    with pytest.raises(ValueError, match="--sequence-parallel needs --tp > 1"):
        parse_config(base + ["--sequence-parallel"])
    with pytest.raises(ValueError, match="--loss-chunk-size must be >= 0"):
        parse_config(base + ["--loss-chunk-size", "-1"])


def test_trainer_evaluate_equals_full_row_reference(tmp_path, mp1):
    """Validation runs the loss-row path under no_grad: its loss and accuracy equal today's full-row loss
    over the same validation microbatches."""
    from functools import partial

    from train_fixtures import hf_weights_provider, write_shards

    import pretrain_jf
    from megatron_jf.models.gpt import unwrap
    from megatron_jf.models.zoo import save_tiny_hf
    from megatron_jf.training.attention_paths import jf_forward
    from megatron_jf.training.config import TrainConfig
    from megatron_jf.training.losses import jf_loss
    from megatron_jf.training.streams import eval_batches
    from megatron_jf.training.trainer import Trainer

    d = str(tmp_path)
    save_tiny_hf(os.path.join(d, "hf"), "qwen2", seed=5, vocab=255, layers=2, max_pos=128)
    recs = [make_record(300 + i, prompt_len=4 + i % 3, block_size=4, num_blocks=3, vocab=255) for i in range(6)]
    write_shards(os.path.join(d, "train"), recs[:4], per_shard=2)
    write_shards(os.path.join(d, "valid"), recs[4:], per_shard=2)
    cfg = TrainConfig.from_flat(hf_config=os.path.join(d, "hf"), data=[os.path.join(d, "train")],
                      valid_data=[os.path.join(d, "valid")], block_size=4, window_size=2, train_steps=1,
                      micro_batch_size=1, lr=1e-3, warmup_steps=0, progress=False, threads=1, loss_chunk_size=3)
    tr = Trainer(cfg, hf_weights_provider(os.path.join(d, "hf")), partial(pretrain_jf.forward_step, cfg=cfg),
                 pretrain_jf.train_valid_datasets_provider)
    got = tr.evaluate()
    model = unwrap(tr.model)
    tot = cnt = correct = pairs = 0.0
    with torch.no_grad():
        for batch in eval_batches(tr.valid_spec, 1, 2):
            loss, rep = jf_loss(jf_forward(model, batch), cfg.jf)
            tot, cnt = tot + loss.item(), cnt + batch.num_samples
            correct, pairs = correct + rep["noisy acc"][0].item(), pairs + rep["noisy acc"][1].item()
    assert cnt == 2 and abs(got["loss"] - tot / cnt) <= 1e-5 * abs(tot / cnt), (got, tot / cnt)
    assert abs(got["noisy acc"] - correct / pairs) <= 1e-9
    assert all(p.grad is None for p in model.parameters())  # validation formed no gradients
