"""Under torchrun x2: train 3 steps at TP=2, then PP=2 (each microbatch its own row length, then every row
padded to --seq-length), then DP=2 from identical weights and data.

Usage: torchrun --nproc_per_node 2 tests/dist/train_parallel.py WORKDIR
Prints ``RESULT {"layout", "config", "loss", "grad_norm"}`` lines (JSON) on global rank 0; the test
compares them with a single-process run of the same configurations.
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
    from train_fixtures import PARALLEL_CONFIGS, hf_weights_provider, parallel_config

    work = sys.argv[1]
    for layout, (tp, pp, over) in (("tp2", (2, 1, {})), ("pp2", (1, 2, {})),
                                   ("pp2_fixed", (1, 2, {"variable_seq_lengths": False, "seq_length": 64})),
                                   ("dp2", (1, 1, {}))):
        for name in PARALLEL_CONFIGS:
            cfg = parallel_config(work, name, tp=tp, pp=pp, **over)
            tr = Trainer(cfg, hf_weights_provider(os.path.join(work, "hf")), partial(pretrain_jf.forward_step, cfg=cfg),
                         pretrain_jf.train_valid_datasets_provider)
            hist = tr.train()
            if dist.get_rank() == 0:
                print("RESULT " + json.dumps({"layout": layout, "config": name, "loss": [h["loss"] for h in hist],
                                              "grad_norm": [h["grad norm"] for h in hist],
                                              "torch_ddp": tr.torch_ddp,
                                              "variable_seq_lengths": tr.module.config.variable_seq_lengths}),
                      flush=True)
    parallel.destroy()


if __name__ == "__main__":
    main()
