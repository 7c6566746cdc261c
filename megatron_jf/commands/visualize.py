"""Render a Jacobi trajectory as HTML and PNG in the style of Jacobi Forcing Figure 4.

One row per Jacobi iteration (per block, in decoding order). Each token cell is coloured:

* **accepted** (green): the prefix of the iterate that already equals the fixed point (converged);
* **stationary** (yellow, highlighted): runs of >= ``--min-run`` (3) tokens after the first mismatch that already
  equal the fixed point at their positions but are not accepted yet (the "correct but not yet verified" spans the
  paper's Figure 4 highlights);
* **match** (grey): shorter such runs;
* **unconverged** (red): tokens that differ from the fixed point.

Sources::

    # a recorded trajectory from a webdataset shard (megatron_jf.data.read_shard)
    python tools/visualize_trajectory.py --shard data/traj-dp00000-000000.tar --index 0 --tokenizer tok/ --out viz/sample0
    # live: run the jacobi decoder with record_trajectory=True on a prompt
    python tools/visualize_trajectory.py --load ckpt/ --prompt "def fib(n):" --block-size 16 --out viz/fib

Writes ``{out}.html`` and ``{out}.png`` (atomically).
"""

from __future__ import annotations

import argparse
import os
import sys

from megatron_jf import cli
from megatron_jf.commands import InputError, run

NAME = "visualize_trajectory"



def build_parser() -> argparse.ArgumentParser:
    """The command-line parser (block size and draft initialisation are the decoder flags every tool shares)."""
    p = cli.parser(__doc__)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--shard", help="webdataset shard (.tar) of trajectory records")
    cli.add_load_arg(src, required=False, help="checkpoint to run live (the jacobi decoder)")
    p.add_argument("--index", type=int, default=0, help="record index in the shard")
    p.add_argument("--sample-id", help="record sample id in the shard (overrides --index)")
    cli.PROMPT.add(p, help="prompt text (live)")
    cli.CHAT.add(p, help="wrap the prompt in the chat template (live)")
    g = cli.add_decode_args(p, title="Jacobi decoding (live)", fields=("block_size", "draft_init"))
    cli.add_max_new_tokens_arg(g)
    cli.TOKENIZER.add(p, help="tokenizer for token text (default: the checkpoint's when live; none: token ids)")
    p.add_argument("--min-run", type=int, default=3, help="shortest run of fixed-point tokens after the first "
                   "mismatch that is highlighted as stationary")
    p.add_argument("--max-png-rows", type=int, default=200, help="most iteration rows drawn in the PNG")
    cli.OUT.add(p, required=True, help="output prefix (writes PREFIX.html and PREFIX.png)")
    cli.add_threads_arg(p)
    cli.add_inference_args(p)
    return p


def main(argv=None) -> int:
    """``tools/visualize_trajectory.py`` / ``jf visualize``; returns the exit status (0, or 2 on bad input:
    :mod:`megatron_jf.commands`)."""
    a, status = cli.parse_or_status(build_parser(), argv)
    if a is None:
        return status
    from megatron_jf.eval.harness import HarnessError

    return run(NAME, lambda: _visualize(a), (ValueError, HarnessError))


def _visualize(a) -> int:
    cli.set_threads(a.threads)
    from megatron_jf.eval.trajectory_view import blocks_from_record, live_trajectory, visualize

    if a.shard:
        from megatron_jf.data import read_shard

        if not os.path.isfile(a.shard):
            raise InputError(f"shard does not exist: {a.shard}")
        recs = read_shard(a.shard)
        if a.sample_id is not None:
            match = [r for r in recs if r.sample_id == a.sample_id]
            if not match:
                raise InputError(f"no record with sample id {a.sample_id!r} in {a.shard}")
            rec = match[0]
        else:
            if not 0 <= a.index < len(recs):
                raise InputError(f"--index {a.index} out of range: {a.shard} has {len(recs)} record(s)")
            rec = recs[a.index]
        tok = None
        if a.tokenizer:
            from megatron_jf.tokenizer import load_tokenizer

            tok = load_tokenizer(a.tokenizer)
        blocks, title, ptext = blocks_from_record(rec), f"{rec.sample_id} (n={rec.block_size})", None
        if tok is not None:
            ptext = tok.decode(rec.prompt_ids.tolist(), skip_special_tokens=False)
    else:
        if not a.prompt:
            raise InputError("--load needs --prompt")
        from megatron_jf.load_errors import check_load_dir

        check_load_dir(a.load)
        blocks, tok, ptext, res = live_trajectory(a.load, a.prompt, block_size=a.block_size,
                                                  max_new_tokens=a.max_new_tokens, chat=a.chat,
                                                  tokenizer=a.tokenizer, draft_init=a.draft_init,
                                                  options=cli.inference_options(a))
        title = f"live jacobi n={a.block_size}: {len(res.tokens)} tokens in {res.forwards} forwards"
    info = visualize(blocks, a.out, tokenizer=tok, min_run=a.min_run, title=title, prompt_text=ptext,
                     max_png_rows=a.max_png_rows)
    print(f"wrote {info['html']} and {info['png']}: {info['rows']} iteration rows, labels {info['label_counts']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
