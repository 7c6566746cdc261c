"""Under torchrun x2 at TP=2: one training step with each activation-recomputation mode against none.

Usage: torchrun --nproc_per_node 2 tests/dist/recompute_tp.py WORKDIR
Prints ``RESULT {"config", "mode", "rank", "loss", "ref_loss", "grad_rel", "peak", "ref_peak"}`` (JSON) for each
rank, from rank 0: ``grad_rel`` is the largest relative difference of this rank's gradient shards from the run without
recomputation (max |g - g_ref| / max |g_ref| per tensor); ``peak`` the peak saved activation bytes.
"""
import os
import sys
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main():
    import torch.distributed as dist

    import pretrain_jf
    from megatron_jf import parallel
    from megatron_jf.training.trainer import Trainer
    from train_fixtures import (PARALLEL_CONFIGS, RECOMPUTE_MODES, hf_weights_provider, measured_step,
                                parallel_config, print_results)

    work = sys.argv[1]
    for name in PARALLEL_CONFIGS:
        ref = None
        for mode, kw in [("none", {})] + list(RECOMPUTE_MODES.items()):
            cfg = parallel_config(work, name, tp=2, train_steps=1, **kw)
            tr = Trainer(cfg, hf_weights_provider(os.path.join(work, "hf")), partial(pretrain_jf.forward_step, cfg=cfg),
                         pretrain_jf.train_valid_datasets_provider)
            m, grads, peak = measured_step(tr)
            if ref is None:
                ref = (m["loss"], grads, peak)
                continue
            rel = max(float((g - ref[1][n]).abs().max() / ref[1][n].abs().max().clamp_min(1e-30))
                      for n, g in grads.items())
            assert grads.keys() == ref[1].keys()
            rec = {"config": name, "mode": mode, "rank": dist.get_rank(), "loss": m["loss"], "ref_loss": ref[0],
                   "grad_rel": rel, "peak": peak, "ref_peak": ref[2]}
            print_results(rec)
    parallel.destroy()


if __name__ == "__main__":
    main()
