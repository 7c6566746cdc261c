"""Engine step API (continuous batching across decode configs), exact stop strings, row removal (issue 15)."""
import random
import zlib

import pytest
import torch

DECODERS = [("ar", {}), ("jacobi", dict(block_size=4)), ("running-window", dict(block_size=5)),
            ("mr", dict(block_size=8, num_blocks=2, verification_size=3)),
            ("mr", dict(block_size=3, num_blocks=3, spawn_threshold=0.5, verification_size=4))]


@pytest.fixture(scope="module")
def engines(mp1):
    from megatron_jf.decoding.width import ForwardCost
    from megatron_jf.inference.engine import Engine
    from megatron_jf.models.convert import hf_to_mcore
    from megatron_jf.models.gpt import build_model
    from megatron_jf.models.hf_config import ModelArgs
    from megatron_jf.models.zoo import peaked_hf_model, tiny_hf_model

    out = {}
    for name, hf in {"random": tiny_hf_model("qwen2", scale=0.3, seed=1),
                     "peaked": peaked_hf_model("llama", period=4, seed=4)}.items():
        args = ModelArgs.from_hf_dict(hf.config.to_dict())
        m = build_model(args).eval()
        m.load_state_dict(hf_to_mcore(hf.state_dict(), args), strict=False)
        # wide forwards free: draft_width="auto" rows draft the same in any batch, so a row's forwards (and its sampled
        # tokens, which depend on what is drafted) equal its offline run's; on a measured cost they follow the batch
        out[name] = Engine(m, check_invariants=True, forward_cost=ForwardCost({1: {1: 1.0, 64: 1.0}}))
    return out


def _prompts(seed, lengths):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (L,), generator=g).tolist() for L in lengths]


# tokens become 1-3 letter strings, so stop strings start and end inside tokens
_LET = "abcdefg"


def _detok(ids):
    return "".join(_LET[t % 7] * (1 + t % 3) for t in ids)


def _cut_reference(full_tokens, stops):
    text = _detok(full_tokens)
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return text[: min(hits)] if hits else text


@pytest.mark.parametrize("decoder,kw", DECODERS, ids=[f"{d}{kw.get('block_size', '')}" for d, kw in DECODERS])
def test_stop_strings_exact_randomized(engines, decoder, kw):
    """Output text == the greedy text cut right before the first stop string (any decoder); the
    streamed tokens equal the returned ones and usage counts only them."""
    from megatron_jf.inference.engine import DecodeConfig

    rnd = random.Random(zlib.crc32(repr((decoder, kw)).encode()))
    for name, eng in engines.items():
        prompts = _prompts(rnd.randrange(1000), (3, 9, 17))
        full = eng.generate(prompts, DecodeConfig("ar"), max_new_tokens=40)
        for trial in range(4):
            stops = []
            for f in full:
                t = _detok(f.tokens)
                a = rnd.randrange(len(t) - 6)
                stops.append(t[a: a + rnd.randint(1, 6)])
            stops = tuple(stops[: rnd.randint(1, 3)]) + (("zz",) if trial == 0 else ())  # "zz" never occurs
            got = {}
            res = eng.generate(prompts, DecodeConfig(decoder, **kw), max_new_tokens=40, stop_strings=stops,
                               detokenize=_detok, on_tokens=lambda i, ids: got.setdefault(i, []).extend(ids))
            for i, (f, r) in enumerate(zip(full, res)):
                want = _cut_reference(f.tokens, stops)
                assert _detok(r.tokens) + r.tail_text == want, (name, stops, i)
                assert r.tokens == f.tokens[: len(r.tokens)]
                assert got.get(i, []) == r.tokens  # streamed == returned (held-back text never leaked)
                assert sum(r.accepted) == len(r.tokens) and len(r.accepted) == r.forwards
                assert r.finish_reason == ("stop" if want != _detok(f.tokens) else "length")
                assert len(r.tail_text) < 3  # only part of one token


def test_issue_example_stop_qnop(engines):
    """The issue's example: stop "qnop" on "opqnopqn..." gives "op" and bills the tokens before it only."""
    from megatron_jf.inference.engine import DecodeConfig

    eng = engines["peaked"]
    p = _prompts(3, (5,))
    full = eng.generate(p, DecodeConfig("ar"), max_new_tokens=30)[0].tokens
    # name the 4-cycle of the peaked model o,p,q,n: a detokenizer mapping its tokens to those letters
    cyc = {t: c for t, c in zip(full[:4], "opqn")}
    detok = lambda ids: "".join(cyc.get(t, "x") for t in ids)  # noqa: E731
    assert detok(full).startswith("opqnopqn")
    for d, kw in DECODERS:
        r = eng.generate(p, DecodeConfig(d, **kw), max_new_tokens=30, stop_strings=("qnop",), detokenize=detok)[0]
        assert detok(r.tokens) == "op" and r.tokens == full[:2] and r.finish_reason == "stop", d
        assert sum(r.accepted) == 2


@pytest.mark.parametrize("split", [None, 1], ids=["one-forward", "split-forward"])
def test_mixed_configs_in_one_session_equal_offline(engines, split):
    """Rows with different decoders, block sizes, caps, EOS ids and sampling decode in the same steps (one
    padded forward, or wide and narrow rows in two); rows join mid-way and some leave early (removed);
    every finished row equals its own offline generate."""
    from megatron_jf.inference.engine import DecodeConfig
    from megatron_jf.inference.request import Request
    from megatron_jf.inference.sampling import SamplingParams

    for name, eng in engines.items():
        prompts = _prompts(11, (4, 13, 1, 22, 7, 9, 30, 2))
        specs = []
        for i, p in enumerate(prompts):
            d, kw = DECODERS[i % len(DECODERS)]
            samp = SamplingParams() if i % 3 else SamplingParams(temperature=0.8, top_k=20, seed=100 + i)
            specs.append(dict(prompt=p, cfg=DecodeConfig(d, **kw), max_new=10 + 7 * i, sampling=samp,
                              eos=frozenset({p[0]}) if i == 5 else frozenset()))
        sess = eng.open_batch(6, max_width=64, split_min_saving=split)
        splits = []
        arrange = sess._arrange
        sess._arrange = lambda seqs: splits.append(arrange(seqs)) or splits[-1]
        swaps = []
        swap = sess._swap
        sess._swap = lambda i, j: swaps.append((i, j)) or swap(i, j)
        keys, results, streamed = {}, {}, {}

        def on_tokens(k, ids):
            streamed.setdefault(k, []).extend(ids)

        def add(i):
            s = specs[i]
            keys[sess.add(s["prompt"], Request(s["cfg"], s["sampling"], s["max_new"], eos_ids=s["eos"]))] = i

        for i in range(4):
            add(i)
        steps, nxt, removed = 0, 4, None
        while sess.num_rows or nxt < len(specs):
            for k, r in sess.step(on_tokens):
                results[keys[k]] = r
            steps += 1
            if steps % 3 == 0 and nxt < len(specs) and sess.free:  # join while others decode
                add(nxt)
                nxt += 1
            if steps == 4 and removed is None:
                removed = next(k for k in keys if keys[k] not in results)
                assert sess.remove(removed) and not sess.remove(removed)
        assert keys[removed] not in results
        assert any(splits) == (split is not None) == bool(swaps)  # the split path ran and swapped rows, or never
        for i, s in enumerate(specs):
            if i == keys[removed]:
                continue
            ref = eng.generate([s["prompt"]], s["cfg"], max_new_tokens=s["max_new"], sampling=s["sampling"],
                               eos_ids=s["eos"])[0]
            got = results[i]
            assert got.tokens == ref.tokens and got.forwards == ref.forwards, (name, i, s["cfg"])
            k = next(k for k, v in keys.items() if v == i)
            assert streamed[k] == got.tokens


def test_session_limits_named(engines):
    from megatron_jf.inference.engine import DecodeConfig
    from megatron_jf.inference.request import Request

    eng = engines["random"]
    sess = eng.open_batch(1, max_width=16)
    with pytest.raises(ValueError, match="forwards 41 tokens per step; this batch allows at most 16"):
        sess.add([1, 2], Request(DecodeConfig("mr", block_size=8, num_blocks=2, verification_size=4)))
    sess.add([1, 2], Request(DecodeConfig("jacobi", block_size=8), max_new_tokens=5))
    with pytest.raises(ValueError, match="the batch is full"):
        sess.add([1, 2])
    while sess.num_rows:
        sess.step()
    assert sess.free == 1
