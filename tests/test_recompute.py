"""Activation recomputation (``--recompute-granularity/--recompute-method/--recompute-num-layers``, Megatron-LM
meaning, megatron-core ``TransformerConfig`` fields): a training step in every mode gives the loss and gradients
of a step without recomputation (fp32, <= 1e-6 relative) and holds fewer saved activation bytes, at TP=1 here
and TP=2 under torchrun (gloo)."""
import json
import os
import sys
from functools import partial

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist"))
from conftest import run_torchrun  # noqa: E402
from train_fixtures import (  # noqa: E402
    PARALLEL_CONFIGS,
    RECOMPUTE_MODES,
    hf_weights_provider,
    make_record,
    measured_step,
    parallel_config,
    write_shards,
)

VOCAB = 255


@pytest.fixture(scope="module")
def work(tmp_path_factory, mp1):
    from megatron_jf.models.zoo import save_tiny_hf

    d = str(tmp_path_factory.mktemp("jfrecompute"))
    save_tiny_hf(os.path.join(d, "hf"), "qwen2", seed=5, vocab=VOCAB, layers=4, tied=True, max_pos=128)
    recs = [make_record(100 + i, prompt_len=4 + i % 3, block_size=4, num_blocks=3, vocab=VOCAB,
                        last_block_len=3 if i % 4 == 1 else None) for i in range(8)]
    write_shards(os.path.join(d, "train"), recs, per_shard=3)
    return d


def _trainer(cfg, work):
    import pretrain_jf
    from megatron_jf.training.trainer import Trainer

    return Trainer(cfg, hf_weights_provider(os.path.join(work, "hf")), partial(pretrain_jf.forward_step, cfg=cfg),
                   pretrain_jf.train_valid_datasets_provider)


_REF = {}


def _reference(work, name):
    if name not in _REF:
        _REF[name] = measured_step(_trainer(parallel_config(work, name, train_steps=1), work))
    return _REF[name]


def _assert_same_step(got, ref):
    (m, grads, _), (m0, grads0, _) = got, ref
    assert m["loss"] == pytest.approx(m0["loss"], rel=1e-6, abs=0)
    assert m["grad norm"] == pytest.approx(m0["grad norm"], rel=1e-6, abs=0)
    assert grads.keys() == grads0.keys() and grads
    for n, g in grads.items():
        scale = float(grads0[n].abs().max())
        assert float((g - grads0[n]).abs().max()) <= 1e-6 * scale, n


@pytest.mark.parametrize("mode", list(RECOMPUTE_MODES))
@pytest.mark.parametrize("name", list(PARALLEL_CONFIGS))
def test_recompute_step_equals_plain_step_and_saves_less(work, name, mode):
    tr = _trainer(parallel_config(work, name, train_steps=1, **RECOMPUTE_MODES[mode]), work)
    cfgs = {k: getattr(tr.module.config, k) for k in RECOMPUTE_MODES[mode]}
    assert cfgs == RECOMPUTE_MODES[mode]  # the flags reached megatron-core's TransformerConfig
    got = measured_step(tr)
    ref = _reference(work, name)
    _assert_same_step(got, ref)
    assert got[2] < ref[2], (got[2], ref[2])


def test_full_recompute_saves_less_than_selective_and_uniform_less_than_block(work):
    """Full recomputation keeps only layer inputs; block (2 of 4 layers) keeps the other two layers' activations."""
    peaks = {mode: measured_step(_trainer(parallel_config(work, "dense_ncic_ref", train_steps=1, **kw), work))[2]
             for mode, kw in RECOMPUTE_MODES.items()}
    ref = _reference(work, "dense_ncic_ref")[2]
    assert peaks["full_uniform"] < peaks["full_block"] < ref
    assert peaks["full_uniform"] < peaks["selective"] and peaks["selective_mlp"] < peaks["selective"]
    print({"none": ref, **peaks})


def test_recompute_at_tp2_equals_plain_step(work):
    out = run_torchrun("recompute_tp.py", work, timeout=400)
    res = [json.loads(line[len("RESULT "):]) for line in out.splitlines() if line.startswith("RESULT ")]
    assert {(r["config"], r["mode"], r["rank"]) for r in res} == {
        (c, m, rank) for c in PARALLEL_CONFIGS for m in RECOMPUTE_MODES for rank in (0, 1)}
    for r in res:
        assert r["loss"] == pytest.approx(r["ref_loss"], rel=1e-6, abs=0), r
        assert r["grad_rel"] <= 1e-6, r
        assert r["peak"] < r["ref_peak"], r
    # TP=2 gives the single-process loss of the same step
    for c in PARALLEL_CONFIGS:
        r = next(x for x in res if x["config"] == c)
        assert r["ref_loss"] == pytest.approx(_reference(work, c)[0]["loss"], rel=2e-5)


@pytest.mark.parametrize("argv,match", [
    (["--recompute-granularity", "full"], "needs --recompute-method"),
    (["--recompute-granularity", "full", "--recompute-method", "uniform"], "needs --recompute-method"),
    (["--recompute-granularity", "selective", "--recompute-num-layers", "2"], "apply to --recompute-granularity full"),
    (["--recompute-method", "block", "--recompute-num-layers", "1"], "need --recompute-granularity"),
    (["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "0"], ">= 1"),
])
def test_bad_recompute_options(argv, match):
    from megatron_jf.training.config import parse_config

    with pytest.raises(ValueError, match=match):
        parse_config(["--data", "x", "--train-steps", "1", "--block-size", "4", "--hf-config", "x", *argv])


def test_recompute_options_reach_transformer_config_and_are_checked_against_the_model(work):
    from megatron_jf.training.config import parse_config

    cfg = parse_config(["--data", "x", "--train-steps", "1", "--block-size", "4", "--hf-config", "x",
                        "--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "3"])
    assert cfg.recompute.kwargs() == {"recompute_granularity": "full", "recompute_method": "block",
                                      "recompute_num_layers": 3}
    # uniform chunks of 3 do not tile 4 layers
    with pytest.raises(ValueError, match="does not divide the 4 layers"):
        _trainer(parallel_config(work, "two_stream_kl", recompute_granularity="full", recompute_method="uniform",
                                 recompute_num_layers=3), work)

    # a model provider that ignores the recompute options is an error, not a silent no-op
    def plain_provider(model_args, cfg):
        from megatron_jf.models.gpt import build_model

        return build_model(model_args)

    import pretrain_jf
    from megatron_jf.training.trainer import Trainer

    cfg = parallel_config(work, "two_stream_kl", recompute_granularity="selective")
    with pytest.raises(ValueError, match="not the requested"):
        Trainer(cfg, plain_provider, partial(pretrain_jf.forward_step, cfg=cfg), pretrain_jf.train_valid_datasets_provider)


@pytest.mark.parametrize("mode", ["selective", "full_uniform"])
def test_recompute_on_the_packed_path(work, mode):
    """The packed THD path (PackedSeqParams through our core attention) under recomputation."""
    from megatron_jf.training.config import ATTENTION_PATHS

    if "packed" not in ATTENTION_PATHS:
        pytest.skip("no packed attention path")
    ref = measured_step(_trainer(parallel_config(work, "two_stream_kl", attention_path="packed", train_steps=1), work))
    got = measured_step(_trainer(parallel_config(work, "two_stream_kl", attention_path="packed", train_steps=1,
                                                 **RECOMPUTE_MODES[mode]), work))
    _assert_same_step(got, ref)
    assert got[2] < ref[2]
