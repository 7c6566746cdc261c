#!/usr/bin/env python
"""Convert checkpoints between Hugging Face (Qwen2/Qwen2.5, Llama) and megatron-core.

HF -> megatron-core distributed checkpoint at a target TP/PP (re-launches itself under torchrun
with tp*pp ranks when needed; the result also loads at any other layout)::

    python tools/convert_hf.py hf-to-mcore --hf /models/Qwen2.5-7B-Instruct --out ckpt/qwen7b --tp 4 --pp 2

megatron-core -> HF directory (safetensors, config, generation config with every stop token, tokenizer)::

    python tools/convert_hf.py mcore-to-hf --load ckpt/qwen7b --out /models/qwen7b-jf

Errors name the problem: missing config.json, unsupported architectures, tensor shape mismatches,
a TP size that does not divide the heads, an output directory that exists (without ``--overwrite``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args(argv=None):
    """Parse the two sub-commands and their flags."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("hf-to-mcore", help="HF directory -> megatron-core distributed checkpoint")
    a.add_argument("--hf", required=True, help="HF checkpoint directory (config.json + safetensors + tokenizer)")
    a.add_argument("--out", required=True, help="output megatron checkpoint directory")
    a.add_argument("--tp", type=int, default=1, help="target tensor-parallel size")
    a.add_argument("--pp", type=int, default=1, help="target pipeline-parallel size")
    a.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    b = sub.add_parser("mcore-to-hf", help="megatron-core checkpoint -> HF directory")
    b.add_argument("--load", required=True, help="megatron checkpoint directory")
    b.add_argument("--iteration", type=int, default=None, help="iteration to export (default: latest)")
    b.add_argument("--out", required=True, help="output HF directory")
    b.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    return p.parse_args(argv)


def hf_to_mcore_cmd(args) -> None:
    """HF directory -> megatron-core distributed checkpoint at ``--tp``/``--pp`` (one process per rank)."""
    import torch.distributed as dist

    from megatron_jf import parallel
    from megatron_jf.checkpointing import save_checkpoint
    from megatron_jf.hf_io import load_hf_state_dict, read_model_args
    from megatron_jf.models.convert import hf_to_mcore, uses_fused_norms

    margs = read_model_args(args.hf)  # fails on a missing/unsupported config before any work
    margs.validate_parallel(args.tp, args.pp)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1 and args.tp * args.pp > 1:  # re-launch with one process per model-parallel rank
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.tp * args.pp),
               os.path.abspath(__file__), *sys.argv[1:]]
        raise SystemExit(subprocess.call(cmd, env=dict(os.environ, OMP_NUM_THREADS="1")))
    if world != args.tp * args.pp:
        raise SystemExit(f"error: run with tp*pp = {args.tp * args.pp} ranks, got WORLD_SIZE={world}")
    if os.path.exists(args.out):
        if not args.overwrite:
            raise SystemExit(f"error: output directory {args.out} exists (pass --overwrite to replace it)")
    parallel.initialize(args.tp, args.pp)
    from megatron.core import parallel_state as ps

    from megatron_jf.models.gpt import build_model

    if parallel.is_rank0() and os.path.exists(args.out):
        shutil.rmtree(args.out)
    if dist.is_initialized():
        dist.barrier()
    hf = load_hf_state_dict(args.hf)
    model = build_model(margs)
    sd = hf_to_mcore(hf, margs, tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=args.tp,
                     pp_rank=ps.get_pipeline_model_parallel_rank(), pp_size=args.pp,
                     fused_norms=uses_fused_norms(model.state_dict()))  # TE spec: norms fused into linears
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise SystemExit(f"error: weight mapping mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    save_checkpoint(args.out, 0, model, tokenizer_dir=args.hf,
                    common={"source": os.path.abspath(args.hf), "converted_by": "tools/convert_hf.py"})
    if parallel.is_rank0():
        print(f"saved megatron checkpoint {args.out} (tp={args.tp}, pp={args.pp}, "
              f"{sum(v.numel() for v in hf.values()) / 1e6:.2f}M parameters, stop tokens {margs.eos_token_ids})")
    parallel.destroy()


def mcore_to_hf_cmd(args) -> None:
    """megatron-core checkpoint (any layout) -> HF directory, in one process."""
    from megatron_jf import parallel
    from megatron_jf.checkpointing import load_model, tokenizer_path
    from megatron_jf.hf_io import save_hf_checkpoint
    from megatron_jf.load_errors import reject_hf_dir
    from megatron_jf.models.convert import mcore_to_hf

    reject_hf_dir(args.load)
    if os.path.exists(args.out) and not args.overwrite:
        raise SystemExit(f"error: output directory {args.out} exists (pass --overwrite to replace it)")
    parallel.initialize(1, 1)
    model, margs, meta = load_model(args.load, iteration=args.iteration)
    sd = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    hf = mcore_to_hf([[sd]], margs)
    save_hf_checkpoint(args.out, hf, margs, tokenizer_dir=tokenizer_path(args.load), overwrite=args.overwrite)
    print(f"saved HF checkpoint {args.out} from {args.load} iteration {meta['iteration']}")
    parallel.destroy()


def main(argv=None):
    """CLI entry point; known input errors exit with ``error: ...``."""
    args = parse_args(argv)
    try:
        if args.cmd == "hf-to-mcore":
            hf_to_mcore_cmd(args)
        else:
            mcore_to_hf_cmd(args)
    except (FileNotFoundError, ValueError, KeyError, FileExistsError) as e:
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main()
