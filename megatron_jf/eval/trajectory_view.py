"""Jacobi trajectories drawn in the style of Jacobi Forcing Figure 4: one row per Jacobi iteration (per block, in
decoding order), each token cell coloured accepted / stationary / match / unconverged against the block's fixed point
(:func:`classify_state`), as HTML and PNG. The command is ``jf visualize`` (``tools/visualize_trajectory.py``,
:mod:`megatron_jf.commands.visualize`)."""

from __future__ import annotations

import html
from typing import Any, Callable, Optional, Sequence

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
    from megatron_jf.fileio import atomic_write_bytes

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
