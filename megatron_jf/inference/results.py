"""The one result type of a request, used by the engine, the server, the evaluator, the quickstart report and the
benches (paper Sec. 4.1: TPF, TPS)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class GenerationResult:
    """Output and metrics of one request.

    Attributes:
        tokens: emitted token ids (EOS included when it ended the output). With a stop string: the tokens
            whose text lies entirely before its first occurrence.
        finish_reason: ``eos``, ``stop`` (a stop string) or ``length``.
        tail_text: with a stop string, the text between ``detokenize(tokens)`` and the stop string (the
            start of a token that straddles it; usually ``""``). The output text is
            ``detokenize(tokens) + tail_text``.
        forwards: decode forward passes (prefill not counted).
        accepted: tokens emitted by each decode forward.
        prefill_s, decode_s: wall seconds.
        trajectory: per block (when recorded): ``{"context_len", "drafts": [[n tokens]...], "fixed_point"}``.
        draft_lens: per decode forward, draft tokens verified (the winning branch; 0 for AR, and for the steps
            ``draft_width="auto"`` ran as AR: the widths it chose).
        draft_accepted: per decode forward, how many of them were accepted and emitted (the leading ones;
            the correction/bonus token is not a draft token). Speculative-decoding counters in vLLM's
            sense: drafts = forwards with ``draft_lens > 0``.
        batch_size: rows in the engine step that finished the request.
        queue_s: seconds between a server's submit and the prefill (0 offline).
    """

    tokens: list[int]
    finish_reason: str
    forwards: int
    accepted: list[int]
    prefill_s: float
    decode_s: float
    prompt_len: int
    trajectory: list[dict] | None = None
    tail_text: str = ""
    draft_lens: list[int] = field(default_factory=list)
    draft_accepted: list[int] = field(default_factory=list)
    batch_size: int = 1
    queue_s: float = 0.0

    @property
    def tpf(self) -> float:
        """Tokens per forward: emitted tokens / decode forwards (after EOS truncation)."""
        return len(self.tokens) / max(self.forwards, 1)

    @property
    def tps(self) -> float:
        """Emitted tokens per second of decode time."""
        return len(self.tokens) / self.decode_s if self.decode_s > 0 else float("nan")
