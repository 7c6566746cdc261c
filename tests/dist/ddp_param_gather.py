"""Under torchrun x2 (DP=2, gloo): megatron-core DDP with the distributed optimizer's buffer layout and both overlaps
(``--overlap-grad-reduce --overlap-param-gather``, small buckets), an untied model, three ``forward_loss_rows`` steps:
the losses and weights equal the same run without overlaps (issue 21 item 1).

megatron's ``DistributedOptimizer`` allocates on CUDA, so its step is written out here as what it does to the DDP
buffers: each rank updates its shard of every bucket's ``param_data`` from the same shard of the reduce-scattered
``grad_data`` (plain SGD), then the parameters are all-gathered -- synchronously without ``--overlap-param-gather``
(``start_param_sync``), else by the forward pre-hooks of the next forward, exactly as megatron's optimizer leaves it.

Usage: torchrun --nproc_per_node 2 tests/dist/ddp_param_gather.py
Prints, from rank 0, ``RESULT {"rank", "losses", "ref_losses", "max_weight_diff", "buckets", "output_layer_alone",
"moved"}`` per rank (``moved``: the largest change of any weight over the run, so equal weights mean something).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

LR = 0.5
STEPS = 3


def run(overlap: bool, hf, rank: int, dp: int):
    import torch
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.distributed.param_and_grad_buffer import shard_buffer

    from megatron_jf.training.config import parse_config
    from megatron_jf.training.config import JFObjective
    from megatron_jf.training.optim import megatron_ddp_config
    from megatron_jf.training.output_head import forward_loss_rows, head_loss, output_weight
    from loss_rows_tp import batch_for, build

    model, args = build(hf, False)
    flags = ["--data", "x", "--train-steps", "1", "--block-size", "4", "--hf-config", "x",
             "--use-distributed-optimizer"]
    if overlap:
        flags += ["--overlap-grad-reduce", "--overlap-param-gather", "--ddp-bucket-size", "4000"]
    ddp = DistributedDataParallel(config=model.config, ddp_config=megatron_ddp_config(parse_config(flags)),
                                  module=model)
    cfg = JFObjective()
    losses = []
    for step in range(STEPS):
        batch = batch_for("two_stream")
        g = torch.Generator().manual_seed(1000 * step + rank)  # each DP rank its own tokens
        batch.tokens = torch.randint(0, args.vocab_size, batch.tokens.shape, generator=g)
        ddp.zero_grad_buffer()
        loss, _ = head_loss(forward_loss_rows(ddp, batch), output_weight(ddp), batch, cfg, args.vocab_size)
        loss.backward()
        ddp.finish_grad_sync()
        both = torch.tensor([loss.item()], dtype=torch.float64)
        torch.distributed.all_reduce(both)
        losses.append(float(both) / dp)
        with torch.no_grad():  # the distributed optimizer's step on this rank's shard of each bucket
            for buf in ddp.buffers:
                for b in buf.buckets:
                    shard_buffer(b.param_data, dp)[rank].add_(shard_buffer(b.grad_data, dp)[rank], alpha=-LR)
        if not overlap:
            ddp.start_param_sync()  # synchronous all-gather (megatron's optimizer does this without the overlap)
    if overlap:
        ddp.start_param_sync(force_sync=True)  # finish the gather the next forward would do (as before a save)
    layout = {"buckets": sum(len(b.buckets) for b in ddp.buffers),
              "output_layer_alone": any([p for p in b.params_list] == [model.output_layer.weight]
                                        for buf in ddp.buffers for b in buf.buckets)}
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, layout


def main():
    import torch.distributed as dist

    from megatron_jf import parallel
    from megatron_jf.models.zoo import tiny_hf_model
    from loss_rows_tp import build
    from train_fixtures import print_results

    parallel.initialize(1, 1)
    rank, dp = dist.get_rank(), dist.get_world_size()
    hf = tiny_hf_model("qwen2", seed=3, vocab=255, tied=False)  # untied output layer, like Qwen2.5-7B
    start = {n: p.detach().clone() for n, p in build(hf, False)[0].named_parameters()}
    ref_losses, ref_w, _ = run(False, hf, rank, dp)
    losses, w, layout = run(True, hf, rank, dp)
    rec = {"rank": rank, "losses": losses, "ref_losses": ref_losses,
           "max_weight_diff": max(float((w[n] - ref_w[n]).abs().max()) for n in w),
           "moved": max(float((ref_w[n] - start[n]).abs().max()) for n in w), **layout}
    print_results(rec)
    parallel.destroy()


if __name__ == "__main__":
    main()
