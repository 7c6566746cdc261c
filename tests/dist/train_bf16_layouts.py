"""Under torchrun x2: 3 steps of CPU bf16 training (autocast, fp32 master weights) at TP=2, PP=2 and DP=2 from the
weights and data of WORKDIR (tests/test_precision.py prepares it and runs the single-process reference).

Usage: MEGATRON_JF_CPU_BF16=1 torchrun --nproc_per_node 2 tests/dist/train_bf16_layouts.py WORKDIR
Prints ``RESULT {"layout", "loss", "grad_norm"}`` lines (JSON) on global rank 0.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main():
    from megatron_jf import parallel
    from train_fixtures import train_and_report

    for layout, tp, pp in (("tp2", 2, 1), ("pp2", 1, 2), ("dp2", 1, 1)):
        train_and_report(sys.argv[1], layout, "two_stream_kl", tp=tp, pp=pp, precision="bf16")
    parallel.destroy()


if __name__ == "__main__":
    main()
