"""The n-gram pool of rejection recycling (paper Sec. 3.2, "MR" decoding).

Draft tokens that verification rejects are often right but misplaced: the same n-gram turns up a
few positions later. The pool keeps n-grams cut from rejected drafts, keyed by their first token and
remembering the token before them. After each verification the newest known token ``x`` (and the
committed token before it) selects candidates: n-grams starting with ``x``, those whose recorded
preceding token also matches the committed text first (a two-token suffix match), newest first.
The pool persists across blocks for the whole request.
"""

from __future__ import annotations

from collections import OrderedDict


class NGramPool:
    """Bounded LRU pool of n-grams keyed by first token.

    Args:
        ngram_len: tokens stored per entry (the candidate draft length; longer candidates are cut).
        max_per_key: entries kept per first token (oldest evicted).
        max_keys: distinct first tokens kept (least recently used evicted).

    Raises:
        ValueError: a non-positive size.
    """

    def __init__(self, ngram_len: int, max_per_key: int = 8, max_keys: int = 4096):
        if ngram_len < 1 or max_per_key < 1 or max_keys < 1:
            raise ValueError("NGramPool sizes must be >= 1")
        self.ngram_len = ngram_len
        self.max_per_key = max_per_key
        self.max_keys = max_keys
        self._pool: OrderedDict[int, OrderedDict[tuple, int]] = OrderedDict()

    def __len__(self) -> int:
        return sum(len(v) for v in self._pool.values())

    def add_rejected(self, prev_token: int, tokens: list[int], stride: int = 1) -> None:
        """Add the n-grams of a rejected draft segment ``tokens`` (cut every ``stride`` positions).

        ``prev_token`` is the token that preceded ``tokens[0]`` in the draft (the suffix-match key).
        """
        n = len(tokens)
        for i in range(0, n - 1, stride):
            gram = tuple(tokens[i:i + self.ngram_len])
            if len(gram) < 2:
                break
            before = prev_token if i == 0 else tokens[i - 1]
            key = gram[0]
            entries = self._pool.get(key)
            if entries is None:
                entries = self._pool[key] = OrderedDict()
                if len(self._pool) > self.max_keys:
                    self._pool.popitem(last=False)
            else:
                self._pool.move_to_end(key)
            entries.pop(gram, None)
            entries[gram] = before
            if len(entries) > self.max_per_key:
                entries.popitem(last=False)

    def candidates(self, prev_token: int, token: int, k: int, exclude: tuple | None = None) -> list[list[int]]:
        """Up to ``k`` continuations starting with ``token`` (without ``token`` itself), best first.

        Entries whose recorded preceding token equals ``prev_token`` come first; then newest first.
        ``exclude`` drops a continuation equal to the primary draft.
        """
        entries = self._pool.get(token)
        if not entries or k <= 0:
            return []
        grams = list(entries.items())[::-1]
        grams.sort(key=lambda kv: kv[1] != prev_token)  # stable: suffix matches first, newest first
        out, seen = [], set()
        for gram, _ in grams:
            cont = gram[1:]
            if not cont or cont in seen or (exclude is not None and cont == exclude[:len(cont)]):
                continue
            seen.add(cont)
            out.append(list(cont))
            if len(out) == k:
                break
        return out
