"""Shared helpers of the server tests: a real uvicorn server on 127.0.0.1 over the tiny checkpoint."""
import json
import os
import socket
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_CTX = 256


def free_port() -> int:
    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        return so.getsockname()[1]


def wait_health(url, timeout, proc=None):
    import httpx

    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"server at {url} did not come up in {timeout}s")


class Served:
    """A running server: ``url``, ``tok``, ``engine``, ``sched``, ``metrics``, ``ckpt``, ``margs``,
    ``stop_ids``; :meth:`close` stops it."""

    def close(self):
        self.server.should_exit = True
        self.thread.join(10)
        self.sched.shutdown()


def serve(root: str, *, sched_kw=None, app_kw=None, default=None, engine=None) -> Served:
    """Build (once) the tiny checkpoint under ``root`` and serve it like the CLI does (one stop set from
    tokenizer + checkpoint), in a background thread."""
    import uvicorn

    from megatron_jf.checkpointing import load_model, tokenizer_path
    from megatron_jf.decoding.width import ForwardCost
    from megatron_jf.inference.engine import DecodeConfig, Engine
    from megatron_jf.server.app import create_app
    from megatron_jf.server.metrics import Metrics
    from megatron_jf.server.scheduler import Scheduler
    from megatron_jf.models.zoo import build_tiny_checkpoint
    from megatron_jf.tokenizer import load_tokenizer, stop_token_ids

    ckpt = build_tiny_checkpoint(root, max_pos=MAX_CTX, in_process=True)
    s = Served()
    s.ckpt = ckpt
    s.tok = load_tokenizer(tokenizer_path(ckpt))
    model, s.margs, _ = load_model(ckpt)
    # a given cost table (wide forwards free, no step calibration): the width choice of auto rows then depends on
    # the tokens only, so a server run and its offline reference draft alike (their forwards are compared)
    s.engine = engine or Engine(model, forward_cost=ForwardCost({1: {1: 1.0, 64: 1.0}}))
    s.metrics = Metrics("tiny")
    s.stop_ids = stop_token_ids(s.tok, s.margs, ckpt)
    s.sched = Scheduler(s.engine, s.tok.decode, metrics=s.metrics, **{"max_batch": 32, "max_queue": 64,
                                                                     "batch_wait_s": 0.01, **(sched_kw or {})})
    app = create_app(s.sched, s.tok, model_name="tiny", default_config=default or DecodeConfig("mr", block_size=8),
                     metrics=s.metrics, stop_ids=s.stop_ids, **(app_kw or {}))
    port = free_port()
    s.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    s.thread = threading.Thread(target=s.server.run, daemon=True)
    s.thread.start()
    s.url = f"http://127.0.0.1:{port}"
    wait_health(s.url, 30)
    return s


def offline(s: Served, prompt_ids, jf, max_new, stop=(), sampling=None):
    """Offline ``Engine.generate`` of one prompt with the server's stop set."""
    from megatron_jf.inference.engine import DecodeConfig
    from megatron_jf.inference.sampling import SamplingParams

    return s.engine.generate([prompt_ids], DecodeConfig(**jf), max_new_tokens=max_new, eos_ids=s.stop_ids,
                             sampling=sampling or SamplingParams(), stop_strings=tuple(stop),
                             detokenize=s.tok.decode if stop else None)[0]


def text_of(s: Served, prompt_ids, tokens, tail=""):
    from megatron_jf.tokenizer import IncrementalDecoder

    d = IncrementalDecoder(s.tok, prompt_ids)
    return d.push(tokens) + d.flush() + tail


def sse(lines):
    """Parse SSE lines into JSON events; assert the stream ends with [DONE]."""
    events, done = [], False
    for line in lines:
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line[len("data: "):]
        assert not done, "event after [DONE]"
        if data == "[DONE]":
            done = True
            continue
        events.append(json.loads(data))
    assert done
    return events


def metric_samples(text: str) -> dict:
    """``/metrics`` text parsed with prometheus_client's parser: ``{(sample name, sorted labels): value}``."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(text):
        for x in fam.samples:
            out[(x.name, tuple(sorted(x.labels.items())))] = x.value
    return out
