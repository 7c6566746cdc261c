"""Optimizer configuration: one parameter grouping on both optimizer paths (no weight decay on biases and
norm weights, Megatron-LM's default), and the megatron DDP / optimizer configs carry the overlap flags."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist"))
from train_fixtures import tiny_mcore_model  # noqa: E402

WD = 0.1


def _cfg(*extra):
    from megatron_jf.training.config import parse_config

    return parse_config(["--data", "x", "--train-steps", "1", "--block-size", "4", "--hf-config", "x",
                         "--weight-decay", str(WD), *extra])


def _expected(model):
    """Decay per parameter by name: matrices decay, biases (qkv) and RMSNorm weights do not."""
    out = {}
    for n, p in model.named_parameters():
        out[n] = 0.0 if (n.endswith(".bias") or "layernorm" in n or "final_layernorm" in n or p.dim() == 1) else WD
    return out


def test_torch_path_grouping(mp1):
    from megatron_jf.training.optim import effective_weight_decay, param_groups, set_lr_and_weight_decay

    model, _ = tiny_mcore_model(seed=0, layers=2)
    names = dict(model.named_parameters())
    assert any(n.endswith("linear_qkv.bias") for n in names) and any("layernorm" in n for n in names)
    opt = torch.optim.AdamW(param_groups(model, WD), lr=1e-3)
    set_lr_and_weight_decay(opt.param_groups, 1e-3, WD)
    got = effective_weight_decay(opt.param_groups, model)
    assert got == _expected(model)
    assert sorted(set(got.values())) == [0.0, WD]


def test_megatron_path_grouping_matches_the_torch_path(mp1):
    """The groups megatron-core's get_megatron_optimizer builds (``_get_param_groups`` with our overrides),
    turned into the torch Adam it constructs: without :func:`set_lr_and_weight_decay` every group decays with
    the optimizer's default (the bug: megatron's groups only carry ``wd_mult``); with it, norms and biases do not."""
    from megatron.core.optimizer import _get_param_groups

    from megatron_jf.training.optim import (
        effective_weight_decay,
        megatron_config_overrides,
        megatron_optimizer_config,
        set_lr_and_weight_decay,
    )

    model, _ = tiny_mcore_model(seed=0, layers=2)
    ocfg = megatron_optimizer_config(_cfg(), torch.float32)
    groups = _get_param_groups([model], ocfg, megatron_config_overrides())
    opt = torch.optim.AdamW(groups, lr=ocfg.lr, weight_decay=ocfg.weight_decay)  # as megatron-core builds it
    before = effective_weight_decay(opt.param_groups, model)
    assert set(before.values()) == {WD}  # norms and biases would decay
    set_lr_and_weight_decay(opt.param_groups, 2e-4, WD)
    assert effective_weight_decay(opt.param_groups, model) == _expected(model)
    assert all(g["lr"] == pytest.approx(2e-4) for g in opt.param_groups)
    # megatron-core's own standard rule (len-1 or *.bias) selects the same parameters as ours
    from megatron.core.optimizer import get_standard_config_overrides

    default = _get_param_groups([model], ocfg, get_standard_config_overrides(ocfg))
    set_lr_and_weight_decay(default, 2e-4, WD)
    assert effective_weight_decay(default, model) == _expected(model)


def test_megatron_ddp_and_optimizer_configs_carry_the_flags():
    from megatron_jf.training.optim import megatron_ddp_config, megatron_optimizer_config

    cfg = _cfg("--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
               "--ddp-bucket-size", "1000000")
    d = megatron_ddp_config(cfg)
    assert (d.overlap_grad_reduce, d.overlap_param_gather, d.use_distributed_optimizer, d.bucket_size,
            d.grad_reduce_in_fp32) == (True, True, True, 1000000, True)
    o = megatron_optimizer_config(cfg, torch.bfloat16)
    assert o.use_distributed_optimizer and o.overlap_param_gather and o.bf16 and o.weight_decay == WD
    d = megatron_ddp_config(_cfg())
    assert not d.overlap_grad_reduce and not d.overlap_param_gather and not d.use_distributed_optimizer


@pytest.mark.parametrize("extra,match", [
    (["--overlap-param-gather"], "needs --use-distributed-optimizer and --overlap-grad-reduce"),
    (["--overlap-param-gather", "--use-distributed-optimizer"], "needs --use-distributed-optimizer and"),
    (["--ddp-bucket-size", "0"], "--ddp-bucket-size must be >= 1"),
])
def test_bad_overlap_options(extra, match):
    with pytest.raises(ValueError, match=match):
        _cfg(*extra)


def test_overlap_flags_on_the_cpu_path_are_an_error(mp1, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("the megatron DDP path is valid with CUDA")
    from functools import partial

    import pretrain_jf
    from megatron_jf.training.trainer import Trainer

    cfg = _cfg("--overlap-grad-reduce")
    with pytest.raises(ValueError, match="configure megatron's DDP"):
        Trainer(cfg, pretrain_jf.model_provider, partial(pretrain_jf.forward_step, cfg=cfg),
                pretrain_jf.train_valid_datasets_provider)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the megatron optimizer needs CUDA")
def test_gpu_trainer_optimizer_groups(tmp_path):
    """On GPU: the Trainer's megatron optimizer applies no weight decay to norms and biases."""
    from functools import partial

    from train_fixtures import make_record, write_shards

    import pretrain_jf
    from megatron_jf.models.zoo import save_tiny_hf
    from megatron_jf.training.optim import effective_weight_decay
    from megatron_jf.training.trainer import Trainer

    save_tiny_hf(str(tmp_path / "hf"), "qwen2", seed=5, vocab=255, layers=2, tied=True, max_pos=128)
    write_shards(str(tmp_path / "train"), [make_record(i, vocab=255) for i in range(4)])
    from megatron_jf.training.config import parse_config

    cfg = parse_config(["--data", str(tmp_path / "train"), "--train-steps", "1", "--block-size", "4",
                        "--hf-config", str(tmp_path / "hf"), "--weight-decay", str(WD), "--use-megatron-optimizer",
                        "--no-progress"])
    tr = Trainer(cfg, pretrain_jf.model_provider, partial(pretrain_jf.forward_step, cfg=cfg),
                 pretrain_jf.train_valid_datasets_provider)
    tr.train()
    got = effective_weight_decay(tr.optimizer.param_groups, tr.module)
    assert got and got == {n: v for n, v in _expected(tr.module).items() if n in got}


def test_megatron_overrides_pass_megatron_consistency_check():
    from megatron.core.optimizer import check_config_overrides_consistency

    from megatron_jf.training.optim import megatron_config_overrides, megatron_optimizer_config

    assert check_config_overrides_consistency(megatron_optimizer_config(_cfg(), torch.float32),
                                              megatron_config_overrides())


def test_megatron_ddp_overlap_grad_reduce_averages_the_same_gradients():
    """DP=2 under torchrun (gloo, CPU): megatron-core DDP from ``megatron_ddp_config`` with and without
    --overlap-grad-reduce (one bucket, and ten buckets via --ddp-bucket-size) equals an all-reduce average; with
    --use-distributed-optimizer each rank's reduce-scattered shard does."""
    import json

    import megatron.core
    from packaging.version import Version

    if Version(megatron.core.__version__).release[:2] >= (0, 17) and not torch.cuda.is_available():
        pytest.skip("megatron-core >= 0.17 DDP synchronises gradients on CUDA streams (torch.cuda.current_stream)")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from conftest import run_torchrun

    out = run_torchrun("ddp_overlap.py", timeout=300)
    res = [json.loads(line[len("RESULT "):]) for line in out.splitlines() if line.startswith("RESULT ")]
    assert {(r["flags"], r["rank"]) for r in res} == {(f, rank) for f in (
        "", "--overlap-grad-reduce", "--overlap-grad-reduce --ddp-bucket-size 4000", "--use-distributed-optimizer",
        "--use-distributed-optimizer --overlap-grad-reduce --ddp-bucket-size 4000") for rank in (0, 1)}
    for r in res:
        assert r["rel"] <= 1e-6 and r["local_rel"] > 1e-3, r  # averaged, and the ranks' gradients really differ
        assert r["overlap"] == ("overlap" in r["flags"])
        assert (r["buckets"] > 1) == ("bucket-size" in r["flags"])


def test_overlapped_param_gather_with_untied_output_layer_equals_no_overlap():
    """Issue 21 item 1. DP=2 under torchrun (gloo): megatron-core DDP with the distributed optimizer's buffers,
    --overlap-grad-reduce --overlap-param-gather and small buckets (the untied output layer in a bucket of its own),
    three loss-row steps: losses and weights equal the run without overlaps. Without running the output layer's
    forward pre-hooks the second step stops on megatron's ``assert self.param_gather_handle is None``. megatron's
    optimizer itself needs CUDA: its step is written out on the DDP buffers (tests/dist/ddp_param_gather.py); the
    real optimizer runs in ``bench/gpu_check.sh``."""
    import json

    import megatron.core
    from packaging.version import Version

    if Version(megatron.core.__version__).release[:2] >= (0, 17) and not torch.cuda.is_available():
        pytest.skip("megatron-core >= 0.17 DDP synchronises gradients on CUDA streams (torch.cuda.current_stream)")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from conftest import run_torchrun

    out = run_torchrun("ddp_param_gather.py", timeout=300)
    res = [json.loads(line[len("RESULT "):]) for line in out.splitlines() if line.startswith("RESULT ")]
    assert sorted(r["rank"] for r in res) == [0, 1]
    for r in res:
        assert r["buckets"] > 1 and r["output_layer_alone"], r  # the layout of the failure: its own bucket
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-6) and len(r["losses"]) == 3, r
        assert r["max_weight_diff"] <= 1e-6 * r["moved"] and r["moved"] > 1e-2, r
