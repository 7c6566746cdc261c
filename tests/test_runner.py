"""The model runner (issue 22): the forward chosen by constructor argument with environment overrides, static
decoders owned with a bounded lifetime (issue 21 item 4), a device-synchronised prefill clock (item 8), and the
model layer importing nothing from inference."""
import ast
import gc
import pathlib

import pytest
import torch


@pytest.fixture(scope="module")
def model(mp1):
    from megatron_jf.models.zoo import mcore_twin, tiny_hf_model

    return mcore_twin(tiny_hf_model("qwen2", scale=0.3, seed=1))


def _live_static_decoders() -> int:
    from megatron_jf.inference.static_decode import StaticDecoder

    gc.collect()
    return sum(isinstance(o, StaticDecoder) for o in gc.get_objects())


def test_static_decoders_do_not_outlive_generate(model, monkeypatch):
    """Each generate() builds static decoders for its own cache (static path forced on CPU); after many calls,
    none is left (the old table on the lean forward kept one per call and per row-count view)."""
    from megatron_jf.inference.engine import DecodeConfig, Engine

    monkeypatch.setenv("MEGATRON_JF_STATIC_DECODE", "force")
    eng = Engine(model)
    base = _live_static_decoders()
    for i in range(6):
        prompts = [[3, 1, 4, 1, 5][: 1 + i % 5], [9, 2, 6] * (1 + i)]
        eng.generate(prompts, DecodeConfig("jacobi", block_size=2 + i % 3), max_new_tokens=6 + i)
    assert _live_static_decoders() == base


def test_a_session_keeps_a_bounded_number_of_static_decoders(model, monkeypatch):
    """A long-lived session (the server's) whose row count changes holds at most max_static_views decoders and
    still decodes exactly as AR."""
    from megatron_jf.inference.engine import DecodeConfig, Engine
    from megatron_jf.inference.request import Request

    monkeypatch.setenv("MEGATRON_JF_STATIC_DECODE", "force")
    eng = Engine(model, check_invariants=True)
    prompts = [[5, 3, 5], [1, 2, 3, 4], [7], [8, 8, 2], [4, 4, 4, 4, 4]]
    ar = [r.tokens for r in eng.generate(prompts, DecodeConfig("ar"), max_new_tokens=12)]
    sess = eng.open_batch(5, max_width=8)
    assert sess.runner.impl == "static"
    sess.runner.max_static_views = 2
    keys, out, seen = {}, {}, 0
    for i, p in enumerate(prompts):  # one row joins per step: views over 1, 2, 3, ... rows
        keys[sess.add(p, Request(DecodeConfig("running-window", block_size=3), max_new_tokens=12 - i))] = i
        for k, r in sess.step():
            out[keys[k]] = r.tokens
        seen = max(seen, len(sess.runner._static))
        assert _live_static_decoders() <= 2
    while sess.num_rows:
        for k, r in sess.step():
            out[keys[k]] = r.tokens
    assert seen == 2 and all(out[i] == ar[i][: 12 - i] for i in range(5))


def test_forward_is_a_constructor_field_with_environment_overrides(model, monkeypatch):
    from megatron_jf.inference.engine import DecodeConfig, Engine
    from megatron_jf.inference.options import InferenceOptions as IO
    from megatron_jf.inference.runner import ModelRunner

    for var in ("MEGATRON_JF_LEAN_FORWARD", "MEGATRON_JF_STATIC_DECODE", "MEGATRON_JF_MR_VERIFY"):
        monkeypatch.delenv(var, raising=False)
    assert ModelRunner(model, 1, 8).impl == "lean"  # CPU default
    assert ModelRunner(model, 1, 8).mr_verify == "pruned"
    monkeypatch.setenv("MEGATRON_JF_STATIC_DECODE", "force")
    assert ModelRunner(model, 1, 8).impl == "static"
    assert ModelRunner(model, 1, 8, options=IO(forward="lean")).impl == "lean"  # the argument wins over the variable
    assert ModelRunner(model, 1, 8, options=IO(static_decode=False)).impl == "lean"
    monkeypatch.setenv("MEGATRON_JF_LEAN_FORWARD", "0")
    assert ModelRunner(model, 1, 8).impl == "megatron"
    monkeypatch.setenv("MEGATRON_JF_MR_VERIFY", "tree")
    assert ModelRunner(model, 1, 8).mr_verify == "tree"
    assert ModelRunner(model, 1, 8, options=IO(mr_verify="pruned")).mr_verify == "pruned"
    with pytest.raises(ValueError, match="unknown forward impl 'fast'"):
        IO(forward="fast")
    with pytest.raises(ValueError, match="unknown gemv mode 'some'"):
        IO(gemv="some")
    monkeypatch.setenv("MEGATRON_JF_LEAN_GEMV", "some")
    with pytest.raises(ValueError, match="MEGATRON_JF_LEAN_GEMV must be all, out or none, got 'some'"):
        Engine(model)
    monkeypatch.delenv("MEGATRON_JF_LEAN_GEMV")
    monkeypatch.delenv("MEGATRON_JF_LEAN_FORWARD")
    monkeypatch.delenv("MEGATRON_JF_STATIC_DECODE")
    p, cfg = [[3, 1, 4, 1, 5, 9, 2, 6]], DecodeConfig("mr", block_size=4, num_blocks=2, spawn_threshold=0.5)
    outs = {f: Engine(model, options=IO(forward=f), check_invariants=True).generate(p, cfg, max_new_tokens=20)[0].tokens
            for f in ("megatron", "lean", "static")}
    assert outs["megatron"] == outs["lean"] == outs["static"]


def test_engine_takes_inference_options_on_cpu(model, monkeypatch):
    """``Engine(model, options=...)``: the explicit field wins over the variable, the variable over CPU's default."""
    from megatron_jf.inference.engine import Engine
    from megatron_jf.inference.options import InferenceOptions

    for var in ("MEGATRON_JF_LEAN_FORWARD", "MEGATRON_JF_STATIC_DECODE", "MEGATRON_JF_MR_VERIFY"):
        monkeypatch.delenv(var, raising=False)
    assert Engine(model).mr_verify == "pruned" and Engine(model).options == InferenceOptions()
    monkeypatch.setenv("MEGATRON_JF_MR_VERIFY", "tree")
    assert Engine(model).mr_verify == "tree"
    eng = Engine(model, options=InferenceOptions(mr_verify="pruned"))
    assert eng.mr_verify == "pruned"
    sess = eng.open_batch(1)
    assert sess.runner.mr_verify == "pruned" and sess.runner.impl == "lean" and sess.runner.cuda_graphs is False
    monkeypatch.setenv("MEGATRON_JF_STATIC_DECODE", "force")
    assert eng.open_batch(1).runner.impl == "static"
    assert Engine(model, options=InferenceOptions(static_decode=False)).open_batch(1).runner.impl == "lean"


def test_gemv_and_packing_set_explicitly_stay_on_the_lean_forward(model):
    """``InferenceOptions(gemv=..., lean_packed=...)`` set the model's lean forward's weight copies and packing; auto
    leaves them as they are."""
    from megatron_jf.inference.lean_forward import _onednn_packing_works
    from megatron_jf.inference.options import InferenceOptions as IO
    from megatron_jf.inference.runner import ModelRunner

    lean = ModelRunner(model, 1, 8, options=IO(forward="lean", gemv="none", lean_packed=False)).lean
    assert lean.gemv_transposed == set() and lean.packed is False
    again = ModelRunner(model, 1, 8, options=IO(forward="lean"))._lean()
    assert again is lean and lean.gemv_transposed == set() and lean.packed is False
    ModelRunner(model, 1, 8, options=IO(forward="lean", gemv="out", lean_packed=True))
    assert lean.gemv_transposed == {"out"} and lean.packed is _onednn_packing_works()
    ModelRunner(model, 1, 8, options=IO(forward="lean", gemv="all"))
    assert "qkv0" in lean.gemv_transposed


def test_prefill_clock_waits_for_the_device(model, monkeypatch):
    """prefill_s is read after a device synchronize (on CUDA queued kernels would otherwise be missed)."""
    from megatron_jf.inference import runner as runner_mod
    from megatron_jf.inference.engine import DecodeConfig, Engine

    calls = []
    monkeypatch.setattr(runner_mod, "synchronize", lambda d: calls.append(d))
    res = Engine(model).generate([[1, 2, 3, 4]], DecodeConfig("ar"), max_new_tokens=2)[0]
    assert calls == [next(model.parameters()).device] and res.prefill_s > 0


@pytest.mark.parametrize("together", [False, True])
def test_prefill_one_by_one_or_padded_fills_the_same_cache(model, together):
    """Ragged prompts prefilled each alone (CPU) or as one padded batch (accelerators): each row's committed keys and
    values equal a prefill of that prompt alone, and nothing is written past its length."""
    from megatron_jf.inference.options import InferenceOptions
    from megatron_jf.inference.runner import ModelRunner

    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 200, (n,), generator=g).tolist() for n in (7, 3, 11, 1)]
    r = ModelRunner(model, 4, 16, options=InferenceOptions(forward="lean"))
    r.prefill_together = together
    r.prefill(prompts, 0)
    assert r.cache.lengths.tolist() == [6, 2, 10, 0]
    for i, p in enumerate(prompts):
        alone = ModelRunner(model, 1, 16, options=InferenceOptions(forward="lean"))
        alone.prefill([p], 0)
        L = len(p) - 1
        torch.testing.assert_close(r.cache.k[:, i, :, :L], alone.cache.k[:, 0, :, :L], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(r.cache.v[:, i, :, :L], alone.cache.v[:, 0, :, :L], rtol=1e-5, atol=1e-6)
        assert not r.cache.k[:, i, :, L:].any()


def test_models_do_not_import_inference():
    """The model layer (megatron_jf/models) has no import of megatron_jf.inference (the two old back-edges:
    forward_logits reaching into the lean forward and the static decoder)."""
    import megatron_jf.models

    files = sorted(pathlib.Path(megatron_jf.models.__file__).parent.glob("*.py"))
    assert len(files) >= 5
    bad = []
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            bad += [f"{f.name}: {n}" for n in names if n.startswith("megatron_jf.inference")]
    assert not bad, bad
