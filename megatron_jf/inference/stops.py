"""Stop strings: where an output ends before the first occurrence of any of them, and how much of it can be
streamed before that is decided (a token can straddle a stop string's start; text that may still become one is
held back)."""

from __future__ import annotations


def find_stop(out: list[int], sent: int, stops: tuple[str, ...], detokenize) -> tuple[int | None, str, int]:
    """Stop-string search on ``text = detokenize(out)``.

    Returns ``(cut, tail, safe)``:

    * ``cut``: when ``text`` contains a stop string, the most tokens whose text is a prefix of
      ``text[:i]`` (``i``: the first index where any stop string starts), else ``None``;
    * ``tail``: the rest of ``text[:i]`` -- the part before the stop string of a token that straddles it;
    * ``safe``: without a stop, the most tokens that can be released (their text ends before any suffix of
      ``text`` that is a proper prefix of a stop string, i.e. could still become one), at least ``sent``.
    """
    text = detokenize(out)
    first = min((i for i in (text.find(s) for s in stops) if i >= 0), default=None)
    if first is not None:
        want = text[:first]
        c = max(prefix_tokens(out, want, 0, detokenize), sent)
        return c, want[len(detokenize(out[:c])):], c
    hold = len(text.rstrip("\ufffd"))  # an incomplete character may still complete to a stop string
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                hold = min(hold, len(text) - k)
                break
    if hold == len(text):
        return None, "", len(out)
    return None, "", prefix_tokens(out, text[:hold], sent, detokenize)


def prefix_tokens(out: list[int], want: str, lo: int, detokenize) -> int:
    """The largest ``c >= lo`` (``c <= len(out)``) with ``detokenize(out[:c])`` a prefix of ``want``
    (``lo`` itself when none is larger)."""
    for c in range(len(out), lo, -1):
        t = detokenize(out[:c])
        if want.startswith(t) and not (t.endswith("\ufffd") and not want[:len(t)].endswith("\ufffd")):
            return c
    return lo
