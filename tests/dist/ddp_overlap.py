"""Under torchrun x2 (DP=2, gloo): megatron-core DDP built from the trainer's ``megatron_ddp_config`` averages the
same gradients with ``--overlap-grad-reduce`` (bucket reduces dispatched during the backward, several buckets via
``--ddp-bucket-size``) as without it, and as a plain all-reduce of per-rank gradients; with
``--use-distributed-optimizer`` (reduce-scatter) each rank's shard holds the same average.

Usage: torchrun --nproc_per_node 2 tests/dist/ddp_overlap.py
Prints ``RESULT {"flags", "rank", "rel", "local_rel", "buckets", "overlap"}`` (JSON, for both ranks, from rank 0):
``rel`` = max relative difference of the averaged gradients from the reference, per tensor; ``local_rel`` the
same for this rank's own (unreduced) gradient, so a missing reduction would show.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _shard_rel(ddp, model, ref, rank, dp):
    """Distributed optimizer: the gradients are reduce-scattered, so only this rank's shard of every bucket holds
    the average. Compare that shard with the same shard of a bucket filled from the reference gradients."""
    import torch
    from megatron.core.distributed.param_and_grad_buffer import shard_buffer

    name = {p: n for n, p in model.named_parameters()}
    worst = 0.0
    for buf in ddp.buffers:
        for b in buf.buckets:
            want = torch.zeros_like(b.grad_data)
            for p in b.params_list:
                s, e = b.param_to_index[p]
                want[s:e] = ref[name[p]].flatten().to(want.dtype)
            got, exp = shard_buffer(b.grad_data, dp)[rank], shard_buffer(want, dp)[rank]
            worst = max(worst, float((got - exp).abs().max() / exp.abs().max().clamp_min(1e-30)))
    return worst


def main():
    import torch
    import torch.distributed as dist
    from megatron.core.distributed import DistributedDataParallel

    from megatron_jf import parallel
    from megatron_jf.training.config import parse_config
    from megatron_jf.training.optim import megatron_ddp_config
    from train_fixtures import print_results, tiny_mcore_model

    parallel.initialize(1, 1)
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(100 + rank)  # each DP rank its own data
    tok = torch.randint(0, 200, (2, 16), generator=g)
    pos = torch.arange(16).expand(2, 16)

    def loss_of(m):
        return m(tok, pos, None).float().logsumexp(-1).mean()

    parallel.set_seed(0)
    ref_model, _ = tiny_mcore_model(seed=0, layers=2)
    loss_of(ref_model).backward()
    ref, local = {}, {}
    for n, p in ref_model.named_parameters():
        local[n] = p.grad.detach().clone()
        gr = p.grad.detach().clone()
        dist.all_reduce(gr)
        ref[n] = gr / dist.get_world_size()

    base = ["--data", "x", "--train-steps", "1", "--block-size", "4", "--hf-config", "x"]
    for flags in ([], ["--overlap-grad-reduce"], ["--overlap-grad-reduce", "--ddp-bucket-size", "4000"],
                  ["--use-distributed-optimizer"],
                  ["--use-distributed-optimizer", "--overlap-grad-reduce", "--ddp-bucket-size", "4000"]):
        parallel.set_seed(0)
        model, _ = tiny_mcore_model(seed=0, layers=2)
        ddp = DistributedDataParallel(config=model.config, ddp_config=megatron_ddp_config(parse_config(base + flags)),
                                      module=model)
        ddp.zero_grad_buffer()
        loss_of(ddp).backward()
        ddp.finish_grad_sync()
        if ddp.ddp_config.use_distributed_optimizer:
            rel = _shard_rel(ddp, model, ref, rank, dist.get_world_size())
        else:
            rel = max(float((p.main_grad - ref[n]).abs().max() / ref[n].abs().max().clamp_min(1e-30))
                      for n, p in model.named_parameters())
        buckets = sum(len(b.buckets) for b in ddp.buffers)
        local_rel = max(float((local[n] - ref[n]).abs().max() / ref[n].abs().max().clamp_min(1e-30)) for n in ref)
        rec = {"flags": " ".join(flags), "rank": rank, "rel": rel, "buckets": buckets, "local_rel": local_rel,
               "overlap": ddp.ddp_config.overlap_grad_reduce}
        print_results(rec)
    parallel.destroy()


if __name__ == "__main__":
    main()
