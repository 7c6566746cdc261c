"""The training loop: parallel layouts agree, loss goes down, exact resume after a kill, bad input.

Heavy pieces run once: one torchrun launch (TP=2, PP=2 and DP=2 phases) and two ``pretrain_jf.py``
subprocesses (a run SIGKILLed mid-training, then its resumption). Everything else runs in-process on
a tiny random Qwen2 (4 layers, tied embeddings, vocabulary 255 so TP=2 pads the vocabulary).
"""
import json
import os
import signal
import subprocess
import sys
from functools import partial

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist"))
from conftest import REPO, run_torchrun  # noqa: E402
from train_fixtures import (  # noqa: E402
    PARALLEL_CONFIGS,
    hf_weights_provider,
    make_record,
    parallel_config,
    save_tiny_hf_config,
    write_shards,
)

VOCAB = 255
HF_KW = dict(vocab=VOCAB, layers=4, tied=True, max_pos=128)


@pytest.fixture(scope="module")
def work(tmp_path_factory, mp1):
    from megatron_jf.models.zoo import save_tiny_hf

    d = str(tmp_path_factory.mktemp("jftrain"))
    save_tiny_hf(os.path.join(d, "hf"), "qwen2", seed=5, **HF_KW)
    recs = [make_record(100 + i, prompt_len=4 + i % 3, block_size=4, num_blocks=3, vocab=VOCAB,
                        last_block_len=3 if i % 4 == 1 else None) for i in range(12)]
    write_shards(os.path.join(d, "train"), recs[:8], per_shard=3)
    write_shards(os.path.join(d, "valid"), recs[8:], per_shard=4)
    write_shards(os.path.join(d, "fixed"), recs[:2])
    return d


def _trainer(cfg, work):
    import pretrain_jf
    from megatron_jf.training.trainer import Trainer

    return Trainer(cfg, hf_weights_provider(os.path.join(work, "hf")), partial(pretrain_jf.forward_step, cfg=cfg),
                   pretrain_jf.train_valid_datasets_provider)


def _cli_trainer(argv):
    """A Trainer built exactly as ``pretrain_jf.py ARGV`` builds it (random init or --load)."""
    import pretrain_jf
    from megatron_jf.training.trainer import Trainer
    from megatron_jf.training.config import parse_config

    cfg = parse_config(argv)
    return Trainer(cfg, pretrain_jf.model_provider, partial(pretrain_jf.forward_step, cfg=cfg),
                   pretrain_jf.train_valid_datasets_provider)


# ----------------------------------------------------------------------------- parallel layouts
def test_tp_pp_dp_match_single_process(work):
    """Same weights, same data: TP=2 (vocab padded), PP=2 (tied embedding across stages) and DP=2 give the
    single-process losses and gradient norms at every step (clipping active, so the norm matters)."""
    ref = {}
    for name in PARALLEL_CONFIGS:
        hist = _trainer(parallel_config(work, name), work).train()
        ref[name] = ([h["loss"] for h in hist], [h["grad norm"] for h in hist])
        assert all(g > 0.05 for g in ref[name][1])  # the clip threshold is really exceeded
        assert ref[name][0][0] != ref[name][0][-1]  # the optimizer really moves the weights
    out = run_torchrun("train_parallel.py", work, timeout=400)
    results = [json.loads(line[len("RESULT "):]) for line in out.splitlines() if line.startswith("RESULT ")]
    assert {(r["layout"], r["config"]) for r in results} == {(lay, n) for lay in ("tp2", "pp2", "pp2_fixed", "dp2")
                                                             for n in PARALLEL_CONFIGS}
    for r in results:
        loss, gn = ref[r["config"]]
        np.testing.assert_allclose(r["loss"], loss, rtol=2e-5, atol=1e-6, err_msg=f"{r['layout']} {r['config']}")
        np.testing.assert_allclose(r["grad_norm"], gn, rtol=2e-4, err_msg=f"{r['layout']} {r['config']}")
        assert r["torch_ddp"] == (r["layout"] == "dp2")
        assert r["variable_seq_lengths"] == (r["layout"] == "pp2")


@pytest.mark.parametrize("variable", [True, False])
def test_pipeline_rows_keep_their_own_length(work, variable):
    """PP > 1 pads each microbatch to its own length (rounded to 8), not every row to --seq-length, unless
    --no-variable-seq-lengths."""
    import pretrain_jf
    from megatron_jf.models.hf_config import ModelArgs
    from megatron_jf.training.config import parse_config

    argv = ["--hf-config", os.path.join(work, "hf"), "--data", os.path.join(work, "train"), "--block-size", "4",
            "--train-steps", "1", "--pp", "2", "--seq-length", "64"]
    cfg = parse_config(argv + ([] if variable else ["--no-variable-seq-lengths"]))
    assert cfg.pad_rows_to_seq_length is not variable
    spec, _ = pretrain_jf.train_valid_datasets_provider(cfg, ModelArgs.from_hf_dir(os.path.join(work, "hf")))
    ds = spec.dataset
    ds.set_epoch(0)
    ds.set_start(0)
    lengths = {spec.collate([s]).tokens.shape[1] for s in ds}
    if variable:
        assert max(lengths) < 64 and all(n % 8 == 0 for n in lengths) and len(lengths) > 1, lengths
    else:
        assert lengths == {64}


def test_resample_noise_flag_reaches_the_training_dataset(work):
    """--resample-noise-per-epoch reaches the training dataset (issue 31: re-drawn noisy states); validation keeps
    one fixed draw (it compares runs); without the flag the training data packs the same state every epoch."""
    import pretrain_jf
    from megatron_jf.models.hf_config import ModelArgs
    from megatron_jf.training.config import parse_config

    argv = ["--hf-config", os.path.join(work, "hf"), "--data", os.path.join(work, "train"), "--valid-data",
            os.path.join(work, "train"), "--block-size", "4", "--train-steps", "1"]
    args = ModelArgs.from_hf_dir(os.path.join(work, "hf"))
    on, valid = pretrain_jf.train_valid_datasets_provider(parse_config(argv + ["--resample-noise-per-epoch"]), args)
    off, _ = pretrain_jf.train_valid_datasets_provider(parse_config(argv), args)
    assert on.dataset.resample_noise_per_epoch and not valid.dataset.resample_noise_per_epoch
    assert not off.dataset.resample_noise_per_epoch

    def targets(ds, epoch):
        ds.set_epoch(epoch)
        return sorted((s.sample_id, tuple(s.target_ratios.tolist())) for s in ds)

    assert targets(on.dataset, 0) == targets(off.dataset, 0)  # epoch 0: the schedule as written
    assert any(targets(on.dataset, e) != targets(off.dataset, e) for e in (1, 2, 3))
    assert all(targets(off.dataset, e) == targets(off.dataset, 0) for e in (1, 2, 3))


def test_group_by_length_flag_reaches_the_training_dataset(work):
    """--group-by-length reaches the training dataset (groups of 50 micro-batches, the micro-batch size its unit) and
    reorders its epoch (the same samples); validation keeps the plain order."""
    import pretrain_jf
    from megatron_jf.models.hf_config import ModelArgs
    from megatron_jf.training.config import parse_config

    argv = ["--hf-config", os.path.join(work, "hf"), "--data", os.path.join(work, "train"), "--valid-data",
            os.path.join(work, "train"), "--block-size", "4", "--train-steps", "1", "--micro-batch-size", "2"]
    args = ModelArgs.from_hf_dir(os.path.join(work, "hf"))
    on, valid = pretrain_jf.train_valid_datasets_provider(parse_config(argv + ["--group-by-length"]), args)
    off, _ = pretrain_jf.train_valid_datasets_provider(parse_config(argv), args)
    assert (on.dataset.length_group_size, on.dataset.micro_batch_size) == (100, 2)
    assert valid.dataset.length_group_size == 0 and off.dataset.length_group_size == 0
    a, b = on.dataset.rank_indices().tolist(), off.dataset.rank_indices().tolist()
    assert a != b and sorted(a) == sorted(b)


# ----------------------------------------------------------------------------- optimisation
def test_few_steps_on_a_fixed_batch_reduce_the_loss(work):
    cfg = parallel_config(work, "two_stream_kl", data=[os.path.join(work, "fixed")], micro_batch_size=2,
                          global_batch_size=2, train_steps=8, lr=3e-3, clip_grad=1.0)
    hist = _trainer(cfg, work).train()
    losses = [h["loss"] for h in hist]
    assert losses[-1] < 0.8 * losses[0], losses
    assert hist[-1]["ar loss"] < hist[0]["ar loss"]
    assert all(h["tokens"] > 0 for h in hist)
    # the consistency term alone (ar_weight 0) is also minimised by its own gradient
    cfg = parallel_config(work, "two_stream_kl", data=[os.path.join(work, "fixed")], micro_batch_size=2,
                          global_batch_size=2, train_steps=8, lr=3e-3, clip_grad=1.0, ar_weight=0.0)
    hist = _trainer(cfg, work).train()
    assert hist[-1]["pc loss"] < 0.8 * hist[0]["pc loss"], [h["pc loss"] for h in hist]
    assert hist[-1]["noisy acc"] >= hist[0]["noisy acc"]


def test_pretrain_frees_its_model_before_returning(work):
    """Nothing of the model outlives ``pretrain``: its reference cycles are collected (Python's collector is off
    here, so only ``pretrain``'s own collection can free them) and megatron-core's RotaryEmbedding forward cache
    (a class-level lru_cache holding the instance, and on GPU megatron DDP's hooks on it) is cleared. Before the
    fix each Qwen2.5-0.5B run left 8.4 GiB allocated on the H200 (``bench/gpu_check.sh``)."""
    import gc
    import weakref

    import pretrain_jf
    from megatron_jf.training.trainer import pretrain

    cfg = parallel_config(work, "two_stream_kl", data=[os.path.join(work, "fixed")], micro_batch_size=2,
                          global_batch_size=2, train_steps=2)
    built = []

    def provider(*args, **kwargs):
        model = hf_weights_provider(os.path.join(work, "hf"))(*args, **kwargs)
        # the model and each submodule (megatron-core's RotaryEmbedding sits in a class-level lru_cache)
        built.extend(weakref.ref(m) for m in model.modules())
        return model

    was_enabled = gc.isenabled()
    gc.disable()
    try:
        hist = pretrain(cfg, provider, partial(pretrain_jf.forward_step, cfg=cfg),
                        pretrain_jf.train_valid_datasets_provider)
        assert len(hist) == 2 and built
        alive = sorted({type(r()).__name__ for r in built if r() is not None})
        assert not alive, f"pretrain returned with modules of its model still alive: {alive}"
    finally:
        if was_enabled:
            gc.enable()


def test_lr_schedule_warmup_then_cosine():
    from megatron_jf.training.config import TrainConfig, lr_at

    cfg = TrainConfig.from_flat(data=["x"], block_size=4, train_steps=100, warmup_steps=10, lr=1e-3, min_lr=1e-4,
                                hf_config="x")
    assert lr_at(1, cfg) == pytest.approx(1e-4) and lr_at(10, cfg) == pytest.approx(1e-3)
    assert lr_at(55, cfg) == pytest.approx(1e-4 + 0.5 * 9e-4)  # halfway through the decay
    assert lr_at(100, cfg) == pytest.approx(1e-4)
    assert TrainConfig.from_flat(data=["x"], block_size=4, train_steps=100, hf_config="x").validate()
    assert lr_at(3, TrainConfig.from_flat(data=["x"], train_steps=100, lr=1.0)) == pytest.approx(1.0)  # 3 warmup (3%)


def test_ar_objective_trains_on_token_ids(work, tmp_path):
    """--objective ar on a .npy of int32 ids: a repeating pattern is learned quickly."""
    ids = np.tile(np.arange(3, 3 + 17, dtype=np.int32), 40)
    np.save(tmp_path / "tok.npy", ids)
    tr = _cli_trainer(["--objective", "ar", "--hf-config", os.path.join(work, "hf"), "--data",
                       str(tmp_path / "tok.npy"), "--seq-length", "32", "--micro-batch-size", "4",
                       "--train-steps", "12", "--lr", "3e-3", "--warmup-steps", "0", "--threads", "1",
                       "--no-progress", "--log-interval", "100"])
    hist = tr.train()
    assert hist[-1]["loss"] < 0.7 * hist[0]["loss"]
    assert hist[0]["tokens"] == 4 * 32


# ----------------------------------------------------------------------------- checkpoint / resume
FAULT_INJECTION = os.path.join(REPO, "tests", "fault_injection.py")  # honours MEGATRON_JF_FAULT_KILL_AT_STEP


def _run_cli(args, env_extra=None, timeout=300):
    """Run ``pretrain_jf.py`` in its own session (through the test-only :mod:`tests.fault_injection` wrapper);
    output goes to files, not pipes (dist_checkpointing's spawned manager inherits the descriptors and would keep a
    pipe open after a kill)."""
    import tempfile

    env = {k: v for k, v in os.environ.items()  # not this process's rendezvous (it holds that port)
           if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=REPO, **(env_extra or {}))
    with tempfile.TemporaryFile("w+") as fo, tempfile.TemporaryFile("w+") as fe:
        proc = subprocess.Popen([sys.executable, FAULT_INJECTION, os.path.join(REPO, "pretrain_jf.py"), *args], env=env,
                                stdout=fo, stderr=fe, text=True, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        finally:
            try:  # reap what the run left behind in its own session (the checkpoint manager process)
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        fo.seek(0)
        fe.seek(0)
        return rc, fo.read(), fe.read()


def _resume_args(work, save, log):
    return ["--hf-config", os.path.join(work, "hf"), "--data", os.path.join(work, "train"), "--block-size", "4",
            "--window-size", "2", "--micro-batch-size", "1", "--global-batch-size", "3", "--train-steps", "6",
            "--lr", "2e-3", "--warmup-steps", "1", "--clip-grad", "0.5", "--seed", "11", "--threads", "1",
            "--log-interval", "1", "--no-progress", "--save", save, "--save-interval", "2", "--log-file", log]


@pytest.fixture(scope="module")
def killed_and_resumed(work):
    """A run SIGKILLed right after step 5 (last checkpoint: step 4), then resumed to step 6."""
    from megatron_jf import checkpointing

    save = os.path.join(work, "ckpt")
    log1, log2 = os.path.join(work, "killed.jsonl"), os.path.join(work, "resumed.jsonl")
    rc, out, err = _run_cli(_resume_args(work, save, log1), {"MEGATRON_JF_FAULT_KILL_AT_STEP": "5"})
    assert rc == -signal.SIGKILL, (rc, out[-2000:], err[-4000:])
    assert checkpointing.latest_iteration(save) == 4
    rc, out, err = _run_cli(_resume_args(work, save, log2))
    assert rc == 0, (out[-2000:], err[-4000:])
    assert "resumed from" in out and checkpointing.latest_iteration(save) == 6
    read = lambda p: {r["iteration"]: r for r in map(json.loads, open(p)) if r["split"] == "train"}  # noqa: E731
    return save, read(log1), read(log2)


def test_resume_after_kill_matches_uninterrupted_run(work, killed_and_resumed):
    from megatron_jf.training.config import parse_config

    save, killed, resumed = killed_and_resumed
    assert sorted(killed) == [1, 2, 3, 4, 5] and sorted(resumed) == [5, 6]
    # the uninterrupted reference: same configuration, in this process, without checkpoints
    args = _resume_args(work, save, "x")
    cfg = parse_config(args[: args.index("--save")])
    hist = _trainer_from_scratch(cfg).train()
    for it in (1, 2, 3, 4, 5):
        assert killed[it]["loss"] == hist[it - 1]["loss"], it
    for it in (5, 6):  # identical, not merely close
        assert resumed[it]["loss"] == hist[it - 1]["loss"], it
        assert resumed[it]["pc_loss"] == hist[it - 1]["pc loss"] and resumed[it]["lr"] == hist[it - 1]["lr"]


def _trainer_from_scratch(cfg):
    import pretrain_jf
    from megatron_jf.training.trainer import Trainer

    return Trainer(cfg, pretrain_jf.model_provider, partial(pretrain_jf.forward_step, cfg=cfg),
                   pretrain_jf.train_valid_datasets_provider)


def test_training_dtype_reaches_the_pipeline_config_when_the_build_dtype_differs(work, monkeypatch):
    """Issue 21 item 7. On GPU the model provider builds in bf16 (``platform.default_dtype``); a run in fp32
    (``--precision fp32``, the torch AdamW path) casts the weights, and megatron's pipeline receive buffers
    (``config.pipeline_dtype``) must follow, or PP > 1 receives fp32 activations into bf16 buffers. Here the
    provider sees the GPU's default dtype on CPU."""
    from megatron_jf import platform

    monkeypatch.setattr(platform, "default_dtype", lambda: torch.bfloat16)
    tr = _cli_trainer(["--hf-config", os.path.join(work, "hf"), "--data", os.path.join(work, "train"),
                       "--block-size", "4", "--train-steps", "1", "--precision", "fp32", "--no-progress"])
    c = tr.module.config
    assert {p.dtype for p in tr.module.parameters()} == {torch.float32}
    assert (c.pipeline_dtype, c.params_dtype, c.bf16) == (torch.float32, torch.float32, False)


def test_load_initialises_weights_and_rejects_other_architectures(work, killed_and_resumed, tmp_path):
    save = killed_and_resumed[0]
    base = ["--data", os.path.join(work, "train"), "--block-size", "4", "--train-steps", "1", "--threads", "1",
            "--no-progress"]
    tr = _cli_trainer(["--load", save, *base])
    assert tr.iteration == 0  # weights only: a fresh run
    ref = _cli_trainer(["--hf-config", os.path.join(work, "hf"), *base])
    p_load = dict(tr.module.named_parameters())
    for n, p in ref.module.named_parameters():  # random init differs from the loaded (trained) weights
        if n.endswith("linear_fc2.weight"):
            assert (p - p_load[n]).abs().max() > 1e-4
    other = save_tiny_hf_config(str(tmp_path / "other"), vocab=VOCAB, layers=4, hidden=32, heads=4, kv_heads=2,
                                ffn=48, tied=True, max_pos=128)
    with pytest.raises(ValueError, match="another architecture"):
        _cli_trainer(["--hf-config", other, "--load", save, *base])


# ----------------------------------------------------------------------------- bad input
def test_unknown_option_is_an_argparse_error(capsys):
    from megatron_jf.training.config import parse_config

    with pytest.raises(SystemExit):
        parse_config(["--data", "x", "--train-steps", "1", "--bogus-flag"])
    assert "unrecognized arguments: --bogus-flag" in capsys.readouterr().err


@pytest.mark.parametrize("extra,exc,match", [
    ([], ValueError, "--block-size is required"),
    (["--block-size", "4", "--attention-path", "two_stream", "--mask", "nc_ic"], ValueError, "exact only for --mask nc"),
    (["--block-size", "4", "--min-lr", "1.0"], ValueError, "min-lr"),
    (["--block-size", "4", "--use-megatron-optimizer"], ValueError, "needs CUDA"),
])
def test_bad_configuration(work, extra, exc, match):
    if "--use-megatron-optimizer" in extra and torch.cuda.is_available():
        pytest.skip("the megatron optimizer is valid with CUDA")
    with pytest.raises(exc, match=match):
        _cli_trainer(["--hf-config", os.path.join(work, "hf"), "--data", os.path.join(work, "train"),
                      "--train-steps", "1", *extra])


def test_attention_path_flex_is_not_offered(capsys):
    """Issue 25: no choice is offered that raises; FlexAttention is not implemented, so it is not a choice (it used to
    be offered and raise NotImplementedError)."""
    from megatron_jf.training.config import build_parser, parse_config

    with pytest.raises(SystemExit):
        parse_config(["--data", "x", "--train-steps", "1", "--block-size", "4", "--attention-path", "flex"])
    assert "unknown attention path 'flex'; choose one of two_stream, dense, packed" in capsys.readouterr().err
    assert "flex" not in build_parser().format_help()


def test_bad_data(work, tmp_path):
    base = ["--hf-config", os.path.join(work, "hf"), "--train-steps", "1", "--no-progress", "--threads", "1"]
    # block size in the shards differs from --block-size
    with pytest.raises(ValueError, match="block_size 4 != requested block_size 8"):
        _cli_trainer([*base, "--data", os.path.join(work, "train"), "--block-size", "8"])
    # no shards / an empty shard
    os.makedirs(tmp_path / "none")
    with pytest.raises(FileNotFoundError, match="no .tar shards"):
        _cli_trainer([*base, "--data", str(tmp_path / "none"), "--block-size", "4"])
    import tarfile

    os.makedirs(tmp_path / "empty")
    tarfile.open(tmp_path / "empty" / "e-000000.tar", "w").close()
    with pytest.raises(ValueError, match="empty dataset"):
        _cli_trainer([*base, "--data", str(tmp_path / "empty"), "--block-size", "4"])
    # corrupt shards are named in the error: a damaged tar header (found when indexing) and damaged
    # record bytes (found by the checksum when the record is read)
    src = sorted(f for f in os.listdir(os.path.join(work, "train")) if f.endswith(".tar"))[0]
    for name, lo in (("hdr", 0), ("body", 1600)):
        os.makedirs(tmp_path / name)
        dst = tmp_path / name / src
        raw = bytearray(open(os.path.join(work, "train", src), "rb").read())
        for i in range(lo, lo + 60):
            raw[i] ^= 0x5A
        open(dst, "wb").write(bytes(raw))
        with pytest.raises(ValueError, match=str(dst)):
            tr = _cli_trainer([*base[:2], "--train-steps", "3", "--no-progress", "--data", str(tmp_path / name),
                               "--block-size", "4"])
            tr.train()
    # sequences longer than the model's context: a model with 12 positions
    small = save_tiny_hf_config(str(tmp_path / "small"), vocab=VOCAB, max_pos=12)
    tr = _cli_trainer(["--hf-config", small, "--train-steps", "1", "--no-progress", "--data",
                       os.path.join(work, "train"), "--block-size", "4"])
    with pytest.raises(ValueError, match="exceeds the model's context of 12"):
        tr.train()
    # AR token data with ids outside the vocabulary, and JSONL without a tokenizer
    np.save(tmp_path / "big.npy", np.arange(300, dtype=np.int32))
    tr = _cli_trainer(["--objective", "ar", "--hf-config", os.path.join(work, "hf"), "--data",
                       str(tmp_path / "big.npy"), "--seq-length", "16", "--train-steps", "1", "--no-progress"])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tr.train()
    (tmp_path / "t.jsonl").write_text('{"text": "hello"}\n')
    with pytest.raises(ValueError, match="needs a tokenizer"):
        _cli_trainer(["--objective", "ar", "--hf-config", os.path.join(work, "hf"), "--data",
                      str(tmp_path / "t.jsonl"), "--seq-length", "16", "--train-steps", "1"])


def test_cli_reports_bad_input_as_one_line(work):
    rc, out, err = _run_cli(["--hf-config", os.path.join(work, "hf"), "--data", os.path.join(work, "train"),
                             "--train-steps", "1", "--block-size", "8", "--no-progress"], timeout=120)
    assert rc == 2 and "pretrain_jf.py: error:" in err and "block_size 4 != requested block_size 8" in err
    assert "Traceback" not in err


def test_saved_checkpoint_carries_the_tokenizer(work, tmp_path):
    """A JF run from a checkpoint with a tokenizer saves one too, so generate/evaluate/serve/collect load it."""
    from megatron_jf import checkpointing
    from megatron_jf.models.zoo import build_tiny_checkpoint
    from megatron_jf.tokenizer import load_tokenizer

    src = build_tiny_checkpoint(str(tmp_path / "tiny"), in_process=True)
    save = str(tmp_path / "jf")
    tr = _cli_trainer(["--load", src, "--data", os.path.join(work, "train"), "--block-size", "4", "--train-steps",
                       "1", "--threads", "1", "--no-progress", "--save", save])
    tr.train()
    assert checkpointing.latest_iteration(save) == 1
    assert checkpointing.tokenizer_path(save) is not None
    from megatron_jf.training.config import TrainConfig

    saved = checkpointing.read_meta(save)["common"]["config"]  # the nested config, read back whole
    assert "optim" in saved and TrainConfig.from_json(saved) == tr.cfg
    a, b = load_tokenizer(checkpointing.tokenizer_path(src)), load_tokenizer(checkpointing.tokenizer_path(save))
    text = "def add(a, b):\n    return a + b\n"
    assert b.encode(text) == a.encode(text) and b.eos_ids == a.eos_ids
