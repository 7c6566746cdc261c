"""Under torchrun x2: 3 steps of CPU bf16 training (autocast, fp32 master weights) at TP=2, PP=2 and DP=2 from the
weights and data of WORKDIR (tests/test_precision.py prepares it and runs the single-process reference).

Usage: MEGATRON_JF_CPU_BF16=1 torchrun --nproc_per_node 2 tests/dist/train_bf16_layouts.py WORKDIR
Prints ``RESULT {"layout", "loss", "grad_norm"}`` lines (JSON) on global rank 0.
"""
import json
import os
import sys
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main():
    import torch.distributed as dist

    import pretrain_jf
    from megatron_jf import parallel
    from megatron_jf.training.trainer import Trainer
    from train_fixtures import hf_weights_provider, parallel_config

    work = sys.argv[1]
    for layout, tp, pp in (("tp2", 2, 1), ("pp2", 1, 2), ("dp2", 1, 1)):
        cfg = parallel_config(work, "two_stream_kl", tp=tp, pp=pp, precision="bf16")
        hist = Trainer(cfg, hf_weights_provider(os.path.join(work, "hf")), partial(pretrain_jf.forward_step, cfg=cfg),
                       pretrain_jf.train_valid_datasets_provider).train()
        if dist.get_rank() == 0:
            print("RESULT " + json.dumps({"layout": layout, "loss": [h["loss"] for h in hist],
                                          "grad_norm": [h["grad norm"] for h in hist]}), flush=True)
    parallel.destroy()


if __name__ == "__main__":
    main()
