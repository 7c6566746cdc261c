"""Shared helpers for the training tests: hand-made trajectory records and tiny real models.

Records are built by hand (no model): each block's fixed point is random, and its Jacobi states
converge left to right (state ``s`` of ``S`` has its first ``round(s * n / S)`` tokens correct and
random tokens after them), which is the shape real greedy trajectories have.
"""

from __future__ import annotations

import os

import torch


def make_record(seed: int, *, prompt_len: int = 5, block_size: int = 4, num_blocks: int = 3, vocab: int = 256,
                num_states: int = 4, last_block_len: int | None = None, sample_id: str | None = None):
    """A valid :class:`~megatron_jf.data.trajectory.TrajectoryRecord` (ids in ``[0, vocab - 1)``)."""
    from megatron_jf.data.trajectory import BlockTrajectory, TrajectoryRecord

    g = torch.Generator().manual_seed(seed)
    hi = vocab - 1  # keep clear of the tiny models' EOS (vocab - 1)
    prompt = torch.randint(0, hi, (prompt_len,), generator=g)
    blocks, ctx = [], prompt_len
    for i in range(num_blocks):
        n = block_size if (i < num_blocks - 1 or last_block_len is None) else last_block_len
        fp = torch.randint(0, hi, (n,), generator=g)
        states = []
        for s in range(num_states):
            k = round(s * n / num_states)
            d = torch.randint(0, hi, (n,), generator=g)
            d[:k] = fp[:k]
            states.append(d)
        blocks.append(BlockTrajectory(context_len=ctx, drafts=torch.stack(states), fixed_point=fp))
        ctx += n
    rec = TrajectoryRecord(sample_id=sample_id or f"rec{seed}", prompt_ids=prompt, blocks=blocks,
                           block_size=block_size, eos_reached=False)
    return rec.validate()


def write_shards(directory: str, records, *, per_shard: int = 4, prefix: str = "traj") -> str:
    """Write ``records`` as trajectory shards (+ manifest) into ``directory``; returns it."""
    from megatron_jf.data.shards import TrajectoryShardWriter

    with TrajectoryShardWriter(directory, prefix=prefix, max_records_per_shard=per_shard) as w:
        for r in records:
            w.write(r)
    w.write_manifest(model="hand-made", tokenizer="none")
    return directory


def tiny_mcore_model(seed: int = 0, layers: int = 2, **kw):
    """A converted tiny random Qwen2 (megatron-core, this rank's TP/PP shard) and its ModelArgs."""
    from megatron.core import parallel_state as ps

    from megatron_jf.models.convert import hf_to_mcore
    from megatron_jf.models.gpt import build_model
    from megatron_jf.models.hf_config import ModelArgs
    from megatron_jf.models.zoo import tiny_hf_model

    hf = tiny_hf_model("qwen2", seed=seed, layers=layers, **kw)
    args = ModelArgs.from_hf_dict(hf.config.to_dict())
    model = build_model(args)
    sd = hf_to_mcore(hf.state_dict(), args, tp_rank=ps.get_tensor_model_parallel_rank(),
                     tp_size=ps.get_tensor_model_parallel_world_size(),
                     pp_rank=ps.get_pipeline_model_parallel_rank(),
                     pp_size=ps.get_pipeline_model_parallel_world_size())
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not [k for k in missing if "extra_state" not in k] and not unexpected, (missing, unexpected)
    return model, args


def save_tiny_hf_config(path: str, **kw) -> str:
    """Write only the ``config.json`` of a tiny Qwen2 into ``path`` (for from-scratch training)."""
    from megatron_jf.models.zoo import tiny_hf_config

    os.makedirs(path, exist_ok=True)
    tiny_hf_config("qwen2", **kw).save_pretrained(path)
    return path


def hf_weights_provider(hf_dir: str):
    """A ``model_provider`` for :class:`~megatron_jf.training.trainer.Trainer` that loads the HF weights
    of ``hf_dir`` into this rank's TP/PP shard (so every layout starts from identical weights)."""

    def provider(model_args, cfg):
        from megatron.core import parallel_state as ps
        from transformers import AutoModelForCausalLM

        from megatron_jf.models.convert import hf_to_mcore
        from megatron_jf.models.gpt import build_model

        model = build_model(model_args, recompute=cfg.recompute.kwargs())
        hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
        sd = hf_to_mcore(hf.state_dict(), model_args, tp_rank=ps.get_tensor_model_parallel_rank(),
                         tp_size=ps.get_tensor_model_parallel_world_size(),
                         pp_rank=ps.get_pipeline_model_parallel_rank(),
                         pp_size=ps.get_pipeline_model_parallel_world_size())
        missing, unexpected = model.load_state_dict(sd, strict=False)
        assert not [k for k in missing if "extra_state" not in k] and not unexpected, (missing, unexpected)
        return model

    return provider


#: Two training configurations exercised at every parallel layout: the default path, and the dense
#: path with the NC-IC mask and the reference code's loss settings.
PARALLEL_CONFIGS = {
    "two_stream_kl": dict(attention_path="two_stream", mask="nc", consistency_loss="kl"),
    "dense_ncic_ref": dict(attention_path="dense", mask="nc_ic", consistency_loss="soft_ce",
                           pc_normalization="reference", ar_weight=10.0),
}


def parallel_config(work: str, name: str, **over):
    """The TrainConfig of one parallel-equivalence run (3 steps, 2 samples per step, clipping active)."""
    from megatron_jf.training.config import TrainConfig

    kw = dict(hf_config=os.path.join(work, "hf"), data=[os.path.join(work, "train")], block_size=4, window_size=2,
              train_steps=3, micro_batch_size=1, global_batch_size=2, lr=2e-3, warmup_steps=0, clip_grad=0.05,
              log_interval=100, progress=False, threads=1, seed=7)
    kw.update(PARALLEL_CONFIGS[name])
    kw.update(over)
    return TrainConfig.from_flat(**kw)


def train_and_report(work: str, layout: str, name: str, **over) -> None:
    """Under torchrun: train :func:`parallel_config` ``(work, name, **over)`` from the HF weights of ``work`` and print
    ``RESULT {"layout", "loss", "grad_norm"}`` (JSON, per-step lists) on global rank 0."""
    import json
    from functools import partial

    import torch.distributed as dist

    import pretrain_jf
    from megatron_jf.training.trainer import Trainer

    cfg = parallel_config(work, name, **over)
    hist = Trainer(cfg, hf_weights_provider(os.path.join(work, "hf")), partial(pretrain_jf.forward_step, cfg=cfg),
                   pretrain_jf.train_valid_datasets_provider).train()
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({"layout": layout, "loss": [h["loss"] for h in hist],
                                      "grad_norm": [h["grad norm"] for h in hist]}), flush=True)


#: Activation-recomputation settings exercised by the recompute tests (Megatron-LM flag meanings).
RECOMPUTE_MODES = {
    "selective": dict(recompute_granularity="selective"),
    "selective_mlp": dict(recompute_granularity="selective", recompute_modules=["core_attn", "mlp"]),
    "full_uniform": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "full_block": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=2),
}


class SavedBytesMeter:
    """``torch.autograd.graph.saved_tensors_hooks`` that track the bytes of tensors autograd holds for the
    backward (parameters excluded: they are held anyway): ``live`` now and ``peak`` over the step."""

    def __init__(self, params):
        self.params = {p.untyped_storage().data_ptr() for p in params}
        self.live = 0
        self.peak = 0

    def pack(self, t):
        if t.untyped_storage().data_ptr() in self.params:
            return t
        import weakref

        n = t.untyped_storage().nbytes()
        box = _Saved(t)
        self.live += n
        self.peak = max(self.peak, self.live)
        weakref.finalize(box, self._free, n)  # autograd drops the box when the saved tensor is released
        return box

    def _free(self, n):
        self.live -= n

    @staticmethod
    def unpack(x):
        return x.t if isinstance(x, _Saved) else x


class _Saved:
    __slots__ = ("t", "__weakref__")

    def __init__(self, t):
        self.t = t


def measured_step(trainer):
    """One ``trainer.train_step()`` under a :class:`SavedBytesMeter`.

    Returns:
        ``(metrics, {param name: grad (cloned)}, peak saved activation bytes)``; the gradients are taken
        after the DP/TP synchronisation and clipping, i.e. what the optimizer used.
    """
    meter = SavedBytesMeter(trainer.module.parameters())
    with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
        m = trainer.train_step()
    grads = {n: p.grad.detach().clone() for n, p in trainer.module.named_parameters() if p.grad is not None}
    return m, grads, meter.peak


def print_results(rec: dict) -> None:
    """Print ``RESULT <json>`` for every rank's ``rec`` from rank 0 (collective: every rank calls it; one writer, so
    the lines of two ranks cannot interleave)."""
    import json

    import torch.distributed as dist

    recs = [None] * dist.get_world_size()
    dist.all_gather_object(recs, rec)
    if dist.get_rank() == 0:
        for r in recs:
            print("RESULT " + json.dumps(r), flush=True)
