"""The training memory planner (bench/train_memory.py): measured activations and the projection's arithmetic.

* activation elements per token per layer are measured from the tensors autograd saves: full recomputation
  keeps exactly each layer's input (``h`` per token), far fewer than no recomputation;
* parameter counts equal the published Qwen2.5 sizes; the per-GPU components add up to the total and follow
  the stated formulas (distributed optimizer sharding over DP, TP / sequence-parallel splits);
* launch-script flags with ``${VAR:-default}`` indirection are read back.
"""
import math
import os

import pytest

from bench import train_memory as tm
from megatron_jf.models.hf_config import ModelArgs

TINY = ModelArgs(architecture="Qwen2ForCausalLM", vocab_size=1000, hidden_size=64, intermediate_size=160, num_layers=4,
                 num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=1e6,
                 max_position_embeddings=4096, tie_word_embeddings=False, qkv_bias=True)


@pytest.fixture(scope="module")
def measured(mp1):
    return tm.measure_activations(TINY, seqs=(16, 32), layers=(1, 2))


def test_measured_full_recompute_saves_fewer_bytes_than_none(measured):
    meas, small, k = measured
    assert k == 8 and small.hidden_size == 8 and small.intermediate_size == 20 and small.num_heads == 4
    assert all(meas[m]["other"] == 0 for m in tm.MODES)  # every saved tensor was recognised
    none, sel, full = (sum(meas[m][c] for c in tm.CLASSES) for m in tm.MODES)
    assert full < none / 10  # a real reduction, measured
    assert meas["full"]["hidden"] == small.hidden_size and full == small.hidden_size  # only the layer input
    assert sel <= none and meas["selective"]["per_head"] == 0 < meas["none"]["per_head"]  # SDPA's LSE rerun
    # without recompute at least: 2 norm inputs, q/k/v, attention out, fc1 out (2 x ffn), act out, residuals
    assert none >= 2 * small.hidden_size + 2 * small.intermediate_size + small.intermediate_size
    assert meas["none"]["bytes_fp32"] == pytest.approx(4 * none)


@pytest.mark.parametrize("name,count", [("qwen2.5-7b", 7_615_616_512), ("qwen2.5-1.5b", 1_543_714_304),
                                        ("qwen2.5-0.5b", 494_032_768)])
def test_parameter_counts_match_published_sizes(name, count):
    assert tm.total_params(tm.load_arch(name)) == count


def test_projection_arithmetic(measured):
    meas, small, _ = measured
    kw = dict(tp=2, dp=4, seq_length=100, micro_batch_size=1, loss_chunk=32)
    pl = tm.plan(TINY, meas, small, **kw)
    assert pl.total == sum(pl.components.values())
    p = tm.params(TINY, 2)
    local = sum(p.values())
    assert p["embedding"] == p["output"] == 500 * 64  # vocab 1000 split over TP 2
    assert pl.components["weights (bf16)"] == 2 * local
    assert pl.components["gradients (fp32 DDP buffer)"] == 4 * local
    assert pl.components["optimizer (fp32 main + Adam m, v)"] == 12 * local
    dist = tm.plan(TINY, meas, small, use_distributed_optimizer=True, **kw)
    assert dist.components["optimizer (fp32 main + Adam m, v)"] == 12 * local // 4
    per = tm.act_bytes_per_token_layer(meas["none"], TINY, small, 2, False)
    m = meas["none"]
    rd = 16 / small.head_dim
    assert per == pytest.approx(2 * (m["hidden"] * 8 + m["scalar"] + m["rope"] * rd + (m["attn"] * rd + m["ffn"] * 8) / 2)
                                + 4 * m["per_head"] / 2)
    const = 200 * 2 * meas["none"]["const"] * 8  # the final norm, once
    assert meas["none"]["const"] > 0
    assert pl.components["activations"] == int(200 * 4 * per + const)  # 2 streams x 100 tokens x 4 layers
    sp = tm.act_bytes_per_token_layer(meas["none"], TINY, small, 2, True)
    assert sp == pytest.approx(per - (m["hidden"] * 8 + m["scalar"]))  # the hidden-sized half goes to the other rank
    full = tm.plan(TINY, meas, small, recompute_granularity="full", recompute_method="uniform",
                   recompute_num_layers=2, **kw)
    pf = tm.act_bytes_per_token_layer(meas["full"], TINY, small, 2, False)
    assert full.components["activations"] == int(200 * (2 * pf + 2 * per) + 200 * 2 * meas["full"]["const"] * 8)
    assert full.components["activations"] < pl.components["activations"]
    rows = 3 * 100
    v = 500
    assert pl.components["logits + loss temporaries"] > 5 * 32 * v * 4  # at least the chunk buffers
    old = tm.plan(TINY, meas, small, loss_rows_head=False, **kw)
    assert old.components["logits + loss temporaries"] == 200 * v * 2 + 6 * (rows // 3) * v * 4
    with pytest.raises(ValueError, match="recompute-method"):
        tm.plan(TINY, meas, small, recompute_granularity="full", **kw)


def test_settings_from_launch_script(tmp_path):
    sh = tmp_path / "run.sh"
    sh.write_text('NNODES=${NNODES:-2}\nGPUS_PER_NODE=${GPUS_PER_NODE:-8}\nTP=${TP:-4}\nSEQ=${SEQ:-8192}\n'
                  'ARGS=(\n  --tp "$TP" --pp 1   # comment --pp 7\n  --seq-length "$SEQ" --micro-batch-size 2\n'
                  '  --recompute-granularity full --recompute-method block --recompute-num-layers 3\n'
                  '  --sequence-parallel --use-distributed-optimizer --global-batch-size 16\n)\n')
    s = tm.settings_from_script(str(sh))
    assert s == dict(tp=4, pp=1, dp=4, seq_length=8192, micro_batch_size=2, num_microbatches=2,
                     recompute_granularity="full", recompute_method="block", recompute_num_layers=3,
                     sequence_parallel=True, use_distributed_optimizer=True, loss_chunk=1024, attention_path=None)
    assert tm.settings_from_script(str(sh), world_size=32)["dp"] == 8


def test_launch_script_projects_within_target(mp1):
    """examples/train_jf_qwen7b_h200.sh's settings, projected for Qwen2.5-7B from activations measured on
    its CPU twin, fit the 120 GiB target at 16k-token streams; without recomputation, sequence parallelism
    and the loss-row head the same shape does not fit an H200."""
    arch = tm.load_arch("qwen2.5-7b")
    meas, small, _ = tm.measure_activations(arch)
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples",
                          "train_jf_qwen7b_h200.sh")
    s = tm.settings_from_script(script)
    s.pop("attention_path")
    assert s["seq_length"] >= 16384 and s["recompute_granularity"] == "full"
    pl = tm.plan(arch, meas, small, **s)
    assert pl.total <= tm.DEFAULT_TARGET_GIB * tm.GiB, tm.report("script", pl, tm.DEFAULT_TARGET_GIB)
    bare = tm.plan(arch, meas, small, loss_rows_head=False, **dict(
        s, recompute_granularity=None, recompute_method=None, recompute_num_layers=None, sequence_parallel=False,
        loss_chunk=None))
    assert bare.total > tm.H200_BYTES
    # measured, not typed in: ~36 h saved elements per token per layer without recomputation (issue 12)
    per_layer = sum(meas["none"][c] * (arch.hidden_size / small.hidden_size if c in ("hidden", "ffn", "other")
                                       else arch.head_dim / small.head_dim if c in ("attn", "rope") else 1)
                    for c in tm.CLASSES)
    assert 30 * arch.hidden_size < per_layer < 42 * arch.hidden_size


def test_planner_flags_are_pretrain_jfs_definitions():
    """The planner's training flags are ``pretrain_jf.py``'s (the TrainConfig fields), with its own seq-length
    default; parsing needs no torch."""
    from megatron_jf.training.config import build_parser as pretrain_parser

    p = tm.build_parser()
    ours = {a.dest: a for a in p._actions}
    theirs = {a.dest: a for a in pretrain_parser()._actions}
    for dest in tm.TRAIN_FLAGS:
        assert ours[dest].definition is theirs[dest].definition, dest
    a = p.parse_args(["--tensor-model-parallel-size", "2", "--recompute-granularity", "full", "--recompute-method",
                      "uniform", "--recompute-num-layers", "1", "--sequence-parallel"])
    assert (a.tp, a.recompute_method, a.sequence_parallel, a.seq_length) == (2, "uniform", True, 16384)
    with pytest.raises(SystemExit):
        p.parse_args(["--recompute-method", "zigzag"])
