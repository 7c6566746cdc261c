"""Under torchrun x2: tools/generate_trajectories.py data-parallel (tp=1, 2 DP ranks) and tensor-parallel
(tp=2, 1 DP rank) in one launch.

Usage: torchrun --nproc_per_node 2 tests/dist/collect_2ranks.py CKPT PROMPTS OUT_DP OUT_TP
Prints "DONE <rank>" on each rank at the end.
"""
import sys


def main():
    ckpt, prompts, out_dp, out_tp = sys.argv[1:5]
    from megatron_jf import parallel

    parallel.initialize(1, 1)  # the process group outlives both tool runs
    from megatron_jf.commands import collect as tool
    common = ["--prompts", prompts, "--load", ckpt, "--block-size", "4", "--max-new-tokens", "16",
              "--batch-size", "3", "--draft-init", "repeat", "--max-records-per-shard", "2", "--no-filter",
              "--no-progress"]
    tool.main(common + ["--out", out_dp, "--tp", "1"])
    tool.main(common + ["--out", out_tp, "--tp", "2"])
    import torch.distributed as dist

    print(f"DONE {dist.get_rank()}", flush=True)
    parallel.destroy()


if __name__ == "__main__":
    main()
