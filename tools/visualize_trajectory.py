#!/usr/bin/env python
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
import html
import os
import sys
from typing import Any, Callable, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_jf import cli  # noqa: E402  (light: torch is imported after parsing)

COLORS = {"accepted": "#7bd88f", "stationary": "#ffd54f", "match": "#c8c8c8", "unconverged": "#f28b82"}


def classify_state(draft: Sequence[int], fixed_point: Sequence[int], min_run: int = 3) -> list[str]:
    """Label every token of one Jacobi iterate against the block's fixed point (Figure 4 colours).

    Args:
        draft: the iterate, ``n_b`` token ids.
        fixed_point: the converged block, ``n_b`` token ids.
        min_run: minimum run length (tokens) of fixed-point matches after the first mismatch to count as
            ``"stationary"``.

    Returns:
        ``n_b`` labels in ``{"accepted", "stationary", "match", "unconverged"}``.

    Raises:
        ValueError: length mismatch or ``min_run < 1``.
    """
    if len(draft) != len(fixed_point):
        raise ValueError(f"draft has {len(draft)} tokens but the fixed point has {len(fixed_point)}")
    if min_run < 1:
        raise ValueError(f"min_run must be >= 1, got {min_run}")
    eq = [int(a) == int(b) for a, b in zip(draft, fixed_point)]
    k = 0
    while k < len(eq) and eq[k]:
        k += 1
    labels = ["accepted"] * k
    j = k
    while j < len(eq):
        if not eq[j]:
            labels.append("unconverged")
            j += 1
            continue
        e = j
        while e < len(eq) and eq[e]:
            e += 1
        labels += ["stationary" if e - j >= min_run else "match"] * (e - j)
        j = e
    return labels


def blocks_from_record(record) -> list[dict[str, Any]]:
    """Convert a :class:`megatron_jf.data.TrajectoryRecord` to ``[{"context_len", "drafts", "fixed_point"}]``
    with plain int lists."""
    return [{"context_len": int(b.context_len), "drafts": [list(map(int, d)) for d in b.drafts.tolist()],
             "fixed_point": list(map(int, b.fixed_point.tolist()))} for b in record.blocks]


def trajectory_rows(blocks: Sequence[dict], min_run: int = 3) -> list[dict[str, Any]]:
    """Flatten blocks into one row per iteration: ``{"block", "iteration", "tokens", "labels"}``.

    Raises:
        ValueError: a draft whose length differs from its block's fixed point.
    """
    rows = []
    for bi, b in enumerate(blocks):
        fp = b["fixed_point"]
        for it, d in enumerate(b["drafts"]):
            rows.append({"block": bi, "iteration": it, "tokens": list(d), "labels": classify_state(d, fp, min_run)})
    return rows


def _atomic_bytes(path: str, data: bytes) -> None:
    from megatron_jf.eval.harness import atomic_write_bytes

    atomic_write_bytes(path, data)


def _piece(tok_text: Callable[[int], str] | None, t: int) -> str:
    if tok_text is None:
        return str(t)
    s = tok_text(t)
    return s.replace("\n", "\u21b5").replace("\t", "\u21e5") if s else f"<{t}>"


def render_html(rows: Sequence[dict], *, title: str = "Jacobi trajectory", prompt_text: Optional[str] = None,
                token_text: Callable[[int], str] | None = None) -> str:
    """HTML page: a legend and one ``<tr class="iter">`` per iteration (cells ``<td class="tok LABEL">``)."""
    css = "".join(f".{k}{{background:{v}}}" for k, v in COLORS.items())
    out = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title><style>"
           "body{font-family:sans-serif} table{border-collapse:collapse} td{border:1px solid #fff;padding:2px 4px;"
           "font-family:monospace;white-space:pre} td.hdr{background:#eee;color:#333}" + css + "</style></head><body>",
           f"<h2>{html.escape(title)}</h2>"]
    if prompt_text is not None:
        out.append(f"<p><b>Prompt:</b> <code>{html.escape(prompt_text[-500:])}</code></p>")
    out.append("<p>" + " ".join(f"<span class='{k}' style='padding:2px 6px'>{k}</span>" for k in COLORS) + "</p>")
    out.append("<table>")
    for r in rows:
        cells = "".join(f"<td class='tok {lab}' title='id {t}'>{html.escape(_piece(token_text, t))}</td>"
                        for t, lab in zip(r["tokens"], r["labels"]))
        out.append(f"<tr class='iter' data-block='{r['block']}' data-iteration='{r['iteration']}'>"
                   f"<td class='hdr'>block {r['block']} · iter {r['iteration']}</td>{cells}</tr>")
    out.append("</table></body></html>")
    return "\n".join(out) + "\n"


def render_png(rows: Sequence[dict], path: str, *, token_text: Callable[[int], str] | None = None,
               max_rows: int = 200, title: str = "Jacobi trajectory") -> int:
    """Draw the rows as a coloured grid (matplotlib, Agg) and save a PNG atomically.

    Returns:
        The number of rows drawn (at most ``max_rows``; the rest are omitted from the image, not the HTML).
    """
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    rows = list(rows)[:max_rows]
    width = max((len(r["tokens"]) for r in rows), default=1)
    fig, ax = plt.subplots(figsize=(min(2 + 0.7 * width, 60), min(1 + 0.3 * max(len(rows), 1), 120)))
    for y, r in enumerate(rows):
        for x, (t, lab) in enumerate(zip(r["tokens"], r["labels"])):
            ax.add_patch(Rectangle((x, -y - 1), 0.95, 0.9, color=COLORS[lab]))
            ax.text(x + 0.47, -y - 0.55, _piece(token_text, t)[:6], ha="center", va="center", fontsize=6,
                    family="monospace")
    ax.set_xlim(0, width)
    ax.set_ylim(-max(len(rows), 1), 0)
    ax.set_yticks([-y - 0.55 for y in range(len(rows))])
    ax.set_yticklabels([f"b{r['block']} it{r['iteration']}" for r in rows], fontsize=6)
    ax.set_xticks([])
    ax.set_title(title, fontsize=9, pad=22)
    handles = [Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()]
    ax.legend(handles, list(COLORS), loc="upper right", fontsize=6, bbox_to_anchor=(1, 1.08), ncol=4)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    _atomic_bytes(path, buf.getvalue())
    return len(rows)


def live_trajectory(load: str, prompt: str, *, block_size: int = 16, max_new_tokens: int = 64, chat: bool = False,
                    tokenizer: Optional[str] = None, draft_init: str = "context", seed: int = 1234, options=None):
    """Run the ``jacobi`` decoder with ``record_trajectory=True`` on one prompt (``options``: the engine's
    :class:`~megatron_jf.inference.options.InferenceOptions`; None: every field auto).

    Returns:
        ``(blocks, tokenizer, prompt_text, GenerationResult)``.

    Raises:
        CheckpointNotFound / TokenizerNotFound (see :meth:`megatron_jf.inference.llm.LLM.from_checkpoint`).
    """
    from megatron_jf.eval.harness import decode_config_from
    from megatron_jf.inference.llm import LLM

    lm = LLM.from_checkpoint(load, tokenizer=tokenizer, seed=seed, options=options)
    text = lm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}]) if chat else prompt
    cfg = decode_config_from("jacobi", block_size=block_size, draft_init=draft_init)
    res = lm.generate([text], cfg, max_new_tokens=max_new_tokens, record_trajectory=True)[0]
    return res.trajectory, lm.tokenizer, text, res


def visualize(blocks: Sequence[dict], out_prefix: str, *, tokenizer=None, min_run: int = 3,
              title: str = "Jacobi trajectory", prompt_text: Optional[str] = None, max_png_rows: int = 200) -> dict:
    """Write ``{out_prefix}.html`` and ``{out_prefix}.png``; returns ``{"html", "png", "rows", "label_counts"}``."""
    rows = trajectory_rows(blocks, min_run)
    tt = (lambda t: tokenizer.decode([t], skip_special_tokens=False)) if tokenizer is not None else None
    html_path, png_path = out_prefix + ".html", out_prefix + ".png"
    _atomic_bytes(html_path, render_html(rows, title=title, prompt_text=prompt_text, token_text=tt).encode("utf-8"))
    render_png(rows, png_path, token_text=tt, max_rows=max_png_rows, title=title)
    counts: dict[str, int] = {}
    for r in rows:
        for lab in r["labels"]:
            counts[lab] = counts.get(lab, 0) + 1
    return {"html": html_path, "png": png_path, "rows": len(rows), "label_counts": counts}


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser (block size and draft initialisation are the decoder flags every tool shares)."""
    p = cli.parser(__doc__)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--shard", help="webdataset shard (.tar) of trajectory records")
    cli.add_load_arg(src, required=False, help="checkpoint to run live (the jacobi decoder)")
    p.add_argument("--index", type=int, default=0, help="record index in the shard")
    p.add_argument("--sample-id", help="record sample id in the shard (overrides --index)")
    p.add_argument("--prompt", help="prompt text (live)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template (live)")
    g = cli.add_decode_args(p, title="Jacobi decoding (live)", fields=("block_size", "draft_init"))
    cli.add_max_new_tokens_arg(g)
    p.add_argument(*cli.TOKENIZER_FLAGS, dest="tokenizer",
                   help="tokenizer for token text (default: the checkpoint's when live; none: token ids)")
    p.add_argument("--min-run", type=int, default=3, help="shortest run of fixed-point tokens after the first "
                   "mismatch that is highlighted as stationary")
    p.add_argument("--max-png-rows", type=int, default=200, help="most iteration rows drawn in the PNG")
    p.add_argument("--out", required=True, help="output prefix (writes PREFIX.html and PREFIX.png)")
    cli.add_inference_args(p)
    return p


def main(argv=None) -> int:
    """CLI entry point; returns 0, or 2 on bad input (message on stderr)."""
    a, status = cli.parse_or_status(build_parser(), argv)
    if a is None:
        return status
    from megatron_jf.eval.harness import CheckpointNotFound, HarnessError, TokenizerNotFound

    try:
        if a.shard:
            from megatron_jf.data import read_shard

            if not os.path.isfile(a.shard):
                raise FileNotFoundError(f"shard does not exist: {a.shard}")
            recs = read_shard(a.shard)
            if a.sample_id is not None:
                match = [r for r in recs if r.sample_id == a.sample_id]
                if not match:
                    raise ValueError(f"no record with sample id {a.sample_id!r} in {a.shard}")
                rec = match[0]
            else:
                if not 0 <= a.index < len(recs):
                    raise ValueError(f"--index {a.index} out of range: {a.shard} has {len(recs)} record(s)")
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
                raise ValueError("--load needs --prompt")
            from megatron_jf.load_errors import check_load_dir

            check_load_dir(a.load)
            blocks, tok, ptext, res = live_trajectory(a.load, a.prompt, block_size=a.block_size,
                                                      max_new_tokens=a.max_new_tokens, chat=a.chat,
                                                      tokenizer=a.tokenizer, draft_init=a.draft_init,
                                                      options=cli.inference_options(a))
            title = f"live jacobi n={a.block_size}: {len(res.tokens)} tokens in {res.forwards} forwards"
        info = visualize(blocks, a.out, tokenizer=tok, min_run=a.min_run, title=title, prompt_text=ptext,
                         max_png_rows=a.max_png_rows)
    except (FileNotFoundError, ValueError, HarnessError, CheckpointNotFound, TokenizerNotFound) as e:
        print(f"visualize_trajectory: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {info['html']} and {info['png']}: {info['rows']} iteration rows, labels {info['label_counts']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
