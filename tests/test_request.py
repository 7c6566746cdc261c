"""The request type (issue 34): one torch-free, validated :class:`Request` carried unchanged from the server's protocol
(or ``Engine.generate``) through the scheduler and its tensor-parallel broadcast to the batch row, and one context
check (:func:`megatron_jf.inference.request.check`)."""
import dataclasses
import os
import pickle
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def engine(mp1):
    from megatron_jf.decoding.width import ForwardCost
    from megatron_jf.inference.engine import Engine
    from megatron_jf.models.convert import hf_to_mcore
    from megatron_jf.models.gpt import build_model
    from megatron_jf.models.hf_config import ModelArgs
    from megatron_jf.models.zoo import tiny_hf_model

    hf = tiny_hf_model("qwen2", scale=0.3, seed=1)
    args = ModelArgs.from_hf_dict(hf.config.to_dict())
    m = build_model(args).eval()
    m.load_state_dict(hf_to_mcore(hf.state_dict(), args), strict=False)
    return Engine(m, max_context=64, check_invariants=True, forward_cost=ForwardCost({1: {1: 1.0, 64: 1.0}}))


def test_request_module_does_not_import_torch():
    code = "import sys; from megatron_jf.inference.request import Request, SamplingParams, check; " \
           "print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip() == "False", out.stderr
    from megatron_jf.inference import request, sampling

    assert sampling.SamplingParams is request.SamplingParams  # one class, whichever module names it


@pytest.mark.parametrize("kw,field", [
    ({"max_new_tokens": 0}, "max_new_tokens must be >= 1, got 0"),
    ({"max_new_tokens": 2.0}, "max_new_tokens must be an integer"),
    ({"max_new_tokens": True}, "max_new_tokens must be an integer"),
    ({"stop_strings": ("ok", "")}, "stop_strings must be non-empty strings"),
    ({"stop_strings": (1,)}, "stop_strings must be non-empty strings"),
    ({"stop_strings": 3}, "stop_strings must be a sequence"),
    ({"eos_ids": {-1}}, "eos_ids must be token ids"),
    ({"eos_ids": 5}, "eos_ids must be a set"),
    ({"seed": "7"}, "seed must be an integer"),
    ({"decode": "mr"}, "decode must be a DecodeConfig"),
    ({"sampling": {"temperature": 1}}, "sampling must be a SamplingParams"),
    ({"record_trajectory": 1}, "record_trajectory must be a bool"),
    ({"name": 3}, "name must be a string"),
])
def test_validation_names_the_field(kw, field):
    from megatron_jf.inference.request import Request

    with pytest.raises(ValueError, match=field):
        Request(**kw)


def test_fields_are_normalised_and_frozen():
    from megatron_jf.decoding import DecodeConfig
    from megatron_jf.inference.request import Request, SamplingParams

    r = Request(DecodeConfig("mr"), SamplingParams(0.5, seed=3), 9, ["a", "b"], {2, 1}, record_trajectory=False)
    assert r.stop_strings == ("a", "b") and r.eos_ids == frozenset({1, 2})
    assert Request(stop_strings="\n").stop_strings == ("\n",)  # one string is one stop string, not its characters
    assert r.row_seed == 3 and dataclasses.replace(r, seed=11).row_seed == 11
    assert Request().eos_ids is None  # the caller's default
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.max_new_tokens = 4


def test_check_names_the_prompt_and_the_field():
    from megatron_jf.inference.request import ContextError, Request, check

    r = Request(max_new_tokens=10, name="prompt 3")
    check(r, 54, 64)
    with pytest.raises(ContextError, match="prompt 3 has 55 tokens; with max_new_tokens=10 it exceeds the context "
                                           "window of 64 tokens") as e:
        check(r, 55, 64)
    assert e.value.field == "max_new_tokens"
    with pytest.raises(ContextError) as e:
        check(r, 64, 64)
    assert e.value.field == "prompt"
    with pytest.raises(ContextError, match="prompt 3 is empty"):
        check(r, 0, 64)


def test_request_survives_the_broadcast_unchanged():
    """The TP broadcast pickles the step's op (``broadcast_object_list``); a follower applies what it unpickles."""
    from megatron_jf.decoding import DecodeConfig
    from megatron_jf.inference.request import Request, SamplingParams
    from megatron_jf.server.scheduler import _apply

    r = Request(DecodeConfig("mr", block_size=5, spawn_threshold=0.5), SamplingParams(0.7, 20, 0.9, seed=41), 17,
                ("\n\n", "END"), {0, 7}, seed=43, name="prompt 2")
    op = {"op": "step", "remove": [5], "add": [([3, 1, 4], r)]}
    seen = []
    sess = SimpleNamespace(remove=lambda k: seen.append(("remove", k)),
                           add=lambda p, q: seen.append(("add", p, q)) or 9)
    assert _apply(sess, pickle.loads(pickle.dumps(op))) == [9]
    assert seen[0] == ("remove", 5)
    _, prompt, got = seen[1]
    assert prompt == [3, 1, 4] and got == r and got is not r  # a copy, equal in every field
    assert {f.name: getattr(got, f.name) for f in dataclasses.fields(got)} == \
        {f.name: getattr(r, f.name) for f in dataclasses.fields(r)}
    assert DecodeConfig("mr", block_size=5, spawn_threshold=0.5).label == got.decode.label


def test_generate_request_forms_agree(engine):
    """``generate(prompts, Request)``, ``generate(prompts, [Request, ...])`` and the keyword form decode alike
    (prompt ``i`` of one Request samples with seed ``+ i``); keywords next to a Request are refused."""
    from megatron_jf.decoding import DecodeConfig
    from megatron_jf.inference.request import Request, SamplingParams

    prompts = [[5, 3, 5, 9], [1, 2, 3], [7, 7]]
    cfg, samp = DecodeConfig("jacobi", block_size=4), SamplingParams(0.9, top_k=30, seed=5)
    kw = [r.tokens for r in engine.generate(prompts, cfg, max_new_tokens=12, sampling=samp, eos_ids={3})]
    one = Request(cfg, samp, 12, eos_ids={3})
    assert [r.tokens for r in engine.generate(prompts, one)] == kw
    each = [dataclasses.replace(one, seed=5 + i) for i in range(3)]
    assert [r.tokens for r in engine.generate(prompts, each)] == kw
    assert [r.tokens for r in engine.generate(prompts, each[:1] * 3)] != kw  # the list is used as given
    with pytest.raises(ValueError, match="max_new_tokens given next to a Request"):
        engine.generate(prompts, one, max_new_tokens=5)
    with pytest.raises(ValueError, match="expected 3 Requests"):
        engine.generate(prompts, each[:2])


def test_context_checked_once_per_way_in(engine, monkeypatch):
    """One function checks prompt + max_new_tokens against the context window. Offline it runs once per row (in
    the session's admission); the server's protocol runs it once per prompt (its 400 names the HTTP field), and the
    scheduler does not check again: an over-long request submitted to it directly is refused by the session."""
    from megatron_jf.decoding import DecodeConfig
    from megatron_jf.inference import request as request_mod
    from megatron_jf.inference import slots
    from megatron_jf.inference.request import ContextError, Request
    from megatron_jf.server import protocol
    from megatron_jf.server.scheduler import GenRequest, Scheduler

    assert not hasattr(slots, "check_request") and not hasattr(protocol, "check_request")
    calls = []

    def counting(mod):
        def check(r, n, ctx):
            calls.append((mod, n, r.max_new_tokens, ctx))
            return request_mod.check(r, n, ctx)
        return check

    monkeypatch.setattr(slots, "check", counting("slots"))
    monkeypatch.setattr(protocol, "check", counting("protocol"))
    engine.generate([[1, 2], [3, 4, 5], [6]], DecodeConfig("ar"), max_new_tokens=3)
    assert calls == [("slots", 2, 3, 64), ("slots", 3, 3, 64), ("slots", 1, 3, 64)]
    with pytest.raises(ValueError, match="prompt 1 has 62 tokens; with max_new_tokens=3 it exceeds"):
        engine.generate([[1], [2] * 62], DecodeConfig("ar"), max_new_tokens=3)

    calls.clear()
    tok = SimpleNamespace(vocab_size=engine.vocab_size, decode=lambda ids, **kw: "x", bos_id=None,
                          encode=lambda t: [1] * len(t))
    limits = protocol.Limits(max_context=64)
    p = protocol.parse_completion({"prompt": [1, 2, 3], "max_tokens": 61, "temperature": 0}, tok, limits, "m",
                                  DecodeConfig("ar"))
    assert calls == [("protocol", 3, 61, 64)] and p.requests[0].max_new_tokens == 61
    with pytest.raises(protocol.RequestError, match=r"max_tokens: prompt \(3 tokens\) \+ max_tokens=62 exceeds"):
        protocol.parse_completion({"prompt": [1, 2, 3], "max_tokens": 62}, tok, limits, "m", DecodeConfig("ar"))
    calls.clear()
    protocol.parse_megatron({"prompts": ["ab", "abc"], "tokens_to_generate": 5}, tok, limits, DecodeConfig("ar"))
    assert calls == [("protocol", 2, 5, 64), ("protocol", 3, 5, 64)]

    calls.clear()
    events = []

    class Probe(GenRequest):
        def _emit(self, kind, payload):
            events.append((kind, payload))

    sched = Scheduler(engine, max_batch=2, batch_wait_s=0)
    try:
        sched.submit(Probe(prompt=[1] * 60, request=Request(DecodeConfig("ar"), max_new_tokens=10)))  # not raised
        t0 = time.time()
        while not events and time.time() - t0 < 30:
            time.sleep(0.01)
    finally:
        sched.shutdown()
    assert [k for k, _ in events] == ["error"] and isinstance(events[0][1], ContextError), events
    assert calls == [("slots", 60, 10, 64)]  # the session's admission, once; submit checked nothing


def test_server_path_carries_the_parsed_request_into_the_row(engine, monkeypatch):
    """The Request the protocol parses is the object the session's row keeps (``Row.request``), with the server's
    stop ids, the client's seed (+ prompt index) and the stop strings in it."""
    from megatron_jf.decoding import DecodeConfig
    from megatron_jf.inference.session import BatchSession
    from megatron_jf.server import protocol
    from megatron_jf.server.scheduler import GenRequest, Scheduler

    rows = []
    add = BatchSession.add

    def recording(self, prompt, request):
        key = add(self, prompt, request)
        rows.append(self.slots.pending[-1])
        return key

    monkeypatch.setattr(BatchSession, "add", recording)
    tok = SimpleNamespace(vocab_size=engine.vocab_size, decode=lambda ids, **kw: " ".join(map(str, ids)),
                          bos_id=None, encode=lambda t: [ord(c) % 50 + 1 for c in t])
    p = protocol.parse_megatron({"prompts": ["hello", "hi"], "tokens_to_generate": 6, "temperature": 0.8,
                                 "random_seed": 100, "stop": ["99"], "stop_token": 4,
                                 "jf": {"decoder": "jacobi", "block_size": 3}},
                                tok, protocol.Limits(max_context=64), DecodeConfig("mr"), eos_ids=frozenset({2}))
    assert [r.seed for r in p.requests] == [100, 101] and p.requests[0].sampling.seed == 100
    assert p.requests[0].eos_ids == {2, 4} and p.requests[0].stop_strings == ("99",)
    assert p.requests[0].decode == DecodeConfig("jacobi", block_size=3) and p.decode.label == \
        "Jacobi (n=3)"
    done = []

    class Probe(GenRequest):
        def _emit(self, kind, payload):
            if kind != "tokens":
                done.append((self.id, kind))

    sched = Scheduler(engine, tok.decode, max_batch=4, batch_wait_s=0.05)
    try:
        reqs = [sched.submit(Probe(prompt=ids, request=r)) for ids, r in zip(p.prompts, p.requests)]
        t0 = time.time()
        while len(done) < 2 and time.time() - t0 < 60:
            time.sleep(0.01)
    finally:
        sched.shutdown()
    assert sorted(k for _, k in done) == ["done", "done"], done
    assert len(rows) == 2
    by_prompt = {tuple(r.prompt): r for r in rows}
    for g in reqs:
        assert by_prompt[tuple(g.prompt)].request is g.request  # the parsed object, unchanged
