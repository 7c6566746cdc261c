"""The anchor term (``--anchor-data``/``--anchor-weight``): real-text next-token rows appended to JF microbatches.

Checks: appending anchor rows leaves the JF logits at the student/teacher/AR positions unchanged (both
attention paths, anchor rows shorter and longer than the JF rows); the anchor loss equals plain
``F.cross_entropy`` over a separate forward of the text rows; the reported total is
``pc_weight L_pc + ar_weight L_AR + lambda L_anchor``; bad flag combinations error; a run SIGKILLed
mid-training and resumed reproduces the uninterrupted losses exactly (the anchor stream position is
checkpointed; the anchor data wraps around an epoch inside the run).
"""
import json
import os
import signal
import sys
from functools import partial

import numpy as np
import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist"))
from train_fixtures import hf_weights_provider, make_record, write_shards  # noqa: E402

VOCAB = 255


@pytest.fixture(scope="module")
def work(tmp_path_factory, mp1):
    from megatron_jf.models.zoo import save_tiny_hf

    d = str(tmp_path_factory.mktemp("jfanchor"))
    save_tiny_hf(os.path.join(d, "hf"), "qwen2", seed=5, vocab=VOCAB, layers=2, tied=True, max_pos=128)
    recs = [make_record(300 + i, prompt_len=4 + i % 3, block_size=4, num_blocks=3, vocab=VOCAB,
                        last_block_len=3 if i % 4 == 1 else None) for i in range(6)]
    write_shards(os.path.join(d, "train"), recs, per_shard=3)
    rng = np.random.default_rng(0)
    np.save(os.path.join(d, "text.npy"), rng.integers(0, VOCAB - 1, size=2000, dtype=np.int32))
    np.save(os.path.join(d, "small.npy"), rng.integers(0, VOCAB - 1, size=200, dtype=np.int32))  # 12 x 16
    return d


def _cfg(work, **over):
    from megatron_jf.training.config import TrainConfig

    kw = dict(hf_config=os.path.join(work, "hf"), data=[os.path.join(work, "train")], block_size=4, window_size=2,
              train_steps=2, micro_batch_size=2, global_batch_size=2, lr=2e-3, warmup_steps=0, log_interval=100,
              progress=False, threads=1, seed=7, anchor_data=[os.path.join(work, "text.npy")], anchor_weight=0.5,
              anchor_seq_length=16, pc_weight=0.7, ar_weight=2.0)
    kw.update(over)
    return TrainConfig.from_flat(**kw)


def _trainer(cfg, work):
    import pretrain_jf
    from megatron_jf.training.trainer import Trainer

    return Trainer(cfg, hf_weights_provider(os.path.join(work, "hf")), partial(pretrain_jf.forward_step, cfg=cfg),
                   pretrain_jf.train_valid_datasets_provider)


@pytest.mark.parametrize("path,mask", [("two_stream", "nc"), ("dense", "nc_ic")])
@pytest.mark.parametrize("anchor_len", [8, 48])  # shorter / longer than the JF rows (24 / 32)
def test_anchor_rows_leave_jf_logits_unchanged_and_loss_is_plain_ce(work, path, mask, anchor_len):
    import pretrain_jf
    from megatron_jf.training.attention_paths import (
        append_anchor_rows,
        forward_model,
        gather_anchor_logits,
        gather_jf_logits,
    )

    cfg = _cfg(work, attention_path=path, mask=mask, anchor_seq_length=anchor_len, anchor_micro_batch_size=3)
    tr = _trainer(cfg, work)
    jf = next(tr.train_stream)
    text = next(tr.anchor_stream)
    both = append_anchor_rows(jf, text, pad_id=0)
    R, S = jf.tokens.shape
    assert both.tokens.shape == (R + 3, max(S, anchor_len)) and both.num_anchor_rows == 3
    assert both.num_tokens == jf.num_tokens + 3 * anchor_len and both.anchor_targets.numel() == 3 * anchor_len
    vocab = tr.module.vocab_size_unpadded
    tr.model.eval()
    with torch.no_grad():
        out_jf = forward_model(tr.model, jf)
        out_both = forward_model(tr.model, both)
        out_text = tr.model(text.tokens, text.position_ids, None, runtime_gather_output=False)
    a, b = gather_jf_logits(out_jf, jf, vocab), gather_jf_logits(out_both, both, vocab)
    for name in ("student_logits", "teacher_logits", "ar_logits"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.shape == y.shape and x.shape[0] > 0
        torch.testing.assert_close(y, x, rtol=0, atol=1e-5, msg=name)
    for name in ("pc_targets", "ar_targets", "pair_sample", "pair_block", "ar_sample"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    # the anchor logits are the text rows' own logits, and the loss is plain next-token CE over them
    direct = F.cross_entropy(out_text[..., :vocab].reshape(-1, vocab).float(), text.labels.reshape(-1))
    torch.testing.assert_close(gather_anchor_logits(out_both, both), out_text.reshape(-1, out_text.shape[-1]),
                               rtol=0, atol=1e-5)
    loss_sum, count, rep = pretrain_jf.loss_func(both, cfg.jf, vocab, out_both)
    _, _, rep_jf = pretrain_jf.loss_func(jf, cfg.jf, vocab, out_jf)
    B = jf.num_samples
    assert int(count) == B and "anchor loss" not in rep_jf
    val = lambda r, k: float(r[k][0] / r[k][1])  # noqa: E731
    assert val(rep, "anchor loss") == pytest.approx(float(direct), rel=1e-5)
    for k in ("pc loss", "ar loss", "noisy acc"):
        assert val(rep, k) == pytest.approx(val(rep_jf, k), rel=1e-5, abs=1e-6), k
    total = 0.7 * val(rep, "pc loss") + 2.0 * val(rep, "ar loss") + 0.5 * val(rep, "anchor loss")
    assert val(rep, "loss") == pytest.approx(total, rel=1e-6)
    assert float(loss_sum) / B == pytest.approx(total, rel=1e-5)


def test_append_anchor_rows_fixed_row_length(work):
    """Pipeline parallelism: rows keep the fixed length; anchor rows longer than it are an error."""
    from megatron_jf.data.text import TextBatch
    from megatron_jf.training.attention_paths import append_anchor_rows

    cfg = _cfg(work)
    tr = _trainer(cfg, work)
    jf = next(tr.train_stream)
    S = jf.tokens.shape[1]
    t = torch.arange(2 * 8).view(2, 8)
    text = TextBatch(tokens=t, labels=t + 1, position_ids=torch.arange(8).expand(2, 8).contiguous())
    out = append_anchor_rows(jf, text, pad_id=0, pad_to=S)
    assert out.tokens.shape == (jf.tokens.shape[0] + 2, S)
    assert torch.equal(out.student_index, jf.student_index) and torch.equal(out.ar_index, jf.ar_index)
    with pytest.raises(ValueError, match="must fit"):
        append_anchor_rows(jf, text, pad_id=0, pad_to=4)
    with pytest.raises(ValueError, match="already carries"):
        append_anchor_rows(out, text, pad_id=0)


def test_training_with_anchor_reports_it(work, tmp_path):
    log = str(tmp_path / "log.jsonl")
    tr = _trainer(_cfg(work, log_interval=1, log_file=log, anchor_micro_batch_size=1), work)
    assert tr.rows_per_micro == 2 * 2 + 1
    hist = tr.train()
    assert all(np.isfinite(h["anchor loss"]) and h["anchor loss"] > 0 for h in hist)
    for h in hist:
        assert h["loss"] == pytest.approx(0.7 * h["pc loss"] + 2.0 * h["ar loss"] + 0.5 * h["anchor loss"], rel=1e-6)
    recs = [json.loads(line) for line in open(log)]
    assert [r["iteration"] for r in recs] == [1, 2] and all("anchor_loss" in r for r in recs)
    assert tr.anchor_stream.state_dict() == {"epoch": 0, "consumed": 2}
    # off: no anchor key anywhere
    hist = _trainer(_cfg(work, anchor_data=None, anchor_weight=0.0, train_steps=1), work).train()
    assert "anchor loss" not in hist[0]


@pytest.mark.parametrize("extra,exc,match", [
    (["--anchor-data", "x.npy"], ValueError, "--anchor-weight is 0"),
    (["--anchor-data", "x.npy", "--anchor-weight", "0"], ValueError, "--anchor-weight is 0"),
    (["--anchor-weight", "0.5"], ValueError, "needs --anchor-data"),
    (["--anchor-data", "x.npy", "--anchor-weight", "-1"], ValueError, "must be >= 0"),
    (["--anchor-data", "x.npy", "--anchor-weight", "1", "--anchor-seq-length", "0"], ValueError, "anchor-seq-length"),
    (["--anchor-data", "x.npy", "--anchor-weight", "1", "--anchor-micro-batch-size", "0"], ValueError,
     "anchor-micro-batch-size"),
    (["--anchor-data", "x.npy", "--anchor-weight", "1", "--objective", "ar", "--seq-length", "8"], ValueError,
     "needs --objective jf"),
])
def test_bad_anchor_flags(extra, exc, match):
    from megatron_jf.training.config import parse_config

    with pytest.raises(exc, match=match):
        parse_config(["--hf-config", "h", "--data", "d", "--block-size", "4", "--train-steps", "1", *extra])


def test_bad_anchor_data(work, tmp_path):
    with pytest.raises(ValueError, match="exceeds the model's context of 128"):
        _trainer(_cfg(work, anchor_seq_length=200), work)
    with pytest.raises(FileNotFoundError, match="token data not found"):
        _trainer(_cfg(work, anchor_data=[str(tmp_path / "missing.npy")]), work)
    np.save(tmp_path / "big.npy", np.arange(100, 400, dtype=np.int32))  # 2 samples, one >= 255
    tr = _trainer(_cfg(work, anchor_data=[str(tmp_path / "big.npy")], anchor_seq_length=100), work)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tr.train()


# ----------------------------------------------------------------------------- resume
def _args(work, save, log):
    return ["--hf-config", os.path.join(work, "hf"), "--data", os.path.join(work, "train"), "--block-size", "4",
            "--window-size", "2", "--micro-batch-size", "1", "--global-batch-size", "3", "--train-steps", "6",
            "--lr", "2e-3", "--warmup-steps", "1", "--clip-grad", "0.5", "--seed", "11", "--threads", "1",
            "--anchor-data", os.path.join(work, "small.npy"), "--anchor-weight", "0.5", "--anchor-seq-length", "16",
            "--anchor-micro-batch-size", "2",
            "--log-interval", "1", "--no-progress", "--save", save, "--save-interval", "2", "--log-file", log]


def test_resume_after_kill_with_anchor_matches_uninterrupted_run(work):
    """6 steps x 3 microbatches x 2 anchor rows over 12 anchor samples: the anchor stream wraps an epoch
    every 2 steps, so the checkpoint at step 4 holds a non-trivial (epoch, consumed) position."""
    import pretrain_jf
    from megatron_jf import checkpointing
    from megatron_jf.training.trainer import Trainer
    from megatron_jf.training.config import parse_config
    from test_training import _run_cli

    save = os.path.join(work, "ckpt")
    log1, log2 = os.path.join(work, "killed.jsonl"), os.path.join(work, "resumed.jsonl")
    rc, out, err = _run_cli(_args(work, save, log1), {"MEGATRON_JF_FAULT_KILL_AT_STEP": "5"})
    assert rc == -signal.SIGKILL, (rc, out[-2000:], err[-4000:])
    assert checkpointing.latest_iteration(save) == 4
    common = checkpointing.read_meta(save, 4)["common"]
    assert common["anchor_data"] == {"epoch": 1, "consumed": 12}  # 24 of 2 x 12 samples
    rc, out, err = _run_cli(_args(work, save, log2))
    assert rc == 0, (out[-2000:], err[-4000:])
    assert "resumed from" in out and "anchor loss" in out
    read = lambda p: {r["iteration"]: r for r in map(json.loads, open(p)) if r["split"] == "train"}  # noqa: E731
    killed, resumed = read(log1), read(log2)
    assert sorted(killed) == [1, 2, 3, 4, 5] and sorted(resumed) == [5, 6]

    args = _args(work, save, "x")
    cfg = parse_config(args[: args.index("--save")])
    hist = Trainer(cfg, pretrain_jf.model_provider, partial(pretrain_jf.forward_step, cfg=cfg),
                   pretrain_jf.train_valid_datasets_provider).train()
    for it, rec in [*killed.items(), *resumed.items()]:  # identical, not merely close
        h = hist[it - 1]
        assert rec["loss"] == h["loss"] and rec["anchor_loss"] == h["anchor loss"], it
        assert rec["pc_loss"] == h["pc loss"] and rec["ar_loss"] == h["ar loss"], it
    assert len({h["anchor loss"] for h in hist}) == 6  # every step really sees different anchor text
