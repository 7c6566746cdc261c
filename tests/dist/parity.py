"""Under torchrun x2: logits of the converted megatron model at TP=2 or PP=2 equal transformers' logits.

Usage: torchrun --nproc_per_node 2 tests/dist/parity.py {tp|pp} FAMILY:TIED [FAMILY:TIED ...]
e.g. ``tp qwen2:untied llama:tied``. Prints "PARITY <case> <max abs diff>" on the rank holding the logits.
"""
import sys

import torch


def main():
    mode, cases = sys.argv[1], sys.argv[2:]
    from megatron_jf import parallel

    tp, pp = (2, 1) if mode == "tp" else (1, 2)
    parallel.initialize(tp, pp)
    parallel.set_seed(0)
    for case in cases:
        family, tied = case.split(":")
        run_case(mode, case, family, tied == "tied", tp, pp)
    parallel.destroy()


def run_case(mode, case, family, tied, tp, pp):
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_jf.models.convert import hf_to_mcore
    from megatron_jf.inference.forward import forward_logits
    from megatron_jf.models.gpt import build_model
    from megatron_jf.models.hf_config import ModelArgs
    from megatron_jf.models.zoo import tiny_hf_model

    hf = tiny_hf_model(family, tied=tied, layers=4)
    args = ModelArgs.from_hf_dict(hf.config.to_dict())
    model = build_model(args).eval()
    sd = hf_to_mcore(hf.state_dict(), args, tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=tp,
                     pp_rank=ps.get_pipeline_model_parallel_rank(), pp_size=pp)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not [k for k in missing if "extra_state" not in k] and not unexpected, (missing, unexpected)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, args.vocab_size, (2, 10), generator=g)
    # offset and non-monotonic positions (a packed noisy/clean layout reuses positions)
    pos = torch.tensor([[100, 101, 102, 103, 104, 105, 106, 107, 108, 109],
                        [0, 1, 2, 3, 4, 5, 3, 4, 5, 6]])
    with torch.no_grad():
        ref = torch.stack([hf(tokens[i:i + 1], position_ids=pos[i:i + 1]).logits[0] for i in range(2)])
    if mode == "tp":
        out = forward_logits(model, tokens, pos)
        if ps.get_tensor_model_parallel_rank() == 0:  # one writer: two ranks' lines can interleave on stdout
            print(f"PARITY {case} {(out - ref).abs().max().item():.3e}", flush=True)
    else:
        config = model.config
        config.variable_seq_lengths = False
        def forward_step(data_iter, m):
            t, p = next(data_iter)
            out = m(t, p, None, runtime_gather_output=True)
            return out, lambda o: (o.sum() * 0.0, {"logits": o.detach()})
        fwd = get_forward_backward_func()
        res = fwd(forward_step_func=forward_step, data_iterator=iter([(tokens, pos)]), model=[model],
                  num_microbatches=1, seq_length=10, micro_batch_size=2, forward_only=True)
        if ps.is_pipeline_last_stage():
            out = res[0]["logits"][..., : args.vocab_size]
            print(f"PARITY {case} {(out - ref).abs().max().item():.3e}", flush=True)


if __name__ == "__main__":
    main()
