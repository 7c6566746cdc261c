"""CPU mixed precision (``--precision bf16`` on CPU: fp32 master weights, bf16 autocast; megatron_jf.precision).

Training: a bf16 step's loss is within bf16 rounding of the fp32 step on the same batch and weights (and not
equal to it: bf16 really runs), weights, gradients and AdamW state stay fp32, a few steps reduce the loss, the
checkpoint holds fp32 tensors and a resumed bf16 run continues exactly. CPUs without native bf16 are refused
with one line. These tests run bf16 on any CPU (``MEGATRON_JF_CPU_BF16=1``: emulated where not native).
"""
import os
import subprocess
import sys
from functools import partial

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist"))
from train_fixtures import hf_weights_provider, make_record, parallel_config, write_shards  # noqa: E402

VOCAB = 255
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def work(tmp_path_factory, mp1):
    from megatron_jf.models.zoo import save_tiny_hf

    d = str(tmp_path_factory.mktemp("jfprec"))
    save_tiny_hf(os.path.join(d, "hf"), "qwen2", seed=3, vocab=VOCAB, layers=4, tied=True, max_pos=128)
    recs = [make_record(300 + i, prompt_len=5 + i % 2, block_size=4, num_blocks=3, vocab=VOCAB) for i in range(6)]
    write_shards(os.path.join(d, "train"), recs, per_shard=3)
    write_shards(os.path.join(d, "fixed"), recs[:2])
    return d


@pytest.fixture
def allow_bf16(monkeypatch):
    from megatron_jf.precision import CPU_BF16_ENV

    monkeypatch.setenv(CPU_BF16_ENV, "1")


def _trainer(work, precision, **over):
    import pretrain_jf
    from megatron_jf.training.trainer import Trainer

    cfg = parallel_config(work, "two_stream_kl", precision=precision, **over)
    return Trainer(cfg, hf_weights_provider(os.path.join(work, "hf")), partial(pretrain_jf.forward_step, cfg=cfg),
                   pretrain_jf.train_valid_datasets_provider)


def _fixed(work, **over):
    return dict(data=[os.path.join(work, "fixed")], micro_batch_size=2, global_batch_size=2, clip_grad=1.0, **over)


#: bf16 keeps 8 significant bits (unit roundoff 2^-9 ~ 0.2 %); the step's loss is a mean over ~100 loss
#: positions of KL/CE values computed from bf16 logits through 4 layers of bf16 products, whose rounding errors
#: are independent and largely cancel in the mean. 1 % relative is ~5 roundoffs: an autocast that skipped the
#: fp32 accumulation, or ran the loss itself in bf16, errs by more.
BF16_LOSS_RTOL = 1e-2


def test_bf16_step_loss_within_rounding_of_fp32(work, allow_bf16):
    ref = _trainer(work, "fp32", **_fixed(work, train_steps=1)).train()[0]
    got = _trainer(work, "bf16", **_fixed(work, train_steps=1)).train()[0]
    for k in ("loss", "ar loss"):
        assert got[k] == pytest.approx(ref[k], rel=BF16_LOSS_RTOL), k
    # L_pc is a KL between two near-equal distributions (0.025 here): its rounding error comes from the logits' and
    # is absolute, not relative to its own small size -- within one bf16 unit roundoff (2^-9) of a unit quantity
    assert got["pc loss"] == pytest.approx(ref["pc loss"], abs=2 ** -9)
    assert got["loss"] != ref["loss"]  # the products really ran in bf16
    assert got["grad norm"] == pytest.approx(ref["grad norm"], rel=5e-2)


def test_bf16_keeps_fp32_master_weights_and_optimizer_state_and_learns(work, allow_bf16):
    tr = _trainer(work, "bf16", **_fixed(work, train_steps=8, lr=3e-3))
    assert tr.autocast_dtype == torch.bfloat16 and tr.dtype == torch.float32
    hist = tr.train()
    losses = [h["loss"] for h in hist]
    assert losses[-1] < 0.8 * losses[0], losses
    params = list(tr.module.parameters())
    assert {p.dtype for p in params} == {torch.float32}
    assert {p.grad.dtype for p in params if p.grad is not None} == {torch.float32}
    state = [v for p in params for v in tr.optimizer.state[p].values() if torch.is_tensor(v) and v.dim() > 0]
    assert len(state) == 2 * len(params) and {v.dtype for v in state} == {torch.float32}  # exp_avg, exp_avg_sq


def test_bf16_checkpoint_holds_fp32_and_resumes_exactly(work, allow_bf16, tmp_path):
    from megatron.core import dist_checkpointing

    from megatron_jf import checkpointing

    run = dict(data=[os.path.join(work, "train")], train_steps=4, save_interval=2)
    whole = _trainer(work, "bf16", save=str(tmp_path / "whole"), **run).train()
    _trainer(work, "bf16", save=str(tmp_path / "split"), exit_interval=2, **run).train()  # killed at 2, as it were
    resumed = _trainer(work, "bf16", save=str(tmp_path / "split"), **run)
    assert resumed.iteration == 2
    tail = resumed.train()
    assert [h["loss"] for h in tail] == [h["loss"] for h in whole[2:]]
    meta = checkpointing.read_meta(str(tmp_path / "split"), 4)
    md = dist_checkpointing.load_tensors_metadata(meta["path"])
    weights = [k for k in md if k.startswith(meta["model_key_prefix"]) and "_extra_state" not in k]
    assert weights and {md[k].dtype for k in weights} == {torch.float32}
    assert checkpointing.stored_dtype(str(tmp_path / "split")) == torch.float32


def test_cpu_without_bf16_is_refused_in_one_line(work, monkeypatch):
    from megatron_jf.precision import CPU_BF16_ENV

    monkeypatch.setenv(CPU_BF16_ENV, "0")
    with pytest.raises(ValueError, match="AVX-512 BF16 or AMX"):
        _trainer(work, "bf16")
    argv = ["--hf-config", os.path.join(work, "hf"), "--data", os.path.join(work, "train"), "--block-size", "4",
            "--train-steps", "1", "--bf16", "--no-progress"]
    proc = subprocess.run([sys.executable, os.path.join(REPO, "pretrain_jf.py"), *argv], capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, PYTHONPATH=REPO))
    err = [line for line in proc.stderr.strip().splitlines() if "Warning" not in line and "warn" not in line]
    assert proc.returncode == 2 and len(err) == 1, proc.stderr
    assert err[0].startswith("pretrain_jf.py: error: --precision bf16 on CPU needs"), err


@pytest.mark.parametrize("flags, want", [("fpu avx2 avx512f avx512_bf16 amx_tile", "avx512_bf16"),
                                         ("fpu avx2 avx512_bf16 amx_bf16 amx_tile", "amx_bf16"),
                                         ("fpu avx2 fma f16c", None)])
def test_cpu_bf16_feature_from_cpuinfo(tmp_path, flags, want):
    from megatron_jf.precision import cpu_bf16_feature

    p = tmp_path / "cpuinfo"
    p.write_text(f"processor\t: 0\nmodel name\t: X\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    assert cpu_bf16_feature(str(p)) == want


def test_megatron_linears_run_bf16_under_autocast_and_backward_outside_it(mp1):
    """Inside :func:`megatron_jf.precision.autocast` megatron's linear layers take bf16 input, weight and bias (as
    ``F.linear`` does under autocast) and their backward needs no autocast region: the gradients reach the fp32
    weights as fp32, within bf16 rounding of the fp32 gradients."""
    from train_fixtures import tiny_mcore_model

    from megatron_jf.precision import autocast

    model, _ = tiny_mcore_model(seed=2, layers=2, vocab=VOCAB)
    x = torch.randint(0, VOCAB - 1, (2, 12), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(12).expand(2, 12)
    qkv = model.decoder.layers[0].self_attention.linear_qkv
    assert qkv.bias is not None  # Qwen2: the bias is part of the bf16 product
    seen = []
    hook = qkv.register_forward_hook(lambda m, i, o: seen.append(o[0].dtype))

    def grads(dtype):
        model.zero_grad(set_to_none=True)
        with autocast(dtype):
            loss = model(x, pos, None).float().logsumexp(-1).mean()
        loss.backward()  # outside the region
        return {n: p.grad for n, p in model.named_parameters()}

    ref, got = grads(None), grads(torch.bfloat16)
    hook.remove()
    assert seen == [torch.float32, torch.bfloat16]
    for n, g in got.items():
        assert g.dtype == torch.float32, n
        assert (g - ref[n]).norm() <= 5e-2 * ref[n].norm(), n
    assert any(not torch.equal(g, ref[n]) for n, g in got.items())


@pytest.mark.parametrize("family,peaked,weights", [("qwen2", False, torch.bfloat16), ("llama", True, torch.bfloat16),
                                                   ("qwen2", False, torch.float32)])
def test_decoders_lossless_against_ar_in_bf16(mp1, family, peaked, weights):
    """``--bf16`` inference runs bf16 weights; lossless then means equal to the same model's greedy AR in bf16
    (which may differ from the fp32 model's output). Jacobi, running window and MR (both verification modes)
    against AR, on a random and a peaked tiny model, prompts of several lengths, batched. Also fp32 weights under
    bf16 autocast (the third mode ``bench/decode_precision.py`` measures; its bf16 keys and values enter the fp32
    KV cache). These models' top logits are further apart than bf16 rounding; at a near-tie a wider forward can
    round to the other token (measured on SmolLM2-135M: README "bf16 on CPU"), which no decoder rule can avoid."""
    from megatron_jf.inference.engine import DecodeConfig, Engine, InferenceOptions
    from megatron_jf.models.convert import hf_to_mcore
    from megatron_jf.models.gpt import build_model
    from megatron_jf.models.hf_config import ModelArgs
    from megatron_jf.precision import autocast
    from megatron_jf.models.zoo import peaked_hf_model, tiny_hf_model

    hf = peaked_hf_model(family, period=4, seed=4) if peaked else tiny_hf_model(family, scale=0.3, seed=1)
    args = ModelArgs.from_hf_dict(hf.config.to_dict())
    m = build_model(args, params_dtype=weights).eval()
    m.load_state_dict(hf_to_mcore(hf.state_dict(), args), strict=False)
    assert {p.dtype for p in m.parameters() if p.dim() == 2} == {weights}  # (megatron's CPU norms: fp32)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (1, 9, 33)]
    with autocast(torch.bfloat16 if weights == torch.float32 else None):
        for mode in ("pruned", "tree"):
            eng = Engine(m, check_invariants=True, options=InferenceOptions(mr_verify=mode))
            ref = [r.tokens for r in eng.generate(prompts, DecodeConfig("ar"), max_new_tokens=40)]
            for cfg in (DecodeConfig("jacobi", block_size=8), DecodeConfig("jacobi", block_size=32),
                        DecodeConfig("running-window", block_size=8),
                        DecodeConfig("mr", block_size=8, num_blocks=2, spawn_threshold=0.5, verification_size=4)):
                out = eng.generate(prompts, cfg, max_new_tokens=40)
                assert [o.tokens for o in out] == ref, (mode, cfg)


@pytest.mark.parametrize("recompute", [dict(recompute_granularity="full", recompute_method="uniform",
                                             recompute_num_layers=1),
                                        dict(recompute_granularity="selective")])
def test_bf16_recomputed_forward_runs_in_bf16_too(work, allow_bf16, recompute):
    """Activation recomputation reruns the forward during the backward: still under the autocast region, so the
    gradients equal those of the run that kept its activations."""
    ref = _trainer(work, "bf16", **_fixed(work, train_steps=2)).train()
    got = _trainer(work, "bf16", **_fixed(work, train_steps=2, **recompute)).train()
    assert [h["grad norm"] for h in got] == pytest.approx([h["grad norm"] for h in ref], rel=1e-6)
    assert got[1]["loss"] == pytest.approx(ref[1]["loss"], rel=1e-6)


def test_bf16_parallel_layouts_match_one_process(work, allow_bf16):
    """PP=2 exchanges the residual stream between stages in the dtype megatron-core keeps it under autocast (bf16
    up to 0.16, fp32 in 0.19: ``precision.residual_stream_dtype``; the trainer sets megatron's ``pipeline_dtype``
    to it: with fp32 buffers for a bf16 stream on 0.16 the losses were silently wrong, grad norm 347 instead of 5.2,
    and with bf16 buffers for an fp32 stream on 0.19 gloo stopped on the size mismatch) and
    DP=2 averages the same gradients: both equal the single-process bf16 run. TP=2 splits each product, so its bf16
    rounding differs: within the bf16 tolerance."""
    import json

    from tests.conftest import run_torchrun

    ref = _trainer(work, "bf16").train()
    out = run_torchrun("train_bf16_layouts.py", work, timeout=600)  # ranks inherit allow_bf16's environment
    got = {r["layout"]: r for r in (json.loads(line[len("RESULT "):]) for line in out.splitlines()
                                    if line.startswith("RESULT "))}
    assert sorted(got) == ["dp2", "pp2", "tp2"]
    for layout, rtol in (("pp2", 1e-5), ("dp2", 1e-5), ("tp2", BF16_LOSS_RTOL)):
        assert got[layout]["loss"] == pytest.approx([h["loss"] for h in ref], rel=rtol), layout
        assert got[layout]["grad_norm"] == pytest.approx([h["grad norm"] for h in ref], rel=10 * rtol), layout


def test_core_attention_runs_fp32_under_cpu_autocast_up_to_the_key_bound(mp1, monkeypatch):
    """Under CPU bf16 autocast the core attention computes softmax(QK^T)V in fp32 from its bf16 inputs (faster than
    torch's bf16 CPU flash backward at short rows: ``megatron_jf.precision.CPU_FP32_ATTENTION_MAX_KEYS``), returning
    bf16 as before; past the bound it runs in bf16 as autocast would. Values checked against torch SDPA called
    directly both ways, so the test fails if either branch is taken at the wrong length."""
    import torch.nn.functional as F
    from train_fixtures import tiny_mcore_model

    from megatron_jf import precision

    model, _ = tiny_mcore_model(seed=4, layers=1, vocab=VOCAB)
    core = model.decoder.layers[0].self_attention.core_attention
    cfg = model.config
    nh, ng, hd = cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels
    g = torch.Generator().manual_seed(5)
    s, b = 12, 3
    q = torch.randn(s, b, nh, hd, generator=g).bfloat16()
    k = torch.randn(s, b, ng, hd, generator=g).bfloat16()
    v = torch.randn(s, b, ng, hd, generator=g).bfloat16()

    def reference(dtype):
        qq, kk, vv = (t.permute(1, 2, 0, 3).to(dtype) for t in (q, k, v))
        o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=core.softmax_scale,
                                           enable_gqa=nh != ng).bfloat16()
        return o.permute(2, 0, 1, 3).reshape(s, b, nh * hd)

    def run():
        with precision.autocast(torch.bfloat16):
            return core(q, k, v, None)

    fp32, bf16 = reference(torch.float32), reference(torch.bfloat16)
    assert not torch.equal(fp32, bf16)
    got = run()
    assert got.dtype == torch.bfloat16 and torch.equal(got, fp32)
    monkeypatch.setattr(precision, "CPU_FP32_ATTENTION_MAX_KEYS", s - 1)
    assert torch.equal(run(), bf16)


def test_output_layer_backward_is_one_matrix_product(mp1):
    """megatron returns the logits transposed to ``[b, s, V]``; the output layer's forward hook
    (``megatron_jf.models.gpt.contiguous_logits_grad``) hands its backward a contiguous gradient, so under CPU bf16
    autocast (where the product's saved weight is a bf16 copy that does not require grad, and torch's ``matmul``
    does not fold a strided 3-D gradient) the input gradient is one ``mm`` instead of a ``bmm`` over the weight
    copied ``s`` times, with the same gradients (checked against the model with the hook removed)."""
    from megatron_jf.precision import autocast
    from torch.utils._python_dispatch import TorchDispatchMode
    from train_fixtures import tiny_mcore_model

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    model, _ = tiny_mcore_model(seed=6, layers=1, vocab=VOCAB)
    x = torch.randint(0, VOCAB - 1, (2, 10), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(10).expand(2, 10)

    def backward():
        model.zero_grad(set_to_none=True)
        with autocast(torch.bfloat16):
            loss = model(x, pos, None).float().logsumexp(-1).mean()
        with Ops() as ops:
            loss.backward()
        return ops.names, {n: p.grad.clone() for n, p in model.named_parameters()}

    names, grads = backward()
    assert "bmm" not in names and "mm" in names
    hooks = model.output_layer._forward_hooks
    saved = dict(hooks)
    hooks.clear()
    try:
        ref_names, ref = backward()
    finally:
        hooks.update(saved)
    assert "bmm" in ref_names  # what the hook avoids (if torch ever folds it itself, this test has nothing left)
    for n, g in grads.items():
        torch.testing.assert_close(g, ref[n], rtol=1e-2, atol=1e-4, msg=n)  # bf16 products, summed in another order


def _run_after_compile_failure(monkeypatch, module, attr: str, compiled, run):
    """Set ``module.attr`` to a ``CompiledOnCPU`` like ``compiled`` whose kernel fails to run (as if inductor had
    built it), call ``run()`` expecting the one "torch.compile failed" warning, check the wrapper stays off, and return
    what ``run()`` returned (the caller's uncompiled path)."""
    def broken(*_):
        raise RuntimeError("no C++ compiler")

    failing = type(compiled)(broken, compiled.name)
    failing.compiled = broken
    monkeypatch.setattr(module, attr, failing)
    with pytest.warns(UserWarning, match="torch.compile failed"):
        out = run()
    assert failing.compiled is False and failing(None) is None
    return out


def test_rmsnorm_under_cpu_autocast_runs_compiled_in_fp32(monkeypatch):
    """Inside a CPU autocast region a bf16 row with the fp32 weight goes through the inductor-compiled
    ``rms_norm_fp32`` (one fused pass instead of the composite path's several; ``megatron_jf.models.norm``): the output
    and the input / weight gradients equal the eager fp32 formula rounded once to bf16 (within one bf16 step of
    it: compiled and eager fp32 sum in different orders), and the compiled function is what ran. Where compiling
    fails, one warning and the composite path, with the same values as ``torch.nn.RMSNorm``."""
    from types import SimpleNamespace

    from megatron_jf.models import norm

    cfg = SimpleNamespace(normalization="RMSNorm", params_dtype=torch.float32)
    g = torch.Generator().manual_seed(7)
    layer = norm.RMSNorm(cfg, 48, eps=1e-6)
    with torch.no_grad():
        layer.weight.copy_(1 + 0.5 * torch.randn(48, generator=g))
    x0 = torch.randn(3, 5, 48, generator=g).bfloat16()
    go = torch.randn(3, 5, 48, generator=g).bfloat16()

    def run(fn):
        x = x0.clone().requires_grad_()
        layer.weight.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = fn(x)
        y.backward(go)
        return y, x.grad, layer.weight.grad.clone()

    calls = []
    compiled = norm.COMPILED_RMS_NORM
    monkeypatch.setattr(norm, "COMPILED_RMS_NORM", lambda *a: calls.append(1) or compiled(*a))
    got = run(layer)
    assert calls and got[0].dtype == torch.bfloat16
    want = run(lambda x: norm.rms_norm_fp32(x, layer.weight, 1e-6))
    for a, b in zip(got, want):
        torch.testing.assert_close(a.float(), b.float(), rtol=2 ** -7, atol=1e-5)

    fallback = _run_after_compile_failure(monkeypatch, norm, "COMPILED_RMS_NORM", compiled, lambda: run(layer))
    composite = run(lambda x: torch.nn.RMSNorm.forward(layer, x))
    for a, b in zip(fallback, composite):
        assert torch.equal(a, b)


def test_mlp_swiglu_under_cpu_autocast_runs_compiled_in_fp32(mp1, monkeypatch):
    """The local spec's MLP (``megatron_jf.models.mlp``): inside a CPU bf16 autocast region its gated SiLU is the
    inductor-compiled ``swiglu_fp32`` (one fused pass), so output and every gradient equal ``fc1 -> swiglu_fp32 ->
    fc2`` in eager mode (within a bf16 step: compiled and eager fp32 round differently) and the compiled function is
    what ran; outside autocast (fp32) the layer is megatron's own forward bit for bit and nothing compiled runs; where
    compiling fails, one warning and megatron's composite glu, bit for bit."""
    from megatron.core.transformer.mlp import MLP as MegatronMLP
    from train_fixtures import tiny_mcore_model

    from megatron_jf import precision
    from megatron_jf.models import mlp as jf_mlp

    model, _ = tiny_mcore_model(seed=6, layers=1, vocab=VOCAB)
    layer = model.decoder.layers[0].mlp
    assert type(layer) is jf_mlp.MLP
    g = torch.Generator().manual_seed(8)
    x0 = torch.randn(7, 3, model.config.hidden_size, generator=g)
    go = torch.randn(7, 3, model.config.hidden_size, generator=g)

    def run(fn, dtype=torch.bfloat16):
        x = x0.to(dtype, copy=True).requires_grad_()
        layer.zero_grad(set_to_none=True)
        with precision.autocast(dtype if dtype != torch.float32 else None):
            y, bias = fn(x)
        assert bias is None
        y.backward(go.to(y.dtype))
        return [y, x.grad] + [p.grad.clone() for p in layer.parameters()]

    def eager(x):
        h, _ = layer.linear_fc1(x)
        return layer.linear_fc2(jf_mlp.swiglu_fp32(h))

    calls = []
    compiled = jf_mlp.COMPILED_SWIGLU
    monkeypatch.setattr(jf_mlp, "COMPILED_SWIGLU", lambda *a: calls.append(1) or compiled(*a))
    got = run(layer)
    assert calls and got[0].dtype == torch.bfloat16
    for a, b in zip(got, run(eager)):
        torch.testing.assert_close(a.float(), b.float(), rtol=2 ** -6, atol=2e-4)
    composite = run(lambda x: MegatronMLP.forward(layer, x))
    assert not torch.equal(got[0], composite[0])  # the compiled path rounds once, megatron's glu per operation

    calls.clear()
    fp32 = run(layer, torch.float32)
    assert not calls and fp32[0].dtype == torch.float32
    for a, b in zip(fp32, run(lambda x: MegatronMLP.forward(layer, x), torch.float32)):
        assert torch.equal(a, b)

    fallback = _run_after_compile_failure(monkeypatch, jf_mlp, "COMPILED_SWIGLU", compiled, lambda: run(layer))
    for a, b in zip(fallback, composite):
        assert torch.equal(a, b)
