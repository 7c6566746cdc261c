"""Convert checkpoints between Hugging Face (Qwen2/Qwen2.5, Llama) and megatron-core.

Both directions take ``--load IN --out OUT``; ``--hf`` always names the Hugging Face directory (the input of
hf-to-mcore, the output of mcore-to-hf), so the spellings of earlier versions keep working.

HF -> megatron-core distributed checkpoint at a target TP/PP (re-launches itself under torchrun
with tp*pp ranks when needed; the result also loads at any other layout, and in Megatron-LM)::

    python tools/convert_hf.py hf-to-mcore --load /models/Qwen2.5-7B-Instruct --out ckpt/qwen7b --tp 4 --pp 2

megatron-core checkpoint (this project's or Megatron-LM's, ``release`` included) -> HF directory as
``save_pretrained`` writes it (safetensors shards + index, config with dtype, the source's generation config
with every stop token, tokenizer)::

    python tools/convert_hf.py mcore-to-hf --load ckpt/qwen7b --out /models/qwen7b-jf --max-shard-size 5GB

The result is the same whichever layer spec (local or Transformer Engine) the model is built with.
Errors name the problem: missing config.json, unsupported architectures, tensor shape mismatches,
a TP size that does not divide the heads, an output directory that exists (without ``--overwrite``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

from megatron_jf import cli
from megatron_jf.commands import InputError, run

NAME = "convert_hf"
#: replace an existing output directory (both directions)
OVERWRITE = cli.Option("overwrite", ("--overwrite",), {"action": "store_true",
                                                       "help": "replace an existing output directory"})


def _shard_size(text: str) -> str:
    from megatron_jf.hf_io import parse_shard_size

    try:
        parse_shard_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def build_parser() -> argparse.ArgumentParser:
    """The two sub-commands and their flags (Megatron-LM and vLLM spellings accepted as aliases)."""
    from megatron_jf.hf_io import DEFAULT_MAX_SHARD_SIZE

    p = cli.parser(__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("hf-to-mcore", help="HF directory -> megatron-core distributed checkpoint",
                       formatter_class=cli.HelpFormatter, description=__doc__, allow_abbrev=False)
    cli.LOAD.add(a, aliases=("--hf",), required=True, metavar="HF_DIR",
                 help="input HF checkpoint directory: config.json + safetensors + tokenizer (required)")
    cli.OUT.add(a, aliases=("--save",), required=True, metavar="CKPT_DIR",
                help="output megatron checkpoint directory (required)")
    cli.TP.add(a, help="target tensor-parallel size")
    cli.PP.add(a, help="target pipeline-parallel size")
    OVERWRITE.add(a)
    b = sub.add_parser("mcore-to-hf", help="megatron-core checkpoint -> HF directory",
                       formatter_class=cli.HelpFormatter, description=__doc__, allow_abbrev=False)
    cli.add_load_arg(b, help="input megatron checkpoint directory, this project's or Megatron-LM's (required)")
    b.add_argument("--iteration", type=int, default=None,
                   help="iteration to export (default: the latest, as latest_checkpointed_iteration.txt names)")
    cli.OUT.add(b, aliases=("--hf",), required=True, metavar="HF_DIR", help="output HF directory (required)")
    b.add_argument("--max-shard-size", type=_shard_size, default=DEFAULT_MAX_SHARD_SIZE,
                   help="largest safetensors shard, as save_pretrained's max_shard_size: bytes or a number with "
                        "KB/MB/GB/TB (decimal units)")
    OVERWRITE.add(b)
    return p




def hf_to_mcore_cmd(args, argv: list[str]) -> int:
    """HF directory -> megatron-core distributed checkpoint at ``--tp``/``--pp`` (one process per rank; ``argv``:
    the command line, for the re-launch under torchrun). Returns the exit status."""
    import torch
    import torch.distributed as dist

    from megatron_jf import parallel
    from megatron_jf.checkpointing import save_checkpoint
    from megatron_jf.hf_io import load_hf_state_dict, read_model_args
    from megatron_jf.models.convert import hf_to_mcore, uses_fused_norms

    margs = read_model_args(args.load)  # fails on a missing/unsupported config before any work
    margs.validate_parallel(args.tp, args.pp)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1 and args.tp * args.pp > 1:  # re-launch with one process per model-parallel rank
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.tp * args.pp),
               "-m", __name__ if __name__ != "__main__" else "megatron_jf.commands.convert", *argv]
        return subprocess.call(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if world != args.tp * args.pp:
        raise InputError(f"run with tp*pp = {args.tp * args.pp} ranks, got WORLD_SIZE={world}")
    if os.path.exists(args.out):
        if not args.overwrite:
            raise InputError(f"output directory {args.out} exists (pass --overwrite to replace it)")
    parallel.initialize(args.tp, args.pp)
    from megatron.core import parallel_state as ps

    from megatron_jf.models.gpt import build_model

    if parallel.is_rank0() and os.path.exists(args.out):
        shutil.rmtree(args.out)
    if dist.is_initialized():
        dist.barrier()
    hf = load_hf_state_dict(args.load)
    dtypes = {v.dtype for v in hf.values() if v.is_floating_point()}
    # the source's dtype, not the platform default (bf16 on GPU), so the checkpoint is the same everywhere
    model = build_model(margs, params_dtype=dtypes.pop() if len(dtypes) == 1 else torch.float32)
    sd = hf_to_mcore(hf, margs, tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=args.tp,
                     pp_rank=ps.get_pipeline_model_parallel_rank(), pp_size=args.pp,
                     fused_norms=uses_fused_norms(model.state_dict()))  # TE spec: norms fused into linears
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise InputError(f"weight mapping mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    gen_path = os.path.join(args.load, "generation_config.json")
    gen = json.load(open(gen_path)) if os.path.isfile(gen_path) else None
    save_checkpoint(args.out, 0, model, tokenizer_dir=args.load,
                    common={"source": os.path.abspath(args.load), "generation_config": gen,
                            "converted_by": "tools/convert_hf.py"})
    if parallel.is_rank0():
        print(f"saved megatron checkpoint {args.out} (tp={args.tp}, pp={args.pp}, "
              f"{sum(v.numel() for v in hf.values()) / 1e6:.2f}M parameters, stop tokens {margs.eos_token_ids})")
    parallel.destroy()
    return 0


def mcore_to_hf_cmd(args) -> int:
    """megatron-core checkpoint (any layout) -> HF directory, in one process."""
    from megatron_jf import parallel
    from megatron_jf.checkpointing import load_model, stored_dtype, tokenizer_path
    from megatron_jf.hf_io import save_hf_checkpoint
    from megatron_jf.models.convert import mcore_to_hf

    if os.path.exists(args.out) and not args.overwrite:
        raise InputError(f"output directory {args.out} exists (pass --overwrite to replace it)")
    parallel.initialize(1, 1)
    # built in the stored dtype (not the platform default), so the export is the same on CPU and GPU
    dtype = stored_dtype(args.load, args.iteration)
    model, margs, meta = load_model(args.load, iteration=args.iteration, params_dtype=dtype)
    # one dtype throughout, as save_pretrained writes it (megatron's CPU norms are fp32 in a bf16 model)
    sd = {k: v.cpu().to(dtype) if v.is_floating_point() else v.cpu()
          for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    hf = mcore_to_hf([[sd]], margs)
    save_hf_checkpoint(args.out, hf, margs, tokenizer_dir=tokenizer_path(args.load), overwrite=args.overwrite,
                       max_shard_size=args.max_shard_size,
                       generation_source=meta.get("common", {}).get("generation_config"))
    print(f"saved HF checkpoint {args.out} from {args.load} iteration {meta['iteration']}")
    parallel.destroy()
    return 0


def main(argv=None) -> int:
    """``tools/convert_hf.py`` / ``jf convert``; returns the exit status (:mod:`megatron_jf.commands`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args, status = cli.parse_or_status(build_parser(), argv)
    if args is None:
        return status

    def body() -> int:
        if args.cmd == "mcore-to-hf":  # before torch is imported
            from megatron_jf.load_errors import check_load_dir

            check_load_dir(args.load)
            return mcore_to_hf_cmd(args)
        return hf_to_mcore_cmd(args, argv)

    return run(NAME, body, (ValueError, KeyError, FileExistsError))


if __name__ == "__main__":
    sys.exit(main())
