"""Under torchrun x2: the JF loss and every gradient at TP=2, with and without sequence parallelism,
equal the TP=1 full-row reference (output layer over every row, then ``jf_loss``).

Usage: torchrun --nproc_per_node 2 tests/dist/loss_rows_tp.py WORKDIR
For each attention path (two-stream ``nc``, dense ``nc_ic``, packed THD ``nc``) prints on global rank 0 three lines
``PARITY <path>/<case> <loss rel diff> <max grad diff / max grad>`` for the cases ``tp2`` (loss-row head,
chunked loss), ``tp2_sp`` (the same with ``--sequence-parallel``) and ``tp2_sp_fullrow`` (today's full-row
head under sequence parallelism). The vocabulary (255) is padded to 256 at TP=2, so the padding column
is exercised. Then the trainer (``pretrain_jf.forward_step``, torch AdamW, clipping active) runs 3 steps at
TP=2 with and without ``--sequence-parallel`` for each of the parallel-test configurations and prints
``TRAIN <config> <max loss rel diff> <max grad-norm rel diff>``.
"""
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

VOCAB = 255
PATHS = {"two_stream": ("nc", "kl", "paper"), "dense": ("nc_ic", "soft_ce", "reference"), "packed": ("nc", "kl", "paper")}


def build(hf, sequence_parallel):
    from megatron.core import parallel_state as ps

    from megatron_jf.models.convert import hf_to_mcore
    from megatron_jf.models.gpt import build_model
    from megatron_jf.models.hf_config import ModelArgs

    args = ModelArgs.from_hf_dict(hf.config.to_dict())
    model = build_model(args, sequence_parallel=sequence_parallel)
    sd = hf_to_mcore(hf.state_dict(), args, tp_rank=ps.get_tensor_model_parallel_rank(),
                     tp_size=ps.get_tensor_model_parallel_world_size())
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not [k for k in missing if "extra_state" not in k] and not unexpected, (missing, unexpected)
    return model, args


def batch_for(path):
    from train_fixtures import make_record

    from megatron_jf.data.packing import pack_record
    from megatron_jf.training.attention_paths import build_jf_batch

    recs = [make_record(40 + i, prompt_len=5 + 3 * i, block_size=4, num_blocks=3, vocab=VOCAB,
                        last_block_len=3 if i else None) for i in range(2)]
    mask = PATHS[path][0]
    return build_jf_batch([pack_record(r, "progressive", 3) for r in recs], path=path, mask=mask, window_size=2,
                          pad_to_multiple_of=8)


def step(model, args, batch, cfg, head):
    """One forward + backward; returns (loss, HF-named gradients merged over the TP group)."""
    from megatron.core import parallel_state as ps

    from megatron_jf.models.convert import mcore_to_hf
    from megatron_jf.training.attention_paths import forward_model, gather_jf_logits
    from megatron_jf.training.losses import jf_loss
    from megatron_jf.models.gpt import unwrap
    from megatron_jf.training.optim import allreduce_sequence_parallel_grads
    from megatron_jf.training.output_head import forward_loss_rows, head_loss, output_weight

    model.zero_grad(set_to_none=True)
    if head == "rows":
        loss, _ = head_loss(forward_loss_rows(model, batch), output_weight(model), batch, cfg, args.vocab_size,
                            chunk_size=5)
    else:
        loss, _ = jf_loss(gather_jf_logits(forward_model(model, batch), batch, args.vocab_size), cfg)
    loss.backward()
    allreduce_sequence_parallel_grads(unwrap(model))
    grads = {n: p.grad.detach().clone() for n, p in model.state_dict(keep_vars=True).items()
             if isinstance(p, torch.nn.Parameter)}
    tp = ps.get_tensor_model_parallel_world_size()
    shards = [None] * tp
    dist.all_gather_object(shards, grads, group=ps.get_tensor_model_parallel_group())
    return loss.item(), mcore_to_hf([shards], args)


def main():
    from megatron_jf import parallel
    from megatron_jf.models.zoo import tiny_hf_model
    from megatron_jf.training.config import JFObjective

    hf = tiny_hf_model("qwen2", seed=9, vocab=VOCAB, layers=2)
    parallel.initialize(1, 1)
    parallel.set_seed(0)
    ref = {}
    for path, (_, kind, norm) in PATHS.items():
        cfg = JFObjective(consistency_loss=kind, pc_normalization=norm, ar_weight=0.5)
        model, args = build(hf, False)
        ref[path] = step(model, args, batch_for(path), cfg, "full")
    parallel.initialize(2, 1)
    parallel.set_seed(0)
    for path, (_, kind, norm) in PATHS.items():
        cfg = JFObjective(consistency_loss=kind, pc_normalization=norm, ar_weight=0.5)
        l0, g0 = ref[path]
        for case, sp, head in (("tp2", False, "rows"), ("tp2_sp", True, "rows"), ("tp2_sp_fullrow", True, "full")):
            model, args = build(hf, sp)
            assert model.config.sequence_parallel == sp
            loss, g = step(model, args, batch_for(path), cfg, head)
            assert set(g) == set(g0), (set(g) ^ set(g0))
            worst = max((g[k] - g0[k]).abs().max().item() / max(g0[k].abs().max().item(), 1e-6) for k in g0)
            if dist.get_rank() == 0:
                print(f"PARITY {path}/{case} {abs(loss - l0) / abs(l0):.3e} {worst:.3e}", flush=True)
    train_phase(sys.argv[1])
    parallel.destroy()


def sp_weights_provider(hf_dir):
    """``hf_weights_provider`` of the parallel tests, building the model with the run's --sequence-parallel."""
    from transformers import AutoModelForCausalLM

    def provider(model_args, cfg):
        hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
        hf.config.vocab_size = model_args.vocab_size
        return build(hf, cfg.parallel.sequence_parallel)[0]

    return provider


def train_phase(work):
    from functools import partial

    from train_fixtures import PARALLEL_CONFIGS, make_record, parallel_config, write_shards

    import pretrain_jf
    from megatron_jf.models.zoo import save_tiny_hf
    from megatron_jf.training.trainer import Trainer

    if dist.get_rank() == 0:
        save_tiny_hf(os.path.join(work, "hf"), "qwen2", seed=5, vocab=VOCAB, layers=2, tied=True, max_pos=128)
        recs = [make_record(100 + i, prompt_len=4 + i % 3, block_size=4, num_blocks=3, vocab=VOCAB,
                            last_block_len=3 if i % 4 == 1 else None) for i in range(8)]
        write_shards(os.path.join(work, "train"), recs, per_shard=3)
    dist.barrier()
    for name in PARALLEL_CONFIGS:
        hist = {}
        for sp in (False, True):
            cfg = parallel_config(work, name, tp=2, sequence_parallel=sp)
            tr = Trainer(cfg, sp_weights_provider(os.path.join(work, "hf")), partial(pretrain_jf.forward_step, cfg=cfg),
                         pretrain_jf.train_valid_datasets_provider)
            assert tr.module.config.sequence_parallel == sp
            hist[sp] = tr.train()
        a, b = hist[False], hist[True]
        dl = max(abs(x["loss"] - y["loss"]) / abs(x["loss"]) for x, y in zip(a, b))
        dg = max(abs(x["grad norm"] - y["grad norm"]) / x["grad norm"] for x, y in zip(a, b))
        if dist.get_rank() == 0:
            print(f"TRAIN {name} {dl:.3e} {dg:.3e} steps={len(a)}", flush=True)


if __name__ == "__main__":
    main()
