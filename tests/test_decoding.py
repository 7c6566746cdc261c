"""Every decoder is lossless: greedy output == greedy AR == transformers' greedy generate (issue 3), with the
default draft width ``auto`` (issue 33) as with a fixed one."""
import pytest
import torch

from tests.conftest import run_torchrun


def _knee():
    """A forward cost with a knee (3 tokens cost 10 % more than 1, 9 tokens twice, 33 eight times): under
    ``draft_width="auto"`` the widths then vary with each request's acceptance, 0 to the ceiling, deterministically
    (a measured table would vary with the machine's load)."""
    from megatron_jf.decoding.width import ForwardCost

    return ForwardCost({1: {1: 1.0, 3: 1.1, 9: 2.0, 33: 8.0}, 4: {1: 2.0, 3: 2.4, 9: 5.0, 33: 24.0}})


def _engine(hf, forward_cost=None):
    from megatron_jf.inference.engine import Engine
    from megatron_jf.models.convert import hf_to_mcore
    from megatron_jf.models.gpt import build_model
    from megatron_jf.models.hf_config import ModelArgs

    args = ModelArgs.from_hf_dict(hf.config.to_dict())
    m = build_model(args).eval()
    m.load_state_dict(hf_to_mcore(hf.state_dict(), args), strict=False)
    return Engine(m, check_invariants=True, forward_cost=forward_cost or _knee())


@pytest.fixture(scope="module")
def models(mp1):
    from megatron_jf.models.zoo import peaked_hf_model, tiny_hf_model

    out = {}
    for name, hf in {"qwen2-random": tiny_hf_model("qwen2", scale=0.3, seed=1),
                     "llama-random": tiny_hf_model("llama", scale=0.3, seed=2),
                     "peaked-1": peaked_hf_model("qwen2", period=1, seed=3),
                     "peaked-4": peaked_hf_model("llama", period=4, seed=4)}.items():
        out[name] = (hf, _engine(hf))
    return out


def _prompts(seed=0, lengths=(1, 7, 40)):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (L,), generator=g).tolist() for L in lengths]


@pytest.mark.parametrize("name", ["qwen2-random", "llama-random", "peaked-4"])
def test_ar_equals_transformers_generate(models, name):
    from megatron_jf.inference.engine import DecodeConfig

    hf, eng = models[name]
    prompts = _prompts(1)
    ours = eng.generate(prompts, DecodeConfig("ar"), max_new_tokens=37)
    for p, o in zip(prompts, ours):
        ref = _hf_greedy(hf, p, 37)
        assert o.tokens == ref
        assert o.forwards == 37 and o.tpf == 1.0


def _hf_greedy(hf, prompt, max_new_tokens):
    """transformers greedy continuation; the explicit attention_mask keeps prompt tokens with id 0 visible."""
    ids = torch.tensor([prompt])
    return hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                       eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()


def test_reference_sees_prompt_token_zero(models):
    """A prompt containing token 0: without the mask, generate() would treat it as padding and diverge."""
    from megatron_jf.inference.engine import DecodeConfig

    hf, eng = models["qwen2-random"]
    p = [0, 17, 0, 99, 0, 5, 0, 42]
    ref = _hf_greedy(hf, p, 12)
    assert eng.generate([p], DecodeConfig("ar"), max_new_tokens=12)[0].tokens == ref
    assert eng.generate([p], DecodeConfig("jacobi", block_size=4), max_new_tokens=12)[0].tokens == ref


CONFIGS = (  # draft_width "auto" (the default) unless given
    [("jacobi", dict(block_size=n)) for n in (1, 2, 3, 16, 64)]
    + [("jacobi", dict(block_size=16, draft_init="repeat")), ("jacobi", dict(block_size=16, draft_width="fixed"))]
    + [("running-window", dict(block_size=n)) for n in (1, 5, 16)]
    + [("mr", dict(block_size=n, num_blocks=K, spawn_threshold=r, verification_size=v))
       for n, K, r, v in [(1, 1, 1.0, 1), (3, 2, 0.5, 2), (16, 1, 0.85, 4), (16, 2, 0.85, 4), (8, 3, 0.3, 3),
                          (64, 2, 0.5, 4), (4, 3, 1.0, 1)]]
    + [("mr", dict(block_size=16, num_blocks=2, verification_size=4, draft_width="fixed")),
       ("mr", dict(block_size=16, num_blocks=2, verification_size=4, draft_width="fixed", prompt_lookup_max=0)),
       ("mr", dict(block_size=8, num_blocks=2, verification_size=4, prompt_lookup_min=2, prompt_lookup_max=3))]
)


@pytest.mark.parametrize("decoder,kw", CONFIGS, ids=[f"{d}-{'-'.join(f'{k}{v}' for k, v in kw.items())}" for d, kw in CONFIGS])
def test_decoders_are_lossless(models, decoder, kw):
    from megatron_jf.inference.engine import DecodeConfig

    for name in ("qwen2-random", "peaked-1", "peaked-4"):
        _, eng = models[name]
        prompts = _prompts(2)
        ref = eng.generate(prompts, DecodeConfig("ar"), max_new_tokens=45)  # 45: not a multiple of n
        out = eng.generate(prompts, DecodeConfig(decoder, **kw), max_new_tokens=45)
        for o, r in zip(out, ref):
            assert o.tokens == r.tokens, (name, decoder, kw)
            assert len(o.tokens) == 45 and o.finish_reason == "length"
            assert sum(o.accepted) == 45 and o.forwards == len(o.accepted)


def test_peaked_model_accepts_many_tokens_per_forward(models):
    from megatron_jf.inference.engine import DecodeConfig

    from megatron_jf.decoding import PAPER

    _, eng = models["peaked-1"]
    out = eng.generate(_prompts(3), DecodeConfig("jacobi", block_size=16, draft_init="repeat", **PAPER),
                       max_new_tokens=64)
    # the repeat draft is the fixed point: every block takes one forward to verify
    assert all(o.tpf >= 10 for o in out), [o.tpf for o in out]
    _, eng4 = models["peaked-4"]
    mr = eng4.generate(_prompts(3), DecodeConfig("mr", block_size=8, num_blocks=2, verification_size=4, **PAPER),
                       max_new_tokens=64)
    jac = eng4.generate(_prompts(3), DecodeConfig("jacobi", block_size=8, **PAPER), max_new_tokens=64)
    # rejection recycling finds the repeating cycle in rejected drafts; plain Jacobi cannot
    assert sum(o.tpf for o in mr) > 1.2 * sum(o.tpf for o in jac), ([o.tpf for o in mr], [o.tpf for o in jac])


def test_width_follows_the_cost_table_in_the_engine(models):
    """Issue 33: where wide forwards are free every step forwards the whole draft (the ceiling); where a forward of
    s tokens costs s times one token every step is plain AR (no draft token forwarded); output equal to AR both ways,
    and with the measured cost of this machine."""
    from megatron_jf.decoding.width import ForwardCost
    from megatron_jf.inference.engine import DecodeConfig, Engine

    free = ForwardCost({1: {1: 1.0, 64: 1.0}})
    steep = ForwardCost({1: {1: 1.0, 64: 64.0}})
    prompts = _prompts(3)
    # drafts the model accepts (the repeat draft on the period-1 model; MR's pools on the period-4 one): free, the
    # fixed width's steps exactly (MR with v=1 has no candidates, so nothing leads its draft); steep, AR steps
    for name, cfg in (("peaked-1", DecodeConfig("jacobi", block_size=8, draft_init="repeat")),
                      ("peaked-1", DecodeConfig("mr", block_size=8, num_blocks=2, verification_size=1,
                                                draft_init="repeat")),
                      ("peaked-4", DecodeConfig("mr", block_size=8, num_blocks=2))):
        hf, eng = models[name]
        ref = eng.generate(prompts, DecodeConfig("ar"), max_new_tokens=40)
        wide = Engine(eng.model, forward_cost=free).generate(prompts, cfg, max_new_tokens=40)
        fixed = eng.generate(prompts, DecodeConfig(**{**cfg.__dict__, "draft_width": "fixed"}), max_new_tokens=40)
        ar = Engine(eng.model, forward_cost=steep).generate(prompts, cfg, max_new_tokens=40)
        for w, f, a, r in zip(wide, fixed, ar, ref):
            assert w.tokens == f.tokens == a.tokens == r.tokens
            if cfg.verification_size == 1 or cfg.decoder == "jacobi":  # the ceiling: the fixed width's steps
                assert w.draft_lens == f.draft_lens and w.forwards == f.forwards
            assert set(a.draft_lens) == {0} and a.forwards == len(a.tokens)  # AR steps
        assert sum(w.tpf for w in wide) > 3 * len(wide), [w.tpf for w in wide]
    hf, eng = models["peaked-4"]
    ref = eng.generate(prompts, DecodeConfig("ar"), max_new_tokens=40)
    measured = Engine(eng.model)  # this machine's cost (measured once, cached under MEGATRON_JF_COST_CACHE)
    for o, r in zip(measured.generate(prompts, DecodeConfig("mr"), max_new_tokens=40), ref):
        assert o.tokens == r.tokens
    # steps are timed against the measured table (a given table is used as it is: no calibration); a single row's
    # steps are not recorded (no penalty reads them)
    assert measured.step_calibration.steps > 0
    single = Engine(eng.model)
    assert single.generate(prompts[:1], DecodeConfig("mr"), max_new_tokens=40)[0].tokens == ref[0].tokens
    assert single.step_calibration.steps == 0
    assert Engine(eng.model, forward_cost=free).step_calibration is None


def test_fast_forwards_are_timed_more_often(models, monkeypatch):
    """measure_rows: REPS passes over the points, and more while the measurement has taken under REFINE_S -- a fast
    forward's points are the fastest of many timings (its table drove the auto width, and 3 timings of a 1 ms
    forward varied by 15 % between processes)."""
    from megatron_jf.inference import cost_model
    from megatron_jf.inference.runner import ModelRunner

    _, eng = models["qwen2-random"]
    runner = ModelRunner(eng.model, 1, 160, options=eng.options)
    calls = []
    real = cost_model._forward_seconds
    monkeypatch.setattr(cost_model, "_forward_seconds", lambda *a: calls.append(a[2]) or real(*a))
    counts = {}
    for refine in (0.0, 0.3):
        monkeypatch.setattr(cost_model, "REFINE_S", refine)
        calls.clear()
        times = cost_model.measure_rows(runner, 1, 4, reps=3)
        counts[refine] = len(calls)
        assert sorted(times) == [1, 2, 3, 4] and all(t > 0 for t in times.values())
    # warm-ups (2) + the first 1-token time + a pass per point (the 1-token reference beside each other point)
    assert counts[0.0] == 3 + 3 * (1 + 3 * 2)
    assert counts[0.3] > counts[0.0]
    # the 1-token point is the fastest of as many timings as every other point (once a pass), not of all the
    # reference timings beside the other points: with 1-token timings that only get faster, the last (beside the
    # last point) is not its time
    ones = []

    def fake(runner, rows, s, gen, context):
        if s == 1:
            ones.append(1.0 - 0.01 * len(ones))
            return ones[-1]
        return 2.0

    monkeypatch.setattr(cost_model, "_forward_seconds", fake)
    monkeypatch.setattr(cost_model, "REFINE_S", 0.0)
    times = cost_model.measure_rows(runner, 1, 4, reps=3)
    assert times[1] == ones[-4] > min(ones)  # the last pass's own, before the references beside its 3 other points


def test_forward_cost_measured_once_and_cached(models, monkeypatch, tmp_path):
    """The forward's cost is measured at first need for the batch's row counts, written atomically under the cache
    directory keyed by the model's shape, dtype, device and threads, and read back by a later engine."""
    import json

    from megatron_jf.inference import cost_model
    from megatron_jf.inference.engine import Engine

    monkeypatch.setenv("MEGATRON_JF_COST_CACHE", str(tmp_path))
    _, eng = models["qwen2-random"]
    cost = Engine(eng.model).forward_cost(rows=5, max_tokens=20)
    assert cost.rows == [1, 4, 5]
    for b in cost.rows:
        curve = cost.curve(b)
        assert curve[0][0] == 1 and len(curve) >= 4 and all(t > 0 for _, t in curve)
        assert [t for _, t in curve] == sorted(t for _, t in curve)
    files = list((tmp_path / "forward_cost").glob("*.json"))
    assert len(files) == 1
    key = json.loads(files[0].read_text())["about"]["key"]
    assert key["threads"] == torch.get_num_threads() and key["dtype"] == "float32" and key["model"]["num_layers"] == 2
    monkeypatch.setattr(cost_model, "measure_rows", lambda *a, **k: pytest.fail("measured again"))
    again = Engine(eng.model).forward_cost(rows=5, max_tokens=20)
    assert again.points() == cost.points()
    assert Engine(eng.model).forward_cost(rows=3).points() == cost.points()  # fewer rows: nothing to measure


def test_forward_cost_follows_the_thread_count(models, monkeypatch, tmp_path):
    """An engine holding a table measured at one torch thread count does not use it at another (the report times its
    decoders at 1 thread after evaluating them batched at 2): it reads or measures that count's table, and goes back
    to the first one's when the count does."""
    import json

    from megatron_jf.inference.engine import Engine

    monkeypatch.setenv("MEGATRON_JF_COST_CACHE", str(tmp_path))
    _, eng = models["qwen2-random"]
    engine = Engine(eng.model)
    before = torch.get_num_threads()
    other = 2 if before == 1 else 1
    first = engine.forward_cost(rows=1, max_tokens=8)
    try:
        torch.set_num_threads(other)
        second = engine.forward_cost(rows=1, max_tokens=8)
    finally:
        torch.set_num_threads(before)
    assert first.about["key"]["threads"] == before and second.about["key"]["threads"] == other
    assert len(list((tmp_path / "forward_cost").glob("*.json"))) == 2
    back = engine.forward_cost(rows=1, max_tokens=8)
    assert back.about["key"]["threads"] == before and back.points() == first.points()
    assert {json.loads(f.read_text())["about"]["key"]["threads"]
            for f in (tmp_path / "forward_cost").glob("*.json")} == {before, other}


def test_product_kernels_are_measured_kept_with_the_table_and_applied(models, monkeypatch, tmp_path):
    """Before a model's first cost table on a CPU, the fp32 products' kernels are measured per weight shape and row
    count (every kernel, interleaved), set on the lean forward, stored with the table and applied again by a later
    engine reading the cache; the choice is the fastest and moves off the default only for a real saving."""
    import json

    from megatron_jf.inference import cost_model
    from megatron_jf.inference.engine import Engine
    from megatron_jf.inference.lean_forward import SKINNY_MAX_ROWS, lean_forward_for
    from megatron_jf.models.gpt import unwrap

    choose = cost_model.choose_kernels
    t = {1: {"transposed": 1.0, "linear": 0.8, "packed": 1.2}, 2: {"transposed": 1.0, "linear": 0.9, "packed": 0.5},
         4: {"transposed": 1.0, "linear": 0.99, "packed": 0.6}, 8: {"transposed": 1.0, "linear": 1.0, "packed": 0.995}}
    default = {1: "transposed", 2: "packed", 4: "packed", 8: "packed"}
    # up to DECODE_ROWS rows one kernel (one copy of the weight for every decode step): the lowest sum of times over
    # each row count's fastest -- packed 1.5 + 1 + 1 + 1, linear 1 + 1.8 + 1.65 + 1.005, transposed 5.92
    assert choose(t, default) == ((1, "packed"),)
    # past that range each row count its fastest where it saves more than 2 % of the default's time; merged runs
    assert choose(t, default, decode_rows=1) == ((1, "linear"), (2, "packed"))
    assert choose(t, {1: "transposed", 2: "transposed", 4: "transposed", 8: "transposed"}, decode_rows=1) == (
        (1, "linear"), (2, "packed"), (8, "transposed"))  # 8 rows: within the noise of the default, which stays
    # the shared kernel keeps the one-row default unless it saves more than 2 % over the range
    near = {1: {"transposed": 1.0, "skinny": 0.97}, 2: {"transposed": 1.0, "skinny": 1.02}}
    two = {1: "transposed", 2: "transposed"}
    assert choose(near, two) == ((1, "transposed"),)
    assert choose({**near, 1: {"transposed": 1.0, "skinny": 0.9}}, two) == ((1, "skinny"),)
    # a kernel not timed at every row count of the range (skinny: up to 16 rows) is not shared past it; just past
    # the range (17-23 rows) a product takes the next measured row count's kernel
    wide = {1: {"transposed": 1.0, "skinny": 0.5}, 16: {"transposed": 1.0, "skinny": 0.9},
            24: {"transposed": 1.0, "linear": 0.5}, 32: {"transposed": 1.0, "linear": 0.5},
            64: {"transposed": 0.5, "linear": 1.0}}
    assert choose(wide, dict.fromkeys(wide, "transposed")) == ((1, "skinny"), (17, "linear"), (64, "transposed"))
    # no kernel timed at every row count of the range (never from calibrate_products): each row count its own
    assert choose({1: {"transposed": 1.0}, 2: {"packed": 1.0}}, {1: "transposed", 2: "packed"}) == (
        (1, "transposed"), (2, "packed"))
    with pytest.raises(ValueError, match="not timed"):
        choose({1: {"linear": 1.0}}, {1: "packed"})
    with pytest.raises(ValueError, match="timings"):
        choose({}, {})

    monkeypatch.setenv("MEGATRON_JF_COST_CACHE", str(tmp_path))
    _, eng = models["qwen2-random"]
    lean = lean_forward_for(unwrap(eng.model))
    if lean is None or not lean.packed:
        pytest.skip("no lean forward with oneDNN packing here")
    monkeypatch.setattr(lean, "kernels", {})
    seen = {}

    def pick(timings, default, **kw):  # the real measurements, a forced choice (timings differ by machine)
        seen[len(seen)] = timings
        return ((1, "linear"), (4, "packed"))

    monkeypatch.setattr(cost_model, "choose_kernels", pick)
    cost = Engine(eng.model).forward_cost(rows=1, max_tokens=8)
    shapes = set(lean.products())
    assert len(seen) == len(shapes) >= 2
    for timings in seen.values():
        assert sorted(timings) == list(cost_model.PRODUCT_ROWS)
        kinds = {"transposed", "linear", "packed"}
        for r, x in timings.items():  # skinny: with the C glue, up to the rows of one pass over the weight
            skinny = {"skinny"} if lean.glue and r <= SKINNY_MAX_ROWS else set()
            assert set(x) == kinds | skinny and min(x.values()) > 0
    assert lean.kernels == {s: ((1, "linear"), (4, "packed")) for s in shapes}
    assert not lean._wt and not lean._wk  # no choice uses the transposed or panel copies: freed
    w = next(iter(lean.products().values()))[0][1]
    assert lean.kernel(w, 3) == "linear"
    with monkeypatch.context() as mp:  # a skinny choice holds for one pass of the weight (16 rows), not past it
        mp.setattr(lean, "kernels", {tuple(w.shape): ((1, "skinny"),)})
        assert lean.kernel(w, 16) == "skinny" and lean.kernel(w, 17) == lean.default_kernel(w, 17) != "skinny"
    want = {f"{a}x{b}": [[1, "linear"], [4, "packed"]] for a, b in shapes}
    assert cost.about["products"] == want
    [f] = (tmp_path / "forward_cost").glob("*.json")
    assert json.loads(f.read_text())["about"]["products"] == want
    lean.kernels, lean._wp = {}, {}
    monkeypatch.setattr(cost_model, "calibrate_products", lambda *a, **k: pytest.fail("measured again"))
    Engine(eng.model).forward_cost(rows=1, max_tokens=8)
    assert lean.kernels == {s: ((1, "linear"), (4, "packed")) for s in shapes}  # applied from the cache
    # with the copies the choice uses made now, not at the first wide forward of a generation
    assert set(lean._wp) == {n for named in lean.products().values() for n, _ in named} and not lean._wt
    summary = cost_model.packing_summary(cost.about)  # what the benches print next to the cost table
    a, b = sorted(shapes)[0]
    assert f"{a}x{b} linear 1-3, packed 4+" in summary
    assert cost_model.packing_summary({"key": {}}) is None
    # what runs, not only what was measured: a skinny choice holds for one pass of the weight (16 rows)
    wide = cost_model.packing_summary({"products": {"960x576": [[1, "transposed"], [2, "skinny"], [24, "packed"]]}})
    assert wide.endswith("960x576 transposed 1, skinny 2-16, packed 17+")
    assert cost_model.products_from_about({"products": {"3x4": [[2, "packed"]]}}) is None  # must start at 1 row
    assert cost_model.products_from_about({"products": {"3x4": [[1, "gemv"]]}}) is None


def test_product_calibration_follows_the_timings(models, monkeypatch):
    """calibrate_products picks, per weight shape, one kernel for the decode range's row counts and past it the
    fastest by row count, from its products' timings (given through a fake clock: the real ones differ by
    machine), and frees the copies no choice uses."""
    from megatron_jf.inference import cost_model
    from megatron_jf.inference.lean_forward import lean_forward_for
    from megatron_jf.models.gpt import unwrap

    _, eng = models["qwen2-random"]
    lean = lean_forward_for(unwrap(eng.model))
    if lean is None or not lean.packed:
        pytest.skip("no lean forward with oneDNN packing here")
    monkeypatch.setattr(lean, "kernels", {})
    clock = [0.0]
    real = type(lean)._linear

    def linear(self, x, w, name, bias=None, kind=None):  # a product's time by kernel and rows
        rows = x.shape[0]
        clock[0] += {"transposed": 1.0, "linear": 0.5 if rows <= 2 else 1.2, "packed": 3.0 if rows < 8 else 0.4,
                     "skinny": 5.0}[kind]
        return real(self, x, w, name, bias, kind)

    monkeypatch.setattr(type(lean), "_linear", linear)
    monkeypatch.setattr(cost_model.time, "perf_counter", lambda: clock[0])
    got = cost_model.calibrate_products(lean, rows=(1, 2, 4, 8, 16, 24, 32), reps=1)
    shapes = list(lean.products())
    # up to 16 rows one kernel: F.linear, fastest at 1-2 rows only, sums 1 + 1 + 1.2 + 3 + 3 times each row
    # count's fastest against the transposed copies' 2 + 2 + 1 + 2.5 + 2.5 (packed: 17); from 17 rows the fastest
    assert lean.kernels == {s: ((1, "linear"), (17, "packed")) for s in shapes}
    assert got == {"products": {f"{a}x{b}": [[1, "linear"], [17, "packed"]] for a, b in shapes}}
    assert lean._wp and not lean._wt and not lean._wk  # the packed copies are used: kept; the others freed


@pytest.mark.parametrize("decoder,kw", [("jacobi", dict(block_size=4)), ("running-window", dict(block_size=4)),
                                        ("mr", dict(block_size=4, num_blocks=3, spawn_threshold=0.5)),
                                        ("ar", {})])
def test_eos_mid_block_and_after_full_block(models, decoder, kw):
    from megatron_jf.inference.engine import DecodeConfig

    _, eng = models["qwen2-random"]
    prompts = _prompts(4, (9,))
    full = eng.generate(prompts, DecodeConfig("ar"), max_new_tokens=30)[0].tokens
    for stop_at in (5, 7, 8):  # mid block, last of a block, right after a full block (n=4)
        eos = full[stop_at]
        first = full.index(eos)  # the engine must stop at the first occurrence
        out = eng.generate(prompts, DecodeConfig(decoder, **kw), max_new_tokens=30, eos_ids={eos})[0]
        assert out.tokens == full[: first + 1]
        assert out.finish_reason == "eos"
        assert sum(out.accepted) == len(out.tokens)  # nothing after EOS is counted


def test_batched_rows_match_single_rows(models):
    from megatron_jf.inference.engine import DecodeConfig

    _, eng = models["peaked-4"]
    prompts = _prompts(5, (3, 11, 1, 25))
    cfg = DecodeConfig("mr", block_size=8, num_blocks=2, verification_size=3)
    batched = eng.generate(prompts, cfg, max_new_tokens=33, eos_ids={7})
    for p, b in zip(prompts, batched):
        single = eng.generate([p], cfg, max_new_tokens=33, eos_ids={7})[0]
        assert b.tokens == single.tokens


def test_stop_strings_cut_output(models):
    from megatron_jf.inference.engine import DecodeConfig

    _, eng = models["qwen2-random"]
    detok = lambda ids: " ".join(map(str, ids))  # noqa: E731
    prompts = _prompts(6, (5,))
    full = eng.generate(prompts, DecodeConfig("ar"), max_new_tokens=20)[0].tokens
    stop = f"{full[6]} {full[7]}"
    out = eng.generate(prompts, DecodeConfig("jacobi", block_size=4), max_new_tokens=20,
                       stop_strings=(stop,), detokenize=detok)[0]
    assert out.finish_reason == "stop"
    assert stop not in detok(out.tokens)
    assert full[: len(out.tokens)] == out.tokens and len(out.tokens) <= 7


def test_sampled_decoders_follow_ar_distribution(mp1):
    """Speculative acceptance keeps the sampling distribution: compare the exact distribution of the 3rd
    sampled token (enumerated from model probabilities) with AR, Jacobi and MR samples."""
    from megatron_jf.inference.engine import DecodeConfig, Engine
    from megatron_jf.inference.sampling import SamplingParams, processed_probs
    from megatron_jf.inference.forward import forward_logits

    hf_small = __import__("megatron_jf.models.zoo", fromlist=["x"]).tiny_hf_model("qwen2", vocab=6, scale=0.5, seed=9)
    eng = _engine(hf_small)
    eng.check_invariants = False
    params = SamplingParams(temperature=1.0, top_k=5, top_p=0.95, seed=11)
    prompt = [1, 4, 2]
    V = 6
    # exact distribution of the 3rd generated token by enumerating the first two
    exact = torch.zeros(V)
    base = torch.tensor([prompt])
    def probs(seq):
        lg = forward_logits(eng.model, torch.tensor([seq]), torch.arange(len(seq))[None])[0, -1]
        return processed_probs(lg, params)
    p1 = probs(prompt)
    for a in range(V):
        if p1[a] == 0:
            continue
        p2 = probs(prompt + [a])
        for b in range(V):
            if p2[b] == 0:
                continue
            exact += p1[a] * p2[b] * probs(prompt + [a, b])
    N = 1500
    for cfg in (DecodeConfig("ar"), DecodeConfig("jacobi", block_size=3), DecodeConfig("mr", block_size=2, num_blocks=2, spawn_threshold=0.5, verification_size=3)):
        out = eng.generate([prompt] * N, cfg, max_new_tokens=3, sampling=params)
        counts = torch.bincount(torch.tensor([o.tokens[2] for o in out]), minlength=V).float()
        tv = 0.5 * (counts / N - exact).abs().sum().item()
        assert tv < 0.06, (cfg.decoder, tv, (counts / N).tolist(), exact.tolist())


def test_bad_inputs_named(models):
    from megatron_jf.inference.engine import DecodeConfig
    from megatron_jf.inference.sampling import SamplingParams

    _, eng = models["qwen2-random"]
    with pytest.raises(ValueError, match="unknown decoder"):
        DecodeConfig("medusa")
    with pytest.raises(ValueError, match="block size n"):
        DecodeConfig("jacobi", block_size=0)
    with pytest.raises(ValueError, match="number of blocks K"):
        DecodeConfig("mr", num_blocks=0)
    for r in (0.0, 1.5):
        with pytest.raises(ValueError, match="spawn threshold r"):
            DecodeConfig("mr", spawn_threshold=r)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="context window"):
        eng.generate([[1] * 500], DecodeConfig("ar"), max_new_tokens=20)
    with pytest.raises(ValueError, match="empty"):
        eng.generate([[]], DecodeConfig("ar"))


def test_tp2_decoders_match_tp1_torchrun():
    out = run_torchrun("decode_tp.py")
    lines = [l for l in out.splitlines() if l.startswith("DECODE")]
    assert len(lines) >= 4 and all(l.endswith("OK") for l in lines), out


def test_metrics_values():
    from megatron_jf.inference.engine import GenerationResult
    from megatron_jf.inference.metrics import percentile

    a = GenerationResult(tokens=[1] * 10, finish_reason="length", forwards=5, accepted=[2] * 5, prefill_s=1.0,
                         decode_s=2.0, prompt_len=3)
    assert a.tpf == 2.0 and a.tps == 5.0
    assert percentile([3.0, 2.0], 50) == 2.5 and abs(percentile([3.0, 2.0], 95) - 2.95) < 1e-9
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([], 50) != percentile([], 50)  # NaN
    with pytest.raises(ValueError, match="percentile q"):
        percentile([1.0], 101)


@pytest.mark.parametrize("max_new,n", [(3, 2), (8, 4), (11, 4), (45, 16)])
def test_trajectory_fixed_points_cover_output(models, max_new, n):
    """Concatenated block fixed points equal the output, even when the last forward crosses a block end."""
    from megatron_jf.inference.engine import DecodeConfig

    for name, init in (("peaked-1", "repeat"), ("qwen2-random", "context")):
        _, eng = models[name]
        for r in eng.generate(_prompts(7), DecodeConfig("jacobi", block_size=n, draft_init=init),
                              max_new_tokens=max_new, record_trajectory=True):
            fps = [t for b in r.trajectory for t in b["fixed_point"]]
            assert fps == r.tokens
            for b in r.trajectory:
                assert all(len(d) == len(b["fixed_point"]) <= n for d in b["drafts"])


def test_draft_init_does_not_depend_on_batch_position(models):
    from megatron_jf.inference.engine import DecodeConfig

    _, eng = models["qwen2-random"]
    p = _prompts(8)
    cfg = DecodeConfig("jacobi", block_size=8)
    a = eng.generate(p, cfg, max_new_tokens=20, record_trajectory=True)
    b = eng.generate(p[::-1], cfg, max_new_tokens=20, record_trajectory=True)[::-1]
    assert [x.trajectory for x in a] == [x.trajectory for x in b]


def test_argmax_list_equals_torch_argmax_with_ties_and_strides():
    """The engine's greedy tokens (numpy argmax on CPU float32) equal torch.argmax, first index on ties, also on
    strided rows (logits sliced to the unpadded vocabulary) and other dtypes."""
    from megatron_jf.inference.sampling import argmax_list

    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 4, (3, 17, 130), generator=g).float()  # many ties
    x[1, 2] = float("nan")
    sliced = x[:, :, :97]
    for t in (x, sliced, sliced[0], sliced[0, :5], x.double(), x.bfloat16()):
        assert argmax_list(t) == t.argmax(-1).tolist()
    assert argmax_list(sliced[0, 3]) == int(sliced[0, 3].argmax())
