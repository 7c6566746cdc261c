"""Under torchrun x2 at TP=2: every decoder's greedy output equals the TP=1 reference (transformers greedy)."""
import torch


def main():
    from megatron.core import parallel_state as ps

    from megatron_jf import parallel
    from megatron_jf.inference.engine import DecodeConfig, Engine
    from megatron_jf.models.convert import hf_to_mcore
    from megatron_jf.inference.forward import forward_logits
    from megatron_jf.models.gpt import build_model, new_kv_cache
    from megatron_jf.models.hf_config import ModelArgs
    from megatron_jf.models.zoo import peaked_hf_model

    parallel.initialize(2, 1)
    parallel.set_seed(0)
    hf = peaked_hf_model("qwen2", period=4, seed=5)
    args = ModelArgs.from_hf_dict(hf.config.to_dict())
    m = build_model(args).eval()
    m.load_state_dict(hf_to_mcore(hf.state_dict(), args, tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=2),
                      strict=False)
    eng = Engine(m, check_invariants=True)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (L,), generator=g).tolist() for L in (2, 13)]
    prompts[1][4] = 0  # token 0 inside a prompt: the reference must not mistake it for padding
    # explicit attention_mask: with pad_token_id=0 and no mask, generate() hides every prompt token 0
    ref = [hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long), max_new_tokens=30,
                       do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    # the lean inference forward (TP shards + all-reduce/all-gather) equals megatron-core's forward at TP=2
    toks = torch.randint(0, 256, (2, 9), generator=g)
    pos = torch.arange(9).expand(2, 9)
    lean = forward_logits(m, toks, pos, impl="lean")
    meg = forward_logits(m, toks, pos, impl="megatron")
    step_ok = True
    for impl in ("lean", "megatron"):  # a cached one-row step (transposed-weight path) against uncached
        cache = new_kv_cache(m, 2, 16)
        forward_logits(m, toks[:, :8], pos[:, :8], kv_cache=cache, return_logits=False, impl=impl)
        cache.commit([8, 8])
        one = forward_logits(m, toks[:, 8:], pos[:, 8:], kv_cache=cache, impl=impl)
        step_ok &= bool(torch.allclose(one[:, 0], meg[:, 8], rtol=1e-5, atol=1e-5))
    ok = bool(torch.allclose(lean, meg, rtol=1e-5, atol=1e-5)) and step_ok
    ok &= bool(torch.allclose(lean, hf(toks).logits, rtol=1e-4, atol=1e-4))
    if parallel.is_rank0():
        print(f"DECODE lean-forward-parity max|lean-megatron|={(lean - meg).abs().max():.2e} {'OK' if ok else 'MISMATCH'}",
              flush=True)
    for cfg in (DecodeConfig("ar"), DecodeConfig("jacobi", block_size=8), DecodeConfig("running-window", block_size=8),
                DecodeConfig("mr", block_size=8, num_blocks=2, verification_size=3)):
        out = eng.generate(prompts, cfg, max_new_tokens=30)
        ok = all(o.tokens == r for o, r in zip(out, ref))
        if parallel.is_rank0():
            print(f"DECODE {cfg.decoder} {'OK' if ok else 'MISMATCH'}", flush=True)
    # ranks whose steps take different times keep the same step calibration (so they choose the same draft widths):
    # rank 1's clock runs 3x fast in the session, its steps look 3x as long; both ranks record the slowest time
    import time

    import megatron_jf.inference.session as session

    skew = 3.0 if ps.get_tensor_model_parallel_rank() == 1 else 1.0
    session.time = type("SkewedClock", (), {"perf_counter": staticmethod(lambda: skew * time.perf_counter())})
    try:
        eng2 = Engine(m)
        out = eng2.generate(prompts, DecodeConfig("mr", block_size=8, num_blocks=2), max_new_tokens=30)
    finally:
        session.time = time
    cal = eng2.step_calibration
    mine = (cal.steps, sorted((k, [(round(r, 9), t) for r, t, _ in v]) for k, v in cal._steps.items()))
    both = [None, None]
    torch.distributed.all_gather_object(both, mine, group=ps.get_tensor_model_parallel_group())
    ok = all(o.tokens == r for o, r in zip(out, ref)) and mine[0] > 0 and both[0] == both[1]
    if parallel.is_rank0():
        print(f"DECODE skewed-clock calibration ({both[0][0]} steps) {'OK' if ok else 'MISMATCH'}", flush=True)
    parallel.destroy()


if __name__ == "__main__":
    main()
